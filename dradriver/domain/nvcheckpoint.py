"""NVIDIA's kubelet-plugin checkpoint (``checkpoint.json``): the model, and its bytes exactly as NVIDIA's Go driver
writes and verifies them.

Why this module exists: an operator rolling back from dradriver to NVIDIA's driver starts NVIDIA's
``gpu-kubelet-plugin`` on the same plugin directory. It reads ``<plugins dir>/gpu.nvidia.com/checkpoint.json``
to learn which claims are prepared; a file whose checksum it cannot verify makes it exit 1 before it registers
(a crash loop on the node), and an entry without ``status.allocation`` makes its next prepare panic. So dradriver
writes this file byte for byte as NVIDIA would, and reads NVIDIA's own without guessing.

Format (NVIDIA's ``cmd/gpu-kubelet-plugin/checkpoint*.go`` and ``cmd/compute-domain-kubelet-plugin/checkpoint*.go``
in github.com/kubernetes-sigs/dra-driver-nvidia-gpu; the kubelet's ``pkg/kubelet/checkpointmanager/checksum``):

* top level ``{"checksum": <V1 checksum>, "v1": {"preparedClaims": {...}}, "v2": {...}}``; ``v1`` is the
  downgrade view with only ``PrepareCompleted`` claims, each ``{"status", "preparedDevices"}``;
* ``v2`` = ``{"checksum", "preparedClaims": {<claim UID>: entry}, "nodeBootID"}``; an entry is
  ``{"checkpointState", "status", "preparedDevices", "name", "namespace"}`` (the compute-domain plugin adds
  ``abortedAt``); ``status`` is the claim's whole ``ResourceClaimStatus`` (``resource.k8s.io/v1``);
* a prepared-device group is ``{"devices": [...], "configState": {...}}``; a GPU plugin device is
  ``{"gpu": {"info": {"uuid"}, "device"} | null, "mig": {"concrete": {...}, "device"} | null, "vfio"?}`` and
  ``device`` is the kubelet plugin library's ``Device`` with Go field names (``Requests``, ``PoolName``,
  ``DeviceName``, ``CDIDeviceIDs``, ``ShareID``?, ``Metadata``?);
* checksum: FNV-32a over go-spew's ``%#v`` of the JSON bytes (``([]uint8)[123 34 ...]``, decimal bytes separated
  by spaces), stored as an unsigned integer. The V1 checksum covers the top-level object with ``checksum`` 0 and
  ``v2`` left out; the V2 checksum covers the ``v2`` object with its ``checksum`` 0. NVIDIA verifies by
  re-marshalling what it parsed, so the bytes that count are Go's ``encoding/json`` output of its structs:
  struct fields in declaration order, map keys sorted, ``omitempty`` fields left out when empty (a nil pointer,
  never a pointer to ``false``), fields NVIDIA does not know dropped, ``<``, ``>``, ``&``, U+2028 and U+2029
  escaped as ``\\u003c`` and the like. :func:`encode` writes exactly that; :func:`decode` re-encodes what it
  parsed the same way and compares, as NVIDIA does.

The Go types' field order is written out below as schemas (:data:`CLAIM_STATUS`, the entries): one place.
``Quantity`` values (``consumedCapacity``) and timestamps are kept as the API server sent them (it sends both in
their canonical form, which is what Go re-marshals).
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from dradriver import _native

__all__ = [
    "CD_CLAIM",
    "CLAIM_STATUS",
    "GPU_CLAIM",
    "Checkpoint",
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointState",
    "ClaimSchema",
    "ConfigState",
    "DeviceGroup",
    "EncodedEntry",
    "KubeletDevice",
    "MigConcrete",
    "PreparedDevice",
    "assemble",
    "checksum",
    "claim_status_json",
    "decode",
    "encode",
    "encode_entry",
    "go_json",
]

class CheckpointError(ValueError):
    """A checkpoint that cannot be read without guessing: not JSON, an unknown version, a field of the wrong
    type, or a checksum that does not verify. The message names the file's field and what was expected."""


