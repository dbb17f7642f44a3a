"""The plugin end-to-end fixtures (``sandbox``) for the opaque-config tests."""

from tests.plugin.conftest import sandbox

__all__ = ["sandbox"]
