# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
"""Claim store core, compiled: the claim table and its journal encoding, CRC-32 and append in C.

Same API, same bytes and same exception classes as the twin ``dradriver._native.claimstore_py``
(which documents the on-disk format and defines the exception classes this module raises).
The table keeps each live claim as its encoded PUT frame in a dict (compact, and a snapshot is a
concatenation); the device-holder index is a dict keyed ``pool + "\\0" + device``.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_SetFromErrno
from libc.stdint cimport uint8_t, uint16_t, uint32_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t *size) except NULL
    object PyUnicode_DecodeUTF8(const char *s, Py_ssize_t size, const char *errors)

cdef extern from "unistd.h" nogil:
    ssize_t c_write "write"(int fd, const void *buf, size_t count)
    int c_fdatasync "fdatasync"(int fd)

cdef extern from "errno.h":
    int errno
    int EINTR

from dradriver._native.claimstore_py import (  # the twin owns the exception classes: one set for both
    ClaimConflictError,
    ClaimRecordError,
    ClaimStateCorruptError,
    ClaimStateError,
    ClaimStateVersionError,
    ClaimUnknownError,
)

MAGIC = b"DRACLAIM"
FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)
STATE_PREPARE_STARTED = 1
STATE_PREPARE_COMPLETED = 2
RECORD_PUT = 1
RECORD_DELETE = 2
APPLY_OK = 0
APPLY_TORN = 1
APPLY_BAD_FRAME = 2
APPLY_BAD_RECORD = 3
FRAME_HEAD_SIZE = 12
MAX_STR = 0xFFFF
MAX_COUNT = 0xFFFF
MAX_PAYLOAD = 0x7FFFFFFF

cdef enum:
    CS_FRAME_HEAD = 12
    CS_HDR_FIXED = 16
    CS_MAX_STR = 0xFFFF
    CS_MAX_COUNT = 0xFFFF
    CS_MAX_PAYLOAD = 0x7FFFFFFF

cdef const char *CS_MAGIC = b"DRACLAIM"

cdef uint32_t cs_crc_table[256]


cdef void cs_crc_init() noexcept:
    cdef uint32_t c
    cdef int n, k
    for n in range(256):
        c = <uint32_t>n
        for k in range(8):
            if c & 1:
                c = 0xEDB88320U ^ (c >> 1)
            else:
                c = c >> 1
        cs_crc_table[n] = c


cs_crc_init()


cdef inline uint32_t cs_crc32(const unsigned char *p, Py_ssize_t n, uint32_t value) noexcept nogil:
    cdef uint32_t c = ~value
    cdef Py_ssize_t i
    for i in range(n):
        c = cs_crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8)
    return ~c


cdef inline uint32_t cs_get_u32(const unsigned char *p) noexcept nogil:
    return (<uint32_t>p[0]) | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline void cs_set_u32(unsigned char *p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


def crc32(data, value=0):
    """CRC-32 (zlib polynomial 0xEDB88320) of ``data``, continuing from ``value``."""
    cdef const unsigned char[:] view = data
    if view.shape[0] == 0:
        return int(value) & 0xFFFFFFFF
    return cs_crc32(&view[0], view.shape[0], <uint32_t>value)


# ---- growable output buffer -------------------------------------------------------------------

cdef struct cs_buf:
    unsigned char *data
    Py_ssize_t len
    Py_ssize_t cap


cdef int cs_reserve(cs_buf *b, Py_ssize_t n) except -1:
    cdef Py_ssize_t cap
    cdef unsigned char *p
    if b.len + n <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 512
    while cap < b.len + n:
        cap *= 2
    p = <unsigned char *>realloc(b.data, cap)
    if p == NULL:
        raise MemoryError()
    b.data = p
    b.cap = cap
    return 0


cdef inline int cs_put_u8(cs_buf *b, unsigned int v) except -1:
    cs_reserve(b, 1)
    b.data[b.len] = v & 0xFF
    b.len += 1
    return 0


cdef inline int cs_put_u16(cs_buf *b, Py_ssize_t v) except -1:
    cs_reserve(b, 2)
    b.data[b.len] = v & 0xFF
    b.data[b.len + 1] = (v >> 8) & 0xFF
    b.len += 2
    return 0


cdef inline int cs_put_u32(cs_buf *b, Py_ssize_t v) except -1:
    cs_reserve(b, 4)
    cs_set_u32(b.data + b.len, <uint32_t>v)
    b.len += 4
    return 0


cdef int cs_put_raw(cs_buf *b, const char *p, Py_ssize_t n) except -1:
    cs_reserve(b, n)
    if n:
        memcpy(b.data + b.len, p, n)
    b.len += n
    return 0


cdef const char *cs_utf8(object value, str what, Py_ssize_t *n) except NULL:
    cdef const char *p
    try:
        p = PyUnicode_AsUTF8AndSize(value, n)
    except UnicodeEncodeError:
        raise ClaimRecordError(f"{what} is not encodable as UTF-8") from None
    if n[0] > CS_MAX_STR:
        raise ClaimRecordError(f"{what} is {n[0]} bytes long, more than {CS_MAX_STR}")
    return p


cdef int cs_put_str(cs_buf *b, object value, str what) except -1:
    cdef Py_ssize_t n
    cdef const char *p
    if not isinstance(value, str):
        raise ClaimRecordError(f"{what} must be a string, not {type(value).__name__}")
    p = cs_utf8(value, what, &n)
    cs_put_u16(b, n)
    cs_put_raw(b, p, n)
    return 0


cdef int cs_put_strs(cs_buf *b, object values, str what) except -1:
    if not isinstance(values, (tuple, list)):
        raise ClaimRecordError(f"{what} must be a tuple or list of strings")
    cdef Py_ssize_t count = len(values)
    if count > CS_MAX_COUNT:
        raise ClaimRecordError(f"{what} has {count} entries, more than {CS_MAX_COUNT}")
    cs_put_u16(b, count)
    for value in values:
        cs_put_str(b, value, what)
    return 0


cdef bytes cs_finish_frame(cs_buf *b):
    """``b`` holds 12 reserved bytes then a body: fill the frame head, return the frame as bytes."""
    cdef Py_ssize_t body_len = b.len - CS_FRAME_HEAD
    cs_set_u32(b.data, <uint32_t>body_len)
    cs_set_u32(b.data + 4, cs_crc32(b.data + CS_FRAME_HEAD, body_len, 0))
    cs_set_u32(b.data + 8, cs_crc32(b.data, 8, 0))
    return PyBytes_FromStringAndSize(<char *>b.data, b.len)


# ---- header -----------------------------------------------------------------------------------

def encode_header(boot_id, int version=FORMAT_VERSION):
    """Return the journal header stamped with ``boot_id``.

    :raises ClaimRecordError: ``boot_id`` is not a string or is longer than 65535 bytes.
    """
    cdef cs_buf b
    cdef Py_ssize_t n
    cdef const char *p
    if not isinstance(boot_id, str):
        raise ClaimRecordError("boot ID must be a string")
    p = cs_utf8(boot_id, "boot ID", &n)
    b.data = NULL
    b.len = 0
    b.cap = 0
    try:
        cs_put_raw(&b, CS_MAGIC, 8)
        cs_put_u16(&b, version)
        cs_put_u16(&b, 0)
        cs_put_u32(&b, n)
        cs_put_raw(&b, p, n)
        cs_put_u32(&b, cs_crc32(b.data, b.len, 0))
        return PyBytes_FromStringAndSize(<char *>b.data, b.len)
    finally:
        free(b.data)


def decode_header(data):
    """Parse the header at the start of ``data``; return ``(version, boot_id, header_len)``.

    :raises ClaimStateCorruptError: wrong magic, short header, or header CRC mismatch.
    :raises ClaimStateVersionError: a version newer than :data:`FORMAT_VERSION` or one not readable.
    """
    cdef const unsigned char[:] view = data
    cdef Py_ssize_t size = view.shape[0]
    cdef const unsigned char *p
    cdef unsigned int version
    cdef Py_ssize_t boot_len, header_len, plausible
    if size < CS_HDR_FIXED:
        raise ClaimStateCorruptError(
            f"header is {size} bytes, shorter than the {CS_HDR_FIXED}-byte minimum"
        )
    p = &view[0]
    if memcmp(p, CS_MAGIC, 8) != 0:
        magic = bytes(data[:8])
        raise ClaimStateCorruptError(f"bad magic {magic!r} (expected {MAGIC!r}): not a claim-state journal")
    version = p[8] | (p[9] << 8)
    boot_len = cs_get_u32(p + 12)
    header_len = CS_HDR_FIXED + boot_len + 4
    plausible = header_len if boot_len <= CS_MAX_STR else 0
    if size < header_len or boot_len > CS_MAX_STR:
        raise ClaimStateCorruptError(
            f"header declares a {boot_len}-byte boot ID but the file is {size} bytes",
            header_len=plausible if size >= header_len else 0,
        )
    if cs_crc32(p, header_len - 4, 0) != cs_get_u32(p + header_len - 4):
        raise ClaimStateCorruptError("header checksum mismatch", header_len=plausible)
    if version > FORMAT_VERSION:
        raise ClaimStateVersionError(
            f"claim-state format version {version} is newer than the versions this plugin reads "
            f"({', '.join(map(str, READABLE_VERSIONS))}); it was written by a newer plugin"
        )
    if version not in READABLE_VERSIONS:
        raise ClaimStateVersionError(f"claim-state format version {version} is not a known version")
    try:
        boot_id = PyUnicode_DecodeUTF8(<const char *>(p + CS_HDR_FIXED), boot_len, NULL)
    except UnicodeDecodeError:
        raise ClaimStateCorruptError("boot ID in the header is not UTF-8", header_len=plausible) from None
    return int(version), boot_id, int(header_len)


def append(int fd, data):
    """Write all of ``data`` at the descriptor's position (open it with ``O_APPEND``), then ``fdatasync``.

    The GIL is released around the system calls.

    :raises OSError: from ``write``/``fdatasync``.
    """
    cdef const unsigned char[:] view = data
    cdef const unsigned char *p
    cdef Py_ssize_t left = view.shape[0]
    cdef ssize_t written = 0
    cdef int rc = 0
    p = &view[0] if left else NULL
    with nogil:
        while left > 0:
            written = c_write(fd, p, left)
            if written < 0:
                if errno == EINTR:
                    continue
                break
            p += written
            left -= written
        if written >= 0:
            rc = c_fdatasync(fd)
    if written < 0 or rc != 0:
        PyErr_SetFromErrno(OSError)


# ---- decoding ---------------------------------------------------------------------------------

class _Malformed(Exception):
    pass


cdef struct cs_reader:
    const unsigned char *p
    Py_ssize_t pos
    Py_ssize_t end


cdef inline int cs_need(cs_reader *r, Py_ssize_t n) except -1:
    if r.end - r.pos < n:
        raise _Malformed()
    return 0


cdef inline int cs_u8(cs_reader *r) except -1:
    cs_need(r, 1)
    r.pos += 1
    return r.p[r.pos - 1]


cdef inline Py_ssize_t cs_u16(cs_reader *r) except -1:
    cs_need(r, 2)
    r.pos += 2
    return r.p[r.pos - 2] | (r.p[r.pos - 1] << 8)


cdef inline Py_ssize_t cs_u32(cs_reader *r) except -1:
    cs_need(r, 4)
    r.pos += 4
    return cs_get_u32(r.p + r.pos - 4)


cdef str cs_str(cs_reader *r):
    cdef Py_ssize_t n = cs_u16(r)
    cs_need(r, n)
    r.pos += n
    try:
        return PyUnicode_DecodeUTF8(<const char *>(r.p + r.pos - n), n, NULL)
    except UnicodeDecodeError:
        raise _Malformed() from None


cdef tuple cs_decode_body(const unsigned char *p, Py_ssize_t n, int version):
    """Decode one record body: ``(type, uid, record-or-None)``; version dispatch point for later formats.

    :raises _Malformed: the body does not decode.
    """
    cdef cs_reader r
    cdef unsigned int kind, state, admin, payload_kind
    cdef Py_ssize_t ndev, count, i, j, plen
    r.p = p
    r.pos = 0
    r.end = n
    kind = cs_u8(&r)
    if kind == RECORD_DELETE:
        uid = cs_str(&r)
        if r.pos != r.end or not uid:
            raise _Malformed()
        return (kind, uid, None)
    if kind != RECORD_PUT:
        raise _Malformed()
    state = cs_u8(&r)
    if state != STATE_PREPARE_STARTED and state != STATE_PREPARE_COMPLETED:
        raise _Malformed()
    uid = cs_str(&r)
    namespace = cs_str(&r)
    name = cs_str(&r)
    ndev = cs_u16(&r)
    devices = []
    for i in range(ndev):
        count = cs_u16(&r)
        requests = []
        for j in range(count):
            requests.append(cs_str(&r))
        pool = cs_str(&r)
        dev = cs_str(&r)
        count = cs_u16(&r)
        cdi_ids = []
        for j in range(count):
            cdi_ids.append(cs_str(&r))
        admin = cs_u8(&r)
        if admin > 1:
            raise _Malformed()
        devices.append((tuple(requests), pool, dev, tuple(cdi_ids), admin == 1))
    payload_kind = cs_u8(&r)
    plen = cs_u32(&r)
    cs_need(&r, plen)
    r.pos += plen
    if r.pos != r.end or not uid or payload_kind > 1:
        raise _Malformed()
    if payload_kind == 1:
        try:
            payload = PyUnicode_DecodeUTF8(<const char *>(p + r.pos - plen), plen, NULL)
        except UnicodeDecodeError:
            raise _Malformed() from None
    else:
        payload = PyBytes_FromStringAndSize(<const char *>(p + r.pos - plen), plen)
    return (kind, uid, (int(state), namespace, name, tuple(devices), payload))


cdef list cs_holder_keys(tuple record):
    cdef list keys = []
    for d in record[3]:
        if not d[4]:
            keys.append(d[1] + "\x00" + d[2])
    return keys


cdef class Table:
    """The claim table: claim UID -> record, plus the index of devices held without admin access.

    See the twin ``dradriver._native.claimstore_py.Table`` for the contract of every method.
    """

    cdef dict _frames
    cdef dict _holders
    cdef Py_ssize_t _live_bytes
    cdef cs_buf _buf

    def __cinit__(self):
        self._frames = {}
        self._holders = {}
        self._live_bytes = 0
        self._buf.data = NULL
        self._buf.len = 0
        self._buf.cap = 0

    def __dealloc__(self):
        free(self._buf.data)

    def __len__(self):
        return len(self._frames)

    @property
    def live_bytes(self):
        """Bytes the live records take in a snapshot (sum of their PUT frames)."""
        return self._live_bytes

    def uids(self):
        """Claim UIDs in table order (first insertion)."""
        return list(self._frames)

    cdef tuple _record(self, uid):
        cdef bytes fb
        frame = self._frames.get(uid)
        if frame is None:
            return None
        fb = <bytes>frame
        return cs_decode_body(
            <const unsigned char *>PyBytes_AS_STRING(fb) + CS_FRAME_HEAD,
            PyBytes_GET_SIZE(fb) - CS_FRAME_HEAD,
            FORMAT_VERSION,
        )[2]

    def get(self, uid):
        """The record of ``uid``, or ``None``."""
        return self._record(uid)

    def holder(self, pool, device):
        """UID of the claim holding ``pool``/``device`` without admin access, or ``None``."""
        return self._holders.get(pool + "\x00" + device)

    def snapshot(self):
        """Every live PUT frame, in table order: the body of a compacted journal."""
        return b"".join(self._frames.values())

    cdef bytes _encode_put(self, uid, unsigned int state, namespace, name, devices, payload, list keys):
        cdef cs_buf *b = &self._buf
        cdef Py_ssize_t plen
        cdef const char *pp
        cdef unsigned int kind
        b.len = 0
        cs_reserve(b, CS_FRAME_HEAD)
        b.len = CS_FRAME_HEAD
        cs_put_u8(b, RECORD_PUT)
        cs_put_u8(b, state)
        if not isinstance(uid, str) or not uid:
            raise ClaimRecordError("claim UID must be a non-empty string")
        cs_put_str(b, uid, "claim UID")
        cs_put_str(b, namespace, "namespace")
        cs_put_str(b, name, "name")
        if not isinstance(devices, (tuple, list)):
            raise ClaimRecordError("devices must be a tuple or list of device tuples")
        if len(devices) > CS_MAX_COUNT:
            raise ClaimRecordError(f"devices has {len(devices)} entries, more than {CS_MAX_COUNT}")
        cs_put_u16(b, len(devices))
        for device in devices:
            if not isinstance(device, tuple) or len(device) != 5:
                raise ClaimRecordError(
                    "a device must be a tuple (request_names, pool, device, cdi_device_ids, admin_access)"
                )
            requests, pool, dev, cdi_ids, admin = device
            cs_put_strs(b, requests, "request names")
            cs_put_str(b, pool, "pool")
            cs_put_str(b, dev, "device name")
            cs_put_strs(b, cdi_ids, "CDI device IDs")
            if not isinstance(admin, bool):
                raise ClaimRecordError("admin_access must be a bool")
            cs_put_u8(b, 1 if admin else 0)
            if not admin:
                keys.append(pool + "\x00" + dev)
        if isinstance(payload, bytes):
            kind = 0
            pp = PyBytes_AS_STRING(payload)
            plen = PyBytes_GET_SIZE(payload)
        elif isinstance(payload, str):
            kind = 1
            try:
                pp = PyUnicode_AsUTF8AndSize(payload, &plen)
            except UnicodeEncodeError:
                raise ClaimRecordError("payload is not encodable as UTF-8") from None
        else:
            raise ClaimRecordError("payload must be bytes or str")
        if plen > CS_MAX_PAYLOAD:
            raise ClaimRecordError(f"payload is {plen} bytes long, more than {CS_MAX_PAYLOAD}")
        cs_put_u8(b, kind)
        cs_put_u32(b, plen)
        cs_put_raw(b, pp, plen)
        return cs_finish_frame(b)

    cdef int _check_conflicts(self, uid, list keys) except -1:
        for key in keys:
            holder = self._holders.get(key)
            if holder is not None and holder != uid:
                pool, _, device = key.partition("\x00")
                raise ClaimConflictError(uid, holder, pool, device)
        return 0

    cdef int _delete_keys(self, uid) except -1:
        for key in cs_holder_keys(self._record(uid)):
            if self._holders.get(key) == uid:
                del self._holders[key]
        return 0

    cdef int _put(self, uid, bytes frame, list keys) except -1:
        old = self._frames.get(uid)
        if old is not None:
            self._delete_keys(uid)
            self._live_bytes -= PyBytes_GET_SIZE(<bytes>old)
        self._frames[uid] = frame
        self._live_bytes += PyBytes_GET_SIZE(frame)
        for key in keys:
            self._holders[key] = uid
        return 0

    cdef int _delete(self, uid) except -1:
        self._delete_keys(uid)
        self._live_bytes -= PyBytes_GET_SIZE(<bytes>self._frames.pop(uid))
        return 0

    def prepare_started(self, uid, namespace, name, devices, payload):
        """Record ``uid`` as PREPARE_STARTED (replacing any record of that UID); return the frame.

        :raises ClaimRecordError: a field cannot be encoded.
        :raises ClaimConflictError: a non-admin device is held by another claim.
        """
        cdef list keys = []
        frame = self._encode_put(uid, STATE_PREPARE_STARTED, namespace, name, devices, payload, keys)
        self._check_conflicts(uid, keys)
        self._put(uid, frame, keys)
        return frame

    def prepare_completed(self, uid, devices, payload):
        """Mark ``uid`` PREPARE_COMPLETED, replacing devices/payload when given; return the frame.

        :raises ClaimUnknownError: ``uid`` is not in the table.
        :raises ClaimRecordError: a field cannot be encoded.
        :raises ClaimConflictError: a new non-admin device is held by another claim.
        """
        cdef list keys = []
        if not isinstance(uid, str):
            raise ClaimRecordError("claim UID must be a non-empty string")
        old = self._record(uid)
        if old is None:
            raise ClaimUnknownError(f"claim {uid} is not prepared (it was unprepared or never started)")
        frame = self._encode_put(
            uid,
            STATE_PREPARE_COMPLETED,
            old[1],
            old[2],
            old[3] if devices is None else devices,
            old[4] if payload is None else payload,
            keys,
        )
        self._check_conflicts(uid, keys)
        self._put(uid, frame, keys)
        return frame

    def remove(self, uid):
        """Forget ``uid``; return its DELETE frame, or ``b""`` when it was not in the table."""
        cdef cs_buf *b = &self._buf
        if not isinstance(uid, str):
            raise ClaimRecordError("claim UID must be a non-empty string")
        if uid not in self._frames:
            return b""
        b.len = 0
        cs_reserve(b, CS_FRAME_HEAD)
        b.len = CS_FRAME_HEAD
        cs_put_u8(b, RECORD_DELETE)
        cs_put_str(b, uid, "claim UID")
        frame = cs_finish_frame(b)
        self._delete(uid)
        return frame

    def apply(self, data, Py_ssize_t offset, int version):
        """Apply the frames in ``data[offset:]`` without conflict checks; return ``(status, stop, resume)``."""
        cdef const unsigned char[:] view = data
        cdef const unsigned char *p
        cdef Py_ssize_t end = view.shape[0]
        cdef Py_ssize_t pos = offset
        cdef Py_ssize_t body_len, nxt, k
        cdef uint32_t body_crc
        cdef bint zeros
        if end == 0:
            return (APPLY_OK, 0, 0)
        p = &view[0]
        while pos < end:
            if end - pos < CS_FRAME_HEAD:
                return (APPLY_TORN, pos, pos)
            body_len = cs_get_u32(p + pos)
            body_crc = cs_get_u32(p + pos + 4)
            if cs_crc32(p + pos, 8, 0) != cs_get_u32(p + pos + 8):
                zeros = True
                for k in range(pos, end):
                    if p[k] != 0:
                        zeros = False
                        break
                if zeros:
                    return (APPLY_TORN, pos, pos)
                return (APPLY_BAD_FRAME, pos, pos)
            nxt = pos + CS_FRAME_HEAD + body_len
            if nxt > end:
                return (APPLY_TORN, pos, pos)
            if cs_crc32(p + pos + CS_FRAME_HEAD, body_len, 0) != body_crc:
                if nxt == end:
                    return (APPLY_TORN, pos, pos)
                return (APPLY_BAD_RECORD, pos, nxt)
            try:
                kind, uid, record = cs_decode_body(p + pos + CS_FRAME_HEAD, body_len, version)
            except _Malformed:
                return (APPLY_BAD_RECORD, pos, nxt)
            if record is None:
                if uid in self._frames:
                    self._delete(uid)
            else:
                if version == FORMAT_VERSION:
                    frame = PyBytes_FromStringAndSize(<const char *>(p + pos), nxt - pos)
                else:
                    frame = self._encode_put(uid, record[0], record[1], record[2], record[3], record[4], [])
                self._put(uid, frame, cs_holder_keys(record))
            pos = nxt
        return (APPLY_OK, end, end)
