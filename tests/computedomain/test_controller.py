"""The compute-domain controller against the API emulator (real HTTP, the official client, the bundled CRDs):
finalizer, the daemon and workload ResourceClaimTemplates, the DaemonSet exactly as templated, global status from
clique objects, deletion in NVIDIA's order leaving nothing behind, the stale sweep, host-managed mode."""

from __future__ import annotations

import logging
import re
import urllib.parse
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes
import pytest

from dradriver.computedomain import controller as cdcontroller
from dradriver.computedomain.controller import ComputeDomainController
from dradriver.domain.cdtemplates import (
    IMEX_MODE_HOST_MANAGED,
    daemon_claim_template,
    daemon_set,
    workload_claim_template,
)
from dradriver.domain.computedomains import FINALIZER, LABEL_COMPUTE_DOMAIN, ComputeDomain, daemon_object_name
from dradriver.domain.featuregates import DEFAULT_GATES
from dradriver.kube.client import KubeClient
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.workloads import FINALIZER as KUBELET  # the container runtime's: a kubelet's graceful stop
from tests.computedomain.controller_helpers import (
    DRIVER_NS,
    GROUP,
    VERSION,
    clique_object,
    compute_domain,
    daemon_pod,
    entry,
    nvidia_compute_domain,
    running,
    settings,
    wait_for,
)


def _controller(client: KubeClient, **kw: Any) -> ComputeDomainController:
    return ComputeDomainController(client, settings(**kw), status_period_s=0.05)


def _create(client: KubeClient, obj: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    out: dict[str, Any] = client.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "computedomains",
                                                                        obj)
    return out


def _cd(api: ApiServerEmulator, name: str, namespace: str = "default") -> dict[str, Any] | None:
    return api.get("ComputeDomain", name, namespace)


def _status(api: ApiServerEmulator, name: str) -> dict[str, Any]:
    cd = _cd(api, name)
    assert cd is not None
    return dict(cd.get("status") or {})


def _owned_pod(api: ApiServerEmulator, ds: dict[str, Any], node: str, ip: str, *,
               kubelet: bool = True) -> dict[str, Any]:
    """A daemon pod of ``ds`` on ``node`` as the DaemonSet controller makes it (owned by the DaemonSet), running
    under its kubelet when ``kubelet``: the kubelet's finalizer stands for graceful termination (the pod stays, being
    deleted, until its containers have stopped)."""
    meta = ds["metadata"]
    pod = daemon_pod(api, meta["labels"][LABEL_COMPUTE_DOMAIN], node, ip)
    pod["metadata"]["namespace"] = meta["namespace"]
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": meta["name"],
                                           "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]
    pod["metadata"]["finalizers"] = [KUBELET] if kubelet else []
    api.delete("Pod", pod["metadata"]["name"], DRIVER_NS)
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        pod["metadata"].pop(key, None)
    return api.create(pod)


def _containers_stopped(api: ApiServerEmulator, pod: dict[str, Any]) -> None:
    """The kubelet has stopped the pod's containers: its finalizer goes, and with it the pod being deleted."""
    stored = api.get("Pod", pod["metadata"]["name"], pod["metadata"]["namespace"])
    assert stored is not None and stored["metadata"].get("deletionTimestamp")
    stored["metadata"]["finalizers"] = []
    api.update(stored)


