"""The event log every write appends to, and watches served from it (resumable from a ``resourceVersion``)."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dradriver.sandbox.apiserver.errors import ApiStatusError, JSONDict, bad_request
from dradriver.sandbox.apiserver.resources import ResourceType
from dradriver.sandbox.apiserver.selectors import (
    FieldTerm,
    Requirement,
    parse_field_selector,
    parse_label_selector,
    selects,
)

if TYPE_CHECKING:
    from dradriver.sandbox.apiserver.storage import Storage

HISTORY_LIMIT = 50_000


@dataclass(slots=True)
class Change:
    """One stored change: the object after it (before it, for ``old``)."""

    rv: int
    rt: ResourceType
    type: str
    obj: JSONDict
    old: JSONDict | None = None


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

    def send_chunk(self, event: Any) -> bool: ...

    def end_stream(self) -> None: ...


def translate_change(
    ev: Change,
    rt: ResourceType,
    ns: str | None,
    labels: list[Requirement],
    fields: list[FieldTerm],
) -> JSONDict | None:
    """The watch event a client with these selectors sees for a stored change, if any."""
    if ev.rt != rt:
        return None
    if ns is not None and ev.obj["metadata"].get("namespace") != ns:
        return None
    now = selects(ev.obj, labels, fields)
    before = ev.old is not None and selects(ev.old, labels, fields)
    if ev.type == "MODIFIED":
        if now and not before:
            return {"type": "ADDED", "object": ev.obj}
        if before and not now:
            return {"type": "DELETED", "object": ev.obj}
    if not now and not (ev.type == "DELETED" and before):
        return None
    return {"type": ev.type, "object": ev.obj}


def serve_watch(
    storage: Storage, stream: EventStream, rt: ResourceType, ns: str | None, params: Mapping[str, str]
) -> None:
    """Stream watch events for ``rt`` (in ``ns``) until ``timeoutSeconds``, the client leaves or the server stops.

    ``resourceVersion`` unset or ``0`` starts with ADDED events for the current objects; a number resumes after
    it, or answers one ERROR event with 410 ``Expired`` when the log no longer reaches back that far.
    """
    timeout = float(params.get("timeoutSeconds") or 1800)
    deadline = time.monotonic() + timeout
    with storage.lock:
        labels = parse_label_selector(params.get("labelSelector", ""))
        fields = parse_field_selector(params.get("fieldSelector", ""), rt)
        rv_param = params.get("resourceVersion", "")
        initial: list[JSONDict] = []
        if rv_param in ("", "0"):
            initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for o in storage.list(rt, ns, labels, fields)]
            since = storage.rv
        else:
            try:
                since = int(rv_param)
            except ValueError as exc:
                raise bad_request(f"invalid resourceVersion {rv_param!r}") from exc
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
    _follow(storage, stream, rt, ns, labels, fields, since, deadline)


def _follow(
    storage: Storage,
    stream: EventStream,
    rt: ResourceType,
    ns: str | None,
    labels: list[Requirement],
    fields: list[FieldTerm],
    since: int,
    deadline: float,
) -> None:
    index = 0
    while True:
        with storage.lock:
            pending: list[JSONDict] = []
            history = storage.log.changes
            while index < len(history) and history[index].rv <= since:
                index += 1
            while index < len(history):
                ev = history[index]
                index += 1
                since = ev.rv
                out = translate_change(ev, rt, ns, labels, fields)
                if out is not None:
                    pending.append(out)
            if not pending:
                remaining = deadline - time.monotonic()
                if storage.closing or remaining <= 0:
                    break
                storage.lock.wait(timeout=min(remaining, 1.0))
                continue
        for out in pending:
            if not stream.send_chunk(out):
                return
    stream.end_stream()
