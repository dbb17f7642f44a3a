"""The ComputeDomain churn run (issue 14): domains created and deleted while their daemons restart at random, on
one :class:`~bench.cdfleet.Fleet`, against the real controller and the real daemon membership code.

What runs (:func:`run_churn`):

* the real controller (:class:`dradriver.computedomain.controller.ComputeDomainController`, in process, event-driven)
  with its own client (``bench-controller``);
* ``slots`` lanes, each owning ``racks_per_domain`` racks of the fleet; a lane creates a domain over its racks,
  runs one :class:`~bench.cdfleet.NodeAgent` per node (channel prepare, daemon, kubelet prober), restarts
  ``restarts`` random daemons of it (the pod deleted and made again with a new UID, as a DaemonSet does after
  ``kubectl delete pod`` or a crash; half of them withdraw their entry first as a SIGTERM'd daemon does, half do
  not, as a crashed one), waits until the domain's ``status.status`` is ``Ready`` again, deletes the domain (as
  ``kubectl delete``) and waits until it is gone; then the next domain;
* the garbage collector, emulated: once a domain's DaemonSet is gone its daemon pods are deleted;
* a watch on every ComputeDomainClique of the driver namespace, from before the first domain to after the last,
  checking each observed state: no ``index`` held by two items of one clique.

After the last domain: nothing may be left (cliques, daemon pods, DaemonSets, ResourceClaimTemplates and node
labels of any domain, the domains themselves). :class:`ChurnResult` holds the figures; a failed check raises.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from bench import cdfleet
from bench.cdfleet import Fleet, FleetNode, NodeAgent, Timing
from dradriver.computedomain import daemon as cddaemon
from dradriver.domain import computedomains as cd
from dradriver.domain.cdtemplates import owner_of
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors

__all__ = ["CHURN_TIMING", "ChurnError", "ChurnResult", "leftovers", "run_churn"]

CHURN_TIMING = Timing(scale=0.1)
"""NVIDIA's periods / 10: the churn checks states, not speed."""


class ChurnError(RuntimeError):
    """A churn check failed (the message names the domain, clique or object)."""


@dataclass
class ChurnResult:
    """Figures of one churn run.

    :param seconds: wall time from the first domain's creation to the last one gone.
    :param writes: every write of the node agents and the controller (create, update, patch, delete).
    :param conflicts: answers 409 (``node_conflicts``: those to the node agents; the rest are the controller's).
    :param clique_states: clique states the watch checked.
    """

    domains: int
    restarts: int
    seconds: float = 0.0
    writes: int = 0
    node_writes: int = 0
    controller_writes: int = 0
    conflicts: int = 0
    node_conflicts: int = 0
    clique_states: int = 0
    ready_again: int = 0
    duplicates: list[str] = field(default_factory=list)


def _watch_indexes(fleet: Fleet, result: ChurnResult, stop: threading.Event, started: threading.Event) -> None:
    """Check every observed clique state for an index held twice (kept in ``result.duplicates``)."""
    client = fleet.client("bench-churn-watch")
    rv = ""
    try:
        while not stop.is_set():
            try:
                events = kube_cd.watch_cliques(client, fleet.namespace, cd.LABEL_COMPUTE_DOMAIN, rv, 5.0)
                started.set()
                for event in events:
                    obj = event.get("object") or {}
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                    if event.get("type") == "DELETED":
                        continue
                    result.clique_states += 1
                    held = Counter(d.get("index") for d in obj.get("daemons") or ()
                                   if isinstance(d.get("index"), int) and d["index"] >= 0)
                    twice = sorted(i for i, n in held.items() if n > 1)
                    if twice:
                        result.duplicates.append(f"clique {obj['metadata']['name']} rv {rv}: indexes {twice} "
                                                 "held twice")
                    if stop.is_set():
                        return
            except kube_errors.KubeAPIError:
                rv = ""
    finally:
        client.close()


def _gc(fleet: Fleet, gone: set[str], stop: threading.Event, period_s: float) -> None:
    """The garbage collector: daemon pods of a deleted domain (in ``gone``) whose DaemonSet is gone are deleted
    (in process)."""
    while not stop.wait(period_s):
        live = {owner_of(ds) for ds in fleet.api.objects("DaemonSet", fleet.namespace)}
        for pod in fleet.api.objects("Pod", fleet.namespace):
            uid = owner_of(pod)
            if uid and uid not in live and uid in gone:
                fleet.api.delete("Pod", pod["metadata"]["name"], fleet.namespace)


