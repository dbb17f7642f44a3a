"""``nvmlDeviceGetModuleId`` in the mock: the nvml.h signature, per-profile values, NOT_SUPPORTED.

Expected values are written here from the fact sheet, not read back from the profiles: the B200 capture
(NVIDIA/k8s-test-infra ``qx-b200.xml``) reports module IDs 6, 8, 7, 5, 2, 4, 3, 1 for minors 0-7 (not in bus order),
the GB200 tray capture 2, 1, 4, 3; the HGX A100/H100/H200 8-GPU profiles use 1..8 in bus order (synthetic). The L4
node has no module ID (NOT_SUPPORTED).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

EXPECTED: dict[str, list[int] | None] = {
    "dgx-a100": [1, 2, 3, 4, 5, 6, 7, 8],
    "dgx-h100": [1, 2, 3, 4, 5, 6, 7, 8],
    "dgx-h200": [1, 2, 3, 4, 5, 6, 7, 8],
    "dgx-b200": [6, 8, 7, 5, 2, 4, 3, 1],
    "gb200-nvl72-node": [2, 1, 4, 3],
    "l4-inference": None,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_module_ids_per_profile_by_minor(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    want = EXPECTED[name]
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    by_minor = sorted(handles, key=pynvml.nvmlDeviceGetMinorNumber)
    if want is None:
        for h in by_minor:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetModuleId(h)
    else:
        assert [pynvml.nvmlDeviceGetModuleId(h) for h in by_minor] == want


def test_module_id_c_signature_null_pointer_and_runtime_unset(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml = nvml("dgx-b200")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    fn = lib.nvmlDeviceGetModuleId
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint)]
    out = ctypes.c_uint(0)
    assert fn(ctypes.cast(h, ctypes.c_void_p), ctypes.byref(out)) == pynvml.NVML_SUCCESS
    assert out.value == 6
    assert fn(ctypes.cast(h, ctypes.c_void_p), None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert lib.mocknvml_control(b"set 0 moduleId -1") == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetModuleId(h)
    assert lib.mocknvml_control(b"notsupported * nvmlDeviceGetModuleId 1") == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetModuleId(pynvml.nvmlDeviceGetHandleByIndex(1))
