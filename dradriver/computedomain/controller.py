"""The compute-domain controller: reconciles ``ComputeDomain`` objects (NVIDIA's
``cmd/compute-domain-controller/`` in kubernetes-sigs/dra-driver-nvidia-gpu).

Machinery (``docs/user-guide/compute-domains.md``, "Controller"): a watch on ComputeDomains of every namespace
feeds a work queue of ``namespace/name`` keys (a key is queued once however many events arrive; a failed key is
retried with exponential backoff 5 ms .. 60 s); a full list re-queues every domain every ``resync_s`` (10 min); one
worker reconciles keys one at a time. Reconcile is level-triggered -- it reads the domain and the objects it should
have and makes what is missing -- so it is idempotent and a new leader finishes whatever a killed one left half
done. Watches on the controller's own DaemonSets (driver namespace and ``--additional-namespaces``) and
ResourceClaimTemplates (every namespace), selected by the label ``resource.nvidia.com/computeDomain``, queue the
owning domain when one of them is deleted or starts being deleted, so a deleted DaemonSet or template is recreated
at once rather than at the 10-min re-list (an object held by the controller's finalizer while its domain lives is
released first); a DaemonSet whose ``status.numberReady`` changed has its domain's status recomputed at once
(NVIDIA's handler sets ``Ready`` when ``numberReady == numNodes``, 7.3; here ``status.status`` always agrees with
``status.nodes``). Besides the queue: membership (below), the slow resync (``status_period_s``, 60 s) and the
stale sweep (at start and every 10 min).

Driver-managed reconcile: finalizer ``resource.nvidia.com/computeDomain`` on the domain; the daemon
ResourceClaimTemplate and DaemonSet ``computedomain-daemon-<cdUID>`` in the driver namespace; the workload
ResourceClaimTemplate in the domain's namespace; the global status. Deletion, in NVIDIA's order: the workload
template, the DaemonSets and daemon templates (found by the domain's label in every namespace), the domain's node
labels, the finalizers of the templates and the DaemonSets, a check that they are gone (else retry); then
(dradriver) a wait until no daemon pod of the domain is left in any namespace -- the garbage collector deletes a
DaemonSet's pods after it, and each lasts until its kubelet has stopped its containers; a pod being deleted on a
node that stopped answering is not waited for -- and the domain's ComputeDomainCliques (which NVIDIA leaves to the
garbage collector through the daemon pods' owner references; deleted after the pods, so a daemon still stopping
cannot write one back); then the domain's finalizer. NVIDIA releases the finalizer as soon as the DaemonSet is
gone, while its IMEX daemons may still run. Host-managed IMEX mode: finalizer, workload template and status
``Ready`` only.

Pre-warmed IMEX mode (``--imex-mode preWarmed``, dradriver's; :meth:`ComputeDomainController.ensure_clique_daemons`,
at start, every node check and when one of them is deleted): for every value of the Node label ``nvidia.com/gpu.clique``
one IMEX domain, served by a daemon ResourceClaimTemplate and a DaemonSet ``computedomain-daemon-<clique domain ID>``
(:func:`~dradriver.domain.cdtemplates.clique_daemon_set`) on that clique's nodes, made before any ComputeDomain
exists; a clique no node carries any more has its objects and ComputeDomainClique deleted. Membership of the
clique daemons is the driver-managed code path, keyed by the clique domain's ID. A ComputeDomain gets only its
finalizer, its channel (channel isolation's allocator) and its workload template; its ``status.nodes`` lists the
nodes its allocated channel claims are on, each with the clique daemon's entry there and the condition
``CliqueDaemonReady`` (reasons ``CliqueDaemonReady``, ``CliqueDaemonNotReady``, ``NodeNotAnswering``), and
``status.status`` is ``NotReady`` while any of them is not; each change of a node's condition is an Event on the
domain (Warning with the reason, Normal ``CliqueDaemonReady`` on recovery). The domains' status is recomputed at
every membership pass of a clique domain and at the status resync.

One install per cluster: DaemonSets, daemon templates and cliques of a live domain in a namespace that is neither
the driver namespace nor an ``--additional-namespaces`` one were left by an install in another namespace (a
reinstall into a new namespace); the stale sweep (which runs before the first reconcile) deletes them, so exactly one
DaemonSet -- the driver namespace's -- serves each domain and the old namespace holds nothing of ours (NVIDIA leaves
them, and each domain gets a second DaemonSet). With ``--additional-namespaces`` naming the old namespace its
DaemonSets are kept and used instead (NVIDIA's behaviour). These cluster-wide lists need RBAC to list DaemonSets,
pods and cliques in every namespace; where only the driver and additional namespaces are allowed (NVIDIA's Helm
chart) the controller searches those, with a warning.

Membership (issue 14; ``docs/design/compute-domain-membership.md``): watches on the cliques and the daemon
pods of the driver namespace mark the owning domain; a worker runs one pass per burst of marks
(:meth:`ComputeDomainController.reconcile_membership`, ``coalesce_s``). Per clique a pass sends at most one JSON
patch (:func:`membership_operations`: remove the items of nodes without a daemon pod in that clique -- by the pod
label ``resource.nvidia.com/computeDomain.cliqueID``, so a node moved to another clique leaves the old one; clear
the daemon-owned fields of nodes that stopped answering -- Lease in ``kube-node-lease`` older than
``node_grace_s`` or Node ``Ready`` False/Unknown -- keeping their ``index``) and at most one server-side apply under
:data:`CONTROLLER_FIELD_MANAGER` of ``{nodeName, index, status}`` for every item
(:func:`~dradriver.domain.imex.assign_indexes`: lowest free, never moved; :func:`entry_statuses`: a member's
``status`` mirrors its daemon pod's Ready condition, so a daemon writes its entry once per pod), then the domain's
status is written if it changed (a merge patch without ``resourceVersion``: the controller is its only writer).
A node check every ``node_check_s`` marks the domains with a member on a node that stopped answering. Nothing
is read-modify-written: the patch is guarded by ``test`` operations, the apply cannot conflict.

Status: per domain, the daemon pods (label ``resource.nvidia.com/computeDomain=<uid>`` in the driver
namespace) and ComputeDomainCliques; clique entries whose node runs no daemon pod of the domain are pruned;
``status.nodes`` = the cliques' members (items with an ``ipAddress``) + the daemon pods on nodes in no clique (pod label
``resource.nvidia.com/computeDomain.cliqueID`` explicitly empty: index -1, status from the pod's Ready
condition); with the gate ComputeDomainCliques off the daemons write ``status.nodes`` themselves and the loop
keeps the entries whose IP is still a daemon pod's. ``status.status`` = :func:`~dradriver.domain.computedomains.
global_status`. Written only when it changed.

Stale sweep: DaemonSets, ResourceClaimTemplates, node labels and cliques (in every namespace) labelled with a domain
UID no ComputeDomain has any more are deleted (finalizers removed) or unlabelled, and so are a live domain's objects
left by an install in another namespace (above). The objects are listed before the domains, so an object made for a
domain created during the sweep is never taken for stale.
"""

from __future__ import annotations

import functools
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dradriver.domain.cdtemplates import (
    ANNOTATION_TEMPLATE_HASH,
    ControllerSettings,
    clique_daemon_set,
    clique_domain,
    daemon_claim_template,
    daemon_set,
    owner_of,
    workload_claim_template,
)
from dradriver.domain.computedomains import (
    ANNOTATION_IMEX_CHANNEL,
    CLIQUE_DAEMON_CONDITION,
    COMPUTE_DOMAIN_KIND,
    FINALIZER,
    LABEL_CLIQUE_ID,
    LABEL_COMPUTE_DOMAIN,
    NODE_CLIQUE_LABEL,
    REASON_CLIQUE_DAEMON_NOT_READY,
    REASON_CLIQUE_DAEMON_READY,
    REASON_NODE_LOST,
    STATUS_NOT_READY,
    STATUS_READY,
    CliqueDaemon,
    ComputeDomain,
    ComputeDomainError,
    DaemonCondition,
    choose_channel,
    clique_domain_uid,
    clique_member_nodes,
    clique_object_name,
    clique_of,
    daemon_object_name,
    domain_channel,
    global_status,
    pod_ready,
    ready_daemons,
    unresponsive_nodes,
)
from dradriver.domain.featuregates import COMPUTE_DOMAIN_CLIQUES
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER
from dradriver.domain.imex import assign_indexes
from dradriver.kube import cdobjects, errors, events
from dradriver.kube import computedomains as kcd
from dradriver.kube.cdobjects import DAEMON_SETS, PODS, RESOURCE_CLAIM_TEMPLATES, RESOURCE_CLAIMS
from dradriver.kube.client import JSONDict, KubeClient
from dradriver.kube.deployments import list_pods

