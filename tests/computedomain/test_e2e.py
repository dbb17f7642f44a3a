"""ComputeDomains end to end in the multi-node sandbox: two racks of two emulated GB200 NVL72 nodes, one
compute-domain kubelet plugin process per node, the compute-domain controller process, the IMEX daemon pods of
its DaemonSets run as local processes with the ``nvidia-imex`` stand-ins, and NVIDIA's example manifests applied
unchanged (``../shared/peers/manifests/imex/``; copies in ``tests/sandbox/fixtures/imex/``)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.domain import computedomains as cd
from dradriver.nvml import mock
from dradriver.sandbox.demos import compute_domain as domain_demo
from dradriver.sandbox.multinode import RACK_PROFILES, EmulatedNode, MultiNodeCluster
from dradriver.sandbox.workloads import pids_with_marker

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "sandbox" / "fixtures" / "imex"
NS = "default"
CHANNEL0 = "/dev/nvidia-caps-imex-channels/channel0"
WAIT_S = 90.0


def _manifest(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((FIXTURES / name).read_text()) if d]


@pytest.fixture(scope="module")
def cluster() -> Iterator[MultiNodeCluster]:
    with MultiNodeCluster((2, 2), time_scale=0.1, interval_s=0.05) as c:
        c.install_compute_domains()
        c.start_plugins(timeout_s=120)
        c.start_controller()
        yield c


@pytest.fixture
def world(cluster: MultiNodeCluster) -> Iterator[MultiNodeCluster]:
    """The shared cluster; whatever a test created is deleted afterwards and must leave nothing behind."""
    yield cluster
    for pod in cluster.api.objects("Pod", NS):
        with contextlib.suppress(Exception):
            cluster.api.delete("Pod", pod["metadata"]["name"], NS)
    uids = [o["metadata"]["uid"] for o in cluster.api.objects(cd.COMPUTE_DOMAIN_KIND)]
    for obj in cluster.api.objects(cd.COMPUTE_DOMAIN_KIND):
        with contextlib.suppress(Exception):
            cluster.api.delete(cd.COMPUTE_DOMAIN_KIND, obj["metadata"]["name"], obj["metadata"]["namespace"])
    for uid in uids:
        cluster.wait_for(f"ComputeDomain {uid} cleaned up",
                         lambda uid=uid: not any(cluster.compute_domain_leftovers(uid).values()), timeout_s=WAIT_S)
    cluster.wait_for("no ComputeDomain left", lambda: not cluster.api.objects(cd.COMPUTE_DOMAIN_KIND),
                     timeout_s=WAIT_S)


def _apply(c: MultiNodeCluster, docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for doc in docs:
        doc.setdefault("metadata", {}).setdefault("namespace", NS)
        out[doc["kind"]] = c.api.create(doc)
    return out


def _domain(c: MultiNodeCluster, name: str) -> dict[str, Any]:
    obj = c.api.get(cd.COMPUTE_DOMAIN_KIND, name, NS)
    assert obj is not None
    return obj


def _ready(c: MultiNodeCluster, name: str) -> bool:
    return ((c.api.get(cd.COMPUTE_DOMAIN_KIND, name, NS) or {}).get("status") or {}).get("status") == cd.STATUS_READY


def _daemon_pods(c: MultiNodeCluster, uid: str) -> dict[str, dict[str, Any]]:
    """Node name -> the live daemon Pod of domain ``uid`` there."""
    return {p["spec"]["nodeName"]: p for p in c.api.objects("Pod", c.namespace)
            if (p["metadata"].get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN) == uid
            and not p["metadata"].get("deletionTimestamp") and p["spec"].get("nodeName")}


def _pod_dir(node: EmulatedNode, pod: dict[str, Any]) -> Path:
    meta = pod["metadata"]
    return node.root / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


def _ctl(node: EmulatedNode, pod: dict[str, Any], *args: str) -> str:
    """``nvidia-imex-ctl -c <the pod's imexd.cfg> <args>`` on the pod's node (its domain directory)."""
    imexd = next(h for c_path, h in node.pod_devices[f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"]
                 .mounts if c_path == "/imexd")
    done = subprocess.run([str(node.bin_dir / "nvidia-imex-ctl"), "-c", f"{imexd}/imexd.cfg", *args],
                          capture_output=True, text=True, timeout=30, check=False)
    return done.stdout


def _workload_devices(c: MultiNodeCluster, pod: str) -> list[str]:
    node = c.pod_node(pod)
    assert node is not None
    return node.pod_devices[f"{NS}/{pod}"].device_paths()


def test_channel_injection_manifest_runs_unchanged(world: MultiNodeCluster) -> None:
    objs = _apply(world, _manifest("channel-injection.yaml"))
    uid = objs["ComputeDomain"]["metadata"]["uid"]
    world.wait_for("the workload Pod running", lambda: world.pod_running("imex-channel-injection"), timeout_s=WAIT_S)
    world.wait_for("the domain Ready", lambda: _ready(world, "imex-channel-injection"), timeout_s=WAIT_S)
    node = world.pod_node("imex-channel-injection")
    assert node is not None
    assert node.labels()[cd.LABEL_COMPUTE_DOMAIN] == uid
    edits = node.pod_devices[f"{NS}/imex-channel-injection"]
    assert edits.device_paths() == [CHANNEL0]
    assert edits.device_nodes[0]["major"] == 234 and edits.device_nodes[0].get("minor", 0) == 0  # omitempty
    daemons = _daemon_pods(world, uid)
    assert list(daemons) == [node.name]
    daemon = daemons[node.name]
    world.wait_for("the daemon Pod ready", lambda: world.pod_running(daemon["metadata"]["name"], world.namespace),
                   timeout_s=WAIT_S)
    assert _ctl(node, daemon, "-q") == "READY\n"
    status = _domain(world, "imex-channel-injection")["status"]
    assert [(n["name"], n["status"]) for n in status["nodes"]] == [(node.name, cd.STATUS_READY)]
    assert status["nodes"][0]["ipAddress"] == node.ip and status["nodes"][0]["cliqueID"].endswith(".2")
    assert world.api.get("ResourceClaimTemplate", "imex-channel-0", NS) is not None


def test_channel_injection_all_gets_every_channel(world: MultiNodeCluster) -> None:
    _apply(world, _manifest("channel-injection-all.yaml"))
    world.wait_for("the workload Pod running", lambda: world.pod_running("imex-channel-injection-all"),
                   timeout_s=WAIT_S)
    paths = _workload_devices(world, "imex-channel-injection-all")
    assert paths == [f"/dev/nvidia-caps-imex-channels/channel{n}" for n in range(2048)]


def _two_node_domain(c: MultiNodeCluster, name: str, rack: int) -> str:
    domain = c.api.create({"apiVersion": cd.API_GROUP_VERSION, "kind": cd.COMPUTE_DOMAIN_KIND,
                           "metadata": {"name": name, "namespace": NS},
                           "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}}})
    for i in range(2):
        c.api.create({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": f"{name}-{i}", "namespace": NS, "labels": {"job": name}},
                      "spec": {"nodeSelector": {"sandbox.dradriver.io/rack": str(rack)},
                               "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                                   {"labelSelector": {"matchLabels": {"job": name}},
                                    "topologyKey": "kubernetes.io/hostname"}]}},
                               "containers": [{"name": "ctr", "image": "ubuntu:22.04",
                                               "resources": {"claims": [{"name": "channel"}]}}],
                               "resourceClaims": [{"name": "channel",
                                                   "resourceClaimTemplateName": f"{name}-channel"}]}})
    return str(domain["metadata"]["uid"])


def test_two_node_domain_in_one_rack_survives_a_daemon_force_delete(world: MultiNodeCluster) -> None:
    uid = _two_node_domain(world, "pair", rack=1)
    for i in range(2):
        world.wait_for(f"workload pair-{i} running", lambda i=i: world.pod_running(f"pair-{i}"), timeout_s=WAIT_S)
    world.wait_for("the domain Ready", lambda: _ready(world, "pair"), timeout_s=WAIT_S)
    nodes = {world.pod_node(f"pair-{i}").name for i in range(2)}  # type: ignore[union-attr]
    assert nodes == {"rack1-node00", "rack1-node01"}
    for i in range(2):
        assert _workload_devices(world, f"pair-{i}") == [CHANNEL0]
    daemons = _daemon_pods(world, uid)
    assert set(daemons) == nodes
    for name, pod in daemons.items():
        world.wait_for(f"IMEX on {name} connected to its peer",
                       lambda name=name, pod=pod: _ctl(world.nodes[name], pod, "-q") == "READY\n", timeout_s=WAIT_S)
    clique = world.api.get(cd.CLIQUE_KIND, cd.clique_object_name(uid, "abc9829a-d4c8-491c-8da5-ad28fb34876b.2"),
                           world.namespace)
    assert clique is not None
    index = {d["nodeName"]: d["index"] for d in clique["daemons"]}
    assert sorted(index.values()) == [0, 1]

    victim, peer = "rack1-node01", "rack1-node00"
    old = daemons[victim]
    peer_log = next(_pod_dir(world.nodes[peer], daemons[peer]).glob("*.log"))
    reloads = peer_log.read_text().count("SIGUSR1 received")
    world.force_delete_pod(old["metadata"]["name"], world.namespace)
    world.wait_for("a new daemon Pod on the node",
                   lambda: victim in _daemon_pods(world, uid)
                   and _daemon_pods(world, uid)[victim]["metadata"]["uid"] != old["metadata"]["uid"],
                   timeout_s=WAIT_S)
    marker = f"{old['metadata']['uid']}/{old['spec']['containers'][0]['name']}"
    world.wait_for("the old daemon's processes stopped", lambda: pids_with_marker(marker) == [], timeout_s=WAIT_S)
    new = _daemon_pods(world, uid)[victim]
    world.wait_for("the new daemon ready", lambda: world.pod_running(new["metadata"]["name"], world.namespace),
                   timeout_s=WAIT_S)
    world.wait_for("the domain Ready again", lambda: _ready(world, "pair"), timeout_s=WAIT_S)
    clique = world.api.get(cd.CLIQUE_KIND, cd.clique_object_name(uid, "abc9829a-d4c8-491c-8da5-ad28fb34876b.2"),
                           world.namespace)
    assert clique is not None
    assert {d["nodeName"]: d["index"] for d in clique["daemons"]} == index
    world.wait_for("the peer's nvidia-imex re-read its peers (SIGUSR1)",
                   lambda: peer_log.read_text().count("SIGUSR1 received") > reloads, timeout_s=WAIT_S)
    world.wait_for("IMEX connected again", lambda: _ctl(world.nodes[victim], new, "-q") == "READY\n",
                   timeout_s=WAIT_S)
    for i in range(2):
        assert world.pod_running(f"pair-{i}") and _workload_devices(world, f"pair-{i}") == [CHANNEL0]


def test_two_domains_in_one_clique_on_different_nodes_stay_apart(world: MultiNodeCluster) -> None:
    uids = {}
    for name, node in (("left", "rack2-node00"), ("right", "rack2-node01")):
        domain = world.api.create({"apiVersion": cd.API_GROUP_VERSION, "kind": cd.COMPUTE_DOMAIN_KIND,
                                   "metadata": {"name": name, "namespace": NS},
                                   "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": name}}}})
        uids[name] = domain["metadata"]["uid"]
        world.api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-w", "namespace": NS},
                          "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                                   "containers": [{"name": "ctr", "image": "x",
                                                   "resources": {"claims": [{"name": "c"}]}}],
                                   "resourceClaims": [{"name": "c", "resourceClaimTemplateName": name}]}})
    for name in uids:
        world.wait_for(f"{name} workload running", lambda name=name: world.pod_running(f"{name}-w"), timeout_s=WAIT_S)
        world.wait_for(f"{name} Ready", lambda name=name: _ready(world, name), timeout_s=WAIT_S)
    hosts = {}
    for name, node in (("left", "rack2-node00"), ("right", "rack2-node01")):
        pod = _daemon_pods(world, uids[name])[node]
        names = [line.split()[1] for line in (_pod_dir(world.nodes[node], pod) / "hosts").read_text().splitlines()
                 if cd.DNS_NAME_PREFIX in line and not line.startswith("#")]
        assert names and all(n.startswith(cd.DNS_NAME_PREFIX) for n in names)
        hosts[name] = names
        assert "READY" in _ctl(world.nodes[node], pod, "-q")
        status = json.loads(_ctl(world.nodes[node], pod, "-N", "-j"))
        connected = [n["ip"] for n in status["nodes"] if n.get("connected")]
        assert connected == [world.nodes[node].ip]  # itself only: no handshake with the other domain's daemon
    assert not set(hosts["left"]) & set(hosts["right"])  # per-domain DNS names: no name of one in the other


def test_deleting_a_domain_while_its_pods_run_leaves_nothing(world: MultiNodeCluster) -> None:
    objs = _apply(world, _manifest("channel-injection.yaml"))
    uid = objs["ComputeDomain"]["metadata"]["uid"]
    world.wait_for("the workload Pod running", lambda: world.pod_running("imex-channel-injection"), timeout_s=WAIT_S)
    node = world.pod_node("imex-channel-injection")
    assert node is not None
    assert world.claim_specs(node.name) and world.claim_state(node.name)
    world.api.delete(cd.COMPUTE_DOMAIN_KIND, "imex-channel-injection", NS)
    world.wait_for("the domain gone", lambda: world.api.get(cd.COMPUTE_DOMAIN_KIND, "imex-channel-injection", NS)
                   is None, timeout_s=WAIT_S)
    world.wait_for("the controller's objects and labels gone", lambda: not any(
        v for k, v in world.compute_domain_leftovers(uid).items() if k not in ("cdi specs", "claim state")),
        timeout_s=WAIT_S)
    world.api.delete("Pod", "imex-channel-injection", NS)
    world.wait_for("nothing left", lambda: not any(world.compute_domain_leftovers(uid).values()), timeout_s=WAIT_S)


def test_plugin_sigkilled_while_a_channel_prepare_waits_for_the_daemon(world: MultiNodeCluster) -> None:
    """The channel prepare waits inside the plugin for the node's daemon (whose nvidia-imex is held back); the
    plugin is SIGKILLed then, restarted, and the kubelet's retried prepare completes once IMEX is up."""
    name = "rack2-node01"
    node = world.nodes[name]
    real, fake, release = node.bin_dir / "nvidia-imex.real", node.bin_dir / "nvidia-imex", node.root / "imex-go"
    fake.rename(real)
    fake.write_text(f'#!/bin/sh\nwhile [ ! -e {release} ]; do sleep 0.05; done\nexec {real} "$@"\n')
    fake.chmod(0o755)
    try:
        domain = world.api.create(domain_demo.compute_domain("crash", "crash-channel", num_nodes=1))
        uid = domain["metadata"]["uid"]
        pod = domain_demo.workload_pod("crash-w", "crash-channel", group="crash")
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": name}
        world.api.create(pod)
        world.wait_for("the prepare waiting (node labelled, daemon not ready)",
                       lambda: node.labels().get(cd.LABEL_COMPUTE_DOMAIN) == uid and name in _daemon_pods(world, uid)
                       and f"{NS}/crash-w" not in node.pod_devices, timeout_s=WAIT_S)
        assert world.stop_plugin(name, sig=signal.SIGKILL) == -signal.SIGKILL
        world.wait_for("the kubelet's in-flight prepare failed with the plugin",
                       lambda: f"{NS}/crash-w" in node.prepare_errors, timeout_s=WAIT_S)
        release.touch()
        world.start_plugin(name)
        world.wait_for_plugin(name, timeout_s=WAIT_S)
        world.wait_for("the workload running after the restart", lambda: world.pod_running("crash-w"),
                       timeout_s=WAIT_S)
        assert _workload_devices(world, "crash-w") == [CHANNEL0]
        assert len(world.claim_specs(name)) == 2  # the daemon's claim and the workload's channel claim
    finally:
        release.touch()
        fake.unlink(missing_ok=True)
        real.rename(fake)


