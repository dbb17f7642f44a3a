"""NVIDIA's consumable-share example manifests (``fixtures/nvidia/consumable-shares-*.yaml``, copied with their
provenance) allocate as they mean over the slices ``dradriver inspect`` prints with the plugin's
``--consumable-shares`` mode: the replicas share one GPU, each with its own share."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dradriver.allocator.simulation import load, simulate
from tests.allocator.nvidia_examples import CLASSES, example, inspected


def slices(mode: str) -> str:
    """The slices of a DGX H100 node with ``--consumable-shares <mode>`` (and its gate), as a List."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": inspected(
        "--mock-profile", "dgx-h100", "--node-name", "h100-node", "--feature-gates", "ConsumableShares=true",
        "--consumable-shares", mode)})


def results(outcome: Any) -> list[dict[str, Any]]:
    return [r for c in outcome.claims for r in c["status"]["allocation"]["devices"]["results"]]


@pytest.mark.parametrize(("name", "mode", "replicas", "consumed"), [
    ("memory-sharing", "memory", 2, {"memory": "4Gi"}),
    ("integer-sharing", "4", 4, {"shares": "1"}),
    ("unlimited-sharing", "unlimited", 2, {"memory": "0"}),
])
def test_consumable_share_example_replicas_share_one_gpu(name: str, mode: str, replicas: int,
                                                         consumed: dict[str, str]) -> None:
    inputs = load([CLASSES, slices(mode), example(f"consumable-shares-{name}.yaml")])
    assert not inputs.warnings
    outcome = simulate(inputs)
    assert not outcome.failures
    shares = results(outcome)
    assert len(shares) == replicas
    assert {r["device"] for r in shares} == {"gpu-0"}  # every replica on the first GPU, each with its own share
    assert len({r["shareID"] for r in shares}) == replicas
    for r in shares:
        assert {k: v for k, v in r["consumedCapacity"].items() if k in consumed} == consumed


def test_integer_shares_run_out_after_n_replicas_per_gpu() -> None:
    """With ``--consumable-shares=2`` the example's four replicas take two GPUs, two shares each."""
    inputs = load([CLASSES, slices("2"), example("consumable-shares-integer-sharing.yaml")])
    outcome = simulate(inputs)
    assert not outcome.failures
    assert sorted(r["device"] for r in results(outcome)) == ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]
