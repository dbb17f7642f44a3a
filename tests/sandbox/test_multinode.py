"""The multi-node sandbox without the compute-domain driver: CDI resolution, node and pod selection rules, the
DaemonSet controller with its Pods run as local processes on their nodes, and scheduling across nodes."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.sandbox import multinode
from dradriver.sandbox.multinode import (
    NODE_LEASE_NAMESPACE,
    MultiNodeCluster,
    MultiNodeError,
    cdi_edits,
    node_matches,
    pod_affinity_allows,
)
from dradriver.sandbox.workloads import pids_with_marker
from tests.factories import wait_until

NS = "default"


def _node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {multinode.HOSTNAME_LABEL: name, **labels}}, "spec": {}}


def test_cdi_edits_merge_spec_and_device_edits(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({
        "cdiVersion": "0.6.0", "kind": "k8s.compute-domain.nvidia.com/claim",
        "containerEdits": {"env": ["SPEC=1"]},
        "devices": [{"name": "u1-channel", "containerEdits": {"deviceNodes": [
            {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 234, "minor": 0}]}},
            {"name": "u1-daemon", "containerEdits": {"env": ["CLIQUE_ID=x.2"], "mounts": [
                {"containerPath": "/imexd", "hostPath": "/host/dir", "options": ["rw", "bind"]}]}}]}))
    (tmp_path / "ignored.txt").write_text("not a spec")
    edits = cdi_edits(tmp_path, ["k8s.compute-domain.nvidia.com/claim=u1-channel",
                                 "k8s.compute-domain.nvidia.com/claim=u1-daemon"])
    assert edits.env == {"SPEC": "1", "CLIQUE_ID": "x.2"}
    assert edits.mounts == [("/imexd", "/host/dir")]
    assert edits.device_paths() == ["/dev/nvidia-caps-imex-channels/channel0"]
    with pytest.raises(MultiNodeError, match="u1-nothing"):
        cdi_edits(tmp_path, ["k8s.compute-domain.nvidia.com/claim=u1-nothing"])


def test_node_selection_rules() -> None:
    node = _node("n1", zone="a")
    assert node_matches({"nodeSelector": {"zone": "a"}}, node)
    assert not node_matches({"nodeSelector": {"zone": "b"}}, node)
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}]}}}
    assert not node_matches({"affinity": affinity}, node)
    tainted = {**node, "spec": {"taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]}}
    assert not node_matches({}, tainted)
    assert node_matches({"tolerations": [{"operator": "Exists"}]}, tainted)
    assert node_matches({"tolerations": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]}, tainted)


def test_pod_affinity_and_anti_affinity() -> None:
    nodes = {"n1": _node("n1", rack="1"), "n2": _node("n2", rack="1"), "n3": _node("n3", rack="2")}
    other = {"metadata": {"name": "w0", "namespace": NS, "labels": {"app": "w"}}, "spec": {"nodeName": "n1"}}
    term = {"labelSelector": {"matchLabels": {"app": "w"}}, "topologyKey": multinode.HOSTNAME_LABEL}
    anti = {"metadata": {"name": "w1", "namespace": NS, "labels": {"app": "w"}}, "spec": {"affinity": {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}}}
    assert not pod_affinity_allows(anti, nodes["n1"], [other], nodes)
    assert pod_affinity_allows(anti, nodes["n2"], [other], nodes)
    rack_term = {"labelSelector": {"matchLabels": {"app": "w"}}, "topologyKey": "rack"}
    near = {"metadata": {"name": "w2", "namespace": NS, "labels": {"app": "w"}}, "spec": {"affinity": {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [rack_term]}}}}
    assert pod_affinity_allows(near, nodes["n2"], [other], nodes)
    assert not pod_affinity_allows(near, nodes["n3"], [other], nodes)
    assert pod_affinity_allows(near, nodes["n3"], [], nodes)  # the first of the group matches its own term


@pytest.fixture
def cluster() -> Iterator[MultiNodeCluster]:
    with MultiNodeCluster((2, 1), time_scale=0.05, interval_s=0.02) as c:
        yield c


def _set_label(c: MultiNodeCluster, node: str, key: str, value: str | None) -> None:
    obj = c.api.get("Node", node)
    assert obj is not None
    labels = obj["metadata"].setdefault("labels", {})
    if value is None:
        labels.pop(key, None)
    else:
        labels[key] = value
    c.api.update(obj)


def _ds_pods(c: MultiNodeCluster) -> dict[str, dict[str, Any]]:
    return {p["spec"]["nodeName"]: p for p in c.api.objects("Pod", NS)
            if p["metadata"].get("ownerReferences") and not p["metadata"].get("deletionTimestamp")}


SCRIPT = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
          "open(os.environ['OUT'], 'w').write(os.environ['NODE_NAME'] + ' ' + os.environ['POD_IP'] + ' ' + "
          "os.environ['POD_NAME']); time.sleep(3600)")


@pytest.mark.slow
def test_daemonset_pods_follow_the_node_label_and_run_as_processes(cluster: MultiNodeCluster, tmp_path: Path) -> None:
    assert sorted(cluster.nodes) == ["rack1-node00", "rack1-node01", "rack2-node00"]
    assert len({n.ip for n in cluster.nodes.values()}) == 3
    cluster.api.create({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "probe", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": "probe"}}, "template": {
            "metadata": {"labels": {"app": "probe"}},
            "spec": {"nodeSelector": {"example.com/run": "yes"}, "containers": [{
                "name": "main", "image": "x", "command": [sys.executable, "-c", SCRIPT],
                "env": [{"name": "OUT", "value": str(tmp_path / "$(NODE_NAME).txt")},
                        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "readinessProbe": {"exec": {"command": ["test", "-s", str(tmp_path / "$(NODE_NAME).txt")]},
                                   "periodSeconds": 1}}]}}}})
    for name in ("rack1-node01", "rack2-node00"):
        _set_label(cluster, name, "example.com/run", "yes")
    wait_until(lambda: set(_ds_pods(cluster)) == {"rack1-node01", "rack2-node00"}, "one Pod per labelled node")
    for name in ("rack1-node01", "rack2-node00"):
        wait_until(lambda name=name: cluster.pod_running(_ds_pods(cluster)[name]["metadata"]["name"]),
                   f"the Pod on {name} ready")
        pod = _ds_pods(cluster)[name]
        assert (tmp_path / f"{name}.txt").read_text() == f"{name} {cluster.nodes[name].ip} {pod['metadata']['name']}"
        assert pod["status"]["podIP"] == cluster.nodes[name].ip
    ds = cluster.api.get("DaemonSet", "probe", NS)
    wait_until(lambda: (cluster.api.get("DaemonSet", "probe", NS) or {}).get("status", {}).get("numberReady") == 2,
               "DaemonSet status counts two ready Pods")
    assert ds is not None

    old = _ds_pods(cluster)["rack2-node00"]
    marker = f"{old['metadata']['uid']}/main"
    cluster.api.delete("Pod", old["metadata"]["name"], NS)
    wait_until(lambda: "rack2-node00" in _ds_pods(cluster)
               and _ds_pods(cluster)["rack2-node00"]["metadata"]["uid"] != old["metadata"]["uid"], "Pod recreated")
    assert pids_with_marker(marker) == []

    gone = _ds_pods(cluster)["rack1-node01"]
    _set_label(cluster, "rack1-node01", "example.com/run", None)
    wait_until(lambda: "rack1-node01" not in _ds_pods(cluster)
               and cluster.api.get("Pod", gone["metadata"]["name"], NS) is None, "Pod removed from the unlabelled node")
    assert pids_with_marker(f"{gone['metadata']['uid']}/main") == []


def test_a_node_pulling_its_image_starts_no_new_container_until_the_pull_is_done() -> None:
    """:attr:`EmulatedNode.pulling`: the DaemonSet Pod is made and its (no) claims prepared, but its container
    starts only once the pull is done; the loops are driven pass by pass here."""
    with contextlib.closing(MultiNodeCluster((1,), time_scale=0.05, interval_s=0.02)) as c:
        node = next(iter(c.nodes.values()))
        node.pulling = True
        c.api.create({
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "pull", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "pull"}}, "template": {
                "metadata": {"labels": {"app": "pull"}},
                "spec": {"containers": [{"name": "main", "image": "x",
                                         "command": [sys.executable, "-c", "import time; time.sleep(3600)"]}]}}}})
        for _ in range(3):
            c.reconcile_control_plane()
            c.reconcile_node(node)
        pod = _ds_pods(c)[node.name]
        assert f"{NS}/{pod['metadata']['name']}" in node.pod_devices  # the kubelet's part is done
        assert (pod.get("status") or {}).get("phase") == "Pending" and not node.runtime.container_pids()
        node.pulling = False
        c.reconcile_node(node)
        assert pids_with_marker(f"{pod['metadata']['uid']}/main")
        assert (c.api.get("Pod", pod["metadata"]["name"], NS) or {})["status"]["phase"] == "Running"


@pytest.mark.slow
def test_a_template_change_rolls_the_daemonset_one_node_at_a_time(cluster: MultiNodeCluster, tmp_path: Path) -> None:
    def container(version: str) -> dict[str, Any]:
        return {"name": "main", "image": f"x:{version}", "command": [sys.executable, "-c", SCRIPT],
                "env": [{"name": "OUT", "value": str(tmp_path / f"{version}-$(NODE_NAME).txt")},
                        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "readinessProbe": {"exec": {"command": ["test", "-s", str(tmp_path / f"{version}-$(NODE_NAME).txt")]},
                                   "periodSeconds": 1}}

    cluster.api.create({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "roll", "namespace": NS},
                        "spec": {"selector": {"matchLabels": {"app": "roll"}}, "template": {
                            "metadata": {"labels": {"app": "roll"}}, "spec": {"containers": [container("v1")]}}}})

    def ready_pods() -> dict[str, dict[str, Any]]:
        return {n: p for n, p in _ds_pods(cluster).items() if cluster.pod_running(p["metadata"]["name"])}

    wait_until(lambda: len(ready_pods()) == 3, "a ready Pod on each of the three nodes")
    first = {n: p["metadata"]["uid"] for n, p in ready_pods().items()}
    assert {p["metadata"]["labels"]["pod-template-generation"] for p in ready_pods().values()} == {"1"}
    ds = cluster.api.get("DaemonSet", "roll", NS)
    assert ds is not None
    ds["spec"]["template"]["spec"]["containers"] = [container("v2")]
    cluster.api.update(ds)
    fewest = [3]
    stop = threading.Event()

    def watch() -> None:  # the fewest nodes with a Ready Pod at any moment of the roll
        while not stop.is_set():
            fewest[0] = min(fewest[0], len(ready_pods()))
            stop.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        wait_until(lambda: all((tmp_path / f"v2-{n}.txt").exists() for n in cluster.nodes) and len(ready_pods()) == 3
                   and not set(first.values()) & {p["metadata"]["uid"] for p in ready_pods().values()},
                   "every node running a Ready Pod of the new template", timeout=120)
    finally:
        stop.set()
        watcher.join()
    assert fewest[0] == 2  # maxUnavailable 1 (the default): one node at a time, never two
    hashes = {p["metadata"]["labels"]["controller-revision-hash"] for p in ready_pods().values()}
    assert len(hashes) == 1 and {p["metadata"]["labels"]["pod-template-generation"]
                                 for p in ready_pods().values()} == {"2"}
    for uid in first.values():
        assert pids_with_marker(f"{uid}/main") == []  # the old containers stopped

    def counts() -> tuple[Any, ...]:
        status = (cluster.api.get("DaemonSet", "roll", NS) or {}).get("status") or {}
        return tuple(status.get(k) for k in ("desiredNumberScheduled", "updatedNumberScheduled", "numberReady",
                                             "numberAvailable", "numberUnavailable", "observedGeneration"))

    wait_until(lambda: counts() == (3, 3, 3, 3, 0, 2), "the status of a finished roll at generation 2")


@pytest.mark.slow
def test_scheduler_spreads_pods_with_anti_affinity_within_a_rack(cluster: MultiNodeCluster) -> None:
    def pod(name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": {"app": "w"}},
                "spec": {"nodeSelector": {multinode.RACK_LABEL: "1"}, "containers": [{"name": "c", "image": "x"}],
                         "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                             {"labelSelector": {"matchLabels": {"app": "w"}},
                              "topologyKey": multinode.HOSTNAME_LABEL}]}}}}

    for name in ("w0", "w1", "w2"):
        cluster.api.create(pod(name))
    wait_until(lambda: cluster.pod_running("w0") and cluster.pod_running("w1"), "two workload Pods running")
    placed = {cluster.pod_node(n).name for n in ("w0", "w1")}  # type: ignore[union-attr]
    assert placed == {"rack1-node00", "rack1-node01"}
    assert cluster.pod_node("w2") is None  # no third node in rack 1
    assert cluster.nodes["rack1-node00"].pod_devices[f"{NS}/w0"].device_ids == []


def test_bad_layouts_and_names_are_refused_clearly() -> None:
    with pytest.raises(MultiNodeError, match=r"racks must list 1\.\.2 racks of 1\.\.18 nodes, not \[19\]"):
        MultiNodeCluster((19,))
    with pytest.raises(MultiNodeError, match="not \\[1, 1, 1\\]"):
        MultiNodeCluster((1, 1, 1))
    with MultiNodeCluster((1,)) as c:
        with pytest.raises(MultiNodeError, match="no node 'rack9-node00'; nodes: rack1-node00"):
            c.node("rack9-node00")
        assert c.rack_nodes(1)[0].profile.name == "rack-a-tray-00.json"


def test_starting_a_started_cluster_runs_one_set_of_loops() -> None:
    with MultiNodeCluster((2,), time_scale=0.05, interval_s=0.02) as c:  # __enter__ starts it
        first = list(c._threads)
        assert c.start() is c
        assert c._threads == first and all(t.is_alive() for t in first)
        names = sorted(t.name for t in threading.enumerate() if t.name.startswith("sandbox-"))
        assert names == ["sandbox-control-plane", "sandbox-kubelet-rack1-node00", "sandbox-kubelet-rack1-node01",
                         "sandbox-node-leases"]
        c.stop()
        assert c.start()._threads != first  # stopped, then started afresh
        assert all(t.is_alive() for t in c._threads)


def _renewed(c: MultiNodeCluster, node: str) -> str:
    lease = c.api.get("Lease", node, NODE_LEASE_NAMESPACE) or {}
    return str((lease.get("spec") or {}).get("renewTime") or "")


def test_kubelets_renew_node_leases_and_a_killed_node_stops_until_healed(cluster: MultiNodeCluster) -> None:
    cluster.start()
    names = sorted(cluster.nodes)
    cluster.wait_for("every node Lease", lambda: all(_renewed(cluster, n) for n in names), timeout_s=30)
    dead, alive = names[0], names[1]
    cluster.kill_node(dead)
    assert dead in cluster.killed
    frozen = _renewed(cluster, dead)
    seen = _renewed(cluster, alive)
    cluster.wait_for("a live node's renewal", lambda: _renewed(cluster, alive) > seen, timeout_s=30)
    seen = _renewed(cluster, alive)
    cluster.wait_for("another live renewal", lambda: _renewed(cluster, alive) > seen, timeout_s=30)
    assert _renewed(cluster, dead) == frozen  # two live renewals later the dead node's Lease has not moved
    cluster.heal_node(dead)
    assert dead not in cluster.killed
    cluster.wait_for("the healed node's renewal", lambda: _renewed(cluster, dead) > frozen, timeout_s=30)
