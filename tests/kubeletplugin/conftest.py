"""Fixtures of the kubelet-plugin tests: the root conftest provides ``sandbox``."""