def test_a_new_domain_gets_its_finalizer_templates_and_daemonset(api: ApiServerEmulator, client: KubeClient) -> None:
    controller = _controller(client)
    with running(controller):
        made = _create(client, nvidia_compute_domain())  # NVIDIA's imex-channel-injection, unchanged
        uid = made["metadata"]["uid"]
        ds = wait_for(lambda: api.get("DaemonSet", daemon_object_name(uid), DRIVER_NS), "the DaemonSet")
        workload = wait_for(lambda: api.get("ResourceClaimTemplate", "imex-channel-0", "default"), "workload RCT")
        wait_for(lambda: _status(api, "imex-channel-injection").get("status"), "a status")
    stored = _cd(api, "imex-channel-injection")
    assert stored is not None and stored["metadata"]["finalizers"] == [FINALIZER]
    cd = ComputeDomain.from_object(stored)
    # the DaemonSet and both templates exactly as templated (the API server adds only its own fields)
    expected_ds = daemon_set(cd, settings())
    assert ds["spec"] == expected_ds["spec"]
    assert {k: ds["metadata"][k] for k in ("name", "namespace", "labels", "finalizers")} == expected_ds["metadata"]
    daemon_rct = api.get("ResourceClaimTemplate", daemon_object_name(uid), DRIVER_NS)
    assert daemon_rct is not None
    expected = daemon_claim_template(cd, settings())
    assert daemon_rct["spec"] == expected["spec"]
    assert daemon_rct["metadata"]["labels"] == {LABEL_COMPUTE_DOMAIN: uid,
                                                "resource.nvidia.com/computeDomainTarget": "Daemon"}
    assert workload["spec"] == workload_claim_template(cd, settings())["spec"]
    assert workload["metadata"]["finalizers"] == [FINALIZER]
    assert workload["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"] == {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": uid,
        "allocationMode": "Single"}
    # numNodes 1 and no daemon yet: NotReady
    assert _status(api, "imex-channel-injection") == {"status": "NotReady"}


def test_reconcile_is_idempotent(api: ApiServerEmulator, client: KubeClient) -> None:
    controller = _controller(client)
    _create(client, compute_domain("cd1", template="cd1-tpl", mode="All"))
    controller.reconcile(("default", "cd1"))
    before = {(o["kind"], o["metadata"]["name"]): o["metadata"]["resourceVersion"]
              for kind in ("DaemonSet", "ResourceClaimTemplate", "ComputeDomain") for o in api.objects(kind)}
    api.clear_requests()
    controller.reconcile(("default", "cd1"))
    after = {(o["kind"], o["metadata"]["name"]): o["metadata"]["resourceVersion"]
             for kind in ("DaemonSet", "ResourceClaimTemplate", "ComputeDomain") for o in api.objects(kind)}
    assert after == before  # nothing rewritten
    assert api.count("create") == 0  # reads only: nothing is missing
    assert api.count("update") == 0
    workload = api.get("ResourceClaimTemplate", "cd1-tpl", "default")
    assert workload is not None
    assert workload["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"] == "All"


def test_global_status_follows_the_cliques(api: ApiServerEmulator, client: KubeClient) -> None:
    controller = _controller(client)
    with running(controller):
        uid = _create(client, compute_domain("cd2", num_nodes=2))["metadata"]["uid"]
        wait_for(lambda: _status(api, "cd2").get("status") == "NotReady", "NotReady with no daemon")
        daemon_pod(api, uid, "node-a", "10.0.0.1")
        b_pod = daemon_pod(api, uid, "node-b", "10.0.0.2", ready=False)
        # an entry's status is the controller's copy of its daemon pod's Ready condition: node-b's "Ready" (as an
        # older daemon would have written it) is corrected to its pod's NotReady
        api.create(clique_object(uid, [entry("node-a", "10.0.0.1", 0), entry("node-b", "10.0.0.2", 1, "Ready")]))
        # wait for both entries settled (a pass that ran before the pod watch delivered node-a's Ready pod lists
        # node-a NotReady for a moment)
        nodes = wait_for(lambda: (n := _status(api, "cd2").get("nodes")) and n[-1]["status"] == "NotReady"
                         and n[0]["status"] == "Ready" and n, "status.nodes")
        assert [(n["name"], n["index"], n["status"]) for n in nodes] == [("node-a", 0, "Ready"),
                                                                         ("node-b", 1, "NotReady")]
        assert _status(api, "cd2")["status"] == "NotReady"
        clique = api.get("ComputeDomainClique", f"{uid}.abc9829a-0000-4000-8000-000000000001.2", DRIVER_NS)
        assert clique is not None and [d["status"] for d in clique["daemons"]] == ["Ready", "NotReady"]
        b_pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]  # node-b's probe passes
        api.update(b_pod, subresource="status")
        wait_for(lambda: _status(api, "cd2").get("status") == "Ready", "Ready with two Ready daemons")
        # node-b's daemon pod goes away: its clique entry is pruned; numNodes (2) is advisory (elastic domains), so
        # the one Ready member left keeps the domain Ready
        api.delete("Pod", f"computedomain-daemon-{uid[:8]}-node-b", DRIVER_NS)
        wait_for(lambda: [n["name"] for n in _status(api, "cd2").get("nodes") or []] == ["node-a"], "pruned node-b")
        assert _status(api, "cd2")["status"] == "Ready"
        assert _status(api, "cd2")["nodes"][0]["status"] == "Ready"
        pruned = api.get("ComputeDomainClique", clique["metadata"]["name"], DRIVER_NS)
        assert pruned is not None and [d["nodeName"] for d in pruned["daemons"]] == ["node-a"]
        # a daemon on a node in no clique counts from its pod: index -1, Ready from the pod's condition
        daemon_pod(api, uid, "node-c", "10.0.0.3", clique="")
        wait_for(lambda: len(_status(api, "cd2").get("nodes") or []) == 2, "the non-fabric node listed")
        assert _status(api, "cd2")["status"] == "Ready"
        assert _status(api, "cd2")["nodes"][-1] == {"name": "node-c", "ipAddress": "10.0.0.3", "cliqueID": "",
                                                    "index": -1, "status": "Ready"}


