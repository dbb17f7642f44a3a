"""GPU settings that sharing changes: compute mode (NVML) and the compute time-slice (no public NVML call).

* Compute mode: ``nvmlDeviceGetComputeMode`` / ``nvmlDeviceSetComputeMode`` (``nvml.h``; values of
  ``nvmlComputeMode_t``: 0 DEFAULT, 1 EXCLUSIVE_THREAD "Support Removed", 2 PROHIBITED, 3 EXCLUSIVE_PROCESS).
  The setter needs root (``NVML_ERROR_NO_PERMISSION`` otherwise), takes effect immediately and lasts until
  reboot; on a MIG-enabled GPU ``nvml.h`` wants a MIG device handle.
* Compute time-slice: what ``nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>`` sets (0 DEFAULT,
  1 SHORT, 2 MEDIUM, 3 LONG; NVIDIA's ``api/nvidia.com/resource/v1beta1/sharing.go``). NVML publishes no call for
  it (``nvml.h`` has only the vGPU scheduler calls), so dradriver sets it through ``nvidia-smi``
  (:mod:`dradriver.host.nvidiasmi`), as NVIDIA's driver does. :func:`compute_timeslice` reads it back where the
  library can tell: the bundled mock exports ``mocknvml_device_get_timeslice`` (``ext/mocknvml/settings.c``); the
  real library raises :class:`~dradriver.nvml.errors.NvmlFunctionNotFound`.

Every function takes an open :class:`~dradriver.nvml.session.NvmlSession` and a device UUID (``GPU-…`` or
``MIG-…``) and raises the :mod:`dradriver.nvml.errors` class of the NVML return code, with the UUID in the
message.
"""

from __future__ import annotations

import ctypes
import enum

import pynvml

from dradriver.nvml.errors import NvmlFunctionNotFound, error_for_code
from dradriver.nvml.session import NvmlSession


class ComputeMode(enum.IntEnum):
    """``nvmlComputeMode_t`` (``nvml.h``); the names are the words ``nvidia-smi -c`` takes."""

    DEFAULT = 0
    EXCLUSIVE_THREAD = 1
    PROHIBITED = 2
    EXCLUSIVE_PROCESS = 3


def compute_mode(session: NvmlSession, uuid: str) -> ComputeMode:
    """``nvmlDeviceGetComputeMode`` of the GPU or MIG device ``uuid``.

    :raises dradriver.nvml.errors.NvmlError: the NVML failure (``NvmlNotFound`` for an unknown UUID,
        ``NvmlGpuIsLost``, ...).
    """
    handle = session.device_by_uuid(uuid)
    value = session.call(pynvml.nvmlDeviceGetComputeMode, handle, context=f"nvmlDeviceGetComputeMode on {uuid}")
    return ComputeMode(int(value))


def set_compute_mode(session: NvmlSession, uuid: str, mode: ComputeMode) -> None:
    """``nvmlDeviceSetComputeMode`` of the GPU or MIG device ``uuid`` to ``mode``.

    :raises dradriver.nvml.errors.NvmlError: e.g. ``NvmlNoPermission`` (not root), ``NvmlNotSupported`` (the
        device cannot, or a full-GPU handle of a MIG-enabled GPU), ``NvmlInvalidArgument``.
    """
    handle = session.device_by_uuid(uuid)
    session.call(pynvml.nvmlDeviceSetComputeMode, handle, int(mode),
                 context=f"nvmlDeviceSetComputeMode({mode.name}) on {uuid}")


def compute_timeslice(session: NvmlSession, uuid: str) -> int:
    """The compute time-slice setting (0-3) of GPU ``uuid``, read through the library's own export.

    Only the bundled mock can answer (``mocknvml_device_get_timeslice``); real NVML has no public getter.

    :raises NvmlFunctionNotFound: the loaded library has no such export (the real NVIDIA library).
    :raises dradriver.nvml.errors.NvmlError: the library's return code (``NvmlNotSupported`` on a MIG device).
    """
    handle = session.device_by_uuid(uuid)
    library = pynvml.nvmlLib
    fn = getattr(library, "mocknvml_device_get_timeslice", None) if library is not None else None
    if fn is None:
        raise NvmlFunctionNotFound(
            f"reading the compute time-slice of {uuid}: {session.library} has no call for it "
            "(NVML publishes none; only the bundled mock exports mocknvml_device_get_timeslice)")
    value = ctypes.c_uint(0)
    code = int(fn(handle, ctypes.byref(value)))
    if code != 0:
        raise error_for_code(code, f"reading the compute time-slice of {uuid}: NVML return code {code}")
    return int(value.value)
