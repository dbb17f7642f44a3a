"""Conflict-free ComputeDomain membership (issue 14) against the API emulator over real HTTP: daemons apply only
their own clique entry (:class:`dradriver.computedomain.daemon.Membership`, in-process, no ``nvidia-imex``), the
controller assigns indexes, clears the entries of failed nodes keeping their index, and aggregates
``status.nodes``; churn of domains and daemon restarts leaves nothing behind and never gives an index twice."""

from __future__ import annotations

import contextlib
import functools
import secrets
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from dradriver.computedomain.controller import ComputeDomainController
from dradriver.computedomain.daemon import DaemonSettings, Membership, withdraw_entry
from dradriver.domain.computedomains import (
    LABEL_COMPUTE_DOMAIN,
    STATUS_NOT_READY,
    STATUS_READY,
    UNUSED_SLOT_IP,
    clique_object_name,
    dns_name,
)
from dradriver.kube.client import KubeClient
from dradriver.kube.leaderelection import LeaderElectionConfig, LeaderElector, candidate_identity
from dradriver.sandbox.apiserver import ApiServerEmulator
from tests.computedomain.controller_helpers import (
    CLIQUE,
    DRIVER_NS,
    GROUP,
    VERSION,
    clique_object,
    compute_domain,
    daemon_pod,
    entry,
    running,
    settings,
    wait_for,
)

NODES = ("node-a", "node-b", "node-c")


def _controller(client: KubeClient, **kw: Any) -> ComputeDomainController:
    return ComputeDomainController(client, settings(max_nodes_per_imex_domain=4), status_period_s=0.5,
                                   coalesce_s=0.02, **kw)


def _create(client: KubeClient, name: str) -> str:
    obj = client.custom.create_namespaced_custom_object(GROUP, VERSION, "default", "computedomains",
                                                       compute_domain(name, num_nodes=len(NODES)))
    return str(obj["metadata"]["uid"])


def _daemon(api: ApiServerEmulator, client: KubeClient, uid: str, node: str, tmp_path: Path, *,
            ready: bool = True, clique: str = CLIQUE) -> Membership:
    """A daemon pod of ``uid`` on ``node`` in ``clique`` (a fresh pod: new UID and IP, as after a restart; Ready or
    not) and its membership."""
    name = f"computedomain-daemon-{uid[:8]}-{node}"
    if api.get("Pod", name, DRIVER_NS) is not None:
        api.delete("Pod", name, DRIVER_NS)
    ip = f"10.{NODES.index(node) + 1}.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 1}"
    pod = daemon_pod(api, uid, node, ip, ready=ready, clique=clique)
    config = DaemonSettings(clique_id=clique, cd_uid=uid, cd_name="", cd_namespace="default", node_name=node,
                            pod_ip=ip, pod_uid=pod["metadata"]["uid"], pod_name=name, pod_namespace=DRIVER_NS,
                            max_nodes=4, imexd_dir=tmp_path)
    return Membership(client, config)


def _clique(api: ApiServerEmulator, uid: str, clique: str = CLIQUE) -> dict[str, Any] | None:
    return api.get("ComputeDomainClique", clique_object_name(uid, clique), DRIVER_NS)


def _status(api: ApiServerEmulator, name: str) -> dict[str, Any]:
    obj = api.get("ComputeDomain", name, "default")
    return dict((obj or {}).get("status") or {})


def _gone(api: ApiServerEmulator, kind: str, name: str, namespace: str) -> bool:
    return api.get(kind, name, namespace) is None


def _indexes(api: ApiServerEmulator, uid: str, clique_id: str = CLIQUE) -> dict[str, int]:
    clique = _clique(api, uid, clique_id) or {}
    return {d["nodeName"]: d["index"] for d in clique.get("daemons") or () if "index" in d}


def _converge(daemons: list[Membership]) -> None:
    """Step every daemon in parallel threads (their writes race, as daemons on different nodes do)."""
    threads = [threading.Thread(target=m.step) for m in daemons]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


def _ready(api: ApiServerEmulator, name: str, uid: str, daemons: list[Membership]) -> bool:
    _converge(daemons)
    status = _status(api, name)
    nodes = status.get("nodes") or []
    return (status.get("status") == STATUS_READY and len(nodes) == len(daemons)
            and all(n["index"] >= 0 for n in nodes) and all(m.mapping and sum(ip != UNUSED_SLOT_IP for ip in
                                                                               m.mapping.values()) == len(daemons)
                                                             for m in daemons))