def test_numnodes_zero_is_ready_without_daemons(api: ApiServerEmulator, client: KubeClient) -> None:
    controller = _controller(client)
    with running(controller):
        _create(client, compute_domain("cd0"))
        wait_for(lambda: _status(api, "cd0").get("status") == "Ready", "Ready (numNodes 0: NVIDIA's rule)")


def test_deletion_leaves_nothing_while_claims_still_exist(api: ApiServerEmulator, client: KubeClient) -> None:
    controller = _controller(client)
    with running(controller):
        uid = _create(client, compute_domain("cd3", num_nodes=1, template="cd3-channel"))["metadata"]["uid"]
        ds = wait_for(lambda: api.get("DaemonSet", daemon_object_name(uid), DRIVER_NS), "the DaemonSet")
        wait_for(lambda: api.get("ResourceClaimTemplate", "cd3-channel", "default"), "the workload template")
        # what the plugin and the daemons add meanwhile: node labels, a clique, a workload claim in use
        for node in ("node-a", "node-b"):
            labelled = api.get("Node", node)
            assert labelled is not None
            labelled["metadata"]["labels"][LABEL_COMPUTE_DOMAIN] = uid
            api.update(labelled)
        other = api.get("Node", "node-c")
        assert other is not None
        other["metadata"]["labels"][LABEL_COMPUTE_DOMAIN] = "another-domain"
        api.update(other)
        _owned_pod(api, ds, "node-a", "10.0.0.1", kubelet=False)  # goes with its DaemonSet
        api.create(clique_object(uid, [entry("node-a", "10.0.0.1", 0)]))
        claim = api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                            "metadata": {"name": "worker-0-channel", "namespace": "default"},
                            "spec": workload_claim_template(ComputeDomain.from_object(_cd(api, "cd3") or {}),
                                                            settings())["spec"]["spec"]})
        client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd3")
        wait_for(lambda: _cd(api, "cd3") is None, "the ComputeDomain to go")
    assert api.objects("DaemonSet") == []
    assert api.objects("ResourceClaimTemplate") == []
    assert api.objects("ComputeDomainClique") == [] and api.objects("Pod") == []
    labels = {n["metadata"]["name"]: n["metadata"]["labels"].get(LABEL_COMPUTE_DOMAIN) for n in api.objects("Node")}
    assert labels == {"node-a": None, "node-b": None, "node-c": "another-domain"}
    assert api.get("ResourceClaim", claim["metadata"]["name"], "default") is not None  # claims are not ours


def test_the_stale_sweep_removes_objects_of_gone_domains(api: ApiServerEmulator, client: KubeClient) -> None:
    controller = _controller(client)
    live_uid = _create(client, compute_domain("live"))["metadata"]["uid"]
    controller.reconcile(("default", "live"))
    gone = ComputeDomain(name="gone", namespace="default", uid="00000000-dead-4000-8000-000000000000",
                         template_name="gone-channel")
    for obj in (daemon_set(gone, settings()), daemon_claim_template(gone, settings()),
                workload_claim_template(gone, settings())):
        api.create(obj)
    node = api.get("Node", "node-b")
    assert node is not None
    node["metadata"]["labels"][LABEL_COMPUTE_DOMAIN] = gone.uid
    api.update(node)
    api.create(clique_object(gone.uid, [entry("node-b", "10.0.0.2", 0)]))
    api.create(clique_object(live_uid, [entry("node-a", "10.0.0.1", 0)]))
    controller.sweep()
    assert [d["metadata"]["name"] for d in api.objects("DaemonSet")] == [daemon_object_name(live_uid)]
    assert sorted(t["metadata"]["name"] for t in api.objects("ResourceClaimTemplate")) == sorted(
        [daemon_object_name(live_uid), "live-channel"])
    assert [c["metadata"]["name"].split(".")[0] for c in api.objects("ComputeDomainClique")] == [live_uid]
    stored = api.get("Node", "node-b")
    assert stored is not None and LABEL_COMPUTE_DOMAIN not in stored["metadata"]["labels"]


