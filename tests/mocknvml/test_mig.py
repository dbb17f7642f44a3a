"""MIG mutations of the mock (``ext/mocknvml/mig.c``): MIG mode, instance create/destroy, "in use", overrides,
the shared state file and the capability files. Return codes as ``nvml.h`` documents each call."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dradriver.nvml import mock

IN_USE = pynvml.NVML_ERROR_IN_USE
H100_1G = 19  # GI profile ID of 1g.10gb on H100 (gpu-facts.md 2.6)
H100_3G = 9


def placement(start: int, size: int) -> Any:
    where = pynvml.c_nvmlGpuInstancePlacement_t()
    where.start, where.size = start, size
    return ctypes.byref(where)


def code(fn: Callable[..., Any], *args: Any) -> int:
    try:
        fn(*args)
    except pynvml.NVMLError as exc:
        return int(exc.value)
    return 0


@pytest.fixture
def mig_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    state, proc = tmp_path / "nvml-state", tmp_path / "proc"
    monkeypatch.setenv(mock.STATE_ENV, str(state))
    monkeypatch.setenv(mock.PROC_ROOT_ENV, str(proc))
    return state, proc


def make_1g(nv: Any, dev: Any, start: int) -> tuple[Any, Any]:
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, H100_1G, placement(start, 1))
    ci_profile = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 0)
    return gi, nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)


def test_hopper_mig_mode_takes_effect_at_once_when_idle(nvml: Any, mig_env: tuple[Path, Path]) -> None:
    nv = nvml("dgx-h100")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]
    assert code(nv.nvmlDeviceCreateGpuInstanceWithPlacement, dev, H100_1G, placement(0, 1)) == \
        pynvml.NVML_ERROR_NOT_SUPPORTED  # MIG mode off
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 7
    assert code(nv.nvmlDeviceSetMigMode, dev, 2) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_hopper_mode_change_stays_pending_while_busy(nvml: Any, lib: ctypes.CDLL, mig_env: Any) -> None:
    nv = nvml("dgx-h100")
    dev = nv.nvmlDeviceGetHandleByIndex(1)
    assert lib.mocknvml_control(b"procs 1 1") == 0
    assert len(nv.nvmlDeviceGetComputeRunningProcesses_v3(dev)) == 1
    assert nv.nvmlDeviceSetMigMode(dev, 1) == IN_USE
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
    assert lib.mocknvml_control(b"procs 1 0") == 0
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    make_1g(nv, dev, 0)
    assert nv.nvmlDeviceSetMigMode(dev, 0) == IN_USE  # instances left: not idle
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 0]


def test_ampere_mig_mode_pending_until_reset(nvml: Any, lib: ctypes.CDLL, mig_env: Any) -> None:
    nv = nvml("dgx-a100")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    current, _ = nv.nvmlDeviceGetMigMode(dev)
    target = 1 - current
    assert nv.nvmlDeviceSetMigMode(dev, target) == IN_USE
    assert nv.nvmlDeviceGetMigMode(dev) == [current, target]
    assert lib.mocknvml_control(b"reset 0") == 0
    assert nv.nvmlDeviceGetMigMode(dev) == [target, target]


def test_create_at_placement_and_capacity(nvml: Any, mig_env: Any) -> None:
    nv = nvml("dgx-h100")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(dev, 1)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, H100_3G) == 2
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, H100_3G, placement(4, 4))
    info = nv.nvmlGpuInstanceGetInfo(gi)
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (1, H100_3G, 4, 4)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, H100_3G) == 1
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, H100_1G) == 4
    # occupied, overlapping, impossible placements
    assert code(nv.nvmlDeviceCreateGpuInstanceWithPlacement, dev, H100_3G, placement(4, 4)) == \
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert code(nv.nvmlDeviceCreateGpuInstanceWithPlacement, dev, H100_1G, placement(5, 1)) == \
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert code(nv.nvmlDeviceCreateGpuInstanceWithPlacement, dev, H100_3G, placement(2, 4)) == \
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(nv.nvmlDeviceCreateGpuInstanceWithPlacement, dev, 77, placement(0, 1)) == \
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    # without placement: the first free one
    gi2 = nv.nvmlDeviceCreateGpuInstance(dev, H100_1G)
    assert nv.nvmlGpuInstanceGetInfo(gi2).placement.start == 0
    ci_profile = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, 0)  # 3_SLICE
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
    assert nv.nvmlComputeInstanceGetInfo(ci).id == 0
    assert code(nv.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile.id) == \
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES  # the GI's compute slices are used up
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, 0)
    uuid = nv.nvmlDeviceGetUUID(mig)
    assert uuid.startswith("MIG-") and uuid[18] == "5" and uuid[23] in "89ab"  # v5-shaped (gpu-facts.md 3.1)
    assert nv.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert (nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)) == (1, 0)


def test_destroy_in_use_and_order(nvml: Any, lib: ctypes.CDLL, mig_env: Any) -> None:
    nv = nvml("dgx-h100")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(dev, 1)
    gi, ci = make_1g(nv, dev, 3)
    gi_id = nv.nvmlGpuInstanceGetInfo(gi).id
    assert gi_id == 7  # 1-slice pool starts at 7 (gpu-facts.md 3.1)
    assert code(nv.nvmlGpuInstanceDestroy, gi) == IN_USE  # a compute instance is active on it
    assert lib.mocknvml_control(f"procs 0 {gi_id} 0 2".encode()) == 0
    procs = nv.nvmlDeviceGetComputeRunningProcesses_v3(dev)
    assert [(p.gpuInstanceId, p.computeInstanceId) for p in procs] == [(gi_id, 0), (gi_id, 0)]
    assert code(nv.nvmlComputeInstanceDestroy, ci) == IN_USE
    assert lib.mocknvml_control(f"procs 0 {gi_id} 0 0".encode()) == 0
    nv.nvmlComputeInstanceDestroy(ci)
    assert code(nv.nvmlDeviceGetMigDeviceHandleByIndex, dev, 0) == pynvml.NVML_ERROR_NOT_FOUND
    nv.nvmlGpuInstanceDestroy(gi)
    assert code(nv.nvmlDeviceGetGpuInstanceById, dev, gi_id) == pynvml.NVML_ERROR_NOT_FOUND
    assert code(nv.nvmlGpuInstanceDestroy, gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # stale handle
    assert nv.nvmlDeviceSetMigMode(dev, 0) == pynvml.NVML_SUCCESS


def test_fail_overrides_each_call(nvml: Any, lib: ctypes.CDLL, mig_env: Any) -> None:
    nv = nvml("dgx-h100")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(dev, 1)
    assert lib.mocknvml_control(b"fail 0 nvmlDeviceCreateGpuInstanceWithPlacement 23 1") == 0
    assert code(nv.nvmlDeviceCreateGpuInstanceWithPlacement, dev, H100_1G, placement(0, 1)) == 23
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, H100_1G, placement(0, 1))  # count used up
    assert lib.mocknvml_control(b"fail * nvmlGpuInstanceCreateComputeInstance 999") == 0
    assert code(nv.nvmlGpuInstanceCreateComputeInstance, gi, 0) == pynvml.NVML_ERROR_UNKNOWN
    assert code(nv.nvmlGpuInstanceCreateComputeInstance, gi, 0) == pynvml.NVML_ERROR_UNKNOWN
    assert lib.mocknvml_control(b"fail * nvmlGpuInstanceCreateComputeInstance 0") == 0
    nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    assert lib.mocknvml_control(b"fail 1 nvmlDeviceGetMigMode 15") == 0  # GPU 1 only
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    assert code(nv.nvmlDeviceGetMigMode, nv.nvmlDeviceGetHandleByIndex(1)) == 15
    assert lib.mocknvml_control(b"fail 99 nvmlDeviceGetMigMode 15") == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_capability_files_follow_instances(nvml: Any, mig_env: tuple[Path, Path]) -> None:
    _, proc = mig_env
    nv = nvml("dgx-h100")
    minors = (proc / "driver" / "nvidia-caps" / "mig-minors").read_text().splitlines()
    assert minors[:3] == ["config 1", "monitor 2", "gpu0/gi0/access 3"]
    assert "gpu3/gi3/ci3/access 439" in minors and minors[-1] == "gpu31/gi14/ci7/access 4322"
    dev = nv.nvmlDeviceGetHandleByIndex(2)
    minor = nv.nvmlDeviceGetMinorNumber(dev)
    nv.nvmlDeviceSetMigMode(dev, 1)
    caps = proc / "driver" / "nvidia" / "capabilities" / f"gpu{minor}" / "mig"
    assert not caps.exists() or not any(caps.iterdir())
    gi, ci = make_1g(nv, dev, 6)
    gi_id = nv.nvmlGpuInstanceGetInfo(gi).id
    assert (caps / f"gi{gi_id}" / "access").read_text() == \
        f"DeviceFileMinor: {3 + 135 * minor + 9 * gi_id}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    assert (caps / f"gi{gi_id}" / "ci0" / "access").read_text().startswith(
        f"DeviceFileMinor: {4 + 135 * minor + 9 * gi_id}\n")
    nv.nvmlComputeInstanceDestroy(ci)
    assert not (caps / f"gi{gi_id}" / "ci0").exists() and (caps / f"gi{gi_id}" / "access").exists()
    nv.nvmlGpuInstanceDestroy(gi)
    assert not (caps / f"gi{gi_id}").exists()


CHILD = textwrap.dedent("""
    import ctypes, sys, pynvml
    from dradriver.nvml import mock
    lib = ctypes.CDLL(str(mock.library_path()), mode=ctypes.RTLD_GLOBAL)
    lib.mocknvml_control.argtypes = [ctypes.c_char_p]
    pynvml.nvmlInit()
    dev = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlDeviceSetMigMode(dev, 1)
    lib.mocknvml_control(sys.argv[1].encode())
    where = pynvml.c_nvmlGpuInstancePlacement_t(); where.start, where.size = 2, 1
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, ctypes.byref(where))
    pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    print("done", flush=True)