def _set_ready(api: ApiServerEmulator, pod_name: str, ready: bool) -> None:
    """The kubelet's status update after the daemon pod's probe passed (or failed)."""
    pod = api.get("Pod", pod_name, DRIVER_NS)
    assert pod is not None
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    api.update(pod, subresource="status")


def _entry_statuses(api: ApiServerEmulator, uid: str) -> dict[str, str]:
    clique = _clique(api, uid) or {}
    return {d["nodeName"]: d.get("status", "") for d in clique.get("daemons") or ()}


def test_daemons_join_once_and_the_controller_writes_indexes_and_pod_readiness(api: ApiServerEmulator,
                                                                              client: KubeClient,
                                                                              tmp_path: Path) -> None:
    with running(_controller(client)):
        uid = _create(client, "cd1")
        daemons = [_daemon(api, client, uid, node, tmp_path, ready=False) for node in NODES]
        _converge(daemons)
        wait_for(lambda: len(_indexes(api, uid)) == 3, "the controller's indexes")
        assert sorted(_indexes(api, uid).values()) == [0, 1, 2]
        wait_for(lambda: _entry_statuses(api, uid) == dict.fromkeys(NODES, STATUS_NOT_READY), "entries NotReady")
        wait_for(lambda: _status(api, "cd1").get("status") == STATUS_NOT_READY, "cd1 NotReady")
        for m in daemons:  # the probes pass: the kubelet turns each pod Ready; the daemons write nothing
            _set_ready(api, m.settings.pod_name, True)
        wait_for(lambda: _ready(api, "cd1", uid, daemons), "cd1 Ready")
        assert _entry_statuses(api, uid) == dict.fromkeys(NODES, STATUS_READY)
        _set_ready(api, daemons[1].settings.pod_name, False)  # node-b's IMEX daemon stops answering its probe
        wait_for(lambda: _entry_statuses(api, uid)["node-b"] == STATUS_NOT_READY
                 and _status(api, "cd1").get("status") == STATUS_NOT_READY, "node-b NotReady")
        _set_ready(api, daemons[1].settings.pod_name, True)
        wait_for(lambda: _ready(api, "cd1", uid, daemons), "cd1 Ready again")
        for m in daemons:
            m.step()  # nothing changed: reads only
        assert [m.applied for m in daemons] == [1, 1, 1]  # the join only: the controller writes the status
        managers = {m["manager"]: m["operation"] for m in (_clique(api, uid) or {})["metadata"]["managedFields"]}
        assert managers == {**{f"compute-domain-daemon/{n}": "Apply" for n in NODES},
                            "compute-domain-controller": "Apply"}
        # every daemon maps every peer's index to its IP
        for m in daemons:
            assert m.mapping is not None
            for node, index in _indexes(api, uid).items():
                peer = next(d for d in daemons if d.settings.node_name == node)
                assert m.mapping[dns_name(uid, index)] == peer.settings.pod_ip


def test_churn_leaves_nothing_behind_and_never_gives_an_index_twice(api: ApiServerEmulator, client: KubeClient,
                                                                    tmp_path: Path) -> None:
    with running(_controller(client)):
        for round_ in range(2):
            uids = {f"churn{round_}-{i}": _create(client, f"churn{round_}-{i}") for i in range(3)}
            fleets = {name: [_daemon(api, client, uid, node, tmp_path) for node in NODES]
                      for name, uid in uids.items()}
            for fleet in fleets.values():
                _converge(fleet)
            for name, uid in uids.items():  # daemons restart mid-convergence: new pod, new IP, same node
                fleets[name][1] = _daemon(api, client, uid, NODES[1], tmp_path)
            for name, uid in uids.items():
                fleet = fleets[name]
                wait_for(functools.partial(_ready, api, name, uid, fleet), f"{name} Ready after churn")
                indexes = _indexes(api, uid)
                assert len(indexes) == 3 and len(set(indexes.values())) == 3, indexes
            first, first_uid = f"churn{round_}-0", uids[f"churn{round_}-0"]
            kept = dict(_indexes(api, first_uid))
            fleets[first][2] = _daemon(api, client, first_uid, NODES[2], tmp_path)
            fleet = fleets[first]
            wait_for(functools.partial(_ready, api, first, first_uid, fleet), "Ready after a restart")
            assert _indexes(api, first_uid) == kept  # a restarted daemon keeps its index
            for name, uid in uids.items():
                client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", name)
                for node in NODES:  # the DaemonSet's pods go with it
                    api.delete("Pod", f"computedomain-daemon-{uid[:8]}-{node}", DRIVER_NS)
            for name, uid in uids.items():
                wait_for(functools.partial(_gone, api, "ComputeDomain", name, "default"), f"{name} deleted")
                wait_for(functools.partial(_gone, api, "ComputeDomainClique", clique_object_name(uid, CLIQUE),
                                           DRIVER_NS), f"the clique of {name} deleted")
        left = [o for kind in ("DaemonSet", "ResourceClaimTemplate", "ComputeDomainClique")
                for o in api.objects(kind) if LABEL_COMPUTE_DOMAIN in ((o.get("metadata") or {}).get("labels") or {})]
        assert left == []


