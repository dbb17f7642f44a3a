"""The event log every write appends to, and watches served from it: resumable from a ``resourceVersion``,
and watch-list (KEP-3157): ``sendInitialEvents=true&resourceVersionMatch=NotOlderThan`` streams ADDED events
for the current objects, then (with ``allowWatchBookmarks=true``) a BOOKMARK whose object carries only
``metadata.resourceVersion`` and the annotation ``k8s.io/initial-events-end: "true"``, then live events.

The options are checked as ``validateWatchOptions`` (k8s.io/apimachinery, meta/internalversion/validation)
does with the WatchList feature on: ``sendInitialEvents`` needs ``resourceVersionMatch=NotOlderThan``, and
``resourceVersionMatch`` needs ``sendInitialEvents``; both are 422 ``Invalid`` ListOptions. Since 1.29 the
server no longer requires ``allowWatchBookmarks`` with ``sendInitialEvents``: without it the initial events
come without the closing bookmark. Legacy watches (no ``sendInitialEvents``) are not defaulted to watch-list.
"""

from __future__ import annotations

import bisect
import copy
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dradriver.sandbox.apiserver.errors import ApiStatusError, Cause, JSONDict, bad_request, invalid
from dradriver.sandbox.apiserver.resources import ResourceType
from dradriver.sandbox.apiserver.selectors import (
    FieldTerm,
    Requirement,
    parse_field_selector,
    parse_label_selector,
    selects,
)

HISTORY_LIMIT = 50_000
NOT_OLDER_THAN = "NotOlderThan"
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


@dataclass(slots=True)
class Change:
    """One stored change: the object after it (before it, for ``old``); never modified once logged.

    Its watch event is encoded once per event type, whatever the number of watchers it goes to (:meth:`line`),
    as the API server's watch cache serializes an object once per encoding for all its watchers.
    """

    rv: int
    rt: ResourceType
    type: str
    obj: JSONDict
    old: JSONDict | None = None
    lines: dict[str, bytes] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)  # when it was stored (``time.monotonic()``)

    def line(self, type_: str) -> bytes:
        """The JSON line of this change as a watch event of ``type_`` (``ADDED``, ``MODIFIED``, ``DELETED``)."""
        line = self.lines.get(type_)
        if line is None:  # two watchers racing here encode the same bytes; either copy is kept
            line = json.dumps({"type": type_, "object": self.obj}).encode() + b"\n"
            self.lines[type_] = line
        return line


@dataclass(slots=True)
class EventLog:
    """The last :data:`HISTORY_LIMIT` changes, oldest first; ``oldest_rv`` is the newest one dropped."""

    changes: list[Change] = field(default_factory=list)
    oldest_rv: int = 0

    def append(self, rt: ResourceType, type_: str, obj: JSONDict, old: JSONDict | None = None) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self.changes.append(Change(rv, rt, type_, copy.deepcopy(obj), copy.deepcopy(old)))
        if len(self.changes) > HISTORY_LIMIT:
            dropped = self.changes[: len(self.changes) - HISTORY_LIMIT]
            del self.changes[: len(dropped)]
            self.oldest_rv = dropped[-1].rv


class EventStream(Protocol):
    """The HTTP side of a watch: a chunked response of JSON lines."""

    def start_stream(self) -> bool: ...

    def send_chunk(self, event: Any) -> bool:
        """Send one event: an object, or its JSON line already encoded (bytes ending in a newline)."""
        ...

    def end_stream(self) -> None: ...


class WatchedStore(Protocol):
    """What a watch reads of the store (:class:`dradriver.sandbox.apiserver.storage.Storage`): its lock, its
    resource version and change log, the matching objects, and the condition a watch of a resource waits on."""

    lock: threading.Condition
    log: EventLog
    rv: int
    closing: bool

    def list(self, rt: ResourceType, ns: str | None, labels: list[Requirement],
             fields: list[FieldTerm]) -> list[JSONDict]: ...

    def changed(self, rt: ResourceType, name: str | None = None) -> threading.Condition: ...


def translate_change(
    ev: Change,
    rt: ResourceType,
    ns: str | None,
    labels: list[Requirement],
    fields: list[FieldTerm],
) -> str | None:
    """The type of the watch event a client with these selectors sees for a stored change (``None``: none): a
    ``MODIFIED`` change that brings an object into the selection is ``ADDED`` for it, one that takes it out
    ``DELETED``."""
    if ev.rt != rt:
        return None
    if ns is not None and ev.obj["metadata"].get("namespace") != ns:
        return None
    now = selects(ev.obj, labels, fields)
    before = ev.old is not None and selects(ev.old, labels, fields)
    if ev.type == "MODIFIED":
        if now and not before:
            return "ADDED"
        if before and not now:
            return "DELETED"
    if not now and not (ev.type == "DELETED" and before):
        return None
    return ev.type


def _flag(params: Mapping[str, str], name: str) -> bool | None:
    """A boolean query parameter as Go's ``strconv.ParseBool`` reads it; None when absent."""
    if name not in params:
        return None
    value = params[name]
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise bad_request(f'invalid value for {name}: strconv.ParseBool: parsing "{value}": invalid syntax')


