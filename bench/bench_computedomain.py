"""Issue 14: ComputeDomain membership at fleet scale, with NVIDIA's protocol as the baseline in the same run.

* ``compute_domain_256``: 256 nodes over 15 emulated racks in one API emulator, one 256-pod domain, from its
  creation to every workload pod's channel prepared (:func:`bench.cdfleet.run_domain`, NVIDIA's periods unscaled).
  Variants: ``nvidia`` (:mod:`bench.cdprotocol`: the shared clique read-modify-written with conflict retries, the
  2 s status loop) and ``dradriver`` (this checkout's daemon :class:`dradriver.computedomain.daemon.Membership`:
  server-side apply of its own entry, clique polled every 1 s; the real controller in process, event-driven).
  Targets: dradriver >= 20x faster than the baseline, <= 3 API writes per node, 0 conflicts.
* ``compute_domain_fleet``: 10, 100 and 1,000 racks of 18 nodes (180 .. 18,000 nodes; one domain per 2 racks:
  5 .. 500 domains), settled; the controller runs in a process of its own (:mod:`bench.controllerprobe`) and
  handles 20 rounds of one membership event (a daemon's entry flips Ready/NotReady); its CPU per event and its
  memory, and the emulator's CPU per event apart. Target: CPU per event at 1,000 racks <= 1.5x that at 10 racks.
* ``compute_domain_churn``: 100 domains created and deleted (5 at a time) while 2 daemons of each restart
  (:mod:`bench.cdchurn`); the run fails on anything left behind, an index held twice in an observed clique state,
  or a domain not Ready again; figures: time, writes, 409s.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import cdfleet

NODES, RACKS = 256, 15
FLEET_RACKS = tuple(int(r) for r in os.environ.get("BENCH_CD_FLEET_RACKS", "10,100,1000").split(","))
WRITES_TARGET = 3.0
SPEEDUP_TARGET = 20.0
FLATNESS_TARGET = 1.5
EVENTS_PER_ROUND, ROUNDS = 1, 20  # one event a round: the per-event cost without coalescing (which helps small fleets)
CHURN_DOMAINS, CHURN_SLOTS, CHURN_RACK_NODES = 100, 5, 4

MEMBERSHIPS: dict[str, Callable[[], cdfleet.Membership]] = {
    "nvidia": cdfleet.NvidiaMembership,
    "dradriver": cdfleet.DradriverMembership,
}


def _figures_256(result: cdfleet.DomainResult, *, ours: bool) -> dict[str, Any]:
    def fig(value: float, op: str = "", target: float = 0.0) -> tuple[float, str, float]:
        return (round(value, 3), op if ours else "", target)

    return {
        f"{result.protocol}: seconds to all {result.nodes} prepared": fig(result.seconds),
        f"{result.protocol}: writes per node, max": fig(result.max_writes_per_node, "<=", WRITES_TARGET),
        f"{result.protocol}: writes per node, mean": fig(result.mean_writes_per_node),
        f"{result.protocol}: membership writes per node (cliques, domains), mean": fig(result.mean_membership_writes),
        f"{result.protocol}: label writes per node (node, pod), mean": fig(result.mean_label_writes),
        f"{result.protocol}: 409 conflicts": fig(result.conflicts, "<=", 0),
        f"{result.protocol}: controller writes": fig(result.controller.membership_writes
                                                     + result.controller.label_writes),
        f"{result.protocol}: NodePrepareResources calls (kubelet retries past 45 s)": fig(result.prepare_calls),
        f"{result.protocol}: plugin readiness lookups (prepare tries)": fig(result.prepare_attempts),
        **{f"{result.protocol}: slowest node at {stage} (s)": fig(at) for stage, at in result.stages.items()},
    }


@pytest.mark.parametrize("variant", sorted(MEMBERSHIPS))
def test_compute_domain_256(benchmark: Any, variant: str) -> None:
    """One 256-node domain from creation to every channel prepared; one round (a run is ~30 s)."""
    results: list[cdfleet.DomainResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        fleet = cdfleet.Fleet(cdfleet.spread(NODES, RACKS)).start(Path(tmp))
        try:
            benchmark.pedantic(lambda: results.append(cdfleet.run_domain(fleet, MEMBERSHIPS[variant](),
                                                                           cdfleet.Timing())),
                               rounds=1, iterations=1)
        finally:
            fleet.stop()
    result = results[0]
    benchmark.extra_info.update({"scenario": "compute_domain_256", "variant": variant, "prepared_s": result.seconds,
                                 "figures": _figures_256(result, ours=variant == "dradriver")})


@pytest.mark.parametrize("mode", ["nvidia", "dradriver"])
def test_compute_domain_fleet(benchmark: Any, mode: str) -> None:
    """The controller's CPU per membership event and memory at 10, 100 and 1,000 racks."""
    costs: list[cdfleet.ControllerCost] = []

    def measure() -> None:
        for racks in FLEET_RACKS:
            with tempfile.TemporaryDirectory() as tmp:
                fleet = cdfleet.Fleet([18] * racks).start(Path(tmp))
                try:
                    costs.append(cdfleet.measure_controller(fleet, cdfleet.seed_domains(fleet), mode,
                                                            events_per_round=EVENTS_PER_ROUND, rounds=ROUNDS))
                finally:
                    fleet.stop()

    benchmark.pedantic(measure, rounds=1, iterations=1)
    ours = mode == "dradriver"
    figures: dict[str, tuple[float, str, float]] = {}
    for cost in costs:
        at = f"{mode} at {cost.racks} racks ({cost.nodes} nodes, {cost.domains} domains)"
        figures[f"{at}: controller CPU per event (ms)"] = (round(cost.cpu_per_event_s * 1e3, 3), "", 0.0)
        figures[f"{at}: emulator CPU per event (ms)"] = (round(cost.emulator_cpu_per_event_s * 1e3, 3), "", 0.0)
        figures[f"{at}: controller memory after rounds (MiB)"] = (round(cost.memory_kib / 1024, 1), "", 0.0)
        figures[f"{at}: controller peak memory (MiB)"] = (round(cost.peak_kib / 1024, 1), "", 0.0)
        figures[f"{at}: controller writes per event"] = (round(cost.writes / cost.events, 3), "", 0.0)
    if len(costs) > 1:
        first, last = costs[0], costs[-1]
        figures[f"{mode}: CPU per event, {last.racks} / {first.racks} racks (flatness)"] = (
            round(last.cpu_per_event_s / first.cpu_per_event_s, 2), "<=" if ours else "", FLATNESS_TARGET)
        figures[f"{mode}: peak memory, {last.racks} / {first.racks} racks (flatness)"] = (
            round(last.peak_kib / max(1, first.peak_kib), 2), "<=" if ours else "", FLATNESS_TARGET)
    benchmark.extra_info.update({"scenario": "compute_domain_fleet", "variant": mode, "figures": figures})


