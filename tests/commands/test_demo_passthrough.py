"""``dradriver demo --scenario passthrough``: a GPU bound to vfio-pci for a VM claim and given back to nvidia."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

from dradriver.sandbox.demos import passthrough
from dradriver.sandbox.demos.narrator import Narrator

ROOT = Path(__file__).resolve().parents[2]


def test_passthrough_scenario_in_process() -> None:
    out = io.StringIO()
    narrator = Narrator(output="json", stream=out)
    asyncio.run(passthrough.demo(node_name="gpu-node-1", narrator=narrator))
    steps = narrator.steps
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    details = {k: v for s in steps for d in s["details"] for k, v in d.items()}
    assert len(details["vfio"]) == 8
    spec = details["cdi_spec"]
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"].startswith("/dev/vfio/")
    assert details["withdrawn"].startswith("gpu-") and details["uuid"].startswith("GPU-")


def test_passthrough_scenario_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", "--scenario", "passthrough", "--output", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is True
