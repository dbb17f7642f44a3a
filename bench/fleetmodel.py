"""A ComputeDomain's start on a fleet, in simulated time: the model behind ``python -m bench fleet``
(``bench/fleet.py``), issue 35's "fleet benchmark that can be trusted".

Why simulated time: ``compute_domain_256`` (``bench/cdfleet.py``) runs 256 node agents and the API emulator in
real time on two cores, where a Python emulator's own milliseconds per request and the agents' shared GIL are
the cost the run measures, not the protocols (docs/benchmarks.md). Here every cost is a stated constant with its
public source, spent on a simulated clock (a discrete-event loop, :class:`Sim`): the harness's own CPU advances
no clock, so it cannot be the bottleneck it measures, and one process hosts any fleet (the runs of one report go
to a process pool only to finish sooner).

What is modelled, per ComputeDomain of ``nodes`` nodes (one workload pod per node, racks of up to 18 nodes:
one NVLink clique and one ComputeDomainClique per rack):

* **The API server** (:class:`Api`): each read, write and watch event costs its latency
  (:class:`~dradriver.sandbox.apiserver.flowcontrol.Latency`); every request passes the same API Priority and
  Fairness rules as the emulator's (:class:`~dradriver.sandbox.apiserver.flowcontrol.FairQueues`: seats,
  per-flow queues, 429 with ``Retry-After``, retried by the client after it). Conflicts are real: a clique has
  a resourceVersion, and an update whose read is stale is answered 409 at its commit.
* **Each client's shipped QPS/burst** (:data:`CLIENTS`), client-go's token bucket
  (:class:`dradriver.kube.ratelimit.TokenBucket` on the simulated clock).
* **The pod path shared by every protocol** (:class:`PodStart`): the resourceclaim controller makes each pod's
  claim and writes the pod's status; the scheduler schedules one pod per cycle and binds it (the claim's
  allocation, the binding); the kubelet hears the binding, reads the claim and calls NodePrepareResources, and
  after a failed call waits the pod worker's back-off (10 s, jitter 0.5) before the next; a node label makes the
  DaemonSet controller create the daemon pod in client-go's slow-start batches (1, 2, 4, ...); the daemon pod gets
  its claim, is scheduled, its image is present or pulled, its container starts; its startup probe runs every
  second from the start and passes at the first tick after IMEX answers ready, and the kubelet writes the pod's
  Ready.
* **The protocol under test** (:class:`Protocol`): the plugin's prepare (node label, readiness rule, retry
  pause, deadline), the daemon's membership writes and when it knows its own mapping (then ``nvidia-imex``
  starts and answers ready :attr:`PodStart.imex_start_s` later), and the controller's side.
  :class:`NvidiaProtocol` (kubernetes-sigs/dra-driver-nvidia-gpu, as ``bench/cdprotocol.py``) and
  :class:`DriverManagedProtocol` (dradriver's driver-managed IMEX) and :class:`PreWarmedProtocol` (``--imex-mode
  preWarmed``: the clique daemons already run when the domain is created, so :attr:`Protocol.needs_daemon_pod` is
  False; the controller writes the domain's finalizer, channel and workload template, and the pods' claims wait
  for that template) are built.
  :class:`FloorProtocol` is no driver: a prepare that succeeds at once, the floor the shared pod path sets.

Figures (:class:`RunResult`): seconds from the ComputeDomain's creation to every workload claim prepared; the
first node's; API requests per node (the node's own clients: plugin, daemon, kubelet) and cluster-wide per node
(every client); 409s and 429s.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dradriver.kube.ratelimit import TokenBucket
from dradriver.sandbox.apiserver.flowcontrol import Admission, FairQueues, FlowControlSettings, Latency

__all__ = ["APF_WORKLOAD_LOW", "CLIENTS", "PROTOCOLS", "Api", "ClientLimits", "DriverManagedProtocol",
           "FloorProtocol", "NvidiaProtocol", "PodStart", "PreWarmedProtocol", "Protocol", "RunResult", "Signal",
           "Sim", "racks_for", "run"]

Process = Generator[Any, Any, Any]
MAX_RACK_NODES = 18  # GB200 NVL72: 18 compute trays, one NVLink clique (MAX_NODES_PER_IMEX_DOMAIN's default)


# -- the simulated clock ------------------------------------------------------------------------------------------


class Signal:
    """Something processes wait for (``yield signal``); :meth:`fire` wakes them all with a value."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.fired = False
        self.value: Any = None
        self._waiters: list[Callable[[Any], None]] = []

    def fire(self, value: Any = True) -> None:
        if self.fired:
            return
        self.fired, self.value = True, value
        waiters, self._waiters = self._waiters, []
        for wake in waiters:
            self.sim.at(self.sim.now, functools.partial(wake, value))

    def on(self, wake: Callable[[Any], None]) -> None:
        if self.fired:
            self.sim.at(self.sim.now, lambda: wake(self.value))
        else:
            self._waiters.append(wake)


@dataclass(frozen=True, slots=True)
class Wait:
    """``yield Wait(signal, timeout_s)``: the signal's value, or ``None`` after ``timeout_s`` seconds."""

    signal: Signal
    timeout_s: float


