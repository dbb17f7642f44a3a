"""NVIDIA's consumable-share example manifests (``fixtures/nvidia/consumable-shares-*.yaml``, copied with their
provenance) allocate as they mean over the slices ``dradriver inspect`` prints with the plugin's
``--consumable-shares`` mode: the replicas share one GPU, each with its own share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dradriver.allocator.simulation import load, simulate
from dradriver.cli import main

REPO = Path(__file__).resolve().parents[2]
NVIDIA = Path(__file__).resolve().parent / "fixtures" / "nvidia"
CLASSES = (REPO / "deploy" / "kustomize" / "base" / "deviceclasses.yaml").read_text()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DRADRIVER_MOCK_PROFILE", "DRADRIVER_NVML_LIBRARY", "NODE_NAME", "SYSFS_ROOT", "FEATURE_GATES",
                 "CONSUMABLE_SHARES"):
        monkeypatch.delenv(name, raising=False)


def inspected(capsys: pytest.CaptureFixture[str], mode: str) -> str:
    rc = main(["inspect", "--mock-profile", "dgx-h100", "--node-name", "h100-node", "-o", "json",
               "--feature-gates", "ConsumableShares=true", "--consumable-shares", mode])
    out, err = capsys.readouterr()
    assert rc == 0, err
    slices = json.loads(out)
    for i, s in enumerate(slices):
        s["metadata"] = {"name": f"h100-node-gpu.nvidia.com-{i}"}
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": slices})


def results(outcome: Any) -> list[dict[str, Any]]:
    return [r for c in outcome.claims for r in c["status"]["allocation"]["devices"]["results"]]


@pytest.mark.parametrize(("example", "mode", "replicas", "consumed"), [
    ("memory-sharing", "memory", 2, {"memory": "4Gi"}),
    ("integer-sharing", "4", 4, {"shares": "1"}),
    ("unlimited-sharing", "unlimited", 2, {"memory": "0"}),
])
def test_consumable_share_example_replicas_share_one_gpu(capsys: pytest.CaptureFixture[str], example: str, mode: str,
                                                         replicas: int, consumed: dict[str, str]) -> None:
    inputs = load([CLASSES, inspected(capsys, mode), (NVIDIA / f"consumable-shares-{example}.yaml").read_text()])
    assert not inputs.warnings
    outcome = simulate(inputs)
    assert not outcome.failures
    shares = results(outcome)
    assert len(shares) == replicas
    assert {r["device"] for r in shares} == {"gpu-0"}  # every replica on the first GPU, each with its own share
    assert len({r["shareID"] for r in shares}) == replicas
    for r in shares:
        assert {k: v for k, v in r["consumedCapacity"].items() if k in consumed} == consumed


def test_integer_shares_run_out_after_n_replicas_per_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--consumable-shares=2`` the example's four replicas take two GPUs, two shares each."""
    inputs = load([CLASSES, inspected(capsys, "2"), (NVIDIA / "consumable-shares-integer-sharing.yaml").read_text()])
    outcome = simulate(inputs)
    assert not outcome.failures
    assert sorted(r["device"] for r in results(outcome)) == ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]
