"""GB200 NVL72 rack profiles: one tray's view per process, one cluster UUID and clique per rack (gpu-facts 4.1-4.2)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dradriver.nvml import mock

RACK_A = ("abc9829a-d4c8-491c-8da5-ad28fb34876b", 2)


def _fabric(pynvml: Any, index: int) -> Any:
    info = pynvml.c_nvmlGpuFabricInfo_t()
    pynvml.nvmlDeviceGetGpuFabricInfo(pynvml.nvmlDeviceGetHandleByIndex(index), ctypes.byref(info))
    return info


def _identities(pynvml: Any) -> list[tuple[str, str, str]]:
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out.append((pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetSerial(h), pynvml.nvmlDeviceGetPciInfo(h).busId))
    return out


def test_each_rack_lists_eighteen_trays_of_four_distinct_gpus() -> None:
    seen: set[str] = set()
    for rack in ("gb200-nvl72-rack-a", "gb200-nvl72-rack-b"):
        seen = {s for s in seen if not s.startswith("pciBusId=")}  # bus IDs repeat on other machines, not in one rack
        trays = mock.load_profile(rack)["rack"]["trays"]
        assert len(trays) == mock.RACK_TRAYS == 18
        for tray in trays:
            assert len(tray) == 4
            for gpu in tray:
                for key in ("uuid", "serial", "pciBusId"):
                    assert f"{key}={gpu[key]}" not in seen
                    seen.add(f"{key}={gpu[key]}")
    assert len(seen) == (2 * 2 + 1) * 18 * 4


def test_a_tray_view_serves_that_trays_gpus_and_the_racks_clique(
        nvml: Callable[[str | Path], Any], tmp_path: Path) -> None:
    expected = mock.load_profile("gb200-nvl72-rack-a")["rack"]["trays"][5]
    pynvml = nvml(mock.rack_node_profile("gb200-nvl72-rack-a", 5, tmp_path))
    assert _identities(pynvml) == [(g["uuid"], g["serial"], g["pciBusId"]) for g in expected]
    for index in range(4):
        info = _fabric(pynvml, index)
        assert bytes(info.clusterUuid) == bytes.fromhex(RACK_A[0].replace("-", ""))
        assert (info.cliqueId, info.state, info.status) == (RACK_A[1], mock.FABRIC_STATE_COMPLETED, 0)


def test_the_two_racks_are_different_cliques(nvml: Callable[[str | Path], Any], tmp_path: Path) -> None:
    pynvml = nvml(mock.rack_node_profile("gb200-nvl72-rack-b", 17, tmp_path))
    info = _fabric(pynvml, 0)
    assert bytes(info.clusterUuid) != bytes.fromhex(RACK_A[0].replace("-", "")) and info.cliqueId != RACK_A[1]
    assert info.state == mock.FABRIC_STATE_COMPLETED


def test_fabric_state_and_status_can_be_replaced_per_tray(nvml: Callable[[str | Path], Any], tmp_path: Path) -> None:
    path = mock.rack_node_profile("gb200-nvl72-rack-a", 1, tmp_path, fabric_state=mock.FABRIC_STATE_IN_PROGRESS)
    info = _fabric(nvml(path), 3)
    assert info.state == mock.FABRIC_STATE_IN_PROGRESS
    assert (info.cliqueId, bytes(info.clusterUuid)) == (0, bytes(16))  # assigned once the registration completes


def test_a_gpu_that_finishes_registering_reports_its_cluster_and_clique(
        nvml: Callable[[str | Path], Any], tmp_path: Path) -> None:
    path = mock.rack_node_profile("gb200-nvl72-rack-a", 1, tmp_path, fabric_state=mock.FABRIC_STATE_IN_PROGRESS)
    pynvml = nvml(path)
    assert (_fabric(pynvml, 0).cliqueId, bytes(_fabric(pynvml, 0).clusterUuid)) == (0, bytes(16))
    lib = ctypes.CDLL(str(mock.library_path()))
    assert lib.mocknvml_control(b"set 0 fabric.state 3") == 0  # what the fabric manager does at run time
    info = _fabric(pynvml, 0)
    assert bytes(info.clusterUuid) == bytes.fromhex(RACK_A[0].replace("-", ""))
    assert (info.cliqueId, info.state) == (RACK_A[1], mock.FABRIC_STATE_COMPLETED)


@pytest.mark.parametrize(("name", "state", "status"), [
    ("gb200-nvl72-fabric-in-progress", 2, 0), ("gb200-nvl72-fabric-failed", 3, 999)])
def test_bundled_fabric_variants(nvml: Callable[[str | Path], Any], name: str, state: int, status: int) -> None:
    pynvml = nvml(name)
    for index in range(4):
        info = _fabric(pynvml, index)
        assert (info.state, info.status, info.cliqueId) == (state, status, RACK_A[1] if state == 3 else 0)


def test_rack_node_profile_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(mock.MockNvmlError, match="not a rack profile"):
        mock.rack_node_profile("gb200-nvl72-node", 0, tmp_path)
    with pytest.raises(mock.MockNvmlError, match=r"trays 0\.\.17, not 18"):
        mock.rack_node_profile("gb200-nvl72-rack-a", 18, tmp_path)
