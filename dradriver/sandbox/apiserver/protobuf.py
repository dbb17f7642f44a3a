"""Kubernetes protobuf bodies <-> the emulator's JSON dicts.

Wire format (``k8s.io/apimachinery/pkg/runtime/serializer/protobuf``): the magic ``k8s\\x00``, then a
``runtime.Unknown`` whose ``typeMeta`` names apiVersion and kind and whose ``raw`` is the typed message
(generated from ``protos/k8s_*.proto`` into ``dradriver._proto``).

The JSON mapping is ``google.protobuf.json_format`` (the .proto field names are the Kubernetes JSON names)
plus what Kubernetes' JSON does differently: ``Time`` / ``MicroTime`` are RFC 3339 strings, not
``{seconds, nanos}``; ``Quantity`` is its string, not ``{string}``; int64 is a JSON number, not a string.
A Go client sends every non-pointer field, zero or not; decoding drops zero values as Go's ``omitempty``
JSON would, except for the Go pointer fields and the fields without ``omitempty`` in :data:`KEEP_ZERO`.
Encoding drops fields the messages do not model (e.g. ``metadata.managedFields``).
"""

from __future__ import annotations

import calendar
from datetime import UTC, datetime
from typing import Any, cast

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from dradriver._proto import (
    k8s_core_v1_pb2,
    k8s_events_v1_pb2,
    k8s_meta_v1_pb2,
    k8s_resource_v1_pb2,
    k8s_runtime_pb2,
)
from dradriver.sandbox.apiserver.errors import ApiStatusError, JSONDict, bad_request

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"

# (apiVersion, kind) -> message: the kinds the emulator reads and writes as protobuf.
MESSAGES: dict[tuple[str, str], type[Message]] = {
    ("resource.k8s.io/v1", "ResourceSlice"): k8s_resource_v1_pb2.ResourceSlice,
    ("resource.k8s.io/v1", "ResourceSliceList"): k8s_resource_v1_pb2.ResourceSliceList,
    ("v1", "Event"): k8s_core_v1_pb2.Event,
    ("v1", "EventList"): k8s_core_v1_pb2.EventList,
    ("events.k8s.io/v1", "Event"): k8s_events_v1_pb2.Event,
    ("events.k8s.io/v1", "EventList"): k8s_events_v1_pb2.EventList,
    ("v1", "Node"): k8s_core_v1_pb2.Node,
    ("v1", "NodeList"): k8s_core_v1_pb2.NodeList,
    ("v1", "Status"): k8s_meta_v1_pb2.Status,
}
_TIME = "k8s.io.apimachinery.pkg.apis.meta.v1.Time"
_MICRO_TIME = "k8s.io.apimachinery.pkg.apis.meta.v1.MicroTime"
_QUANTITY = "k8s.io.apimachinery.pkg.api.resource.Quantity"
_INT64 = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64)
# "<Message>.<field>" whose zero value means something: Go pointers (*bool, *int64, *string) and fields
# whose JSON tag has no omitempty.
KEEP_ZERO = frozenset(
    {
        "DeviceAttribute.int",
        "DeviceAttribute.bool",
        "DeviceAttribute.string",
        "DeviceAttribute.version",
        "ResourceSliceSpec.driver",
        "ResourceSliceSpec.nodeName",
        "ResourceSliceSpec.allNodes",
        "ResourceSliceSpec.perDeviceNodeSelection",
        "ResourcePool.name",
        "ResourcePool.generation",
        "ResourcePool.resourceSliceCount",
        "Device.name",
        "Device.nodeName",
        "Device.allNodes",
        "Device.bindsToNode",
        "Device.allowMultipleAllocations",
        "ObjectMeta.deletionGracePeriodSeconds",
        "OwnerReference.controller",
        "OwnerReference.blockOwnerDeletion",
        "ListMeta.remainingItemCount",
        "DeleteOptions.gracePeriodSeconds",
        "DeleteOptions.orphanDependents",
        "DeleteOptions.ignoreStoreReadErrorWithClusterBreakingPotential",
    }
)
DELETE_OPTIONS = "DeleteOptions"
"""The kind of a DELETE's body; the server registers it in every group version, so client-go's envelope names the
resource's own (``apps/v1`` ``DeleteOptions`` for a Deployment)."""
_OMIT = object()


def supports(api_version: str, kind: str) -> bool:
    """The emulator speaks protobuf for this kind (CRD-like kinds it does not, as the real server)."""
    return (api_version, kind) in MESSAGES


def encode(obj: JSONDict, api_version: str, kind: str) -> bytes:
    """A protobuf body for ``obj``; its own ``apiVersion`` / ``kind`` win over the given ones.

    :raises KeyError: a kind without a message (check :func:`supports` first).
    """
    api_version, kind = obj.get("apiVersion") or api_version, obj.get("kind") or kind
    message = MESSAGES[(api_version, kind)]()
    json_format.ParseDict(_from_json(obj, cast(Descriptor, message.DESCRIPTOR)), message, ignore_unknown_fields=True)
    envelope = k8s_runtime_pb2.Unknown(
        typeMeta=k8s_runtime_pb2.TypeMeta(apiVersion=api_version, kind=kind),
        raw=message.SerializeToString(),
        contentEncoding="",
        contentType="",
    )
    return MAGIC + envelope.SerializeToString()


def decode(body: bytes) -> JSONDict:
    """The object in a protobuf body, as the JSON dict the real server would have stored.

    :raises ApiStatusError: 400 for a malformed body, 415 for a kind the emulator has no message for.
    """
    api_version, kind, raw = _open(body)
    if not supports(api_version, kind):
        raise unsupported_media_type()
    return {"apiVersion": api_version, "kind": kind, **to_json(_parse(MESSAGES[(api_version, kind)], raw))}


