"""Injected API server costs: per-request latency and API Priority and Fairness (APF) limits, both off by default.

**Latency** (:class:`Latency`): every read (get, list), write (create, update, patch, delete) and watch event is
served that many seconds late. A request's latency is spent before it reaches the storage (its answer leaves at
once after), so a write's conflict window grows with it as it does on a real server whose etcd round trip comes
between the request and the commit; a watch event leaves that many seconds after its change was committed. A
latency is a lower bound on what a client measures: the emulator's own work comes on top.

**API Priority and Fairness** (:class:`FlowControlSettings`, :class:`FairQueues`), the model of kube-apiserver's
filter (KEP-1040, kubernetes/enhancements ``keps/sig-api-machinery/1040-priority-and-fairness``; kubernetes.io
"API Priority and Fairness"): the requests of one priority level share ``seats`` (its concurrency limit; each
non-watch request occupies one seat while it is served, its latency included); a request that finds every seat
taken waits in its flow's queue (a flow is the client, here its ``User-Agent``, as a FlowSchema's
``distinguisherMethod: ByUser`` makes one flow per user), and freed seats go to the queued flows in turn (round
robin: fair queuing between flows); a request whose flow already has ``queue_length`` requests waiting
(``queueLengthLimit``, 50 in the default ``workload-low`` level), or that waited ``queue_wait_s`` (15 s by
default, assumed: kube-apiserver bounds the wait by the request's deadline), is answered 429
``TooManyRequests`` with ``Retry-After: <retry_after_s>`` (kube-apiserver sends 1: k8s.io/apiserver
``pkg/server/filters/priority-and-fairness.go``).
Watches hold no seat (kube-apiserver counts only their initialisation). Not modelled: several priority levels
(one level serves every request), shuffle sharding of flows onto queues, list requests occupying several seats,
borrowing between levels.

Environment (the sandbox and the demos build their emulators without arguments, which read these):

* ``DRADRIVER_APISERVER_LATENCY``: ``read=10ms,write=30ms,watch=5ms`` (``ms`` or ``s``; a key left out is 0);
* ``DRADRIVER_APISERVER_FLOW_CONTROL``: ``seats=245,queue=50,wait=15s,retry-after=1`` (keys left out keep
  :class:`FlowControlSettings`' defaults; the default ``seats`` is the ``workload-low`` level's share of
  kube-apiserver's 600 seats).
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

__all__ = ["FLOW_CONTROL_ENV", "LATENCY_ENV", "READ_VERBS", "WRITE_VERBS", "Admission", "FairQueues",
           "FlowControlSettings", "Latency", "SettingsError", "ThreadedFlowControl", "flow_control_from_env",
           "latency_from_env", "parse_flow_control", "parse_latency"]

LATENCY_ENV = "DRADRIVER_APISERVER_LATENCY"
FLOW_CONTROL_ENV = "DRADRIVER_APISERVER_FLOW_CONTROL"
READ_VERBS = frozenset({"get", "list"})
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})


class SettingsError(ValueError):
    """A latency or flow-control setting that cannot be read; the message names the setting and the value."""


@dataclass(frozen=True, slots=True)
class Latency:
    """Seconds added to each request of a kind (all 0: off).

    :param read_s: per get or list.
    :param write_s: per create, update, patch, delete, deletecollection.
    :param watch_s: per watch event, from its commit to its delivery.
    :raises SettingsError: a negative value.
    """

    read_s: float = 0.0
    write_s: float = 0.0
    watch_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise SettingsError(f"Latency.{f.name} must not be negative, not {getattr(self, f.name)}")

    @property
    def off(self) -> bool:
        return self.read_s == self.write_s == self.watch_s == 0

    def of(self, verb: str) -> float:
        """The latency of a request with Kubernetes verb ``verb`` (0 for watch and non-resource requests)."""
        if verb in WRITE_VERBS:
            return self.write_s
        if verb in READ_VERBS:
            return self.read_s
        return 0.0


@dataclass(frozen=True, slots=True)
class FlowControlSettings:
    """One APF priority level (module text).

    :param seats: concurrency limit (kube-apiserver's 600 seats times ``workload-low``'s 100 of the default
        levels' 245 nominal shares, rounded up: 245).
    :param queue_length: requests one flow may have waiting (``queueLengthLimit``; 50 for ``workload-low``).
    :param queue_wait_s: the longest a request waits for a seat before its 429 (15 s).
    :param retry_after_s: the ``Retry-After`` of a 429, whole seconds (kube-apiserver: 1).
    :raises SettingsError: seats below 1, a negative queue length or wait, a ``retry_after_s`` below 1.
    """

    seats: int = 245
    queue_length: int = 50
    queue_wait_s: float = 15.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.seats < 1:
            raise SettingsError(f"FlowControlSettings.seats must be at least 1, not {self.seats}")
        if self.queue_length < 0 or self.queue_wait_s < 0:
            raise SettingsError(f"FlowControlSettings.queue_length and queue_wait_s must not be negative, not "
                                f"{self.queue_length} and {self.queue_wait_s}")
        if self.retry_after_s < 1:
            raise SettingsError(f"FlowControlSettings.retry_after_s must be at least 1, not {self.retry_after_s}")


class Admission:
    """What :meth:`FairQueues.admit` answered for one request: ``run`` (a seat is its), ``queued`` (it waits
    for :meth:`FairQueues.release` to hand it one), or ``rejected`` (429)."""

    RUN = "run"
    QUEUED = "queued"
    REJECTED = "rejected"


@dataclass(slots=True)
class _Waiter:
    flow: str
    granted: bool = False
    ticket: object = None  # what the caller waits on (a threading.Event, a simulation's signal)


@dataclass(slots=True)
class FairQueues:
    """The seat accounting and fair queuing of one priority level, without threads or clocks: the emulator
    (:class:`ThreadedFlowControl`) and the fleet model (``bench/fleetmodel.py``, simulated time) drive the same
    rules. Not thread-safe: callers hold their own lock.
    """

    settings: FlowControlSettings
    busy: int = 0
    rejected: int = 0
    _queues: dict[str, deque[_Waiter]] = field(default_factory=dict)
    _turn: deque[str] = field(default_factory=deque)  # flows with waiters, in round-robin order

    def admit(self, flow: str, ticket: object = None) -> tuple[str, _Waiter | None]:
        """A request of ``flow`` arrives: a seat now, a place in its flow's queue (the waiter returned: its
        ``granted`` turns True when :meth:`release` hands it a seat), or a rejection."""
        if self.busy < self.settings.seats and not self._turn:
            self.busy += 1
            return Admission.RUN, None
        queue = self._queues.setdefault(flow, deque())
        if len(queue) >= self.settings.queue_length:
            self.rejected += 1
            return Admission.REJECTED, None
        waiter = _Waiter(flow, ticket=ticket)
        if not queue:
            self._turn.append(flow)
        queue.append(waiter)
        return Admission.QUEUED, waiter

    def release(self) -> _Waiter | None:
        """A request ends: its seat goes to the next flow's oldest waiter in turn (returned, ``granted``), or
        is freed."""
        while self._turn:
            flow = self._turn.popleft()
            queue = self._queues[flow]
            waiter = queue.popleft()
            if queue:
                self._turn.append(flow)
            else:
                del self._queues[flow]
            waiter.granted = True
            return waiter  # the seat passes on: busy unchanged
        self.busy -= 1
        return None

    def expire(self, waiter: _Waiter) -> bool:
        """``waiter`` waited ``queue_wait_s``: it leaves its queue and is rejected (True), unless a seat was
        handed to it meanwhile (False: it runs)."""
        if waiter.granted:
            return False
        queue = self._queues.get(waiter.flow)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[waiter.flow]
                self._turn.remove(waiter.flow)
        self.rejected += 1
        return True

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())


class ThreadedFlowControl:
    """:class:`FairQueues` for the emulator's request threads: :meth:`acquire` blocks while queued."""

    def __init__(self, settings: FlowControlSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._queues = FairQueues(settings)

    def acquire(self, flow: str) -> bool:
        """Take a seat for a request of ``flow``, waiting in its queue up to ``queue_wait_s``; False: rejected
        (answer 429), and nothing to release."""
        with self._lock:
            verdict, waiter = self._queues.admit(flow, threading.Event())
        if verdict == Admission.RUN:
            return True
        if verdict == Admission.REJECTED or waiter is None:
            return False
        ticket = waiter.ticket
        assert isinstance(ticket, threading.Event)
        if ticket.wait(self.settings.queue_wait_s):
            return True
        with self._lock:
            return not self._queues.expire(waiter)

    def release(self) -> None:
        """The request that held a seat is answered."""
        with self._lock:
            waiter = self._queues.release()
        if waiter is not None:
            ticket = waiter.ticket
            assert isinstance(ticket, threading.Event)
            ticket.set()

    @property
    def rejected(self) -> int:
        """Requests answered 429 so far."""
        with self._lock:
            return self._queues.rejected

    @property
    def busy(self) -> int:
        """Seats taken now."""
        with self._lock:
            return self._queues.busy


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def _seconds(setting: str, key: str, text: str) -> float:
    m = _DURATION.match(text)
    if m is None:
        raise SettingsError(f"{setting}: {key}={text!r} is not a duration (e.g. 30ms, 1.5s)")
    return float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)