class CheckpointState(enum.StrEnum):
    """``checkpointState`` of an entry."""

    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"
    PREPARE_ABORTED = "PrepareAborted"
    """Compute-domain plugin only: a prepare that lost to an unprepare, kept ``abortedAt`` + 90 s."""


# ---- Go's encoding/json, driven by a schema ------------------------------------------------------------------
#
# A schema is one of:
#   "string" | "int" | "bool" | "raw"           a Go value of that kind ("raw": json.RawMessage/RawExtension,
#                                                written as its compact bytes; missing -> null)
#   ("ptr", schema)                              a pointer: None -> null, anything else encoded (false included)
#   ("list", schema)                             a slice: None -> null, [] -> []
#   ("map", schema)                              a map with string keys, written in sorted key order
#   ("struct", ((key, schema, omitempty), ...))  a struct, fields in declaration order; missing -> zero value

Schema = Any

_STRING_LIST: Final = ("list", "string")
_META_CONDITION: Final = ("struct", (
    ("type", "string", False), ("status", "string", False), ("observedGeneration", "int", True),
    ("lastTransitionTime", "string", False), ("reason", "string", False), ("message", "string", False)))
_NODE_SELECTOR_REQUIREMENT: Final = ("struct", (
    ("key", "string", False), ("operator", "string", False), ("values", _STRING_LIST, True)))
_NODE_SELECTOR: Final = ("struct", (("nodeSelectorTerms", ("list", ("struct", (
    ("matchExpressions", ("list", _NODE_SELECTOR_REQUIREMENT), True),
    ("matchFields", ("list", _NODE_SELECTOR_REQUIREMENT), True)))), False),))
_DEVICE_TOLERATION: Final = ("struct", (
    ("key", "string", True), ("operator", "string", True), ("value", "string", True), ("effect", "string", True),
    ("tolerationSeconds", ("ptr", "int"), True)))
_REQUEST_RESULT: Final = ("struct", (
    ("request", "string", False), ("driver", "string", False), ("pool", "string", False),
    ("device", "string", False), ("adminAccess", ("ptr", "bool"), True),
    ("tolerations", ("list", _DEVICE_TOLERATION), True), ("bindingConditions", _STRING_LIST, True),
    ("bindingFailureConditions", _STRING_LIST, True), ("shareID", ("ptr", "string"), True),
    ("consumedCapacity", ("map", "string"), True)))
_ALLOCATION_CONFIG: Final = ("struct", (
    ("source", "string", False), ("requests", _STRING_LIST, True),
    ("opaque", ("ptr", ("struct", (("driver", "string", False), ("parameters", "raw", False)))), True)))
_ALLOCATION: Final = ("struct", (
    ("devices", ("struct", (("results", ("list", _REQUEST_RESULT), True),
                            ("config", ("list", _ALLOCATION_CONFIG), True))), True),
    ("nodeSelector", ("ptr", _NODE_SELECTOR), True),
    ("allocationTimestamp", ("ptr", "string"), True)))
_CONSUMER: Final = ("struct", (
    ("apiGroup", "string", True), ("resource", "string", False), ("name", "string", False),
    ("uid", "string", False)))
_DEVICE_STATUS: Final = ("struct", (
    ("driver", "string", False), ("pool", "string", False), ("device", "string", False),
    ("shareID", ("ptr", "string"), True), ("conditions", ("list", _META_CONDITION), False),
    ("data", ("ptr", "raw"), True),
    ("networkData", ("ptr", ("struct", (("interfaceName", "string", True), ("ips", _STRING_LIST, True),
                                        ("hardwareAddress", "string", True)))), True)))
CLAIM_STATUS: Final[Schema] = ("struct", (
    ("allocation", ("ptr", _ALLOCATION), True),
    ("reservedFor", ("list", _CONSUMER), True),
    ("devices", ("list", _DEVICE_STATUS), True)))