def check_watch_options(params: Mapping[str, str]) -> bool | None:
    """Validate the watch-list options; returns ``sendInitialEvents`` (None when not given).

    :raises ApiStatusError: 400 for a malformed boolean, 422 ``Invalid`` ListOptions for a forbidden
        combination (the real server's field errors and wording).
    """
    send_initial = _flag(params, "sendInitialEvents")
    match = params.get("resourceVersionMatch", "")
    causes: list[Cause] = []
    if send_initial is not None and match != NOT_OLDER_THAN:
        causes.append(
            (
                "FieldValueForbidden",
                "resourceVersionMatch",
                f"Forbidden: sendInitialEvents requires setting resourceVersionMatch to {NOT_OLDER_THAN}",
            )
        )
    if match:
        if send_initial is None:
            causes.append(
                (
                    "FieldValueForbidden",
                    "resourceVersionMatch",
                    "Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
                )
            )
        if match != NOT_OLDER_THAN:
            causes.append(
                (
                    "FieldValueNotSupported",
                    "resourceVersionMatch",
                    f'Unsupported value: "{match}": supported values: "{NOT_OLDER_THAN}"',
                )
            )
        if params.get("continue"):
            causes.append(
                (
                    "FieldValueForbidden",
                    "resourceVersionMatch",
                    "Forbidden: resourceVersionMatch is forbidden when continue is provided",
                )
            )
    if causes:
        raise invalid("meta.k8s.io", "ListOptions", "", causes)
    return send_initial


def initial_events_end(rt: ResourceType, rv: int) -> JSONDict:
    """The BOOKMARK that ends a watch-list's initial events at ``rv``."""
    return {
        "type": "BOOKMARK",
        "object": {
            "kind": rt.kind,
            "apiVersion": rt.api_version,
            "metadata": {"resourceVersion": str(rv), "annotations": {INITIAL_EVENTS_END: "true"}},
        },
    }


def serve_watch(
    storage: WatchedStore, stream: EventStream, rt: ResourceType, ns: str | None, params: Mapping[str, str], *,
    delay_s: float = 0.0,
) -> None:
    """Stream watch events for ``rt`` (in ``ns``) until ``timeoutSeconds``, the client leaves or the server stops.

    :param delay_s: each change's event leaves no sooner than this many seconds after the change was stored
        (injected watch latency, :class:`.flowcontrol.Latency`); the initial events are not delayed.

    ``resourceVersion`` unset or ``0`` starts with ADDED events for the current objects; a number resumes after
    it, or answers one ERROR event with 410 ``Expired`` when the log no longer reaches back that far. With
    ``sendInitialEvents`` (see the module text) the initial events are the current objects (and the bookmark),
    or none for ``sendInitialEvents=false``.
    """
    send_initial = check_watch_options(params)
    timeout = float(params.get("timeoutSeconds") or 1800)
    deadline = time.monotonic() + timeout
    with storage.lock:
        labels = parse_label_selector(params.get("labelSelector", ""))
        fields = parse_field_selector(params.get("fieldSelector", ""), rt)
        rv_param = params.get("resourceVersion", "")
        initial: list[JSONDict] = []
        if send_initial:
            since = storage.rv
            if rv_param not in ("", "0") and _resource_version(rv_param) > since:
                raise ApiStatusError(
                    504,
                    "Timeout",
                    f"Too large resource version: {rv_param}, current: {since}",
                    details={"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                             "retryAfterSeconds": 1},
                )
            initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in storage.list(rt, ns, labels, fields)]
            if _flag(params, "allowWatchBookmarks"):
                initial.append(initial_events_end(rt, since))
        elif send_initial is False and rv_param in ("", "0"):
            since = storage.rv  # NotOlderThan without initial events: start at the most recent state
        elif rv_param in ("", "0"):
            initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in storage.list(rt, ns, labels, fields)]
            since = storage.rv
        else:
            since = _resource_version(rv_param)
            if since < storage.log.oldest_rv:
                expired = ApiStatusError(
                    410, "Expired", f"too old resource version: {since} ({storage.log.oldest_rv})"
                )
                initial = [{"type": "ERROR", "object": expired.status()}]
                since = -1
    if not stream.start_stream():
        return
    for event in initial:
        if not stream.send_chunk(event):
            return
    if since < 0:
        stream.end_stream()
        return
    _follow(storage, stream, rt, ns, labels, fields, since, deadline, delay_s)


def _rv_of(change: Change) -> int:
    return change.rv


def _resource_version(text: str) -> int:
    try:
        return int(text)
    except ValueError as exc:
        raise bad_request(f"invalid resourceVersion {text!r}") from exc


def _follow(
    storage: WatchedStore,
    stream: EventStream,
    rt: ResourceType,
    ns: str | None,
    labels: list[Requirement],
    fields: list[FieldTerm],
    since: int,
    deadline: float,
    delay_s: float = 0.0,
) -> None:
    named = [value for field, equal, value in fields if field == "metadata.name" and equal]
    changed = storage.changed(rt, named[0] if named else None)
    while True:
        with storage.lock:
            pending: list[tuple[Change, str]] = []
            history = storage.log.changes
            index = bisect.bisect_right(history, since, key=_rv_of)  # the first change after ``since`` (the log
            while index < len(history):  # is in resourceVersion order; trimming its head shifts positions)
                ev = history[index]
                index += 1
                since = ev.rv
                type_ = translate_change(ev, rt, ns, labels, fields)
                if type_ is not None:
                    pending.append((ev, type_))
            if not pending:
                remaining = deadline - time.monotonic()
                if storage.closing or remaining <= 0:
                    break
                changed.wait(timeout=min(remaining, 1.0))
                continue
        for ev, type_ in pending:  # encoded outside the lock, once per change and type for all watchers
            late = ev.at + delay_s - time.monotonic() if delay_s > 0 else 0.0
            if late > 0:
                time.sleep(late)
            if not stream.send_chunk(ev.line(type_)):
                return
    stream.end_stream()
