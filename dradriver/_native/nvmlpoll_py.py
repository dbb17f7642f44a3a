"""Pure-Python twin of ``ext/nvmlpoll.pyx``: the same sampling through pynvml (ctypes).

Selected with ``DRADRIVER_NO_EXTENSIONS=1``; also the baseline of the poller benchmark. Produces the
same :class:`~dradriver._native.nvmlfields.Sample` (values, statuses) as the compiled poller.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Sequence
from typing import Any

import pynvml

from dradriver._native import nvmlfields as nf

_TEMPERATURE_V1 = 0  # filled lazily: sizeof(nvmlTemperature_v1_t) | 1 << 24


_LIBRARY = "libnvidia-ml.so.1"
_LIBRARY_NOT_FOUND = 12  # nvml.h NVML_ERROR_LIBRARY_NOT_FOUND


def _check_library(library: str) -> None:
    """Raise :class:`PollerError` unless pynvml calls ``library`` (a path; a bare name is whatever pynvml loads)."""
    if "/" not in library:
        return
    loaded = getattr(pynvml.nvmlLib, "_name", None)
    if not loaded or os.path.realpath(loaded) != os.path.realpath(library):
        raise nf.PollerError(_LIBRARY_NOT_FOUND, f"pynvml uses {loaded or 'no library'}, not {library}")


def _call(fn: Any, *args: Any) -> tuple[int, Any]:
    try:
        return nf.NVML_SUCCESS, fn(*args)
    except pynvml.NVMLError as exc:
        return int(exc.value), None


class Poller:
    """Samples ``fields`` for every device in ``uuids`` on each :meth:`poll`.

    :param uuids: GPU and MIG device UUIDs as NVML reports them.
    :param fields: field names from :data:`~dradriver._native.nvmlfields.FIELD_NAMES`; all when ``None``.
    :param library: the ``libnvidia-ml.so.1`` file to use (the NVML session's); ``None``: pynvml's. pynvml calls
        the one library installed as ``pynvml.nvmlLib`` (the NVML session installs the file it opened there, also
        after a driver reload), so a file given must be that one.
    :raises PollerError: ``library`` is not pynvml's library (LIBRARY_NOT_FOUND), NVML cannot be initialised, or a
        UUID is unknown.
    :raises ValueError: an unknown field name.
    """

    def __init__(
        self, uuids: Sequence[str], fields: Sequence[str] | None = None, library: str | None = None
    ) -> None:
        self._table = nf.resolve_fields(None if fields is None else list(fields))
        self.devices = tuple(uuids)
        self.fields = tuple(f[0] for f in self._table)
        self._index = nf.make_index(self.devices, self.fields)
        self._field_ids = [arg for _, kind, arg in self._table if kind == nf.KIND_FIELD]
        self.library = library or _LIBRARY
        _check_library(self.library)
        code, _ = _call(pynvml.nvmlInit)
        if code != nf.NVML_SUCCESS:
            raise nf.PollerError(code, "nvmlInit failed")
        self._open = True
        self._handles = []
        for uuid in self.devices:
            code, handle = _call(pynvml.nvmlDeviceGetHandleByUUID, uuid)
            if code != nf.NVML_SUCCESS:
                self.close()
                raise nf.PollerError(code, f"nvmlDeviceGetHandleByUUID({uuid!r}) failed")
            self._handles.append(handle)

    def close(self) -> None:
        """Release the NVML reference taken at construction. Idempotent."""
        if getattr(self, "_open", False):
            self._open = False
            pynvml.nvmlShutdown()

    def __enter__(self) -> Poller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self) -> nf.Sample:
        """Sample every device and field once; see :class:`~dradriver._native.nvmlfields.Sample`."""
        started = time.monotonic()
        n = len(self.fields)
        values = array("d", bytes(8 * n * len(self.devices)))
        status = array("i", bytes(4 * n * len(self.devices)))
        for row, handle in enumerate(self._handles):
            self._sample(handle, values, status, row * n)
        return nf.Sample(self.devices, self.fields, values, status, started, self._index)

    def _sample(self, handle: Any, values: array[float], status: array[int], base: int) -> None:
        util: tuple[int, Any] | None = None
        mem: tuple[int, Any] | None = None
        fv: dict[int, tuple[int, float]] = {}
        if self._field_ids:
            code, out = _call(pynvml.nvmlDeviceGetFieldValues, handle, self._field_ids)
            for k, fid in enumerate(self._field_ids):
                if code != nf.NVML_SUCCESS:
                    fv[fid] = (code, 0.0)
                else:
                    fv[fid] = (int(out[k].nvmlReturn), _field_value(out[k]))
        for col, (_, kind, arg) in enumerate(self._table):
            code, value = nf.NVML_SUCCESS, 0.0
            if kind in (nf.KIND_UTIL_GPU, nf.KIND_UTIL_MEM):
                if util is None:
                    util = _call(pynvml.nvmlDeviceGetUtilizationRates, handle)
                code = util[0]
                if code == nf.NVML_SUCCESS:
                    value = float(util[1].gpu if kind == nf.KIND_UTIL_GPU else util[1].memory)
            elif kind in (nf.KIND_MEM_TOTAL, nf.KIND_MEM_USED, nf.KIND_MEM_FREE):
                if mem is None:
                    mem = _call(pynvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2)
                code = mem[0]
                if code == nf.NVML_SUCCESS:
                    m = mem[1]
                    by_kind = {nf.KIND_MEM_TOTAL: m.total, nf.KIND_MEM_USED: m.used, nf.KIND_MEM_FREE: m.free}
                    value = float(by_kind[kind])
            elif kind == nf.KIND_TEMPERATURE:
                code, out = _call(pynvml.nvmlDeviceGetTemperatureV, handle, pynvml.NVML_TEMPERATURE_GPU)
                value = float(out) if code == nf.NVML_SUCCESS else 0.0
            elif kind == nf.KIND_POWER:
                code, out = _call(pynvml.nvmlDeviceGetPowerUsage, handle)
                value = float(out) if code == nf.NVML_SUCCESS else 0.0
            elif kind == nf.KIND_CLOCK:
                code, out = _call(pynvml.nvmlDeviceGetClockInfo, handle, arg)
                value = float(out) if code == nf.NVML_SUCCESS else 0.0
            elif kind == nf.KIND_PCIE:
                code, out = _call(pynvml.nvmlDeviceGetPcieThroughput, handle, arg)
                value = float(out) if code == nf.NVML_SUCCESS else 0.0
            else:
                code, value = fv[arg]
                if code != nf.NVML_SUCCESS:
                    value = 0.0
            values[base + col] = value
            status[base + col] = code


def _field_value(v: Any) -> float:
    """Decode ``nvmlFieldValue_t.value`` by ``valueType`` (nvml.h ``nvmlValueType_t``)."""
    t = int(v.valueType)
    u = v.value
    if t == 0:
        return float(u.dVal)
    if t == 1:
        return float(u.uiVal)
    if t == 2:
        return float(u.ulVal)
    if t == 3:
        return float(u.ullVal)
    if t == 4:
        return float(u.sllVal)
    if t == 5:
        return float(u.siVal)
    if t == 6:
        return float(u.usVal)
    return 0.0
