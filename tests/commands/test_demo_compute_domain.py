"""``dradriver demo --scenario compute-domain``: a ComputeDomain across two nodes of one of two emulated NVL72
racks, from the command line with ``--output json`` (every step reported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_compute_domain_scenario_reports_every_step() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", "--scenario", "compute-domain", "--output",
                           "json"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["scenario"] == "compute-domain"
    steps = {s["step"]: s for s in report["steps"]}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6, 7]
    nodes = steps[1]["details"]
    assert {d["rack"] for d in nodes} == {1, 2} and len(nodes) == 4
    assert all(d["devices"] == ["channel-0", "daemon-0"] for d in steps[2]["details"])
    placed = {d["node"] for d in steps[3]["details"]}
    assert len(placed) == 2 and all(n.startswith("rack1-") for n in placed)
    ready = [d for d in steps[4]["details"] if "status" in d]
    assert sorted(d["name"] for d in ready) == sorted(placed) and all(d["status"] == "Ready" for d in ready)
    for detail in steps[5]["details"]:
        assert [n["path"] for n in detail["device_nodes"]] == ["/dev/nvidia-caps-imex-channels/channel0"]
    assert [d["state"] for d in steps[6]["details"]] == ["READY", "READY"]
    assert not any(steps[7]["details"][0]["leftovers"].values())
