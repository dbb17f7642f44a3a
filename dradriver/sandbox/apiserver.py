"""A small Kubernetes API server emulator over real HTTP, for tests and ``dradriver demo``.

Why our own and not ``kmock``: kmock's ``KubernetesEmulator`` (0.8) stores objects as merged dicts with a
constant ``resourceVersion: '...'``, so it cannot answer an update with a stale ``resourceVersion`` with 409,
does not implement ``generateName``, field or label selectors, the ``status`` subresource, delete
preconditions, or watches that resume from a ``resourceVersion``. The driver's ResourceSlice reconciler and
claim reads depend on exactly those, so this module implements them on the standard library
(``http.server.ThreadingHTTPServer``; one thread per connection, chunked watch streams).

What it serves (paths and shapes as ``kube-apiserver`` 1.34 serves them):

* discovery: ``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/apis/<group>``, ``/apis/<group>/<version>``,
  ``/healthz``, ``/livez``, ``/readyz``;
* core ``v1``: ``namespaces``, ``nodes``, ``pods``, ``events``, ``configmaps``; ``events.k8s.io/v1``
  ``events``; ``resource.k8s.io/v1`` ``resourceslices``, ``deviceclasses``, ``resourceclaims``,
  ``resourceclaimtemplates``;
* verbs: get, list (``labelSelector``, ``fieldSelector``), watch (``resourceVersion``, ``timeoutSeconds``;
  410 ``Expired`` when the history no longer reaches back), create (``generateName``), update (409 on a stale
  ``metadata.resourceVersion``), patch (JSON merge patch, strategic merge patch treated as merge patch, JSON
  patch), delete (``preconditions`` on uid and resourceVersion, finalizers, owner-reference cascade),
  deletecollection, and the ``status`` subresource (get/update/patch) where the real server has one.

The server assigns ``metadata.uid``, ``resourceVersion`` (one counter for all objects, like etcd's revision),
``creationTimestamp`` and ``generation`` (bumped when anything outside ``metadata`` and ``status`` changes).
Errors are ``Status`` objects with the real server's ``reason``, ``code``, ``details`` and message wording.

Tests use it in process::

    with ApiServerEmulator() as api:
        kubeconfig = api.kubeconfig_path(tmp_path)
        api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
        api.fail_next(2, status=500, path="/apis/resource.k8s.io/v1/resourceslices")
        ...
        assert api.count("update", "resourceslices") == 1

No authentication or authorization is performed; every request is accepted as if from a cluster admin.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["ApiServerEmulator", "ApiStatusError", "RequestRecord", "ResourceType"]

JSONDict = dict[str, Any]

SERVER_VERSION: JSONDict = {
    "major": "1",
    "minor": "34",
    "gitVersion": "v1.34.0-dradriver-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-08-27T00:00:00Z",
    "goVersion": "go1.24.6",
    "compiler": "gc",
    "platform": "linux/amd64",
}

# generateName suffix alphabet and length, as in k8s.io/apiserver/pkg/storage/names (utilrand.String(5)).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_NAME_SUFFIX_LEN = 5
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# semver 2.0.0, the regular expression the API server applies to DeviceAttribute.version.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_HISTORY_LIMIT = 50_000


@dataclass(frozen=True, slots=True)
class ResourceType:
    """One REST resource the emulator serves.

    :param status: the resource has a ``status`` subresource (main-resource writes keep the old status).
    :param field_labels: field-selector labels accepted besides ``metadata.name`` and ``metadata.namespace``.
    :param keep_status_on_create: HTTP create keeps ``status`` (Nodes are created with status by the kubelet).
    """

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    status: bool = False
    field_labels: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()
    keep_status_on_create: bool = False

    @property
    def api_version(self) -> str:
        """``apiVersion`` of objects of this resource (``v1`` or ``<group>/<version>``)."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``<plural>.<group>`` as error messages spell it (just ``<plural>`` for the core group)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        """``<Kind>.<group>`` as validation messages spell it."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


RESOURCE_TYPES: tuple[ResourceType, ...] = (
    ResourceType(
        "",
        "v1",
        "namespaces",
        "namespace",
        "Namespace",
        False,
        status=True,
        field_labels=("status.phase",),
        short_names=("ns",),
        keep_status_on_create=True,
    ),
    ResourceType(
        "",
        "v1",
        "nodes",
        "node",
        "Node",
        False,
        status=True,
        field_labels=("spec.unschedulable",),
        short_names=("no",),
        keep_status_on_create=True,
    ),
    ResourceType(
        "",
        "v1",
        "pods",
        "pod",
        "Pod",
        True,
        status=True,
        field_labels=(
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ),
        short_names=("po",),
    ),
    ResourceType(
        "",
        "v1",
        "events",
        "event",
        "Event",
        True,
        field_labels=(
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ),
        short_names=("ev",),
    ),
    ResourceType("", "v1", "configmaps", "configmap", "ConfigMap", True, short_names=("cm",)),
    ResourceType(
        "events.k8s.io",
        "v1",
        "events",
        "event",
        "Event",
        True,
        field_labels=(
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "reason",
            "reportingController",
            "type",
        ),
        short_names=("ev",),
    ),
    ResourceType("resource.k8s.io", "v1", "deviceclasses", "deviceclass", "DeviceClass", False),
    ResourceType(
        "resource.k8s.io", "v1", "resourceclaims", "resourceclaim", "ResourceClaim", True, status=True
    ),
    ResourceType(
        "resource.k8s.io",
        "v1",
        "resourceclaimtemplates",
        "resourceclaimtemplate",
        "ResourceClaimTemplate",
        True,
    ),
    ResourceType(
        "resource.k8s.io",
        "v1",
        "resourceslices",
        "resourceslice",
        "ResourceSlice",
        False,
        field_labels=("spec.nodeName", "spec.driver"),
    ),
)


