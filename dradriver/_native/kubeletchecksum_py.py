"""The kubelet checkpoint manager's checksum (pure-Python twin of ``ext/kubeletchecksum.pyx``).

The kubelet's ``pkg/kubelet/checkpointmanager/checksum`` (kubernetes/kubernetes), which NVIDIA's DRA plugins use
for ``checkpoint.json``: ``hashutil.DeepHashObject`` = FNV-32a (``hash/fnv.New32a``) over go-spew's ``%#v``
rendering of the JSON byte slice, i.e. the text ``([]uint8)[`` + each byte's decimal value, separated by single
spaces, + ``]``; stored as an unsigned integer.
"""

from __future__ import annotations

FNV32_OFFSET = 0x811C9DC5
"""FNV-32 offset basis."""
FNV32_PRIME = 0x01000193
"""FNV-32 prime."""
PREFIX = b"([]uint8)["
"""go-spew's ``%#v`` prefix of a ``[]byte``."""

_DECIMAL = [b"%d" % i for i in range(256)]


def checksum(data: bytes) -> int:
    """FNV-32a of ``([]uint8)[`` + the decimal values of ``data``'s bytes separated by spaces + ``]``."""
    h = FNV32_OFFSET
    for byte in PREFIX + b" ".join([_DECIMAL[b] for b in data]) + b"]":
        h = ((h ^ byte) * FNV32_PRIME) & 0xFFFFFFFF
    return h