"""``ResourceClaimStatus`` of ``k8s.io/api/resource/v1`` (Kubernetes 1.34, the API NVIDIA's driver vendors)."""

_KUBELET_DEVICE: Final = ("struct", (
    ("Requests", _STRING_LIST, False), ("PoolName", "string", False), ("DeviceName", "string", False),
    ("CDIDeviceIDs", _STRING_LIST, False), ("ShareID", ("ptr", "string"), True), ("Metadata", ("ptr", "raw"), True)))
"""``k8s.io/dynamic-resource-allocation/kubeletplugin.Device`` as NVIDIA tags it."""

_GPU_DEVICE: Final = ("struct", (
    ("gpu", ("ptr", ("struct", (("info", ("ptr", ("struct", (("uuid", "string", False),))), False),
                                ("device", ("ptr", _KUBELET_DEVICE), False)))), False),
    ("mig", ("ptr", ("struct", (
        ("concrete", ("ptr", ("struct", (
            ("parentMinor", "int", False), ("giId", "int", False), ("ciId", "int", False),
            ("migUUID", "string", False), ("parentUUID", "string", False),
            ("parentPCIBusID", "string", True)))), False),
        ("device", ("ptr", _KUBELET_DEVICE), False)))), False),
    ("vfio", ("ptr", ("struct", (("info", ("ptr", ("struct", (("uuid", "string", False),
                                                               ("pciBusID", "string", True)))), False),
                                 ("device", ("ptr", _KUBELET_DEVICE), False)))), True)))
_GPU_CONFIG_STATE: Final = ("struct", (
    ("mpsControlDaemonID", "string", True), ("mpsApplied", "bool", True), ("timeSliceApplied", "bool", True)))
_CD_DEVICE: Final = ("struct", (
    ("channel", ("ptr", ("struct", (("info", ("ptr", ("struct", (("id", "int", False),))), False),
                                    ("device", ("ptr", _KUBELET_DEVICE), False)))), False),
    ("daemon", ("ptr", ("struct", (("info", ("ptr", ("struct", (("id", "int", False),))), False),
                                   ("device", ("ptr", _KUBELET_DEVICE), False)))), False)))
_CD_CONFIG_STATE: Final = ("struct", (("Type", "string", False), ("ComputeDomain", "string", False)))


@dataclass(frozen=True, slots=True)
class ClaimSchema:
    """The Go shapes of one plugin's checkpoint entry: its prepared device and its group's ``configState``."""

    device: Schema
    config_state: Schema
    aborted_at: bool = False
    """The entry has ``abortedAt`` (compute-domain plugin)."""


GPU_CLAIM: Final = ClaimSchema(device=_GPU_DEVICE, config_state=_GPU_CONFIG_STATE)
"""``gpu.nvidia.com`` (checked byte for byte against NVIDIA's binary for full GPUs)."""
CD_CLAIM: Final = ClaimSchema(device=_CD_DEVICE, config_state=_CD_CONFIG_STATE, aborted_at=True)
"""``compute-domain.nvidia.com`` (from NVIDIA's source; no binary of it to check against)."""


@functools.cache
def _groups_schema(claim: ClaimSchema) -> Schema:
    return ("list", ("struct", (("devices", ("list", claim.device), False),
                                ("configState", claim.config_state, False))))


@functools.cache
def _entry_schema(claim: ClaimSchema, *, v1: bool) -> Schema:
    groups = _groups_schema(claim)
    if v1:
        return ("struct", (("status", CLAIM_STATUS, False), ("preparedDevices", groups, True)))
    fields: list[tuple[str, Schema, bool]] = [
        ("checkpointState", "string", False), ("status", CLAIM_STATUS, False), ("preparedDevices", groups, True),
        ("name", "string", True), ("namespace", "string", True)]
    if claim.aborted_at:
        fields.append(("abortedAt", ("ptr", "string"), True))
    return ("struct", tuple(fields))


