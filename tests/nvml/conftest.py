"""Fixtures: an NVML session over the C mock library with a chosen profile, closed after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dradriver.nvml.session import NvmlSession, open_session


@pytest.fixture
def nvml() -> Iterator[Callable[[str], NvmlSession]]:
    """Factory ``nvml(profile_name_or_path)`` -> open session; every session it made is closed afterwards."""
    opened: list[NvmlSession] = []

    def start(profile: str) -> NvmlSession:
        session = open_session(mock_profile=profile)
        opened.append(session)
        return session

    yield start
    for session in reversed(opened):
        session.close()


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """An empty directory to build a sysfs fixture tree in."""
    root = tmp_path / "sys"
    root.mkdir()
    return root
