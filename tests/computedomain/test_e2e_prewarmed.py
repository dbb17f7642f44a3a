"""Pre-warmed IMEX (``--imex-mode preWarmed``, issue 35) end to end in the multi-node sandbox: two racks of two
emulated GB200 NVL72 nodes (two NVLink cliques), one compute-domain kubelet plugin process per node, the controller
process, and the clique daemons of the controller's per-clique DaemonSets run as local processes with the
``nvidia-imex`` stand-ins, before any ComputeDomain exists. A ComputeDomain then gets a channel and its workload
claims prepare on the running daemons: no new pod."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from dradriver.domain import computedomains as cd
from dradriver.nvml import mock
from dradriver.sandbox.demos import compute_domain as domain_demo
from dradriver.sandbox.multinode import RACK_PROFILES, MultiNodeCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NS = "default"
WAIT_S = 120.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[MultiNodeCluster]:
    with MultiNodeCluster((2, 2), time_scale=0.1, interval_s=0.05, pre_warmed=True) as c:
        c.install_compute_domains()
        c.start_plugins(timeout_s=WAIT_S)
        c.start_controller(extra_env={"NODE_FAILURE_GRACE_PERIOD": "3s", "STATUS_RESYNC_PERIOD": "2s"})
        c.wait_for("a Ready clique daemon on every node", lambda: set(_clique_daemons(c)) == set(c.nodes),
                   timeout_s=WAIT_S)
        yield c


@pytest.fixture
def world(cluster: MultiNodeCluster) -> Iterator[MultiNodeCluster]:
    """The shared cluster; what a test created is deleted afterwards, and every clique daemon is Ready again."""
    yield cluster
    for pod in cluster.api.objects("Pod", NS):
        with contextlib.suppress(Exception):
            cluster.api.delete("Pod", pod["metadata"]["name"], NS)
    for obj in cluster.api.objects(cd.COMPUTE_DOMAIN_KIND):
        with contextlib.suppress(Exception):
            cluster.api.delete(cd.COMPUTE_DOMAIN_KIND, obj["metadata"]["name"], obj["metadata"]["namespace"])
    cluster.wait_for("no ComputeDomain left", lambda: not cluster.api.objects(cd.COMPUTE_DOMAIN_KIND),
                     timeout_s=WAIT_S)
    cluster.wait_for("every clique daemon Ready", lambda: set(_clique_daemons(cluster)) == set(cluster.nodes),
                     timeout_s=WAIT_S)


def _clique_of(c: MultiNodeCluster, node: str) -> str:
    return c.node(node).labels().get(cd.NODE_CLIQUE_LABEL, "")


def _clique_daemons(c: MultiNodeCluster) -> dict[str, dict[str, Any]]:
    """Node name -> the Ready clique daemon Pod there (labelled with the node's clique domain ID)."""
    out = {}
    for name in c.nodes:
        clique = _clique_of(c, name)
        if not clique:
            continue
        pods = domain_demo.daemon_pods(c, cd.clique_domain_uid(clique))
        if name in pods and cd.pod_ready(pods[name]):
            out[name] = pods[name]
    return out


def _driver_pods(c: MultiNodeCluster) -> set[str]:
    """UIDs of every Pod in the driver namespace (the clique daemons)."""
    return {p["metadata"]["uid"] for p in c.api.objects("Pod", c.namespace)}


def _domain(c: MultiNodeCluster, name: str) -> dict[str, Any]:
    obj = c.api.get(cd.COMPUTE_DOMAIN_KIND, name, NS)
    assert obj is not None
    return obj


def _channel(c: MultiNodeCluster, name: str) -> int | None:
    return cd.domain_channel(_domain(c, name))


def _devices(c: MultiNodeCluster, pod: str) -> list[str]:
    node = c.pod_node(pod)
    assert node is not None
    return node.pod_devices[f"{NS}/{pod}"].device_paths()


def _status_nodes(c: MultiNodeCluster, name: str) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in (_domain(c, name).get("status") or {}).get("nodes") or ()}


def _reason(c: MultiNodeCluster, name: str, node: str) -> str:
    conditions = _status_nodes(c, name).get(node, {}).get("conditions") or ()
    return next((str(x["reason"]) for x in conditions if x["type"] == cd.CLIQUE_DAEMON_CONDITION), "")


def _events(c: MultiNodeCluster, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in c.api.objects("Event", NS)
            if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == reason]