def _v1_schema(claim: ClaimSchema) -> Schema:
    return ("struct", (("preparedClaims", ("map", _entry_schema(claim, v1=True)), True),))


def _v2_schema(claim: ClaimSchema) -> Schema:
    return ("struct", (("checksum", "int", False),
                       ("preparedClaims", ("map", _entry_schema(claim, v1=False)), True),
                       ("nodeBootID", "string", True)))


def _top_schema(claim: ClaimSchema) -> Schema:
    return ("struct", (("checksum", "int", False), ("v1", ("ptr", _v1_schema(claim)), True),
                       ("v2", ("ptr", _v2_schema(claim)), True)))


_ESCAPES: Final = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                                 "\u2029": "\\u2029"})


def _go_string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False).translate(_ESCAPES)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).translate(_ESCAPES)


def _empty(schema: Schema, value: Any) -> bool:
    """Go's ``omitempty``: false, 0, "", a nil pointer, an empty slice or map. A struct is never empty."""
    if value is None:
        return not (isinstance(schema, tuple) and schema[0] == "struct")
    if isinstance(schema, tuple):
        kind = schema[0]
        if kind in ("list", "map"):
            return len(value) == 0
        return False
    return schema != "raw" and not value


class _Encoded(str):
    """A value already in Go's JSON (written as it is): a part shared by an entry's V2 and V1 forms."""


def _encode(schema: Schema, value: Any, out: list[str], where: str) -> None:
    if type(value) is _Encoded:
        out.append(value)
        return
    if isinstance(schema, str):
        if schema == "string":
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise CheckpointError(f"{where}: must be a string, got {type(value).__name__}")
            out.append(_go_string(value))
        elif schema == "int":
            if value is None:
                value = 0
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(f"{where}: must be an integer, got {type(value).__name__}")
            out.append(str(value))
        elif schema == "bool":
            if value is None:
                value = False
            if not isinstance(value, bool):
                raise CheckpointError(f"{where}: must be a boolean, got {type(value).__name__}")
            out.append("true" if value else "false")
        else:  # raw
            out.append("null" if value is None else _compact(value))
        return
    kind, inner = schema
    if kind == "ptr":
        if value is None:
            out.append("null")
        else:
            _encode(inner, value, out, where)
    elif kind == "list":
        if value is None:
            out.append("null")
            return
        if not isinstance(value, list | tuple):
            raise CheckpointError(f"{where}: must be a list, got {type(value).__name__}")
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(inner, item, out, f"{where}[{i}]")
        out.append("]")
    elif kind == "map":
        if value is None:
            out.append("null")
            return
        if not isinstance(value, Mapping):
            raise CheckpointError(f"{where}: must be an object, got {type(value).__name__}")
        out.append("{")
        for i, key in enumerate(sorted(value)):
            if i:
                out.append(",")
            out.append(_go_string(key))
            out.append(":")
            _encode(inner, value[key], out, f"{where}[{key!r}]")
        out.append("}")
    else:  # struct
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise CheckpointError(f"{where}: must be an object, got {type(value).__name__}")
        out.append("{")
        first = True
        for key, field_schema, omitempty in inner:
            item = value.get(key)
            if omitempty and _empty(field_schema, item):
                continue
            if not first:
                out.append(",")
            first = False
            out.append(_go_string(key))
            out.append(":")
            _encode(field_schema, item, out, f"{where}.{key}" if where else key)
        out.append("}")


def go_json(schema: Schema, value: Any, where: str = "") -> bytes:
    """``value`` (JSON-shaped Python data) as Go's ``json.Marshal`` writes the Go type ``schema`` describes.

    :raises CheckpointError: a field has the wrong JSON type (named by its path from ``where``).
    """
    out: list[str] = []
    _encode(schema, value, out, where)
    return "".join(out).encode()