class ApiStatusError(Exception):
    """An error the emulator answers with a ``Status`` object (also raised by the in-process helpers)."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: JSONDict | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = dict(headers or {})

    def status(self) -> JSONDict:
        """The ``Status`` object, shaped as ``kube-apiserver`` writes it."""
        body: JSONDict = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(rt: ResourceType, name: str) -> JSONDict:
    """``Status.details`` as the server writes it (``group`` omitted for the core group)."""
    return {"name": name, **({"group": rt.group} if rt.group else {}), "kind": rt.plural}


def _not_found(rt: ResourceType, name: str) -> ApiStatusError:
    return ApiStatusError(
        404,
        "NotFound",
        f'{rt.group_resource} "{name}" not found',
        details=_details(rt, name),
    )


def _already_exists(rt: ResourceType, name: str) -> ApiStatusError:
    return ApiStatusError(
        409,
        "AlreadyExists",
        f'{rt.group_resource} "{name}" already exists',
        details=_details(rt, name),
    )


def _conflict(rt: ResourceType, name: str, why: str) -> ApiStatusError:
    return ApiStatusError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {why}',
        details=_details(rt, name),
    )


def _invalid(rt: ResourceType, name: str, causes: list[tuple[str, str, str]]) -> ApiStatusError:
    """422 ``Invalid``; each cause is ``(reason, field, message)`` (reason e.g. ``FieldValueRequired``)."""
    text = ", ".join(f"{fld}: {msg}" for _, fld, msg in causes)
    return ApiStatusError(
        422,
        "Invalid",
        f'{rt.group_kind} "{name}" is invalid: {text}',
        details={
            "name": name,
            "group": rt.group,
            "kind": rt.kind,
            "causes": [{"reason": r, "message": m, "field": f} for r, f, m in causes],
        },
    )


def _bad_request(message: str) -> ApiStatusError:
    return ApiStatusError(400, "BadRequest", message)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request the emulator received.

    :param verb: Kubernetes verb (``get``, ``list``, ``watch``, ``create``, ``update``, ``patch``,
        ``delete``, ``deletecollection``), or the lower-case HTTP method for non-resource paths.
    :param code: HTTP status code of the answer (200 for a watch once streaming starts).
    """

    method: str
    path: str
    query: str
    verb: str
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    code: int


@dataclass(slots=True)
class _Fault:
    remaining: int
    status: int
    method: str | None
    path: str | re.Pattern[str] | None
    retry_after: int | None

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method.upper() != method:
            return False
        if self.path is None:
            return True
        if isinstance(self.path, re.Pattern):
            return self.path.search(path) is not None
        return path == self.path or path.startswith(self.path.rstrip("/") + "/")


@dataclass(slots=True)
class _Event:
    rv: int
    rt: ResourceType
    type: str
    obj: JSONDict
    old: JSONDict | None = None


@dataclass(slots=True)
class _Route:
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


@dataclass(slots=True)
class _Store:
    objects: dict[tuple[ResourceType, str, str], JSONDict] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    oldest_rv: int = 0
    rv: int = 0


