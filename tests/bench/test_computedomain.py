"""The ComputeDomain fleet bench (``bench/cdfleet.py``, ``bench/cdprotocol.py``, ``bench/controllerprobe.py``) at
tiny sizes: every node prepared, writes and conflicts read from the emulator's records, indexes unique, the
controller's cost measured in its own process. Shape and bookkeeping only: no timings are asserted."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import cdchurn, cdfleet, cdprotocol
from dradriver.domain import computedomains as cd
from dradriver.sandbox.apiserver import RequestRecord

FAST = cdfleet.Timing(scale=0.05)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[cdfleet.Fleet]:
    f = cdfleet.Fleet(cdfleet.spread(7, 2)).start(tmp_path)
    try:
        yield f
    finally:
        f.stop()


def test_spread_fills_racks_evenly_and_refuses_what_does_not_fit() -> None:
    assert cdfleet.spread(256, 15) == [18] + [17] * 14
    assert cdfleet.spread(7, 2) == [4, 3]
    with pytest.raises(ValueError, match="do not fit"):
        cdfleet.spread(19, 1)
    with pytest.raises(ValueError, match="do not fit"):
        cdfleet.spread(1, 2)


def test_count_writes_splits_membership_from_labels_per_agent() -> None:
    def rec(verb: str, resource: str, code: int, agent: str) -> RequestRecord:
        return RequestRecord("X", "/", "", verb, resource, None, "ns", "n", code, user_agent=agent)

    records = [rec("update", cd.CLIQUE_PLURAL, 409, "bench-node/a"),
               rec("update", cd.CLIQUE_PLURAL, 200, "bench-node/a"),
               rec("patch", "nodes", 200, "bench-node/a"), rec("get", cd.CLIQUE_PLURAL, 200, "bench-node/b"),
               rec("update", cd.COMPUTE_DOMAIN_PLURAL, 200, "bench-controller"), rec("patch", "pods", 200, "")]
    counts = cdfleet.count_writes(records, cdfleet.NODE_AGENT)
    assert counts == {"a": cdfleet.WriteCounts(2, 1, 0, 1), "b": cdfleet.WriteCounts(0, 0, 1, 0)}
    assert cdfleet.count_writes(records, cdfleet.CONTROLLER_AGENT) == {"": cdfleet.WriteCounts(1, 0, 0, 0)}


@pytest.mark.parametrize("membership", [cdfleet.NvidiaMembership, cdfleet.DradriverMembership])
def test_a_domain_runs_to_every_node_prepared(fleet: cdfleet.Fleet, membership: type) -> None:
    result = cdfleet.run_domain(fleet, membership(), FAST, timeout_s=120)
    names = {n.name for n in fleet.nodes}
    assert result.nodes == len(names) and set(result.per_node) == names
    for name, counts in result.per_node.items():
        assert counts.label_writes == 2, name  # the plugin's node label, the daemon's pod label
        if membership is cdfleet.NvidiaMembership:
            assert counts.membership_writes >= 2, name  # the entry NotReady, then Ready (409-answered tries included)
        else:
            assert (counts.membership_writes, counts.conflicts) == (1, 0), name  # one apply per pod, never a 409
    assert result.prepare_attempts >= result.nodes and result.prepare_calls >= result.nodes
    assert result.seconds > 0
    assert "entries Ready" in result.stages  # the run waits for every entry's Ready (a dradriver node may be
    # prepared first: its plugin reads the daemon pod's Ready before the controller copies it into the entry)
    cliques = fleet.api.objects("ComputeDomainClique", fleet.namespace)
    assert len(cliques) == 2
    for clique in cliques:
        indexes = [d["index"] for d in clique["daemons"]]
        assert len(indexes) == len(set(indexes)) and sorted(indexes) == list(range(len(indexes)))
        assert {d["status"] for d in clique["daemons"]} == {cd.STATUS_READY}
    assert sum(len(c["daemons"]) for c in cliques) == len(names)


def test_status_round_lists_everything_and_writes_only_changed_domains(fleet: cdfleet.Fleet) -> None:
    domains = cdfleet.seed_domains(fleet, racks_per_domain=1)
    client = fleet.client(cdfleet.CONTROLLER_AGENT)
    try:
        first = cdprotocol.status_round(client, fleet.namespace)
        assert (first.domains, first.pods, first.cliques, first.status_writes) == (2, 7, 2, 2)
        assert set(first.ready.values()) == {cd.STATUS_READY}
        assert cdprotocol.status_round(client, fleet.namespace).status_writes == 0
        cdfleet.flip_entries(fleet, domains[:1], 1, random.Random(1))
        third = cdprotocol.status_round(client, fleet.namespace)
        assert third.status_writes == 1 and third.ready[domains[0].uid] == cd.STATUS_NOT_READY
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["nvidia", "dradriver"])
def test_the_controller_probe_reports_cpu_memory_and_writes_per_event(fleet: cdfleet.Fleet, mode: str) -> None:
    domains = cdfleet.seed_domains(fleet)
    cost = cdfleet.measure_controller(fleet, domains, mode, events_per_round=2, rounds=2)
    assert (cost.racks, cost.nodes, cost.domains, cost.events) == (2, 7, 1, 4)
    assert cost.cpu_per_event_s > 0 and cost.emulator_cpu_per_event_s > 0
    assert cost.peak_kib >= 0 and 1 <= cost.writes <= 2  # one domain: at most one status write a round


def test_churn_leaves_nothing_behind_and_never_holds_an_index_twice(tmp_path: Path) -> None:
    fleet = cdfleet.Fleet([2] * 4).start(tmp_path)
    try:
        result = cdchurn.run_churn(fleet, domains=3, slots=2, restarts=1, timing=FAST, timeout_s=120)
        assert (result.domains, result.restarts, result.ready_again) == (3, 3, 3)
        assert result.duplicates == [] and result.clique_states > 0
        assert cdchurn.leftovers(fleet) == []
        assert result.writes == result.node_writes + result.controller_writes and result.node_writes > 0
    finally:
        fleet.stop()


def test_leftovers_name_what_a_domain_left(fleet: cdfleet.Fleet) -> None:
    assert cdchurn.leftovers(fleet) == []
    cdfleet.seed_domains(fleet)
    left = cdchurn.leftovers(fleet)
    assert sum(x.startswith("ComputeDomainClique ") for x in left) == 2
    assert sum(x.startswith("Pod ") for x in left) == 7 and any(x.startswith("ComputeDomain ") for x in left)