CLIQUE_A = "abc9829a-d4c8-491c-8da5-ad28fb34876b.2"


@contextlib.contextmanager
def _moved(c: MultiNodeCluster, name: str, rack: int, tray: int) -> Iterator[EmulatedNode]:
    """Node ``name`` moved into rack ``rack`` as its tray ``tray`` (another NVLink clique): its plugin restarts on
    that rack's fabric; moved back at the end."""
    node = c.node(name)
    before = node.profile
    c.stop_plugin(name)
    node.profile = mock.rack_node_profile(RACK_PROFILES[rack], tray, node.root / "nvml")
    c.start_plugin(name)
    c.wait_for_plugin(name, timeout_s=WAIT_S)
    try:
        yield node
    finally:
        c.stop_plugin(name)
        node.profile = before
        c.start_plugin(name)
        c.wait_for_plugin(name, timeout_s=WAIT_S)


def test_a_node_moved_to_another_rack_leaves_its_old_clique(world: MultiNodeCluster) -> None:
    """rack1-node01 of a Ready two-node domain is moved to rack 2 (its tray rebooted there: the plugin restarts on
    the new fabric and the node's daemon pod is recreated). Its entry leaves the rack-1 clique, so the daemon left
    there maps the moved node's name to no address; the moved node's daemon joins the rack-2 clique."""
    uid = _two_node_domain(world, "mover", rack=1)
    world.wait_for("the domain Ready", lambda: _ready(world, "mover"), timeout_s=WAIT_S)
    victim, peer = "rack1-node01", "rack1-node00"
    clique_a = cd.clique_object_name(uid, CLIQUE_A)
    index = {d["nodeName"]: d["index"] for d in (world.api.get(cd.CLIQUE_KIND, clique_a, world.namespace) or {})
             ["daemons"]}
    moved_name = cd.dns_name(uid, index[victim])
    with _moved(world, victim, rack=2, tray=9):
        old = _daemon_pods(world, uid)[victim]
        world.force_delete_pod(old["metadata"]["name"], world.namespace)  # the reboot: a new daemon pod
        world.wait_for("a new daemon Pod on the moved node",
                       lambda: victim in _daemon_pods(world, uid)
                       and _daemon_pods(world, uid)[victim]["metadata"]["uid"] != old["metadata"]["uid"],
                       timeout_s=WAIT_S)

        def in_new_clique() -> bool:
            pod = _daemon_pods(world, uid).get(victim) or {}
            return str(((pod.get("metadata") or {}).get("labels") or {}).get(cd.LABEL_CLIQUE_ID, "")).endswith(".7")

        world.wait_for("the moved node's daemon in the rack-2 clique", in_new_clique, timeout_s=WAIT_S)
        world.wait_for("the moved node gone from the rack-1 clique",
                       lambda: victim not in {d["nodeName"] for d in (world.api.get(cd.CLIQUE_KIND, clique_a,
                                                                                    world.namespace) or {})
                                              .get("daemons") or ()}, timeout_s=WAIT_S)
        peer_pod = _daemon_pods(world, uid)[peer]

        def peer_dropped_it() -> bool:
            hosts = (_pod_dir(world.nodes[peer], peer_pod) / "hosts").read_text().splitlines()
            return any(line.split()[1:] == [moved_name] and line.split()[0] == cd.UNUSED_SLOT_IP for line in hosts)

        world.wait_for("the rack-1 peer maps the moved node's name to no address", peer_dropped_it, timeout_s=WAIT_S)
        def new_index() -> list[Any]:
            return [d.get("index") for c in world.api.objects(cd.CLIQUE_KIND, world.namespace)
                    if (c["metadata"].get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN) == uid
                    and c["metadata"]["name"] != clique_a for d in c.get("daemons") or () if d["nodeName"] == victim]

        world.wait_for("the moved node's entry in the rack-2 clique", lambda: new_index() == [0], timeout_s=WAIT_S)