def test_host_managed_mode_makes_only_the_workload_template(api: ApiServerEmulator, client: KubeClient) -> None:
    gates = DEFAULT_GATES.with_gates(HostManagedIMEXDaemon=True)
    controller = _controller(client, imex_mode=IMEX_MODE_HOST_MANAGED, feature_gates=gates)
    with running(controller):
        _create(client, nvidia_compute_domain("channel-injection-all.yaml"))
        wait_for(lambda: _status(api, "imex-channel-injection-all").get("status") == "Ready", "Ready")
    stored = _cd(api, "imex-channel-injection-all")
    assert stored is not None and stored["metadata"]["finalizers"] == [FINALIZER]
    assert api.objects("DaemonSet") == []
    [workload] = api.objects("ResourceClaimTemplate")
    assert (workload["metadata"]["namespace"], workload["metadata"]["name"]) == ("default", "tpl-imex-channels")
    # allocationMode All is forced to Single on host-managed IMEX (NVIDIA 7.3)
    assert workload["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"] == "Single"
    with running(controller):
        client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains",
                                                      "imex-channel-injection-all")
        wait_for(lambda: _cd(api, "imex-channel-injection-all") is None, "the ComputeDomain to go")
    assert api.objects("ResourceClaimTemplate") == []


def test_a_template_name_taken_by_another_domain_is_retried_not_stolen(api: ApiServerEmulator,
                                                                       client: KubeClient) -> None:
    controller = _controller(client)
    _create(client, compute_domain("first", template="shared"))
    controller.reconcile(("default", "first"))
    _create(client, compute_domain("second", template="shared"))
    with pytest.raises(Exception, match="belongs to ComputeDomain uid"):
        controller.reconcile(("default", "second"))
    first = _cd(api, "first")
    template = api.get("ResourceClaimTemplate", "shared", "default")
    assert first is not None and template is not None
    assert template["metadata"]["labels"][LABEL_COMPUTE_DOMAIN] == first["metadata"]["uid"]


def test_a_domain_in_another_namespace_gets_its_workload_template_there(api: ApiServerEmulator,
                                                                        client: KubeClient) -> None:
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"},
                "status": {"phase": "Active"}})
    controller = _controller(client)
    uid = _create(client, compute_domain("cd4"), namespace="team-a")["metadata"]["uid"]
    controller.reconcile(("team-a", "cd4"))
    assert api.get("ResourceClaimTemplate", "cd4-channel", "team-a") is not None
    assert api.get("ResourceClaimTemplate", daemon_object_name(uid), DRIVER_NS) is not None
    with pytest.raises(kubernetes.client.ApiException):
        client.resource.read_namespaced_resource_claim_template("cd4-channel", "default")


def test_the_sweep_runs_at_start(api: ApiServerEmulator, client: KubeClient) -> None:
    gone = ComputeDomain(name="gone", namespace="default", uid="00000000-dead-4000-8000-000000000001",
                         template_name="gone-channel")
    api.create(daemon_set(gone, settings()))
    api.create(workload_claim_template(gone, settings()))
    controller = ComputeDomainController(client, settings(), status_period_s=0.05, cleanup_period_s=3600)
    with running(controller):
        wait_for(lambda: not api.objects("DaemonSet") and not api.objects("ResourceClaimTemplate"),
                 "the start-up sweep")