OTHER_CLIQUE = "abc9829a-0000-4000-8000-000000000001.7"
"""A second NVLink clique (another rack of the same cluster)."""


@pytest.mark.parametrize("withdrew", [False, True], ids=["node-rebooted", "daemon-stopped-cleanly"])
def test_a_node_moved_to_another_clique_leaves_the_old_clique_and_its_peers(api: ApiServerEmulator,
                                                                           client: KubeClient, tmp_path: Path,
                                                                           withdrew: bool) -> None:
    """node-b is moved to another rack: its new daemon pod is in another clique. The old clique drops node-b's
    entry (its address, or only the index reservation a clean stop leaves), so the old peers map node-b's former
    index to no address; node-b joins the new clique with an index there, and the domain lists it there once."""
    with running(_controller(client)):
        uid = _create(client, "cdm")
        daemons = [_daemon(api, client, uid, node, tmp_path) for node in NODES]
        wait_for(lambda: _ready(api, "cdm", uid, daemons), "cdm Ready")
        b_name = dns_name(uid, _indexes(api, uid)["node-b"])
        if withdrew:  # the old daemon stopped cleanly first: only the controller's index reservation stays
            withdraw_entry(client, daemons[1].settings)
        moved = _daemon(api, client, uid, "node-b", tmp_path, clique=OTHER_CLIQUE)  # the old pod is gone
        peers = [daemons[0], daemons[2]]

        def moved_over() -> bool:
            _converge([*peers, moved])
            old = _clique(api, uid) or {}
            # the moved daemon maps its new index once it has read the entry the controller indexed: a pass that
            # ran before the controller's may not have it yet (seen under load), so that is waited for too
            return ("node-b" not in {d["nodeName"] for d in old.get("daemons") or ()}
                    and _indexes(api, uid, OTHER_CLIQUE).get("node-b") == 0
                    and all(m.mapping is not None and m.mapping[b_name] == UNUSED_SLOT_IP for m in peers)
                    and moved.mapping is not None and moved.mapping.get(dns_name(uid, 0)) == moved.settings.pod_ip)

        wait_for(moved_over, "node-b out of the old clique and in the new one")
        assert sorted(_indexes(api, uid).items()) == [("node-a", 0), ("node-c", 2)]  # the others keep theirs
        assert moved.mapping is not None and moved.mapping[dns_name(uid, 0)] == moved.settings.pod_ip
        wanted = [("node-a", CLIQUE, 0), ("node-b", OTHER_CLIQUE, 0), ("node-c", CLIQUE, 2)]
        wait_for(lambda: [(n["name"], n["cliqueID"], n["index"]) for n in _status(api, "cdm").get("nodes") or ()]
                 == wanted and _status(api, "cdm").get("status") == STATUS_READY,
                 "cdm Ready, listing node-b once, in its new clique")


def _lease(api: ApiServerEmulator, node: str, age_s: float) -> None:
    stamp = (datetime.now(UTC) - timedelta(seconds=age_s)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = api.get("Lease", node, "kube-node-lease")
    if lease is None:
        api.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": node, "namespace": "kube-node-lease"},
                    "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": stamp}})
    else:
        lease["spec"]["renewTime"] = stamp
        api.update(lease)


@contextlib.contextmanager
def heartbeats(api: ApiServerEmulator) -> Iterator[set[str]]:
    """Renew the node Leases of the nodes in the yielded set every 0.1 s (the kubelets that are alive)."""
    alive = set(NODES)
    for node in NODES:
        _lease(api, node, 0.0)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            for node in sorted(alive):
                _lease(api, node, 0.0)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield alive
    finally:
        stop.set()
        thread.join(timeout=5)


