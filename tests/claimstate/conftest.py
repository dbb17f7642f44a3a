"""Fixtures of the claim-state tests: both native implementations, a boot ID file, and a store factory."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dradriver import _native
from dradriver.host.claimstate import ClaimState, HeldDevice

BOOT_ID = "d95dacd9-6a44-4f58-a9c9-ced799e1caa1"

_IMPLS = [pytest.param("py", id="py")]
if _native.use_extensions():
    _IMPLS.insert(0, pytest.param("c", id="c", marks=pytest.mark.native))


def backend_module(tag: str) -> ModuleType:
    """Return the compiled (``c``) or twin (``py``) claimstore module."""
    return importlib.import_module("dradriver._native.claimstore" + ("_py" if tag == "py" else ""))


@pytest.fixture(params=_IMPLS)
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """Return one claimstore implementation (parametrized: ``c`` where built, and ``py``)."""
    return backend_module(request.param)


@pytest.fixture
def boot_id_file(tmp_path: Path) -> Path:
    """Return a boot ID file holding :data:`BOOT_ID`."""
    path = tmp_path / "boot_id"
    path.write_text(BOOT_ID + "\n")
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """Return an empty plugin directory."""
    path = tmp_path / "plugin"
    path.mkdir()
    return path


@pytest.fixture
def open_state(impl: ModuleType, state_dir: Path, boot_id_file: Path) -> Iterator[Callable[..., ClaimState]]:
    """Return a factory opening the store in ``state_dir`` with the parametrized implementation."""
    opened: list[ClaimState] = []

    def _open(**kwargs: Any) -> ClaimState:
        kwargs.setdefault("boot_id_path", boot_id_file)
        kwargs.setdefault("backend", impl)
        state = ClaimState.open(state_dir / "claims.state", **kwargs)
        opened.append(state)
        return state

    yield _open
    for state in opened:
        state.close()


def gpu(index: int, *, pool: str = "node-a", admin: bool = False, uid: str = "") -> HeldDevice:
    """Return a held full-GPU device ``gpu-<index>`` with its CDI device ID."""
    return HeldDevice(
        request_names=("gpu",),
        pool=pool,
        device=f"gpu-{index}",
        cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={uid or 'x'}-gpu-{index}",),
        admin_access=admin,
    )
