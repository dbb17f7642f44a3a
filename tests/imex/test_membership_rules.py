"""Pure rules of conflict-free membership (issue 14): the controller's index assignment, the node failure check,
the clique JSON patch the controller sends, the daemon's apply body, and the elastic global status."""

from __future__ import annotations

import random
from pathlib import Path

from dradriver.computedomain.controller import membership_operations
from dradriver.computedomain.daemon import DaemonSettings, entry_body, entry_current, field_manager, peer_mapping
from dradriver.domain.computedomains import (
    LABEL_CLIQUE_ID,
    LABEL_COMPUTE_DOMAIN,
    STATUS_NOT_READY,
    STATUS_READY,
    UNUSED_SLOT_IP,
    CliqueDaemon,
    dns_name,
    global_status,
    unresponsive_nodes,
)
from dradriver.domain.imex import assign_indexes
from dradriver.sandbox.apiserver.patches import JSON_PATCH, apply_patch

CD = "0c7e5f3a-1111-4222-8333-444455556666"
CLIQUE = "abc9829a-0000-0000-0000-000000000001.2"


def _d(node: str, index: int = -1, ip: str = "", status: str = STATUS_NOT_READY) -> CliqueDaemon:
    return CliqueDaemon(node_name=node, ip_address=ip, clique_id=CLIQUE if ip else "", index=index, status=status)


def test_assign_indexes_keeps_held_indexes_and_fills_gaps_in_node_order() -> None:
    daemons = [_d("n5", 3, "10.0.0.5"), _d("n2", -1, "10.0.0.2"), _d("n1", 0, ""), _d("n9", -1, "10.0.0.9")]
    assert assign_indexes(daemons, 18) == {"n5": 3, "n1": 0, "n2": 1, "n9": 2}


def test_assign_indexes_never_moves_an_index_and_never_gives_one_twice() -> None:
    rng = random.Random(14)
    held: dict[str, int] = {}
    for _ in range(200):
        nodes = rng.sample([f"n{i}" for i in range(24)], rng.randint(0, 20))
        daemons = [_d(n, held.get(n, -1), "10.0.0.1") for n in nodes]
        out = assign_indexes(daemons, 18)
        assert len(set(out.values())) == len(out)  # no index twice
        assert all(0 <= i < 18 for i in out.values())
        for node in nodes:
            if node in held:
                assert out[node] == held[node]  # never moved
        assert len(out) == min(len(nodes), 18)
        held = {n: i for n, i in out.items()}  # nodes gone from the clique lose their reservation


def test_assign_indexes_leaves_the_overflow_waiting_and_repairs_a_duplicate() -> None:
    full = [_d(f"n{i:02d}", i, "10.0.0.1") for i in range(4)]
    assert "late" not in assign_indexes([*full, _d("late", -1, "10.0.0.9")], 4)
    out = assign_indexes([_d("a", 1, "10.0.0.1"), _d("b", 1, "10.0.0.2"), _d("c", 7, "10.0.0.3")], 4)
    assert out["a"] == 1 and {out["b"], out["c"]} == {0, 2}