__all__ = ["CLIENT_POOL_SIZE", "CLIQUE_WRITERS", "CONTROLLER_FIELD_MANAGER",
           "ComputeDomainController", "ReconcileRetry", "WorkQueue",
           "entry_statuses", "membership_operations", "node_entries"]

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)

CONTROLLER_FIELD_MANAGER = "compute-domain-controller"
"""The controller's server-side-apply field manager: it owns the ``index`` of every clique item."""

CLIQUE_WRITERS = 8
"""How many cliques of one domain a membership pass writes at once (and the pass's lists run on the same threads).
Each clique is its own object with its own writes, so a pass over a 15-rack domain need not wait for 15 round trips
in a row: on a loaded API server (the 256-node join of ``compute_domain_256``, issue 14) one apply waited
0.4-0.9 s, and a pass that wrote one clique after another took 6 s, four at a time 3 s. Four and sixteen writers
gave the same end-to-end time within noise (8.35 vs 8.25 s; the emulator's CPU, not the writers, was the limit), so
eight leaves headroom for a real API server without many idle threads."""
CLIENT_POOL_SIZE = CLIQUE_WRITERS + 10
"""The controller client's connections (:func:`~dradriver.kube.client.open_client` ``pool_size``): the writers,
the watches (domains, templates, DaemonSets per namespace, cliques, pods) and the loops beside them."""


class ReconcileRetry(Exception):
    """The domain cannot be finished now (an object is still going away, a name is taken); retry with backoff."""


class WorkQueue:
    """Keys to reconcile: each queued once, never handed to two workers at once, delayed re-adds for backoff.

    :param clock: monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self._ready: list[Key] = []
        self._queued: set[Key] = set()
        self._processing: set[Key] = set()
        self._dirty: set[Key] = set()
        self._delayed: list[tuple[float, int, Key]] = []
        self._seq = 0
        self._failures: dict[Key, int] = {}

    def add(self, key: Key, delay_s: float = 0.0) -> None:
        """Queue ``key`` (after ``delay_s``); a key being processed is queued again when it is done."""
        with self._cond:
            if delay_s > 0:
                self._seq += 1
                heapq.heappush(self._delayed, (self._clock() + delay_s, self._seq, key))
            elif key in self._processing:
                self._dirty.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
            self._cond.notify_all()

    def retry(self, key: Key) -> float:
        """Queue ``key`` again after its backoff (5 ms doubling per failure, at most 60 s); returns the delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(60.0, 0.005 * 2 ** failures)
        self.add(key, delay)
        return delay

    def forget(self, key: Key) -> None:
        """``key`` succeeded: its backoff starts over."""
        with self._cond:
            self._failures.pop(key, None)

    def get(self, stop: threading.Event, poll_s: float = 0.5) -> Key | None:
        """The next key (marked processing until :meth:`done`), or None once ``stop`` is set."""
        with self._cond:
            while not stop.is_set():
                now = self._clock()
                while self._delayed and self._delayed[0][0] <= now:
                    _, _, key = heapq.heappop(self._delayed)
                    if key in self._processing:
                        self._dirty.add(key)
                    elif key not in self._queued:
                        self._queued.add(key)
                        self._ready.append(key)
                if self._ready:
                    key = self._ready.pop(0)
                    self._queued.discard(key)
                    self._processing.add(key)
                    return key
                wait = poll_s if not self._delayed else max(0.0, min(poll_s, self._delayed[0][0] - now))
                self._cond.wait(wait)
            return None

    def done(self, key: Key) -> None:
        """Processing of ``key`` ended; it is queued again if it was added meanwhile."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._dirty.discard(key)
                if key not in self._queued:
                    self._queued.add(key)
                    self._ready.append(key)
                self._cond.notify_all()

    def wake(self) -> None:
        """Wake waiting workers (e.g. to notice a stop)."""
        with self._cond:
            self._cond.notify_all()


def node_entries(cd: ComputeDomain, pods: Iterable[Mapping[str, Any]], cliques: Iterable[Mapping[str, Any]],
                 *, cliques_gate: bool) -> list[CliqueDaemon]:
    """``status.nodes`` of ``cd`` from its daemon pods and (pruned) clique objects (module docstring), sorted by
    node name."""
    pods = list(pods)
    entries: dict[str, CliqueDaemon] = {}
    if cliques_gate:
        for clique in cliques:
            for raw in clique.get("daemons") or ():
                daemon = CliqueDaemon.from_entry(raw)
                if daemon.member:  # an index reservation of a departed or failed node is no member
                    entries[daemon.node_name] = daemon
    else:
        ips = {str((p.get("status") or {}).get("podIP") or "") for p in pods} - {""}
        for node in cd.nodes:
            if node.clique_id and node.ip_address in ips:
                entries[node.node_name] = node
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if LABEL_CLIQUE_ID in labels and labels[LABEL_CLIQUE_ID] == "":
            node_name = str((pod.get("spec") or {}).get("nodeName") or "")
            if node_name:
                ip = str((pod.get("status") or {}).get("podIP") or "")
                entries[node_name] = CliqueDaemon(node_name=node_name, ip_address=ip, clique_id="", index=-1,
                                                  status=STATUS_READY if pod_ready(pod) else STATUS_NOT_READY)
    return [entries[name] for name in sorted(entries)]


def entry_statuses(items: Iterable[CliqueDaemon], pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """The ``status`` of each member entry (one with an ``ipAddress``), by node name: ``Ready`` iff the
    domain's daemon pod on that node with that IP is Ready and not being deleted, else ``NotReady``.

    The controller writes it, not the daemon: a daemon pod's Ready condition is its IMEX daemon's readiness (the
    startup and readiness probes run ``compute-domain-daemon check``), which NVIDIA's daemon copies into its own
    entry from its pod informer (one more write per daemon and flip, ``cmd/compute-domain-controller/``); the
    controller sees the same condition through its pod watch and batches it with the indexes, one apply per
    clique. A reservation (no ``ipAddress``: a departed or failed node) gets no status."""
    ready = ready_daemons(pods)
    return {d.node_name: STATUS_READY if (d.node_name, d.ip_address) in ready else STATUS_NOT_READY
            for d in items if d.member}


def membership_operations(clique: Mapping[str, Any], *, keep_nodes: set[str],
                          failed_nodes: set[str]) -> list[dict[str, Any]]:
    """The RFC 6902 operations that bring a clique's ``daemons`` in line with the nodes: an item whose node runs
    no daemon pod of the domain in this clique (not in ``keep_nodes``) is removed, reservation and all; an item on
    a node that stopped answering (in ``failed_nodes``) loses its daemon-owned fields (``ipAddress``, ``cliqueID``,
    ``status``) and keeps ``nodeName`` and ``index``, so peers drop it from their mapping and the node gets the
    same index and DNS name when its daemon re-applies. Each touched item is guarded by a ``test`` of its
    ``nodeName`` (a list changed meanwhile fails the patch instead of touching another item); removals come
    last, from the highest position down. ``[]``: nothing to do."""
    ops: list[dict[str, Any]] = []
    removals: list[int] = []
    for position, item in enumerate(clique.get("daemons") or ()):
        node = str(item.get("nodeName") or "")
        path = f"/daemons/{position}"
        if node not in keep_nodes:
            removals.append(position)
        elif node in failed_nodes and item.get("ipAddress"):
            ops.append({"op": "test", "path": f"{path}/nodeName", "value": node})
            ops += [{"op": "remove", "path": f"{path}/{key}"} for key in ("ipAddress", "cliqueID", "status")
                    if key in item]
    for position in sorted(removals, reverse=True):
        node = str((clique.get("daemons") or [])[position].get("nodeName") or "")
        ops += [{"op": "test", "path": f"/daemons/{position}/nodeName", "value": node},
                {"op": "remove", "path": f"/daemons/{position}"}]
    return ops


MEMBERSHIP_BATCH = 16
"""ComputeDomains whose pods and cliques one membership pass lists together (one LIST each per batch): the
most a pass holds at once, whatever the fleet's size (a label selector ``in`` set of 16 UIDs is ~600 bytes)."""


def _uid_selector(uid: str) -> str:
    return f"{LABEL_COMPUTE_DOMAIN}={uid}"