def checksum(data: bytes) -> int:
    """The kubelet checkpoint manager's checksum of ``data``: FNV-32a of go-spew's ``%#v`` rendering of the byte
    slice (``([]uint8)[`` + decimal bytes separated by spaces + ``]``), an unsigned 32-bit value. Compiled
    (``ext/kubeletchecksum.pyx``) unless ``DRADRIVER_NO_EXTENSIONS=1``.

    :raises dradriver.errors.ExtensionMissingError: the compiled module is wanted but missing.
    """
    return _native.load("kubeletchecksum").checksum(data)


# ---- the model -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KubeletDevice:
    """The kubelet's ``Device`` answer as the checkpoint stores it (``Requests``, ``PoolName``, ``DeviceName``,
    ``CDIDeviceIDs``, ``ShareID``; ``metadata``: the KEP-5304 ``Metadata`` object as raw JSON, or ``None``)."""

    requests: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    metadata: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"Requests": list(self.requests), "PoolName": self.pool_name, "DeviceName": self.device_name,
                "CDIDeviceIDs": list(self.cdi_device_ids), "ShareID": self.share_id, "Metadata": self.metadata}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> KubeletDevice:
        return cls(requests=tuple(obj.get("Requests") or ()), pool_name=obj.get("PoolName") or "",
                   device_name=obj.get("DeviceName") or "", cdi_device_ids=tuple(obj.get("CDIDeviceIDs") or ()),
                   share_id=obj.get("ShareID"), metadata=obj.get("Metadata"))


