"""Types of the compiled claim store core ``ext/claimstore.pyx`` (twin: ``dradriver/_native/claimstore_py.py``).

The exception classes are the twin's own (the compiled module imports them from there).
"""

from collections.abc import Sequence
from typing import TypeAlias

from dradriver._native.claimstore_py import ClaimConflictError as ClaimConflictError
from dradriver._native.claimstore_py import ClaimRecordError as ClaimRecordError
from dradriver._native.claimstore_py import ClaimStateCorruptError as ClaimStateCorruptError
from dradriver._native.claimstore_py import ClaimStateError as ClaimStateError
from dradriver._native.claimstore_py import ClaimStateVersionError as ClaimStateVersionError
from dradriver._native.claimstore_py import ClaimUnknownError as ClaimUnknownError

# (request_names, pool, device, cdi_device_ids, admin_access), as stored and as returned
_Device: TypeAlias = tuple[tuple[str, ...], str, str, tuple[str, ...], bool]
# what a mutation accepts: the name lists may be lists
_DeviceIn: TypeAlias = tuple[tuple[str, ...] | list[str], str, str, tuple[str, ...] | list[str], bool]
# (state, namespace, name, devices, payload)
_Record: TypeAlias = tuple[int, str, str, tuple[_Device, ...], bytes | str]

MAGIC: bytes
FORMAT_VERSION: int
READABLE_VERSIONS: tuple[int, ...]
STATE_PREPARE_STARTED: int
STATE_PREPARE_COMPLETED: int
RECORD_PUT: int
RECORD_DELETE: int
APPLY_OK: int
APPLY_TORN: int
APPLY_BAD_FRAME: int
APPLY_BAD_RECORD: int
FRAME_HEAD_SIZE: int
MAX_STR: int
MAX_COUNT: int
MAX_PAYLOAD: int

def crc32(data: bytes, value: int = 0) -> int:
    """CRC-32 (zlib polynomial 0xEDB88320) of ``data``, continuing from ``value``."""

def encode_header(boot_id: str, version: int = ...) -> bytes:
    """Return the journal header stamped with ``boot_id``.

    :raises ClaimRecordError: ``boot_id`` is not a string or is longer than 65535 bytes.
    """

def decode_header(data: bytes) -> tuple[int, str, int]:
    """Parse the header at the start of ``data``; return ``(version, boot_id, header_len)``.

    :raises ClaimStateCorruptError: wrong magic, short header, or header CRC mismatch.
    :raises ClaimStateVersionError: a version newer than :data:`FORMAT_VERSION` or one not readable.
    """

def append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the descriptor's position, then ``fdatasync`` (GIL released).

    :raises OSError: from ``write``/``fdatasync``.
    """

class Table:
    """The claim table: claim UID -> record, plus the index of devices held without admin access."""

    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    @property
    def live_bytes(self) -> int:
        """Bytes the live records take in a snapshot (sum of their PUT frames)."""

    def uids(self) -> list[str]:
        """Claim UIDs in table order (first insertion)."""

    def get(self, uid: str) -> _Record | None:
        """The record of ``uid``, or ``None``."""

    def holder(self, pool: str, device: str) -> str | None:
        """UID of the claim holding ``pool``/``device`` without admin access, or ``None``."""

    def snapshot(self) -> bytes:
        """Every live PUT frame, in table order: the body of a compacted journal."""

    def prepare_started(
        self, uid: str, namespace: str, name: str, devices: Sequence[_DeviceIn], payload: bytes | str
    ) -> bytes:
        """Record ``uid`` as PREPARE_STARTED (replacing any record of that UID); return the frame.

        :raises ClaimRecordError: a field cannot be encoded.
        :raises ClaimConflictError: a non-admin device is held by another claim.
        """

    def prepare_completed(self, uid: str, devices: Sequence[_DeviceIn] | None, payload: bytes | str | None) -> bytes:
        """Mark ``uid`` PREPARE_COMPLETED, replacing devices/payload when given; return the frame.

        :raises ClaimUnknownError: ``uid`` is not in the table.
        :raises ClaimRecordError: a field cannot be encoded.
        :raises ClaimConflictError: a new non-admin device is held by another claim.
        """

    def remove(self, uid: str) -> bytes:
        """Forget ``uid``; return its DELETE frame, or ``b""`` when it was not in the table."""

    def apply(self, data: bytes, offset: int, version: int) -> tuple[int, int, int]:
        """Apply the frames in ``data[offset:]`` without conflict checks; return ``(status, stop, resume)``."""
