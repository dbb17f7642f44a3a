"""Fixtures for the CDI tests: both renderer implementations, fixture ``/proc`` files, DGX-like devices."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

from dradriver._native import cdispec_py
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.host.devicenodes import DeviceNodeInfo
from tests.factories import gpu_device, mig_device

PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
195 nvidia-frontend
195 nvidia
195 nvidiactl
234 nvidia-caps-imex-channels
237 nvidia-caps
510 nvidia-uvm
511 nvidia-nvswitch

Block devices:
  7 loop
 99 nvidia-uvm
"""

CLAIM_UID = "6c6ae1b3-1c6e-4a3b-9d0f-2b1f1c1f0a11"
LETTER_UID = "a9e1a2b3-1c6e-4a3b-9d0f-2b1f1c1f0a11"


def compiled() -> ModuleType:
    """Return the compiled renderer (fails the test if it was not built)."""
    from dradriver._native import cdispec

    return cdispec


@pytest.fixture(params=["c", "py"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """Return each renderer implementation in turn (ids ``c`` / ``py``)."""
    if request.param == "py":
        return cdispec_py
    if os.environ.get("DRADRIVER_NO_EXTENSIONS") == "1":
        pytest.skip("DRADRIVER_NO_EXTENSIONS=1 selects the pure-Python twin only")
    return compiled()


@pytest.fixture
def node_info(tmp_path: Path) -> DeviceNodeInfo:
    """Return a resolver over fixture files: ``/proc/devices`` and mig-minors, an empty dev root."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "devices").write_text(PROC_DEVICES)
    minors = ["config 1", "monitor 2"]
    for gpu in range(8):
        for gi in range(15):
            minors.append(f"gpu{gpu}/gi{gi}/access {3 + 135 * gpu + 9 * gi}")
            minors.extend(f"gpu{gpu}/gi{gi}/ci{ci}/access {4 + 135 * gpu + 9 * gi + ci}" for ci in range(8))
    (proc / "mig-minors").write_text("\n".join(minors) + "\n")
    dev = tmp_path / "devroot"
    dev.mkdir()
    return DeviceNodeInfo(
        dev_root=dev,
        proc_devices=proc / "devices",
        mig_minors=proc / "mig-minors",
        capabilities_dir=proc / "capabilities",
    )


def make_gpu(minor: int, *, mig: bool = False) -> GpuDevice:
    """Return an A100-SXM4-40GB like ``dgx-a100`` reports it, with NVML minor ``minor``."""
    return gpu_device(
        minor,
        uuid=f"GPU-e86cb44c-6756-fd30-cd4a-1e6da3caf9b{minor}",
        pci_bus_id=f"0000:{0x07 + 0x10 * minor:02x}:00.0",
        mig_capable=True,
        mig_enabled=mig,
    )


def make_migs(parent: GpuDevice) -> list[MigDevice]:
    """Return seven ``1g.5gb`` MIG devices (GI IDs 7-13, CI 0) filling ``parent`` (A100-40GB, gpu-facts.md 2.4)."""
    return [
        mig_device(parent, start, uuid=f"MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb{parent.minor}{start}")
        for start in range(7)
    ]