def test_compute_domain_churn(benchmark: Any) -> None:
    """100 domains through 5 lanes of 2 racks of 4 nodes, 2 daemon restarts each (:mod:`bench.cdchurn`): nothing
    left behind, no index held twice in any observed clique state, every domain Ready again after its restarts."""
    from bench import cdchurn

    results: list[cdchurn.ChurnResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        fleet = cdfleet.Fleet([CHURN_RACK_NODES] * (2 * CHURN_SLOTS)).start(Path(tmp))
        try:
            benchmark.pedantic(lambda: results.append(cdchurn.run_churn(fleet, domains=CHURN_DOMAINS,
                                                                          slots=CHURN_SLOTS)),
                               rounds=1, iterations=1)
        finally:
            fleet.stop()
    r = results[0]
    benchmark.extra_info.update({"scenario": "compute_domain_churn", "variant": "dradriver", "figures": {
        "domains created, Ready again after restarts, deleted": (r.ready_again, ">=", CHURN_DOMAINS),
        "daemon restarts": (r.restarts, "", 0.0),
        "seconds": (round(r.seconds, 2), "", 0.0),
        "writes (nodes + controller)": (r.writes, "", 0.0),
        "node writes per domain": (round(r.node_writes / r.domains, 2), "", 0.0),
        "controller writes per domain": (round(r.controller_writes / r.domains, 2), "", 0.0),
        "409 conflicts": (r.conflicts, "", 0.0),
        "409 conflicts answered to node agents": (r.node_conflicts, "", 0.0),
        "clique states checked": (r.clique_states, "", 0.0),
        "clique states with an index held twice": (len(r.duplicates), "<=", 0),
    }})
