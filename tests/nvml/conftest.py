"""Fixtures: an NVML session over the C mock library with a chosen profile, closed after the test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dradriver.nvml.session import NvmlSession


@pytest.fixture
def nvml(mock_session: Callable[[str], NvmlSession]) -> Callable[[str], NvmlSession]:
    """Factory ``nvml(profile_name_or_path)`` -> open session; every session it made is closed afterwards."""
    return mock_session


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """An empty directory to build a sysfs fixture tree in."""
    root = tmp_path / "sys"
    root.mkdir()
    return root
