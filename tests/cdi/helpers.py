"""Checks every produced CDI spec must pass: the official JSON schema and the stricter Go-library rules.

The schema (``tests/cdi/schema``, copied from the CDI project) is only a coarse shape check (``cdi.md`` section 3), so
:func:`check_strict` re-implements what makes the CDI Go library (and a strict JSON decoder) reject a file
(``cdi.md`` sections 1.4, 2.1, 2.2 and 6), plus the stricter rules of 6.7 we hold ourselves to (absolute
paths, fully-specified character devices). It is written independently of the renderer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from dradriver.domain.cdi import ContainerEdits, DeviceNodeError, render_claim_spec
from dradriver.domain.devicemetadata import decode
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.identity import GPU_DRIVER
from dradriver.host import cdifiles
from dradriver.host.devicenodes import DeviceNodeInfo, device_edits
from dradriver.preparers import gpu as gpu_preparers

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = Path(__file__).resolve().parent / "schema"  # the CDI schema, carried with the tests (README there)

KNOWN = ["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"]

_SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_KEYS = {"name", "annotations", "containerEdits"}
_EDITS_KEYS = ["env", "deviceNodes", "netDevices", "hooks", "mounts", "intelRdt", "additionalGids"]
_NODE_KEYS = ["path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"]
_MOUNT_KEYS = ["hostPath", "containerPath", "options", "type"]
_HOOK_KEYS = ["hookName", "path", "args", "env", "timeout"]
_NET_KEYS = ["hostInterfaceName", "name"]
_HOOK_NAMES = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
_KIND_PART = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


@cache
def schema_validator() -> jsonschema.Draft7Validator:
    """Validator for ``schema.json`` with ``defs.json`` resolved by its relative reference."""
    base = SCHEMA_DIR.resolve().as_uri() + "/"
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry: Registry = Registry().with_resources(
        [
            (base + "schema.json", Resource.from_contents(schema, default_specification=DRAFT7)),
            (base + "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)),
        ]
    )
    return jsonschema.Draft7Validator({"$ref": base + "schema.json"}, registry=registry)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate JSON keys {keys}"
    return dict(pairs)


def _keys_in_order(obj: dict[str, Any], allowed: list[str], where: str) -> None:
    unknown = set(obj) - set(allowed)
    assert not unknown, f"{where}: unknown fields {unknown}"
    order = [k for k in allowed if k in obj]
    assert list(obj) == order, f"{where}: keys {list(obj)} not in Go struct order {order}"


def minimum_version(spec: dict[str, Any]) -> str:
    """``MinimumRequiredVersion`` (``cdi.md`` 1.4) over a parsed spec."""
    edits = [spec.get("containerEdits") or {}] + [d["containerEdits"] for d in spec["devices"]]
    nodes = [n for e in edits for n in e.get("deviceNodes", [])]
    rdts = [e["intelRdt"] for e in edits if "intelRdt" in e]
    if any(e.get("netDevices") for e in edits) or any(
        r.get("schemata") is not None or r.get("enableMonitoring") for r in rdts
    ):
        return "1.1.0"
    if rdts or any(e.get("additionalGids") for e in edits):
        return "0.7.0"
    cls = spec["kind"].split("/", 1)[1]
    if spec.get("annotations") or any(d.get("annotations") for d in spec["devices"]) or "." in cls:
        return "0.6.0"
    if any(d["name"][0].isdigit() for d in spec["devices"]) or any(n.get("hostPath") for n in nodes):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", [])):
        return "0.4.0"
    return "0.3.0"


def _check_env(entries: list[Any], where: str) -> None:
    for e in entries:
        assert isinstance(e, str) and e.find("=") > 0, f"{where}: bad env {e!r}"


def _check_edits(edits: dict[str, Any], where: str, *, device: bool, full: bool) -> None:
    assert isinstance(edits, dict), where
    _keys_in_order(edits, _EDITS_KEYS, where)
    if device:
        assert any(edits.get(k) for k in _EDITS_KEYS), f"{where}: empty device edits"
    _check_env(edits.get("env", []), where)
    for node in edits.get("deviceNodes", []):
        _keys_in_order(node, _NODE_KEYS, f"{where}.deviceNodes")
        assert node["path"].startswith("/"), f"{where}: relative device path {node['path']}"
        assert node.get("hostPath", "/").startswith("/"), f"{where}: relative hostPath"
        assert node.get("type", "") in {"", "b", "c", "u", "p"}, f"{where}: type {node.get('type')}"
        assert set(node.get("permissions", "")) <= set("rwm"), f"{where}: permissions"
        for key in ("major", "minor", "fileMode", "uid", "gid"):
            if key in node:
                assert type(node[key]) is int and node[key] >= 0, f"{where}: {key}"
        for key in ("major", "minor"):
            assert node.get(key, 1) != 0, f"{where}: {key} 0 must be omitted (Go omitempty)"
        if full:
            assert node.get("type") == "c", f"{where}: our nodes are character devices"
            assert node.get("major", 0) > 0, f"{where}: char node without major is not fully specified"
    nets = edits.get("netDevices", [])
    for net in nets:
        _keys_in_order(net, _NET_KEYS, f"{where}.netDevices")
        assert net["hostInterfaceName"] and net["name"]
    assert len({n["hostInterfaceName"] for n in nets}) == len(nets)
    assert len({n["name"] for n in nets}) == len(nets)
    for hook in edits.get("hooks", []):
        _keys_in_order(hook, _HOOK_KEYS, f"{where}.hooks")
        assert hook["hookName"] in _HOOK_NAMES, f"{where}: hook name {hook['hookName']}"
        assert hook["path"].startswith("/"), f"{where}: relative hook path"
        _check_env(hook.get("env", []), f"{where}.hooks")
        assert hook.get("timeout", 1) > 0
    for mount in edits.get("mounts", []):
        _keys_in_order(mount, _MOUNT_KEYS, f"{where}.mounts")
        assert mount["hostPath"].startswith("/") and mount["containerPath"].startswith("/"), where
    for gid in edits.get("additionalGids", []):
        assert type(gid) is int and 0 <= gid < 2**32


def check_strict(data: bytes, *, fully_specified: bool = False) -> dict[str, Any]:
    """Parse ``data`` strictly and assert every rule of ``cdi.md`` section 6; return the spec.

    :param fully_specified: also require every device node to be a character device with a major
        (what our claim specs write, so runtimes can create nodes missing on the host).
    """
    spec: dict[str, Any] = json.loads(data, object_pairs_hook=_no_duplicates)
    assert list(spec)[:2] == ["cdiVersion", "kind"], "cdiVersion and kind come first"
    _keys_in_order(spec, ["cdiVersion", "kind", "annotations", "devices", "containerEdits"], "spec")
    assert set(spec) <= _SPEC_KEYS
    version = spec["cdiVersion"].removeprefix("v")
    assert version in KNOWN, f"unknown cdiVersion {version}"
    assert KNOWN.index(version) >= KNOWN.index(minimum_version(spec)), "cdiVersion below the minimum"
    vendor, sep, cls = spec["kind"].partition("/")
    assert sep and _KIND_PART.fullmatch(vendor) and _KIND_PART.fullmatch(cls), spec["kind"]
    assert len(vendor) >= 2 and len(cls) >= 2, "1-character vendor or class crashes released consumers"
    assert spec["devices"], "no devices"
    names = [d["name"] for d in spec["devices"]]
    assert len(names) == len(set(names)), "duplicate device names"
    for dev in spec["devices"]:
        _keys_in_order(dev, ["name", "annotations", "containerEdits"], "device")
        assert set(dev) <= _DEVICE_KEYS
        assert _DEVICE_NAME.fullmatch(dev["name"]), f"invalid device name {dev['name']!r}"
        _check_edits(dev["containerEdits"], f"device {dev['name']}", device=True, full=fully_specified)
    _check_edits(spec.get("containerEdits", {}), "spec", device=False, full=fully_specified)
    return spec


def validate(data: bytes, *, fully_specified: bool = False) -> dict[str, Any]:
    """Schema check plus strict check; assert the version is exactly the minimum; return the spec."""
    spec = check_strict(data, fully_specified=fully_specified)
    schema_validator().validate(spec)
    assert spec["cdiVersion"] == minimum_version(spec), "not the lowest version the content needs"
    return spec


def render_gpu_spec(
    claim_uid: str,
    devices: Iterable[GpuDevice | MigDevice],
    *,
    node_info: DeviceNodeInfo | None = None,
    common: ContainerEdits | None = None,
    extra_edits: Mapping[str, ContainerEdits] | None = None,
) -> bytes:
    """A GPU-plugin claim spec as the batch runner composes it: each device's preparer edits (plus
    ``extra_edits`` of its name), the plugin's spec-level edits, rendered for kind ``k8s.gpu.nvidia.com/claim``."""
    info = node_info or DeviceNodeInfo()
    extras = extra_edits or {}
    try:
        majors = info.read_majors()
        records = []
        for device in devices:
            edits = device_edits(device, info, majors)
            if device.name in extras:
                edits = edits + extras[device.name]
            records.append((device.name, edits))
        top = gpu_preparers.spec_edits(info, common)
    except DeviceNodeError as exc:
        raise DeviceNodeError(f"claim {claim_uid}: CDI spec: {exc}") from exc
    return render_claim_spec(GPU_DRIVER.cdi, claim_uid, records, top)


def write_gpu_spec(cdi_root: Path | str, claim_uid: str, devices: Iterable[GpuDevice | MigDevice],
                   **kwargs: Any) -> Path:
    """:func:`render_gpu_spec`, written as the claim's spec file (atomically, directory fsync'd)."""
    return cdifiles.write_claim_spec(GPU_DRIVER.cdi, cdi_root, claim_uid, render_gpu_spec(claim_uid, devices, **kwargs))


def read_mounted_metadata(mount: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Follow a metadata mount to its file on the host (read-only bind mount checked) and decode its stream."""
    assert "ro" in mount["options"] and "bind" in mount["options"], mount
    return decode(Path(mount["hostPath"]).read_bytes())