def _start(c: MultiNodeCluster, domain: str, pods: dict[str, str]) -> int:
    """Create ComputeDomain ``domain`` and one workload Pod per entry of ``pods`` (Pod name -> node), wait until
    they run; returns the domain's channel."""
    template = f"{domain}-channel"
    c.api.create(domain_demo.compute_domain(domain, template, num_nodes=None))
    for pod, node in pods.items():
        c.api.create(domain_demo.workload_pod(pod, template, group=domain, node=node))
    for pod in pods:
        c.wait_for(f"Pod {pod} running", lambda pod=pod: c.pod_running(pod), timeout_s=WAIT_S)
    channel = _channel(c, domain)
    assert channel is not None and channel > 0
    return channel


def test_two_domains_on_one_clique_get_their_own_channels_without_a_new_pod(world: MultiNodeCluster) -> None:
    before = _driver_pods(world)
    node = "rack1-node00"
    channel_a = _start(world, "job-a", {"job-a-0": node})
    channel_b = _start(world, "job-b", {"job-b-0": node, "job-b-1": "rack1-node01"})
    assert channel_a != channel_b
    assert _devices(world, "job-a-0") == [f"/dev/nvidia-caps-imex-channels/channel{channel_a}"]
    assert _devices(world, "job-b-0") == [f"/dev/nvidia-caps-imex-channels/channel{channel_b}"]
    assert _driver_pods(world) == before  # no IMEX daemon pod was made for either domain
    assert not world.api.objects("DaemonSet", NS)
    assert cd.LABEL_COMPUTE_DOMAIN not in world.node(node).labels()  # no per-domain node label
    clique = _clique_of(world, node)
    world.wait_for("job-b Ready on both nodes", lambda: set(_status_nodes(world, "job-b")) == {node, "rack1-node01"}
                   and domain_demo.domain_ready(world, "job-b"), timeout_s=WAIT_S)
    entry = _status_nodes(world, "job-b")[node]
    assert entry["cliqueID"] == clique and entry["status"] == cd.STATUS_READY and entry["index"] >= 0
    assert _reason(world, "job-b", node) == cd.REASON_CLIQUE_DAEMON_READY


def test_a_domain_spanning_two_cliques_gets_a_channel_in_each(world: MultiNodeCluster) -> None:
    channel = _start(world, "wide", {"wide-0": "rack1-node01", "wide-1": "rack2-node00"})
    for pod in ("wide-0", "wide-1"):
        assert _devices(world, pod) == [f"/dev/nvidia-caps-imex-channels/channel{channel}"]
    world.wait_for("wide Ready on both racks", lambda: set(_status_nodes(world, "wide")) == {"rack1-node01",
                                                                                              "rack2-node00"}
                   and domain_demo.domain_ready(world, "wide"), timeout_s=WAIT_S)
    nodes = _status_nodes(world, "wide")
    assert {nodes[n]["cliqueID"] for n in nodes} == {_clique_of(world, "rack1-node01"),
                                                     _clique_of(world, "rack2-node00")}
    assert _clique_of(world, "rack1-node01") != _clique_of(world, "rack2-node00")


def test_a_restarted_clique_daemon_makes_its_domains_not_ready_then_ready(world: MultiNodeCluster) -> None:
    node = "rack2-node01"
    _start(world, "steady", {"steady-0": node})
    world.wait_for("steady Ready", lambda: domain_demo.domain_ready(world, "steady")
                   and _reason(world, "steady", node) == cd.REASON_CLIQUE_DAEMON_READY, timeout_s=WAIT_S)
    daemon = _clique_daemons(world)[node]
    world.api.delete("Pod", daemon["metadata"]["name"], world.namespace)
    world.wait_for("a Warning Event while the daemon is down",
                   lambda: _events(world, "steady", cd.REASON_CLIQUE_DAEMON_NOT_READY), timeout_s=WAIT_S)
    warning = _events(world, "steady", cd.REASON_CLIQUE_DAEMON_NOT_READY)[0]
    assert warning["type"] == "Warning" and node in warning["message"]
    world.wait_for("a new clique daemon Ready", lambda: node in _clique_daemons(world)
                   and _clique_daemons(world)[node]["metadata"]["uid"] != daemon["metadata"]["uid"], timeout_s=WAIT_S)
    world.wait_for("steady Ready again with a Normal Event", lambda: domain_demo.domain_ready(world, "steady")
                   and _events(world, "steady", cd.REASON_CLIQUE_DAEMON_READY), timeout_s=WAIT_S)
    assert _events(world, "steady", cd.REASON_CLIQUE_DAEMON_READY)[0]["type"] == "Normal"
    assert world.pod_running("steady-0")  # the workload kept running throughout


