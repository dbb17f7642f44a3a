# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""CDI spec renderer, compiled: writes the JSON bytes directly into one growing C buffer.

Same interface, same bytes and same exceptions as the pure-Python twin ``dradriver/_native/cdispec_py.py``,
whose module docstring documents the input shapes and rules. No dict is built per field; strings are copied
as-is when they are printable ASCII and escaped exactly like :func:`json.dumps` (``ensure_ascii``) otherwise.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.string cimport memcpy, strlen


cdef extern from "Python.h":
    int PyUnicode_KIND(object)
    void* PyUnicode_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    Py_UCS4 PyUnicode_READ(int kind, void* data, Py_ssize_t index)
    bint PyUnicode_IS_ASCII(object)
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1
    bint PyLong_Check(object)
    bint PyBool_Check(object)


KNOWN_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
HOOK_NAMES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
NODE_TYPES = ("", "b", "c", "u", "p")
MAX_MAJOR = 4095
MAX_MINOR = (1 << 20) - 1
MAX_FILE_MODE = 0o7777
MAX_UINT32 = 4294967295
IMEX_CHANNEL_COUNT = 2048
IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels/channel"
MAX_ANNOTATIONS_SIZE = 256 * 1024

DEF C_IMEX_CHANNEL_COUNT = 2048

cdef frozenset _ALPHA = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
cdef frozenset _DIGIT = frozenset("0123456789")
cdef frozenset _ALNUM = _ALPHA | _DIGIT
cdef frozenset _KIND_INNER = _ALNUM | frozenset("_-.")
cdef frozenset _DNS_INNER = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
cdef frozenset _DNS_END = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
cdef dict _VERSION_SCORE = {v: i for i, v in enumerate(KNOWN_VERSIONS)}

cdef const char* _HEX = b"0123456789abcdef"


# --------------------------------------------------------------------------------------------------------
# Output buffer

cdef struct Buf:
    char* p
    Py_ssize_t n
    Py_ssize_t cap