def decode_delete_options(body: bytes) -> JSONDict:
    """A DELETE's protobuf body, ``DeleteOptions`` (``propagationPolicy``, ``preconditions``, ``dryRun``,
    ``gracePeriodSeconds``, ...; ``k8s.io/apimachinery/pkg/apis/meta/v1``), as the JSON dict the server reads:
    client-go sends one for every delete of a kind it talks protobuf for (``Deployments().Delete`` of NVIDIA's MPS
    control daemon, with ``propagationPolicy: Foreground``).

    :raises ApiStatusError: 400 for a malformed body or one of another kind.
    """
    api_version, kind, raw = _open(body)
    if kind != DELETE_OPTIONS:
        raise bad_request(f"the body of a DELETE must be DeleteOptions, not {api_version} {kind}")
    return {"apiVersion": api_version, "kind": kind, **to_json(_parse(k8s_meta_v1_pb2.DeleteOptions, raw))}


def _open(body: bytes) -> tuple[str, str, bytes]:
    """The ``runtime.Unknown`` envelope of a protobuf body: its apiVersion, kind and typed message bytes.

    :raises ApiStatusError: 400 without the magic number or for a malformed envelope.
    """
    if not body.startswith(MAGIC):
        raise bad_request("the protobuf body does not start with the Kubernetes magic number k8s\\x00")
    try:
        envelope = k8s_runtime_pb2.Unknown.FromString(body[len(MAGIC) :])
    except DecodeError as exc:
        raise bad_request(f"the request body is not a valid protobuf message: {exc}") from exc
    return envelope.typeMeta.apiVersion, envelope.typeMeta.kind, envelope.raw


def _parse(message: type[Message], raw: bytes) -> Message:
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        raise bad_request(f"the request body is not a valid protobuf message: {exc}") from exc


def unsupported_media_type() -> ApiStatusError:
    """415 as the server answers a protobuf body for a kind without protobuf (a CRD)."""
    return ApiStatusError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json, application/yaml",
    )


def to_json(message: Message) -> JSONDict:
    """``message`` as Kubernetes JSON (see the module text)."""
    raw = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return _to_json(raw, cast(Descriptor, message.DESCRIPTOR))


def _to_json(raw: dict[str, Any], descriptor: Descriptor) -> JSONDict:
    out: JSONDict = {}
    for key, value in raw.items():
        fd = descriptor.fields_by_name[key]
        value_fd = _map_value_field(fd)
        if value_fd is not None:
            out[key] = {k: _value_to_json(v, value_fd, keep=True) for k, v in value.items()}
        elif fd.is_repeated:
            out[key] = [_value_to_json(v, fd, keep=True) for v in value]
        else:
            converted = _value_to_json(value, fd, keep=f"{descriptor.name}.{fd.name}" in KEEP_ZERO)
            if converted is not _OMIT:
                out[key] = converted
    return out


def _value_to_json(value: Any, fd: FieldDescriptor, *, keep: bool) -> Any:
    if fd.message_type is not None:
        name = fd.message_type.full_name
        if name in (_TIME, _MICRO_TIME):
            seconds, nanos = int(value.get("seconds", 0)), int(value.get("nanos", 0))
            if not seconds and not nanos and not keep:
                return _OMIT
            return format_time(seconds, nanos, micro=name == _MICRO_TIME)
        if name == _QUANTITY:
            return value.get("string", "")
        return _to_json(value, fd.message_type)
    if fd.type in _INT64:
        value = int(value)
    if not keep and (value == "" or value is False or (type(value) is int and value == 0)):
        return _OMIT
    return value


def _from_json(obj: dict[str, Any], descriptor: Descriptor) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        fd = descriptor.fields_by_name.get(key)
        if fd is None or value is None:
            continue
        value_fd = _map_value_field(fd)
        if value_fd is not None:
            out[key] = {k: _value_from_json(v, value_fd) for k, v in value.items()}
        elif fd.is_repeated:
            out[key] = [_value_from_json(v, fd) for v in value]
        else:
            out[key] = _value_from_json(value, fd)
    return out


def _value_from_json(value: Any, fd: FieldDescriptor) -> Any:
    if fd.message_type is None or not isinstance(value, (str, dict)):
        return value
    name = fd.message_type.full_name
    if name in (_TIME, _MICRO_TIME) and isinstance(value, str):
        seconds, nanos = parse_time(value)
        return {"seconds": seconds, "nanos": nanos}
    if name == _QUANTITY:
        return {"string": str(value)}
    return _from_json(value, fd.message_type) if isinstance(value, dict) else value


def _map_value_field(fd: FieldDescriptor) -> FieldDescriptor | None:
    """The ``value`` field of a map field's entry message; None for any other field."""
    entry = fd.message_type
    if entry is None or not entry.GetOptions().map_entry:
        return None
    return entry.fields_by_name["value"]


def format_time(seconds: int, nanos: int, *, micro: bool) -> str:
    """``metav1.Time`` (seconds) or ``metav1.MicroTime`` (microseconds) as RFC 3339 in UTC."""
    moment = datetime.fromtimestamp(seconds, tz=UTC).replace(microsecond=nanos // 1000)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> tuple[int, int]:
    """An RFC 3339 time as (seconds since the epoch, nanoseconds).

    :raises ApiStatusError: 400 for a malformed time.
    """
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise bad_request(f"invalid RFC 3339 time {text!r}") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return calendar.timegm(moment.utctimetuple()), moment.microsecond * 1000
