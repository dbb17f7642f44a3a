"""Compute mode, compute time-slice and persistence mode of the mock: NVML's return codes, and settings shared
across processes through the control file (``ext/mocknvml/settings.c``)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dradriver.nvml import mock


def _timeslice(lib: ctypes.CDLL, handle: Any) -> int:
    value = ctypes.c_uint(99)
    assert lib.mocknvml_device_get_timeslice(handle, ctypes.byref(value)) == pynvml.NVML_SUCCESS
    return value.value


def test_compute_mode_defaults_to_default_and_is_set_back(nvml: Any) -> None:
    nv = nvml("dgx-h100")
    handle = nv.nvmlDeviceGetHandleByIndex(3)
    assert nv.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_DEFAULT
    nv.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert nv.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert nv.nvmlDeviceGetComputeMode(nv.nvmlDeviceGetHandleByIndex(2)) == pynvml.NVML_COMPUTEMODE_DEFAULT
    nv.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_PROHIBITED)
    assert nv.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_PROHIBITED


@pytest.mark.parametrize(("mode", "error"), [
    (4, pynvml.NVMLError_InvalidArgument),                                        # past nvmlComputeMode_t
    (pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD, pynvml.NVMLError_NotSupported),    # nvml.h: "Support Removed"
])
def test_bad_compute_modes_are_refused(nvml: Any, mode: int, error: type[Exception]) -> None:
    nv = nvml("dgx-h100")
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(error):
        nv.nvmlDeviceSetComputeMode(handle, mode)
    assert nv.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_DEFAULT


def test_mig_enabled_gpu_takes_compute_mode_on_its_mig_devices_only(nvml: Any) -> None:
    nv = nvml("dgx-a100")
    gpu = nv.nvmlDeviceGetHandleByIndex(0)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceSetComputeMode(gpu, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    nv.nvmlDeviceSetComputeMode(mig, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert nv.nvmlDeviceGetComputeMode(mig) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert nv.nvmlDeviceGetComputeMode(nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)) == 0
    assert nv.nvmlDeviceGetComputeMode(gpu) == pynvml.NVML_COMPUTEMODE_DEFAULT


def test_unprivileged_caller_and_lost_gpu_get_nvml_codes(nvml: Any, lib: ctypes.CDLL) -> None:
    nv = nvml("dgx-h100")
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    assert lib.mocknvml_control(b"set 1 noPermission 1") == 0
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nv.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert lib.mocknvml_device_set_timeslice(handle, 2) == pynvml.NVML_ERROR_NO_PERMISSION
    assert _timeslice(lib, handle) == 0
    assert lib.mocknvml_set_lost(1, 1) == 0
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetComputeMode(handle)
    assert lib.mocknvml_device_set_timeslice(handle, 1) == pynvml.NVML_ERROR_GPU_IS_LOST


def test_timeslice_is_0_to_3_on_full_gpus_only(nvml: Any, lib: ctypes.CDLL) -> None:
    nv = nvml("dgx-a100")
    full = nv.nvmlDeviceGetHandleByIndex(4)
    assert _timeslice(lib, full) == 0
    assert lib.mocknvml_device_set_timeslice(full, 3) == pynvml.NVML_SUCCESS
    assert _timeslice(lib, full) == 3
    assert lib.mocknvml_device_set_timeslice(full, 4) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert _timeslice(lib, full) == 3
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(nv.nvmlDeviceGetHandleByIndex(0), 0)
    assert lib.mocknvml_device_set_timeslice(mig, 1) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert lib.mocknvml_device_get_timeslice(full, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_persistence_mode_is_enabled_by_default_and_set_through_the_legacy_call(
        nvml: Any, lib: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlDeviceSetPersistenceMode (nvml.h's legacy call, what ``nvidia-smi -pm`` uses without
    nvidia-persistenced): DISABLED/ENABLED only, full GPUs only, NO_PERMISSION for an unprivileged caller, and
    written through to the control file like compute mode."""
    control = tmp_path / "control"
    control.touch()
    monkeypatch.setenv(mock.CONTROL_ENV, str(control))
    nv = nvml("dgx-a100")
    full = nv.nvmlDeviceGetHandleByIndex(3)
    assert nv.nvmlDeviceGetPersistenceMode(full) == pynvml.NVML_FEATURE_ENABLED
    nv.nvmlDeviceSetPersistenceMode(full, pynvml.NVML_FEATURE_DISABLED)
    assert nv.nvmlDeviceGetPersistenceMode(full) == pynvml.NVML_FEATURE_DISABLED
    assert nv.nvmlDeviceGetPersistenceMode(nv.nvmlDeviceGetHandleByIndex(4)) == pynvml.NVML_FEATURE_ENABLED
    assert control.read_text() == "set 3 persistenceMode 0\n"
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetPersistenceMode(full, 2)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(nv.nvmlDeviceGetHandleByIndex(0), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceSetPersistenceMode(mig, pynvml.NVML_FEATURE_DISABLED)
    assert lib.mocknvml_control(b"set 3 noPermission 1") == 0
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nv.nvmlDeviceSetPersistenceMode(full, pynvml.NVML_FEATURE_ENABLED)
    assert nv.nvmlDeviceGetPersistenceMode(full) == pynvml.NVML_FEATURE_DISABLED


_OTHER_PROCESS = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(2)
mode = pynvml.nvmlDeviceGetComputeMode(h)
v = ctypes.c_uint(0)
lib.mocknvml_device_get_timeslice(h, ctypes.byref(v))
pynvml.nvmlDeviceSetComputeMode(pynvml.nvmlDeviceGetHandleByIndex(5), 2)
print(mode, v.value)
"""


def test_settings_are_shared_with_other_processes_through_the_control_file(
        nvml: Any, lib: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "control"
    control.touch()
    monkeypatch.setenv(mock.CONTROL_ENV, str(control))
    nv = nvml("dgx-h100")
    handle = nv.nvmlDeviceGetHandleByIndex(2)
    nv.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert lib.mocknvml_device_set_timeslice(handle, 1) == 0
    assert control.read_text() == "set 2 computeMode 3\nset 2 computeTimeslice 1\n"
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(mock.library_path())], env=dict(os.environ),
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["3", "1"]
    # what the other process set reaches this one at its next NVML call
    assert nv.nvmlDeviceGetComputeMode(nv.nvmlDeviceGetHandleByIndex(5)) == pynvml.NVML_COMPUTEMODE_PROHIBITED