def test_unresponsive_nodes_from_leases_and_ready_conditions() -> None:
    leases = [{"metadata": {"name": "fresh"}, "spec": {"renewTime": "2026-12-02T15:00:39.500000Z"}},
              {"metadata": {"name": "stale"}, "spec": {"renewTime": "2026-12-02T15:00:00.000000Z"}},
              {"metadata": {"name": "acquired-only"}, "spec": {"acquireTime": "2026-12-02T14:00:00Z"}},
              {"metadata": {"name": "no-times"}, "spec": {}}]
    nodes = [{"metadata": {"name": "unknown"}, "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}},
             {"metadata": {"name": "not-ready"}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}},
             {"metadata": {"name": "fresh"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]
    now = 1796223640.0  # 2026-12-02T15:00:40Z
    assert unresponsive_nodes(leases, nodes, now_s=now, grace_s=30.0) == {"stale", "acquired-only", "unknown",
                                                                          "not-ready"}
    assert "stale" not in unresponsive_nodes(leases, [], now_s=now, grace_s=60.0)


def test_membership_patch_removes_gone_nodes_clears_failed_ones_and_keeps_their_index() -> None:
    clique = {"daemons": [
        {"nodeName": "a", "ipAddress": "10.0.0.1", "cliqueID": CLIQUE, "index": 0, "status": "Ready"},
        {"nodeName": "gone", "ipAddress": "10.0.0.2", "cliqueID": CLIQUE, "index": 1, "status": "Ready"},
        {"nodeName": "dead", "ipAddress": "10.0.0.3", "cliqueID": CLIQUE, "index": 2, "status": "Ready"},
        {"nodeName": "gone2", "index": 3},
        {"nodeName": "dead-cleared", "index": 4}]}
    ops = membership_operations(clique, keep_nodes={"a", "dead", "dead-cleared"},
                                failed_nodes={"dead", "dead-cleared"})
    out = apply_patch(clique, ops, JSON_PATCH)
    assert out["daemons"] == [
        {"nodeName": "a", "ipAddress": "10.0.0.1", "cliqueID": CLIQUE, "index": 0, "status": "Ready"},
        {"nodeName": "dead", "index": 2},
        {"nodeName": "dead-cleared", "index": 4}]
    assert membership_operations(out, keep_nodes={"a", "dead", "dead-cleared"}, failed_nodes={"dead"}) == []
    # every touched position is guarded by a test of its nodeName
    tests = {op["path"] for op in ops if op["op"] == "test"}
    assert tests == {"/daemons/2/nodeName", "/daemons/1/nodeName", "/daemons/3/nodeName"}


def _settings(tmp_path: Path) -> DaemonSettings:
    return DaemonSettings(clique_id=CLIQUE, cd_uid=CD, node_name="node-a", pod_ip="10.0.0.7", pod_uid="pod-uid",
                          pod_name="daemon-a", pod_namespace="nvidia-dra-driver", max_nodes=4, imexd_dir=tmp_path)


def test_the_daemon_applies_only_its_own_fields_and_skips_an_unchanged_entry(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert field_manager(settings) == "compute-domain-daemon/node-a"
    body = entry_body(settings)
    assert body["metadata"]["labels"] == {LABEL_COMPUTE_DOMAIN: CD, LABEL_CLIQUE_ID: CLIQUE}
    assert body["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "daemon-a",
                                                    "uid": "pod-uid"}]
    # no index, no status: the controller's (the status mirrors the daemon pod's Ready condition)
    assert body["daemons"] == [{"nodeName": "node-a", "ipAddress": "10.0.0.7", "cliqueID": CLIQUE}]
    assert entry_body(settings, member=False)["daemons"] == []
    obj = {**body, "daemons": [{**body["daemons"][0], "index": 2, "status": STATUS_NOT_READY}]}
    assert entry_current(obj, settings)
    flipped = {**obj, "daemons": [{**obj["daemons"][0], "status": STATUS_READY}]}
    assert entry_current(flipped, settings)  # a status flip is the controller's write, not the daemon's
    assert not entry_current({**obj, "metadata": {**obj["metadata"], "ownerReferences": []}}, settings)
    moved = {**obj, "daemons": [{**obj["daemons"][0], "ipAddress": "10.0.0.8"}]}
    assert not entry_current(moved, settings)  # another pod's IP: this pod applies its own
    cleared = {**obj, "daemons": [{"nodeName": "node-a", "index": 2}]}  # the controller cleared a failed node
    assert not entry_current(cleared, settings)


def test_peer_mapping_puts_reservations_and_unindexed_members_on_the_unused_ip(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    daemons = [_d("node-a", 0, "10.0.0.7"), _d("node-b", 1, ""), _d("node-c", -1, "10.0.0.9")]
    mapping = peer_mapping(settings, daemons)
    assert mapping == {dns_name(CD, 0): "10.0.0.7", dns_name(CD, 1): UNUSED_SLOT_IP,
                       dns_name(CD, 2): UNUSED_SLOT_IP, dns_name(CD, 3): UNUSED_SLOT_IP}


def test_global_status_is_elastic() -> None:
    ready, not_ready = _d("a", 0, "10.0.0.1", STATUS_READY), _d("b", 1, "10.0.0.2")
    assert global_status(4, [ready]) == STATUS_READY  # numNodes is advisory
    assert global_status(1, [ready, not_ready]) == STATUS_NOT_READY
    assert global_status(0, []) == STATUS_READY  # NVIDIA: no node and numNodes 0 is Ready
    assert global_status(2, []) == STATUS_NOT_READY  # nobody joined yet