def _wait(what: str, check: Callable[[], bool], timeout_s: float, period_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise ChurnError(f"{what} after {timeout_s} s")
        time.sleep(period_s)


def _run_agents(agents: list[NodeAgent], timeout_s: float) -> None:
    threads = [threading.Thread(target=a.run, args=(time.monotonic(),), daemon=True) for a in agents]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    errors = [a.error for a in agents if a.error]
    if errors:
        raise ChurnError(f"{len(errors)} node agents failed; first: {errors[0]}")
    if any(t.is_alive() for t in threads):
        raise ChurnError(f"node agents not done after {timeout_s} s")


def _restart(fleet: Fleet, agent: NodeAgent, rng: random.Random, timing: Timing,
             stop: threading.Event) -> NodeAgent:
    """The daemon on ``agent``'s node restarts: its pod is replaced (new UID); a graceful one withdraws first."""
    assert agent.pod is not None
    old = agent.pod["metadata"]
    fresh = NodeAgent(fleet, agent.node, agent.cd_uid, agent.membership, timing, stop)
    if rng.random() < 0.5:
        settings = cddaemon.DaemonSettings(clique_id=agent.node.clique_id, cd_uid=agent.cd_uid,
                                           node_name=agent.node.name, pod_ip=agent.node.ip, pod_uid=old["uid"],
                                           pod_name=old["name"], pod_namespace=fleet.namespace)
        cddaemon.withdraw_entry(fresh.api, settings)
    fleet.api.delete("Pod", old["name"], fleet.namespace)
    pod = fleet.create_daemon_pod(agent.cd_uid, agent.node)
    pod["_started"] = time.monotonic()
    fresh.prepared_at = agent.prepared_at
    fresh.pod = pod
    return fresh


def _lane(fleet: Fleet, gone: set[str], lane: int, nodes: list[FleetNode], count: int, restarts: int,
          timing: Timing, rng: random.Random, result: ChurnResult, timeout_s: float) -> None:
    for n in range(count):
        _one_domain(fleet, gone, f"churn-{lane:02d}-{n:03d}", nodes, restarts, timing, rng, result, timeout_s)


def _one_domain(fleet: Fleet, gone: set[str], name: str, nodes: list[FleetNode], restarts: int, timing: Timing,
                rng: random.Random, result: ChurnResult, timeout_s: float) -> None:
    """One domain's life: created, every node prepared, ``restarts`` daemons restarted, Ready again, deleted."""
    membership = cdfleet.DradriverMembership()
    period = timing.s(0.2)
    stop = threading.Event()
    uid = fleet.create_domain(name, num_nodes=len(nodes))
    agents = [NodeAgent(fleet, node, uid, membership, timing, stop) for node in nodes]

    def ready() -> bool:
        obj = fleet.api.get("ComputeDomain", name, "default")
        return obj is not None and (obj.get("status") or {}).get("status") == cd.STATUS_READY

    def pods_gone() -> bool:
        return not any(owner_of(p) == uid for p in fleet.api.objects("Pod", fleet.namespace))

    _run_agents(agents, timeout_s)
    again = [_restart(fleet, a, rng, timing, stop) for a in rng.sample(agents, min(restarts, len(agents)))]
    _run_agents(again, timeout_s)
    _wait(f"ComputeDomain default/{name} not Ready again", ready, timeout_s, period)
    result.ready_again += 1
    gone.add(uid)
    fleet.api.delete("ComputeDomain", name, "default")
    _wait(f"ComputeDomain default/{name} not gone", lambda: fleet.api.get("ComputeDomain", name, "default") is None,
          timeout_s, period)
    _wait(f"daemon pods of ComputeDomain default/{name} not gone", pods_gone, timeout_s, period)


def leftovers(fleet: Fleet) -> list[str]:
    """What any ComputeDomain left behind: cliques, daemon pods, DaemonSets, ResourceClaimTemplates, node
    labels, domains."""
    out = [f"ComputeDomainClique {o['metadata']['name']}" for o in fleet.api.objects("ComputeDomainClique")]
    out += [f"ComputeDomain {o['metadata']['namespace']}/{o['metadata']['name']}"
            for o in fleet.api.objects("ComputeDomain")]
    for kind in ("Pod", "DaemonSet", "ResourceClaimTemplate"):
        out += [f"{kind} {o['metadata']['namespace']}/{o['metadata']['name']}" for o in fleet.api.objects(kind)
                if (o["metadata"].get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN)]
    out += [f"Node {o['metadata']['name']} label" for o in fleet.api.objects("Node")
            if (o["metadata"].get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN)]
    return out


def run_churn(fleet: Fleet, *, domains: int = 100, slots: int = 5, racks_per_domain: int = 2, restarts: int = 2,
              timing: Timing = CHURN_TIMING, seed: int = 14, timeout_s: float = 120.0) -> ChurnResult:
    """Run ``domains`` domains through ``slots`` lanes (module docstring) with the real controller running.

    :raises ChurnError: an index held twice, a domain not Ready again or not gone, something left behind.
    :raises ValueError: the fleet has fewer than ``slots * racks_per_domain`` racks, or ``domains`` < ``slots``.
    """
    racks = sorted({n.rack for n in fleet.nodes})
    if len(racks) < slots * racks_per_domain or domains < slots:
        raise ValueError(f"{domains} domains in {slots} lanes of {racks_per_domain} racks need "
                         f"{slots * racks_per_domain} racks and at least {slots} domains; the fleet has "
                         f"{len(racks)} racks")
    result = ChurnResult(domains, restarts * domains)
    stop = threading.Event()
    watching = threading.Event()
    watcher = threading.Thread(target=_watch_indexes, args=(fleet, result, stop, watching), daemon=True)
    watcher.start()
    watching.wait(30)
    controller_client = fleet.client(cdfleet.CONTROLLER_AGENT)
    membership = cdfleet.DradriverMembership()
    controller = threading.Thread(target=membership.controller, args=(fleet.namespace, controller_client, timing, stop),
                                  daemon=True)
    gone: set[str] = set()
    gc = threading.Thread(target=_gc, args=(fleet, gone, stop, timing.s(0.5)), daemon=True)
    controller.start()
    gc.start()
    stop.wait(timing.s(timing.controller_start_s))
    fleet.api.clear_requests()
    started = time.monotonic()
    rng = random.Random(seed)
    per_lane = [domains // slots + (1 if i < domains % slots else 0) for i in range(slots)]
    failures: list[str] = []

    def lane(i: int) -> None:
        mine = {racks[i * racks_per_domain + k] for k in range(racks_per_domain)}
        try:
            _lane(fleet, gone, i, [n for n in fleet.nodes if n.rack in mine], per_lane[i], restarts, timing,
                  random.Random(rng.random()), result, timeout_s)
        except Exception as exc:
            failures.append(f"lane {i}: {type(exc).__name__}: {exc}")

    lanes = [threading.Thread(target=lane, args=(i,), daemon=True) for i in range(slots)]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    result.seconds = time.monotonic() - started
    try:
        if failures:
            raise ChurnError("; ".join(failures))
        _wait("objects left behind", lambda: not leftovers(fleet), timeout_s, timing.s(0.5))
    except ChurnError as exc:
        left = leftovers(fleet)
        raise ChurnError(f"{exc}; left behind: {left[:10]}") from None
    finally:
        stop.set()
        controller.join(timeout=30)
        controller_client.close()
        watcher.join(timeout=10)
    records = fleet.api.requests
    writes = [r for r in records if r.verb in cdfleet.WRITE_VERBS and r.user_agent.startswith(("bench-node/",
                                                                                                 "bench-controller"))]
    result.writes = len(writes)
    result.node_writes = sum(1 for r in writes if r.user_agent.startswith("bench-node/"))
    result.controller_writes = result.writes - result.node_writes
    result.conflicts = sum(1 for r in records if r.code == 409)
    result.node_conflicts = sum(1 for r in records if r.code == 409 and r.user_agent.startswith("bench-node/"))
    if result.duplicates:
        raise ChurnError(f"{len(result.duplicates)} clique states with an index held twice; first: "
                         f"{result.duplicates[0]}")
    return result