class Sim:
    """A discrete-event loop: processes are generators yielding seconds to sleep, a :class:`Signal` or a
    :class:`Wait`; :attr:`now` is simulated seconds."""

    def __init__(self, seed: int = 35) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.events = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn))

    def spawn(self, process: Process) -> None:
        self.at(self.now, lambda: self._step(process, None))

    def _step(self, process: Process, value: Any) -> None:
        try:
            command = process.send(value)
        except StopIteration:
            return
        if isinstance(command, (int, float)):
            self.at(self.now + max(0.0, float(command)), lambda: self._step(process, None))
        elif isinstance(command, Signal):
            command.on(lambda v: self._step(process, v))
        elif isinstance(command, Wait):
            done = [False]

            def wake(v: Any) -> None:
                if not done[0]:
                    done[0] = True
                    self._step(process, v)

            command.signal.on(wake)
            self.at(self.now + command.timeout_s, lambda: wake(None))
        else:
            raise TypeError(f"a process yielded {command!r}")

    def run(self, until: Callable[[], bool], limit_s: float) -> None:
        """Run events until ``until()`` holds after one, or the clock passes ``limit_s``."""
        while self._heap and not until():
            when, _, fn = heapq.heappop(self._heap)
            if when > limit_s:
                self.now = limit_s
                return
            self.now = when
            self.events += 1
            fn()


# -- the API server and its clients -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """A client's shipped client-side limit and how often it retries a 429.

    :param qps: client-go's token bucket rate (< 0: no client-side limit).
    :param burst: its size.
    :param retries_429: how many times a 429 is retried after its ``Retry-After`` (client-go's ``rest.Request``
        retries up to 10 times; dradriver's :class:`~dradriver.kube.client.RetryPolicy` makes 5 tries).
    """

    qps: float
    burst: int
    retries_429: int = 10


CLIENTS: dict[str, ClientLimits] = {
    # kubernetes-sigs/dra-driver-nvidia-gpu pkg/flags/kubeclient.go: --kube-api-qps 5, --kube-api-burst 10, for
    # its plugins, daemons and controller alike
    "nvidia": ClientLimits(5.0, 10),
    # dradriver/config.py: --kube-api-qps -1 (no client-side limit: API Priority and Fairness applies), 5 tries
    "dradriver": ClientLimits(-1.0, 10, retries_429=4),
    # kube-controller-manager --kube-api-qps 20 --kube-api-burst 30 (kubernetes.io kube-controller-manager
    # reference); each controller has a client of its own (--use-service-account-credentials)
    "kube-controller-manager": ClientLimits(20.0, 30),
    # KubeSchedulerConfiguration clientConnection qps 50, burst 100 (kubernetes.io kube-scheduler config v1)
    "kube-scheduler": ClientLimits(50.0, 100),
    # KubeletConfiguration kubeAPIQPS 50, kubeAPIBurst 100 (the defaults since Kubernetes 1.27)
    "kubelet": ClientLimits(50.0, 100),
}


class Conflict(Exception):
    """A write whose precondition no longer held at its commit: answered 409."""


@dataclass
class Client:
    """One API client: its name (the flow APF queues it in), whose requests it is counted as (a node or
    ``cluster``), and its token bucket."""

    name: str
    owner: str
    limits: ClientLimits
    bucket: TokenBucket | None = None


class Api:
    """The API server (module text): latency, API Priority and Fairness, request counts, watch delivery."""

    def __init__(self, sim: Sim, latency: Latency, flow_control: FlowControlSettings | None,
                 clients: Mapping[str, ClientLimits] | None = None) -> None:
        self.sim = sim
        self.clients = {**CLIENTS, **(clients or {})}
        self.latency = latency
        self.flow = FairQueues(flow_control) if flow_control is not None else None
        self.requests: Counter[str] = Counter()  # owner -> requests (every try, 429s and 409s included)
        self.by_verb: Counter[str] = Counter()
        self.conflicts = 0
        self.throttled = 0

    def client(self, name: str, owner: str, kind: str) -> Client:
        limits = self.clients[kind]
        bucket = (TokenBucket(limits.qps, limits.burst, clock=lambda: self.sim.now) if limits.qps >= 0 else None)
        return Client(name, owner, limits, bucket)

    def request(self, client: Client, verb: str, commit: Callable[[], Any] = lambda: None) -> Process:
        """One request of ``client`` (``yield from``): its token, its seat (or 429 and a retry after
        ``Retry-After``), its latency, then ``commit()`` at the server (its value is the answer; :class:`Conflict`
        from it is the 409, raised to the caller)."""
        for _ in range(client.limits.retries_429 + 1):
            if client.bucket is not None:
                delay = client.bucket.reserve()
                if delay > 0:
                    yield delay
            self.requests[client.owner] += 1
            self.by_verb[verb] += 1
            if self.flow is not None and not (yield from self._seat(client)):
                self.throttled += 1
                assert self.flow is not None
                yield float(self.flow.settings.retry_after_s)
                continue
            try:
                yield self.latency.of(verb)
                return commit()
            except Conflict:
                self.conflicts += 1
                raise
            finally:
                if self.flow is not None:
                    waiter = self.flow.release()
                    if waiter is not None:
                        ticket = waiter.ticket
                        assert isinstance(ticket, Signal)
                        ticket.fire(True)
        raise RuntimeError(f"{client.name}: {client.limits.retries_429 + 1} answers 429 in a row")

    def _seat(self, client: Client) -> Process:
        assert self.flow is not None
        verdict, waiter = self.flow.admit(client.name, Signal(self.sim))
        if verdict == Admission.RUN:
            return True
        if verdict == Admission.REJECTED or waiter is None:
            return False
        ticket = waiter.ticket
        assert isinstance(ticket, Signal)
        got = yield Wait(ticket, self.flow.settings.queue_wait_s)
        return bool(got) or not self.flow.expire(waiter)

    def watch(self, open_by: Client | None = None) -> Process:
        """A watch opened by ``open_by`` (one request, no seat) -- counted only."""
        if open_by is not None:
            self.requests[open_by.owner] += 1
            self.by_verb["watch"] += 1
        yield 0.0

    def deliver(self, fn: Callable[[], None]) -> None:
        """A watch event reaches a watcher :attr:`Latency.watch_s` after its commit."""
        self.sim.at(self.sim.now + self.latency.watch_s, fn)


# -- the cluster around the driver --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodStart:
    """The pod path shared by every protocol; seconds.

    :param schedule_s: one scheduling cycle of kube-scheduler (100 pods/s: the scheduling throughput the
        Kubernetes scalability tests hold, kubernetes/perf-tests clusterloader2 ``load`` config).
    :param image_present: whether the daemon image is already on the node (``IfNotPresent``; a node that ran a
        daemon of an earlier domain has it).
    :param image_pull_s: pulling the daemon image on a fresh node (20 s, inside the 5-30 s kubernetes-sigs/
        dra-driver-nvidia-gpu#1152 reports for cold caches).
    :param container_start_s: sandbox and container creation once the image is there (inside the 5 s p99 of the
        Kubernetes pod startup SLO, kubernetes/community ``sig-scalability/slos/pod_startup_latency.md``).
    :param imex_start_s: ``nvidia-imex`` from its start to answering ready (assumed: NVIDIA's daemon template
        sets ``IMEX_WAIT_FOR_QUORUM=RECOVERY``, so a first start waits for no quorum; no public timing).
    :param startup_probe_s: the daemon pod's startup probe period (NVIDIA's DaemonSet template: every 1 s).
    :param kubelet_backoff_s: the kubelet's pod worker back-off after a failed sync, a failed
        NodePrepareResources included (kubernetes ``pkg/kubelet/kubelet.go`` ``backOffPeriod`` 10 s, jittered
        by ``workerBackOffPeriodJitterFactor`` 0.5 in ``pkg/kubelet/pod_workers.go``: 10-15 s).
    :param kubelet_deadline_s: one NodePrepareResources call's deadline (the kubelet's 45 s).
    """

    schedule_s: float = 0.01
    image_present: bool = True
    image_pull_s: float = 20.0
    container_start_s: float = 1.0
    imex_start_s: float = 1.0
    startup_probe_s: float = 1.0
    kubelet_backoff_s: float = 10.0
    kubelet_backoff_jitter: float = 0.5
    kubelet_deadline_s: float = 45.0


@dataclass
class Entry:
    """A daemon's entry in its clique."""

    ip: str
    index: int | None = None
    status: str = "NotReady"