@dataclass(frozen=True, slots=True)
class MigConcrete:
    """A MIG device as it exists on the GPU (NVIDIA's ``MigLiveTuple``): parent minor number and UUID, GPU and
    compute instance IDs, the MIG device UUID, and the parent's PCI bus ID (may be empty)."""

    parent_minor: int
    gi_id: int
    ci_id: int
    mig_uuid: str
    parent_uuid: str
    parent_pci_bus_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"parentMinor": self.parent_minor, "giId": self.gi_id, "ciId": self.ci_id, "migUUID": self.mig_uuid,
                "parentUUID": self.parent_uuid, "parentPCIBusID": self.parent_pci_bus_id}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> MigConcrete:
        return cls(parent_minor=obj.get("parentMinor") or 0, gi_id=obj.get("giId") or 0,
                   ci_id=obj.get("ciId") or 0, mig_uuid=obj.get("migUUID") or "",
                   parent_uuid=obj.get("parentUUID") or "", parent_pci_bus_id=obj.get("parentPCIBusID") or "")


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One prepared device of a checkpoint entry.

    :param kind: ``gpu``, ``mig`` or ``vfio`` (GPU plugin); ``channel`` or ``daemon`` (compute-domain plugin).
    :param device: the kubelet ``Device`` answered for it (``None`` only in a damaged entry).
    :param uuid: GPU UUID (``gpu.info.uuid``, ``vfio.info.uuid``).
    :param mig: the MIG device (``mig.concrete``).
    :param pci_bus_id: ``vfio.info.pciBusID``.
    :param id: ``channel.info.id`` / ``daemon.info.id``.
    """

    kind: str
    device: KubeletDevice | None
    uuid: str = ""
    mig: MigConcrete | None = None
    pci_bus_id: str = ""
    id: int = 0

    def to_json(self) -> dict[str, Any]:
        device = None if self.device is None else self.device.to_json()
        if self.kind == "gpu":
            return {"gpu": {"info": {"uuid": self.uuid}, "device": device}, "mig": None}
        if self.kind == "mig":
            return {"gpu": None, "mig": {"concrete": None if self.mig is None else self.mig.to_json(),
                                         "device": device}}
        if self.kind == "vfio":
            return {"gpu": None, "mig": None,
                    "vfio": {"info": {"uuid": self.uuid, "pciBusID": self.pci_bus_id}, "device": device}}
        if self.kind in ("channel", "daemon"):
            return {self.kind: {"info": {"id": self.id}, "device": device}}
        raise CheckpointError(f"prepared device kind {self.kind!r} is not gpu, mig, vfio, channel or daemon")

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> PreparedDevice:
        present = [k for k in ("gpu", "mig", "vfio", "channel", "daemon") if obj.get(k) is not None]
        if len(present) != 1:
            raise CheckpointError(f"{where}: must have exactly one of gpu, mig, vfio, channel, daemon; "
                                  f"has {present or 'none'}")
        kind = present[0]
        body = obj[kind]
        raw_device = body.get("device")
        device = None if raw_device is None else KubeletDevice.from_json(raw_device)
        info = body.get("info") or {}
        if kind == "mig":
            concrete = body.get("concrete")
            return cls("mig", device, mig=None if concrete is None else MigConcrete.from_json(concrete))
        if kind in ("channel", "daemon"):
            return cls(kind, device, id=info.get("id") or 0)
        return cls(kind, device, uuid=info.get("uuid") or "", pci_bus_id=info.get("pciBusID") or "")


@dataclass(frozen=True, slots=True)
class ConfigState:
    """What a device group's config set up, for its unprepare to undo (``configState``).

    GPU plugin: ``mps_control_daemon_id`` (``<claim UID>-<5 hex>``, the Deployment ``mps-control-daemon-<id>``),
    ``mps_applied``, ``time_slice_applied``. Compute-domain plugin: ``type`` and ``compute_domain`` (UID).
    """

    mps_control_daemon_id: str = ""
    mps_applied: bool = False
    time_slice_applied: bool = False
    type: str = ""
    compute_domain: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"mpsControlDaemonID": self.mps_control_daemon_id, "mpsApplied": self.mps_applied,
                "timeSliceApplied": self.time_slice_applied, "Type": self.type,
                "ComputeDomain": self.compute_domain}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> ConfigState:
        obj = obj or {}
        return cls(mps_control_daemon_id=obj.get("mpsControlDaemonID") or "",
                   mps_applied=bool(obj.get("mpsApplied")), time_slice_applied=bool(obj.get("timeSliceApplied")),
                   type=obj.get("Type") or "", compute_domain=obj.get("ComputeDomain") or "")


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """The devices one config applied to, and that config's state."""

    devices: tuple[PreparedDevice, ...]
    config_state: ConfigState = ConfigState()


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One claim (``PreparedClaimV2``).

    :param status: the claim's ``ResourceClaimStatus`` as JSON-shaped data; NVIDIA reads ``allocation`` from it
        to refuse held devices to other claims, and panics on an entry without it.
    :param aborted_at: compute-domain plugin: when the prepare was aborted (RFC 3339), else ``None``.
    """

    state: CheckpointState
    status: Mapping[str, Any]
    groups: tuple[DeviceGroup, ...] = ()
    name: str = ""
    namespace: str = ""
    aborted_at: str | None = None

    @property
    def devices(self) -> tuple[PreparedDevice, ...]:
        """Every prepared device of every group, in order."""
        return tuple(d for g in self.groups for d in g.devices)

    def _groups_json(self) -> list[dict[str, Any]]:
        return [{"devices": [d.to_json() for d in g.devices], "configState": g.config_state.to_json()}
                for g in self.groups]

    def to_json(self) -> dict[str, Any]:
        return {"checkpointState": self.state.value, "status": self.status, "preparedDevices": self._groups_json(),
                "name": self.name, "namespace": self.namespace, "abortedAt": self.aborted_at}

    def to_v1_json(self) -> dict[str, Any]:
        return {"status": self.status, "preparedDevices": self._groups_json()}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A whole checkpoint: the claims by UID and the node boot ID it was written in (empty: not recorded)."""

    claims: Mapping[str, CheckpointEntry] = field(default_factory=dict)
    node_boot_id: str = ""


