"""Types of the compiled checksum ``ext/kubeletchecksum.pyx`` (twin: ``dradriver/_native/kubeletchecksum_py.py``)."""

FNV32_OFFSET: int
FNV32_PRIME: int
PREFIX: bytes

def checksum(data: bytes) -> int:
    """FNV-32a of ``([]uint8)[`` + the decimal values of ``data``'s bytes separated by spaces + ``]``."""