@dataclass
class Clique:
    """One ComputeDomainClique: its resourceVersion and entries (node -> :class:`Entry`)."""

    rv: int = 0
    exists: bool = False
    entries: dict[str, Entry] = field(default_factory=dict)
    watchers: list[Callable[[], None]] = field(default_factory=list)

    def snapshot(self) -> tuple[int, dict[str, Entry]]:
        return self.rv, {n: replace(e) for n, e in self.entries.items()}


@dataclass
class Node:
    """One node of the domain and what has happened on it (simulated seconds)."""

    name: str
    rack: int
    ip: str
    plugin: Client
    daemon: Client
    kubelet: Client
    labelled: bool = False
    daemon_pod: bool = False
    container_started: float | None = None
    mapping_known: Signal | None = None
    imex_ready_at: float | None = None
    pod_ready: Signal | None = None  # the daemon pod's Ready, as its kubelet wrote it
    record_ready: Signal | None = None  # dradriver's local readiness record says ready
    record_written: bool = False
    bound_at: float | None = None  # the workload pod's binding reached the kubelet
    prepared_at: float | None = None
    prepare_calls: int = 0


class Model:
    """One run's cluster: the simulated clock, the API server, the shared controllers and the nodes."""

    def __init__(self, protocol: Protocol, nodes: int, latency: Latency, flow_control: FlowControlSettings | None,
                 pod: PodStart, seed: int, clients: Mapping[str, ClientLimits] | None = None) -> None:
        self.sim = Sim(seed)
        self.api = Api(self.sim, latency, flow_control, clients)
        self.protocol = protocol
        self.pod = pod
        self.cliques: dict[int, Clique] = {}
        self.nodes: list[Node] = []
        for rack, count in enumerate(racks_for(nodes), start=1):
            for tray in range(count):
                name = f"rack{rack:03d}-node{tray:02d}"
                self.nodes.append(Node(name, rack, f"10.0.{rack}.{tray + 1}",
                                       self.api.client(f"plugin/{name}", name, protocol.client_kind),
                                       self.api.client(f"daemon/{name}", name, protocol.client_kind),
                                       self.api.client(f"kubelet/{name}", name, "kubelet")))
            self.cliques[rack] = Clique()
        for n in self.nodes:
            n.mapping_known, n.pod_ready, n.record_ready = Signal(self.sim), Signal(self.sim), Signal(self.sim)
        self.claims = self.api.client("resourceclaim-controller", "cluster", "kube-controller-manager")
        self.daemonsets = self.api.client("daemonset-controller", "cluster", "kube-controller-manager")
        self.scheduler = self.api.client("kube-scheduler", "cluster", "kube-scheduler")
        self.controller = self.api.client("compute-domain-controller", "cluster", protocol.client_kind)
        self._schedule_queue: list[tuple[Node, Signal]] = []
        self._scheduler_wake = Signal(self.sim)
        self._ds_pending: list[Node] = []
        self._ds_wake = Signal(self.sim)

    # the shared pod path --------------------------------------------------------------------------------------

    def start(self) -> None:
        for node in self.nodes:
            self.sim.spawn(self._workload(node))
        self.sim.spawn(self._scheduler_loop())
        self.sim.spawn(self._daemonset_loop())
        self.protocol.start(self)

    def _schedule(self, node: Node) -> Process:
        bound = Signal(self.sim)
        self._schedule_queue.append((node, bound))
        self._scheduler_wake.fire()
        yield bound

    def _scheduler_loop(self) -> Process:
        while True:
            if not self._schedule_queue:
                self._scheduler_wake = Signal(self.sim)
                yield self._scheduler_wake
                continue
            _, bound = self._schedule_queue.pop(0)
            yield self.pod.schedule_s  # the scheduling cycle, one pod at a time
            self.sim.spawn(self._bind(bound))

    def _bind(self, bound: Signal) -> Process:
        yield from self.api.request(self.scheduler, "update")  # PreBind: the claim's status.allocation
        yield from self.api.request(self.scheduler, "create")  # the binding
        self.api.deliver(bound.fire)  # the kubelet's pod watch

    def _claim_for(self, node: Node) -> Process:
        yield from self.api.request(self.claims, "create")  # the ResourceClaim from the pod's template
        yield from self.api.request(self.claims, "update")  # the pod's status.resourceClaimStatuses
        yield self.api.latency.watch_s  # the scheduler hears the claim

    def _workload(self, node: Node) -> Process:
        yield self.api.latency.watch_s  # the resourceclaim controller hears the workload pod
        template = self.protocol.workload_template
        if template is not None:  # the pod's claim is made from the template the domain's controller writes
            yield template
            yield self.api.latency.watch_s  # the resourceclaim controller's template informer hears it
        yield from self._claim_for(node)
        yield from self._schedule(node)
        node.bound_at = self.sim.now
        while True:
            yield from self.api.request(node.kubelet, "get")  # the kubelet reads the claim before each call
            node.prepare_calls += 1
            for _ in range(self.protocol.call_reads):  # the plugin's own reads of the claim and its domain
                yield from self.api.request(node.plugin, "get")
            deadline = self.sim.now + self.pod.kubelet_deadline_s
            ok = yield from self.protocol.prepare(self, node, deadline)
            if ok:
                node.prepared_at = self.sim.now
                return
            yield self.pod.kubelet_backoff_s * (1 + self.sim.rng.random() * self.pod.kubelet_backoff_jitter)

    def label(self, node: Node) -> Process:
        """The plugin's node label (one write), heard by the DaemonSet controller."""
        yield from self.api.request(node.plugin, "patch")
        node.labelled = True
        if self.protocol.needs_daemon_pod:
            self.api.deliver(lambda: self._ds_enqueue(node))

    def _ds_enqueue(self, node: Node) -> None:
        self._ds_pending.append(node)
        self._ds_wake.fire()

    def _daemonset_loop(self) -> Process:
        """The DaemonSet controller: each sync creates the missing pods in slow-start batches of 1, 2, 4, ...
        (kubernetes ``pkg/controller/daemon/daemon_controller.go`` ``syncNodes``, ``slowStartBatch`` with
        ``SlowStartInitialBatchSize`` 1), then waits to observe its creations (its expectations) before the next."""
        while True:
            if not self._ds_pending:
                self._ds_wake = Signal(self.sim)
                yield self._ds_wake
                continue
            todo, self._ds_pending = self._ds_pending, []
            size = 1
            while todo:
                batch, todo = todo[:size], todo[size:]
                done = [Signal(self.sim) for _ in batch]
                for node, signal in zip(batch, done, strict=True):
                    self.sim.spawn(self._create_daemon_pod(node, signal))
                for signal in done:
                    yield signal
                size *= 2
            yield self.api.latency.watch_s  # the controller observes its creations (expectations)

    def _create_daemon_pod(self, node: Node, created: Signal) -> Process:
        yield from self.api.request(self.daemonsets, "create")
        created.fire()
        self.api.deliver(lambda: self.sim.spawn(self._daemon_pod(node)))

    def _daemon_pod(self, node: Node) -> Process:
        node.daemon_pod = True
        yield from self._claim_for(node)  # the daemon pod's claim from the domain's daemon template
        yield from self._schedule(node)
        yield from self.api.request(node.kubelet, "get")  # its claim (the daemon claim's prepare is node-local)
        if not self.pod.image_present:
            yield self.pod.image_pull_s
        yield self.pod.container_start_s
        node.container_started = self.sim.now
        self.sim.spawn(self._prober(node))
        yield from self.protocol.daemon(self, node)

    def imex_starts(self, node: Node) -> None:
        """The daemon knows its own name -> IP mapping: ``nvidia-imex`` starts and answers ready later."""
        if node.imex_ready_at is None:
            node.imex_ready_at = self.sim.now + self.pod.imex_start_s
            assert node.mapping_known is not None
            node.mapping_known.fire()

    def _prober(self, node: Node) -> Process:
        """The startup probe every :attr:`PodStart.startup_probe_s` from the container's start; it passes at the
        first tick at or after IMEX answers ready; the kubelet then writes the pod's Ready."""
        assert node.mapping_known is not None and node.pod_ready is not None and node.record_ready is not None
        while True:
            yield self.pod.startup_probe_s
            if node.imex_ready_at is not None and self.sim.now >= node.imex_ready_at:
                break
        self.protocol.probed(self, node)
        yield from self.api.request(node.kubelet, "update")  # the pod's status: Ready
        node.pod_ready.fire()

    def done(self) -> bool:
        return all(n.prepared_at is not None for n in self.nodes)


