"""A ComputeDomain fleet in one process: the harness of ``bench/bench_computedomain.py``.

What runs (NVIDIA's ``cmd/compute-domain-controller/`` and ``cmd/compute-domain-daemon/`` in
kubernetes-sigs/dra-driver-nvidia-gpu for every step and period):

* one API emulator (:mod:`dradriver.sandbox.apiserver`, real HTTP) with the ComputeDomain CRDs, the driver
  namespace and ``racks`` x ``nodes`` Nodes; every node of a rack carries the fabric label
  ``nvidia.com/gpu.clique=<clusterUUID>.<rack>`` (one NVLink clique per rack, as on GB200 NVL72);
* per node of a domain, one thread (:class:`NodeAgent`) with its own API client (``User-Agent
  bench-node/<node>``, so the emulator's request records attribute every request to its node) playing the node's
  three parts: the kubelet plugin's channel prepare of the workload pod (real node label write
  :func:`dradriver.kube.computedomains.set_node_label` and the plugin's real readiness lookup
  (:meth:`Membership.plugin_ready`: NVIDIA's plugin reads its clique entry's status; dradriver's calls
  :meth:`dradriver.preparers.computedomain.DomainLookup.daemon_readiness`), retried with each plugin's own
  per-claim backoff (:meth:`Membership.backoff_s`: NVIDIA's 250 ms -> 3 s, dradriver's 100 ms -> 2 s) and the 45 s
  deadline, after which the kubelet's own retry starts the next call); the IMEX
  daemon (the membership protocol under test: pod label, then the clique entry: NVIDIA's NotReady and Ready
  writes, dradriver's one apply); and the kubelet's prober (IMEX is ready once the daemon's own entry has its
  index; the startup probe, every 1 s, then passes and the pod turns Ready, written in process like the kubelet's
  status update; NVIDIA's daemon hears it at once, as its pod informer would, dradriver's controller through its
  pod watch). No ``nvidia-imex`` process runs (2 CPU cores);
* the DaemonSet controller's answer to the plugin's node label: a daemon pod (labelled with the domain's UID,
  owned by nobody: nothing deletes it during a run) created in process right after the label write, in the
  node's own thread (:meth:`NodeAgent._daemon_pod`);
* the controller side of the protocol under test (:class:`Membership.controller`) with its own client
  (``bench-controller``).

Periods are NVIDIA's (seconds on a real cluster) times :attr:`Timing.scale`. Every figure is read from the
emulator's request records: writes (create, update, patch, delete) per node split into membership writes
(ComputeDomainCliques and ComputeDomains) and label writes (Nodes and Pods), and answers 409.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench import cdprotocol
from bench.cdprotocol import DaemonIdentity
from dradriver.computedomain import daemon as cddaemon  # here, not in 256 node threads at once behind the import lock
from dradriver.domain import computedomains as cd
from dradriver.domain.computedomains import CliqueDaemon
from dradriver.host import imexchannels
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kube import pods as kube_pods
from dradriver.kube.client import JSONDict, KubeClient, RetryPolicy, open_client
from dradriver.kubeletplugin.runner import HINT_POLL_S, RETRY_PAUSE_S
from dradriver.preparers.computedomain import DomainLookup
from dradriver.sandbox.apiserver import ApiServerEmulator, RequestRecord

__all__ = [
    "DRIVER_NAMESPACE",
    "ControllerCost",
    "DaemonSide",
    "DomainResult",
    "DradriverMembership",
    "Fleet",
    "FleetDomain",
    "FleetNode",
    "Membership",
    "NodeAgent",
    "NvidiaMembership",
    "Timing",
    "WriteCounts",
    "count_writes",
    "flip_entries",
    "measure_controller",
    "run_domain",
    "seed_domains",
    "spread",
]

DRIVER_NAMESPACE = "nvidia-dra-driver"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete"})
NODE_AGENT = "bench-node/"
CONTROLLER_AGENT = "bench-controller"
DAEMON_IMAGE = "bench/compute-domain-daemon"  # the DaemonSet the real controller makes; no container runs it


@dataclass(frozen=True, slots=True)
class Timing:
    """The periods of the cluster around the driver, seconds on a real cluster, all times :attr:`scale`.

    :param startup_probe_s: the daemon pod's startup probe period (``compute-domain-daemon check``, 1 s x 1200).
    :param status_period_s: the controller's status loop (2 s).
    :param prepare_backoff_s: NVIDIA's compute-domain plugin's per-claim retry backoff, first and largest (250 ms ->
        3 s, NVIDIA's ``cmd/compute-domain-kubelet-plugin/device_state.go``); dradriver's plugin has its own
        (:meth:`Membership.backoff_s`).
    :param prepare_deadline_s: one NodePrepareResources call's deadline (45 s); the kubelet then calls again.
    :param controller_start_s: how long the controller runs before the domain is created (its start-up:
        sweep, lists, watches), outside the measured time.
    """

    scale: float = 1.0
    startup_probe_s: float = 1.0
    status_period_s: float = 2.0
    prepare_backoff_s: tuple[float, float] = (0.25, 3.0)
    prepare_deadline_s: float = 45.0
    controller_start_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"Timing.scale must be above 0, not {self.scale}")

    def s(self, seconds: float) -> float:
        """``seconds`` of a real cluster in this run."""
        return seconds * self.scale


@dataclass(frozen=True, slots=True)
class FleetNode:
    """One Node: name, rack (1-based), the clique ID of its rack, and the IP its daemon pod gets."""

    name: str
    rack: int
    clique_id: str
    ip: str


def spread(total: int, racks: int) -> list[int]:
    """``total`` nodes over ``racks`` racks as evenly as possible, the larger racks first (256 over 15: one
    of 18 and fourteen of 17).

    :raises ValueError: fewer than one node per rack, or more than 18 (an NVL72 rack's compute trays).
    """
    if racks < 1 or total < racks or total > racks * cd.DEFAULT_MAX_NODES_PER_IMEX_DOMAIN:
        raise ValueError(f"{total} nodes do not fit {racks} racks of 1..{cd.DEFAULT_MAX_NODES_PER_IMEX_DOMAIN}")
    base, extra = divmod(total, racks)
    return [base + (1 if r < extra else 0) for r in range(racks)]


def bench_client(kubeconfig: str, agent: str, *, pool_size: int | None = None) -> KubeClient:
    """The bench's API client (``User-Agent`` ``agent``; 120 s reads; 8 tries, 50 ms -> 1 s backoff), also in the
    controller's process (:class:`ControllerProcess`, with the controller's ``pool_size``)."""
    return open_client(kubeconfig, user_agent=agent, read_timeout_s=120.0, pool_size=pool_size,
                       retry=RetryPolicy(attempts=8, initial_delay_s=0.05, max_delay_s=1.0))


class Fleet:
    """One API emulator holding the fleet's Nodes (context manager: started on enter, stopped on exit).

    :param per_rack: nodes in each rack, e.g. ``spread(256, 15)``.
    :param namespace: the driver namespace (daemon pods and ComputeDomainCliques).
    """

    def __init__(self, per_rack: Sequence[int], *, namespace: str = DRIVER_NAMESPACE) -> None:
        if not per_rack or any(n < 1 or n > cd.DEFAULT_MAX_NODES_PER_IMEX_DOMAIN for n in per_rack):
            raise ValueError(f"per_rack must list racks of 1..{cd.DEFAULT_MAX_NODES_PER_IMEX_DOMAIN} nodes, "
                             f"not {list(per_rack)}")
        self.namespace = namespace
        self.cluster_uuid = str(uuid.uuid4())
        self.api = ApiServerEmulator()
        self.nodes: list[FleetNode] = []
        for rack, count in enumerate(per_rack, start=1):
            for tray in range(count):
                self.nodes.append(FleetNode(f"rack{rack:04d}-node{tray:02d}", rack, f"{self.cluster_uuid}.{rack}",
                                            f"10.{rack // 250}.{rack % 250}.{tray + 1}"))
        self._kubeconfig: str | None = None
        self.directory: Path | None = None

    def plugin_dir(self, node: FleetNode) -> Path:
        """``node``'s ``<kubelet plugins dir>/compute-domain.nvidia.com`` (under the started fleet's directory): its
        domain directories, where its daemon writes the readiness record its plugin reads."""
        if self.directory is None:
            raise RuntimeError("the fleet is not started")
        return self.directory / "nodes" / node.name / "compute-domain.nvidia.com"

    def start(self, directory: Path) -> Fleet:
        """Start the emulator, install the CRDs, seed the namespace and Nodes (in process, not recorded);
        the kubeconfig is written to ``directory``."""
        self.api.start()
        self.api.install_crds()
        self.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace},
                         "status": {"phase": "Active"}})
        for node in self.nodes:
            self.api.add_node(node.name, labels={cd.NODE_CLIQUE_LABEL: node.clique_id, "bench/rack": str(node.rack)})
        self._kubeconfig = self.api.kubeconfig_path(directory)
        self.directory = directory
        return self

    def stop(self) -> None:
        self.api.stop()

    @property
    def kubeconfig(self) -> str:
        """The kubeconfig of the started emulator (:raises RuntimeError: not started)."""
        if self._kubeconfig is None:
            raise RuntimeError("the fleet is not started")
        return self._kubeconfig

    def client(self, agent: str) -> KubeClient:
        """An API client whose requests the records attribute to ``agent`` (the ``User-Agent``)."""
        return bench_client(self.kubeconfig, agent)

    def create_domain(self, name: str, *, namespace: str = "default", num_nodes: int = 0) -> str:
        """Create a ComputeDomain (in process, as a user's ``kubectl apply``) with the controller's finalizer;
        returns its UID."""
        obj = self.api.create({"apiVersion": cd.API_GROUP_VERSION, "kind": "ComputeDomain",
                               "metadata": {"name": name, "namespace": namespace, "finalizers": [cd.FINALIZER]},
                               "spec": {"numNodes": num_nodes,
                                        "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}}})
        return str(obj["metadata"]["uid"])

    def create_daemon_pod(self, cd_uid: str, node: FleetNode, *, settled: bool = False) -> JSONDict:
        """The daemon pod the DaemonSet controller makes on ``node`` for domain ``cd_uid`` (in process), with
        ``status.podIP``; not Ready, or with ``settled`` as a running daemon leaves it: Ready and labelled
        with its clique."""
        labels = {cd.LABEL_COMPUTE_DOMAIN: cd_uid, **({cd.LABEL_CLIQUE_ID: node.clique_id} if settled else {})}
        return self.api.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"cd-daemon-{cd_uid[:8]}-{node.name}", "namespace": self.namespace,
                         "labels": labels},
            "spec": {"nodeName": node.name, "containers": [{"name": "compute-domain-daemon", "image": "bench"}]},
            "status": {"phase": "Running", "podIP": node.ip,
                       "conditions": [{"type": "Ready", "status": "True" if settled else "False"}]}})

    def set_pod_ready(self, name: str, ready: bool) -> None:
        """The kubelet's status update of a daemon pod's Ready condition (in process)."""
        pod = self.api.get("Pod", name, self.namespace)
        if pod is None:
            return
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self.api.update(pod, subresource="status")


class DaemonSide(Protocol):
    """One daemon's side of a membership protocol, stepped by its :class:`NodeAgent`."""

    def step(self, status: str) -> bool:
        """One daemon round with the daemon's current ``status`` (``Ready``/``NotReady``); returns whether its
        own name -> IP mapping is known (then ``nvidia-imex`` could start and turn ready)."""
        ...

    def poll_s(self, timing: Timing) -> float | None:
        """Seconds until the daemon's next round with an unchanged status (``None``: it waits for a change)."""
        ...

    def pending(self) -> bool:
        """Whether an event the daemon watches for (its clique's watch) arrived since its last round: then it
        steps at once."""
        ...

    def close(self) -> None:
        """The node agent is done: end what the daemon runs beside its rounds (its watch)."""
        ...

    def probed(self, ready: bool) -> None:
        """The kubelet ran the daemon pod's probe (``compute-domain-daemon check``) and it answered ``ready``."""
        ...


class Membership(Protocol):
    """A ComputeDomain membership protocol: what each daemon does and what the controller runs beside."""

    label: str

    def daemon(self, client: KubeClient, me: DaemonIdentity, wake: Callable[[], None] | None = None) -> DaemonSide:
        """The daemon side of ``me`` talking through ``client``; ``wake`` wakes its node agent (an event)."""
        ...

    def controller(self, namespace: str, client: KubeClient, timing: Timing, stop: threading.Event) -> None:
        """Run the controller side (driver namespace ``namespace``) until ``stop`` is set; :func:`run_domain`
        runs it in a process of its own (:class:`ControllerProcess`)."""
        ...

    def plugin_ready(self, lookup: DomainLookup, cd_uid: str, clique_id: str) -> bool:
        """The kubelet plugin's readiness rule for this node's daemon (one try of the channel prepare's lookup)."""
        ...

    def backoff_s(self, timing: Timing) -> tuple[float, float]:
        """The kubelet plugin's pause between two tries of a not-ready claim, first and longest (real seconds)."""
        ...

    def ready_hint(self, lookup: DomainLookup, cd_uid: str) -> bool:
        """What the plugin polls during its pause (every :data:`~dradriver.kubeletplugin.runner.HINT_POLL_S`)
        to try again early: whether it now says so (always False for a plugin without one)."""
        ...


@dataclass
class _NvidiaDaemon:
    client: KubeClient
    me: DaemonIdentity
    reported: str = ""
    mine: bool = False

    def step(self, status: str) -> bool:
        if status != self.reported:  # NVIDIA's daemon writes on a status change (informer-driven)
            daemons = cdprotocol.join_clique(self.client, self.me, status)
            self.reported = status
            self.mine = any(d.node_name == self.me.node_name for d in daemons)  # it picked its own index
        return self.mine

    def poll_s(self, timing: Timing) -> float | None:
        return None

    def pending(self) -> bool:
        return False  # its informer's events are the status changes the node agent steps it on

    def close(self) -> None:
        pass

    def probed(self, ready: bool) -> None:
        pass  # NVIDIA's check only answers the kubelet


class NvidiaMembership:
    """NVIDIA's protocol (:mod:`bench.cdprotocol`): read-modify-write of the shared clique with conflict
    retries; the 2 s status loop listing every domain, daemon pod and clique."""

    label = "nvidia"

    def __init__(self) -> None:
        self.rounds = 0

    def daemon(self, client: KubeClient, me: DaemonIdentity, wake: Callable[[], None] | None = None) -> DaemonSide:
        return _NvidiaDaemon(client, me)

    def backoff_s(self, timing: Timing) -> tuple[float, float]:
        """NVIDIA's per-item workqueue backoff (:attr:`Timing.prepare_backoff_s`)."""
        first, longest = timing.prepare_backoff_s
        return timing.s(first), timing.s(longest)

    def ready_hint(self, lookup: DomainLookup, cd_uid: str) -> bool:
        """None: NVIDIA's workqueue waits its backoff out."""
        return False

    def plugin_ready(self, lookup: DomainLookup, cd_uid: str, clique_id: str) -> bool:
        """NVIDIA's plugin: its node's clique entry says ``Ready`` (the daemon writes it itself)."""
        _, entry = lookup.daemon_entry(cd_uid, clique_id)
        return entry is not None and entry.member and entry.status == cd.STATUS_READY

    def controller(self, namespace: str, client: KubeClient, timing: Timing, stop: threading.Event) -> None:
        while not stop.wait(timing.s(timing.status_period_s)):
            try:
                cdprotocol.status_round(client, namespace)
            except kube_errors.KubeAPIError:
                continue  # the next round tries again, as NVIDIA's loop does
            self.rounds += 1


class _DradriverDaemon:
    """The real daemon rounds of :func:`dradriver.computedomain.daemon.run_daemon` without ``nvidia-imex``: the
    first :meth:`~dradriver.computedomain.daemon.Membership.step` is one server-side apply of the own entry (no read);
    from its answer's resourceVersion on, the real :class:`~dradriver.computedomain.daemon.CliqueWatch` follows the
    clique in a thread of its own and wakes the node agent at each event, whose clique the next round acts on (no GET);
    a GET only when the watch's period passes without an event (60 s resync while it is up, the 1 s poll while it
    is down). Once the own mapping is known (the controller's index arrived) the daemon has nothing left to
    write for the join (the controller copies the pod's Ready condition into the entry): the bench steps it no
    more and its watch ends at its next event: its steady-state reads are not part of the join."""

    def __init__(self, membership: Any, watch: Any) -> None:  # cddaemon.Membership, cddaemon.CliqueWatch
        self.membership = membership
        self.watch = watch
        self.known = False
        self._stop = threading.Event()
        self._watching = False
        self._liveness: int | None = None  # run_daemon's liveness lock, held until close()

    def step(self, status: str) -> bool:
        if self.known:  # joined: its entry's status is the controller's (the pod's Ready condition), nothing to send
            return True
        if not self._watching:  # run_daemon's start: configs rendered, the liveness lock, the record "starting"
            self._liveness = imexchannels.hold_daemon_lock(self.membership.settings.imexd_dir)
            cddaemon.record_readiness(self.membership.settings, False, "starting: nvidia-imex not started yet")
        self.membership.step(self.watch.take() if self._watching else cddaemon.READ)
        if not self._watching:  # as run_daemon: the watch starts from the first apply's answer
            self.watch.start(self.membership.resource_version)
            threading.Thread(target=self.watch.run, args=(self._stop,), daemon=True,
                             name=f"clique-watch-{self.membership.settings.node_name}").start()
            self._watching = True
        self.known = self.membership.settings.pod_ip in (self.membership.mapping or {}).values()
        if self.known:
            self._stop.set()
        return self.known

    def poll_s(self, timing: Timing) -> float | None:
        return None if self.known or not self._watching else timing.s(self.watch.period_s())

    def pending(self) -> bool:
        return not self.known and self._watching and bool(self.watch.pending())

    def close(self) -> None:
        """End the watch (at its next event or the end of its request) and drop the liveness lock."""
        self._stop.set()
        liveness, self._liveness = self._liveness, None
        if liveness is not None:
            os.close(liveness)

    def probed(self, ready: bool) -> None:
        """What :func:`dradriver.computedomain.daemon.check` writes besides its answer: the readiness record."""
        cddaemon.record_readiness(self.membership.settings, ready, "READY" if ready else "not ready")


class DradriverMembership:
    """dradriver's own code: the daemon's :class:`dradriver.computedomain.daemon.Membership` (server-side apply of its
    own clique entry) with its :class:`~dradriver.computedomain.daemon.CliqueWatch`, and the real controller
    (:class:`dradriver.computedomain.controller.ComputeDomainController`: watches, event-driven membership passes that
    assign indexes by apply, coalesced status writes)."""

    label = "dradriver"

    def daemon(self, client: KubeClient, me: DaemonIdentity, wake: Callable[[], None] | None = None) -> DaemonSide:
        settings = cddaemon.DaemonSettings(clique_id=me.clique_id, cd_uid=me.cd_uid, node_name=me.node_name,
                                           pod_ip=me.pod_ip, pod_uid=me.pod_uid, pod_name=me.pod_name,
                                           pod_namespace=me.namespace, max_nodes=me.max_nodes,
                                           imexd_dir=me.imexd_dir or Path("/imexd"))
        return _DradriverDaemon(cddaemon.Membership(client, settings),
                                cddaemon.CliqueWatch(client, settings, on_event=wake))

    def backoff_s(self, timing: Timing) -> tuple[float, float]:
        """dradriver's batch runner's pause (:data:`dradriver.kubeletplugin.runner.RETRY_PAUSE_S`)."""
        first, longest = RETRY_PAUSE_S
        return timing.s(first), timing.s(longest)

    def ready_hint(self, lookup: DomainLookup, cd_uid: str) -> bool:
        """dradriver's plugin's hint: the node's daemon's readiness record says ready
        (:meth:`DomainLookup.local_record`)."""
        record = lookup.local_record(cd_uid)
        return record is not None and record.ready

    def plugin_ready(self, lookup: DomainLookup, cd_uid: str, clique_id: str) -> bool:
        """dradriver's plugin: :meth:`DomainLookup.daemon_readiness` (the node's daemon's readiness record when
        current; else the entry's status, or while the controller's copy lags, the daemon pod's own Ready
        condition)."""
        return lookup.daemon_readiness(cd_uid, clique_id).ready

    def controller(self, namespace: str, client: KubeClient, timing: Timing, stop: threading.Event) -> None:
        from dradriver.computedomain.controller import ComputeDomainController
        from dradriver.domain.cdtemplates import ControllerSettings

        ComputeDomainController(client, ControllerSettings(namespace=namespace, image=DAEMON_IMAGE),
                                watch_timeout_s=5.0).run(stop)


MEMBERSHIPS: dict[str, Callable[[], Membership]] = {"nvidia": NvidiaMembership, "dradriver": DradriverMembership}


class ControllerProcess:
    """The controller side of ``membership`` in a process of its own (``python -m bench.controllerprobe
    KUBECONFIG NAMESPACE serve PROTOCOL SCALE``, ``User-Agent bench-controller``), so it does not share the GIL
    with the emulator and the node agents -- on a cluster the controller runs in its own pod. Context manager:
    entered once the process says it runs its controller; on exit it is asked to stop and :attr:`report` holds
    its last line (``cpu_s``, ``rounds``).

    :raises RuntimeError: the process exited or did not answer within ``timeout_s``.
    """

    def __init__(self, fleet: Fleet, membership: Membership, timing: Timing, *, timeout_s: float = 120.0) -> None:
        import os
        import subprocess
        import sys

        if membership.label not in MEMBERSHIPS:
            raise ValueError(f"no controller process for protocol {membership.label!r}")
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        self.timeout_s = timeout_s
        self.report: dict[str, Any] = {}
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads would block a chatty controller
        self._proc = subprocess.Popen([sys.executable, "-m", "bench.controllerprobe", fleet.kubeconfig,
                                       fleet.namespace, "serve", membership.label, repr(timing.scale)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, env=env, cwd=root)

    def _answer(self) -> dict[str, Any]:
        import json

        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=self.timeout_s)
            self._stderr.seek(0)
            raise RuntimeError(f"controller process exited {self._proc.returncode}: {self._stderr.read()[-2000:]}")
        return dict(json.loads(line))

    def __enter__(self) -> ControllerProcess:
        try:
            self._answer()
        except BaseException:
            self._kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write("quit\n")
            self._proc.stdin.flush()
            self.report = self._answer()
            self._proc.wait(timeout=self.timeout_s)
        finally:
            self._kill()

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()


@dataclass
class NodeAgent:
    """One node of a domain: its workload's channel prepare, its IMEX daemon and its kubelet prober (module
    docstring), as a state machine stepped by one thread."""

    fleet: Fleet
    node: FleetNode
    cd_uid: str
    membership: Membership
    timing: Timing
    stop: threading.Event
    client: KubeClient | None = None  # made here when not given (``User-Agent bench-node/<node>``)
    wake: threading.Event = field(default_factory=threading.Event)
    pod: JSONDict | None = None  # the daemon pod, once the node is labelled
    prepared_at: float | None = None
    prepare_calls: int = 1  # NodePrepareResources calls (a call past its 45 s deadline is followed by another)
    prepare_attempts: int = 0
    pod_ready_at: float | None = None
    error: str = ""
    _labelled: bool = False
    _pod_labelled: bool = False
    _imex_ready_at: float | None = None
    _pod_ready: bool = False
    _reported: str = ""
    _side: DaemonSide | None = None
    _next_round: float = 0.0

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = self.fleet.client(NODE_AGENT + self.node.name)

    @property
    def api(self) -> KubeClient:
        assert self.client is not None
        return self.client

    def run(self, started: float) -> None:
        """Step until prepared and the daemon's Ready entry is written, or ``stop``; errors end the agent and
        are kept in :attr:`error`."""
        lookup = DomainLookup(self.api, self.node.name, self.fleet.namespace,
                              plugin_dir=self.fleet.plugin_dir(self.node))
        backoff_first, backoff_max = self.membership.backoff_s(self.timing)
        backoff, call_started, next_prepare = backoff_first, started, started
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if self.prepared_at is None and now >= next_prepare:
                    if self._prepare(lookup):
                        self.prepared_at = time.monotonic()
                    else:
                        if now - call_started > self.timing.s(self.timing.prepare_deadline_s):
                            self.prepare_calls += 1  # the kubelet's next call; the plugin's backoff starts over
                            call_started, backoff = now, backoff_first
                        next_prepare = time.monotonic() + backoff * (1 + 0.1 * random.random())
                        backoff = min(backoff_max, backoff * 2)
                if self.pod is not None:
                    self._daemon()
                if self.prepared_at is not None and self._reported == cd.STATUS_READY:
                    if self._side is not None:
                        self._side.close()
                    return
                if (self.prepared_at is None and self.pod is not None
                        and self.membership.ready_hint(lookup, self.cd_uid)):  # the runner's hint poll
                    next_prepare = min(next_prepare, time.monotonic() + self.timing.s(HINT_POLL_S))
                waits = [next_prepare - time.monotonic()] if self.prepared_at is None else []
                if self._imex_ready_at is not None and not self._pod_ready:
                    waits.append(self._probe_due() - time.monotonic())
                if self._side is not None and self._side.poll_s(self.timing) is not None and (
                        self._imex_ready_at is None or self._reported != cd.STATUS_READY):
                    waits.append(self._next_round - time.monotonic())
                self.wake.wait(max(0.0, min(waits)) if waits else None)
                self.wake.clear()
        except Exception as exc:
            self.error = f"node {self.node.name}: {type(exc).__name__}: {exc}"
        finally:
            self.api.close()

    def _prepare(self, lookup: DomainLookup) -> bool:
        """One try of the channel prepare: label the node once, then the plugin's readiness lookup."""
        self.prepare_attempts += 1
        if not self._labelled:
            current = lookup.node_label()
            if current is None:
                kube_cd.set_node_label(self.api, self.node.name, cd.LABEL_COMPUTE_DOMAIN, self.cd_uid)
            elif current != self.cd_uid:
                raise RuntimeError(f"node {self.node.name} is labelled for ComputeDomain {current}")
            self._labelled = True
            self._daemon_pod()
        return self.membership.plugin_ready(lookup, self.cd_uid, self.node.clique_id)

    def _daemon_pod(self) -> None:
        """The DaemonSet controller's answer to the label just written: the daemon pod on this node (in
        process). Its informer hears the write at once; made here, in the node's own thread, the pods of 256
        nodes are not queued behind one emulated controller thread that the GIL, shared with 256 busy agents,
        schedules rarely (a single such thread took 14 s to make 256 pods, for both protocols alike)."""
        if self.pod is None:
            pod = self.fleet.create_daemon_pod(self.cd_uid, self.node)
            pod["_started"] = time.monotonic()
            imexchannels.ensure_domain_dir(self.fleet.plugin_dir(self.node), self.cd_uid)  # the daemon claim's
            self.pod = pod

    def _identity(self) -> DaemonIdentity:
        assert self.pod is not None
        meta = self.pod["metadata"]
        return DaemonIdentity(cd_uid=self.cd_uid, clique_id=self.node.clique_id, node_name=self.node.name,
                              pod_ip=self.node.ip, pod_name=meta["name"], pod_uid=meta["uid"],
                              namespace=self.fleet.namespace,
                              imexd_dir=imexchannels.domain_dir(self.fleet.plugin_dir(self.node), self.cd_uid))

    def _probe_due(self) -> float:
        """When the startup probe first passes: the first probe tick (every 1 s from the pod's start) at or
        after IMEX became ready."""
        assert self._imex_ready_at is not None and self.pod is not None
        period = self.timing.s(self.timing.startup_probe_s)
        start = float(self.pod["_started"])
        return start + max(1, math.ceil((self._imex_ready_at - start) / period)) * period

    def _daemon(self) -> None:
        me = self._identity()
        if self._side is None:
            self._side = self.membership.daemon(self.api, me, self.wake.set)
        if not self._pod_labelled:
            kube_pods.set_pod_label(self.api, me.namespace, me.pod_name, cd.LABEL_CLIQUE_ID, me.clique_id)
            self._pod_labelled = True
        if self._imex_ready_at is not None and not self._pod_ready and time.monotonic() >= self._probe_due():
            self.fleet.set_pod_ready(me.pod_name, True)  # the kubelet; the daemon's pod informer sees it at once
            self._side.probed(True)  # the passing check's own output (dradriver: the readiness record)
            self._pod_ready = True
            self.pod_ready_at = time.monotonic()
        status = cd.STATUS_READY if self._pod_ready else cd.STATUS_NOT_READY
        poll = self._side.poll_s(self.timing)
        if poll is None:  # informer-driven: a status change is written at once
            due = status != self._reported
        else:  # polling (the pod's Ready condition and the clique are read each round): the next round's tick
            due = time.monotonic() >= self._next_round and (status != self._reported or self._imex_ready_at is None)
        due = due or self._side.pending()  # a watch event: acted on at once
        if not due:
            return
        known = self._side.step(status)
        self._reported = status
        if poll is not None:
            self._next_round = time.monotonic() + poll
        if self._imex_ready_at is None and known:
            self._imex_ready_at = time.monotonic()  # IMEX starts with its own name -> IP mapping written


@dataclass(frozen=True, slots=True)
class WriteCounts:
    """Requests of one group of clients, from the emulator's records."""

    membership_writes: int  # ComputeDomainCliques and ComputeDomains (and their status)
    label_writes: int  # Nodes and Pods
    reads: int
    conflicts: int  # answers 409


def count_writes(records: Iterable[RequestRecord], agent_prefix: str) -> dict[str, WriteCounts]:
    """Per client whose ``User-Agent`` starts with ``agent_prefix`` (the rest of it is the key)."""
    membership: Counter[str] = Counter()
    labels: Counter[str] = Counter()
    reads: Counter[str] = Counter()
    conflicts: Counter[str] = Counter()
    agents: set[str] = set()
    for r in records:
        if not r.user_agent.startswith(agent_prefix):
            continue
        who = r.user_agent[len(agent_prefix):]
        agents.add(who)
        if r.code == 409:
            conflicts[who] += 1
        if r.verb in WRITE_VERBS:
            if r.resource in (cd.CLIQUE_PLURAL, cd.COMPUTE_DOMAIN_PLURAL):
                membership[who] += 1
            else:
                labels[who] += 1
        else:
            reads[who] += 1
    return {a: WriteCounts(membership[a], labels[a], reads[a], conflicts[a]) for a in sorted(agents)}


@dataclass(frozen=True, slots=True)
class DomainResult:
    """One domain's run from creation to every workload pod's channel prepared.

    :param seconds: wall time from the domain's creation to the last prepare's success.
    :param per_node: writes and 409s of each node's clients.
    :param controller: the controller client's counts.
    :param stages: the slowest node's seconds from the domain's creation to each step (``daemon pod``,
        ``own mapping``, ``pod Ready``, ``prepared``): where the time goes; and ``entries Ready``: when every
        clique entry said ``Ready`` (the domain settled; not part of :attr:`seconds`).
    """

    protocol: str
    nodes: int
    seconds: float
    per_node: dict[str, WriteCounts]
    controller: WriteCounts
    prepare_calls: int
    prepare_attempts: int
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def max_writes_per_node(self) -> int:
        return max((c.membership_writes + c.label_writes for c in self.per_node.values()), default=0)

    @property
    def mean_writes_per_node(self) -> float:
        return sum(c.membership_writes + c.label_writes for c in self.per_node.values()) / max(1, self.nodes)

    @property
    def mean_membership_writes(self) -> float:
        return sum(c.membership_writes for c in self.per_node.values()) / max(1, self.nodes)

    @property
    def mean_label_writes(self) -> float:
        return sum(c.label_writes for c in self.per_node.values()) / max(1, self.nodes)

    @property
    def conflicts(self) -> int:
        return sum(c.conflicts for c in self.per_node.values()) + self.controller.conflicts


def run_domain(fleet: Fleet, membership: Membership, timing: Timing, *, name: str = "bench-cd",
               timeout_s: float = 600.0, say: Callable[[str], None] = lambda _: None) -> DomainResult:
    """Create one ComputeDomain over every node of ``fleet`` and run until each node's channel prepare
    succeeded.

    :raises RuntimeError: a node agent failed, or ``timeout_s`` passed first (the message names the nodes).
    """
    fleet.api.clear_requests()
    stop = threading.Event()
    clients = {n.name: fleet.client(NODE_AGENT + n.name) for n in fleet.nodes}  # made before the clock starts
    for client in clients.values():  # and their API classes (imported at first use: 256 threads behind one lock)
        _ = client.core, client.custom
    with ControllerProcess(fleet, membership, timing):  # runs before the domain exists, as on a cluster
        stop.wait(timing.s(timing.controller_start_s))
        agents, started, finished = _run_agents(fleet, membership, timing, stop, clients, name, timeout_s)
        settled = _entries_ready(fleet, started + timeout_s) if not math.isinf(finished) else math.inf
    errors = [a.error for a in agents.values() if a.error]
    if errors:
        raise RuntimeError(f"{len(errors)} node agents failed; first: {errors[0]}")
    if math.isinf(finished):
        waiting = sorted(n for n, a in agents.items() if a.prepared_at is None)
        raise RuntimeError(f"{len(waiting)} nodes not prepared after {timeout_s} s: {', '.join(waiting[:5])}")
    records = fleet.api.requests
    per_node = count_writes(records, NODE_AGENT)
    controller_counts = count_writes(records, CONTROLLER_AGENT).get("", WriteCounts(0, 0, 0, 0))
    result = DomainResult(membership.label, len(agents), finished - started, per_node, controller_counts,
                          sum(a.prepare_calls for a in agents.values()),
                          sum(a.prepare_attempts for a in agents.values()),
                          _stages(started, agents.values()))
    if not math.isinf(settled):
        result.stages["entries Ready"] = round(settled - started, 3)
    say(f"{membership.label}: {result.nodes} nodes prepared in {result.seconds:.2f} s, "
        f"{result.mean_writes_per_node:.2f} writes/node (max {result.max_writes_per_node}), "
        f"{result.conflicts} conflicts; slowest node at {result.stages}")
    return result


def _run_agents(fleet: Fleet, membership: Membership, timing: Timing, stop: threading.Event,
                clients: dict[str, KubeClient], name: str, timeout_s: float) -> tuple[dict[str, NodeAgent], float,
                                                                                       float]:
    """Create the domain and run a node agent per node until each is prepared (or ``timeout_s``); returns the
    agents, when the domain was created and when the last node was prepared (inf: not all were)."""
    started = time.monotonic()
    cd_uid = fleet.create_domain(name, num_nodes=len(fleet.nodes))
    agents = {n.name: NodeAgent(fleet, n, cd_uid, membership, timing, stop, clients[n.name]) for n in fleet.nodes}
    threads = [threading.Thread(target=a.run, args=(started,), name=f"agent-{a.node.name}", daemon=True)
               for a in agents.values()]
    for t in threads:
        t.start()
    deadline = started + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    finished = max((a.prepared_at or math.inf) for a in agents.values())
    stop.set()
    for a in agents.values():
        a.wake.set()
        if a._side is not None:
            a._side.close()
    return agents, started, finished


def _entries_ready(fleet: Fleet, deadline: float) -> float:
    """When every daemon entry of the fleet's cliques says ``Ready`` (``time.monotonic()``; inf: not by
    ``deadline``). A dradriver node may be prepared before the controller copies its pod's Ready into its entry
    (the plugin reads the pod itself), so the run waits for the domain to settle, outside the measured time."""
    while time.monotonic() < deadline:
        cliques = fleet.api.objects("ComputeDomainClique", fleet.namespace)
        if cliques and all(d.get("status") == cd.STATUS_READY for c in cliques for d in c.get("daemons") or ()):
            return time.monotonic()
        time.sleep(0.05)
    return math.inf


def _stages(started: float, agents: Iterable[NodeAgent]) -> dict[str, float]:
    agents = list(agents)
    at = {"daemon pod": [float(a.pod["_started"]) if a.pod is not None else None for a in agents],
          "own mapping": [a._imex_ready_at for a in agents], "pod Ready": [a.pod_ready_at for a in agents],
          "prepared": [a.prepared_at for a in agents]}
    return {stage: round(max(t for t in times if t is not None) - started, 3) for stage, times in at.items()
            if any(t is not None for t in times)}


# -- the fleet scenario: the controller's cost per membership event ------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetDomain:
    """A seeded domain: UID, name, and its cliques (name -> the clique's nodes)."""

    uid: str
    name: str
    cliques: dict[str, list[FleetNode]]


def seed_domains(fleet: Fleet, racks_per_domain: int = 2) -> list[FleetDomain]:
    """Every ``racks_per_domain`` consecutive racks form one settled domain (in process, not recorded): the
    ComputeDomain with the finalizer, a Ready daemon pod per node (labelled with the domain and the clique) and
    one ComputeDomainClique per rack listing every daemon Ready with indexes 0..n-1."""
    by_rack: dict[int, list[FleetNode]] = {}
    for node in fleet.nodes:
        by_rack.setdefault(node.rack, []).append(node)
    racks = sorted(by_rack)
    domains = []
    for first in range(0, len(racks), racks_per_domain):
        name = f"fleet-cd-{first // racks_per_domain:04d}"
        uid = fleet.create_domain(name)
        cliques: dict[str, list[FleetNode]] = {}
        for rack in racks[first:first + racks_per_domain]:
            members = by_rack[rack]
            for node in members:
                fleet.create_daemon_pod(uid, node, settled=True)
            clique = cd.clique_object_name(uid, members[0].clique_id)
            fleet.api.create({"apiVersion": cd.API_GROUP_VERSION, "kind": cd.CLIQUE_KIND,
                              "metadata": {"name": clique, "namespace": fleet.namespace,
                                           "labels": {cd.LABEL_COMPUTE_DOMAIN: uid,
                                                      cd.LABEL_CLIQUE_ID: members[0].clique_id}},
                              "daemons": [CliqueDaemon(n.name, n.ip, n.clique_id, i, cd.STATUS_READY)
                                          .to_clique_entry() for i, n in enumerate(members)]})
            cliques[clique] = members
        domains.append(FleetDomain(uid, name, cliques))
    return domains


def flip_entries(fleet: Fleet, domains: Sequence[FleetDomain], count: int, rng: random.Random) -> tuple[int, int]:
    """``count`` membership events: daemons of random domains turn their entry NotReady (or Ready again), as
    the daemon's own write would (in process, not recorded); returns the resourceVersions just before the first
    and of the last event (a watch from the first sees them all)."""
    first = last = 0
    for i in range(count):
        domain = rng.choice(domains)
        clique_name = rng.choice(sorted(domain.cliques))
        clique = fleet.api.get("ComputeDomainClique", clique_name, fleet.namespace)
        assert clique is not None
        entry = rng.choice(clique["daemons"])
        entry["status"] = cd.STATUS_NOT_READY if entry["status"] == cd.STATUS_READY else cd.STATUS_READY
        last = int(fleet.api.update(clique)["metadata"]["resourceVersion"])
        if i == 0:
            first = last - 1
    return first, last


@dataclass(frozen=True, slots=True)
class ControllerCost:
    """The controller's cost over ``rounds`` rounds of ``events_per_round`` membership events each.

    :param cpu_per_event_s: the controller process's CPU (user + system) per event, seconds.
    :param emulator_cpu_per_event_s: the API emulator's CPU over the same windows, per event, seconds.
    :param memory_kib: the controller's RSS after the rounds minus its RSS after the imports, KiB.
    :param peak_kib: its peak RSS (``VmHWM``) minus its RSS after the imports, KiB.
    :param writes: the controller's writes in the measured rounds (from the emulator's records).
    """

    mode: str
    racks: int
    nodes: int
    domains: int
    events: int
    cpu_per_event_s: float
    emulator_cpu_per_event_s: float
    memory_kib: int
    peak_kib: int
    writes: int


def measure_controller(fleet: Fleet, domains: Sequence[FleetDomain], mode: str, *, events_per_round: int = 36,
                       rounds: int = 3, seed: int = 14, timeout_s: float = 900.0) -> ControllerCost:
    """Run the controller probe (:mod:`bench.controllerprobe`, ``mode`` ``nvidia`` or ``dradriver``) against
    the fleet: a warm-up round, then ``rounds`` times ``events_per_round`` events followed by one round.

    :raises RuntimeError: the probe failed or did not answer (its stderr in the message).
    """
    import json
    import os
    import subprocess
    import sys

    if fleet._kubeconfig is None:
        raise RuntimeError("the fleet is not started")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "bench.controllerprobe", fleet._kubeconfig, fleet.namespace, mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=root)
    assert proc.stdin is not None and proc.stdout is not None

    def answer() -> dict[str, float]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=timeout_s)
            assert proc.stderr is not None
            raise RuntimeError(f"controller probe {mode} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        return dict(json.loads(line))

    rng = random.Random(seed)
    try:
        ready = answer()
        cpu = emulator = 0.0
        writes = 0
        last: dict[str, float] = {}
        for _ in range(rounds):
            since, until = flip_entries(fleet, domains, events_per_round, rng)
            fleet.api.clear_requests()
            before = time.process_time()
            proc.stdin.write(f"go {since} {until}\n")
            proc.stdin.flush()
            last = answer()
            emulator += time.process_time() - before
            cpu += last["cpu_s"]
            counts = count_writes(fleet.api.requests, CONTROLLER_AGENT).get("", WriteCounts(0, 0, 0, 0))
            writes += counts.membership_writes + counts.label_writes
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = events_per_round * rounds
    return ControllerCost(mode, len({n.rack for n in fleet.nodes}), len(fleet.nodes), len(domains), events,
                          cpu / events, emulator / events, int(last["rss_kib"] - ready["imports_kib"]),
                          int(last["hwm_kib"] - ready["imports_kib"]), writes)
