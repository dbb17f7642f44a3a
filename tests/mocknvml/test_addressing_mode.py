"""``nvmlDeviceGetAddressingMode`` in the mock: the nvml.h signature and versioned struct, per-profile values.

Expected values are written here from ``gpu-facts.md`` 1.3 (the ``nvidia-smi -q`` captures, column
"Addressing mode") and 4.1, not read back from the profiles: A100 and H100 report HMM on x86 hosts, GB200
(Grace, C2C) reports ATS. The fact sheet has no capture for the L4, so its profile leaves the value out
(NOT_SUPPORTED).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

NONE, HMM, ATS = 0, 1, 2  # nvmlDeviceAddressingModeType_t (nvml.h)
EXPECTED = {"dgx-a100": HMM, "dgx-h100": HMM, "gb200-nvl72-node": ATS, "synthetic-large": HMM, "l4-inference": None,
            "vr200-node": ATS}


class _Mode(ctypes.Structure):
    """``nvmlDeviceAddressingMode_v1_t``: ``{unsigned int version; unsigned int value;}``."""

    _fields_ = [("version", ctypes.c_uint), ("value", ctypes.c_uint)]


# NVML_STRUCT_VERSION(DeviceAddressingMode, 1) = sizeof(struct) | 1 << 24
MODE_V1 = ctypes.sizeof(_Mode) | (1 << 24)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_profile_values(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    want = EXPECTED[name]
    for index in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        if want is None:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetAddressingMode(h)
        else:
            assert pynvml.nvmlDeviceGetAddressingMode(h) == want


def test_struct_version_is_checked(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml = nvml("gb200-nvl72-node")
    assert MODE_V1 == pynvml.nvmlDeviceAddressingMode_v1 == 0x1000008
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    fn = lib.nvmlDeviceGetAddressingMode
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Mode)]
    mode = _Mode(version=MODE_V1)
    assert fn(ctypes.cast(h, ctypes.c_void_p), ctypes.byref(mode)) == pynvml.NVML_SUCCESS
    assert mode.value == ATS
    bad = _Mode(version=ctypes.sizeof(_Mode) | (2 << 24), value=77)
    assert fn(ctypes.cast(h, ctypes.c_void_p), ctypes.byref(bad)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert bad.value == 77
    assert fn(ctypes.cast(h, ctypes.c_void_p), None) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_runtime_set_and_not_supported(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml = nvml("dgx-h100")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert lib.mocknvml_control(b"set 0 addressingMode 0") == 0
    assert pynvml.nvmlDeviceGetAddressingMode(h) == NONE
    assert lib.mocknvml_control(b"set 0 addressingMode -1") == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetAddressingMode(h)
    assert pynvml.nvmlDeviceGetAddressingMode(pynvml.nvmlDeviceGetHandleByIndex(1)) == HMM
    assert lib.mocknvml_control(b"notsupported * nvmlDeviceGetAddressingMode 1") == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetAddressingMode(pynvml.nvmlDeviceGetHandleByIndex(1))


def test_uninitialized(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml = nvml("dgx-h100")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetAddressingMode(h)