def racks_for(nodes: int) -> list[int]:
    """``nodes`` over as few racks of up to 18 as hold them, as evenly as possible (256: one of 18 and fourteen
    of 17; 72: four of 18).

    :raises ValueError: fewer than one node.
    """
    if nodes < 1:
        raise ValueError(f"a domain needs at least one node, not {nodes}")
    racks = math.ceil(nodes / MAX_RACK_NODES)
    base, extra = divmod(nodes, racks)
    return [base + (1 if r < extra else 0) for r in range(racks)]


# -- the protocols ------------------------------------------------------------------------------------------------


class Protocol:
    """A ComputeDomain protocol: what its plugin, daemon and controller send and wait for. Subclasses set
    :attr:`label` (the report's name) and :attr:`client_kind` (a key of :data:`CLIENTS`)."""

    label = ""
    client_kind = ""
    needs_daemon_pod = True  # False for a mode whose daemons run before any domain (pre-warmed)
    workload_template: Signal | None = None  # fired when the controller has created the workload claim template;
    # None: the model takes it as there when the domain is created (NVIDIA's and driver-managed's controllers
    # write it too, not modelled: it would add the same few requests to each)
    call_reads = 2  # per NodePrepareResources: the plugin GETs the ResourceClaim (k8s.io/dynamic-resource-
    # allocation's kubeletplugin helper, and dradriver's runner) and the ComputeDomain it names

    def start(self, model: Model) -> None:
        """Processes that run from the domain's creation (the controller's loops)."""

    def prepare(self, model: Model, node: Node, deadline: float) -> Process:
        """One NodePrepareResources of ``node``'s workload claim (the kubelet's ``deadline``); returns when the call
        is answered: True for success, False for the error it ends with (at its own deadline at the latest)."""
        raise NotImplementedError
        yield

    def daemon(self, model: Model, node: Node) -> Process:
        """The daemon from its container's start: its membership writes; calls :meth:`Model.imex_starts` when it
        knows its own mapping."""
        raise NotImplementedError
        yield

    def probed(self, model: Model, node: Node) -> None:
        """The startup probe passed (the daemon's ``check`` answered ready)."""