def test_a_lost_node_fails_its_domains_loudly_and_recovers(world: MultiNodeCluster) -> None:
    lost, kept = "rack2-node00", "rack2-node01"
    _start(world, "split", {"split-0": lost, "split-1": kept})
    world.wait_for("split Ready", lambda: domain_demo.domain_ready(world, "split")
                   and set(_status_nodes(world, "split")) == {lost, kept}, timeout_s=WAIT_S)
    world.kill_node(lost)
    try:
        world.wait_for("split NotReady naming the lost node",
                       lambda: _reason(world, "split", lost) == cd.REASON_NODE_LOST
                       and not domain_demo.domain_ready(world, "split"), timeout_s=WAIT_S)
        assert _reason(world, "split", kept) == cd.REASON_CLIQUE_DAEMON_READY  # the other node is unaffected
        event = _events(world, "split", cd.REASON_NODE_LOST)
        assert event and event[0]["type"] == "Warning" and lost in event[0]["message"]
    finally:
        world.heal_node(lost)
    world.wait_for("split Ready again", lambda: domain_demo.domain_ready(world, "split")
                   and _reason(world, "split", lost) == cd.REASON_CLIQUE_DAEMON_READY, timeout_s=WAIT_S)


def test_a_plugin_restart_leaves_the_clique_daemon_running(world: MultiNodeCluster) -> None:
    node = "rack1-node01"
    daemon = _clique_daemons(world)[node]
    world.stop_plugin(node)
    assert _clique_of(world, node)  # the label stays: the clique DaemonSet keeps the node
    world.start_plugin(node)
    world.wait_for_plugin(node, timeout_s=WAIT_S)
    _start(world, "after-restart", {"after-restart-0": node})  # the restarted plugin serves the running daemon
    assert _clique_daemons(world)[node]["metadata"]["uid"] == daemon["metadata"]["uid"]


def test_a_node_moved_to_another_clique_is_reported_and_joins_the_new_one(world: MultiNodeCluster) -> None:
    mover, stays = "rack1-node01", "rack1-node00"
    _start(world, "mover", {"mover-0": stays, "mover-1": mover})
    world.wait_for("mover Ready", lambda: domain_demo.domain_ready(world, "mover")
                   and set(_status_nodes(world, "mover")) == {stays, mover}, timeout_s=WAIT_S)
    old_clique, new_clique = _clique_of(world, mover), _clique_of(world, "rack2-node00")
    node = world.node(mover)
    before = node.profile
    world.stop_plugin(mover)
    node.profile = mock.rack_node_profile(RACK_PROFILES[2], 9, node.root / "nvml")  # its tray rebooted in rack 2
    world.start_plugin(mover)
    try:
        world.wait_for_plugin(mover, timeout_s=WAIT_S)
        world.wait_for("the moved node in the new clique", lambda: _clique_of(world, mover) == new_clique,
                       timeout_s=WAIT_S)
        world.wait_for("a Warning Event naming the moved node",
                       lambda: [e for e in _events(world, "mover", cd.REASON_CLIQUE_DAEMON_NOT_READY)
                                if mover in e["message"]], timeout_s=WAIT_S)
        world.wait_for("the moved node Ready in the new clique's domain",
                       lambda: _status_nodes(world, "mover").get(mover, {}).get("cliqueID") == new_clique
                       and _reason(world, "mover", mover) == cd.REASON_CLIQUE_DAEMON_READY, timeout_s=WAIT_S)
        old = world.api.get(cd.CLIQUE_KIND, cd.clique_object_name(cd.clique_domain_uid(old_clique), old_clique),
                            world.namespace) or {}
        assert mover not in {d["nodeName"] for d in old.get("daemons") or ()}  # its old clique's peers dropped it
        assert _status_nodes(world, "mover")[stays]["cliqueID"] == old_clique
    finally:
        world.stop_plugin(mover)
        node.profile = before
        world.start_plugin(mover)
        world.wait_for_plugin(mover, timeout_s=WAIT_S)
        world.wait_for("the node back in its clique", lambda: _clique_of(world, mover) == old_clique,
                       timeout_s=WAIT_S)