def test_a_daemonset_in_an_additional_namespace_is_used_not_duplicated(api: ApiServerEmulator,
                                                                       client: KubeClient) -> None:
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "legacy"},
                "status": {"phase": "Active"}})
    uid = _create(client, compute_domain("cd5"))["metadata"]["uid"]
    cd = ComputeDomain.from_object(_cd(api, "cd5") or {})
    legacy = settings(namespace="legacy")
    api.create(daemon_set(cd, legacy))
    controller = ComputeDomainController(client, settings(), additional_namespaces=("legacy",))
    controller.reconcile(("default", "cd5"))
    assert [(d["metadata"]["namespace"], d["metadata"]["name"]) for d in api.objects("DaemonSet")] == [
        ("legacy", daemon_object_name(uid))]
    assert api.get("ResourceClaimTemplate", daemon_object_name(uid), DRIVER_NS) is not None  # made where it lives
    client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd5")
    controller.reconcile(("default", "cd5"))
    assert api.objects("DaemonSet") == [] and _cd(api, "cd5") is None


def test_a_deleted_daemonset_or_template_is_recreated_at_once(api: ApiServerEmulator, client: KubeClient) -> None:
    """The controller watches its own DaemonSets and templates: one deleted while its domain lives (held by the
    controller's finalizer, so only marked deleting) is released and recreated without waiting for the 10-min
    re-list (resync_s is left at its default here)."""
    controller = ComputeDomainController(client, settings(), status_period_s=0.05)
    with running(controller):
        uid = _create(client, compute_domain("cd7", num_nodes=1, template="cd7-channel"))["metadata"]["uid"]
        name = daemon_object_name(uid)
        targets = [("DaemonSet", name, DRIVER_NS), ("ResourceClaimTemplate", name, DRIVER_NS),
                   ("ResourceClaimTemplate", "cd7-channel", "default")]
        for kind, obj_name, ns in targets:
            first = wait_for(lambda k=kind, n=obj_name, s=ns: api.get(k, n, s), f"{kind} {obj_name}")
            old_uid = first["metadata"]["uid"]
            if kind == "DaemonSet":
                client.apps.delete_namespaced_daemon_set(obj_name, ns)
            else:
                client.resource.delete_namespaced_resource_claim_template(obj_name, ns)

            def recreated(k: str = kind, n: str = obj_name, s: str = ns, old: str = old_uid) -> bool:
                obj = api.get(k, n, s)
                return (obj is not None and obj["metadata"]["uid"] != old
                        and not obj["metadata"].get("deletionTimestamp"))

            wait_for(recreated, f"{kind} {ns}/{obj_name} recreated")
            again = api.get(kind, obj_name, ns)
            assert again is not None and again["metadata"]["finalizers"] == [FINALIZER]
            assert again["metadata"]["labels"][LABEL_COMPUTE_DOMAIN] == uid
    assert controller.resync_s == 600.0


def test_a_daemonset_readiness_change_recomputes_the_status_at_once(api: ApiServerEmulator,
                                                                     client: KubeClient) -> None:
    """A DaemonSet whose numberReady changes has its domain's status recomputed from the nodes right away (the
    status loop is slowed down here, so only the DaemonSet event can make the domain Ready)."""
    controller = ComputeDomainController(client, settings(), status_period_s=600.0)
    with running(controller):
        uid = _create(client, compute_domain("cd8", num_nodes=1))["metadata"]["uid"]
        ds = wait_for(lambda: api.get("DaemonSet", daemon_object_name(uid), DRIVER_NS), "the DaemonSet")
        wait_for(lambda: _status(api, "cd8").get("status") == "NotReady", "NotReady")
        daemon_pod(api, uid, "node-a", "10.0.0.1")
        api.create(clique_object(uid, [entry("node-a", "10.0.0.1", 0)]))
        assert _status(api, "cd8").get("status") == "NotReady"  # nothing recomputed it yet
        ds["status"] = {"numberReady": 1, "desiredNumberScheduled": 1}
        api.update(ds, subresource="status")
        wait_for(lambda: _status(api, "cd8").get("status") == "Ready", "Ready after the DaemonSet event")
        assert [(n["name"], n["status"]) for n in _status(api, "cd8")["nodes"]] == [("node-a", "Ready")]


