# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
"""The kubelet checkpoint manager's checksum, compiled: FNV-32a over go-spew's ``%#v`` rendering of a byte slice,
hashed digit by digit without building the text. Same results as the twin ``dradriver._native.kubeletchecksum_py``
(which documents the rule)."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t

FNV32_OFFSET = 0x811C9DC5
FNV32_PRIME = 0x01000193
PREFIX = b"([]uint8)["

cdef uint32_t _OFFSET = 0x811C9DC5
cdef uint32_t _PRIME = 0x01000193


cdef inline uint32_t _step(uint32_t h, unsigned char c) nogil:
    return (h ^ c) * _PRIME


def checksum(bytes data) -> int:
    """FNV-32a of ``([]uint8)[`` + the decimal values of ``data``'s bytes separated by spaces + ``]``."""
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), i
    cdef uint32_t h = _OFFSET
    cdef const unsigned char *prefix = <const unsigned char *>b"([]uint8)["
    cdef unsigned char b
    with nogil:
        for i in range(10):
            h = _step(h, prefix[i])
        for i in range(n):
            if i:
                h = _step(h, 32)
            b = p[i]
            if b >= 100:
                h = _step(h, 48 + b // 100)
                h = _step(h, 48 + (b // 10) % 10)
            elif b >= 10:
                h = _step(h, 48 + b // 10)
            h = _step(h, 48 + b % 10)
        h = _step(h, 93)
    return h