def test_an_upgrade_rolls_the_rack_s_clique_daemons_and_its_domain_fails_loudly_then_works_again(
        world: MultiNodeCluster) -> None:
    """The controller restarted with a new image (an upgrade) updates the clique DaemonSet's template; the
    DaemonSet's rolling update replaces the rack's daemons one node at a time. The domain running across the rack
    reports each node NotReady (condition and Warning Event naming it) while that node's daemon is replaced,
    Ready again after (Normal Event), its workload pods keep running, and the next pods on every node of the rack
    get the domain's channel from the new daemons."""
    rack = ["rack1-node00", "rack1-node01"]
    channel = _start(world, "upgrade", {f"upgrade-{i}": node for i, node in enumerate(rack)})
    world.wait_for("upgrade Ready on the whole rack", lambda: domain_demo.domain_ready(world, "upgrade")
                   and set(_status_nodes(world, "upgrade")) == set(rack), timeout_s=WAIT_S)
    clique = _clique_of(world, rack[0])
    uid = cd.clique_domain_uid(clique)
    before = {node: _clique_daemons(world)[node]["metadata"]["uid"] for node in rack}
    image = "registry.example/dradriver:upgrade"
    seen_not_ready: set[str] = set()
    world.stop_controllers()
    world.start_controller(extra_env={"NODE_FAILURE_GRACE_PERIOD": "3s", "STATUS_RESYNC_PERIOD": "2s",
                                      "IMAGE_NAME": image})

    def rolled() -> bool:
        if not domain_demo.domain_ready(world, "upgrade"):
            seen_not_ready.add("domain")
        seen_not_ready.update(n for n in rack if _reason(world, "upgrade", n) != cd.REASON_CLIQUE_DAEMON_READY)
        ds = world.api.get("DaemonSet", cd.daemon_object_name(uid), world.namespace) or {}
        status, daemons = ds.get("status") or {}, _clique_daemons(world)
        return (status.get("updatedNumberScheduled") == status.get("numberReady") == len(rack)
                and all(n in daemons and daemons[n]["metadata"]["uid"] != before[n]
                        and daemons[n]["spec"]["containers"][0]["image"] == image for n in rack))

    world.wait_for("the rack's clique daemons replaced by the new image", rolled, timeout_s=2 * WAIT_S)
    world.wait_for("upgrade Ready again on the whole rack", lambda: domain_demo.domain_ready(world, "upgrade")
                   and all(_reason(world, "upgrade", n) == cd.REASON_CLIQUE_DAEMON_READY for n in rack),
                   timeout_s=WAIT_S)
    assert seen_not_ready  # not silent: the status said so while a daemon was down
    for node in rack:  # and an Event named each node whose daemon was replaced
        warnings = [e for e in _events(world, "upgrade", cd.REASON_CLIQUE_DAEMON_NOT_READY) if node in e["message"]]
        assert warnings and warnings[0]["type"] == "Warning"
    assert all(e["type"] == "Normal" for e in _events(world, "upgrade", cd.REASON_CLIQUE_DAEMON_READY))
    assert len(_events(world, "upgrade", cd.REASON_CLIQUE_DAEMON_READY)) >= len(rack)
    assert all(world.pod_running(f"upgrade-{i}") for i in range(len(rack)))  # the workload kept running
    for i in range(len(rack)):  # the channel is usable again: the jobs' next pods on each node prepare it
        world.api.delete("Pod", f"upgrade-{i}", NS)
    world.wait_for("the first pods' claims released", lambda: not [
        c for c in world.api.objects("ResourceClaim", NS) if c["metadata"]["name"].startswith("upgrade-")],
                   timeout_s=WAIT_S)
    for i, node in enumerate(rack):
        world.api.create(domain_demo.workload_pod(f"upgrade-after-{i}", "upgrade-channel", group="upgrade-after",
                                                          node=node))
    for i in range(len(rack)):
        world.wait_for(f"Pod upgrade-after-{i} running", lambda i=i: world.pod_running(f"upgrade-after-{i}"),
                       timeout_s=WAIT_S)
        assert _devices(world, f"upgrade-after-{i}") == [f"/dev/nvidia-caps-imex-channels/channel{channel}"]
    rack2 = world.api.get("DaemonSet", cd.daemon_object_name(cd.clique_domain_uid(_clique_of(world, "rack2-node00"))),
                          world.namespace) or {}
    assert rack2["spec"]["template"]["spec"]["containers"][0]["image"] == image  # every clique's DaemonSet updated