def test_a_failed_node_leaves_its_peers_mapping_and_keeps_its_index(api: ApiServerEmulator, client: KubeClient,
                                                                    tmp_path: Path) -> None:
    """The controller's side, seeded clique (no daemon): node-b's Lease stops being renewed -> its daemon fields
    are cleared, its index stays, the domain's status lists the two live members only."""
    with heartbeats(api) as alive, running(_controller(client, node_grace_s=1.0, node_check_s=0.1)):
        uid = _create(client, "cdf")
        for i, node in enumerate(NODES):
            daemon_pod(api, uid, node, f"10.0.0.{i + 1}")
        api.create(clique_object(uid, [entry(node, f"10.0.0.{i + 1}", i) for i, node in enumerate(NODES)]))
        wait_for(lambda: len(_status(api, "cdf").get("nodes") or []) == 3, "three members")
        alive.discard("node-b")  # node-b's kubelet stops renewing
        wait_for(lambda: [n["name"] for n in _status(api, "cdf").get("nodes") or []] == ["node-a", "node-c"],
                 "node-b dropped")
        clique = _clique(api, uid)
        assert clique is not None
        b = next(d for d in clique["daemons"] if d["nodeName"] == "node-b")
        assert b.get("index") == 1 and not b.get("ipAddress")  # reservation kept, daemon fields gone
        assert _status(api, "cdf")["status"] == STATUS_READY  # the live members are all Ready


def test_a_healed_node_returns_with_the_same_index_and_name(api: ApiServerEmulator, client: KubeClient,
                                                            tmp_path: Path) -> None:
    """Full round trip with daemons: node-b fails (Lease not renewed) -> gone from its peers' mapping; it heals
    and its daemon re-applies -> the same index and DNS name, mapped again on its peers."""
    with heartbeats(api) as alive, running(_controller(client, node_grace_s=1.0, node_check_s=0.1)):
        uid = _create(client, "cdh")
        daemons = [_daemon(api, client, uid, node, tmp_path) for node in NODES]
        wait_for(lambda: _ready(api, "cdh", uid, daemons), "cdh Ready")
        before = _indexes(api, uid)
        b_name = dns_name(uid, before["node-b"])
        alive.discard("node-b")  # node-b and its daemon stop answering: the daemon does not step meanwhile
        peers = [daemons[0], daemons[2]]

        def peers_dropped_b() -> bool:
            _converge(peers)
            return all(m.mapping is not None and m.mapping[b_name] == UNUSED_SLOT_IP for m in peers)

        wait_for(peers_dropped_b, "node-b gone from its peers' mapping")
        alive.add("node-b")  # healed: the daemon resumes its loop
        wait_for(lambda: _ready(api, "cdh", uid, daemons), "cdh Ready again")
        assert _indexes(api, uid) == before
        for m in peers:
            assert m.mapping is not None and m.mapping[b_name] == daemons[1].settings.pod_ip


def _elected(client: KubeClient, pod: str, controller: ComputeDomainController,
             stop: threading.Event) -> threading.Thread:
    cfg = LeaderElectionConfig(namespace=DRIVER_NS, name="dradriver-compute-domain-controller",
                               identity=candidate_identity(pod), lease_duration_s=15, renew_deadline_s=10,
                               retry_period_s=0.2)
    thread = threading.Thread(target=LeaderElector(client, cfg).run, args=(controller.run, stop), daemon=True)
    thread.start()
    return thread


def test_a_new_leader_finishes_membership_the_old_one_left_converging(api: ApiServerEmulator, client: KubeClient,
                                                                      tmp_path: Path) -> None:
    """Leader a assigns the first daemons' indexes and stops (releasing the Lease); a daemon joins with no leader;
    b takes over and gives it the next index without moving the others."""
    a, b = _controller(client), _controller(client)
    stop_a, stop_b = threading.Event(), threading.Event()
    runner_a = _elected(client, "controller-a", a, stop_a)
    try:
        uid = _create(client, "cdl")
        daemons = [_daemon(api, client, uid, node, tmp_path) for node in NODES[:2]]
        _converge(daemons)
        wait_for(lambda: len(_indexes(api, uid)) == 2, "a's indexes")
        before = _indexes(api, uid)
    finally:
        stop_a.set()
        runner_a.join(timeout=30)
    assert not runner_a.is_alive()
    daemons.append(_daemon(api, client, uid, NODES[2], tmp_path))
    _converge(daemons)  # joins while nobody leads: no index yet
    assert NODES[2] not in _indexes(api, uid)
    runner_b = _elected(client, "controller-b", b, stop_b)
    try:
        wait_for(lambda: _ready(api, "cdl", uid, daemons), "cdl Ready under b")
        after = _indexes(api, uid)
        assert {k: after[k] for k in before} == before and sorted(after.values()) == [0, 1, 2]
        assert b.index_applies >= 1
    finally:
        stop_b.set()
        runner_b.join(timeout=30)


