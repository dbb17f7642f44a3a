"""Fixtures for the mock NVML tests: the library loaded once by SONAME, pynvml sessions per profile.

The library is loaded with ``RTLD_GLOBAL`` before pynvml's first init, after which pynvml's own
``CDLL("libnvidia-ml.so.1")`` resolves to it: the same path production code takes on a GPU node.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dradriver.nvml import mock
from tests import factories


@pytest.fixture(scope="session")
def lib() -> ctypes.CDLL:
    """The mock library, loaded globally; also used directly through ctypes for return-code checks."""
    handle = ctypes.CDLL(str(mock.library_path()), mode=ctypes.RTLD_GLOBAL)
    handle.mocknvml_inject_event.argtypes = [
        ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_uint,
    ]
    handle.mocknvml_set_ecc.argtypes = [ctypes.c_uint, ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong]
    handle.mocknvml_control.argtypes = [ctypes.c_char_p]
    handle.mocknvml_set_lost.argtypes = [ctypes.c_uint, ctypes.c_int]
    return handle


def _shutdown_all() -> None:
    while True:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            return


@pytest.fixture
def nvml(lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str | Path], Any]]:
    """``nvml(profile)`` points the mock at a bundled profile name or a file and runs ``pynvml.nvmlInit``."""
    monkeypatch.delenv(mock.CONTROL_ENV, raising=False)
    _shutdown_all()

    def start(profile: str | Path) -> Any:
        monkeypatch.setenv(mock.PROFILE_ENV, str(mock.profile_path(str(profile))))
        pynvml.nvmlInit()
        return pynvml

    yield start
    _shutdown_all()


@pytest.fixture
def write_profile(tmp_path: Path) -> Callable[..., Path]:
    """``write_profile(base, edit)``: copy a bundled profile, apply ``edit(dict)`` and return the new file."""
    counter = [0]

    def write(base: str, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
        counter[0] += 1
        return Path(factories.write_profile(tmp_path, base, edit, name=f"profile-{counter[0]}"))

    return write
