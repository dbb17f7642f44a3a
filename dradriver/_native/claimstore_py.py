"""Claim store core, pure-Python twin of ``ext/claimstore.pyx``: the claim table and its journal encoding.

This module is the source of truth for the on-disk format and for the exception types; the compiled
module imports the exception classes from here, so both raise the very same classes. It does no file
handling beyond :func:`append` (one ``write`` loop and ``fdatasync`` on a descriptor the caller owns);
opening, locking, recovery and compaction live in :mod:`dradriver.host.claimstate`.

Journal file layout, format version 1 (all integers little-endian):

``header``
    ``magic`` 8 bytes ``b"DRACLAIM"``, ``version`` u16, ``reserved`` u16 (0), ``boot_len`` u32,
    ``boot_id`` (``boot_len`` bytes, UTF-8, from ``/proc/sys/kernel/random/boot_id``), ``crc`` u32 =
    CRC-32 (zlib polynomial) of every header byte before it.
``frame`` (repeated to the end of the file)
    ``body_len`` u32, ``body_crc`` u32 = CRC-32 of the body, ``head_crc`` u32 = CRC-32 of the 8 bytes
    before it, then ``body``. The head CRC makes the length trustworthy, so a damaged length in the middle
    of the file is told apart from a record cut short at the end (a torn tail).
``body``
    ``PUT`` (type 1): type u8, state u8 (1 = PREPARE_STARTED, 2 = PREPARE_COMPLETED), ``str`` uid,
    ``str`` namespace, ``str`` name, u16 device count, devices, payload kind u8 (0 bytes, 1 str),
    payload length u32, payload bytes. A device: u16 request count, ``str`` requests, ``str`` pool,
    ``str`` device, u16 CDI ID count, ``str`` CDI IDs, admin access u8 (0/1).
    ``DELETE`` (type 2): type u8, ``str`` uid.
    ``str`` is a u16 byte length and UTF-8 bytes.

A PUT carries the whole record, so the live table is always "last PUT per uid unless deleted", and a
snapshot (compaction) is the concatenation of the stored PUT frames.

Shapes used across the API: a *device* is ``(request_names: tuple[str, ...], pool: str, device: str,
cdi_device_ids: tuple[str, ...], admin_access: bool)``; a *record* is ``(state: int, namespace: str,
name: str, devices: tuple[device, ...], payload: bytes | str)``.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence

from dradriver.errors import DradriverError

MAGIC = b"DRACLAIM"
FORMAT_VERSION = 1
#: Versions this code reads; a file of an older listed version is migrated by the next compaction.
READABLE_VERSIONS = (1,)

STATE_PREPARE_STARTED = 1
STATE_PREPARE_COMPLETED = 2

RECORD_PUT = 1
RECORD_DELETE = 2

#: :meth:`Table.apply` outcomes.
APPLY_OK = 0  # every frame up to the end of the data was applied
APPLY_TORN = 1  # the last frame is incomplete: a write cut short by a crash, never acknowledged
APPLY_BAD_FRAME = 2  # a frame head fails its CRC with data after it: nothing after it can be framed
APPLY_BAD_RECORD = 3  # a complete frame whose body fails its CRC or does not decode: skippable

FRAME_HEAD_SIZE = 12
MAX_STR = 0xFFFF
MAX_COUNT = 0xFFFF
MAX_PAYLOAD = 0x7FFFFFFF

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<II")
_HDR_FIXED = struct.Struct("<8sHHI")


class ClaimStateError(DradriverError):
    """Base class of claim-state errors."""


class ClaimStateCorruptError(ClaimStateError):
    """The claim-state file is damaged (bad header, a record failing its checksum, unreadable bytes).

    :param header_len: for a damaged header, the header length its fixed part declares when that is
        plausible (records may still be read after it), else 0.
    """

    #: set by :meth:`dradriver.host.claimstate.ClaimState.open` when it recovered what it could: the
    #: problems found and the usable, recovered store (the damaged file was kept aside).
    problems: tuple[object, ...] = ()
    state: object = None

    def __init__(self, message: str, *, header_len: int = 0) -> None:
        super().__init__(message)
        self.header_len = header_len


class ClaimStateVersionError(ClaimStateError):
    """The claim-state file was written in a format version this code does not read (a newer plugin)."""


class ClaimRecordError(ClaimStateError, ValueError):
    """A claim record cannot be stored: a field has the wrong type, is empty, or is too long."""


class ClaimConflictError(ClaimStateError):
    """A device is already held (without admin access) by another claim.

    :param uid: the claim being prepared; ``holder``: the claim that holds ``pool``/``device``.
    """

    def __init__(self, uid: str, holder: str, pool: str, device: str, message: str = "") -> None:
        super().__init__(
            message or f"claim {uid}: device {pool}/{device} is already prepared for claim {holder}"
        )
        self.uid = uid
        self.holder = holder
        self.pool = pool
        self.device = device


class ClaimUnknownError(ClaimStateError):
    """The claim UID is not in the table (e.g. completing a prepare after the claim was unprepared)."""


def crc32(data: bytes, value: int = 0) -> int:
    """CRC-32 (zlib polynomial 0xEDB88320) of ``data``, continuing from ``value``."""
    return zlib.crc32(data, value)


def encode_header(boot_id: str, version: int = FORMAT_VERSION) -> bytes:
    """Return the journal header stamped with ``boot_id``.

    :raises ClaimRecordError: ``boot_id`` is not a string or is longer than 65535 bytes.
    """
    if not isinstance(boot_id, str):
        raise ClaimRecordError("boot ID must be a string")
    raw = _utf8(boot_id, "boot ID")
    head = _HDR_FIXED.pack(MAGIC, version, 0, len(raw)) + raw
    return head + _U32.pack(zlib.crc32(head))


def decode_header(data: bytes) -> tuple[int, str, int]:
    """Parse the header at the start of ``data``; return ``(version, boot_id, header_len)``.

    :raises ClaimStateCorruptError: wrong magic, short header, or header CRC mismatch.
    :raises ClaimStateVersionError: a version newer than :data:`FORMAT_VERSION` or one not readable.
    """
    fixed = _HDR_FIXED.size
    if len(data) < fixed:
        raise ClaimStateCorruptError(f"header is {len(data)} bytes, shorter than the {fixed}-byte minimum")
    magic, version, _reserved, boot_len = _HDR_FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise ClaimStateCorruptError(f"bad magic {magic!r} (expected {MAGIC!r}): not a claim-state journal")
    header_len = fixed + boot_len + 4
    plausible = header_len if boot_len <= MAX_STR else 0
    if len(data) < header_len or boot_len > MAX_STR:
        raise ClaimStateCorruptError(
            f"header declares a {boot_len}-byte boot ID but the file is {len(data)} bytes",
            header_len=plausible if len(data) >= header_len else 0,
        )
    (stored,) = _U32.unpack_from(data, header_len - 4)
    if zlib.crc32(data[: header_len - 4]) != stored:
        raise ClaimStateCorruptError("header checksum mismatch", header_len=plausible)
    if version > FORMAT_VERSION:
        raise ClaimStateVersionError(
            f"claim-state format version {version} is newer than the versions this plugin reads "
            f"({', '.join(map(str, READABLE_VERSIONS))}); it was written by a newer plugin"
        )
    if version not in READABLE_VERSIONS:
        raise ClaimStateVersionError(f"claim-state format version {version} is not a known version")
    try:
        boot_id = bytes(data[fixed : fixed + boot_len]).decode("utf-8")
    except UnicodeDecodeError:
        raise ClaimStateCorruptError("boot ID in the header is not UTF-8", header_len=plausible) from None
    return version, boot_id, header_len


def append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the descriptor's position (open it with ``O_APPEND``), then ``fdatasync``.

    :raises OSError: from ``write``/``fdatasync``.
    """
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    os.fdatasync(fd)


