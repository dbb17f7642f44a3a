# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled NVML poller: one call samples every field of every GPU and MIG device with the GIL released.

NVML declarations come from NVIDIA's ``cuda.bindings.cynvml`` (cimported), so nothing here links against NVML
and no struct layout is written by hand. The entry points themselves are resolved with ``dlsym`` from the library
file the poller is given (the NVML session's, :attr:`dradriver.nvml.session.NvmlSession.library`), not through
cynvml's loader: cynvml binds ``libnvidia-ml.so.1`` by name once per process (``cuda.pathfinder``
``load_nvidia_dynamic_lib("nvml")``, cached, with no documented way to point it at another file), and after a
driver reload that loaded the new driver's copy by path a lookup by name still finds the old copy. Fields of kind FIELD are fetched by one
``nvmlDeviceGetFieldValues`` call per device. Results go straight into a C double buffer and a C int
status buffer wrapped as ``array.array``: no Python object per value.

Twin: ``dradriver/_native/nvmlpoll_py.py`` (pynvml); both return the same
:class:`dradriver._native.nvmlfields.Sample`.
"""

from cpython cimport array
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from posix.dlfcn cimport RTLD_NOW, dlclose, dlopen, dlsym

import array as py_array
import os
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

# Entry points, resolved once per poller from the poller's library file (the hot loop then calls NVML directly, as
# C code does). Signatures are those of cuda.bindings.cynvml. Init, shutdown and the UUID lookup must resolve; a
# sampling symbol an older driver lacks is the cynvml wrapper instead (which answers FUNCTION_NOT_FOUND).
ctypedef cynvml.nvmlReturn_t (*init_fn)() noexcept nogil
ctypedef cynvml.nvmlReturn_t (*by_uuid_fn)(const char*, cynvml.nvmlDevice_t*) noexcept nogil
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


_DEFAULT_LIBRARY = "libnvidia-ml.so.1"
cdef int NVML_ERROR_LIBRARY_NOT_FOUND = 12
cdef int NVML_ERROR_FUNCTION_NOT_FOUND = 13


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
    :param library: the ``libnvidia-ml.so.1`` file to use (the NVML session's); ``None``: the one the dynamic
        loader finds by that name.
    :raises PollerError: the library cannot be opened (LIBRARY_NOT_FOUND) or lacks an entry point
        (FUNCTION_NOT_FOUND), NVML cannot be initialised, or a UUID is unknown.
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
    cdef init_fn _shutdown_call
    cdef void* _lib
    cdef readonly str library
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

    def __init__(self, uuids, fields=None, library=None):
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
        self.library = library or _DEFAULT_LIBRARY
        # A path is opened by its target: the loader remembers every name an object was opened by, so the
        # ``libnvidia-ml.so.1`` link, once opened for the old driver's file, would name the old copy for good.
        cdef bytes target = (os.path.realpath(self.library) if "/" in self.library else self.library).encode()
        self._lib = dlopen(target, RTLD_NOW)
        if self._lib == NULL:
            raise nf.PollerError(NVML_ERROR_LIBRARY_NOT_FOUND, f"cannot load NVML library {self.library}")
        cdef init_fn init = <init_fn>dlsym(self._lib, b"nvmlInit_v2")
        cdef by_uuid_fn by_uuid = <by_uuid_fn>dlsym(self._lib, b"nvmlDeviceGetHandleByUUID")
        self._shutdown_call = <init_fn>dlsym(self._lib, b"nvmlShutdown")
        if init == NULL or by_uuid == NULL or self._shutdown_call == NULL:
            raise nf.PollerError(NVML_ERROR_FUNCTION_NOT_FOUND, f"{self.library} is not an NVML library")
        cdef cynvml.nvmlReturn_t rc
        with nogil:
            rc = init()
        if rc != cynvml.NVML_SUCCESS:
            raise nf.PollerError(<int>rc, f"nvmlInit failed ({self.library})")
        self._open = True
        self._resolve()
        cdef bytes raw
        cdef int i
        for i in range(self._n_dev):
            raw = self.devices[i].encode()
            rc = by_uuid(raw, &self._handles[i])
            if rc != cynvml.NVML_SUCCESS:
                self.close()
                raise nf.PollerError(<int>rc, f"nvmlDeviceGetHandleByUUID({self.devices[i]!r}) failed")

    cdef void _resolve(self):
        """Point the hot loop at the entry points of the poller's library (the copy its init just used)."""
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
        if self._open:
            self._shutdown_call()
            self._open = False
        if self._lib != NULL:
            dlclose(self._lib)
            self._lib = NULL
        free(self._handles)
        free(self._kinds)
        free(self._args)
        free(self._fv_col)
        free(self._fv)

    def close(self):
        """Release the NVML reference taken at construction. Idempotent."""
        if self._open:
            self._open = False
            self._shutdown_call()

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
