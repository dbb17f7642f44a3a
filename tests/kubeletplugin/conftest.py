"""Fixtures of the kubelet-plugin tests."""

from tests.plugin.conftest import sandbox

__all__ = ["sandbox"]