def _utf8(value: str, what: str) -> bytes:
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise ClaimRecordError(f"{what} is not encodable as UTF-8") from None
    if len(raw) > MAX_STR:
        raise ClaimRecordError(f"{what} is {len(raw)} bytes long, more than {MAX_STR}")
    return raw


def _str(value: object, what: str, parts: list[bytes]) -> None:
    if not isinstance(value, str):
        raise ClaimRecordError(f"{what} must be a string, not {type(value).__name__}")
    raw = _utf8(value, what)
    parts.append(_U16.pack(len(raw)))
    parts.append(raw)


def _strs(values: object, what: str, parts: list[bytes]) -> None:
    if not isinstance(values, tuple | list):
        raise ClaimRecordError(f"{what} must be a tuple or list of strings")
    if len(values) > MAX_COUNT:
        raise ClaimRecordError(f"{what} has {len(values)} entries, more than {MAX_COUNT}")
    parts.append(_U16.pack(len(values)))
    for value in values:
        _str(value, what, parts)


def _frame(body: bytes) -> bytes:
    head = _HEAD.pack(len(body), zlib.crc32(body))
    return head + _U32.pack(zlib.crc32(head)) + body


def _encode_put(uid: object, state: int, namespace: object, name: object, devices: object,
                payload: object) -> tuple[bytes, list[str]]:
    """Return the PUT frame and the holder keys of its non-admin devices."""
    parts: list[bytes] = [bytes((RECORD_PUT, state))]
    if not isinstance(uid, str) or not uid:
        raise ClaimRecordError("claim UID must be a non-empty string")
    _str(uid, "claim UID", parts)
    _str(namespace, "namespace", parts)
    _str(name, "name", parts)
    if not isinstance(devices, tuple | list):
        raise ClaimRecordError("devices must be a tuple or list of device tuples")
    if len(devices) > MAX_COUNT:
        raise ClaimRecordError(f"devices has {len(devices)} entries, more than {MAX_COUNT}")
    parts.append(_U16.pack(len(devices)))
    keys: list[str] = []
    for device in devices:
        if not isinstance(device, tuple) or len(device) != 5:
            raise ClaimRecordError(
                "a device must be a tuple (request_names, pool, device, cdi_device_ids, admin_access)"
            )
        requests, pool, dev, cdi_ids, admin = device
        _strs(requests, "request names", parts)
        _str(pool, "pool", parts)
        _str(dev, "device name", parts)
        _strs(cdi_ids, "CDI device IDs", parts)
        if not isinstance(admin, bool):
            raise ClaimRecordError("admin_access must be a bool")
        parts.append(b"\x01" if admin else b"\x00")
        if not admin:
            keys.append(pool + "\x00" + dev)
    if isinstance(payload, bytes):
        raw, kind = payload, 0
    elif isinstance(payload, str):
        try:
            raw, kind = payload.encode("utf-8"), 1
        except UnicodeEncodeError:
            raise ClaimRecordError("payload is not encodable as UTF-8") from None
    else:
        raise ClaimRecordError("payload must be bytes or str")
    if len(raw) > MAX_PAYLOAD:
        raise ClaimRecordError(f"payload is {len(raw)} bytes long, more than {MAX_PAYLOAD}")
    parts.append(bytes((kind,)))
    parts.append(_U32.pack(len(raw)))
    parts.append(raw)
    return _frame(b"".join(parts)), keys


