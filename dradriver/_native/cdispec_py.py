"""CDI spec renderer, pure-Python twin of ``ext/cdispec.pyx`` (select with ``dradriver._native.load("cdispec")``).

Both implementations take the same plain data (tuples or lists of ``str`` and ``int``) and return the same
compact JSON bytes, byte for byte, or raise the same exception type with the same message. This twin builds
dicts and hands them to :func:`json.dumps`; the extension writes the bytes directly.

Input shapes (CDI object model, the CDI ``SPEC.md``; keys are emitted in the Go struct order):

* ``edits``: ``(env, device_nodes, net_devices, hooks, mounts, additional_gids)``

  - ``env``: ``NAME=VALUE`` strings;
  - ``device_nodes``: ``(path, host_path, type, major, minor, file_mode, permissions, uid, gid)``; ``""``
    omits a string field, ``0`` omits ``major``/``minor`` (Go ``omitempty``), ``None`` omits ``file_mode``,
    ``uid``, ``gid``; ``file_mode`` holds permission bits (``0o666`` is written as ``438``);
  - ``net_devices``: ``(host_interface_name, name)``;
  - ``hooks``: ``(hook_name, path, args, env, timeout)``; ``timeout`` in seconds or ``None``;
  - ``mounts``: ``(host_path, container_path, options, type)``;
  - ``additional_gids``: ints (uint32).

* ``device``: ``(name, edits)`` or ``(name, edits, annotations)``;
* ``annotations``: ``(key, value)`` pairs, written sorted by key like Go's map encoder.

Validation (the CDI library's ``pkg/parser/parser.go`` and ``pkg/cdi/spec.go``, plus stricter rules the library does not
check: absolute
paths, Linux device-number ranges): :class:`TypeError` for a wrong type or record shape, :class:`ValueError`
for a bad value; each message names the field (``devices[3].containerEdits.deviceNodes[0].path``).

``cdiVersion`` is the lowest version the content needs (the CDI library's ``specs-go/version.go``) unless one is given,
in which case it must be a known version not older than that minimum. ``intelRdt`` is not supported (NVIDIA specs
never carry it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

#: Versions the CDI library knows (``specs-go/version.go``); a leading ``v`` is tolerated.
KNOWN_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
#: Hook names the CDI library accepts (the CDI ``SPEC.md``, "Hooks").
HOOK_NAMES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
#: Device-node types the library accepts (rule 13); ``"char"`` is rejected by real consumers.
NODE_TYPES = ("", "b", "c", "u", "p")
#: Linux device numbers: 12-bit major, 20-bit minor (``MINORBITS``).
MAX_MAJOR = 4095
MAX_MINOR = (1 << 20) - 1
MAX_FILE_MODE = 0o7777
MAX_UINT32 = 4294967295
#: Channels a node exposes under ``/dev/nvidia-caps-imex-channels`` (NVIDIA's
#: ``cmd/compute-domain-kubelet-plugin/nvlib.go``).
IMEX_CHANNEL_COUNT = 2048
IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels/channel"
#: Sum of annotation key and value lengths allowed per map (Kubernetes ``TotalAnnotationSizeLimitB``).
MAX_ANNOTATIONS_SIZE = 256 * 1024

_ALPHA = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_DIGIT = frozenset("0123456789")
_ALNUM = _ALPHA | _DIGIT
_KIND_INNER = _ALNUM | frozenset("_-.")
_NAME_INNER = _ALNUM | frozenset("_-.:")
_DNS_INNER = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
_DNS_END = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_PERMISSIONS = frozenset("rwm")

_VERSION_SCORE = {v: i for i, v in enumerate(KNOWN_VERSIONS)}


def _tname(value: object) -> str:
    return type(value).__name__


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be str, not {_tname(value)}")
    return value


def _seq(value: object, where: str) -> Sequence[Any]:
    if not isinstance(value, tuple | list):
        raise TypeError(f"{where} must be a tuple or list, not {_tname(value)}")
    return value


def _record(value: object, where: str, size: int, shape: str) -> Sequence[Any]:
    if not isinstance(value, tuple | list):
        raise TypeError(f"{where} must be a tuple or list, not {_tname(value)}")
    if len(value) != size:
        raise TypeError(f"{where} must have {size} fields {shape}, got {len(value)}")
    return value


def _int(value: object, where: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where} must be int, not {_tname(value)}")
    if value < low or value > high:
        raise ValueError(f"{where} {value} is out of range [{low}, {high}]")
    return value


def _abs_path(value: object, where: str, *, optional: bool = False) -> str:
    text = _str(value, where)
    if optional and not text:
        return text
    if not text.startswith("/"):
        raise ValueError(f"{where} {text!r} is not an absolute path")
    return text


def _env(value: object, where: str) -> str:
    text = _str(value, where)
    if text.find("=") <= 0:
        raise ValueError(f"{where} {text!r} is not NAME=VALUE with a non-empty NAME")
    return text


def _kind_part(part: str, what: str, limit: int, kind: str) -> None:
    if len(part) < 2:
        raise ValueError(f"kind {kind!r}: {what} must be at least 2 characters")
    if len(part) > limit:
        raise ValueError(f"kind {kind!r}: {what} is longer than {limit} characters")
    if part[0] not in _ALPHA:
        raise ValueError(f"kind {kind!r}: {what} must start with a letter")
    if part[-1] not in _ALNUM:
        raise ValueError(f"kind {kind!r}: {what} must end with a letter or digit")
    for ch in part:
        if ch not in _KIND_INNER:
            raise ValueError(f"kind {kind!r}: {what} has invalid character {ch!r}")


def _check_kind(kind: object) -> bool:
    """Validate ``vendor/class`` (the CDI library's ``pkg/parser/parser.go``); True when the class has a dot (needs
    0.6.0)."""
    text = _str(kind, "kind")
    slash = text.find("/")
    if slash < 0:
        raise ValueError(f"kind {text!r}: must be vendor/class")
    vendor, cls = text[:slash], text[slash + 1 :]
    _kind_part(vendor, "vendor", 253, text)
    _kind_part(cls, "class", 63, text)
    return "." in cls


def _check_name(name: object, where: str) -> str:
    """Validate a device name (the CDI library's ``pkg/parser/parser.go``)."""
    text = _str(name, where)
    if not text:
        raise ValueError(f"{where} {text!r}: invalid CDI device name: empty")
    if text[0] not in _ALNUM:
        raise ValueError(f"{where} {text!r}: invalid CDI device name: must start with a letter or digit")
    if text[-1] not in _ALNUM:
        raise ValueError(f"{where} {text!r}: invalid CDI device name: must end with a letter or digit")
    for ch in text:
        if ch not in _NAME_INNER:
            raise ValueError(f"{where} {text!r}: invalid CDI device name: invalid character {ch!r}")
    return text


def _check_dns_subdomain(prefix: str, where: str, key: str) -> None:
    if not prefix or len(prefix) > 253:
        raise ValueError(f"{where} key {key!r}: prefix must be 1-253 characters")
    for label in prefix.split("."):
        if not label or label[0] not in _DNS_END or label[-1] not in _DNS_END:
            raise ValueError(f"{where} key {key!r}: prefix is not a lower-case DNS subdomain")
        for ch in label:
            if ch not in _DNS_INNER:
                raise ValueError(f"{where} key {key!r}: prefix is not a lower-case DNS subdomain")


def _check_annotations(value: object, where: str) -> dict[str, str]:
    """Validate ``(key, value)`` pairs as Kubernetes annotations (the CDI library's ``pkg/cdi/annotations.go``); return
    them sorted."""
    pairs = _seq(value, where)
    out: dict[str, str] = {}
    size = 0
    for i, pair in enumerate(pairs):
        item = f"{where}[{i}]"
        key, val = _record(pair, item, 2, "(key, value)")
        _str(key, f"{item}.key")
        _str(val, f"{item}.value")
        slash = key.find("/")
        name = key
        if slash >= 0:
            _check_dns_subdomain(key[:slash], where, key)
            name = key[slash + 1 :]
        if not name or len(name) > 63:
            raise ValueError(f"{where} key {key!r}: name must be 1-63 characters")
        if name[0] not in _ALNUM or name[-1] not in _ALNUM:
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
    return {k: out[k] for k in sorted(out)}


class _Needs:
    """Content facts that raise the minimum cdiVersion (the CDI library's ``specs-go/version.go``)."""

    __slots__ = ("annotations", "gids", "host_path", "mount_type", "net_devices")

    def __init__(self) -> None:
        self.annotations = False
        self.gids = False
        self.host_path = False
        self.mount_type = False
        self.net_devices = False


def _node(value: object, where: str, needs: _Needs) -> dict[str, Any]:
    rec = _record(value, where, 9, "(path, hostPath, type, major, minor, fileMode, permissions, uid, gid)")
    out: dict[str, Any] = {"path": _abs_path(rec[0], f"{where}.path")}
    host = _abs_path(rec[1], f"{where}.hostPath", optional=True)
    if host:
        out["hostPath"] = host
        needs.host_path = True
    typ = _str(rec[2], f"{where}.type")
    if typ not in NODE_TYPES:
        raise ValueError(f"{where}.type {typ!r} is not one of '', 'b', 'c', 'u', 'p'")
    if typ:
        out["type"] = typ
    major = _int(rec[3], f"{where}.major", 0, MAX_MAJOR)
    if major:
        out["major"] = major
    minor = _int(rec[4], f"{where}.minor", 0, MAX_MINOR)
    if minor:
        out["minor"] = minor
    if rec[5] is not None:
        out["fileMode"] = _int(rec[5], f"{where}.fileMode", 0, MAX_FILE_MODE)
    perms = _str(rec[6], f"{where}.permissions")
    for ch in perms:
        if ch not in _PERMISSIONS:
            raise ValueError(f"{where}.permissions {perms!r} may hold only 'r', 'w' and 'm'")
    if perms:
        out["permissions"] = perms
    if rec[7] is not None:
        out["uid"] = _int(rec[7], f"{where}.uid", 0, MAX_UINT32)
    if rec[8] is not None:
        out["gid"] = _int(rec[8], f"{where}.gid", 0, MAX_UINT32)
    return out


def _net_devices(value: object, where: str) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    hosts: set[str] = set()
    names: set[str] = set()
    for i, item in enumerate(_seq(value, where)):
        at = f"{where}[{i}]"
        rec = _record(item, at, 2, "(hostInterfaceName, name)")
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
        out.append({"hostInterfaceName": host, "name": name})
    return out


def _hook(value: object, where: str) -> dict[str, Any]:
    rec = _record(value, where, 5, "(hookName, path, args, env, timeout)")
    name = _str(rec[0], f"{where}.hookName")
    if name not in HOOK_NAMES:
        raise ValueError(f"{where}.hookName {name!r} is not a CDI hook name")
    out: dict[str, Any] = {"hookName": name, "path": _abs_path(rec[1], f"{where}.path")}
    args = [_str(a, f"{where}.args[{j}]") for j, a in enumerate(_seq(rec[2], f"{where}.args"))]
    if args:
        out["args"] = args
    env = [_env(e, f"{where}.env[{j}]") for j, e in enumerate(_seq(rec[3], f"{where}.env"))]
    if env:
        out["env"] = env
    if rec[4] is not None:
        out["timeout"] = _int(rec[4], f"{where}.timeout", 1, MAX_UINT32)
    return out


def _mount(value: object, where: str, needs: _Needs) -> dict[str, Any]:
    rec = _record(value, where, 4, "(hostPath, containerPath, options, type)")
    out: dict[str, Any] = {
        "hostPath": _abs_path(rec[0], f"{where}.hostPath"),
        "containerPath": _abs_path(rec[1], f"{where}.containerPath"),
    }
    options = [_str(o, f"{where}.options[{j}]") for j, o in enumerate(_seq(rec[2], f"{where}.options"))]
    if options:
        out["options"] = options
    typ = _str(rec[3], f"{where}.type")
    if typ:
        out["type"] = typ
        needs.mount_type = True
    return out


def _edits(value: object, where: str, needs: _Needs) -> dict[str, Any]:
    rec = _record(value, where, 6, "(env, deviceNodes, netDevices, hooks, mounts, additionalGids)")
    out: dict[str, Any] = {}
    env = [_env(e, f"{where}.env[{j}]") for j, e in enumerate(_seq(rec[0], f"{where}.env"))]
    if env:
        out["env"] = env
    nodes = [_node(n, f"{where}.deviceNodes[{j}]", needs) for j, n in enumerate(_seq(rec[1], f"{where}.deviceNodes"))]
    if nodes:
        out["deviceNodes"] = nodes
    nets = _net_devices(rec[2], f"{where}.netDevices")
    if nets:
        out["netDevices"] = nets
        needs.net_devices = True
    hooks = [_hook(h, f"{where}.hooks[{j}]") for j, h in enumerate(_seq(rec[3], f"{where}.hooks"))]
    if hooks:
        out["hooks"] = hooks
    mounts = [_mount(m, f"{where}.mounts[{j}]", needs) for j, m in enumerate(_seq(rec[4], f"{where}.mounts"))]
    if mounts:
        out["mounts"] = mounts
    gids = [
        _int(g, f"{where}.additionalGids[{j}]", 0, MAX_UINT32)
        for j, g in enumerate(_seq(rec[5], f"{where}.additionalGids"))
    ]
    if gids:
        out["additionalGids"] = gids
        needs.gids = True
    return out


def _check_version(value: object) -> str:
    text = _str(value, "cdiVersion")
    bare = text[1:] if text.startswith("v") else text
    if bare not in _VERSION_SCORE:
        raise ValueError(f"cdiVersion {text!r} is not a known CDI version")
    return bare


def _minimum(needs: _Needs, class_dot: bool, digit_name: bool) -> str:
    """The lowest cdiVersion for the content (the CDI library's ``specs-go/version.go``, newest rule first)."""
    if needs.net_devices:
        return "1.1.0"
    if needs.gids:
        return "0.7.0"
    if needs.annotations or class_dot:
        return "0.6.0"
    if digit_name or needs.host_path:
        return "0.5.0"
    if needs.mount_type:
        return "0.4.0"
    return "0.3.0"


def _finish(
    version: str | None,
    kind: str,
    spec_annotations: dict[str, str],
    devices: list[Any],
    common: dict[str, Any],
    needs: _Needs,
    class_dot: bool,
    digit_name: bool,
) -> bytes:
    minimum = _minimum(needs, class_dot, digit_name)
    if version is None:
        version = minimum
    else:
        bare = version[1:] if version.startswith("v") else version
        if _VERSION_SCORE[bare] < _VERSION_SCORE[minimum]:
            raise ValueError(f"cdiVersion {version!r} is older than {minimum!r}, which the content needs")
    spec: dict[str, Any] = {"cdiVersion": version, "kind": kind}
    if spec_annotations:
        spec["annotations"] = spec_annotations
    spec["devices"] = devices
    spec["containerEdits"] = common
    return json.dumps(spec, separators=(",", ":")).encode("ascii")


# The last spec-level edits record rendered, if built of tuples, strings, ints and None only (so its rendering
# cannot go stale): (record, its containerEdits dict, the needs it raised). Keeping the record alive makes its
# identity a safe key; a plugin passes the same spec-level record for every claim spec.
_common_cache: tuple[object, dict[str, Any], tuple[bool, ...]] | None = None


def _frozen(value: object) -> bool:
    """True when ``value`` is None, a str, an int or a tuple of such (recursively)."""
    if value is None or isinstance(value, str | int):
        return True
    return type(value) is tuple and all(_frozen(item) for item in value)


def _common(common: object, needs: _Needs) -> dict[str, Any]:
    global _common_cache
    if common is None:
        return {}
    cached = _common_cache
    if cached is not None and cached[0] is common:
        for slot, raised in zip(_Needs.__slots__, cached[2], strict=True):
            if raised:
                setattr(needs, slot, True)
        return cached[1]
    own = _Needs()
    edits = _edits(common, "containerEdits", own)
    raised_now = tuple(bool(getattr(own, slot)) for slot in _Needs.__slots__)
    for slot, raised in zip(_Needs.__slots__, raised_now, strict=True):
        if raised:
            setattr(needs, slot, True)
    if _frozen(common):
        _common_cache = (common, edits, raised_now)
    return edits


def render_spec(
    kind: str,
    devices: Sequence[Any],
    common: Sequence[Any] | None = None,
    annotations: Sequence[Any] = (),
    cdi_version: str | None = None,
) -> bytes:
    """Render one CDI spec as compact JSON bytes (ASCII; non-ASCII text is ``\\u``-escaped).

    :param kind: ``vendor/class``, e.g. ``k8s.gpu.nvidia.com/claim``.
    :param devices: ``(name, edits[, annotations])`` records; at least one; names unique.
    :param common: spec-level edits record or ``None`` (always emitted, as ``{}`` when empty).
    :param annotations: spec-level ``(key, value)`` pairs.
    :param cdi_version: declared version, or ``None`` for the computed minimum.
    :raises TypeError: a field has the wrong type or a record the wrong number of fields.
    :raises ValueError: a value breaks a CDI rule; the message names the field.
    """
    version = None if cdi_version is None else (_check_version(cdi_version) and cdi_version)
    class_dot = _check_kind(kind)
    needs = _Needs()
    spec_ann = _check_annotations(annotations, "annotations")
    if spec_ann:
        needs.annotations = True
    entries = _seq(devices, "devices")
    if not entries:
        raise ValueError("devices: a spec needs at least one device")
    seen: dict[str, int] = {}
    digit_name = False
    out: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        where = f"devices[{i}]"
        if not isinstance(entry, tuple | list):
            raise TypeError(f"{where} must be a tuple or list, not {_tname(entry)}")
        if len(entry) not in (2, 3):
            raise TypeError(f"{where} must have 2 or 3 fields (name, edits[, annotations]), got {len(entry)}")
        name = _check_name(entry[0], f"{where}.name")
        if name in seen:
            raise ValueError(f"{where}.name {name!r}: duplicate device name (also devices[{seen[name]}])")
        seen[name] = i
        if name[0] in _DIGIT:
            digit_name = True
        dev: dict[str, Any] = {"name": name}
        if len(entry) == 3:
            ann = _check_annotations(entry[2], f"{where}.annotations")
            if ann:
                dev["annotations"] = ann
                needs.annotations = True
        edits = _edits(entry[1], f"{where}.containerEdits", needs)
        if not edits:
            raise ValueError(f"{where}.containerEdits: a device needs at least one edit")
        dev["containerEdits"] = edits
        out.append(dev)
    return _finish(version, kind, spec_ann, out, _common(common, needs), needs, class_dot, digit_name)


def render_channel_spec(
    kind: str,
    channels: Sequence[int] | range,
    major: int,
    name_prefix: str = "",
    file_mode: int | None = 0o666,
    host_root: str = "",
    common: Sequence[Any] | None = None,
    cdi_version: str | None = None,
    device_name: str | None = None,
) -> bytes:
    """Render a bulk IMEX-channel spec: one device per channel, one char node each (or one device for all).

    Device ``<name_prefix><N>`` gets the node ``/dev/nvidia-caps-imex-channels/channel<N>``, type ``c``,
    ``major`` (the ``nvidia-caps-imex-channels`` line of ``/proc/devices``), minor ``N``, ``file_mode``
    (0666 as NVIDIA's compute-domain plugin writes, ``cmd/compute-domain-kubelet-plugin/cdi.go``), and ``hostPath`` =
    ``host_root`` + path when ``host_root`` is not empty.

    With ``device_name`` the spec has ONE device of that name whose ``deviceNodes`` hold every channel's node in
    the order of ``channels``: the form of NVIDIA's compute-domain claim spec, where an ``allocationMode: All``
    claim's device ``<claimUID>-channel-0`` carries ``channel0 .. channel2047`` (NVIDIA's
    ``cmd/compute-domain-kubelet-plugin/cdi.go``); ``name_prefix`` must then be empty.

    :param channels: channel numbers (tuple, list or range), each in ``[0, 2047]``; no duplicates.
    :param device_name: ``None``: one device ``<name_prefix><N>`` per channel; else the one device's name.
    :raises TypeError, ValueError: as :func:`render_spec`; a channel outside ``[0, 2047]`` is a ValueError, so are
        a duplicate channel and a ``device_name`` beside a non-empty ``name_prefix``.
    """
    version = None if cdi_version is None else (_check_version(cdi_version) and cdi_version)
    class_dot = _check_kind(kind)
    prefix = _str(name_prefix, "name_prefix")
    _int(major, "major", 0, MAX_MAJOR)
    if file_mode is not None:
        _int(file_mode, "fileMode", 0, MAX_FILE_MODE)
    root = _str(host_root, "host_root")
    if root and not root.startswith("/"):
        raise ValueError(f"host_root {root!r} is not an absolute path")
    root = root.rstrip("/")
    single = device_name is not None
    if single:
        one = _check_name(device_name, "devices[0].name")
        if prefix:
            raise ValueError(f"name_prefix {prefix!r}: a spec with one device_name takes no name_prefix")
    if not isinstance(channels, tuple | list | range):
        raise TypeError(f"channels must be a tuple, list or range, not {_tname(channels)}")
    entries = channels
    if not entries:
        raise ValueError("channels: the device needs at least one channel" if single
                         else "devices: a spec needs at least one device")
    needs = _Needs()
    seen: dict[str, int] = {}
    first_of: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    nodes: list[dict[str, Any]] = []
    for i, channel in enumerate(entries):
        n = _int(channel, f"channels[{i}]", 0, IMEX_CHANNEL_COUNT - 1)
        if single:
            if n in first_of:
                raise ValueError(f"channels[{i}] {n}: duplicate channel (also channels[{first_of[n]}])")
            first_of[n] = i
        else:
            name = _check_name(f"{prefix}{n}", f"devices[{i}].name")
            if name in seen:
                raise ValueError(f"devices[{i}].name {name!r}: duplicate device name (also devices[{seen[name]}])")
            seen[name] = i
        path = f"{IMEX_CHANNEL_DIR}{n}"
        node: dict[str, Any] = {"path": path}
        if root:
            node["hostPath"] = root + path
            needs.host_path = True
        node["type"] = "c"
        if major:
            node["major"] = major
        if n:
            node["minor"] = n
        if file_mode is not None:
            node["fileMode"] = file_mode
        if single:
            nodes.append(node)
        else:
            out.append({"name": name, "containerEdits": {"deviceNodes": [node]}})
    if single:
        out.append({"name": one, "containerEdits": {"deviceNodes": nodes}})
    digit_name = bool(out) and out[0]["name"][0] in _DIGIT
    return _finish(version, kind, {}, out, _common(common, needs), needs, class_dot, digit_name)
