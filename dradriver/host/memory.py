"""Giving the C heap's free pages back to the kernel once start-up is over (resident memory, issue 17).

Start-up allocates and frees a lot (module code, the client library's schema building, NVML discovery); glibc's
allocator keeps the freed pages mapped, so they stay in the process's RSS although nothing uses them.
``malloc_trim(0)`` (glibc 2.8+) returns every whole free page of every arena with ``madvise(MADV_DONTNEED)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["trim_heap"]

log = logging.getLogger(__name__)


def trim_heap() -> bool:
    """Return the allocator's free pages to the kernel; False where the C library has no ``malloc_trim``
    (musl, other platforms), where nothing is done."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    released = bool(trim(0))
    log.debug("malloc_trim: %s", "memory released" if released else "nothing to release")
    return True