def test_the_daemon_hears_its_index_through_the_clique_watch_without_polling(api: ApiServerEmulator,
                                                                             client: KubeClient,
                                                                             tmp_path: Path) -> None:
    from dataclasses import replace

    from dradriver.computedomain.daemon import READ, CliqueWatch

    with running(_controller(client)):
        uid = _create(client, "cdw")
        m = _daemon(api, client, uid, "node-a", tmp_path, ready=False)
        m.settings = replace(m.settings, poll_interval_s=60.0, resync_s=60.0)  # a poll would come far too late
        m.step()
        watch = CliqueWatch(client, m.settings)
        watch.start(m.resource_version)
        stop = threading.Event()
        thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
        thread.start()
        try:
            observed = watch.wait(stop)  # the controller's index apply arrives as an event, well before 60 s
            assert observed is not READ and watch.up
            m.step(observed)
            while m.mapping is not None and m.settings.pod_ip not in m.mapping.values():
                m.step(watch.wait(stop))
            assert m.settings.pod_ip in (m.mapping or {}).values()
            assert (m.applied, m.reads) == (1, 0)  # one apply, no GET: the watch brought every change
            stale = {"metadata": {"resourceVersion": "1"}, "daemons": []}
            m.step(stale)  # an event older than what the daemon has seen is not acted on (no second apply)
            assert m.applied == 1
        finally:
            stop.set()


def test_a_failed_clique_watch_falls_back_to_the_poll(api: ApiServerEmulator, client: KubeClient, tmp_path: Path,
                                                      monkeypatch: Any) -> None:
    from dataclasses import replace

    from dradriver.computedomain import daemon as cddaemon
    from dradriver.kube import errors as kube_errors

    uid = _create(client, "cdf")
    m = _daemon(api, client, uid, "node-a", tmp_path)
    m.settings = replace(m.settings, poll_interval_s=0.05, resync_s=60.0)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise kube_errors.KubeAPIError("WATCH computedomaincliques", status=500)

    monkeypatch.setattr(cddaemon.kube_cd, "watch_cliques", broken)
    watch = cddaemon.CliqueWatch(m.client, m.settings)
    watch.start("")
    assert watch.up and watch.period_s() == 60.0
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: not watch.up, "the watch taken for down")
        assert watch.period_s() == 0.05 and watch.wait(stop) is cddaemon.READ  # the poll period: read the clique
    finally:
        stop.set()
        thread.join(timeout=5)


def test_an_unexpected_failure_in_the_clique_watch_falls_back_to_the_poll_and_the_watch_comes_back(
        api: ApiServerEmulator, client: KubeClient, tmp_path: Path, monkeypatch: Any) -> None:
    """A malformed event (an object that is not a mapping) breaks the watch request, not the watch thread: the
    daemon polls meanwhile, and the next watch request brings the clique again."""
    from dataclasses import replace

    from dradriver.computedomain import daemon as cddaemon

    uid = _create(client, "cdm")
    m = _daemon(api, client, uid, "node-a", tmp_path)
    m.settings = replace(m.settings, poll_interval_s=0.05, resync_s=60.0)
    m.step()
    real = cddaemon.kube_cd.watch_cliques
    calls: list[str] = []

    def first_malformed(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[3])
        if len(calls) == 1:
            yield {"type": "MODIFIED", "object": ["not", "a", "clique"]}
            return
        yield from real(*args, **kwargs)

    monkeypatch.setattr(cddaemon.kube_cd, "watch_cliques", first_malformed)
    watch = cddaemon.CliqueWatch(m.client, m.settings, retry_s=0.05)
    watch.start(m.resource_version)
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(calls) >= 2, "the watch retried after the malformed event")
        assert thread.is_alive()
        # the daemon's own entry changes (a new pod IP): the second watch request carries the event
        moved = replace(m.settings, pod_ip="10.0.9.9")
        cddaemon.Membership(m.client, moved).step()
        wait_for(lambda: watch.pending(), "an event through the watch after the failure")
        observed = watch.take()
        assert isinstance(observed, dict) and watch.up
        assert "10.0.9.9" in {d.get("ipAddress") for d in observed.get("daemons", [])}
    finally:
        stop.set()
        thread.join(timeout=5)