def _now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _lookup_path(obj: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def _field_value(obj: Mapping[str, Any], label: str) -> str:
    value = _lookup_path(obj, label)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --------------------------------------------------------------------------------------------- selectors
@dataclass(frozen=True, slots=True)
class _Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        return not present or value not in self.values  # notin


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


_SET_RE = re.compile(r"^([^\s!=(),]+)\s+(in|notin)\s*\(([^)]*)\)$")


def parse_label_selector(text: str) -> list[_Requirement]:
    """Parse a ``labelSelector`` query value (equality- and set-based forms).

    :raises ApiStatusError: 400 with the selector text for a malformed selector.
    """
    reqs: list[_Requirement] = []
    for part in _split_top_level(text):
        m = _SET_RE.match(part)
        if m:
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(_Requirement(m.group(1), m.group(2), values))
        elif "!=" in part:
            k, v = part.split("!=", 1)
            reqs.append(_Requirement(k.strip(), "!=", (v.strip(),)))
        elif "==" in part or "=" in part:
            k, v = part.split("==", 1) if "==" in part else part.split("=", 1)
            reqs.append(_Requirement(k.strip(), "=", (v.strip(),)))
        elif part.startswith("!"):
            reqs.append(_Requirement(part[1:].strip(), "!"))
        elif re.fullmatch(r"[A-Za-z0-9._/-]+", part):
            reqs.append(_Requirement(part, "exists"))
        else:
            raise _bad_request(f"unable to parse requirement: {part!r} in labelSelector {text!r}")
    return reqs


def parse_field_selector(text: str, rt: ResourceType) -> list[tuple[str, bool, str]]:
    """Parse a ``fieldSelector`` into ``(label, equal, value)`` triples.

    :raises ApiStatusError: 400 ``field label not supported`` for a label the resource does not index.
    """
    terms: list[tuple[str, bool, str]] = []
    allowed = {"metadata.name", "metadata.namespace", *rt.field_labels}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "!=" in part:
            label, value = part.split("!=", 1)
            equal = False
        elif "==" in part:
            label, value = part.split("==", 1)
            equal = True
        elif "=" in part:
            label, value = part.split("=", 1)
            equal = True
        else:
            raise _bad_request(f"invalid field selector: {part!r}")
        label = label.strip()
        if label not in allowed:
            raise _bad_request(f"field label not supported: {label}")
        terms.append((label, equal, value.strip()))
    return terms


def _matches(obj: Mapping[str, Any], labels: list[_Requirement], fields: list[tuple[str, bool, str]]) -> bool:
    obj_labels = (obj.get("metadata") or {}).get("labels") or {}
    if not all(r.matches(obj_labels) for r in labels):
        return False
    return all((_field_value(obj, label) == value) == equal for label, equal, value in fields)


# ----------------------------------------------------------------------------------------------- patches
def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _json_pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise _bad_request(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test, move, copy)."""
    if not isinstance(ops, list):
        raise _bad_request("json patch must be a list of operations")
    doc = copy.deepcopy(doc)

    def parent(tokens: list[str]) -> tuple[Any, str]:
        cur = doc
        for t in tokens[:-1]:
            cur = cur[int(t)] if isinstance(cur, list) else cur[t]
        return cur, tokens[-1]

    def get(tokens: list[str]) -> Any:
        cur = doc
        for t in tokens:
            cur = cur[int(t)] if isinstance(cur, list) else cur[t]
        return cur

    def remove(tokens: list[str]) -> Any:
        container, key = parent(tokens)
        return container.pop(int(key)) if isinstance(container, list) else container.pop(key)

    def add(tokens: list[str], value: Any) -> None:
        nonlocal doc
        if not tokens:
            doc = value
            return
        container, key = parent(tokens)
        if isinstance(container, list):
            container.insert(len(container) if key == "-" else int(key), value)
        else:
            container[key] = value

    try:
        for op in ops:
            kind = op["op"]
            tokens = _json_pointer(op["path"])
            if kind == "add":
                add(tokens, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(tokens)
            elif kind == "replace":
                get(tokens)
                remove(tokens) if tokens else None
                add(tokens, copy.deepcopy(op["value"]))
            elif kind == "test":
                if get(tokens) != op["value"]:
                    raise ApiStatusError(422, "Invalid", f"the json patch test at {op['path']} failed")
            elif kind in ("move", "copy"):
                source = _json_pointer(op["from"])
                value = remove(source) if kind == "move" else copy.deepcopy(get(source))
                add(tokens, value)
            else:
                raise _bad_request(f"unknown json patch operation {kind!r}")
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise ApiStatusError(422, "Invalid", f"the json patch could not be applied: {exc!r}") from exc
    return doc


# -------------------------------------------------------------------------------------------- validation
def _validate_metadata(rt: ResourceType, obj: JSONDict) -> list[tuple[str, str, str]]:
    causes: list[tuple[str, str, str]] = []
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if not name:
        causes.append(
            ("FieldValueRequired", "metadata.name", "Required value: name or generateName is required")
        )
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        causes.append(
            (
                "FieldValueInvalid",
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case '
                "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric "
                "character",
            )
        )
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63:
            causes.append(
                (
                    "FieldValueInvalid",
                    f"metadata.labels.{key}",
                    "Invalid value: must be no more than 63 characters",
                )
            )
    return causes


def _validate_resource_slice(obj: JSONDict, old: JSONDict | None) -> list[tuple[str, str, str]]:
    """The subset of ``pkg/apis/resource/validation`` (v1.34) that drivers trip over."""
    causes: list[tuple[str, str, str]] = []
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [("FieldValueRequired", "spec", "Required value")]
    if not spec.get("driver"):
        causes.append(("FieldValueRequired", "spec.driver", "Required value"))
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        causes.append(("FieldValueRequired", "spec.pool.name", "Required value"))
    if not isinstance(pool.get("generation", 0), int) or pool.get("generation", 0) < 0:
        causes.append(
            ("FieldValueInvalid", "spec.pool.generation", "Invalid value: must be greater than or equal to 0")
        )
    count = pool.get("resourceSliceCount", 0)
    if not isinstance(count, int) or count <= 0:
        causes.append(
            (
                "FieldValueInvalid",
                "spec.pool.resourceSliceCount",
                f"Invalid value: {count}: must be greater than zero",
            )
        )
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    for k in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(k) is False:
            causes.append(("FieldValueInvalid", f"spec.{k}", "Invalid value: false: must be unset or true"))
    if len(selectors) != 1:
        causes.append(
            (
                "FieldValueRequired" if not selectors else "FieldValueInvalid",
                "spec",
                "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
            )
        )
    devices = spec.get("devices") or []
    if len(devices) > 128:
        causes.append(
            ("FieldValueTooMany", "spec.devices", f"Too many: {len(devices)}: must have at most 128 items")
        )
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        where = f"spec.devices[{i}]"
        name = dev.get("name", "") if isinstance(dev, dict) else ""
        if not name or len(name) > 63 or not _DNS_LABEL.match(name):
            causes.append(
                ("FieldValueInvalid", f"{where}.name", f'Invalid value: "{name}": must be a DNS label')
            )
        elif name in seen:
            causes.append(("FieldValueDuplicate", f"{where}.name", f'Duplicate value: "{name}"'))
        seen.add(name)
        attrs = dev.get("attributes") or {} if isinstance(dev, dict) else {}
        caps = dev.get("capacity") or {} if isinstance(dev, dict) else {}
        if len(attrs) + len(caps) > 32:
            causes.append(
                ("FieldValueTooMany", where, "Too many: attributes and capacity must have at most 32 entries")
            )
        for aname, attr in attrs.items():
            kinds = [k for k in ("int", "bool", "string", "version") if k in (attr or {})]
            if len(kinds) != 1:
                causes.append(
                    (
                        "FieldValueRequired",
                        f"{where}.attributes[{aname}]",
                        "exactly one value must be specified",
                    )
                )
                continue
            value = attr[kinds[0]]
            if kinds[0] in ("string", "version") and (not isinstance(value, str) or len(value) > 64):
                causes.append(
                    (
                        "FieldValueTooLong",
                        f"{where}.attributes[{aname}].{kinds[0]}",
                        "Too long: may not be more than 64 bytes",
                    )
                )
            elif kinds[0] == "version" and not _SEMVER.match(value):
                causes.append(
                    (
                        "FieldValueInvalid",
                        f"{where}.attributes[{aname}].version",
                        f'Invalid value: "{value}": must be a string compatible with semver.org spec 2.0.0',
                    )
                )
    if old is not None:
        old_spec = old.get("spec") or {}
        for path in ("driver", "nodeName"):
            if spec.get(path) != old_spec.get(path):
                causes.append(("FieldValueInvalid", f"spec.{path}", "Invalid value: field is immutable"))
        if pool.get("name") != (old_spec.get("pool") or {}).get("name"):
            causes.append(("FieldValueInvalid", "spec.pool.name", "Invalid value: field is immutable"))
    return causes


def _validate_resource_claim(obj: JSONDict, old: JSONDict | None) -> list[tuple[str, str, str]]:
    if old is not None and obj.get("spec") != old.get("spec"):
        return [("FieldValueInvalid", "spec", "Invalid value: field is immutable")]
    causes: list[tuple[str, str, str]] = []
    for i, req in enumerate(((obj.get("spec") or {}).get("devices") or {}).get("requests") or []):
        if not isinstance(req, dict) or not req.get("name"):
            causes.append(("FieldValueRequired", f"spec.devices.requests[{i}].name", "Required value"))
        elif ("exactly" in req) == ("firstAvailable" in req):
            causes.append(
                (
                    "FieldValueRequired",
                    f"spec.devices.requests[{i}]",
                    "exactly one of `exactly` or `firstAvailable` is required",
                )
            )
    return causes


_KIND_VALIDATORS: dict[str, Callable[[JSONDict, JSONDict | None], list[tuple[str, str, str]]]] = {
    "ResourceSlice": _validate_resource_slice,
    "ResourceClaim": _validate_resource_claim,
}


# ------------------------------------------------------------------------------------------------ server
class ApiServerEmulator:
    """An in-memory Kubernetes API server on ``127.0.0.1`` and a random port.

    :param schema_version: when set (e.g. ``"1.34"``), every created or updated object is also validated
        against that Kubernetes version's OpenAPI schema with ``kubernetes_validate`` (a test dependency);
        a failure is answered with 422 ``Invalid``. Objects seeded in process (:meth:`create`,
        :meth:`update`) skip this check, so tests can seed deliberately odd objects.
    :param host: interface to bind; the default keeps the emulator off the network.
    """

    def __init__(self, *, schema_version: str | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self._types = RESOURCE_TYPES
        self._lock = threading.Condition(threading.RLock())
        self._store = _Store()
        self._faults: list[_Fault] = []
        self._records: list[RequestRecord] = []
        self._schema_version = schema_version
        self._seeding = False
        self._closing = False
        self._host = host
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        for ns in ("default", "kube-system"):
            self.create(
                {
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {"name": ns},
                    "status": {"phase": "Active"},
                }
            )

    # -------------------------------------------------------------------------------------- lifecycle
    def start(self) -> ApiServerEmulator:
        """Bind and serve in a background thread; returns ``self``."""
        if self._server is not None:
            return self
        emulator = self

        class Handler(_Handler):
            api = emulator

        server = ThreadingHTTPServer((self._host, self._port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="apiserver-emulator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; open watch streams end, in-memory objects stay readable."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None
        self._thread = None

    def __enter__(self) -> ApiServerEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The TCP port the server listens on (after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the API server emulator is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self._host}:{self.port}"

    def kubeconfig(self) -> JSONDict:
        """A kubeconfig (as a dict) pointing at this server, usable by the Python client and ``kubectl``."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": "default"},
                }
            ],
            "current-context": "emulator",
            "preferences": {},
        }

    def kubeconfig_path(self, directory: str | Path) -> str:
        """Write :meth:`kubeconfig` to ``<directory>/kubeconfig`` (JSON is valid YAML); return its path."""
        path = Path(directory) / "kubeconfig"
        path.write_text(json.dumps(self.kubeconfig(), indent=2) + "\n", encoding="utf-8")
        return str(path)

    # ---------------------------------------------------------------------------- faults and records
    def fail_next(
        self,
        count: int = 1,
        *,
        status: int = 500,
        method: str | None = None,
        path: str | re.Pattern[str] | None = None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the next ``count`` matching requests with ``status`` instead of serving them.

        :param method: HTTP method to match (``"PUT"``), or any.
        :param path: a URL path matched exactly or as a prefix of ``/``-separated segments, or a regular
            expression searched in the path; ``None`` matches every path.
        :param retry_after: value of the ``Retry-After`` header (seconds), e.g. for 429.
        """
        with self._lock:
            self._faults.append(_Fault(count, status, method, path, retry_after))

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request received so far, oldest first (a copy)."""
        with self._lock:
            return list(self._records)

    def count(
        self,
        verb: str | None = None,
        resource: str | None = None,
        *,
        subresource: str | None = None,
        name: str | None = None,
        namespace: str | None = None,
        code: int | None = None,
    ) -> int:
        """Number of recorded requests matching every given filter (``resource`` is the plural)."""
        with self._lock:
            return sum(
                1
                for r in self._records
                if (verb is None or r.verb == verb)
                and (resource is None or r.resource == resource)
                and (subresource is None or r.subresource == subresource)
                and (name is None or r.name == name)
                and (namespace is None or r.namespace == namespace)
                and (code is None or r.code == code)
            )

    def clear_requests(self) -> None:
        """Forget the recorded requests (not the objects)."""
        with self._lock:
            self._records.clear()

    # --------------------------------------------------------------------------- in-process helpers
    def resource_type(self, kind: str, api_version: str | None = None) -> ResourceType:
        """Find a resource by kind (``"ResourceSlice"``), plural (``"resourceslices"``), ``plural.group``
        (``"events.events.k8s.io"``) or short name; ``api_version`` disambiguates a kind.

        :raises KeyError: unknown resource.
        """
        for rt in self._types:
            if api_version is not None and rt.api_version != api_version:
                continue
            if kind in (rt.kind, rt.plural, rt.singular, rt.group_resource, *rt.short_names):
                return rt
        raise KeyError(
            f"the emulator serves no resource {kind!r}" + (f" in {api_version}" if api_version else "")
        )

    def create(self, obj: Mapping[str, Any], *, keep_status: bool = True) -> JSONDict:
        """Store a new object as a client's create would (server fields assigned); returns a copy.

        :param keep_status: keep ``status`` as given (seeding, e.g. an allocated claim); HTTP creates drop it
            for resources with a status subresource, as the real server does.
        :raises ApiStatusError: 409 ``AlreadyExists``, 422 ``Invalid``.
        """
        rt = self.resource_type(str(obj.get("kind", "")), obj.get("apiVersion"))
        ns = (obj.get("metadata") or {}).get("namespace") or ("default" if rt.namespaced else None)
        with self._lock:
            self._seeding = True  # in-process seeding skips the (slow) OpenAPI schema check
            try:
                return self._create(rt, ns, copy.deepcopy(dict(obj)), keep_status=keep_status)
            finally:
                self._seeding = False

    def get(self, kind: str, name: str, namespace: str | None = None) -> JSONDict | None:
        """A copy of the stored object, or ``None``."""
        rt = self.resource_type(kind)
        ns = namespace or ("default" if rt.namespaced else "")
        with self._lock:
            obj = self._store.objects.get((rt, ns if rt.namespaced else "", name))
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str, namespace: str | None = None) -> list[JSONDict]:
        """Copies of all stored objects of a resource (optionally one namespace), sorted by namespace/name."""
        rt = self.resource_type(kind)
        with self._lock:
            items = [
                o
                for (t, ns, _), o in self._store.objects.items()
                if t == rt and (namespace is None or ns == namespace)
            ]
            items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
            return copy.deepcopy(items)

    def update(self, obj: Mapping[str, Any], *, subresource: str | None = None) -> JSONDict:
        """Replace an object (or its ``status`` with ``subresource="status"``) as a PUT would."""
        rt = self.resource_type(str(obj.get("kind", "")), obj.get("apiVersion"))
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace") or ("default" if rt.namespaced else None)
        with self._lock:
            self._seeding = True
            try:
                return self._update(rt, ns, meta.get("name", ""), copy.deepcopy(dict(obj)), subresource)
            finally:
                self._seeding = False

    def delete(self, kind: str, name: str, namespace: str | None = None) -> JSONDict:
        """Delete an object as a DELETE without options would; returns the last state."""
        rt = self.resource_type(kind)
        ns = namespace or ("default" if rt.namespaced else None)
        with self._lock:
            return self._delete(rt, ns, name, {})

    def add_node(
        self,
        name: str,
        *,
        allocatable: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> JSONDict:
        """Seed a Ready Node with ``status.allocatable`` and ``status.capacity``."""
        alloc = dict(allocatable or {"cpu": "8", "memory": "32Gi", "pods": "110"})
        return self.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                "spec": {},
                "status": {
                    "allocatable": alloc,
                    "capacity": dict(alloc),
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "lastHeartbeatTime": _now(),
                            "lastTransitionTime": _now(),
                        }
                    ],
                },
            }
        )

    # ------------------------------------------------------------------------------- store (locked)
    def _next_rv(self) -> int:
        self._store.rv += 1
        return self._store.rv

    def _record_event(self, rt: ResourceType, type_: str, obj: JSONDict, old: JSONDict | None = None) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._store.history.append(_Event(rv, rt, type_, copy.deepcopy(obj), copy.deepcopy(old)))
        if len(self._store.history) > _HISTORY_LIMIT:
            dropped = self._store.history[: len(self._store.history) - _HISTORY_LIMIT]
            del self._store.history[: len(dropped)]
            self._store.oldest_rv = dropped[-1].rv
        self._lock.notify_all()

    def _key(self, rt: ResourceType, ns: str | None, name: str) -> tuple[ResourceType, str, str]:
        return (rt, (ns or "") if rt.namespaced else "", name)

    def _validate(self, rt: ResourceType, obj: JSONDict, old: JSONDict | None) -> None:
        name = obj["metadata"].get("name", "")
        causes = _validate_metadata(rt, obj)
        validator = _KIND_VALIDATORS.get(rt.kind)
        if validator is not None:
            causes.extend(validator(obj, old))
        if not causes and self._schema_version is not None and not self._seeding:
            import kubernetes_validate  # test dependency, imported only when schema validation is asked for

            try:
                kubernetes_validate.validate(obj, self._schema_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                causes.append(("FieldValueInvalid", path or "<root>", exc.message))
        if causes:
            raise _invalid(rt, name, causes)

    def _create(self, rt: ResourceType, ns: str | None, obj: JSONDict, *, keep_status: bool) -> JSONDict:
        if obj.get("apiVersion", rt.api_version) != rt.api_version or obj.get("kind", rt.kind) != rt.kind:
            raise _bad_request(
                f"the API version in the data ({obj.get('apiVersion')}) and kind "
                f"({obj.get('kind')}) do not match {rt.api_version} {rt.kind}"
            )
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise _bad_request("metadata must be an object")
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise _bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            for _ in range(100):
                # names.SimpleNameGenerator: the base is cut to 63 - 5 characters before the suffix.
                candidate = str(meta["generateName"])[: 63 - _NAME_SUFFIX_LEN] + "".join(
                    secrets.choice(_NAME_ALPHABET) for _ in range(_NAME_SUFFIX_LEN)
                )
                if self._key(rt, ns, candidate) not in self._store.objects:
                    meta["name"] = candidate
                    break
        if rt.status and not keep_status and not rt.keep_status_on_create:
            obj.pop("status", None)
        for server_field in (
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "generation",
            "selfLink",
            "managedFields",
        ):
            meta.pop(server_field, None)
        self._validate(rt, obj, None)
        key = self._key(rt, ns, meta["name"])
        if key in self._store.objects:
            raise _already_exists(rt, meta["name"])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        if "spec" in obj:
            meta["generation"] = 1
        meta["resourceVersion"] = str(self._next_rv())
        self._store.objects[key] = obj
        self._record_event(rt, "ADDED", obj)
        return copy.deepcopy(obj)

    def _existing(self, rt: ResourceType, ns: str | None, name: str) -> JSONDict:
        obj = self._store.objects.get(self._key(rt, ns, name))
        if obj is None:
            raise _not_found(rt, name)
        return obj

    def _update(
        self, rt: ResourceType, ns: str | None, name: str, new: JSONDict, subresource: str | None
    ) -> JSONDict:
        old = self._existing(rt, ns, name)
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            raise _bad_request("metadata must be an object")
        if meta.get("name", name) != name:
            raise _bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
            )
        if rt.namespaced and meta.get("namespace", ns) != ns:
            raise _bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        if meta.get("uid") and meta["uid"] != old["metadata"]["uid"]:
            raise _conflict(
                rt,
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, UID in object "
                f"meta: {old['metadata']['uid']}",
            )
        if meta.get("resourceVersion") and meta["resourceVersion"] != old["metadata"]["resourceVersion"]:
            raise _conflict(
                rt,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if subresource == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = merged
        else:
            new["apiVersion"], new["kind"] = rt.api_version, rt.kind
            for server_field in ("uid", "creationTimestamp", "generation", "deletionTimestamp"):
                if server_field in old["metadata"]:
                    meta[server_field] = old["metadata"][server_field]
                else:
                    meta.pop(server_field, None)
            meta["name"] = name
            if rt.namespaced:
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            if rt.status:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)  # a no-op write: no new resourceVersion, no watch event
        self._validate(rt, new, old)
        if "generation" in old["metadata"] and any(
            new.get(k) != old.get(k) for k in set(new) | set(old) if k not in ("metadata", "status")
        ):
            new["metadata"]["generation"] = int(old["metadata"]["generation"]) + 1
        new["metadata"]["resourceVersion"] = str(self._next_rv())
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self._store.objects[self._key(rt, ns, name)]
            self._record_event(rt, "DELETED", new, old)
            self._collect_garbage(new["metadata"]["uid"])
            return copy.deepcopy(new)
        self._store.objects[self._key(rt, ns, name)] = new
        self._record_event(rt, "MODIFIED", new, old)
        return copy.deepcopy(new)

    def _delete(self, rt: ResourceType, ns: str | None, name: str, options: Mapping[str, Any]) -> JSONDict:
        obj = self._existing(rt, ns, name)
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != obj["metadata"]["uid"]:
            raise _conflict(
                rt,
                name,
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                f"meta: {obj['metadata']['uid']}",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise _conflict(
                rt,
                name,
                f"Precondition failed: ResourceVersion in precondition: "
                f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                f"{obj['metadata']['resourceVersion']}",
            )
        if options.get("dryRun"):
            return copy.deepcopy(obj)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(obj)
            old = copy.deepcopy(obj)
            obj["metadata"]["deletionTimestamp"] = _now()
            obj["metadata"]["deletionGracePeriodSeconds"] = 0
            obj["metadata"]["resourceVersion"] = str(self._next_rv())
            self._record_event(rt, "MODIFIED", obj, old)
            return copy.deepcopy(obj)
        del self._store.objects[self._key(rt, ns, name)]
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self._next_rv())
        self._record_event(rt, "DELETED", gone, obj)
        if options.get("propagationPolicy") != "Orphan":
            self._collect_garbage(obj["metadata"]["uid"])
        return gone

    def _collect_garbage(self, owner_uid: str) -> None:
        """Delete dependents whose ownerReferences name ``owner_uid`` (the garbage collector's job)."""
        dependents = [
            (t, ns, name)
            for (t, ns, name), o in self._store.objects.items()
            if any(ref.get("uid") == owner_uid for ref in (o["metadata"].get("ownerReferences") or []))
        ]
        for t, ns, name in dependents:
            if self._key(t, ns, name) in self._store.objects:
                self._delete(t, ns or None, name, {})

    def _list(
        self,
        rt: ResourceType,
        ns: str | None,
        labels: list[_Requirement],
        fields: list[tuple[str, bool, str]],
    ) -> list[JSONDict]:
        items = [
            o
            for (t, ons, _), o in self._store.objects.items()
            if t == rt and (ns is None or ons == ns) and _matches(o, labels, fields)
        ]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return items

    # -------------------------------------------------------------------------------------- routing
    def _route(self, path: str) -> _Route | JSONDict | str | None:
        """Resolve a path to a resource route, a discovery document, ``"ok"`` for health, or None."""
        parts = [p for p in path.split("/") if p]
        if path in ("/healthz", "/livez", "/readyz"):
            return "ok"
        if parts == ["version"]:
            return SERVER_VERSION
        if parts == ["api"]:
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self._host}:{self.port}"}
                ],
            }
        if parts == ["apis"]:
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [self._group_doc(g) for g in self._groups()],
            }
        if parts and parts[0] == "apis" and len(parts) == 2:
            return self._group_doc(parts[1]) if parts[1] in self._groups() else None
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        types = [t for t in self._types if t.group == group and t.version == version]
        if not types:
            return None
        if not rest:
            return self._resource_list_doc(group, version, types)
        by_plural = {t.plural: t for t in types}
        ns: str | None = None
        if (
            rest[0] == "namespaces"
            and len(rest) >= 3
            and rest[2] in by_plural
            and by_plural[rest[2]].namespaced
        ):
            ns, rest = rest[1], rest[2:]
        rt = by_plural.get(rest[0])
        if rt is None or len(rest) > 3:
            return None
        name = rest[1] if len(rest) >= 2 else None
        sub = rest[2] if len(rest) == 3 else None
        if sub is not None and not (sub == "status" and rt.status):
            return None
        if rt.namespaced and ns is None and name is not None:
            return None
        return _Route(rt, ns, name, sub)

    def _groups(self) -> list[str]:
        return sorted({t.group for t in self._types if t.group})

    def _group_doc(self, group: str) -> JSONDict:
        versions = sorted({t.version for t in self._types if t.group == group})
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": gvs,
            "preferredVersion": gvs[0],
        }

    def _resource_list_doc(self, group: str, version: str, types: list[ResourceType]) -> JSONDict:
        resources: list[JSONDict] = []
        for t in types:
            resources.append(
                {
                    "name": t.plural,
                    "singularName": t.singular,
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": [
                        "create",
                        "delete",
                        "deletecollection",
                        "get",
                        "list",
                        "patch",
                        "update",
                        "watch",
                    ],
                    **({"shortNames": list(t.short_names)} if t.short_names else {}),
                }
            )
            if t.status:
                resources.append(
                    {
                        "name": f"{t.plural}/status",
                        "singularName": "",
                        "namespaced": t.namespaced,
                        "kind": t.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.matches(method, path):
                fault.remaining -= 1
                return fault
        self._faults = [f for f in self._faults if f.remaining > 0]
        return None

    # ------------------------------------------------------------------------------------- handling
    def handle(self, handler: _Handler) -> None:
        """Serve one HTTP request (called from the per-connection thread)."""
        method = handler.command
        split = urlsplit(handler.path)
        path, query = split.path, split.query
        params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        body = handler.read_body()
        route = self._route(path)
        verb = method.lower()
        rt_name = sub = ns = name = None
        if isinstance(route, _Route):
            rt_name, sub, ns, name = route.rt.plural, route.subresource, route.namespace, route.name
            watching = params.get("watch") in ("true", "1")
            verb = {
                "GET": "get" if route.name else ("watch" if watching else "list"),
                "POST": "create",
                "PUT": "update",
                "PATCH": "patch",
                "DELETE": "delete" if route.name else "deletecollection",
            }.get(method, verb)

        def record(code: int) -> None:
            with self._lock:
                self._records.append(RequestRecord(method, path, query, verb, rt_name, sub, ns, name, code))

        with self._lock:
            fault = self._take_fault(method, path)
        if fault is not None:
            err = _injected(fault)
            record(err.code)
            handler.send_json(err.code, err.status(), err.headers)
            return
        try:
            if route is None:
                raise ApiStatusError(
                    404, "NotFound", "the server could not find the requested resource", details={}
                )
            if isinstance(route, str):
                record(200)
                handler.send_text(200, route)
                return
            if not isinstance(route, _Route):
                if method != "GET":
                    raise ApiStatusError(
                        405,
                        "MethodNotAllowed",
                        "the server does not allow this method on the requested resource",
                    )
                record(200)
                handler.send_json(200, route)
                return
            if verb == "watch":
                record(200)
                self._serve_watch(handler, route, params)
                return
            code, payload = self._serve(route, verb, params, body, handler.headers.get("Content-Type", ""))
            record(code)
            handler.send_json(code, payload)
        except ApiStatusError as exc:
            record(exc.code)
            handler.send_json(exc.code, exc.status(), exc.headers)

    def _decode(self, body: bytes) -> Any:
        try:
            return json.loads(body or b"null")
        except ValueError as exc:
            raise _bad_request(f"the request body is not valid JSON: {exc}") from exc

    def _serve(
        self, route: _Route, verb: str, params: Mapping[str, str], body: bytes, content_type: str
    ) -> tuple[int, JSONDict]:
        rt, ns, name = route.rt, route.namespace, route.name
        if rt.namespaced and ns is None and verb not in ("list", "watch"):
            return 404, ApiStatusError(
                404, "NotFound", "the server could not find the requested resource"
            ).status()
        with self._lock:
            if verb == "get":
                assert name is not None
                return 200, copy.deepcopy(self._existing(rt, ns, name))
            if verb in ("list", "deletecollection"):
                labels = parse_label_selector(params.get("labelSelector", ""))
                fields = parse_field_selector(params.get("fieldSelector", ""), rt)
                items = self._list(rt, ns, labels, fields)
                if verb == "deletecollection":
                    options = self._decode(body) or {}
                    items = [
                        self._delete(rt, o["metadata"].get("namespace"), o["metadata"]["name"], options)
                        for o in list(items)
                    ]
                return 200, {
                    "kind": f"{rt.kind}List",
                    "apiVersion": rt.api_version,
                    "metadata": {"resourceVersion": str(self._store.rv)},
                    "items": [_without_type(o) for o in items],
                }
            data = self._decode(body)
            if verb == "create":
                if not isinstance(data, dict):
                    raise _bad_request("the request body must be an object")
                if params.get("dryRun"):
                    return 201, data
                return 201, self._create(rt, ns, data, keep_status=False)
            assert name is not None
            if verb == "update":
                if not isinstance(data, dict):
                    raise _bad_request("the request body must be an object")
                return 200, self._update(rt, ns, name, data, route.subresource)
            if verb == "patch":
                current = copy.deepcopy(self._existing(rt, ns, name))
                ctype = content_type.split(";")[0].strip()
                if ctype == "application/json-patch+json":
                    patched = _json_patch(current, data)
                elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                    patched = _merge_patch(current, data)
                else:
                    raise ApiStatusError(
                        415,
                        "UnsupportedMediaType",
                        f"the body of the request was in an unknown format - accepted media "
                        f"types include: application/json-patch+json, application/merge-patch+"
                        f"json, application/strategic-merge-patch+json (got {ctype!r})",
                    )
                if not isinstance(patched, dict):
                    raise _bad_request("the patch did not produce an object")
                return 200, self._update(rt, ns, name, patched, route.subresource)
            if verb == "delete":
                options = self._decode(body) or {}
                for key in ("propagationPolicy", "dryRun"):
                    if key in params:
                        options[key] = params[key]
                return 200, self._delete(rt, ns, name, options)
        raise ApiStatusError(
            405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
        )

    def _serve_watch(self, handler: _Handler, route: _Route, params: Mapping[str, str]) -> None:
        rt, ns = route.rt, route.namespace
        timeout = float(params.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        with self._lock:
            labels = parse_label_selector(params.get("labelSelector", ""))
            fields = parse_field_selector(params.get("fieldSelector", ""), rt)
            rv_param = params.get("resourceVersion", "")
            initial: list[JSONDict] = []
            if rv_param in ("", "0"):
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(o)} for o in self._list(rt, ns, labels, fields)
                ]
                since = self._store.rv
            else:
                try:
                    since = int(rv_param)
                except ValueError as exc:
                    raise _bad_request(f"invalid resourceVersion {rv_param!r}") from exc
                if since < self._store.oldest_rv:
                    expired = ApiStatusError(
                        410, "Expired", f"too old resource version: {since} ({self._store.oldest_rv})"
                    )
                    initial = [{"type": "ERROR", "object": expired.status()}]
                    since = -1
        if not handler.start_stream():
            return
        for event in initial:
            if not handler.send_chunk(event):
                return
        if since < 0:
            handler.end_stream()
            return
        index = 0
        while True:
            with self._lock:
                pending: list[JSONDict] = []
                history = self._store.history
                while index < len(history) and history[index].rv <= since:
                    index += 1
                while index < len(history):
                    ev = history[index]
                    index += 1
                    since = ev.rv
                    out = _translate_event(ev, rt, ns, labels, fields)
                    if out is not None:
                        pending.append(out)
                if not pending:
                    remaining = deadline - time.monotonic()
                    if self._closing or remaining <= 0:
                        break
                    self._lock.wait(timeout=min(remaining, 1.0))
                    continue
            for out in pending:
                if not handler.send_chunk(out):
                    return
        handler.end_stream()


def _translate_event(
    ev: _Event,
    rt: ResourceType,
    ns: str | None,
    labels: list[_Requirement],
    fields: list[tuple[str, bool, str]],
) -> JSONDict | None:
    """The watch event a client with these selectors sees for a stored change, if any."""
    if ev.rt != rt:
        return None
    if ns is not None and ev.obj["metadata"].get("namespace") != ns:
        return None
    now = _matches(ev.obj, labels, fields)
    before = ev.old is not None and _matches(ev.old, labels, fields)
    if ev.type == "MODIFIED":
        if now and not before:
            return {"type": "ADDED", "object": ev.obj}
        if before and not now:
            return {"type": "DELETED", "object": ev.obj}
    if not now and not (ev.type == "DELETED" and before):
        return None
    return {"type": ev.type, "object": ev.obj}


def _without_type(obj: JSONDict) -> JSONDict:
    out = copy.deepcopy(obj)
    out.pop("apiVersion", None)
    out.pop("kind", None)
    return out


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Gone",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _injected(fault: _Fault) -> ApiStatusError:
    headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
    message = {
        429: "Too many requests, please try again later.",
        500: "Internal error occurred: injected fault",
        503: "the server is currently unable to handle the request",
    }.get(fault.status, "injected fault")
    details = {"retryAfterSeconds": fault.retry_after} if fault.retry_after is not None else None
    return ApiStatusError(
        fault.status, _REASONS.get(fault.status, "InternalError"), message, details=details, headers=headers
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dradriver-apiserver-emulator"
    # Headers and body leave in one segment (buffered writer, flushed per response) and without Nagle:
    # otherwise every small response waits for the client's delayed ACK (about 40 ms on Linux).
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    api: ApiServerEmulator

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: requests are recorded in :attr:`ApiServerEmulator.requests` instead."""

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            return self.rfile.read(length)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return b""

    def send_json(self, code: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def send_text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> bool:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            return True
        except OSError:
            return False

    def send_chunk(self, event: Any) -> bool:
        data = json.dumps(event).encode() + b"\n"
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            return True
        except OSError:
            self.close_connection = True
            return False

    def end_stream(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _dispatch(self) -> None:
        try:
            self.api.handle(self)
        except (ConnectionError, BrokenPipeError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch


def iter_objects(docs: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """Yield the objects of YAML/JSON documents, flattening ``List`` kinds (for seeding from files)."""
    for doc in docs:
        if not doc:
            continue
        if str(doc.get("kind", "")).endswith("List") and "items" in doc:
            yield from doc["items"]
        else:
            yield doc