def test_the_full_resync_walks_the_domains_a_batch_at_a_time(api: ApiServerEmulator, client: KubeClient,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 14 (compute_domain_fleet): the resync must not hold the whole fleet's pods at once; with batches of 2,
    # five domains take three pod lists and three clique lists, each selecting only its batch's domains
    monkeypatch.setattr(cdcontroller, "MEMBERSHIP_BATCH", 2)
    uids = []
    for i in range(5):
        manifest = compute_domain(f"cd{i}", num_nodes=1)
        manifest["metadata"]["finalizers"] = [FINALIZER]
        uid = _create(client, manifest)["metadata"]["uid"]
        uids.append(uid)
        daemon_pod(api, uid, f"node-{i}", f"10.0.0.{i + 1}")
        api.create(clique_object(uid, [entry(f"node-{i}", f"10.0.0.{i + 1}", 0)]))
    controller = _controller(client)
    api.clear_requests()
    controller.sync_all_status()
    for i in range(5):
        assert [(n["name"], n["status"]) for n in _status(api, f"cd{i}")["nodes"]] == [(f"node-{i}", "Ready")]
        assert _status(api, f"cd{i}")["status"] == "Ready"
    pod_lists = [urllib.parse.unquote_plus(r.query) for r in api.requests if r.verb == "list" and r.resource == "pods"]
    assert len(pod_lists) == 3
    selected = [re.findall(r"[0-9a-f-]{36}", q) for q in pod_lists]
    assert sorted(u for batch in selected for u in batch) == sorted(uids) and all(len(b) <= 2 for b in selected)
    assert api.count("list", "computedomaincliques") == 3
    # the domains themselves come a batch per page as well (the resync holds one page of them at a time)
    assert api.count("list", "computedomains") == 3
    assert all("limit=2" in r.query for r in api.requests if r.verb == "list" and r.resource == "computedomains")
    assert all("limit=500" in r.query for r in api.requests if r.verb == "list" and r.resource != "computedomains")


def test_the_finalizer_stays_until_the_daemon_pods_are_gone(api: ApiServerEmulator, client: KubeClient,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Deleting the domain deletes its DaemonSet; the garbage collector then deletes the daemon pods, which stay
    while their kubelet stops the containers. The domain keeps its finalizer (and its clique) until they are gone."""
    caplog.set_level(logging.WARNING, logger=cdcontroller.__name__)
    controller = _controller(client)
    with running(controller):
        uid = _create(client, compute_domain("cd10", num_nodes=1))["metadata"]["uid"]
        ds = wait_for(lambda: api.get("DaemonSet", daemon_object_name(uid), DRIVER_NS), "the DaemonSet")
        pod = _owned_pod(api, ds, "node-a", "10.0.0.1")
        api.create(clique_object(uid, [entry("node-a", "10.0.0.1", 0)]))
        client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd10")
        wait_for(lambda: any("daemon pod(s) of the domain still exist" in r.getMessage() for r in caplog.records),
                 "the controller waiting for the daemon pod")
        assert api.get("DaemonSet", daemon_object_name(uid), DRIVER_NS) is None
        stored = _cd(api, "cd10")
        assert stored is not None and stored["metadata"]["finalizers"] == [FINALIZER]
        assert len(api.objects("ComputeDomainClique")) == 1  # a terminating daemon may still write its entry
        _containers_stopped(api, pod)
        wait_for(lambda: _cd(api, "cd10") is None, "the ComputeDomain to go once its daemon pod is gone")
    assert api.objects("Pod") == [] and api.objects("ComputeDomainClique") == []


def test_a_reinstall_in_another_namespace_retires_the_old_installs_objects(api: ApiServerEmulator,
                                                                           client: KubeClient) -> None:
    """An install in ``old-install`` made a live domain's DaemonSet, daemon template and clique, then went away;
    the install in the driver namespace (no ``--additional-namespaces``) deletes them, so exactly one DaemonSet
    serves the domain, and nothing of the old install is left."""
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "old-install"},
                "status": {"phase": "Active"}})
    uid = _create(client, compute_domain("cd11", num_nodes=1, template="cd11-channel"))["metadata"]["uid"]
    ComputeDomainController(client, settings(namespace="old-install")).reconcile(("default", "cd11"))
    old_ds = api.get("DaemonSet", daemon_object_name(uid), "old-install")
    assert old_ds is not None and api.get("ResourceClaimTemplate", daemon_object_name(uid), "old-install")
    pod = _owned_pod(api, old_ds, "node-a", "10.0.0.1")
    clique = clique_object(uid, [entry("node-a", "10.0.0.1", 0)])
    clique["metadata"]["namespace"] = "old-install"
    api.create(clique)
    workload = api.get("ResourceClaimTemplate", "cd11-channel", "default")
    assert workload is not None

    def labelled(kind: str) -> list[tuple[str, str]]:
        return sorted((o["metadata"]["namespace"], o["metadata"]["name"]) for o in api.objects(kind)
                      if (o["metadata"].get("labels") or {}).get(LABEL_COMPUTE_DOMAIN) == uid)

    with running(_controller(client)):
        wait_for(lambda: labelled("DaemonSet") == [(DRIVER_NS, daemon_object_name(uid))], "one DaemonSet")
        wait_for(lambda: labelled("ComputeDomainClique") == [], "the old install's clique deleted")
        assert labelled("ResourceClaimTemplate") == [("default", "cd11-channel"),
                                                     (DRIVER_NS, daemon_object_name(uid))]
        kept = api.get("ResourceClaimTemplate", "cd11-channel", "default")
        assert kept is not None and kept["metadata"]["uid"] == workload["metadata"]["uid"]  # the user's, kept
        _containers_stopped(api, pod)  # the garbage collector deleted the old DaemonSet's pod
        client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd11")
        wait_for(lambda: _cd(api, "cd11") is None, "the ComputeDomain to go")
    assert [labelled(k) for k in ("DaemonSet", "ResourceClaimTemplate", "ComputeDomainClique", "Pod")] == [[]] * 4


def test_a_controller_allowed_only_its_namespaces_still_reconciles_and_deletes(
        api: ApiServerEmulator, client: KubeClient, caplog: pytest.LogCaptureFixture) -> None:
    """Under RBAC that grants DaemonSets and cliques in the driver namespace only (NVIDIA's Helm chart), the
    cluster-wide lists are refused (403): the controller says so once and works on its namespaces."""
    caplog.set_level(logging.WARNING, logger=cdcontroller.__name__)
    for path in ("/apis/apps/v1/daemonsets", f"/apis/{GROUP}/{VERSION}/computedomaincliques"):
        api.fail_next(1000, status=403, method="GET", path=path)
    controller = _controller(client)
    uid = _create(client, compute_domain("cd12", template="cd12-channel"))["metadata"]["uid"]
    controller.sweep()
    controller.reconcile(("default", "cd12"))
    api.create(clique_object(uid, [entry("node-a", "10.0.0.1", 0)]))
    client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd12")
    controller.reconcile(("default", "cd12"))
    assert _cd(api, "cd12") is None
    assert api.objects("DaemonSet") == [] and api.objects("ComputeDomainClique") == []
    warned = [r.getMessage() for r in caplog.records if "in every namespace is forbidden" in r.getMessage()]
    assert len(warned) == 2 and all(f"searching only namespaces {DRIVER_NS}" in m for m in warned)


def test_a_daemon_pod_stuck_on_a_node_not_answering_does_not_hold_the_finalizer(
        api: ApiServerEmulator, client: KubeClient, caplog: pytest.LogCaptureFixture) -> None:
    """A daemon pod being deleted on a node whose kubelet stopped answering (Lease not renewed) can end only when
    the node returns or is removed: the domain's deletion does not wait for it, and says so."""
    caplog.set_level(logging.WARNING, logger=cdcontroller.__name__)
    stale = (datetime.now(UTC) - timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    api.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "node-b", "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": "node-b", "leaseDurationSeconds": 40, "renewTime": stale}})
    controller = _controller(client)
    uid = _create(client, compute_domain("cd13", num_nodes=1))["metadata"]["uid"]
    controller.reconcile(("default", "cd13"))
    ds = api.get("DaemonSet", daemon_object_name(uid), DRIVER_NS)
    assert ds is not None
    pod = _owned_pod(api, ds, "node-b", "10.0.0.2")
    client.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd13")
    controller.reconcile(("default", "cd13"))
    assert _cd(api, "cd13") is None
    stuck = api.get("Pod", pod["metadata"]["name"], DRIVER_NS)
    assert stuck is not None and stuck["metadata"].get("deletionTimestamp")  # still there: its kubelet is away
    assert any("which stopped answering; not waiting for it" in r.getMessage() for r in caplog.records)