@dataclass
class ComputeDomainController:
    """Reconciles ComputeDomains while :meth:`run` runs (only on the leader when leader election is on).

    :param settings: the controller's flags that shape the objects (:class:`~dradriver.domain.cdtemplates.
        ControllerSettings`).
    :param additional_namespaces: more namespaces whose DaemonSets and daemon templates are the controller's
        (``--additional-namespaces``: used and swept there, never retired as another install's; created only in
        the driver namespace).
    :param resync_s: full re-list period (seconds; NVIDIA's informer resync, 10 min).
    :param status_period_s: full membership and status resync period (seconds; default 60; NVIDIA polls every
        2 s): between two, membership is event-driven (clique and daemon pod watches).
    :param node_grace_s: a node whose Lease was not renewed for this long (or whose Ready condition is
        False/Unknown) has its daemon's fields cleared from its clique (seconds; default 40, the
        kube-controller-manager's ``--node-monitor-grace-period`` before 1.32).
    :param node_check_s: period of the node check (seconds; default ``node_grace_s / 4``).
    :param coalesce_s: how long a burst of clique and pod events is gathered before one membership pass.
    :param cleanup_period_s: stale sweep period (seconds; NVIDIA's 10 min).
    :param watch_timeout_s: ``timeoutSeconds`` of each watch request.
    """

    client: KubeClient
    settings: ControllerSettings
    additional_namespaces: tuple[str, ...] = ()
    resync_s: float = 600.0
    status_period_s: float = 60.0
    cleanup_period_s: float = 600.0
    watch_timeout_s: float = 300.0
    node_grace_s: float = 40.0
    node_check_s: float = 0.0
    coalesce_s: float = 0.05
    clock: Callable[[], float] = time.time
    index_applies: int = 0
    clique_patches: int = 0
    status_writes: int = 0
    queue: WorkQueue = field(default_factory=WorkQueue)
    reconciled: int = 0
    _done: dict[str, int] = field(default_factory=dict)  # CD uid -> metadata.generation last reconciled
    _keys: dict[str, Key] = field(default_factory=dict)  # CD uid -> (namespace, name), from the CD watch
    _ds_ready: dict[str, int] = field(default_factory=dict)  # CD uid -> its DaemonSet's last numberReady seen
    _dirty: set[str] = field(default_factory=set)  # CD uids whose membership changed since the last pass
    _deleting: dict[str, Key] = field(default_factory=dict)  # CD uid -> key: being deleted, waiting for its pods
    _narrowed: set[str] = field(default_factory=set)  # kinds RBAC lets this controller list only per namespace
    _dirty_cond: threading.Condition = field(default_factory=threading.Condition)
    _failed: tuple[float, frozenset[str]] = (float("-inf"), frozenset())  # (checked at, unresponsive nodes)
    _channel_lock: threading.Lock = field(default_factory=threading.Lock)  # one channel assignment at a time
    # one membership pass at a time (lists included): the reconcile's sync_status and the membership worker
    # would otherwise assign indexes from two snapshots, the later apply moving the earlier one's indexes
    _pass_lock: threading.RLock = field(default_factory=threading.RLock)
    _count_lock: threading.Lock = field(default_factory=threading.Lock)  # the write counters, from the writers
    _writers: ThreadPoolExecutor | None = None  # CLIQUE_WRITERS threads (a pass's lists and writes), made at first use
    _clique_domains: dict[str, str] = field(default_factory=dict)  # pre-warmed: clique domain ID -> clique ID
    _clique_lock: threading.Lock = field(default_factory=threading.Lock)  # one ensure_clique_daemons at a time
    _pass_reads: dict[str, Any] | None = None  # pre-warmed: lists shared by the domains of one membership pass

    @property
    def cliques_gate(self) -> bool:
        """ComputeDomainCliques: on unless turned off, and always off in host-managed mode (NVIDIA 1.3)."""
        return not self.settings.host_managed and bool(self.settings.feature_gates[COMPUTE_DOMAIN_CLIQUES])

    # -- the loops --------------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Sweep, then watch, reconcile, sync status and sweep until ``stop`` is set."""
        log.info("compute-domain controller starts (driver namespace %s, IMEX mode %s)", self.settings.namespace,
                 self.settings.imex_mode)
        if self.settings.pre_warmed:
            self._guarded("clique daemons", self.ensure_clique_daemons)  # before the sweep: their IDs are live
        self._guarded("stale sweep", self.sweep)
        owned: list[tuple[cdobjects.ObjectKind, str]] = [(RESOURCE_CLAIM_TEMPLATES, "")]
        if not self.settings.host_managed:
            owned += [(DAEMON_SETS, ns) for ns in (self.settings.namespace, *self.additional_namespaces)]
        watches = [threading.Thread(target=self._watch_loop, args=(stop,), name="cd-watch", daemon=True),
                   *(threading.Thread(target=self._owned_watch_loop, args=(stop, kind, ns), daemon=True,
                                      name=f"cd-watch-{kind.plural}-{ns or 'all'}") for kind, ns in owned)]
        if self.cliques_gate:
            watches += [threading.Thread(target=self._membership_watch_loop, args=(stop, "cliques"), daemon=True,
                                         name="cd-watch-cliques"),
                        threading.Thread(target=self._membership_watch_loop, args=(stop, "pods"), daemon=True,
                                         name="cd-watch-pods")]
        loops = [threading.Thread(target=self._every, args=(stop, self.status_period_s, "status sync",
                                                              self.sync_all_status), name="cd-status", daemon=True),
                 threading.Thread(target=self._membership_worker, args=(stop,), name="cd-membership", daemon=True),
                 threading.Thread(target=self._every, args=(stop, self._node_check_period(), "node check",
                                                            self.check_nodes), name="cd-nodes", daemon=True),
                   threading.Thread(target=self._every, args=(stop, self.cleanup_period_s, "stale sweep",
                                                              self.sweep), name="cd-sweep", daemon=True)]
        for t in (*watches, *loops):
            t.start()
        try:
            while not stop.is_set():
                key = self.queue.get(stop)
                if key is None:
                    break
                try:
                    self.reconcile(key)
                    self.queue.forget(key)
                except (errors.KubeAPIError, ReconcileRetry) as exc:
                    delay = self.queue.retry(key)
                    log.warning("ComputeDomain %s/%s: %s (retry in %.3fs)", key[0], key[1], exc, delay)
                except Exception:
                    delay = self.queue.retry(key)
                    log.exception("ComputeDomain %s/%s: reconcile failed (retry in %.3fs)", key[0], key[1], delay)
                finally:
                    self.queue.done(key)
        finally:
            stop.set()
            self.queue.wake()
            with self._dirty_cond:
                self._dirty_cond.notify_all()
            for t in loops:  # the watch threads end with their current request (daemon threads)
                t.join(timeout=5)
            self.close()
            log.info("compute-domain controller stopped")

    def _guarded(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except errors.KubeAPIError as exc:
            log.warning("%s failed: %s", what, exc)
        except Exception:
            log.exception("%s failed", what)

    def _every(self, stop: threading.Event, period_s: float, what: str, fn: Callable[[], Any]) -> None:
        while not stop.wait(period_s):
            self._guarded(what, fn)

    def _watch_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                body = kcd.list_compute_domains(self.client)
                for item in body.get("items") or ():
                    meta = item.get("metadata") or {}
                    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
                    self._keys[str(meta.get("uid", ""))] = key
                    self.queue.add(key)
                rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
                listed = time.monotonic()
                while not stop.is_set() and time.monotonic() - listed < self.resync_s:
                    timeout = max(1.0, min(self.watch_timeout_s, self.resync_s - (time.monotonic() - listed)))
                    for event in cdobjects.watch_compute_domains(self.client, rv, timeout):
                        if stop.is_set():
                            return
                        obj = event.get("object") or {}
                        meta = obj.get("metadata") or {}
                        if event.get("type") == "ERROR":
                            raise errors.KubeGoneError("WATCH computedomains", reason="Expired",
                                                       message=str(obj.get("message") or ""))
                        rv = str(meta.get("resourceVersion") or rv)
                        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
                        if event.get("type") == "DELETED":
                            self._keys.pop(str(meta.get("uid", "")), None)
                        else:
                            self._keys[str(meta.get("uid", ""))] = key
                        if event.get("type") in ("ADDED", "MODIFIED") and not self._settled(obj):
                            self.queue.add(key)
            except errors.KubeAPIError as exc:
                log.warning("watch on ComputeDomains ended: %s; listing again", exc)
                stop.wait(1.0)

    # -- membership: events, coalescing, node failure ---------------------------------------------------------------
    def _node_check_period(self) -> float:
        return self.node_check_s if self.node_check_s > 0 else max(0.1, self.node_grace_s / 4)

    def mark(self, uid: str) -> None:
        """Queue a membership pass for the domain ``uid`` (coalesced with other events of the burst)."""
        if not uid:
            return
        with self._dirty_cond:
            self._dirty.add(uid)
            self._dirty_cond.notify_all()

    def _membership_watch_loop(self, stop: threading.Event, what: str) -> None:
        """Watch the cliques (``what`` "cliques") or daemon pods ("pods") of the driver namespace and mark the
        owning domain of each changed one."""
        rv = ""
        ns = self.settings.namespace
        while not stop.is_set():
            try:
                events = (kcd.watch_cliques(self.client, ns, LABEL_COMPUTE_DOMAIN, rv, self.watch_timeout_s)
                          if what == "cliques" else
                          cdobjects.watch_objects(self.client, PODS, ns, LABEL_COMPUTE_DOMAIN, rv,
                                                  self.watch_timeout_s))
                for event in events:
                    if stop.is_set():
                        return
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise errors.KubeGoneError(f"WATCH {what}", reason="Expired",
                                                   message=str(obj.get("message") or ""))
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                    uid = owner_of(obj)
                    self.mark(uid)
                    if what == "pods" and event.get("type") == "DELETED" and uid in self._deleting:
                        self.queue.add(self._deleting[uid])  # a deleted domain waits for its daemon pods
            except errors.KubeGoneError:
                rv = ""
            except errors.KubeAPIError as exc:
                log.warning("watch on %s ended: %s; watching again", what, exc)
                rv = ""
                stop.wait(1.0)

    def _membership_worker(self, stop: threading.Event) -> None:
        """Run one membership pass per burst of marked domains."""
        while not stop.is_set():
            with self._dirty_cond:
                while not self._dirty and not stop.is_set():
                    self._dirty_cond.wait(0.5)
            if stop.wait(self.coalesce_s):
                return
            with self._dirty_cond:
                batch, self._dirty = self._dirty, set()
            self._guarded("membership pass", functools.partial(self.reconcile_membership, batch))

    def failed_nodes(self, *, fresh: bool = False) -> frozenset[str]:
        """Nodes that stopped answering (:func:`~dradriver.domain.computedomains.unresponsive_nodes` over the
        ``kube-node-lease`` Leases and the Nodes' Ready condition, grace ``node_grace_s``), re-listed when
        ``fresh`` or older than the node check period.

        :raises errors.KubeAPIError: after retries.
        """
        checked, failed = self._failed
        now = self.clock()
        if fresh or now - checked >= self._node_check_period():
            failed = frozenset(unresponsive_nodes(kcd.list_node_leases(self.client), cdobjects.list_nodes(self.client),
                                                  now_s=now, grace_s=self.node_grace_s))
            if failed != self._failed[1]:
                log.info("nodes not answering (grace %.1fs): %s", self.node_grace_s, sorted(failed) or "none")
            self._failed = (now, failed)
        return failed

    def check_nodes(self) -> None:
        """The node check: mark every domain with a clique member on a node that stopped answering (pre-warmed
        mode: first keep a clique DaemonSet for every clique, :meth:`ensure_clique_daemons`)."""
        if self.settings.pre_warmed:
            self._guarded("clique daemons", self.ensure_clique_daemons)
        failed = self.failed_nodes(fresh=True)
        if not failed or not self.cliques_gate:
            return
        for clique in kcd.list_cliques(self.client, self.settings.namespace, LABEL_COMPUTE_DOMAIN):
            if any(d.get("nodeName") in failed and d.get("ipAddress") for d in clique.get("daemons") or ()):
                self.mark(owner_of(clique))

    def reconcile_membership(self, uids: Iterable[str] | None = None) -> None:
        """One membership pass over the domains ``uids`` (all when None): per clique, drop the items of nodes
        without a daemon pod and clear those of failed nodes (one JSON patch), assign missing indexes (one apply),
        then write each domain's ``status`` if it changed.

        :raises errors.KubeAPIError: a list failed (a failed write re-marks its domain instead).
        """
        with self._pass_lock:
            self._pass_reads = {}
            try:
                self._reconcile_membership(uids)
            finally:
                self._pass_reads = None

    def _reconcile_membership(self, uids: Iterable[str] | None) -> None:
        wanted = None if uids is None else set(uids)
        if self.settings.pre_warmed:
            cliques = set(self._clique_domains) if wanted is None else wanted & set(self._clique_domains)
            if cliques:
                self._sync_clique_domains(cliques)
                wanted = None  # every domain's nodes may be on these cliques: recompute them all
        if wanted is not None and not wanted:
            return
        objs: Iterable[JSONDict]
        if wanted is not None and all(u in self._keys for u in wanted):
            got = [kcd.get_compute_domain(self.client, *self._keys[uid]) for uid in wanted]
            objs = [o for o, uid in zip(got, wanted, strict=True)
                    if o is not None and str((o.get("metadata") or {}).get("uid", "")) == uid]
        else:  # page by page: the full resync holds one page of domains and one batch of members at a time
            objs = (o for o in kcd.iterate_compute_domains(self.client, page_size=MEMBERSHIP_BATCH)
                    if wanted is None or str((o.get("metadata") or {}).get("uid", "")) in wanted)
        batch: list[JSONDict] = []
        for obj in objs:
            meta = obj.get("metadata") or {}
            if meta.get("deletionTimestamp") or FINALIZER not in (meta.get("finalizers") or ()):
                continue
            batch.append(obj)
            if len(batch) == MEMBERSHIP_BATCH:
                self._sync_batch(batch)
                batch = []
        if batch:
            self._sync_batch(batch)

    def _sync_batch(self, batch: list[JSONDict]) -> None:
        pods, cliques = self._members([str(o["metadata"].get("uid", "")) for o in batch])
        for obj in batch:
            obj.setdefault("apiVersion", "resource.nvidia.com/v1beta1")
            obj.setdefault("kind", "ComputeDomain")
            meta = obj["metadata"]
            uid = str(meta.get("uid", ""))
            try:
                self._sync(obj, pods.get(uid, []), cliques.get(uid, []))
            except errors.KubeConflictError:
                self.mark(uid)
            except ComputeDomainError as exc:
                log.debug("status of ComputeDomain %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)

    def _members(self, uids: list[str]) -> tuple[dict[str, list[JSONDict]], dict[str, list[JSONDict]]]:
        """The daemon pods and cliques of the domains ``uids`` (at most :data:`MEMBERSHIP_BATCH`), by domain UID.

        One list of pods and one of cliques for the batch (the set-based selector ``computeDomain in (...)``), so
        a pass costs and holds what its domains have, not what the fleet has: the full resync walks the fleet a
        batch at a time (issue 14, ``compute_domain_fleet``: its controller memory must not grow with the fleet).

        :raises errors.KubeAPIError: a list failed.
        """
        ns = self.settings.namespace
        selector = _uid_selector(uids[0]) if len(uids) == 1 else f"{LABEL_COMPUTE_DOMAIN} in ({','.join(uids)})"
        pods: dict[str, list[JSONDict]] = {}
        cliques: dict[str, list[JSONDict]] = {}
        listing = None
        if self.settings.domain_daemons:  # the two lists at once: one round trip of the pass, not two
            listing = self._writer_pool().submit(list_pods, self.client, ns, selector)
        if self.cliques_gate and self.settings.domain_daemons:
            for clique in kcd.list_cliques(self.client, ns, selector):
                cliques.setdefault(owner_of(clique), []).append(clique)
        if listing is not None:
            for pod in listing.result():
                pods.setdefault(owner_of(pod), []).append(pod)
        return pods, cliques

    # -- pre-warmed IMEX: a clique domain per clique -------------------------------------------------------------
    def ensure_clique_daemons(self) -> dict[str, str]:
        """Pre-warmed mode: a daemon ResourceClaimTemplate and a DaemonSet (:func:`~dradriver.domain.cdtemplates.
        clique_daemon_set`) for every value of the Node label ``nvidia.com/gpu.clique``; those of a clique no Node
        carries any more are deleted with their ComputeDomainCliques. Returns clique domain ID -> clique ID.

        :raises errors.KubeAPIError: a list or write failed (the next node check tries again).
        """
        with self._clique_lock:
            wanted = self.node_cliques()
            for uid, clique in wanted.items():
                if uid not in self._clique_domains:
                    log.info("pre-warmed IMEX: clique %s is IMEX domain %s", clique, uid)
                self._clique_domains[uid] = clique
                cd = clique_domain(clique, self.settings)
                for kind, manifest in ((RESOURCE_CLAIM_TEMPLATES, daemon_claim_template(cd, self.settings)),
                                       (DAEMON_SETS, clique_daemon_set(clique, self.settings))):
                    try:
                        self._ensure(kind, manifest, cd)
                        if kind is DAEMON_SETS:
                            self._update_clique_daemon_set(manifest, clique)
                    except ReconcileRetry as exc:
                        log.warning("pre-warmed IMEX: clique %s: %s (trying again at the next node check)", clique,
                                    exc)
            ns = self.settings.namespace
            for ds in cdobjects.list_objects(self.client, DAEMON_SETS, ns, LABEL_CLIQUE_ID):
                uid = owner_of(ds)
                if uid in wanted:
                    continue
                clique = str((ds["metadata"].get("labels") or {}).get(LABEL_CLIQUE_ID) or "")
                log.warning("pre-warmed IMEX: no node is in clique %s any more: deleting its IMEX daemons", clique)
                for kind in (DAEMON_SETS, RESOURCE_CLAIM_TEMPLATES):
                    cdobjects.delete(self.client, kind, ns, daemon_object_name(uid))
                    cdobjects.remove_finalizer(self.client, kind, ns, daemon_object_name(uid), FINALIZER)
                for obj in kcd.list_cliques(self.client, ns, _uid_selector(uid)):
                    kcd.delete_clique(self.client, ns, obj["metadata"]["name"])
                self._clique_domains.pop(uid, None)
                self.mark(uid)
            return dict(wanted)

    def _update_clique_daemon_set(self, manifest: JSONDict, clique: str) -> None:
        """Replace the clique DaemonSet when its :data:`~dradriver.domain.cdtemplates.ANNOTATION_TEMPLATE_HASH` is
        not ``manifest``'s (the controller was upgraded or its daemon flags changed): the DaemonSet's rolling update
        (``maxUnavailable`` 1, the Kubernetes default) then restarts the clique's daemons node by node, each node's
        domains reporting ``CliqueDaemonNotReady`` while its daemon is down.

        :raises errors.KubeAPIError: the read or the write failed (a conflict is retried at the next node check).
        """
        meta = manifest["metadata"]
        existing = cdobjects.get(self.client, DAEMON_SETS, meta["namespace"], meta["name"])
        if existing is None:
            return
        have = ((existing.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
        want = meta["annotations"][ANNOTATION_TEMPLATE_HASH]
        if have == want:
            return
        updated = {**existing, "spec": {**existing["spec"], "template": manifest["spec"]["template"]},
                   "metadata": {**existing["metadata"], "annotations": {
                       **(existing["metadata"].get("annotations") or {}), ANNOTATION_TEMPLATE_HASH: want}}}
        try:
            cdobjects.replace(self.client, DAEMON_SETS, updated)
        except errors.KubeConflictError:
            return
        log.warning("pre-warmed IMEX: clique %s: DaemonSet %s/%s updated (pod template %s -> %s): its IMEX daemons "
                    "restart node by node", clique, meta["namespace"], meta["name"], have or "(none)", want)

    def node_cliques(self) -> dict[str, str]:
        """Pre-warmed mode: clique domain ID -> clique ID for every value of the Node label
        ``nvidia.com/gpu.clique`` now (one list of the labelled Nodes).

        :raises errors.KubeAPIError: the list failed.
        """
        found = {str(((n.get("metadata") or {}).get("labels") or {}).get(NODE_CLIQUE_LABEL) or "")
                 for n in cdobjects.list_nodes(self.client, NODE_CLIQUE_LABEL)} - {""}
        return {clique_domain_uid(c): c for c in sorted(found)}

    def _sync_clique_domains(self, uids: set[str]) -> None:
        """One membership pass of the clique domains ``uids``: :meth:`reconcile_clique` of each one's
        ComputeDomainCliques with its daemon pods (indexes, statuses, failed nodes), as for a domain's own."""
        ns = self.settings.namespace
        for uid in sorted(uids):
            pods = [p for p in list_pods(self.client, ns, _uid_selector(uid)) if owner_of(p) == uid]
            cliques = [c for c in kcd.list_cliques(self.client, ns, _uid_selector(uid)) if owner_of(c) == uid]
            self._reconcile_cliques(cliques, pods)

    def _pre_warmed_nodes(self, cd: ComputeDomain) -> list[CliqueDaemon]:
        """Pre-warmed mode: ``status.nodes`` of ``cd``: a node per allocated channel claim of the domain (pool =
        node name), each with its clique daemon's entry (index, IP) and the condition ``CliqueDaemonReady``: the
        node stopped answering (``NodeNotAnswering``), its clique daemon has no entry or is not Ready
        (``CliqueDaemonNotReady``, with the daemon's own ``IMEXDaemonRunning`` message when it has one), or it
        is Ready. A node in no clique is Ready with index -1 (its claims get no channel, as in every mode)."""
        names: set[str] = set()
        claims = self._pass_read(f"claims/{cd.namespace}",
                                 lambda: cdobjects.list_objects(self.client, RESOURCE_CLAIMS, cd.namespace))
        for claim in claims:
            devices = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
            params = [((c.get("opaque") or {}).get("parameters") or {}) for c in devices.get("config") or ()]
            if not any(p.get("domainID") == cd.uid for p in params):
                continue
            names |= {str(r.get("pool") or "") for r in devices.get("results") or ()
                      if r.get("driver") == COMPUTE_DOMAIN_DRIVER.driver_name} - {""}
        if not names:
            return []
        every = self._pass_read("nodes", lambda: {
            str(n["metadata"]["name"]): str((n["metadata"].get("labels") or {}).get(NODE_CLIQUE_LABEL) or "")
            for n in cdobjects.list_nodes(self.client)})
        cliques = {name: every[name] for name in names if name in every}
        failed = self.failed_nodes()
        entries: dict[str, dict[str, CliqueDaemon]] = {}
        for clique in {c for c in cliques.values() if c}:
            name = clique_object_name(clique_domain_uid(clique), clique)
            obj = self._pass_read(f"clique/{name}", functools.partial(kcd.get_clique, self.client,
                                                                      self.settings.namespace, name))
            entries[clique] = {d.node_name: d for d in (CliqueDaemon.from_entry(r) for r in
                                                        (obj or {}).get("daemons") or ())}
        before = {n.node_name: n for n in cd.nodes}
        out = []
        for name in sorted(names):
            clique = cliques.get(name, "")
            entry = entries.get(clique, {}).get(name)
            if name in failed:
                reason, message = REASON_NODE_LOST, (f"node {name} stopped answering (Lease or Ready condition): "
                                                     f"the IMEX daemon of clique {clique or '(none)'} there is gone")
            elif not clique:
                reason, message = REASON_CLIQUE_DAEMON_READY, f"node {name} is in no NVLink clique (no channel)"
            elif entry is None or not entry.member:
                reason, message = REASON_CLIQUE_DAEMON_NOT_READY, (f"no IMEX daemon of clique {clique} has joined "
                                                                   f"on node {name}")
            elif entry.status != STATUS_READY:
                own = [c for c in entry.conditions if c.status == "False"]
                reason, message = REASON_CLIQUE_DAEMON_NOT_READY, (
                    f"the IMEX daemon of clique {clique} on node {name} is not Ready"
                    + (f" ({own[0].reason}: {own[0].message})" if own else ""))
            else:
                reason = REASON_CLIQUE_DAEMON_READY
                message = f"the IMEX daemon of clique {clique} on node {name} is Ready"
            ready = reason == REASON_CLIQUE_DAEMON_READY
            old = (next((c for c in before[name].conditions if c.type == CLIQUE_DAEMON_CONDITION), None)
                   if name in before else None)
            since = (old.last_transition_time if old is not None and old.reason == reason
                     else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock())))
            condition = DaemonCondition(CLIQUE_DAEMON_CONDITION, "True" if ready else "False", reason, message, since)
            out.append(CliqueDaemon(node_name=name, ip_address=entry.ip_address if entry and entry.member else "",
                                    clique_id=clique, index=entry.index if entry is not None else -1,
                                    status=STATUS_READY if ready else STATUS_NOT_READY, conditions=(condition,)))
        return out

    def _pass_read(self, key: str, read: Callable[[], Any]) -> Any:
        """``read()``, done once per membership pass for all its domains (the claims of a namespace, the Nodes, a
        clique): a full pass over N domains then lists the Nodes once, not N times; outside a pass, read now."""
        if self._pass_reads is None:
            return read()
        if key not in self._pass_reads:
            self._pass_reads[key] = read()
        return self._pass_reads[key]

    def _report_node_changes(self, cd: ComputeDomain, nodes: list[CliqueDaemon]) -> None:
        """Pre-warmed mode: an Event on ``cd`` for each node whose ``CliqueDaemonReady`` reason changed (a node
        listed for the first time only when it is not Ready): Warning with the reason, Normal on recovery."""
        before = {n.node_name: next((c.reason for c in n.conditions if c.type == CLIQUE_DAEMON_CONDITION), "")
                  for n in cd.nodes}
        about = events.ObjectRef(kind=COMPUTE_DOMAIN_KIND, name=cd.name, namespace=cd.namespace, uid=cd.uid,
                                 api_version="resource.nvidia.com/v1beta1")
        for node in nodes:
            condition = node.conditions[0]
            if before.get(node.node_name, REASON_CLIQUE_DAEMON_READY) == condition.reason:
                continue
            ready = condition.status == "True"
            (log.info if ready else log.warning)("ComputeDomain %s/%s (uid %s): %s", cd.namespace, cd.name, cd.uid,
                                                 condition.message)
            try:
                events.create_event(self.client, about, reason=condition.reason, message=condition.message,
                                    type_="Normal" if ready else "Warning", component=CONTROLLER_FIELD_MANAGER)
            except errors.KubeAPIError as exc:
                log.warning("ComputeDomain %s/%s: Event %s not written: %s", cd.namespace, cd.name,
                            condition.reason, exc)

    def _writer_pool(self) -> ThreadPoolExecutor:
        with self._count_lock:
            if self._writers is None:
                self._writers = ThreadPoolExecutor(CLIQUE_WRITERS, thread_name_prefix="cd-clique-writer")
            return self._writers

    def _owned_watch_loop(self, stop: threading.Event, kind: cdobjects.ObjectKind, namespace: str) -> None:
        """Watch the controller's objects of ``kind`` in ``namespace`` (``""``: all) and queue the owning domain of
        one deleted or being deleted; a DaemonSet whose ``numberReady`` changed has its domain's status recomputed."""
        rv = ""
        while not stop.is_set():
            try:
                for event in cdobjects.watch_objects(self.client, kind, namespace, LABEL_COMPUTE_DOMAIN, rv,
                                                     self.watch_timeout_s):
                    if stop.is_set():
                        return
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise errors.KubeGoneError(f"WATCH {kind.plural}", reason="Expired",
                                                   message=str(obj.get("message") or ""))
                    meta = obj.get("metadata") or {}
                    rv = str(meta.get("resourceVersion") or rv)
                    self._owned_event(kind, str(event.get("type") or ""), obj)
            except errors.KubeGoneError:
                rv = ""
            except errors.KubeAPIError as exc:
                log.warning("watch on %s ended: %s; watching again", kind.plural, exc)
                rv = ""
                stop.wait(1.0)

    def _owned_event(self, kind: cdobjects.ObjectKind, kind_of_event: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = owner_of(obj)
        if not uid:
            return
        gone = kind_of_event == "DELETED" or bool(meta.get("deletionTimestamp"))
        if gone and uid in self._clique_domains:
            log.warning("%s %s/%s of the pre-warmed IMEX daemons of clique %s %s: making it again", kind.plural,
                        meta.get("namespace", ""), meta.get("name", ""), self._clique_domains[uid],
                        "deleted" if kind_of_event == "DELETED" else "being deleted")
            self._guarded("clique daemons", self.ensure_clique_daemons)
            return
        if gone:
            key = self._keys.get(uid)
            if key is None:
                found = kcd.find_compute_domain(self.client, uid)
                if found is None:
                    return  # its domain is gone: nothing to recreate (the sweep handles leftovers)
                fmeta = found.get("metadata") or {}
                key = (str(fmeta.get("namespace", "")), str(fmeta.get("name", "")))
            log.info("%s %s/%s of ComputeDomain %s/%s %s: reconciling the domain", kind.plural,
                     meta.get("namespace", ""), meta.get("name", ""), key[0], key[1],
                     "deleted" if kind_of_event == "DELETED" else "being deleted")
            self.queue.add(key)
            return
        if kind is DAEMON_SETS and kind_of_event in ("ADDED", "MODIFIED"):
            self._daemon_set_changed(uid, obj)

    def _daemon_set_changed(self, uid: str, ds: Mapping[str, Any]) -> None:
        """A DaemonSet's ``status.numberReady`` changed: recompute its domain's status now rather than at the next
        status round. NVIDIA's handler instead sets ``Ready`` when ``numberReady == numNodes`` (7.3); here the
        status stays what the nodes say, so ``status.status`` never reads Ready while ``status.nodes`` lists a
        NotReady daemon (the daemon's clique entry can trail its pod's readiness)."""
        ready = (ds.get("status") or {}).get("numberReady")
        if not isinstance(ready, int) or self._ds_ready.get(uid) == ready:
            return
        self._ds_ready[uid] = ready
        self.mark(uid)

    def _settled(self, obj: Mapping[str, Any]) -> bool:
        """An event that changes nothing reconcile acts on: this generation was reconciled, the finalizer is
        there and no deletion started (status writes, the controller's own included, end here; the periodic
        re-list still re-queues every domain)."""
        meta = obj.get("metadata") or {}
        return (not meta.get("deletionTimestamp") and FINALIZER in (meta.get("finalizers") or ())
                and self._done.get(str(meta.get("uid", ""))) == meta.get("generation"))

    # -- reconcile -----------------------------------------------------------------------------------------------------
    def reconcile(self, key: Key) -> None:
        """Bring one ComputeDomain and its objects to the state the module docstring describes.

        :raises errors.KubeAPIError: an API failure (retried by :meth:`run`).
        :raises ReconcileRetry: something must go away first.
        """
        namespace, name = key
        obj = kcd.get_compute_domain(self.client, namespace, name)
        if obj is None:
            return
        try:
            cd = ComputeDomain.from_object(obj)
        except ComputeDomainError as exc:
            log.error("ComputeDomain %s/%s (uid %s) cannot be reconciled: %s", namespace, name,
                      (obj.get("metadata") or {}).get("uid", ""), exc)
            return
        if cd.deleting:
            self._done.pop(cd.uid, None)
            self._delete(obj, cd)
            return
        if FINALIZER not in cd.finalizers:
            obj["metadata"]["finalizers"] = [*cd.finalizers, FINALIZER]
            obj = kcd.update_compute_domain(self.client, obj)
        if self.settings.domain_daemons:
            for kind, manifest in ((RESOURCE_CLAIM_TEMPLATES, daemon_claim_template(cd, self.settings)),
                                   (DAEMON_SETS, daemon_set(cd, self.settings))):
                manifest["metadata"]["namespace"] = self._daemon_namespace(kind, cd.uid)
                self._ensure(kind, manifest, cd)
        channel = None
        if self.settings.channel_isolation:
            obj, channel = self.assign_channel(obj)
        self._ensure(RESOURCE_CLAIM_TEMPLATES, workload_claim_template(cd, self.settings, channel), cd)
        self.sync_status(obj)
        self._done[cd.uid] = int(obj["metadata"].get("generation") or 0)
        self.reconciled += 1
        log.info("reconciled ComputeDomain %s/%s (uid %s)", namespace, name, cd.uid)

    def assign_channel(self, obj: JSONDict) -> tuple[JSONDict, int]:
        """``IMEX_ISOLATION=channel``: the ComputeDomain's IMEX channel ID, given once and kept in its annotation
        ``resource.nvidia.com/imexChannel``: the one it has, else the lowest ID in 1..2047 no other existing
        ComputeDomain (in any namespace, also one being deleted: it lives until its finalizer goes) holds. The ID
        lives in the object, so a restarted or new leader reads it back; the choice is serialised in this process
        and the write is conditional on ``resourceVersion`` (a conflict is retried by :meth:`run`).

        :returns: the updated object and its channel.
        :raises ReconcileRetry: another domain's annotation is malformed, or no channel is free.
        :raises errors.KubeAPIError: the list or the update failed.
        """
        try:
            held = domain_channel(obj)
        except ComputeDomainError as exc:
            raise ReconcileRetry(str(exc)) from exc
        if held is not None:
            return obj, held
        uid = obj["metadata"].get("uid")
        with self._channel_lock:
            taken: list[int] = []
            for item in kcd.list_compute_domains(self.client).get("items") or ():
                if (item.get("metadata") or {}).get("uid") == uid:
                    continue
                try:
                    other = domain_channel(item)
                except ComputeDomainError as exc:
                    raise ReconcileRetry(str(exc)) from exc
                if other is not None:
                    taken.append(other)
            try:
                channel = choose_channel(taken)
            except ComputeDomainError as exc:
                raise ReconcileRetry(str(exc)) from exc
            obj.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_IMEX_CHANNEL] = str(channel)
            obj = kcd.update_compute_domain(self.client, obj)
        log.info("ComputeDomain %s/%s (uid %s) gets IMEX channel %d", obj["metadata"].get("namespace"),
                 obj["metadata"].get("name"), uid, channel)
        return obj, channel

    def _ensure(self, kind: cdobjects.ObjectKind, manifest: JSONDict, cd: ComputeDomain) -> None:
        """Create ``manifest`` unless it exists; an existing object must be this domain's and not going away."""
        meta = manifest["metadata"]
        existing = cdobjects.get(self.client, kind, meta["namespace"], meta["name"])
        if existing is None:
            if cdobjects.create(self.client, kind, manifest) is not None:
                log.info("created %s %s/%s for ComputeDomain %s/%s", kind.plural, meta["namespace"], meta["name"],
                         cd.namespace, cd.name)
                return
            existing = cdobjects.get(self.client, kind, meta["namespace"], meta["name"])  # made meanwhile
            if existing is None:
                raise ReconcileRetry(f"{kind.plural} {meta['namespace']}/{meta['name']} vanished while being "
                                     "created")
        if owner_of(existing) != cd.uid:
            raise ReconcileRetry(f"{kind.plural} {meta['namespace']}/{meta['name']} exists and belongs to "
                                 f"ComputeDomain uid {owner_of(existing) or '(none)'}, not {cd.uid}")
        if (existing.get("metadata") or {}).get("deletionTimestamp"):
            # Deleted while its domain lives (by hand, or by a cleanup that raced): release it from our finalizer so
            # the deletion completes, and recreate it at the retry.
            if cdobjects.remove_finalizer(self.client, kind, meta["namespace"], meta["name"], FINALIZER):
                log.info("%s %s/%s of live ComputeDomain %s/%s was deleted: finalizer removed, recreating it",
                         kind.plural, meta["namespace"], meta["name"], cd.namespace, cd.name)
            raise ReconcileRetry(f"{kind.plural} {meta['namespace']}/{meta['name']} is still being deleted")

    def _daemon_namespace(self, kind: cdobjects.ObjectKind, uid: str) -> str:
        """Where the domain's daemon object is: the first of the driver namespace and the additional namespaces
        that has it (``--additional-namespaces``: found there, never created there), else the driver namespace."""
        name = daemon_object_name(uid)
        for namespace in self.additional_namespaces:
            if self._owned(kind, namespace, name, uid) is not None:
                return namespace
        return self.settings.namespace

    def _owned(self, kind: cdobjects.ObjectKind, namespace: str, name: str, uid: str) -> JSONDict | None:
        obj = cdobjects.get(self.client, kind, namespace, name)
        return obj if obj is not None and owner_of(obj) == uid else None

    def _delete(self, obj: JSONDict, cd: ComputeDomain) -> None:
        """A ComputeDomain being deleted: remove what it has, then its finalizer (module docstring, "Deletion").

        Its DaemonSets and daemon templates are found by their label in every namespace (also those an earlier
        install in another namespace left); the finalizer stays while a daemon pod of the domain exists anywhere (a
        DaemonSet's pods go after it: the garbage collector deletes them, each ends when its kubelet has stopped its
        containers), except a pod being deleted on a node that stopped answering (it can end only when the node
        comes back or is removed).

        :raises ReconcileRetry: an object or a daemon pod is still there (the pods watch queues the domain again
            when one of its pods in the driver namespace goes).
        """
        if FINALIZER not in cd.finalizers:
            return
        targets: list[tuple[cdobjects.ObjectKind, str, str]] = [(RESOURCE_CLAIM_TEMPLATES, cd.namespace,
                                                                 cd.template_name)]
        if self.settings.domain_daemons:
            targets += [(kind, o["metadata"]["namespace"], o["metadata"]["name"])
                        for kind, o in self._daemon_objects(cd.uid)]
        for kind, namespace, name in targets:
            if self._owned(kind, namespace, name, cd.uid) is not None:
                cdobjects.delete(self.client, kind, namespace, name)
        if self.settings.domain_daemons:
            self._unlabel_nodes(cd.uid)
        for kind, namespace, name in targets:
            if self._owned(kind, namespace, name, cd.uid) is not None:
                cdobjects.remove_finalizer(self.client, kind, namespace, name, FINALIZER)
        for kind, namespace, name in targets:
            if self._owned(kind, namespace, name, cd.uid) is not None:
                raise ReconcileRetry(f"{kind.plural} {namespace}/{name} still exists")
        if self.settings.domain_daemons:
            self._wait_for_daemon_pods(cd)
            for clique in self._list_everywhere(None, _uid_selector(cd.uid)):
                kcd.delete_clique(self.client, clique["metadata"]["namespace"], clique["metadata"]["name"])
        obj["metadata"]["finalizers"] = [f for f in cd.finalizers if f != FINALIZER]
        try:
            kcd.update_compute_domain(self.client, obj)
        except errors.KubeNotFoundError:
            return
        finally:
            self._deleting.pop(cd.uid, None)
        log.info("ComputeDomain %s/%s (uid %s): cleaned up, finalizer removed", cd.namespace, cd.name, cd.uid)

    def _wait_for_daemon_pods(self, cd: ComputeDomain) -> None:
        """Return once no daemon pod of ``cd`` is left in any namespace but pods being deleted on nodes that stopped
        answering; else remember the domain for the pods watch and raise :class:`ReconcileRetry` naming them."""
        pods = self._list_everywhere(PODS, _uid_selector(cd.uid))
        stuck = (self.failed_nodes() if any((p.get("metadata") or {}).get("deletionTimestamp") for p in pods)
                 else frozenset())
        left = [p for p in pods if not ((p.get("metadata") or {}).get("deletionTimestamp")
                                        and (p.get("spec") or {}).get("nodeName") in stuck)]
        if not left:
            for pod in pods:
                log.warning("ComputeDomain %s/%s (uid %s): daemon pod %s/%s is being deleted on node %s, which "
                            "stopped answering; not waiting for it", cd.namespace, cd.name, cd.uid,
                            pod["metadata"]["namespace"], pod["metadata"]["name"], pod["spec"].get("nodeName"))
            return
        self._deleting[cd.uid] = (cd.namespace, cd.name)
        names = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in left]
        raise ReconcileRetry(f"{len(left)} daemon pod(s) of the domain still exist ({', '.join(names[:5])}"
                             f"{', ...' if len(names) > 5 else ''}): its finalizer stays until they are gone")

    def _daemon_objects(self, uid: str) -> list[tuple[cdobjects.ObjectKind, JSONDict]]:
        """The DaemonSets and daemon ResourceClaimTemplates (``computedomain-daemon-<uid>``) labelled with the domain
        ``uid``, in every namespace: the driver namespace's, an additional namespace's, and those an install in
        another namespace made."""
        selector = _uid_selector(uid)
        name = daemon_object_name(uid)
        return [*((DAEMON_SETS, o) for o in self._list_everywhere(DAEMON_SETS, selector)),
                *((RESOURCE_CLAIM_TEMPLATES, o) for o in cdobjects.list_objects(self.client, RESOURCE_CLAIM_TEMPLATES,
                                                                                "", selector)
                  if o["metadata"]["name"] == name)]

    def _list_everywhere(self, kind: cdobjects.ObjectKind | None, selector: str) -> list[JSONDict]:
        """The objects of ``kind`` (``None``: ComputeDomainCliques) matching ``selector`` in every namespace; where
        RBAC allows them only in the driver and additional namespaces (NVIDIA's Helm chart grants the controller
        DaemonSets and cliques there only), in those, with one warning per kind: then objects an install in another
        namespace left are not found.

        :raises errors.KubeAPIError: a list failed.
        """
        plural = kind.plural if kind is not None else "computedomaincliques"
        if plural not in self._narrowed:
            try:
                if kind is None:
                    return kcd.list_cliques(self.client, "", selector)
                return cdobjects.list_objects(self.client, kind, "", selector)
            except errors.KubeForbiddenError as exc:
                self._narrowed.add(plural)
                log.warning("listing %s in every namespace is forbidden (%s): searching only namespaces %s, so what "
                            "an install in another namespace left for a ComputeDomain is not found (grant list on "
                            "%s cluster-wide)", plural, exc, ", ".join(self._managed_namespaces()), plural)
        return [o for ns in self._managed_namespaces()
                for o in (kcd.list_cliques(self.client, ns, selector) if kind is None
                          else cdobjects.list_objects(self.client, kind, ns, selector))]

    def _managed_namespaces(self) -> tuple[str, ...]:
        """The driver namespace, then the additional namespaces (``--additional-namespaces``)."""
        return (self.settings.namespace, *(ns for ns in self.additional_namespaces if ns != self.settings.namespace))

    def _unlabel_nodes(self, uid: str) -> None:
        for node in cdobjects.list_nodes(self.client, _uid_selector(uid)):
            name = node["metadata"]["name"]
            try:
                kcd.set_node_label(self.client, name, LABEL_COMPUTE_DOMAIN, None, only_if=uid)
            except errors.KubeConflictError:
                kcd.set_node_label(self.client, name, LABEL_COMPUTE_DOMAIN, None, only_if=uid)

    # -- status -------------------------------------------------------------------------------------------------
    def sync_all_status(self) -> None:
        """The slow resync: one membership pass over every ComputeDomain."""
        self.reconcile_membership(None)

    def sync_status(self, obj: JSONDict) -> None:
        """Recompute one ComputeDomain's status now (after a reconcile)."""
        with self._pass_lock:
            self._sync_status(obj)

    def _sync_status(self, obj: JSONDict) -> None:
        uid = str(obj["metadata"].get("uid", ""))
        pods = [] if not self.settings.domain_daemons else list_pods(self.client, self.settings.namespace,
                                                                     _uid_selector(uid))
        cliques = [] if not (self.cliques_gate and self.settings.domain_daemons) else kcd.list_cliques(
            self.client, self.settings.namespace, _uid_selector(uid))
        try:
            self._sync(obj, pods, cliques)
        except errors.KubeConflictError:
            self.queue.add((obj["metadata"]["namespace"], obj["metadata"]["name"]))

    def _sync(self, obj: JSONDict, pods: list[JSONDict], cliques: list[JSONDict]) -> None:
        cd = ComputeDomain.from_object(obj)
        status = dict(obj.get("status") or {})
        if self.settings.host_managed:
            wanted = {**status, "status": STATUS_READY}
        elif self.settings.pre_warmed:
            nodes = self._pre_warmed_nodes(cd)
            wanted = {**status, "nodes": [n.to_status_node() for n in nodes], "status": global_status(0, nodes)}
            if not nodes and "nodes" not in status:
                wanted.pop("nodes")
            self._report_node_changes(cd, nodes)
        else:
            mine = [p for p in pods if owner_of(p) == cd.uid]
            my_cliques = self._reconcile_cliques([c for c in cliques if owner_of(c) == cd.uid], mine)
            nodes = node_entries(cd, mine, [c for c in my_cliques if c is not None], cliques_gate=self.cliques_gate)
            wanted = {**status, "nodes": [n.to_status_node() for n in nodes],
                      "status": global_status(cd.num_nodes, nodes)}
            if not nodes and "nodes" not in status:
                wanted.pop("nodes")
        if wanted == status:
            return
        obj["status"] = wanted
        kcd.patch_compute_domain_status(self.client, cd.namespace, cd.name, wanted,
                                        removed=[key for key in status if key not in wanted])
        self.status_writes += 1
        if wanted.get("status") != status.get("status"):
            log.info("ComputeDomain %s/%s (uid %s): status %s", cd.namespace, cd.name, cd.uid, wanted["status"])

    def _reconcile_cliques(self, cliques: list[JSONDict], pods: list[JSONDict]) -> list[JSONDict | None]:
        """:meth:`reconcile_clique` for each of one domain's ``cliques``, up to :data:`CLIQUE_WRITERS` at once
        (in order of ``cliques``). The node check's answer is read once for all of them first."""
        if len(cliques) < 2:
            return [self.reconcile_clique(c, pods) for c in cliques]
        if any(d.get("ipAddress") for c in cliques for d in c.get("daemons") or ()):
            self.failed_nodes()  # fresh enough for the whole pass: the writers do not each list the Leases
        return list(self._writer_pool().map(lambda c: self.reconcile_clique(c, pods), cliques))

    def close(self) -> None:
        """Stop the clique writers (:meth:`run` does at its end)."""
        with self._count_lock:
            writers, self._writers = self._writers, None
        if writers is not None:
            writers.shutdown(wait=True)

    def reconcile_clique(self, clique: JSONDict, pods: list[JSONDict]) -> JSONDict | None:
        """``clique`` after this pass's writes (:func:`membership_operations` as one JSON patch, then the missing
        indexes as one apply); ``None`` when it changed meanwhile or went away (its domain is marked again).

        The items kept are those of nodes running a daemon pod of the domain in this clique
        (:func:`~dradriver.domain.computedomains.clique_member_nodes`: matched by domain and clique, so a node moved
        to another clique leaves this one, index reservation included). An item whose node is missing from the
        pass's pod list is removed only when a fresh list of the domain's pods confirms it (the pass's list may
        predate a pod that wrote its entry since; NVIDIA post-#1453)."""
        uid = owner_of(clique)
        ns = str(clique["metadata"].get("namespace") or self.settings.namespace)
        name = str(clique["metadata"]["name"])
        clique_id = clique_of(clique)
        nodes = clique_member_nodes(pods, clique_id)
        daemons = list(clique.get("daemons") or [])
        if any(d.get("nodeName") not in nodes for d in daemons):
            fresh = list_pods(self.client, self.settings.namespace, _uid_selector(uid))
            nodes |= clique_member_nodes((p for p in fresh if owner_of(p) == uid), clique_id)
        failed = set(self.failed_nodes()) if any(d.get("ipAddress") for d in daemons) else set()
        ops = membership_operations(clique, keep_nodes=nodes, failed_nodes=failed)
        if ops:
            out = kcd.patch_clique(self.client, ns, name, ops)
            with self._count_lock:
                self.clique_patches += 1
            if out is None:
                self.mark(uid)
                return None
            removed = sum(1 for op in ops if op["op"] == "remove" and op["path"].count("/") == 2)
            cleared = sorted({d.get("nodeName") for d in daemons if d.get("nodeName") in failed and d.get("ipAddress")
                              and d.get("nodeName") in nodes})
            log.info("ComputeDomainClique %s/%s: removed %d entries of nodes without a daemon pod in this clique; "
                     "cleared the entries of nodes not answering: %s", ns, name, removed, cleared or "none")
            clique = out
        items = [CliqueDaemon.from_entry(d) for d in clique.get("daemons") or ()]
        assigned = assign_indexes(items, self.settings.max_nodes_per_imex_domain)
        statuses = entry_statuses(items, pods)
        if all(assigned.get(d.node_name, d.index) == d.index and statuses.get(d.node_name, d.status) == d.status
               for d in items):
            return clique
        labels = (clique["metadata"].get("labels") or {})
        body = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainClique",
                "metadata": {"name": name, "namespace": ns,
                             "labels": {k: labels[k] for k in (LABEL_COMPUTE_DOMAIN, LABEL_CLIQUE_ID) if k in labels}},
                "daemons": [{"nodeName": d.node_name,
                             **({"index": assigned[d.node_name]} if d.node_name in assigned else {}),
                             **({"status": statuses[d.node_name]} if d.node_name in statuses else {})}
                            for d in sorted(items, key=lambda d: d.node_name)]}
        try:
            out = kcd.apply_clique(self.client, ns, name, body, field_manager=CONTROLLER_FIELD_MANAGER, force=True)
        except errors.KubeNotFoundError:
            return None
        with self._count_lock:
            self.index_applies += 1
        new = {d.node_name: index for d in items if (index := assigned.get(d.node_name, d.index)) != d.index}
        flipped = {d.node_name: st for d in items if (st := statuses.get(d.node_name, d.status)) != d.status}
        log.info("ComputeDomainClique %s/%s: assigned indexes %s, statuses %s", ns, name, new or "none",
                 flipped or "unchanged")
        return out

    # -- stale sweep --------------------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Delete or unlabel what belongs to ComputeDomains that no longer exist, and retire what an install in
        another namespace left for live ones (module docstring, "Stale sweep").

        :raises errors.KubeAPIError: a list failed.
        """
        ns = self.settings.namespace
        managed = set(self._managed_namespaces())
        found = [(DAEMON_SETS, o) for o in self._list_everywhere(DAEMON_SETS, LABEL_COMPUTE_DOMAIN)]
        found += [(RESOURCE_CLAIM_TEMPLATES, o) for o in cdobjects.list_objects(self.client, RESOURCE_CLAIM_TEMPLATES,
                                                                                "", LABEL_COMPUTE_DOMAIN)]
        nodes = cdobjects.list_nodes(self.client, LABEL_COMPUTE_DOMAIN)
        cliques = self._list_everywhere(None, LABEL_COMPUTE_DOMAIN)
        live = {str((o.get("metadata") or {}).get("uid", "")) for o in
                kcd.list_compute_domains(self.client).get("items") or ()}
        if self.settings.pre_warmed:  # the clique domains of the nodes now (ensure_clique_daemons retires the rest),
            live |= set(self.node_cliques())  # read here: an ensure that failed must not make them look stale
        for kind, obj in found:
            uid = owner_of(obj)
            meta = obj["metadata"]
            if uid in live and not self._left_by_another_install(kind, obj, managed):
                continue
            if uid in live:
                log.warning("stale sweep: %s %s/%s of live ComputeDomain uid %s was made by an install in namespace "
                            "%s (not the driver namespace %s, not in --additional-namespaces): deleting it, the "
                            "domain gets its own in %s", kind.plural, meta["namespace"], meta["name"], uid,
                            meta["namespace"], ns, ns)
            else:
                log.info("stale sweep: %s %s/%s of gone ComputeDomain uid %s", kind.plural, meta["namespace"],
                         meta["name"], uid)
            cdobjects.delete(self.client, kind, meta["namespace"], meta["name"])
            cdobjects.remove_finalizer(self.client, kind, meta["namespace"], meta["name"], FINALIZER)
        for node in nodes:
            uid = owner_of(node)
            if uid not in live:
                log.info("stale sweep: node %s label of gone ComputeDomain uid %s", node["metadata"]["name"], uid)
                kcd.set_node_label(self.client, node["metadata"]["name"], LABEL_COMPUTE_DOMAIN, None, only_if=uid)
        for clique in cliques:
            meta = clique["metadata"]
            if owner_of(clique) not in live or meta["namespace"] not in managed:
                log.info("stale sweep: ComputeDomainClique %s/%s (%s)", meta["namespace"], meta["name"],
                         "gone ComputeDomain" if owner_of(clique) not in live else "left by another install")
                kcd.delete_clique(self.client, meta["namespace"], meta["name"])

    @staticmethod
    def _left_by_another_install(kind: cdobjects.ObjectKind, obj: Mapping[str, Any], managed: set[str]) -> bool:
        """A live domain's DaemonSet or daemon template in a namespace this controller does not manage (neither the
        driver namespace nor an additional one): an earlier install's, whose controller is gone. A workload template
        lives in its domain's own namespace and is never one."""
        meta = obj.get("metadata") or {}
        if meta.get("namespace") in managed:
            return False
        return kind is DAEMON_SETS or meta.get("name") == daemon_object_name(owner_of(obj))