def _free_index(entries: dict[str, Entry]) -> int:
    taken = {e.index for e in entries.values() if e.index is not None}
    return next(i for i in range(MAX_RACK_NODES) if i not in taken)


class NvidiaProtocol(Protocol):
    """NVIDIA's protocol (kubernetes-sigs/dra-driver-nvidia-gpu, as ``bench/cdprotocol.py`` runs it for real):

    * plugin (``cmd/compute-domain-kubelet-plugin/``): label the node, then GET its clique until this node's
      entry is ``Ready``; between tries its workqueue's per-item back-off, 250 ms doubling to 3 s, and a 5 qps /
      burst 10 bucket, until the 45 s deadline;
    * daemon (``cmd/compute-domain-daemon/``): label its pod, then read-modify-write the shared clique to insert
      its entry with the lowest free index (``NotReady``), a 409 retried after its workqueue's jittered back-off
      (5 ms doubling to 6 s); it knows its mapping once its own write succeeded; when its pod turns Ready (its pod
      informer), the same read-modify-write sets ``Ready``;
    * controller (``cmd/compute-domain-controller/``): every 2 s, lists every ComputeDomain, daemon pod and clique
      and writes the domain's status when it changed.
    """

    label = "nvidia"
    client_kind = "nvidia"
    PLUGIN_BACKOFF_S = (0.25, 3.0)
    CONFLICT_BACKOFF_S = (0.005, 6.0)
    STATUS_PERIOD_S = 2.0

    def start(self, model: Model) -> None:
        model.sim.spawn(self._status_loop(model))

    def _status_loop(self, model: Model) -> Process:
        last = ""
        while not model.done():
            yield self.STATUS_PERIOD_S
            for _ in range(3):  # ComputeDomains, daemon pods, cliques
                yield from model.api.request(model.controller, "list")
            now = repr(sorted((r, sorted((n, e.index, e.status) for n, e in c.entries.items()))
                              for r, c in model.cliques.items()))
            if now != last:
                yield from model.api.request(model.controller, "update")  # status.nodes, status.status
                last = now

    def prepare(self, model: Model, node: Node, deadline: float) -> Process:
        if not node.labelled:
            yield from model.label(node)
        clique = model.cliques[node.rack]
        backoff, longest = self.PLUGIN_BACKOFF_S
        bucket = TokenBucket(5.0, 10, clock=lambda: model.sim.now)  # the request's workqueue
        while True:
            _, entries = yield from model.api.request(node.plugin, "get", clique.snapshot)
            entry = entries.get(node.name)
            if entry is not None and entry.status == "Ready":
                return True
            delay = max(backoff, bucket.reserve())
            backoff = min(longest, backoff * 2)
            if model.sim.now + delay >= deadline:  # no try after the deadline: the call fails at it
                yield deadline - model.sim.now
                return False
            yield delay

    def daemon(self, model: Model, node: Node) -> Process:
        yield from model.api.watch(node.daemon)  # its pod informer (list + watch)
        yield from model.api.request(node.daemon, "list")
        yield from model.api.request(node.daemon, "patch")  # its pod's clique label
        yield from self._upsert(model, node, "NotReady")
        model.imex_starts(node)
        assert node.pod_ready is not None
        yield node.pod_ready
        yield model.api.latency.watch_s  # its pod informer hears the kubelet's write
        yield from self._upsert(model, node, "Ready")

    def _upsert(self, model: Model, node: Node, status: str) -> Process:
        clique = model.cliques[node.rack]
        first, longest = self.CONFLICT_BACKOFF_S
        attempt = 0
        while True:
            exists = yield from model.api.request(node.daemon, "get", lambda: clique.exists)
            try:
                if not exists:
                    def create() -> None:
                        if clique.exists:
                            raise Conflict("AlreadyExists")
                        clique.exists, clique.rv = True, clique.rv + 1

                    yield from model.api.request(node.daemon, "create", create)
                rv, entries = yield from model.api.request(node.daemon, "get", clique.snapshot)
                entry = entries.get(node.name) or Entry(node.ip)
                if entry.index is None:
                    entry.index = _free_index(entries)
                entry.status = status

                def update(rv: int = rv, entry: Entry = entry) -> None:
                    if clique.rv != rv:
                        raise Conflict("the object has been modified")
                    clique.entries[node.name] = entry
                    clique.rv += 1

                yield from model.api.request(node.daemon, "update", update)
                return
            except Conflict:
                yield min(longest, first * 2 ** attempt * (1 + model.sim.rng.random()))
                attempt += 1


