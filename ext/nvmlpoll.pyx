# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled NVML poller: one call samples every field of every GPU and MIG device with the GIL released.

NVML declarations come from NVIDIA's ``cuda.bindings.cynvml`` (cimported; it ``dlopen``s
``libnvidia-ml.so.1`` at run time, or reuses the copy already loaded in the process), so nothing here
links against NVML and no struct layout is written by hand. Fields of kind FIELD are fetched by one
``nvmlDeviceGetFieldValues`` call per device. Results go straight into a C double buffer and a C int
status buffer wrapped as ``array.array``: no Python object per value.

Twin: ``dradriver/_native/nvmlpoll_py.py`` (pynvml); both return the same
:class:`dradriver._native.nvmlfields.Sample`.
"""

from cpython cimport array
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from posix.dlfcn cimport RTLD_NOW, dlclose, dlopen, dlsym


cdef extern from "<dlfcn.h>" nogil:
    const int RTLD_NOLOAD

import array as py_array
import time

from cuda.bindings cimport cynvml

from dradriver._native import nvmlfields as nf

cdef enum:
    KIND_UTIL_GPU = 0
    KIND_UTIL_MEM = 1
    KIND_MEM_TOTAL = 2
    KIND_MEM_USED = 3
    KIND_MEM_FREE = 4
    KIND_TEMPERATURE = 5
    KIND_POWER = 6
    KIND_CLOCK = 7
    KIND_PCIE = 8
    KIND_FIELD = 9

# nvml.h: NVML_STRUCT_VERSION(data, ver) = sizeof(nvml##data##_v##ver##_t) | (ver << 24)
cdef unsigned int MEMORY_V2 = <unsigned int>(sizeof(cynvml.nvmlMemory_v2_t) | (2 << 24))
cdef unsigned int TEMPERATURE_V1 = <unsigned int>(sizeof(cynvml.nvmlTemperature_v1_t) | (1 << 24))

# Entry points, resolved once per poller straight from the loaded libnvidia-ml.so.1 (the hot loop then calls
# NVML directly, as C code does). Signatures are those of cuda.bindings.cynvml; when a symbol cannot be
# resolved the pointer is the cynvml wrapper itself, so behaviour is identical either way. (Calls happen
# only after nvmlInit succeeded, so cynvml's library-loading error cannot occur in them.)
ctypedef cynvml.nvmlReturn_t (*fv_fn)(cynvml.nvmlDevice_t, int, cynvml.nvmlFieldValue_t*) noexcept nogil
ctypedef cynvml.nvmlReturn_t (*util_fn)(cynvml.nvmlDevice_t, cynvml.nvmlUtilization_t*) noexcept nogil
ctypedef cynvml.nvmlReturn_t (*mem_fn)(cynvml.nvmlDevice_t, cynvml.nvmlMemory_v2_t*) noexcept nogil
ctypedef cynvml.nvmlReturn_t (*temp_fn)(cynvml.nvmlDevice_t, cynvml.nvmlTemperature_v1_t*) noexcept nogil
ctypedef cynvml.nvmlReturn_t (*uint_fn)(cynvml.nvmlDevice_t, unsigned int*) noexcept nogil
ctypedef cynvml.nvmlReturn_t (*clock_fn)(cynvml.nvmlDevice_t, cynvml.nvmlClockType_t, unsigned int*) noexcept nogil
ctypedef cynvml.nvmlReturn_t (*pcie_fn)(cynvml.nvmlDevice_t, cynvml.nvmlPcieUtilCounter_t, unsigned int*) noexcept nogil

cdef cynvml.nvmlReturn_t _w_fv(cynvml.nvmlDevice_t d, int n, cynvml.nvmlFieldValue_t* v) noexcept nogil:
    return cynvml.nvmlDeviceGetFieldValues(d, n, v)

cdef cynvml.nvmlReturn_t _w_util(cynvml.nvmlDevice_t d, cynvml.nvmlUtilization_t* u) noexcept nogil:
    return cynvml.nvmlDeviceGetUtilizationRates(d, u)

cdef cynvml.nvmlReturn_t _w_mem(cynvml.nvmlDevice_t d, cynvml.nvmlMemory_v2_t* m) noexcept nogil:
    return cynvml.nvmlDeviceGetMemoryInfo_v2(d, m)

cdef cynvml.nvmlReturn_t _w_temp(cynvml.nvmlDevice_t d, cynvml.nvmlTemperature_v1_t* t) noexcept nogil:
    return cynvml.nvmlDeviceGetTemperatureV(d, t)

cdef cynvml.nvmlReturn_t _w_power(cynvml.nvmlDevice_t d, unsigned int* p) noexcept nogil:
    return cynvml.nvmlDeviceGetPowerUsage(d, p)

cdef cynvml.nvmlReturn_t _w_clock(cynvml.nvmlDevice_t d, cynvml.nvmlClockType_t t, unsigned int* c) noexcept nogil:
    return cynvml.nvmlDeviceGetClockInfo(d, t, c)

cdef cynvml.nvmlReturn_t _w_pcie(cynvml.nvmlDevice_t d, cynvml.nvmlPcieUtilCounter_t c, unsigned int* v) noexcept nogil:
    return cynvml.nvmlDeviceGetPcieThroughput(d, c, v)


cdef array.array _DOUBLE_TEMPLATE = py_array.array("d")
cdef array.array _INT_TEMPLATE = py_array.array("i")


cdef inline double _field_value(cynvml.nvmlFieldValue_t* v) noexcept nogil:
    cdef int t = <int>v.valueType
    if t == 0:
        return v.value.dVal
    if t == 1:
        return <double>v.value.uiVal
    if t == 2:
        return <double>v.value.ulVal
    if t == 3:
        return <double>v.value.ullVal
    if t == 4:
        return <double>v.value.sllVal
    if t == 5:
        return <double>v.value.siVal
    if t == 6:
        return <double>v.value.usVal
    return 0.0


cdef class Poller:
    """Samples ``fields`` for every device in ``uuids`` on each :meth:`poll`.

    :param uuids: GPU and MIG device UUIDs as NVML reports them.
    :param fields: field names from ``nvmlfields.FIELD_NAMES``; all when ``None``.
    :raises PollerError: NVML cannot be initialised or a UUID is unknown.
    :raises ValueError: an unknown field name.
    """

    cdef cynvml.nvmlDevice_t* _handles
    cdef int* _kinds
    cdef int* _args
    cdef int* _fv_col  # column of each field-value request
    cdef cynvml.nvmlFieldValue_t* _fv  # per-device request/response buffer
    cdef int _n_dev, _n_fields, _n_fv
    cdef bint _open
    cdef readonly tuple devices
    cdef readonly tuple fields
    cdef fv_fn _fv_call
    cdef util_fn _util_call
    cdef mem_fn _mem_call
    cdef temp_fn _temp_call
    cdef uint_fn _power_call
    cdef clock_fn _clock_call
    cdef pcie_fn _pcie_call
    cdef void* _lib
    cdef tuple _index
    cdef object _sample_type
    cdef object _clock

    def __cinit__(self):
        self._lib = NULL
        self._fv_call = _w_fv
        self._util_call = _w_util
        self._mem_call = _w_mem
        self._temp_call = _w_temp
        self._power_call = _w_power
        self._clock_call = _w_clock
        self._pcie_call = _w_pcie
        self._handles = NULL
        self._kinds = NULL
        self._args = NULL
        self._fv_col = NULL
        self._fv = NULL
        self._open = False

    def __init__(self, uuids, fields=None):
        table = nf.resolve_fields(None if fields is None else list(fields))
        self.devices = tuple(uuids)
        self.fields = tuple(f[0] for f in table)
        self._index = nf.make_index(self.devices, self.fields)
        self._sample_type = nf.Sample
        self._clock = time.monotonic
        self._n_dev = len(self.devices)
        self._n_fields = len(table)
        self._kinds = <int*>malloc(sizeof(int) * max(1, self._n_fields))
        self._args = <int*>malloc(sizeof(int) * max(1, self._n_fields))
        self._fv_col = <int*>malloc(sizeof(int) * max(1, self._n_fields))
        self._fv = <cynvml.nvmlFieldValue_t*>malloc(sizeof(cynvml.nvmlFieldValue_t) * max(1, self._n_fields))
        self._handles = <cynvml.nvmlDevice_t*>malloc(sizeof(cynvml.nvmlDevice_t) * max(1, self._n_dev))
        if not (self._kinds and self._args and self._fv_col and self._fv and self._handles):
            raise MemoryError()
        self._n_fv = 0
        cdef int col
        for col, (_, kind, arg) in enumerate(table):
            self._kinds[col] = kind
            self._args[col] = arg
            if kind == KIND_FIELD:
                self._fv_col[self._n_fv] = col
                self._n_fv += 1
        cdef cynvml.nvmlReturn_t rc
        with nogil:
            rc = cynvml.nvmlInit_v2()
        if rc != cynvml.NVML_SUCCESS:
            raise nf.PollerError(<int>rc, "nvmlInit failed")
        self._open = True
        self._resolve()
        cdef bytes raw
        cdef int i
        for i in range(self._n_dev):
            raw = self.devices[i].encode()
            rc = cynvml.nvmlDeviceGetHandleByUUID(raw, &self._handles[i])
            if rc != cynvml.NVML_SUCCESS:
                self.close()
                raise nf.PollerError(<int>rc, f"nvmlDeviceGetHandleByUUID({self.devices[i]!r}) failed")

    cdef void _resolve(self):
        """Point the hot loop at the loaded library's entry points (the copy NVML init just used)."""
        self._lib = dlopen(b"libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD)
        if self._lib == NULL:
            return
        cdef void* p
        p = dlsym(self._lib, b"nvmlDeviceGetFieldValues")
        if p != NULL:
            self._fv_call = <fv_fn>p
        p = dlsym(self._lib, b"nvmlDeviceGetUtilizationRates")
        if p != NULL:
            self._util_call = <util_fn>p
        p = dlsym(self._lib, b"nvmlDeviceGetMemoryInfo_v2")
        if p != NULL:
            self._mem_call = <mem_fn>p
        p = dlsym(self._lib, b"nvmlDeviceGetTemperatureV")
        if p != NULL:
            self._temp_call = <temp_fn>p
        p = dlsym(self._lib, b"nvmlDeviceGetPowerUsage")
        if p != NULL:
            self._power_call = <uint_fn>p
        p = dlsym(self._lib, b"nvmlDeviceGetClockInfo")
        if p != NULL:
            self._clock_call = <clock_fn>p
        p = dlsym(self._lib, b"nvmlDeviceGetPcieThroughput")
        if p != NULL:
            self._pcie_call = <pcie_fn>p

    def __dealloc__(self):
        if self._lib != NULL:
            dlclose(self._lib)
            self._lib = NULL
        if self._open:
            cynvml.nvmlShutdown()
            self._open = False
        free(self._handles)
        free(self._kinds)
        free(self._args)
        free(self._fv_col)
        free(self._fv)

    def close(self):
        """Release the NVML reference taken at construction. Idempotent."""
        if self._open:
            self._open = False
            cynvml.nvmlShutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def poll(self):
        """Sample every device and field once; see ``nvmlfields.Sample``."""
        if not self._open:
            raise nf.PollerError(1, "poller is closed")  # NVML_ERROR_UNINITIALIZED
        started = self._clock()
        cdef Py_ssize_t total = <Py_ssize_t>self._n_dev * self._n_fields
        cdef array.array values = array.clone(_DOUBLE_TEMPLATE, total, zero=False)
        cdef array.array status = array.clone(_INT_TEMPLATE, total, zero=False)
        cdef double* vp = values.data.as_doubles
        cdef int* sp = status.data.as_ints
        cdef int row
        with nogil:
            for row in range(self._n_dev):
                self._sample(self._handles[row], vp + row * self._n_fields, sp + row * self._n_fields)
        return self._sample_type(self.devices, self.fields, values, status, started, self._index)

    cdef int _sample(self, cynvml.nvmlDevice_t handle, double* out, int* st) noexcept nogil:
        cdef cynvml.nvmlUtilization_t util
        cdef cynvml.nvmlMemory_v2_t mem
        cdef cynvml.nvmlTemperature_v1_t temp
        cdef cynvml.nvmlReturn_t util_rc = cynvml.NVML_SUCCESS
        cdef cynvml.nvmlReturn_t mem_rc = cynvml.NVML_SUCCESS
        cdef cynvml.nvmlReturn_t fv_rc = cynvml.NVML_SUCCESS
        cdef cynvml.nvmlReturn_t rc
        cdef bint have_util = False
        cdef bint have_mem = False
        cdef unsigned int u = 0
        cdef int col, k, kind
        cdef double value
        if self._n_fv:
            memset(self._fv, 0, sizeof(cynvml.nvmlFieldValue_t) * self._n_fv)
            for k in range(self._n_fv):
                self._fv[k].fieldId = <unsigned int>self._args[self._fv_col[k]]
            fv_rc = self._fv_call(handle, self._n_fv, self._fv)
            for k in range(self._n_fv):
                col = self._fv_col[k]
                if fv_rc != cynvml.NVML_SUCCESS:
                    st[col] = <int>fv_rc
                    out[col] = 0.0
                else:
                    st[col] = <int>self._fv[k].nvmlReturn
                    out[col] = _field_value(&self._fv[k]) if self._fv[k].nvmlReturn == cynvml.NVML_SUCCESS else 0.0
        for col in range(self._n_fields):
            kind = self._kinds[col]
            value = 0.0
            rc = cynvml.NVML_SUCCESS
            if kind == KIND_FIELD:
                continue
            elif kind == KIND_UTIL_GPU or kind == KIND_UTIL_MEM:
                if not have_util:
                    util_rc = self._util_call(handle, &util)
                    have_util = True
                rc = util_rc
                if rc == cynvml.NVML_SUCCESS:
                    value = <double>(util.gpu if kind == KIND_UTIL_GPU else util.memory)
            elif kind == KIND_MEM_TOTAL or kind == KIND_MEM_USED or kind == KIND_MEM_FREE:
                if not have_mem:
                    mem.version = MEMORY_V2
                    mem_rc = self._mem_call(handle, &mem)
                    have_mem = True
                rc = mem_rc
                if rc == cynvml.NVML_SUCCESS:
                    if kind == KIND_MEM_TOTAL:
                        value = <double>mem.total
                    elif kind == KIND_MEM_USED:
                        value = <double>mem.used
                    else:
                        value = <double>mem.free
            elif kind == KIND_TEMPERATURE:
                temp.version = TEMPERATURE_V1
                temp.sensorType = cynvml.NVML_TEMPERATURE_GPU
                rc = self._temp_call(handle, &temp)
                if rc == cynvml.NVML_SUCCESS:
                    value = <double>temp.temperature
            elif kind == KIND_POWER:
                rc = self._power_call(handle, &u)
                if rc == cynvml.NVML_SUCCESS:
                    value = <double>u
            elif kind == KIND_CLOCK:
                rc = self._clock_call(handle, <cynvml.nvmlClockType_t>self._args[col], &u)
                if rc == cynvml.NVML_SUCCESS:
                    value = <double>u
            elif kind == KIND_PCIE:
                rc = self._pcie_call(handle, <cynvml.nvmlPcieUtilCounter_t>self._args[col], &u)
                if rc == cynvml.NVML_SUCCESS:
                    value = <double>u
            out[col] = value
            st[col] = <int>rc
        return 0