class _Malformed(Exception):
    pass


class _Reader:
    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int, end: int) -> None:
        self.data = data
        self.pos = pos
        self.end = end

    def take(self, n: int) -> bytes:
        if self.end - self.pos < n:
            raise _Malformed
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        if self.pos >= self.end:
            raise _Malformed
        self.pos += 1
        return self.data[self.pos - 1]

    def u16(self) -> int:
        return int(_U16.unpack(self.take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def str(self) -> str:
        try:
            return self.take(self.u16()).decode("utf-8")
        except UnicodeDecodeError:
            raise _Malformed from None


def _decode_body(body: bytes, version: int) -> tuple[int, str, tuple[object, ...] | None]:
    """Decode one record body: ``(type, uid, record-or-None)``. Version dispatch point for future formats.

    :raises _Malformed: the body does not decode.
    """
    del version  # version 1 is the only layout so far; a v2 reader keeps this branch for v1 files
    rd = _Reader(body, 0, len(body))
    kind = rd.u8()
    if kind == RECORD_DELETE:
        uid = rd.str()
        if rd.pos != rd.end or not uid:
            raise _Malformed
        return kind, uid, None
    if kind != RECORD_PUT:
        raise _Malformed
    state = rd.u8()
    if state not in (STATE_PREPARE_STARTED, STATE_PREPARE_COMPLETED):
        raise _Malformed
    uid = rd.str()
    namespace = rd.str()
    name = rd.str()
    devices = []
    for _ in range(rd.u16()):
        requests = tuple(rd.str() for _ in range(rd.u16()))
        pool = rd.str()
        dev = rd.str()
        cdi_ids = tuple(rd.str() for _ in range(rd.u16()))
        admin = rd.u8()
        if admin > 1:
            raise _Malformed
        devices.append((requests, pool, dev, cdi_ids, bool(admin)))
    payload_kind = rd.u8()
    raw = rd.take(rd.u32())
    if rd.pos != rd.end or not uid or payload_kind > 1:
        raise _Malformed
    payload: bytes | str
    if payload_kind == 1:
        try:
            payload = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Malformed from None
    else:
        payload = raw
    return kind, uid, (state, namespace, name, tuple(devices), payload)


def _holder_keys(record: tuple[object, ...]) -> list[str]:
    devices = record[3]
    assert isinstance(devices, tuple)
    return [d[1] + "\x00" + d[2] for d in devices if not d[4]]


class Table:
    """The claim table: claim UID -> record, plus the index of devices held without admin access.

    Each live claim is kept as its encoded PUT frame (compact: about the size of the record on disk)
    and decoded on :meth:`get`. Mutations validate, check conflicts, apply, and return the frame to
    append to the journal; the caller appends it.
    """

    def __init__(self) -> None:
        self._frames: dict[str, bytes] = {}
        self._holders: dict[str, str] = {}
        self._live_bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def live_bytes(self) -> int:
        """Bytes the live records take in a snapshot (sum of their PUT frames)."""
        return self._live_bytes

    def uids(self) -> list[str]:
        """Claim UIDs in table order (first insertion)."""
        return list(self._frames)

    def get(self, uid: str) -> tuple[object, ...] | None:
        """The record of ``uid`` (see the module docstring), or ``None``."""
        frame = self._frames.get(uid)
        if frame is None:
            return None
        return _decode_body(frame[FRAME_HEAD_SIZE:], FORMAT_VERSION)[2]

    def holder(self, pool: str, device: str) -> str | None:
        """UID of the claim holding ``pool``/``device`` without admin access, or ``None``."""
        return self._holders.get(pool + "\x00" + device)

    def snapshot(self) -> bytes:
        """Every live PUT frame, in table order: the body of a compacted journal."""
        return b"".join(self._frames.values())

    def prepare_started(self, uid: str, namespace: str, name: str, devices: Sequence[tuple[object, ...]],
                        payload: bytes | str) -> bytes:
        """Record ``uid`` as PREPARE_STARTED (replacing any record of that UID); return the frame.

        :raises ClaimRecordError: a field cannot be encoded.
        :raises ClaimConflictError: a non-admin device is held by another claim.
        """
        frame, keys = _encode_put(uid, STATE_PREPARE_STARTED, namespace, name, devices, payload)
        self._check_conflicts(uid, keys)
        self._put(uid, frame, keys)
        return frame

    def prepare_completed(self, uid: str, devices: Sequence[tuple[object, ...]] | None,
                          payload: bytes | str | None) -> bytes:
        """Mark ``uid`` PREPARE_COMPLETED, replacing devices/payload when given; return the frame.

        :raises ClaimUnknownError: ``uid`` is not in the table.
        :raises ClaimRecordError: a field cannot be encoded.
        :raises ClaimConflictError: a new non-admin device is held by another claim.
        """
        if not isinstance(uid, str):
            raise ClaimRecordError("claim UID must be a non-empty string")
        old = self.get(uid)
        if old is None:
            raise ClaimUnknownError(f"claim {uid} is not prepared (it was unprepared or never started)")
        frame, keys = _encode_put(
            uid,
            STATE_PREPARE_COMPLETED,
            old[1],
            old[2],
            old[3] if devices is None else devices,
            old[4] if payload is None else payload,
        )
        self._check_conflicts(uid, keys)
        self._put(uid, frame, keys)
        return frame

    def remove(self, uid: str) -> bytes:
        """Forget ``uid``; return its DELETE frame, or ``b""`` when it was not in the table."""
        if not isinstance(uid, str):
            raise ClaimRecordError("claim UID must be a non-empty string")
        if uid not in self._frames:
            return b""
        parts: list[bytes] = [bytes((RECORD_DELETE,))]
        _str(uid, "claim UID", parts)
        self._delete(uid)
        return _frame(b"".join(parts))

    def apply(self, data: bytes, offset: int, version: int) -> tuple[int, int, int]:
        """Apply the frames in ``data[offset:]`` (journal bytes after the header) without conflict checks.

        Stops at the end or at the first problem. Returns ``(status, stop, resume)``: ``status`` one of
        ``APPLY_*``; ``stop`` the offset of the first frame not applied (``len(data)`` when OK);
        ``resume`` where reading may continue after a skippable ``APPLY_BAD_RECORD`` (else ``stop``).
        """
        end = len(data)
        pos = offset
        while pos < end:
            if end - pos < FRAME_HEAD_SIZE:
                return APPLY_TORN, pos, pos
            body_len, body_crc = _HEAD.unpack_from(data, pos)
            (head_crc,) = _U32.unpack_from(data, pos + 8)
            if zlib.crc32(data[pos : pos + 8]) != head_crc:
                if data.count(0, pos) == end - pos:
                    return APPLY_TORN, pos, pos  # zero-filled tail: size grew, data never reached disk
                return APPLY_BAD_FRAME, pos, pos
            nxt = pos + FRAME_HEAD_SIZE + body_len
            if nxt > end:
                return APPLY_TORN, pos, pos
            body = data[pos + FRAME_HEAD_SIZE : nxt]
            if zlib.crc32(body) != body_crc:
                if nxt == end:
                    return APPLY_TORN, pos, pos
                return APPLY_BAD_RECORD, pos, nxt
            try:
                _kind, uid, record = _decode_body(body, version)
            except _Malformed:
                return APPLY_BAD_RECORD, pos, nxt
            if record is None:
                if uid in self._frames:
                    self._delete(uid)
            else:
                frame = data[pos:nxt] if version == FORMAT_VERSION else _encode_put(
                    uid, int(record[0]), *record[1:])[0]  # type: ignore[call-overload]
                self._put(uid, bytes(frame), _holder_keys(record))
            pos = nxt
        return APPLY_OK, end, end

    def _check_conflicts(self, uid: str, keys: list[str]) -> None:
        for key in keys:
            holder = self._holders.get(key)
            if holder is not None and holder != uid:
                pool, _, device = key.partition("\x00")
                raise ClaimConflictError(uid, holder, pool, device)

    def _put(self, uid: str, frame: bytes, keys: list[str]) -> None:
        if uid in self._frames:
            self._delete_keys(uid)
            self._live_bytes -= len(self._frames[uid])
        self._frames[uid] = frame
        self._live_bytes += len(frame)
        for key in keys:
            self._holders[key] = uid

    def _delete(self, uid: str) -> None:
        self._delete_keys(uid)
        self._live_bytes -= len(self._frames.pop(uid))

    def _delete_keys(self, uid: str) -> None:
        record = self.get(uid)
        assert record is not None
        for key in _holder_keys(record):
            if self._holders.get(key) == uid:
                del self._holders[key]