class DriverManagedProtocol(Protocol):
    """dradriver's driver-managed IMEX (docs/design/compute-domain-membership.md):

    * plugin (``dradriver/preparers/computedomain.py``, ``dradriver/kubeletplugin/runner.py``): label the node;
      its readiness rule reads the daemon's local readiness record first (no API request), else the clique
      entry (a GET) and, for a member not yet ``Ready``, the daemon pod (a LIST); between tries a pause of 100 ms
      doubling to 2 s, cut short at the next 50 ms poll of the record once it says ready; 40 s deadline;
    * daemon (``dradriver/computedomain/daemon.py``): label its pod, write its record (not ready), one
      server-side apply of its own entry (never a 409), a watch on its clique; it knows its mapping when the
      controller's index reaches it; each probe writes its record;
    * controller (``dradriver/computedomain/controller.py``): watches the cliques and daemon pods, gathers a burst
      of events for 50 ms, then one apply per changed clique (indexes, and each entry's status from its pod).
    """

    label = "driver-managed"
    client_kind = "dradriver"
    PAUSE_S = (0.1, 2.0)
    HINT_POLL_S = 0.05
    DEADLINE_S = 40.0
    COALESCE_S = 0.05

    def start(self, model: Model) -> None:
        self._dirty: set[int] = set()
        self._wake = Signal(model.sim)
        model.sim.spawn(model.api.watch(model.controller))  # cliques
        model.sim.spawn(model.api.watch(model.controller))  # daemon pods
        model.sim.spawn(self._controller(model))

    def _mark(self, rack: int) -> None:
        self._dirty.add(rack)
        self._wake.fire()

    def _controller(self, model: Model) -> Process:
        """One pass per burst of marked cliques (gathered :attr:`COALESCE_S`), up to 8 cliques written at once;
        the next pass after this one's writes."""
        while True:
            if not self._dirty:
                self._wake = Signal(model.sim)
                yield self._wake
                continue
            yield self.COALESCE_S
            racks, self._dirty = sorted(self._dirty), set()
            for first in range(0, len(racks), 8):
                done = [Signal(model.sim) for _ in racks[first:first + 8]]
                for rack, signal in zip(racks[first:first + 8], done, strict=True):
                    model.sim.spawn(self._pass(model, rack, signal))
                for signal in done:
                    yield signal

    def _pass(self, model: Model, rack: int, done: Signal) -> Process:
        clique = model.cliques[rack]
        ready = {n.name for n in model.nodes if n.rack == rack and n.pod_ready is not None and n.pod_ready.fired}

        def wanted() -> dict[str, tuple[int | None, str]]:
            return {name: (e.index, "Ready" if name in ready else "NotReady") for name, e in clique.entries.items()}

        before = wanted()

        def apply() -> None:
            for name, entry in sorted(clique.entries.items()):
                if entry.index is None:
                    entry.index = _free_index(clique.entries)
                entry.status = "Ready" if name in ready else "NotReady"
            clique.rv += 1
            self._notify(model, clique)

        if any(index is None for index, _ in before.values()) or any(
                status != clique.entries[n].status for n, (_, status) in before.items()):
            yield from model.api.request(model.controller, "patch", apply)
        done.fire()

    def _notify(self, model: Model, clique: Clique) -> None:
        for watcher in list(clique.watchers):
            model.api.deliver(watcher)

    def prepare(self, model: Model, node: Node, deadline: float) -> Process:
        if not node.labelled:
            yield from model.label(node)
        return (yield from self._daemon_ready(model, node, deadline))

    def _daemon_ready(self, model: Model, node: Node, deadline: float) -> Process:
        """The readiness rule (``DomainLookup.daemon_readiness``) and the runner's retry pauses until it holds or
        the deadline passes; True when it holds."""
        clique = model.cliques[node.rack]
        pause, longest = self.PAUSE_S
        deadline = min(deadline, model.sim.now + self.DEADLINE_S)
        assert node.record_ready is not None and node.pod_ready is not None
        pod_signal = node.pod_ready
        while True:
            if node.record_ready.fired:
                return True
            if not node.record_written:
                _, entries = yield from model.api.request(node.plugin, "get", clique.snapshot)
                entry = entries.get(node.name)
                if entry is not None and entry.index is not None:
                    if entry.status == "Ready":
                        return True
                    pod_ready = yield from model.api.request(node.plugin, "list", lambda: pod_signal.fired)
                    if pod_ready:
                        return True
            if model.sim.now + pause >= deadline:  # the runner answers the error at its deadline
                yield deadline - model.sim.now
                return False
            started = model.sim.now
            hint = yield Wait(node.record_ready, pause)
            if hint is not None:  # the next poll of the record after it turned ready
                elapsed = model.sim.now - started
                yield math.ceil(elapsed / self.HINT_POLL_S + 1e-9) * self.HINT_POLL_S - elapsed
            pause = min(longest, pause * 2)

    def daemon(self, model: Model, node: Node) -> Process:
        clique = model.cliques[node.rack]
        yield from model.api.request(node.daemon, "patch")  # its pod's clique label
        node.record_written = True  # "starting": the plugin's rule reads it from now, not the API

        def apply() -> None:
            clique.exists = True
            clique.entries.setdefault(node.name, Entry(node.ip))
            clique.rv += 1
            self._notify(model, clique)

        yield from model.api.request(node.daemon, "patch", apply)
        yield from model.api.watch(node.daemon)  # from the apply's resourceVersion
        model.api.deliver(lambda: self._mark(node.rack))  # the controller's clique watch
        heard = Signal(model.sim)

        def watcher() -> None:
            entry = clique.entries.get(node.name)
            if entry is not None and entry.index is not None:
                heard.fire()

        clique.watchers.append(watcher)
        if (clique.entries.get(node.name) or Entry("")).index is not None:
            heard.fire()
        yield heard
        clique.watchers.remove(watcher)
        model.imex_starts(node)
        assert node.pod_ready is not None
        yield node.pod_ready
        model.api.deliver(lambda: self._mark(node.rack))  # the controller's pod watch: the entry's status

    def probed(self, model: Model, node: Node) -> None:
        assert node.record_ready is not None
        node.record_ready.fire()


