"""The mock ``libnvfm.so.1`` (``ext/mocknvfm``) against the Fabric Manager stand-in, called raw through ctypes.

Struct layouts and sizes are written here from ``nv_fm_types.h`` (NVIDIA's libnvfm-dev; e.g.
github.com/pexip/os-nvidia-fabricmanager ``include/nv_fm_types.h``), not taken from the product's client, so a
layout mistake in either shows. Return codes: ``nv_fm_agent.h``.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.nvml import mock
from dradriver.sandbox.standins.nv_fabricmanager import (
    DROP,
    FabricManager,
    control,
    mock_library_path,
    table_from_profile,
)

SUCCESS, BADPARAM, GENERIC, UNINIT, VERSION, IN_USE, NOT_CONFIGURED, NOT_VALID = 0, -1, -2, -4, -6, -7, -8, -9


class ConnectParams(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("addressInfo", ctypes.c_char * 256), ("timeoutMs", ctypes.c_uint),
                ("addressIsUnixSocket", ctypes.c_uint)]


class GpuInfo(ctypes.Structure):
    _fields_ = [("physicalId", ctypes.c_uint), ("uuid", ctypes.c_char * 80), ("pciBusId", ctypes.c_char * 32),
                ("numNvLinksAvailable", ctypes.c_uint), ("maxNumNvLinks", ctypes.c_uint),
                ("nvlinkLineRateMBps", ctypes.c_uint)]


class PartitionInfo(ctypes.Structure):
    _fields_ = [("partitionId", ctypes.c_uint), ("isActive", ctypes.c_uint), ("numGpus", ctypes.c_uint),
                ("gpuInfo", GpuInfo * 16)]


class PartitionList(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("numPartitions", ctypes.c_uint), ("maxNumPartitions", ctypes.c_uint),
                ("partitionInfo", PartitionInfo * 64)]


class ActivatedList(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("numPartitions", ctypes.c_uint), ("partitionIds", ctypes.c_uint * 64)]


def version(struct: type[ctypes.Structure]) -> int:
    return ctypes.sizeof(struct) | (1 << 24)  # MAKE_FM_PARAM_VERSION(type, 1)


@pytest.fixture
def fm(tmp_path: Path) -> Iterator[FabricManager]:
    table = table_from_profile(json.loads(mock.profile_path("dgx-h100").read_text()))
    with FabricManager(tmp_path / "run" / "nvidia-fabricmanager" / "socket", table, tmp_path / "fm.json") as daemon:
        yield daemon


@pytest.fixture
def lib() -> Iterator[ctypes.CDLL]:
    handle = ctypes.CDLL(str(mock_library_path()))
    handle.fmConnect.argtypes = [ctypes.POINTER(ConnectParams), ctypes.POINTER(ctypes.c_void_p)]
    handle.fmDisconnect.argtypes = [ctypes.c_void_p]
    handle.fmGetSupportedFabricPartitions.argtypes = [ctypes.c_void_p, ctypes.POINTER(PartitionList)]
    handle.fmActivateFabricPartition.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    handle.fmDeactivateFabricPartition.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    handle.fmSetActivatedFabricPartitions.argtypes = [ctypes.c_void_p, ctypes.POINTER(ActivatedList)]
    yield handle
    handle.fmLibShutdown()


def connect(lib: ctypes.CDLL, path: Path, *, timeout_ms: int = 2000) -> tuple[int, ctypes.c_void_p]:
    params = ConnectParams(version=version(ConnectParams), addressInfo=str(path).encode(), timeoutMs=timeout_ms,
                           addressIsUnixSocket=1)
    handle = ctypes.c_void_p()
    return lib.fmConnect(ctypes.byref(params), ctypes.byref(handle)), handle


def test_struct_sizes_match_the_sdk_header() -> None:
    assert ctypes.sizeof(ConnectParams) == 268
    assert ctypes.sizeof(GpuInfo) == 128
    assert ctypes.sizeof(PartitionInfo) == 12 + 16 * 128
    assert ctypes.sizeof(PartitionList) == 12 + 64 * (12 + 16 * 128)


def test_init_twice_is_in_use_and_calls_before_init_are_uninitialized(lib: ctypes.CDLL, fm: FabricManager) -> None:
    rc, _ = connect(lib, fm.socket_path)
    assert rc == UNINIT
    assert lib.fmLibShutdown() == UNINIT
    assert lib.fmLibInit() == SUCCESS
    assert lib.fmLibInit() == IN_USE


def test_list_reports_the_hgx8_table_with_gpu_identities(lib: ctypes.CDLL, fm: FabricManager) -> None:
    assert lib.fmLibInit() == SUCCESS
    rc, h = connect(lib, fm.socket_path)
    assert rc == SUCCESS
    out = PartitionList(version=version(PartitionList))
    assert lib.fmGetSupportedFabricPartitions(h, ctypes.byref(out)) == SUCCESS
    assert (out.numPartitions, out.maxNumPartitions) == (15, 64)
    sizes = [out.partitionInfo[i].numGpus for i in range(out.numPartitions)]
    assert sizes == [8, 4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    p0 = out.partitionInfo[0]
    profile = json.loads(mock.profile_path("dgx-h100").read_text())
    assert [p0.gpuInfo[j].physicalId for j in range(8)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [p0.gpuInfo[j].uuid.decode() for j in range(8)] == [g["uuid"] for g in profile["gpus"]]
    assert p0.gpuInfo[0].pciBusId.decode() == profile["gpus"][0]["pciBusId"]
    assert lib.fmDisconnect(h) == SUCCESS
    assert lib.fmDisconnect(h) == BADPARAM


def test_list_version_mismatch_and_bad_connect_version(lib: ctypes.CDLL, fm: FabricManager) -> None:
    lib.fmLibInit()
    _, h = connect(lib, fm.socket_path)
    out = PartitionList(version=version(PartitionList) + 1)
    assert lib.fmGetSupportedFabricPartitions(h, ctypes.byref(out)) == VERSION
    params = ConnectParams(version=1, addressInfo=str(fm.socket_path).encode(), addressIsUnixSocket=1)
    assert lib.fmConnect(ctypes.byref(params), ctypes.byref(ctypes.c_void_p())) == VERSION


def test_activate_deactivate_and_their_error_codes(lib: ctypes.CDLL, fm: FabricManager, tmp_path: Path) -> None:
    lib.fmLibInit()
    _, h = connect(lib, fm.socket_path)
    assert lib.fmActivateFabricPartition(h, 3) == SUCCESS  # GPUs 1+3
    assert lib.fmActivateFabricPartition(h, 3) == IN_USE  # already active
    assert lib.fmActivateFabricPartition(h, 1) == IN_USE  # 1-4 overlaps 1+3
    assert lib.fmActivateFabricPartition(h, 99) == BADPARAM
    assert lib.fmDeactivateFabricPartition(h, 4) == UNINIT  # not active
    assert lib.fmDeactivateFabricPartition(h, 99) == BADPARAM
    assert json.loads((tmp_path / "fm.json").read_text()) == {"active": [3]}
    fm.set_gpu_ready(6, False)
    assert lib.fmActivateFabricPartition(h, 6) == GENERIC  # 6+8: GPU 6 not ready
    assert lib.fmDeactivateFabricPartition(h, 3) == SUCCESS
    assert json.loads((tmp_path / "fm.json").read_text()) == {"active": []}
    fm.set_initializing(True)
    assert lib.fmActivateFabricPartition(h, 0) == NOT_CONFIGURED


def test_set_activated_partitions_after_a_restart(lib: ctypes.CDLL, fm: FabricManager) -> None:
    lib.fmLibInit()
    _, h = connect(lib, fm.socket_path)
    ids = ActivatedList(version=version(ActivatedList), numPartitions=2)
    ids.partitionIds[0], ids.partitionIds[1] = 1, 6
    assert lib.fmSetActivatedFabricPartitions(h, ctypes.byref(ids)) == SUCCESS
    assert fm.active == {1, 6}


def test_fm_down_is_connection_not_valid(lib: ctypes.CDLL, fm: FabricManager, tmp_path: Path) -> None:
    lib.fmLibInit()
    assert connect(lib, tmp_path / "nothing" / "socket")[0] == NOT_VALID
    assert connect(lib, Path("/" + "x" * 120))[0] == BADPARAM  # longer than a Unix socket address holds
    fm.stop()
    assert connect(lib, fm.socket_path)[0] == NOT_VALID


def test_injected_faults_per_call_then_normal_again(lib: ctypes.CDLL, fm: FabricManager) -> None:
    lib.fmLibInit()
    fm.inject("connect", NOT_CONFIGURED)
    assert connect(lib, fm.socket_path)[0] == NOT_CONFIGURED
    _, h = connect(lib, fm.socket_path)
    assert control(fm.socket_path, "FAULT activate -10 2") == "0"
    assert lib.fmActivateFabricPartition(h, 0) == -10  # FM_ST_NVLINK_ERROR
    assert lib.fmActivateFabricPartition(h, 0) == -10
    assert lib.fmActivateFabricPartition(h, 0) == SUCCESS
    fm.inject("deactivate", DROP)
    assert lib.fmDeactivateFabricPartition(h, 0) == NOT_VALID  # the daemon closed the connection unanswered
    assert fm.active == {0}
