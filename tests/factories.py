"""Builders shared by the test folders: the one ``GpuDevice`` and ``MigDevice`` factory, bounded waits, and
edited copies of bundled mock NVML profiles. Fixtures that more than one folder uses are in ``tests/conftest.py``.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.passthrough import PciFunction, VfioDevice, vfio_devices
from dradriver.nvml import mock

GIB = 1 << 30
MIB = 1 << 20
WAIT_S = 20.0
"""Upper bound for anything the tests wait for (a hang fails instead of blocking; not a timing assertion)."""

DEVICE_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "gpu.nvidia.com"},
    "spec": {
        "selectors": [
            {
                "cel": {
                    "expression": "device.driver == 'gpu.nvidia.com' && "
                    "device.attributes['gpu.nvidia.com'].type == 'gpu'"
                }
            }
        ]
    },
}
"""NVIDIA's ``gpu.nvidia.com`` DeviceClass (full GPUs), as the sandboxed nodes serve it."""


def gpu_device(minor: int = 0, *, mig: bool = False, **fields: Any) -> GpuDevice:
    """A ``GpuDevice`` with NVML minor ``minor``: an A100-SXM4-40GB unless ``fields`` say otherwise.

    ``index`` defaults to ``minor``, ``uuid`` and ``pci_bus_id`` are derived from it; ``mig=True`` is a
    MIG-capable GPU in MIG mode. Any other ``GpuDevice`` field may be given (``cuda_compute_capability``,
    ``pcie_root``, ``numa_node``, ``mig_capable``, ``fabric``, ...).
    """
    values: dict[str, Any] = {
        "index": minor,
        "minor": minor,
        "uuid": f"GPU-00000000-0000-0000-0000-{minor:012x}",
        "product_name": "NVIDIA A100-SXM4-40GB",
        "brand": "Nvidia",
        "architecture": "Ampere",
        "cuda_compute_capability": (8, 0),
        "memory_bytes": 40 * GIB,
        "pci_bus_id": f"0000:{minor + 1:02x}:00.0",
    }
    if mig:
        values.update(mig_capable=True, mig_enabled=True)
    values.update(fields)
    return GpuDevice(**values)


def gpu_function(bus: int, *, driver: str | None = "nvidia", **fields: Any) -> PciFunction:
    """An H100-like NVIDIA 3D-controller function at ``0000:<bus>:00.0`` bound to ``driver``, alone in IOMMU
    group ``bus``, 128 GiB of BARs; any other ``PciFunction`` field may be given."""
    values: dict[str, Any] = {
        "address": f"0000:{bus:02x}:00.0", "vendor_id": 0x10DE, "device_id": 0x2330, "class_code": 0x030200,
        "driver": driver, "iommu_group": bus, "numa_node": 0, "bar_bytes": 128 * GIB,
        "pcie_root": f"pci0000:{bus - 1:02x}",
    }
    values.update(fields)
    return PciFunction(**values)


def vfio_for(*gpus: GpuDevice, iommufd: bool = False) -> tuple[VfioDevice, ...]:
    """The VFIO siblings of ``gpus`` (each on ``nvidia`` at its ``pci_bus_id``), as discovery builds them."""
    functions = [gpu_function(int(g.pci_bus_id.split(":")[1], 16), address=g.pci_bus_id) for g in gpus]
    return vfio_devices(functions, gpus, iommufd=iommufd)


def mig_device(parent: GpuDevice, start: int = 0, *, gi_id: int | None = None, **fields: Any) -> MigDevice:
    """A ``1g.5gb`` MIG device (GI profile 19, CI 0) at placement ``start`` of ``parent``.

    ``gi_id`` defaults to ``7 + start``; ``uuid`` is derived from the parent's minor and the GI ID. Any other
    ``MigDevice`` field may be given (``profile``, ``placement_size``, ``memory_bytes``, engine counts, ...).
    """
    gi = 7 + start if gi_id is None else gi_id
    values: dict[str, Any] = {
        "parent": parent,
        "uuid": f"MIG-00000000-0000-5000-8000-{parent.minor:04x}{gi:08x}",
        "profile": "1g.5gb",
        "gi_profile_id": 19,
        "ci_profile_id": 0,
        "gi_id": gi,
        "ci_id": 0,
        "placement_start": start,
        "placement_size": 1,
        "memory_bytes": 4864 * MIB,
        "multiprocessors": 14,
        "copy_engines": 1,
        "decoders": 0,
        "encoders": 0,
        "jpeg_engines": 0,
        "ofa_engines": 0,
    }
    values.update(fields)
    return MigDevice(**values)


def wait_until(predicate: Callable[[], bool], what: str = "condition", timeout: float = WAIT_S) -> None:
    """Return once ``predicate()`` is true; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


def write_profile(
    directory: Path, base: str, edit: Callable[[dict[str, Any]], None] | None = None, name: str = ""
) -> str:
    """Copy bundled mock NVML profile ``base``, apply ``edit`` to the parsed JSON, write it as
    ``<directory>/<name or base-edited>.json``; return the path."""
    data = copy.deepcopy(mock.load_profile(base))
    if edit is not None:
        edit(data)
    path = Path(directory) / f"{name or base + '-edited'}.json"
    path.write_text(json.dumps(data))
    return str(path)