""")


@pytest.mark.parametrize(("command", "gis", "cis"), [
    ("fail * nvmlDeviceCreateGpuInstanceWithPlacement kill", 0, 0),
    ("fail * nvmlDeviceCreateGpuInstanceWithPlacement killafter", 1, 0),
    ("fail * nvmlGpuInstanceCreateComputeInstance killafter", 1, 1),
])
def test_sigkill_at_a_call_and_state_outlives_the_process(nvml: Any, mig_env: Any, command: str, gis: int,
                                                          cis: int) -> None:
    env = dict(os.environ, **{mock.PROFILE_ENV: str(mock.profile_path("dgx-h100"))})
    child = subprocess.run([sys.executable, "-c", CHILD, command], env=env, capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2], check=False)
    assert child.returncode == -signal.SIGKILL, child.stderr
    nv = nvml("dgx-h100")  # this process reads the state the killed one left
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    count = ctypes.c_uint(0)
    array = (pynvml.c_nvmlGpuInstance_t * 7)()
    nv.nvmlDeviceGetGpuInstances(dev, H100_1G, array, ctypes.byref(count))
    assert count.value == gis
    migs = 0
    for slot in range(7):
        migs += code(nv.nvmlDeviceGetMigDeviceHandleByIndex, dev, slot) == 0
    assert migs == cis


OTHER_CLIENT = textwrap.dedent("""
    import ctypes, pynvml
    from dradriver.nvml import mock
    ctypes.CDLL(str(mock.library_path()), mode=ctypes.RTLD_GLOBAL)
    pynvml.nvmlInit()
    dev = pynvml.nvmlDeviceGetHandleByIndex(3)
    where = pynvml.c_nvmlGpuInstancePlacement_t(); where.start, where.size = 4, 4
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 9, ctypes.byref(where))
    pynvml.nvmlShutdown()
""")


def test_a_change_by_another_process_is_seen_without_reinit(nvml: Any, mig_env: Any) -> None:
    nv = nvml("dgx-h100")
    dev = nv.nvmlDeviceGetHandleByIndex(3)
    nv.nvmlDeviceSetMigMode(dev, 1)
    env = dict(os.environ, **{mock.PROFILE_ENV: str(mock.profile_path("dgx-h100"))})
    subprocess.run([sys.executable, "-c", OTHER_CLIENT], env=env, check=True, capture_output=True,
                   cwd=Path(__file__).resolve().parents[2])
    count = ctypes.c_uint(0)
    array = (pynvml.c_nvmlGpuInstance_t * 2)()
    nv.nvmlDeviceGetGpuInstances(dev, H100_3G, array, ctypes.byref(count))
    assert count.value == 1 and nv.nvmlGpuInstanceGetInfo(array[0]).placement.start == 4
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, H100_3G) == 1
