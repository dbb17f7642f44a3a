"""Node failure in the multi-node sandbox (issue 14): three workload pods of one ComputeDomain on the three nodes
of a rack, real plugins, daemons and ``nvidia-imex`` stand-ins; one node is killed (its kubelet stops renewing its
Lease, its processes freeze) -> the controller clears its clique entry within the grace period and the two
surviving daemons drop its name; the node heals -> its daemon re-applies and gets the same index and DNS name."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

from dradriver.domain import computedomains as cd
from dradriver.sandbox.demos import compute_domain as domain_demo
from dradriver.sandbox.multinode import HOSTNAME_LABEL, MultiNodeCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WAIT_S = 120.0
DOMAIN, TEMPLATE = "failover", "failover-channel"


@pytest.fixture
def cluster() -> Iterator[MultiNodeCluster]:
    with MultiNodeCluster((3,), time_scale=0.1, interval_s=0.05) as c:
        c.install_compute_domains()
        c.start()
        c.start_plugins(timeout_s=WAIT_S)
        c.start_controller(extra_env={"NODE_FAILURE_GRACE_PERIOD": "3s", "STATUS_RESYNC_PERIOD": "5s"})
        yield c


def _clique(c: MultiNodeCluster, uid: str) -> dict[str, Any]:
    for obj in c.api.objects(cd.CLIQUE_KIND, c.namespace):
        if (obj["metadata"].get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN) == uid:
            return obj
    return {}


def _entries(c: MultiNodeCluster, uid: str) -> dict[str, dict[str, Any]]:
    return {d["nodeName"]: d for d in _clique(c, uid).get("daemons") or ()}


def _hosts(c: MultiNodeCluster, pod: dict[str, Any]) -> str:
    """The hosts file of a daemon pod (the sandbox's per-pod file the daemon rewrites)."""
    node = c.node(pod["spec"]["nodeName"])
    assert node.runtime is not None
    path = node.runtime.pod_directory(pod) / "hosts"
    return path.read_text() if path.exists() else ""


def test_a_killed_node_leaves_its_peers_and_returns_with_the_same_index(cluster: MultiNodeCluster) -> None:
    domain = cluster.api.create(domain_demo.compute_domain(DOMAIN, TEMPLATE, num_nodes=3))
    uid = str(domain["metadata"]["uid"])
    for i, node in enumerate(sorted(cluster.nodes)):  # one per node, pinned (not left to the scheduler's spread)
        pod = domain_demo.workload_pod(f"{DOMAIN}-{i}", TEMPLATE, group=DOMAIN, rack=1)
        pod["spec"]["nodeSelector"][HOSTNAME_LABEL] = node
        cluster.api.create(pod)
    for i in range(3):
        cluster.wait_for(f"workload {i} running", functools.partial(cluster.pod_running, f"{DOMAIN}-{i}"),
                         timeout_s=WAIT_S)
    cluster.wait_for("the domain Ready with three nodes",
                     lambda: domain_demo.domain_ready(cluster, DOMAIN) and len(_entries(cluster, uid)) == 3
                     and all(e.get("ipAddress") and e.get("status") == cd.STATUS_READY
                             for e in _entries(cluster, uid).values()),
                     timeout_s=WAIT_S)
    entries = _entries(cluster, uid)
    before = {n: e["index"] for n, e in entries.items()}
    assert sorted(before.values()) == [0, 1, 2]
    victim = sorted(before)[1]
    name = cd.dns_name(uid, before[victim])
    daemons = domain_demo.daemon_pods(cluster, uid)
    victim_ip = str(entries[victim]["ipAddress"])
    peers = [p for n, p in daemons.items() if n != victim]

    cluster.kill_node(victim)
    cluster.wait_for("the victim's entry cleared, its index kept",
                     lambda: not _entries(cluster, uid)[victim].get("ipAddress")
                     and _entries(cluster, uid)[victim].get("index") == before[victim], timeout_s=WAIT_S)
    cluster.wait_for("the peers' hosts files without the victim",
                     lambda: all(f"{victim_ip}\t{name}" not in _hosts(cluster, p) for p in peers), timeout_s=WAIT_S)
    for i in range(3):  # workloads elsewhere keep running, their channel devices in place
        host = cluster.pod_node(f"{DOMAIN}-{i}")
        assert host is not None
        if host.name != victim:
            assert cluster.pod_running(f"{DOMAIN}-{i}")
            edits = host.pod_devices.get(f"default/{DOMAIN}-{i}")
            assert edits is not None and edits.device_paths() == [domain_demo.CHANNEL0]

    cluster.heal_node(victim)
    cluster.wait_for("the victim back with the same index",
                     lambda: _entries(cluster, uid)[victim].get("ipAddress") == victim_ip
                     and _entries(cluster, uid)[victim].get("index") == before[victim], timeout_s=WAIT_S)
    cluster.wait_for("the peers' hosts files with the victim again",
                     lambda: all(f"{victim_ip}\t{name}" in _hosts(cluster, p) for p in peers), timeout_s=WAIT_S)
    cluster.wait_for("the domain Ready again", lambda: domain_demo.domain_ready(cluster, DOMAIN), timeout_s=WAIT_S)
    assert {n: e["index"] for n, e in _entries(cluster, uid).items()} == before