@dataclass(frozen=True, slots=True)
class EncodedEntry:
    """One claim's entry already in Go's bytes, as members of the ``preparedClaims`` objects (the claim UID as a
    JSON string, ``:``, the value): ``v2`` (the ``PreparedClaimV2`` object) and ``v1`` (its downgrade view,
    ``None`` unless the claim is ``PrepareCompleted``). Kept per claim by a writer that rewrites the whole file
    often (:func:`assemble`), so a rewrite encodes nothing again: it joins these bytes and computes the checksums.
    """

    v2: bytes
    v1: bytes | None


def encode_entry(uid: str, entry: CheckpointEntry, schema: ClaimSchema = GPU_CLAIM) -> EncodedEntry:
    """``entry`` in Go's bytes.

    :raises CheckpointError: a field of ``entry.status`` has the wrong JSON type (the message names the claim UID
        and the field), or a device kind the plugin cannot represent.
    """
    where = f"claim {uid}"
    v2_json = entry.to_json()
    # status and preparedDevices are encoded once, for both forms
    v2_json["status"] = _Encoded(go_json(CLAIM_STATUS, entry.status, f"{where}.status").decode())
    if v2_json["preparedDevices"]:
        v2_json["preparedDevices"] = _Encoded(go_json(_groups_schema(schema), v2_json["preparedDevices"],
                                                      where).decode())
    key = _go_string(uid).encode() + b":"
    v2 = key + go_json(_entry_schema(schema, v1=False), v2_json, where)
    v1 = (key + go_json(_entry_schema(schema, v1=True), {"status": v2_json["status"],
                                                         "preparedDevices": v2_json["preparedDevices"]}, where)
          if entry.state is CheckpointState.PREPARE_COMPLETED else None)
    return EncodedEntry(v2=v2, v1=v1)


def assemble(entries: Mapping[str, EncodedEntry], node_boot_id: str) -> bytes:
    """The whole file from per-claim entries: V2 and its checksum, the V1 view and the top-level checksum, with
    the claims in sorted UID order (as Go writes a map). O(total bytes): the entries' bytes joined once per
    object, and two checksums over the content."""
    ordered = [entries[uid] for uid in sorted(entries)]
    v2_claims = b"{" + b",".join([e.v2 for e in ordered]) + b"}" if ordered else b""
    v1_parts = [e.v1 for e in ordered if e.v1 is not None]
    v1 = b'{"preparedClaims":{' + b",".join(v1_parts) + b"}}" if v1_parts else b"{}"
    v2_tail = ((b',"preparedClaims":' + v2_claims if ordered else b"")
               + (b',"nodeBootID":' + _go_string(node_boot_id).encode() if node_boot_id else b"") + b"}")
    v2_sum = checksum(b'{"checksum":0' + v2_tail)
    v1_sum = checksum(b'{"checksum":0,"v1":' + v1 + b"}")
    return b'{"checksum":%d,"v1":%s,"v2":{"checksum":%d%s}' % (v1_sum, v1, v2_sum, v2_tail)


def encode(checkpoint: Checkpoint, schema: ClaimSchema = GPU_CLAIM) -> bytes:
    """``checkpoint`` as NVIDIA's plugin writes it: V2 with its checksum, the V1 view (completed claims only) and
    the top-level V1 checksum; compact JSON, no trailing newline.

    :raises CheckpointError: as :func:`encode_entry`.
    """
    return assemble({uid: encode_entry(uid, e, schema) for uid, e in checkpoint.claims.items()},
                    checkpoint.node_boot_id)


