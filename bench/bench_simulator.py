"""``dradriver explain`` on a fleet dump: 18,000 GB200 nodes (72,000 GPUs), selectors evaluated once per device
shape against the per-device evaluator, in the same run.

Scenario ``explain_fleet_18000``: the slices of ``gb200-nvl72-node`` (4 GPUs) copied to 18,000 nodes
(:mod:`bench.simfleet`, one JSON ``List`` as ``kubectl get resourceslices -o json`` prints it), NVIDIA's
DeviceClasses, and one claim:

* ``nowhere``: one GPU with at least 200Gi of memory (a GB200 has 189471Mi): fits no node, so ``explain`` gives
  the verdict of every one of the 72,000 GPUs and the allocation tries every node;
* ``fits``: one Blackwell GPU: allocated on the first node, explained there.

Variants ``<claim>_per_shape`` (:class:`dradriver.allocator.shapes.ShapeCache` on, the default) and
``<claim>_per_device`` (``per_shape=False``: every selector on every device, the evaluator before the cache).
Each round reads the dump afresh (not timed: ``load`` is reported as a figure) and times
:func:`dradriver.allocator.simulation.explain`; the two texts are compared (they must be identical).
Targets: per device / per shape >= 20 on ``nowhere``; ``explain`` with the load under 10 s on that fleet. (``fits``
explains one node: both evaluators take about 0.1 s there; it is reported, not compared.)
Run: ``python -m bench -k simulator`` (``BENCH_SIM_NODES`` changes the fleet size).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from bench import simfleet
from dradriver.allocator import simulation

SCENARIO = "explain_fleet_18000"
NODES = int(os.environ.get("BENCH_SIM_NODES", "18000"))
PROFILE = "gb200-nvl72-node"
EXPLAIN_TARGET_S = 10.0
CLASSES = Path(__file__).resolve().parent.parent / "tests" / "allocator" / "fixtures" / "deviceclasses.yaml"
CLAIMS = {
    "nowhere": "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('200Gi')) >= 0",
    "fits": "device.attributes['gpu.nvidia.com'].architecture == 'Blackwell'",
}
_TEXTS: dict[str, str] = {}


def _claim(expression: str) -> str:
    return ("apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: job, namespace: default}\n"
            "spec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n"
            "        deviceClassName: gpu.nvidia.com\n"
            f'        selectors:\n        - cel: {{expression: "{expression}"}}\n')


@pytest.fixture(scope="module")
def fleet() -> str:
    return simfleet.fleet_json(PROFILE, NODES)


@pytest.mark.parametrize("evaluator", ["per_device", "per_shape"])
@pytest.mark.parametrize("claim", list(CLAIMS))
def test_explain_fleet(benchmark: Any, fleet: str, claim: str, evaluator: str) -> None:
    texts = [fleet, CLASSES.read_text(), _claim(CLAIMS[claim])]
    started = time.perf_counter()
    inputs = simulation.load(texts, ["fleet.json", "deviceclasses.yaml", "claim.yaml"])
    load_s = time.perf_counter() - started
    result: dict[str, Any] = {}

    def run() -> None:
        result["text"], result["code"] = simulation.explain(inputs, per_shape=evaluator == "per_shape")

    benchmark.pedantic(run, rounds=1, iterations=1)
    assert result["code"] == (1 if claim == "nowhere" else 0)
    if claim in _TEXTS:
        assert result["text"] == _TEXTS[claim], "explain differs between the evaluators"
    _TEXTS[claim] = result["text"]
    explain_s = float(benchmark.stats.stats.median)
    figures: dict[str, tuple[float, str, float]] = {
        f"{claim} {evaluator}: load (s)": (round(load_s, 2), "", 0.0),
        f"{claim} {evaluator}: explain (s)": (round(explain_s, 2), "", 0.0),
    }
    if evaluator == "per_shape":
        figures[f"{claim} per_shape: load + explain (s)"] = (round(load_s + explain_s, 2), "<=", EXPLAIN_TARGET_S)
    benchmark.extra_info.update(scenario=SCENARIO, variant=f"{claim}_{evaluator}", devices=4 * NODES,
                                figures=figures)
