"""``dradriver demo --scenario dynamic-mig``: MIG devices created at prepare, destroyed at unprepare."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.sandbox.demos import dynamic_mig
from dradriver.sandbox.demos.narrator import Narrator

ROOT = Path(__file__).resolve().parents[2]


def test_dynamic_mig_scenario_in_process() -> None:
    out = io.StringIO()
    narrator = Narrator(output="json", stream=out)
    asyncio.run(dynamic_mig.demo(node_name="gpu-node-1", narrator=narrator))
    steps = narrator.steps
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    details = {k: v for s in steps for d in s["details"] for k, v in d.items()}
    assert details["placements"]["1g.18gb"] == 56 and details["placements"]["3g.71gb"] == 16
    texts = [d["text"] for s in steps for d in s["details"] if "text" in d]
    assert any("MIG mode on: 0, GPU instances: 0" in t for t in texts)
    allocated = [t for t in texts if t.startswith("claim mig-")]
    assert len(allocated) == 2 and all(t.endswith("(allocation simulator)") for t in allocated), allocated
    smi = [d["nvidia_smi"] for s in steps for d in s["details"] if "nvidia_smi" in d]
    assert len(smi) == 2 and "MIG 1g.18gb" in smi[0] and "MIG 3g.71gb" in smi[1]
    status = [d["device_status"] for s in steps for d in s["details"] if "device_status" in d]
    assert [s["data"]["profile"] for s in status] == ["1g.18gb", "3g.71gb"]
    assert all(s["data"]["uuid"].startswith("MIG-") for s in status)
    specs = [d["cdi_spec"] for s in steps for d in s["details"] if "cdi_spec" in d]
    for spec in specs:
        paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
        assert paths[0].startswith("/dev/nvidia") and sum(p.startswith("/dev/nvidia-caps/") for p in paths) == 2
    assert any("MIG mode off on every GPU" in t for t in texts)


@pytest.mark.slow
def test_dynamic_mig_scenario_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", "--scenario", "dynamic-mig", "--output", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["profile"] == "dgx-h200"