def decode(data: bytes, schema: ClaimSchema = GPU_CLAIM, *, source: str = "checkpoint") -> Checkpoint:
    """Read a checkpoint NVIDIA's plugin (or :func:`encode`) wrote, verifying both checksums as NVIDIA does.

    A V1-only file (an older release) is read with every claim ``PrepareCompleted``, as NVIDIA converts it.

    :param source: how the messages name the file (its path).
    :raises CheckpointError: not a JSON object; a top-level field other than ``checksum``, ``v1``, ``v2`` (a
        version this reader does not know: never guessed at); a checksum that does not verify (the message gives
        the stored and computed values); a field of the wrong type (named by its path).
    """
    try:
        top = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{source}: not JSON ({exc})") from None
    if not isinstance(top, dict):
        raise CheckpointError(f"{source}: must be a JSON object, got {type(top).__name__}")
    unknown = sorted(set(top) - {"checksum", "v1", "v2"})
    if unknown:
        raise CheckpointError(f"{source}: unknown checkpoint version (top-level fields {unknown}; this reader "
                              "knows checksum, v1, v2)")
    if top.get("v1") is None and top.get("v2") is None:
        raise CheckpointError(f"{source}: neither v1 nor v2 present: not a checkpoint this reader knows")
    _verify(source, "checksum", top.get("checksum"),
            go_json(_top_schema(schema), {"checksum": 0, "v1": top.get("v1")}, ""))
    v2 = top.get("v2")
    if v2 is None:
        return _from_v1(top["v1"], schema, source)
    if not isinstance(v2, dict):
        raise CheckpointError(f"{source}: v2 must be an object, got {type(v2).__name__}")
    _verify(source, "v2.checksum", v2.get("checksum"), go_json(_v2_schema(schema), {**v2, "checksum": 0}, "v2"))
    claims: dict[str, CheckpointEntry] = {}
    for uid, raw in (v2.get("preparedClaims") or {}).items():
        where = f"{source}: v2.preparedClaims[{uid!r}]"
        try:
            state = CheckpointState(raw.get("checkpointState"))
        except ValueError:
            raise CheckpointError(f"{where}.checkpointState: {raw.get('checkpointState')!r} is not one of "
                                  f"{[s.value for s in CheckpointState]}") from None
        claims[uid] = CheckpointEntry(state=state, status=raw.get("status") or {},
                                      groups=_groups(raw.get("preparedDevices"), where),
                                      name=raw.get("name") or "", namespace=raw.get("namespace") or "",
                                      aborted_at=raw.get("abortedAt"))
    return Checkpoint(claims=claims, node_boot_id=v2.get("nodeBootID") or "")


def _from_v1(v1: Any, schema: ClaimSchema, source: str) -> Checkpoint:
    if not isinstance(v1, dict):
        raise CheckpointError(f"{source}: v1 must be an object, got {type(v1).__name__}")
    claims = {uid: CheckpointEntry(state=CheckpointState.PREPARE_COMPLETED, status=raw.get("status") or {},
                                   groups=_groups(raw.get("preparedDevices"), f"{source}: v1.preparedClaims[{uid!r}]"))
              for uid, raw in (v1.get("preparedClaims") or {}).items()}
    return Checkpoint(claims=claims)


def _groups(raw: Any, where: str) -> tuple[DeviceGroup, ...]:
    return tuple(DeviceGroup(devices=tuple(PreparedDevice.from_json(d, f"{where}.preparedDevices[{i}].devices[{j}]")
                                           for j, d in enumerate(g.get("devices") or ())),
                             config_state=ConfigState.from_json(g.get("configState")))
                 for i, g in enumerate(raw or ()))


def _verify(source: str, key: str, stored: Any, canonical: bytes) -> None:
    computed = checksum(canonical)
    if stored != computed:
        raise CheckpointError(f"{source}: {key} {stored!r} does not match the content's checksum {computed} "
                              "(the file was damaged or edited; NVIDIA's plugin refuses it too)")


def claim_status_json(status: Mapping[str, Any], uid: str) -> bytes:
    """``status`` as Go writes a ``ResourceClaimStatus`` (the bytes the checksum covers).

    :raises CheckpointError: naming the claim and the field of the wrong type.
    """
    return go_json(CLAIM_STATUS, status, f"claim {uid}: status")

