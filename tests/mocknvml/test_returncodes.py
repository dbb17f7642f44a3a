"""NVML return codes as nvml.h documents them, checked through the raw C ABI (ctypes, no pynvml wrapper)."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from dradriver.nvml import mock

c_uint = ctypes.c_uint
byref = ctypes.byref
Handle = ctypes.c_void_p


@pytest.fixture
def raw(lib: ctypes.CDLL, nvml: Any) -> ctypes.CDLL:
    """The library after nvmlInit on dgx-a100, with the argtypes these tests need."""
    nvml("dgx-a100")
    lib.nvmlDeviceGetHandleByIndex_v2.argtypes = [c_uint, ctypes.POINTER(Handle)]
    lib.nvmlDeviceGetName.argtypes = [Handle, ctypes.c_char_p, c_uint]
    lib.nvmlDeviceGetUUID.argtypes = [Handle, ctypes.c_char_p, c_uint]
    lib.nvmlDeviceGetMemoryInfo.argtypes = [Handle, ctypes.c_void_p]
    lib.nvmlDeviceGetMigDeviceHandleByIndex.argtypes = [Handle, c_uint, ctypes.POINTER(Handle)]
    lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2.argtypes = [
        Handle, c_uint, ctypes.c_void_p, ctypes.POINTER(c_uint),
    ]
    lib.nvmlDeviceGetHandleByUUID.argtypes = [ctypes.c_char_p, ctypes.POINTER(Handle)]
    lib.nvmlDeviceGetHandleByPciBusId_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(Handle)]
    lib.nvmlSystemGetDriverVersion.argtypes = [ctypes.c_char_p, c_uint]
    lib.nvmlDeviceGetGpuInstanceById.argtypes = [Handle, c_uint, ctypes.POINTER(Handle)]
    lib.nvmlDeviceGetRetiredPages.argtypes = [Handle, ctypes.c_int, ctypes.POINTER(c_uint), ctypes.c_void_p]
    lib.nvmlErrorString.restype = ctypes.c_char_p
    return lib


def _handle(raw: ctypes.CDLL, index: int) -> Handle:
    h = Handle()
    assert raw.nvmlDeviceGetHandleByIndex_v2(index, byref(h)) == 0
    return h


def test_every_call_before_init_is_uninitialized(lib: ctypes.CDLL, nvml: Any) -> None:
    count = c_uint()
    assert lib.nvmlDeviceGetCount_v2(byref(count)) == pynvml.NVML_ERROR_UNINITIALIZED
    assert lib.nvmlShutdown() == pynvml.NVML_ERROR_UNINITIALIZED
    assert lib.nvmlSystemGetDriverVersion(ctypes.create_string_buffer(80), 80) == pynvml.NVML_ERROR_UNINITIALIZED
    assert lib.nvmlEventSetCreate(byref(Handle())) == pynvml.NVML_ERROR_UNINITIALIZED
    assert lib.mocknvml_set_lost(0, 1) == pynvml.NVML_ERROR_UNINITIALIZED


def test_init_is_reference_counted(lib: ctypes.CDLL, nvml: Any) -> None:
    nvml("dgx-h100")
    assert lib.nvmlInit_v2() == 0
    assert lib.nvmlShutdown() == 0
    count = c_uint()
    assert lib.nvmlDeviceGetCount_v2(byref(count)) == 0 and count.value == 8


def test_handle_from_a_finished_session_is_rejected(raw: ctypes.CDLL, nvml: Any) -> None:
    gpu0 = _handle(raw, 0)
    mig = Handle()
    assert raw.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 0, byref(mig)) == 0
    pynvml.nvmlShutdown()
    nvml("dgx-h100")  # no MIG here: the old MIG handle has no counterpart
    buf = ctypes.create_string_buffer(96)
    assert raw.nvmlDeviceGetName(mig, buf, 96) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert raw.nvmlDeviceGetName(gpu0, buf, 96) == 0 and buf.value == b"NVIDIA H100 80GB HBM3"


def test_invalid_arguments(raw: ctypes.CDLL) -> None:
    h = Handle()
    assert raw.nvmlDeviceGetHandleByIndex_v2(8, byref(h)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert raw.nvmlDeviceGetHandleByIndex_v2(0, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert raw.nvmlDeviceGetCount_v2(None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    gpu0 = _handle(raw, 0)
    assert raw.nvmlDeviceGetMemoryInfo(gpu0, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    bogus = Handle(0x1234)
    buf = ctypes.create_string_buffer(96)
    assert raw.nvmlDeviceGetName(bogus, buf, 96) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert raw.nvmlDeviceGetName(None, buf, 96) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert raw.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 7, byref(h)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert raw.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 4, byref(h)) == pynvml.NVML_ERROR_NOT_FOUND
    assert raw.nvmlDeviceGetGpuInstanceById(gpu0, 14, byref(h)) == pynvml.NVML_ERROR_NOT_FOUND
    assert raw.nvmlDeviceGetGpuInstanceById(gpu0, 15, byref(h)) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_not_found(raw: ctypes.CDLL) -> None:
    h = Handle()
    unknown = b"GPU-00000000-0000-0000-0000-000000000000"
    assert raw.nvmlDeviceGetHandleByUUID(unknown, byref(h)) == pynvml.NVML_ERROR_NOT_FOUND
    assert raw.nvmlDeviceGetHandleByPciBusId_v2(b"00000000:01:00.0", byref(h)) == pynvml.NVML_ERROR_NOT_FOUND
    assert raw.nvmlDeviceGetHandleByPciBusId_v2(b"not a bus id", byref(h)) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_insufficient_size(raw: ctypes.CDLL) -> None:
    gpu0 = _handle(raw, 0)
    small = ctypes.create_string_buffer(8)
    assert raw.nvmlDeviceGetName(gpu0, small, 8) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert raw.nvmlDeviceGetUUID(gpu0, small, 8) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert raw.nvmlSystemGetDriverVersion(small, 8) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    exact = ctypes.create_string_buffer(len("570.148.08") + 1)
    assert raw.nvmlSystemGetDriverVersion(exact, len(exact)) == 0
    count = c_uint(1)
    placements = (pynvml.c_nvmlGpuInstancePlacement_t * 1)()
    assert raw.nvmlDeviceGetGpuInstancePossiblePlacements_v2(gpu0, 19, placements, byref(count)) == \
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 7, "the needed count is reported back"


def test_retired_pages_report_the_needed_count(raw: ctypes.CDLL, nvml: Any, write_profile: Any) -> None:
    pynvml.nvmlShutdown()

    def edit(p: dict[str, Any]) -> None:
        p["gpus"][2]["retiredPages"] = {"doubleBitEcc": [0x1000, 0x2000], "singleBitEcc": [], "pending": True}

    nvml(write_profile("dgx-a100", edit))
    gpu2 = _handle(raw, 2)
    count = c_uint(0)
    assert raw.nvmlDeviceGetRetiredPages(gpu2, 1, byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 2
    assert pynvml.nvmlDeviceGetRetiredPages(pynvml.nvmlDeviceGetHandleByIndex(2), 1) == [0x1000, 0x2000]
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(pynvml.nvmlDeviceGetHandleByIndex(2)) == 1
    assert pynvml.nvmlDeviceGetRetiredPages(pynvml.nvmlDeviceGetHandleByIndex(2), 0) == []


def test_struct_version_mismatch(raw: ctypes.CDLL) -> None:
    gpu0 = _handle(raw, 0)
    mem = pynvml.c_nvmlMemory_v2_t()
    mem.version = 1
    raw.nvmlDeviceGetMemoryInfo_v2.argtypes = [Handle, ctypes.c_void_p]
    assert raw.nvmlDeviceGetMemoryInfo_v2(gpu0, byref(mem)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_error_strings(raw: ctypes.CDLL) -> None:
    assert raw.nvmlErrorString(0) == b"Success"
    assert raw.nvmlErrorString(15) == b"GPU is lost"
    assert raw.nvmlErrorString(999) == b"Unknown Error"
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_NOT_SUPPORTED) == "Not Supported"


def test_mig_handles_refuse_full_gpu_only_queries(nvml: Any) -> None:
    pynvml_ = nvml("dgx-a100")
    h = pynvml_.nvmlDeviceGetHandleByIndex(0)
    m = pynvml_.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    for call in (pynvml_.nvmlDeviceGetMinorNumber, pynvml_.nvmlDeviceGetTemperatureV1, pynvml_.nvmlDeviceGetPowerUsage,
                 pynvml_.nvmlDeviceGetUtilizationRates, pynvml_.nvmlDeviceGetSerial):
        args = (m, 0) if call is pynvml_.nvmlDeviceGetTemperatureV1 else (m,)
        with pytest.raises(pynvml_.NVMLError_NotSupported):
            call(*args)
    assert pynvml_.nvmlDeviceGetPciInfo(m).busId == pynvml_.nvmlDeviceGetPciInfo(h).busId
    assert mock.load_profile("dgx-a100")["gpus"][0]["uuid"] == pynvml_.nvmlDeviceGetUUID(
        pynvml_.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m))
