"""Server-side printing: ``meta.k8s.io/v1`` ``Table`` answers, as ``kubectl get`` asks for them.

kubectl sends ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;
g=meta.k8s.io,application/json`` and prints the columns the server defines. The columns are those of
kube-apiserver's printers (``pkg/printers/internalversion``) where they exist, with the DRA columns an operator
needs in one glance:

* ResourceSlice: NAME, NODE, DRIVER, POOL, DEVICES (count), AGE;
* ResourceClaim: NAME, STATE (``pending``, ``allocated``, ``allocated,reserved``, ``deleted``), DEVICES (the
  allocated ``<driver>/<pool>/<device>`` results, by device name), RESERVED-FOR (the consuming pods), AGE;
* Pod: NAME, READY, STATUS (the reason while pending, e.g. ``Unschedulable``), RESTARTS, AGE, and wide NODE;
* core Event: LAST SEEN, TYPE, REASON, OBJECT, MESSAGE;
* everything else: NAME, AGE.

Each row carries the object as ``PartialObjectMetadata`` (``includeObject=Metadata``, the server default),
the whole object with ``includeObject=Object``, or nothing with ``includeObject=None``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from dradriver.sandbox.apiserver.errors import JSONDict, bad_request
from dradriver.sandbox.apiserver.resources import ResourceType

Column = tuple[str, str, str, int, Callable[[JSONDict], Any]]
"""(name, type, format, priority, cell of an object)."""


def wants_table(accept: str) -> bool:
    """``Accept`` asks for ``as=Table`` of ``meta.k8s.io`` ``v1`` or ``v1beta1`` before any plain media type."""
    for item in accept.split(","):
        media, *raw = (p.strip() for p in item.split(";"))
        params = dict(p.partition("=")[::2] for p in raw)
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") in ("v1", "v1beta1"):
            return media.lower() in ("application/json", "*/*", "application/*")
        if media.lower() in ("application/json", "*/*", "application/*", "application/vnd.kubernetes.protobuf"):
            return False
    return False


def age(timestamp: str | None, now: datetime | None = None) -> str:
    """``metav1.Time`` -> kubectl's short duration (``45s``, ``12m``, ``5h``, ``3d``); ``<unknown>`` when unset."""
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return "<unknown>"
    seconds = max(0, int(((now or datetime.now(tz=UTC)) - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 3600 * 3:
        return f"{seconds // 60}m"
    if seconds < 86400 * 2:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def _name(obj: JSONDict) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _age(obj: JSONDict) -> str:
    return age(obj.get("metadata", {}).get("creationTimestamp"))


def claim_state(claim: JSONDict) -> str:
    """``pending``, ``allocated``, ``allocated,reserved``, with ``deleted`` first while a deletion is pending
    (kube-apiserver's ResourceClaim printer)."""
    status = claim.get("status") or {}
    states = []
    if claim.get("metadata", {}).get("deletionTimestamp"):
        states.append("deleted")
    if status.get("allocation"):
        states.append("allocated")
        if status.get("reservedFor"):
            states.append("reserved")
    elif not states:
        states.append("pending")
    return ",".join(states)


def _claim_devices(claim: JSONDict) -> str:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return ",".join(str(r.get("device", "")) for r in results) or "<none>"


def _reserved_for(claim: JSONDict) -> str:
    refs = (claim.get("status") or {}).get("reservedFor") or []
    return ",".join(f"{r.get('resource', 'pods')}/{r.get('name', '')}" for r in refs) or "<none>"


def _pod_ready(pod: JSONDict) -> str:
    containers = pod.get("spec", {}).get("containers") or []
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return f"{sum(1 for s in statuses if s.get('ready'))}/{len(containers)}"


def pod_status(pod: JSONDict) -> str:
    """What kubectl's STATUS column shows: ``Terminating``, the pod's ``reason``, a waiting container's reason,
    the ``PodScheduled`` condition's reason while unscheduled, else the phase."""
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return "Terminating"
    if status.get("reason"):
        return str(status["reason"])
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            return str(waiting["reason"])
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason"):
            return str(cond["reason"])
    return str(status.get("phase") or "Pending")


def _restarts(pod: JSONDict) -> int:
    return sum(int(cs.get("restartCount", 0)) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def _event_object(event: JSONDict) -> str:
    ref = event.get("involvedObject") or {}
    return f"{str(ref.get('kind', '')).lower()}/{ref.get('name', '')}"


def _event_last_seen(event: JSONDict) -> str:
    return age(event.get("lastTimestamp") or event.get("eventTime") or event.get("metadata", {}).get(
        "creationTimestamp"))


_NAME: Column = ("Name", "string", "name", 0, _name)
_AGE: Column = ("Age", "string", "", 0, _age)
COLUMNS: dict[tuple[str, str], tuple[Column, ...]] = {
    ("resource.k8s.io", "ResourceSlice"): (
        _NAME,
        ("Node", "string", "", 0, lambda o: o.get("spec", {}).get("nodeName") or "<none>"),
        ("Driver", "string", "", 0, lambda o: o.get("spec", {}).get("driver", "")),
        ("Pool", "string", "", 0, lambda o: o.get("spec", {}).get("pool", {}).get("name", "")),
        ("Devices", "integer", "", 0, lambda o: len(o.get("spec", {}).get("devices") or [])),
        _AGE,
    ),
    ("resource.k8s.io", "ResourceClaim"): (
        _NAME,
        ("State", "string", "", 0, claim_state),
        ("Devices", "string", "", 0, _claim_devices),
        ("Reserved-For", "string", "", 0, _reserved_for),
        _AGE,
    ),
    ("", "Pod"): (
        _NAME,
        ("Ready", "string", "", 0, _pod_ready),
        ("Status", "string", "", 0, pod_status),
        ("Restarts", "integer", "", 0, _restarts),
        _AGE,
        ("Node", "string", "", 1, lambda o: o.get("spec", {}).get("nodeName") or "<none>"),
    ),
    ("", "Event"): (
        ("Last Seen", "string", "", 0, _event_last_seen),
        ("Type", "string", "", 0, lambda o: o.get("type", "")),
        ("Reason", "string", "", 0, lambda o: o.get("reason", "")),
        ("Object", "string", "", 0, _event_object),
        ("Message", "string", "", 0, lambda o: o.get("message", "")),
    ),
}


def _row_object(obj: JSONDict, rt: ResourceType, include: str) -> JSONDict | None:
    if include == "None":
        return None
    if include == "Object":
        return {"apiVersion": rt.api_version, "kind": rt.kind, **obj}
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}


def table(rt: ResourceType, payload: JSONDict, params: Mapping[str, str]) -> JSONDict:
    """The ``Table`` for a get (one object) or list (``payload`` with ``items``) answer of ``rt``.

    :raises ApiStatusError: 400 for an ``includeObject`` other than ``None``, ``Metadata`` or ``Object``.
    """
    include = params.get("includeObject") or "Metadata"
    if include not in ("None", "Metadata", "Object"):
        raise bad_request(f"includeObject: unsupported value {include!r}: use None, Metadata or Object")
    columns: Sequence[Column] = COLUMNS.get((rt.group, rt.kind), (_NAME, _AGE))
    items = payload["items"] if "items" in payload else [payload]
    rows = []
    for obj in items:
        row: JSONDict = {"cells": [cell(obj) for *_, cell in columns]}
        embedded = _row_object(obj, rt, include)
        if embedded is not None:
            row["object"] = embedded
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": str(payload.get("metadata", {}).get("resourceVersion", ""))},
        "columnDefinitions": [{"name": name, "type": kind, "format": fmt, "description": name, "priority": prio}
                              for name, kind, fmt, prio, _ in columns],
        "rows": rows,
    }