class PreWarmedProtocol(DriverManagedProtocol):
    """dradriver's pre-warmed IMEX (``--imex-mode preWarmed``, docs/user-guide/compute-domains.md "Pre-warmed IMEX
    daemons per clique"): the clique DaemonSets' IMEX daemons run, joined and ``Ready``, before the ComputeDomain
    is created (t = 0: every node's readiness record says ready, its clique entry is ``Ready``); the domain gets
    no daemon pod, no daemon claim and no node label.

    * controller (``dradriver/computedomain/controller.py`` ``reconcile``, one pass after its ComputeDomain watch
      hears the new domain): GET the domain; its finalizer (an update); ``assign_channel``: LIST every
      ComputeDomain, the channel annotation (an update); ``_ensure`` of the workload ResourceClaimTemplate (a GET,
      then its create: the pods' claims can be made from then, :attr:`Protocol.workload_template`);
      ``sync_status``: the domain's claims (a LIST; none allocated yet, so no Node list and no clique read) and
      its status (a patch: ``Ready``, no node to wait for). Its own two updates, heard on its watch before the pass
      marked the domain's generation done, queue a second pass: the domain and the template read again, the
      claims listed, and where some are allocated by then (the model counts the bound ones) the Nodes listed,
      their cliques read and ``status.nodes`` patched. No clique is written: no membership changes;
    * plugin (``dradriver/preparers/computedomain.py`` ``ChannelPreparer``, pre-warmed branch): the claim and the
      domain (:attr:`Protocol.call_reads`), the channel check against the domain's annotation (no request), then
      ``_clique_daemon_ready``: the clique daemon's readiness record, ready, is the answer (no request). A node
      whose clique daemon were not ready would wait as driver-managed does (the same rule and pauses), but
      with no label to write.
    """

    label = "pre-warmed"
    needs_daemon_pod = False

    def start(self, model: Model) -> None:
        self.workload_template = Signal(model.sim)
        for node in model.nodes:  # the clique daemons: running, joined, Ready
            assert node.record_ready is not None and node.pod_ready is not None
            node.record_written = True
            node.record_ready.fire()
            node.pod_ready.fire()
            model.cliques[node.rack].exists = True
            model.cliques[node.rack].entries[node.name] = Entry(node.ip, len(model.cliques[node.rack].entries),
                                                                "Ready")
        model.sim.spawn(model.api.watch(model.controller))  # ComputeDomains
        model.sim.spawn(self._reconcile(model))

    def _reconcile(self, model: Model) -> Process:
        assert self.workload_template is not None
        yield model.api.latency.watch_s  # the ComputeDomain watch hears the new domain
        api, controller = model.api, model.controller
        yield from api.request(controller, "get")  # the domain
        yield from api.request(controller, "update")  # its finalizer
        yield from api.request(controller, "list")  # assign_channel: every ComputeDomain's channel
        yield from api.request(controller, "update")  # the channel annotation
        yield from api.request(controller, "get")  # _ensure: the workload template is not there
        yield from api.request(controller, "create")  # ... and is created
        self.workload_template.fire()
        yield from api.request(controller, "list")  # sync_status: the domain's ResourceClaims
        yield from api.request(controller, "patch")  # status: Ready
        # Its own finalizer and annotation updates came back on the watch before this pass marked the generation
        # done (``_settled``), so the key is queued again: a second pass that writes nothing but the status.
        yield from api.request(controller, "get")  # the domain
        yield from api.request(controller, "get")  # _ensure: the template is there, this domain's
        yield from api.request(controller, "list")  # sync_status: the domain's ResourceClaims
        racks = {n.rack for n in model.nodes if n.bound_at is not None}  # allocated by now (bound: a little later)
        if racks:  # status.nodes from the allocated claims' nodes, their clique labels and clique entries
            yield from api.request(controller, "list")  # the Nodes
            for _ in sorted(racks):
                yield from api.request(controller, "get")  # each clique's ComputeDomainClique
            yield from api.request(controller, "patch")  # status.nodes (every clique daemon Ready: no Event)

    def prepare(self, model: Model, node: Node, deadline: float) -> Process:
        return (yield from self._daemon_ready(model, node, deadline))

    def daemon(self, model: Model, node: Node) -> Process:
        raise AssertionError("pre-warmed: a ComputeDomain starts no daemon pod")
        yield


