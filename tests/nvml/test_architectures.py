"""Architectures NVML reports, through the C mock: Rubin (13), and a code newer than this driver knows.

NVIDIA's driver stopped enumerating a whole node on Rubin's code 13 (kubernetes-sigs/dra-driver-nvidia-gpu#1462:
go-nvlib's ``GetArchitectureAsString`` errors on a code outside its switch). Here Rubin is published by name, and
a code outside the table is published as ``Unknown`` with one warning, the rest of the GPU's attributes intact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.pools import build_resource_slices
from dradriver.nvml import mock
from dradriver.nvml.discovery import discover
from dradriver.nvml.session import NvmlSession
from tests.domain.slice_validation import assert_valid_slice
from tests.factories import write_profile
from tests.nvml.mockenv import make_sysfs

Session = Callable[[str], NvmlSession]


def published_devices(inv: Any) -> dict[str, dict[str, Any]]:
    """Every device of the node's ResourceSlices by name, each slice validated (schema and API limits)."""
    slices = build_resource_slices(inv, "node-a")
    for s in slices:
        assert_valid_slice(s)
    return {d["name"]: d for s in slices for d in s["spec"]["devices"]}


def test_rubin_gpus_publish_their_architecture_and_compute_capability(
    nvml: Session, sysfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_sysfs(sysfs, mock.load_profile("vr200-node"))
    with caplog.at_level(logging.WARNING, logger="dradriver.nvml.discovery"):
        inv = discover(nvml("vr200-node"), sysfs_root=sysfs)
    assert inv.failures == () and inv.warnings == () and caplog.records == []
    devices = published_devices(inv)
    # minors 0, 3, 1, 2 in NVML index order; one PCI domain per Vera superchip
    expected = {"gpu-0": "0002:81:00.0", "gpu-3": "0002:c1:00.0", "gpu-1": "000a:81:00.0", "gpu-2": "000a:e1:00.0"}
    assert sorted(devices) == sorted(expected)
    for name, bus_id in expected.items():
        attributes = devices[name]["attributes"]
        assert attributes["architecture"] == {"string": "Rubin"}
        assert attributes["cudaComputeCapability"] == {"version": "10.7.0"}
        assert attributes["productName"] == {"string": "NVIDIA Graphics Device"}
        assert attributes["driverVersion"] == {"version": "615.23.0"}
        assert attributes["cudaDriverVersion"] == {"version": "13.4.0"}
        assert attributes["resource.kubernetes.io/pciBusID"] == {"string": bus_id}
        assert attributes["resource.kubernetes.io/pcieRoot"]["string"].startswith(f"pci{bus_id[:4]}:")
        assert attributes["resource.kubernetes.io/numaNode"] == {"int": 0 if bus_id.startswith("0002") else 1}
        assert devices[name]["capacity"]["memory"] == {"value": "286524Mi"}
    assert inv.clique is not None and inv.clique.id == "00000000-0000-0000-0000-000000000001.32766"


@pytest.mark.parametrize("code", [99, 0x7FFFFFFF])
def test_an_unknown_architecture_is_published_as_unknown_with_one_warning(
    nvml: Session, sysfs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    path = write_profile(tmp_path, "dgx-h100", lambda d: d["gpus"][2].update(architecture=code), "future")
    make_sysfs(sysfs, mock.load_profile(path))
    with caplog.at_level(logging.WARNING, logger="dradriver.nvml.discovery"):
        inv = discover(nvml(path), sysfs_root=sysfs)
    assert inv.failures == () and len(inv.gpus) == 8
    future = inv.gpus[2]
    assert future.architecture == "Unknown"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"architecture code {code}" in warning and "GPU index 2" in warning and future.uuid in warning
    assert inv.warnings == (warning,)
    devices = published_devices(inv)
    assert len(devices) == 8
    attributes = devices[future.name]["attributes"]
    assert attributes["architecture"] == {"string": "Unknown"}
    assert attributes["cudaComputeCapability"] == {"version": "9.0.0"}  # still NVML's own compute capability
    assert attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert all(d["attributes"]["architecture"] == {"string": "Hopper"} for n, d in devices.items() if n != future.name)
