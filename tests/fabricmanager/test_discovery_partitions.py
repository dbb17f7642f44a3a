"""GpuDevice.partitions from Fabric Manager at discovery: mock NVML module IDs + the FM stand-in's list, combined by
the pure ``with_partitions`` (what the app calls with the gate FabricManagerPartitioning on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dradriver.domain.fmpartitions import with_partitions
from dradriver.host.fabricmanager import FabricManagerClient
from dradriver.nvml import mock
from dradriver.nvml.discovery import discover
from dradriver.nvml.session import NvmlSession
from tests.nvml.mockenv import make_sysfs


def test_discovered_gpus_get_partition_ids_of_each_size_from_fabric_manager(
        mock_session: Callable[[str], NvmlSession], client: FabricManagerClient, tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    make_sysfs(sysfs, mock.load_profile("dgx-h100"))
    with mock_session("dgx-h100") as session:
        inventory = discover(session, sysfs_root=sysfs)
    out = with_partitions(inventory, client.partitions())
    by_minor = {g.minor: g for g in out.gpus}
    assert [by_minor[m].module_id for m in range(8)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert by_minor[0].partitions == {8: 0, 4: 1, 2: 3, 1: 7}
    assert by_minor[2].partitions == {8: 0, 4: 1, 2: 3, 1: 9}  # module 3 pairs with module 1
    assert by_minor[7].partitions == {8: 0, 4: 2, 2: 6, 1: 14}