class FloorProtocol(Protocol):
    """Not a driver: a prepare that succeeds at once, with no daemon and no API request. Its time is the shared pod
    path alone (claims, scheduling, the kubelet's read), the floor under every mode, a pre-warmed one included:
    NVIDIA's seconds / the floor's is the most any mode can gain in the same cluster."""

    label = "floor"
    client_kind = "dradriver"
    needs_daemon_pod = False
    call_reads = 0

    def prepare(self, model: Model, node: Node, deadline: float) -> Process:
        return True
        yield


APF_WORKLOAD_LOW = FlowControlSettings()
"""The API server's limit in every run: the ``workload-low`` priority level the drivers' service accounts fall in
(kube-apiserver's default FlowSchema ``service-accounts``), :class:`FlowControlSettings`' defaults."""

PROTOCOLS: dict[str, Callable[[], Protocol]] = {"nvidia": NvidiaProtocol, "driver-managed": DriverManagedProtocol,
                                                "pre-warmed": PreWarmedProtocol, "floor": FloorProtocol}
"""The protocols built (the report's names; ``pre-warmed`` is ``--imex-mode preWarmed``) and the floor."""


# -- one run ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunResult:
    """One domain's start.

    :param seconds: simulated seconds from the ComputeDomain's creation to the last workload claim prepared.
    :param first_s: the same to the first claim prepared.
    :param node_requests: requests of the nodes' own clients (plugin, daemon, kubelet), per node, mean.
    :param all_requests: every client's requests (controllers, scheduler included) per node.
    :param driver_s: the longest wait of one workload pod from its binding reaching its kubelet to its claim
        prepared (what the driver's protocol adds to the shared pod path).
    :param prepare_calls: NodePrepareResources calls per node, mean (above 1: the kubelet called again).
    :param events: simulation events processed (the harness's work, not a cost of the model).
    """

    protocol: str
    nodes: int
    latency: Latency
    image_present: bool
    seconds: float
    first_s: float
    driver_s: float
    node_requests: float
    all_requests: float
    conflicts: int
    throttled: int
    prepare_calls: float
    events: int


def run(protocol: str, nodes: int, *, latency: Latency | None = None,
        flow_control: FlowControlSettings | None = APF_WORKLOAD_LOW, pod: PodStart | None = None,
        seed: int = 35, limit_s: float = 3600.0, clients: Mapping[str, ClientLimits] | None = None) -> RunResult:
    """Create one ComputeDomain over ``nodes`` nodes (each with one workload pod) and run until every workload
    claim is prepared.

    :param protocol: a key of :data:`PROTOCOLS`.
    :param clients: limits that replace :data:`CLIENTS`' entries of the same kind (a sensitivity run).
    :param flow_control: the API server's APF level (default: ``workload-low``'s share, :class:`FlowControlSettings`);
        ``None``: no limit.
    :raises KeyError: an unknown protocol (the message lists the built ones).
    :raises RuntimeError: not every claim was prepared within ``limit_s`` simulated seconds.
    """
    if protocol not in PROTOCOLS:
        raise KeyError(f"protocol {protocol!r} is not built; built: {', '.join(sorted(PROTOCOLS))}")
    model = Model(PROTOCOLS[protocol](), nodes, latency or Latency(), flow_control, pod or PodStart(), seed, clients)
    model.start()
    model.sim.run(model.done, limit_s)
    if not model.done():
        waiting = [n.name for n in model.nodes if n.prepared_at is None]
        raise RuntimeError(f"{protocol}: {len(waiting)} of {nodes} claims not prepared after {limit_s:.0f} "
                           f"simulated s (first: {', '.join(waiting[:3])})")
    times = [n.prepared_at or 0.0 for n in model.nodes]
    node_requests = sum(model.api.requests[n.name] for n in model.nodes)
    waits = [(n.prepared_at or 0.0) - (n.bound_at or 0.0) for n in model.nodes]
    return RunResult(protocol, nodes, model.api.latency, model.pod.image_present, max(times), min(times),
                     max(waits), node_requests / nodes, sum(model.api.requests.values()) / nodes, model.api.conflicts,
                     model.api.throttled, sum(n.prepare_calls for n in model.nodes) / nodes, model.sim.events)

