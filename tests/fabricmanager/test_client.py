"""``dradriver.host.fabricmanager``: the ctypes client over the mock ``libnvfm.so.1`` and the FM stand-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from dradriver.host.fabricmanager import (
    FabricManagerClient,
    FabricManagerError,
    FmAddress,
    address_from_environment,
    find_fm_library,
    has_nvswitch_fabric,
    open_client,
)
from dradriver.sandbox.standins.nv_fabricmanager import DROP, HANG, FabricManager, mock_library_path


def test_partitions_come_back_as_records_with_module_ids_and_active(client: FabricManagerClient,
                                                                    fm: FabricManager) -> None:
    parts = client.partitions()
    assert [p.partition_id for p in parts] == list(range(15))
    assert parts[0].module_ids == (1, 2, 3, 4, 5, 6, 7, 8) and parts[3].module_ids == (1, 3)
    assert parts[0].pci_bus_ids[0] == "00000000:18:00.0"
    assert not any(p.active for p in parts)
    client.activate(4)
    assert [p.partition_id for p in client.partitions() if p.active] == [4]


def test_every_operation_opens_a_fresh_connection(client: FabricManagerClient, fm: FabricManager) -> None:
    client.partitions()
    client.activate(7)
    client.deactivate(7)
    assert [c.split()[0] for c in fm.calls] == ["HELLO", "LIST", "HELLO", "ACTIVATE", "HELLO", "DEACTIVATE"]


def test_errors_name_the_operation_partition_and_code(client: FabricManagerClient, fm: FabricManager) -> None:
    client.activate(1)
    with pytest.raises(FabricManagerError, match=r"activate of partition 3 failed: FM_ST_IN_USE") as err:
        client.activate(3)
    assert (err.value.operation, err.value.partition_id, err.value.code) == ("activate", 3, -7)
    with pytest.raises(FabricManagerError, match=r"deactivate of partition 2 failed: FM_ST_UNINITIALIZED"):
        client.deactivate(2)
    with pytest.raises(FabricManagerError, match=r"activate of partition 42 failed: FM_ST_BADPARAM"):
        client.activate(42)
    fm.inject("list", -8)
    with pytest.raises(FabricManagerError, match=r"list partitions failed: FM_ST_NOT_CONFIGURED"):
        client.partitions()
    fm.inject("activate", DROP)
    with pytest.raises(FabricManagerError, match="FM_ST_CONNECTION_NOT_VALID"):
        client.activate(2)


def test_fm_down_is_connection_not_valid_naming_the_socket(client: FabricManagerClient, fm: FabricManager) -> None:
    fm.stop()
    with pytest.raises(FabricManagerError, match=r"activate: connect of partition 0 failed: "
                                                 r"FM_ST_CONNECTION_NOT_VALID \(Fabric Manager at .*/socket\)"):
        client.activate(0)
    fm.start()  # FM back: the next operation just connects again
    client.activate(0)


def test_address_socket_env_wins_over_tcp_and_default_is_under_the_driver_root(tmp_path: Path) -> None:
    root = tmp_path / "dr"
    assert address_from_environment(root, {}) == FmAddress(f"{root}/run/nvidia-fabricmanager/socket", unix=True)
    assert address_from_environment(root, {"NVIDIA_FABRICMANAGER_ADDRESS": "10.0.0.5:7000"}) == \
        FmAddress("10.0.0.5:7000", unix=False)
    assert address_from_environment(root, {"NVIDIA_FABRICMANAGER_ADDRESS": "10.0.0.5",
                                           "NVIDIA_FABRICMANAGER_UNIX_SOCKET": "/run/fm.sock"}) == \
        FmAddress("/run/fm.sock", unix=True)


def test_unix_socket_env_takes_effect(driver_root: Path, proc_root: Path, tmp_path: Path, fm: FabricManager) -> None:
    other = tmp_path / "elsewhere.sock"
    with FabricManager(other, list(fm.table.values())) as second:
        made = open_client(driver_root, proc_root=proc_root, environ={"NVIDIA_FABRICMANAGER_UNIX_SOCKET": str(other)})
        assert made is not None
        made.activate(5)
    assert second.active == {5} and fm.active == set()


def test_enabled_only_with_an_nvswitch_fabric_and_the_library(driver_root: Path, proc_root: Path,
                                                              tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    assert find_fm_library(driver_root) == driver_root / "usr" / "lib64" / "libnvfm.so.1"
    assert find_fm_library(tmp_path / "empty") is None
    assert has_nvswitch_fabric(proc_root, sysfs)
    empty_proc = tmp_path / "proc2"
    (empty_proc / "driver" / "nvidia-nvswitch" / "devices").mkdir(parents=True)
    assert not has_nvswitch_fabric(empty_proc, sysfs)
    assert open_client(driver_root, proc_root=empty_proc, sysfs_root=sysfs, environ={}) is None
    assert open_client(tmp_path / "empty", proc_root=proc_root, sysfs_root=sysfs, environ={}) is None
    vpd = sysfs / "class" / "infiniband" / "mlx5_0" / "device" / "vpd"
    vpd.parent.mkdir(parents=True)
    vpd.write_bytes(b"\x82\x10NVIDIA ConnectX\x90\x20PN:MCX;V3:SW_MNG\x78")  # NVLink 5 switch management VPD
    assert has_nvswitch_fabric(empty_proc, sysfs)
    assert isinstance(open_client(driver_root, proc_root=empty_proc, sysfs_root=sysfs, environ={}),
                      FabricManagerClient)


def test_an_fm_that_does_not_answer_within_the_timeout_is_fm_st_timeout(fm: FabricManager) -> None:
    client = FabricManagerClient(mock_library_path(), FmAddress(str(fm.socket_path)), timeout_ms=200)
    fm.inject("activate", HANG)
    with pytest.raises(FabricManagerError, match="activate of partition 1 failed: FM_ST_TIMEOUT"):
        client.activate(1)
    assert fm.active == set()


def test_an_address_longer_than_fm_connect_params_holds_is_badparam() -> None:
    client = FabricManagerClient(mock_library_path(), FmAddress("/" + "x" * 300))
    with pytest.raises(FabricManagerError, match="list partitions: connect failed: FM_ST_BADPARAM"):
        client.partitions()