cdef int buf_reserve(Buf* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t need = b.n + extra
    cdef Py_ssize_t cap
    cdef char* p
    if need <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 8192
    while cap < need:
        cap *= 2
    p = <char*>PyMem_Realloc(b.p, <size_t>cap)
    if p == NULL:
        raise MemoryError()
    b.p = p
    b.cap = cap
    return 0


cdef inline int put(Buf* b, const char* s, Py_ssize_t n) except -1:
    if b.n + n > b.cap:
        buf_reserve(b, n)
    memcpy(b.p + b.n, s, <size_t>n)
    b.n += n
    return 0


cdef inline int lit(Buf* b, const char* s) except -1:
    return put(b, s, <Py_ssize_t>strlen(s))


cdef inline int putc(Buf* b, char c) except -1:
    if b.n + 1 > b.cap:
        buf_reserve(b, 1)
    b.p[b.n] = c
    b.n += 1
    return 0


cdef int put_uint(Buf* b, unsigned long long v) except -1:
    cdef char tmp[24]
    cdef int i = 24
    if v == 0:
        return putc(b, b'0')
    while v:
        i -= 1
        tmp[i] = <char>(48 + v % 10)
        v //= 10
    return put(b, &tmp[i], 24 - i)


cdef inline void _u4(char* p, unsigned int c):
    p[0] = b'\\'
    p[1] = b'u'
    p[2] = _HEX[(c >> 12) & 15]
    p[3] = _HEX[(c >> 8) & 15]
    p[4] = _HEX[(c >> 4) & 15]
    p[5] = _HEX[c & 15]


cdef int put_raw(Buf* b, str s) except -1:
    """Write the JSON escape of ``s`` without quotes (``json.dumps`` with ``ensure_ascii``)."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(s)
    cdef Py_ssize_t i
    cdef int kind = PyUnicode_KIND(s)
    cdef void* data = PyUnicode_DATA(s)
    cdef const unsigned char* a
    cdef unsigned int c
    cdef char* p
    if PyUnicode_IS_ASCII(s):
        a = <const unsigned char*>data
        for i in range(n):
            c = a[i]
            if c < 0x20 or c == 0x22 or c == 0x5c or c == 0x7f:
                break
        else:
            return put(b, <const char*>a, n)
    buf_reserve(b, n * 12)
    p = b.p + b.n
    for i in range(n):
        c = <unsigned int>PyUnicode_READ(kind, data, i)
        if 0x20 <= c <= 0x7e:
            if c == 0x22 or c == 0x5c:
                p[0] = b'\\'
                p += 1
            p[0] = <char>c
            p += 1
        elif c == 0x0a:
            p[0] = b'\\'; p[1] = b'n'; p += 2
        elif c == 0x0d:
            p[0] = b'\\'; p[1] = b'r'; p += 2
        elif c == 0x09:
            p[0] = b'\\'; p[1] = b't'; p += 2
        elif c == 0x08:
            p[0] = b'\\'; p[1] = b'b'; p += 2
        elif c == 0x0c:
            p[0] = b'\\'; p[1] = b'f'; p += 2
        elif c >= 0x10000:
            c -= 0x10000
            _u4(p, 0xd800 | (c >> 10))
            _u4(p + 6, 0xdc00 | (c & 0x3ff))
            p += 12
        else:
            _u4(p, c)
            p += 6
    b.n = p - b.p
    return 0


cdef inline int put_str(Buf* b, str s) except -1:
    putc(b, b'"')
    put_raw(b, s)
    return putc(b, b'"')


# --------------------------------------------------------------------------------------------------------
# Checks (messages identical to the twin's)

cdef str _tn(object v):
    return type(v).__name__


cdef str _edits_loc(Py_ssize_t dev):
    if dev < 0:
        return "containerEdits"
    return f"devices[{dev}].containerEdits"


cdef str _item(Py_ssize_t dev, str sec, Py_ssize_t j):
    return f"{_edits_loc(dev)}.{sec}[{j}]"


cdef inline tuple _tup(object v):
    if type(v) is tuple:
        return <tuple>v
    return tuple(v)


cdef tuple _seq(object v, str where):
    if not isinstance(v, (tuple, list)):
        raise TypeError(f"{where} must be a tuple or list, not {_tn(v)}")
    return _tup(v)


cdef tuple _seq_at(object v, Py_ssize_t dev, str sec):
    """``_seq`` for one section of an edits record; the location is built only on error."""
    if not isinstance(v, (tuple, list)):
        raise TypeError(f"{_edits_loc(dev)}.{sec} must be a tuple or list, not {_tn(v)}")
    return _tup(v)


cdef tuple _rec(object v, Py_ssize_t size, str shape, Py_ssize_t dev, str sec, Py_ssize_t j):
    if not isinstance(v, (tuple, list)):
        raise TypeError(f"{_item(dev, sec, j)} must be a tuple or list, not {_tn(v)}")
    if len(v) != size:
        raise TypeError(f"{_item(dev, sec, j)} must have {size} fields {shape}, got {len(v)}")
    return _tup(v)


cdef _record(object value, str where, Py_ssize_t size, str shape):
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{where} must be a tuple or list, not {_tn(value)}")
    if len(value) != size:
        raise TypeError(f"{where} must have {size} fields {shape}, got {len(value)}")
    return value


cdef str _str(object value, str where):
    if not isinstance(value, str):
        raise TypeError(f"{where} must be str, not {_tn(value)}")
    return <str>value


cdef long long _int(object value, str where, long long low, long long high) except? -1:
    cdef long long v = 0
    cdef int code = _int_code(value, low, high, &v)
    if code:
        _int_error(code, value, where, low, high)
    return v


cdef inline bint _ascii_alpha(Py_UCS4 c):
    return (0x41 <= c <= 0x5a) or (0x61 <= c <= 0x7a)


cdef inline bint _ascii_alnum(Py_UCS4 c):
    return _ascii_alpha(c) or (0x30 <= c <= 0x39)


cdef str _name_reason(str text):
    """Why ``text`` is not a CDI device name (the CDI library's ``pkg/parser/parser.go``), or None."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef Py_ssize_t i
    cdef int kind = PyUnicode_KIND(text)
    cdef void* data = PyUnicode_DATA(text)
    cdef Py_UCS4 c
    if n == 0:
        return "empty"
    if not _ascii_alnum(PyUnicode_READ(kind, data, 0)):
        return "must start with a letter or digit"
    if not _ascii_alnum(PyUnicode_READ(kind, data, n - 1)):
        return "must end with a letter or digit"
    for i in range(n):
        c = PyUnicode_READ(kind, data, i)
        if not (_ascii_alnum(c) or c == 0x5f or c == 0x2d or c == 0x2e or c == 0x3a):
            return f"invalid character {chr(c)!r}"
    return None


cdef int _check_name(str text, str where) except -1:
    reason = _name_reason(text)
    if reason is not None:
        raise ValueError(f"{where} {text!r}: invalid CDI device name: {reason}")
    return 0


cdef inline int _path_code(object value, bint optional):
    """0 valid, 1 not a str, 2 not absolute."""
    cdef Py_ssize_t n
    if not isinstance(value, str):
        return 1
    n = PyUnicode_GET_LENGTH(value)
    if n == 0:
        return 0 if optional else 2
    if PyUnicode_READ(PyUnicode_KIND(value), PyUnicode_DATA(value), 0) != 0x2f:
        return 2
    return 0


cdef int _path_error(int code, object value, str where) except -1:
    if code == 1:
        raise TypeError(f"{where} must be str, not {_tn(value)}")
    raise ValueError(f"{where} {value!r} is not an absolute path")


cdef str _abs_path(object value, str where, bint optional):
    cdef int code = _path_code(value, optional)
    if code:
        _path_error(code, value, where)
    return <str>value


cdef inline int _int_code(object value, long long low, long long high, long long* out):
    """0 valid (``*out`` set), 1 not an int (or a bool), 2 out of range."""
    cdef int overflow = 0
    cdef long long v
    if not PyLong_Check(value) or PyBool_Check(value):
        return 1
    v = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow or v < low or v > high:
        return 2
    out[0] = v
    return 0


cdef int _int_error(int code, object value, str where, long long low, long long high) except -1:
    if code == 1:
        raise TypeError(f"{where} must be int, not {_tn(value)}")
    raise ValueError(f"{where} {value} is out of range [{low}, {high}]")


cdef str _env(object value, str where):
    if not isinstance(value, str):
        raise TypeError(f"{where} must be str, not {_tn(value)}")
    if (<str>value).find("=") <= 0:
        raise ValueError(f"{where} {value!r} is not NAME=VALUE with a non-empty NAME")
    return <str>value


def _kind_part(str part, str what, Py_ssize_t limit, str kind):
    if len(part) < 2:
        raise ValueError(f"kind {kind!r}: {what} must be at least 2 characters")
    if len(part) > limit:
        raise ValueError(f"kind {kind!r}: {what} is longer than {limit} characters")
    if part[0] not in _ALPHA:
        raise ValueError(f"kind {kind!r}: {what} must start with a letter")
    if part[len(part) - 1] not in _ALNUM:
        raise ValueError(f"kind {kind!r}: {what} must end with a letter or digit")
    for ch in part:
        if ch not in _KIND_INNER:
            raise ValueError(f"kind {kind!r}: {what} has invalid character {ch!r}")


cdef bint _check_kind(object kind) except -1:
    cdef str text = _str(kind, "kind")
    cdef Py_ssize_t slash = text.find("/")
    if slash < 0:
        raise ValueError(f"kind {text!r}: must be vendor/class")
    vendor, cls = text[:slash], text[slash + 1:]
    _kind_part(vendor, "vendor", 253, text)
    _kind_part(cls, "class", 63, text)
    return "." in cls


cdef _check_dns_subdomain(str prefix, str where, str key):
    if not prefix or len(prefix) > 253:
        raise ValueError(f"{where} key {key!r}: prefix must be 1-253 characters")
    for label in prefix.split("."):
        if not label or label[0] not in _DNS_END or label[len(label) - 1] not in _DNS_END:
            raise ValueError(f"{where} key {key!r}: prefix is not a lower-case DNS subdomain")
        for ch in label:
            if ch not in _DNS_INNER:
                raise ValueError(f"{where} key {key!r}: prefix is not a lower-case DNS subdomain")


cdef list _check_annotations(object value, str where):
    """Validated ``(key, value)`` pairs sorted by key (Go's map encoder order)."""
    cdef tuple pairs = _seq(value, where)
    cdef dict out = {}
    cdef Py_ssize_t size = 0
    for i, pair in enumerate(pairs):
        item = f"{where}[{i}]"
        key, val = _record(pair, item, 2, "(key, value)")
        _str(key, f"{item}.key")
        _str(val, f"{item}.value")
        slash = key.find("/")
        name = key
        if slash >= 0:
            _check_dns_subdomain(key[:slash], where, key)
            name = key[slash + 1:]
        if not name or len(name) > 63:
            raise ValueError(f"{where} key {key!r}: name must be 1-63 characters")
        if name[0] not in _ALNUM or name[len(name) - 1] not in _ALNUM:
            raise ValueError(f"{where} key {key!r}: name must start and end with a letter or digit")
        for ch in name:
            if ch not in _KIND_INNER:
                raise ValueError(f"{where} key {key!r}: name has invalid character {ch!r}")
        if key in out:
            raise ValueError(f"{where} key {key!r}: duplicate key")
        size += len(key) + len(val)
        if size > MAX_ANNOTATIONS_SIZE:
            raise ValueError(f"{where}: total size exceeds {MAX_ANNOTATIONS_SIZE} characters")
        out[key] = val
    return sorted(out.items())


cdef int put_annotations(Buf* b, list pairs) except -1:
    cdef bint first = True
    lit(b, b'"annotations":{')
    for key, val in pairs:
        if not first:
            putc(b, b',')
        first = False
        put_str(b, key)
        putc(b, b':')
        put_str(b, val)
    return putc(b, b'}')


cdef str _check_version(object value):
    cdef str text = _str(value, "cdiVersion")
    bare = text[1:] if text.startswith("v") else text
    if bare not in _VERSION_SCORE:
        raise ValueError(f"cdiVersion {text!r} is not a known CDI version")
    return bare


# --------------------------------------------------------------------------------------------------------
# Content facts that raise the minimum cdiVersion (the CDI library's ``specs-go/version.go``)

cdef struct Needs:
    bint annotations
    bint gids
    bint host_path
    bint mount_type
    bint net_devices


cdef str _minimum(Needs* nd, bint class_dot, bint digit_name):
    if nd.net_devices:
        return "1.1.0"
    if nd.gids:
        return "0.7.0"
    if nd.annotations or class_dot:
        return "0.6.0"
    if digit_name or nd.host_path:
        return "0.5.0"
    if nd.mount_type:
        return "0.4.0"
    return "0.3.0"


# --------------------------------------------------------------------------------------------------------
# Container edits

cdef str _NODE_SHAPE = "(path, hostPath, type, major, minor, fileMode, permissions, uid, gid)"


cdef int put_node(Buf* b, object value, Py_ssize_t dev, Py_ssize_t j, Needs* nd) except -1:
    cdef tuple rec = _rec(value, 9, _NODE_SHAPE, dev, "deviceNodes", j)
    cdef str path, host, typ, perms
    cdef long long v = 0
    cdef Py_ssize_t i, n
    cdef Py_UCS4 c
    cdef int code
    cdef object f
    f = rec[0]
    code = _path_code(f, False)
    if code:
        _path_error(code, f, _item(dev, "deviceNodes", j) + ".path")
    lit(b, b'{"path":')
    put_str(b, <str>f)
    f = rec[1]
    code = _path_code(f, True)
    if code:
        _path_error(code, f, _item(dev, "deviceNodes", j) + ".hostPath")
    if PyUnicode_GET_LENGTH(f):
        lit(b, b',"hostPath":')
        put_str(b, <str>f)
        nd.host_path = True
    f = rec[2]
    if not isinstance(f, str):
        raise TypeError(f"{_item(dev, 'deviceNodes', j)}.type must be str, not {_tn(f)}")
    typ = <str>f
    n = PyUnicode_GET_LENGTH(typ)
    if n:
        c = PyUnicode_READ(PyUnicode_KIND(typ), PyUnicode_DATA(typ), 0)
        if n != 1 or not (c == 0x62 or c == 0x63 or c == 0x75 or c == 0x70):
            raise ValueError(
                f"{_item(dev, 'deviceNodes', j)}.type {typ!r} is not one of '', 'b', 'c', 'u', 'p'"
            )
        lit(b, b',"type":"')
        putc(b, <char>c)
        putc(b, b'"')
    f = rec[3]
    code = _int_code(f, 0, MAX_MAJOR, &v)
    if code:
        _int_error(code, f, _item(dev, "deviceNodes", j) + ".major", 0, MAX_MAJOR)
    if v:
        lit(b, b',"major":')
        put_uint(b, <unsigned long long>v)
    f = rec[4]
    code = _int_code(f, 0, MAX_MINOR, &v)
    if code:
        _int_error(code, f, _item(dev, "deviceNodes", j) + ".minor", 0, MAX_MINOR)
    if v:
        lit(b, b',"minor":')
        put_uint(b, <unsigned long long>v)
    f = rec[5]
    if f is not None:
        code = _int_code(f, 0, MAX_FILE_MODE, &v)
        if code:
            _int_error(code, f, _item(dev, "deviceNodes", j) + ".fileMode", 0, MAX_FILE_MODE)
        lit(b, b',"fileMode":')
        put_uint(b, <unsigned long long>v)
    f = rec[6]
    if not isinstance(f, str):
        raise TypeError(f"{_item(dev, 'deviceNodes', j)}.permissions must be str, not {_tn(f)}")
    perms = <str>f
    n = PyUnicode_GET_LENGTH(perms)
    for i in range(n):
        c = PyUnicode_READ(PyUnicode_KIND(perms), PyUnicode_DATA(perms), i)
        if not (c == 0x72 or c == 0x77 or c == 0x6d):
            raise ValueError(
                f"{_item(dev, 'deviceNodes', j)}.permissions {perms!r} may hold only 'r', 'w' and 'm'"
            )
    if n:
        lit(b, b',"permissions":')
        put_str(b, perms)
    f = rec[7]
    if f is not None:
        code = _int_code(f, 0, MAX_UINT32, &v)
        if code:
            _int_error(code, f, _item(dev, "deviceNodes", j) + ".uid", 0, MAX_UINT32)
        lit(b, b',"uid":')
        put_uint(b, <unsigned long long>v)
    f = rec[8]
    if f is not None:
        code = _int_code(f, 0, MAX_UINT32, &v)
        if code:
            _int_error(code, f, _item(dev, "deviceNodes", j) + ".gid", 0, MAX_UINT32)
        lit(b, b',"gid":')
        put_uint(b, <unsigned long long>v)
    return putc(b, b'}')


cdef int put_net_devices(Buf* b, tuple items, Py_ssize_t dev) except -1:
    cdef set hosts = set()
    cdef set names = set()
    cdef Py_ssize_t j
    for j in range(len(items)):
        at = _item(dev, "netDevices", j)
        rec = _rec(items[j], 2, "(hostInterfaceName, name)", dev, "netDevices", j)
        host = _str(rec[0], f"{at}.hostInterfaceName")
        name = _str(rec[1], f"{at}.name")
        if not host:
            raise ValueError(f"{at}.hostInterfaceName is empty")
        if not name:
            raise ValueError(f"{at}.name is empty")
        if host in hosts:
            raise ValueError(f"{at}.hostInterfaceName {host!r} is duplicated")
        if name in names:
            raise ValueError(f"{at}.name {name!r} is duplicated")
        hosts.add(host)
        names.add(name)
        lit(b, b'{"hostInterfaceName":' if j == 0 else b',{"hostInterfaceName":')
        put_str(b, host)
        lit(b, b',"name":')
        put_str(b, name)
        putc(b, b'}')
    return 0


cdef int put_str_list(Buf* b, const char* key, tuple items, Py_ssize_t dev, str sec, str where,
                      bint env) except -1:
    """Write ``key`` (the opening ``"name":[``) and the strings of ``items``, then ``]``.

    The location of an item is ``where[k]`` or, when ``where`` is None, ``<edits of dev>.<sec>[k]``; it is
    built only on error. ``env`` applies the ``NAME=VALUE`` rule.
    """
    cdef Py_ssize_t k
    cdef object item
    lit(b, key)
    for k in range(len(items)):
        item = items[k]
        if k:
            putc(b, b',')
        if not isinstance(item, str) or (env and (<str>item).find("=") <= 0):
            at = f"{where}[{k}]" if where is not None else _item(dev, sec, k)
            if env:
                _env(item, at)
            _str(item, at)
        put_str(b, <str>item)
    return putc(b, b']')


cdef int put_hook(Buf* b, object value, Py_ssize_t dev, Py_ssize_t j) except -1:
    cdef tuple rec = _rec(value, 5, "(hookName, path, args, env, timeout)", dev, "hooks", j)
    cdef str at = _item(dev, "hooks", j)
    cdef str name = _str(rec[0], f"{at}.hookName")
    cdef tuple args, env
    cdef long long v = 0
    if name not in HOOK_NAMES:
        raise ValueError(f"{at}.hookName {name!r} is not a CDI hook name")
    path = _abs_path(rec[1], f"{at}.path", False)
    args = _seq(rec[2], f"{at}.args")
    for k in range(len(args)):
        _str(args[k], f"{at}.args[{k}]")
    env = _seq(rec[3], f"{at}.env")
    for k in range(len(env)):
        _env(env[k], f"{at}.env[{k}]")
    if rec[4] is not None:
        v = _int(rec[4], f"{at}.timeout", 1, MAX_UINT32)
    lit(b, b'{"hookName":')
    put_str(b, name)
    lit(b, b',"path":')
    put_str(b, path)
    if len(args):
        put_str_list(b, b',"args":[', args, dev, "", f"{at}.args", False)
    if len(env):
        put_str_list(b, b',"env":[', env, dev, "", f"{at}.env", True)
    if rec[4] is not None:
        lit(b, b',"timeout":')
        put_uint(b, <unsigned long long>v)
    return putc(b, b'}')


cdef int put_mount(Buf* b, object value, Py_ssize_t dev, Py_ssize_t j, Needs* nd) except -1:
    cdef tuple rec = _rec(value, 4, "(hostPath, containerPath, options, type)", dev, "mounts", j)
    cdef str at = _item(dev, "mounts", j)
    cdef tuple options
    cdef str typ
    lit(b, b'{"hostPath":')
    put_str(b, _abs_path(rec[0], f"{at}.hostPath", False))
    lit(b, b',"containerPath":')
    put_str(b, _abs_path(rec[1], f"{at}.containerPath", False))
    options = _seq(rec[2], f"{at}.options")
    if len(options):
        put_str_list(b, b',"options":[', options, dev, "", f"{at}.options", False)
    typ = _str(rec[3], f"{at}.type")
    if typ:
        lit(b, b',"type":')
        put_str(b, typ)
        nd.mount_type = True
    return putc(b, b'}')


cdef int put_edits(Buf* b, object value, Py_ssize_t dev, Needs* nd) except -1:
    """Write ``{...}`` for one edits record; return the number of non-empty sections."""
    cdef tuple rec
    cdef tuple items
    cdef Py_ssize_t j
    cdef int sections = 0
    cdef long long v = 0
    cdef int code
    cdef object f
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{_edits_loc(dev)} must be a tuple or list, not {_tn(value)}")
    if len(value) != 6:
        raise TypeError(
            f"{_edits_loc(dev)} must have 6 fields "
            f"(env, deviceNodes, netDevices, hooks, mounts, additionalGids), got {len(value)}"
        )
    rec = _tup(value)
    putc(b, b'{')
    items = _seq_at(rec[0], dev, "env")
    if len(items):
        put_str_list(b, b'"env":[', items, dev, "env", None, True)
        sections += 1
    items = _seq_at(rec[1], dev, "deviceNodes")
    if len(items):
        lit(b, b',"deviceNodes":[' if sections else b'"deviceNodes":[')
        for j in range(len(items)):
            if j:
                putc(b, b',')
            put_node(b, items[j], dev, j, nd)
        putc(b, b']')
        sections += 1
    items = _seq_at(rec[2], dev, "netDevices")
    if len(items):
        lit(b, b',"netDevices":[' if sections else b'"netDevices":[')
        put_net_devices(b, items, dev)
        putc(b, b']')
        nd.net_devices = True
        sections += 1
    items = _seq_at(rec[3], dev, "hooks")
    if len(items):
        lit(b, b',"hooks":[' if sections else b'"hooks":[')
        for j in range(len(items)):
            if j:
                putc(b, b',')
            put_hook(b, items[j], dev, j)
        putc(b, b']')
        sections += 1
    items = _seq_at(rec[4], dev, "mounts")
    if len(items):
        lit(b, b',"mounts":[' if sections else b'"mounts":[')
        for j in range(len(items)):
            if j:
                putc(b, b',')
            put_mount(b, items[j], dev, j, nd)
        putc(b, b']')
        sections += 1
    items = _seq_at(rec[5], dev, "additionalGids")
    if len(items):
        lit(b, b',"additionalGids":[' if sections else b'"additionalGids":[')
        for j in range(len(items)):
            if j:
                putc(b, b',')
            f = items[j]
            code = _int_code(f, 0, MAX_UINT32, &v)
            if code:
                _int_error(code, f, _item(dev, "additionalGids", j), 0, MAX_UINT32)
            put_uint(b, <unsigned long long>v)
        putc(b, b']')
        nd.gids = True
        sections += 1
    putc(b, b'}')
    return sections


# --------------------------------------------------------------------------------------------------------
# Public entry points

cdef bytes _assemble(Buf* body, object version, str kind):
    """``{"cdiVersion":...,"kind":...,`` + body, as one bytes object."""
    cdef Buf head
    cdef bytes out
    head.p = NULL
    head.n = 0
    head.cap = 0
    try:
        lit(&head, b'{"cdiVersion":')
        put_str(&head, version)
        lit(&head, b',"kind":')
        put_str(&head, kind)
        putc(&head, b',')
        out = PyBytes_FromStringAndSize(NULL, head.n + body.n)
        memcpy(PyBytes_AS_STRING(out), head.p, <size_t>head.n)
        memcpy(PyBytes_AS_STRING(out) + head.n, body.p, <size_t>body.n)
        return out
    finally:
        PyMem_Free(head.p)


cdef object _final_version(object version, Needs* nd, bint class_dot, bint digit_name):
    minimum = _minimum(nd, class_dot, digit_name)
    if version is None:
        return minimum
    bare = version[1:] if version.startswith("v") else version
    if _VERSION_SCORE[bare] < _VERSION_SCORE[minimum]:
        raise ValueError(f"cdiVersion {version!r} is older than {minimum!r}, which the content needs")
    return version


# The last spec-level edits record rendered, if it is built of tuples, strings, ints and None only (so the
# fragment cannot go stale): (record, fragment, needs bits). Keeping the record alive makes its identity a safe key.
# A plugin passes the same spec-level record for every claim spec, so each renders only its devices.
cdef object _common_cache = None


cdef bint _frozen(object value):
    """True when ``value`` is None, a str, an int or a tuple of such (recursively)."""
    if value is None or isinstance(value, (str, int)):
        return True
    if type(value) is not tuple:
        return False
    for item in <tuple>value:
        if not _frozen(item):
            return False
    return True


cdef inline int _needs_bits(Needs* nd):
    return (nd.annotations | (nd.gids << 1) | (nd.host_path << 2) | (nd.mount_type << 3)
            | (nd.net_devices << 4))


cdef inline void _add_needs(Needs* nd, int bits):
    nd.annotations = nd.annotations or (bits & 1) != 0
    nd.gids = nd.gids or (bits & 2) != 0
    nd.host_path = nd.host_path or (bits & 4) != 0
    nd.mount_type = nd.mount_type or (bits & 8) != 0
    nd.net_devices = nd.net_devices or (bits & 16) != 0


cdef int put_common(Buf* b, object common, Needs* nd) except -1:
    global _common_cache
    cdef Buf cb
    cdef Needs cn
    cdef bytes fragment
    cdef tuple cached = _common_cache
    lit(b, b',"containerEdits":')
    if common is None:
        lit(b, b'{}')
    elif cached is not None and cached[0] is common:
        fragment = <bytes>cached[1]
        put(b, PyBytes_AS_STRING(fragment), PyBytes_GET_SIZE(fragment))
        _add_needs(nd, <int>cached[2])
    else:
        cb.p = NULL
        cb.n = 0
        cb.cap = 0
        cn.annotations = cn.gids = cn.host_path = cn.mount_type = cn.net_devices = False
        try:
            put_edits(&cb, common, -1, &cn)
            fragment = PyBytes_FromStringAndSize(cb.p, cb.n)
        finally:
            PyMem_Free(cb.p)
        put(b, PyBytes_AS_STRING(fragment), PyBytes_GET_SIZE(fragment))
        _add_needs(nd, _needs_bits(&cn))
        if _frozen(common):
            _common_cache = (common, fragment, _needs_bits(&cn))
    return putc(b, b'}')


def render_spec(kind, devices, common=None, annotations=(), cdi_version=None):
    """Render one CDI spec as compact JSON bytes; see the twin ``cdispec_py.render_spec``."""
    cdef Buf b
    cdef Needs nd
    cdef bint class_dot, digit_name = False
    cdef tuple entries, entry
    cdef Py_ssize_t i, count
    cdef dict seen = {}
    cdef str name
    cdef list ann
    if cdi_version is not None:
        _check_version(cdi_version)
    class_dot = _check_kind(kind)
    nd.annotations = nd.gids = nd.host_path = nd.mount_type = nd.net_devices = False
    b.p = NULL
    b.n = 0
    b.cap = 0
    try:
        spec_ann = _check_annotations(annotations, "annotations")
        if spec_ann:
            nd.annotations = True
            put_annotations(&b, spec_ann)
            putc(&b, b',')
        entries = _seq(devices, "devices")
        count = len(entries)
        if count == 0:
            raise ValueError("devices: a spec needs at least one device")
        buf_reserve(&b, count * 160)
        lit(&b, b'"devices":[')
        for i in range(count):
            raw = entries[i]
            if not isinstance(raw, (tuple, list)):
                raise TypeError(f"devices[{i}] must be a tuple or list, not {_tn(raw)}")
            if len(raw) != 2 and len(raw) != 3:
                raise TypeError(
                    f"devices[{i}] must have 2 or 3 fields (name, edits[, annotations]), got {len(raw)}"
                )
            entry = _tup(raw)
            if not isinstance(entry[0], str):
                raise TypeError(f"devices[{i}].name must be str, not {_tn(entry[0])}")
            name = <str>entry[0]
            reason = _name_reason(name)
            if reason is not None:
                raise ValueError(f"devices[{i}].name {name!r}: invalid CDI device name: {reason}")
            prev = seen.get(name)
            if prev is not None:
                raise ValueError(f"devices[{i}].name {name!r}: duplicate device name (also devices[{prev}])")
            seen[name] = i
            if 0x30 <= PyUnicode_READ(PyUnicode_KIND(name), PyUnicode_DATA(name), 0) <= 0x39:
                digit_name = True
            lit(&b, b'{"name":' if i == 0 else b',{"name":')
            put_str(&b, name)
            if len(entry) == 3 and not (isinstance(entry[2], (tuple, list)) and len(entry[2]) == 0):
                ann = _check_annotations(entry[2], f"devices[{i}].annotations")
                if ann:
                    putc(&b, b',')
                    put_annotations(&b, ann)
                    nd.annotations = True
            lit(&b, b',"containerEdits":')
            if put_edits(&b, entry[1], i, &nd) == 0:
                raise ValueError(f"devices[{i}].containerEdits: a device needs at least one edit")
            putc(&b, b'}')
        putc(&b, b']')
        put_common(&b, common, &nd)
        version = _final_version(cdi_version, &nd, class_dot, digit_name)
        return _assemble(&b, version, kind)
    finally:
        PyMem_Free(b.p)


def render_channel_spec(kind, channels, major, name_prefix="", file_mode=0o666, host_root="", common=None,
                        cdi_version=None, device_name=None):
    """Render a bulk IMEX-channel spec; see the twin ``cdispec_py.render_channel_spec``."""
    cdef Buf b
    cdef Needs nd
    cdef bint class_dot, digit_name
    cdef bint single = device_name is not None
    cdef tuple entries
    cdef Py_ssize_t i, count, prefix_start, prefix_len, root_start, root_len
    cdef long long n = 0, major_v, mode_v = 0
    cdef int code
    cdef bint has_mode = file_mode is not None
    cdef int first_index[C_IMEX_CHANNEL_COUNT]
    cdef str prefix, root, one = ""
    cdef char* scratch
    if cdi_version is not None:
        _check_version(cdi_version)
    class_dot = _check_kind(kind)
    prefix = _str(name_prefix, "name_prefix")
    major_v = _int(major, "major", 0, MAX_MAJOR)
    if has_mode:
        mode_v = _int(file_mode, "fileMode", 0, MAX_FILE_MODE)
    root = _str(host_root, "host_root")
    if root and not root.startswith("/"):
        raise ValueError(f"host_root {root!r} is not an absolute path")
    root = root.rstrip("/")
    if single:
        one = _str(device_name, "devices[0].name")
        _check_name(one, "devices[0].name")
        if prefix:
            raise ValueError(f"name_prefix {prefix!r}: a spec with one device_name takes no name_prefix")
    if not isinstance(channels, (tuple, list, range)):
        raise TypeError(f"channels must be a tuple, list or range, not {_tn(channels)}")
    entries = _tup(channels)
    count = len(entries)
    if count == 0:
        if single:
            raise ValueError("channels: the device needs at least one channel")
        raise ValueError("devices: a spec needs at least one device")
    nd.annotations = nd.gids = nd.host_path = nd.mount_type = nd.net_devices = False
    if root:
        nd.host_path = True
    for i in range(C_IMEX_CHANNEL_COUNT):
        first_index[i] = -1
    b.p = NULL
    b.n = 0
    b.cap = 0
    try:
        # The escaped prefix and root are written once into the buffer's head and copied from there.
        buf_reserve(&b, count * 200 + 4 * (len(prefix) + len(root) + len(one)) * 12 + 64)
        prefix_start = b.n
        put_raw(&b, prefix)
        prefix_len = b.n - prefix_start
        root_start = b.n
        put_raw(&b, root)
        root_len = b.n - root_start
        scratch = <char*>PyMem_Realloc(NULL, <size_t>(prefix_len + root_len + 1))
        if scratch == NULL:
            raise MemoryError()
        try:
            memcpy(scratch, b.p + prefix_start, <size_t>prefix_len)
            memcpy(scratch + prefix_len, b.p + root_start, <size_t>root_len)
            b.n = 0
            lit(&b, b'"devices":[')
            if single:
                lit(&b, b'{"name":"')
                put_raw(&b, one)
                lit(&b, b'","containerEdits":{"deviceNodes":[')
            for i in range(count):
                code = _int_code(entries[i], 0, C_IMEX_CHANNEL_COUNT - 1, &n)
                if code:
                    _int_error(code, entries[i], f"channels[{i}]", 0, C_IMEX_CHANNEL_COUNT - 1)
                if single:
                    if first_index[n] >= 0:
                        raise ValueError(f"channels[{i}] {n}: duplicate channel (also channels[{first_index[n]}])")
                    first_index[n] = <int>i
                    lit(&b, b'{"path":"/dev/nvidia-caps-imex-channels/channel' if i == 0
                        else b',{"path":"/dev/nvidia-caps-imex-channels/channel')
                else:
                    if i == 0:
                        _check_name(f"{prefix}{n}", f"devices[{i}].name")
                    if first_index[n] >= 0:
                        raise ValueError(
                            f"devices[{i}].name {prefix + str(n)!r}: duplicate device name "
                            f"(also devices[{first_index[n]}])"
                        )
                    first_index[n] = <int>i
                    lit(&b, b'{"name":"' if i == 0 else b',{"name":"')
                    put(&b, scratch, prefix_len)
                    put_uint(&b, <unsigned long long>n)
                    lit(&b, b'","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia-caps-imex-channels/channel')
                put_uint(&b, <unsigned long long>n)
                if root_len or root:
                    lit(&b, b'","hostPath":"')
                    put(&b, scratch + prefix_len, root_len)
                    lit(&b, b'/dev/nvidia-caps-imex-channels/channel')
                    put_uint(&b, <unsigned long long>n)
                lit(&b, b'","type":"c"')
                if major_v:
                    lit(&b, b',"major":')
                    put_uint(&b, <unsigned long long>major_v)
                if n:
                    lit(&b, b',"minor":')
                    put_uint(&b, <unsigned long long>n)
                if has_mode:
                    lit(&b, b',"fileMode":')
                    put_uint(&b, <unsigned long long>mode_v)
                lit(&b, b'}' if single else b'}]}}')
            if single:
                lit(&b, b']}}')
        finally:
            PyMem_Free(scratch)
        putc(&b, b']')
        if single:
            digit_name = 0x30 <= ord(one[0]) <= 0x39
        else:
            digit_name = (len(prefix) == 0) or (0x30 <= ord(prefix[0]) <= 0x39)
        put_common(&b, common, &nd)
        version = _final_version(cdi_version, &nd, class_dot, digit_name)
        return _assemble(&b, version, kind)
    finally:
        PyMem_Free(b.p)