def _pairs(setting: str, text: str, keys: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise SettingsError(f"{setting}: {part!r} is not one of {', '.join(k + '=...' for k in keys)}")
        out[key] = value.strip()
    return out


def parse_latency(text: str, setting: str = LATENCY_ENV) -> Latency:
    """``read=10ms,write=30ms,watch=5ms`` (module text).

    :raises SettingsError: an unknown key or a value that is not a non-negative duration.
    """
    pairs = _pairs(setting, text, ("read", "write", "watch"))
    return Latency(**{f"{k}_s": _seconds(setting, k, v) for k, v in pairs.items()})


def parse_flow_control(text: str, setting: str = FLOW_CONTROL_ENV) -> FlowControlSettings:
    """``seats=245,queue=50,wait=15s,retry-after=1`` (module text).

    :raises SettingsError: an unknown key or a value out of range.
    """
    pairs = _pairs(setting, text, ("seats", "queue", "wait", "retry-after"))
    kwargs: dict[str, float | int] = {}
    try:
        for key, name in (("seats", "seats"), ("queue", "queue_length"), ("retry-after", "retry_after_s")):
            if key in pairs:
                kwargs[name] = int(pairs[key])
    except ValueError as exc:
        raise SettingsError(f"{setting}: {exc}") from exc
    if "wait" in pairs:
        kwargs["queue_wait_s"] = _seconds(setting, "wait", pairs["wait"])
    try:
        return FlowControlSettings(**kwargs)  # type: ignore[arg-type]
    except SettingsError as exc:
        raise SettingsError(f"{setting}: {exc}") from exc


def latency_from_env(env: Mapping[str, str]) -> Latency:
    """:data:`LATENCY_ENV` read from ``env`` (unset or empty: no latency)."""
    return parse_latency(env.get(LATENCY_ENV, ""))


def flow_control_from_env(env: Mapping[str, str]) -> FlowControlSettings | None:
    """:data:`FLOW_CONTROL_ENV` read from ``env`` (unset or empty: no limit)."""
    text = env.get(FLOW_CONTROL_ENV, "").strip()
    return parse_flow_control(text) if text else None
