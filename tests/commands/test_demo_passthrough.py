"""``dradriver demo --scenario passthrough``: a VM's pod gets two GPUs of one Fabric Manager partition through VFIO,
then gives them back."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.sandbox.demos import passthrough
from dradriver.sandbox.demos.narrator import DemoError, Narrator

ROOT = Path(__file__).resolve().parents[2]


def test_passthrough_scenario_gives_a_vm_two_gpus_of_one_partition_and_takes_them_back() -> None:
    narrator = Narrator(output="json", stream=io.StringIO())
    asyncio.run(passthrough.demo(node_name="gpu-node-1", narrator=narrator))
    steps = narrator.steps
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    texts = [d["text"] for s in steps for d in s["details"] if "text" in d]
    details = {k: v for s in steps for d in s["details"] for k, v in d.items() if k != "text"}
    assert details["vfio"] == [f"gpu-vfio-{i}" for i in range(8)]
    assert any(t.startswith("gpu-vfio-0: 0000:18:00.0, gpuModuleID 1, partition2 3") for t in texts), texts
    devices = details["devices"]
    assert len(devices) == 2
    (allocated,) = [t for t in texts if t.startswith("claim virt-launcher-")]
    assert re.search(r"^claim virt-launcher-vm-a-gpus-\w+ -> gpu-vfio-\d \(\S+\), gpu-vfio-\d \(\S+\), "
                     r"partition2 \{\d+\}$", allocated), allocated
    assert any(t == "pod virt-launcher-vm-a: Running" for t in texts)
    assert any(t.count("vfio-pci") == 2 for t in texts if t.startswith("drivers: "))
    assert any(t.startswith("NVML lists 6 GPU(s) (was 8)") for t in texts)
    assert any(t.startswith("Fabric Manager: partition ") and t.endswith(" active") for t in texts)
    spec = details["cdi_spec"]
    nodes = [n["path"] for n in spec["containerEdits"]["deviceNodes"]] + [
        n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert "/dev/vfio/vfio" in nodes and sum(p.removeprefix("/dev/vfio/").isdigit() for p in nodes) == 2
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert any(t.startswith("withdrawn from the pool while the VM has them: gpu-") for t in texts)
    assert any(t.count(" nvidia") == 2 for t in texts if t.startswith("drivers: ") and "vfio" not in t)
    assert texts[-1].startswith("NVML lists 8 GPU(s); Fabric Manager: no active partition;")
    assert texts[-1].endswith("CDI specs: 0, prepared claims: 0")


def test_passthrough_scenario_on_a_board_without_fabric_manager_partitions_fails_naming_the_profile() -> None:
    narrator = Narrator(output="json", stream=io.StringIO())
    with pytest.raises(DemoError, match="profile gb200-nvl72-node: no HGX 8-GPU Fabric Manager table"):
        asyncio.run(passthrough.demo(profile="gb200-nvl72-node", node_name="gpu-node-1", narrator=narrator))


@pytest.mark.slow
def test_passthrough_scenario_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", "--scenario", "passthrough", "--output", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["profile"] == "dgx-h100" and report["scenario"] == "passthrough"


def test_passthrough_scenario_does_not_serve(capsys: pytest.CaptureFixture[str]) -> None:
    from dradriver.cli import main

    assert main(["demo", "--scenario", "passthrough", "--serve"]) == 2
    assert "--serve does not run the passthrough scenario" in capsys.readouterr().err


def test_the_user_guides_partition_claim_is_the_one_the_demo_runs() -> None:
    import yaml

    page = (ROOT / "docs" / "user-guide" / "passthrough.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", page, re.DOTALL)
    (shown,) = [yaml.safe_load(b) for b in blocks if "matchAttribute: gpu.nvidia.com/partition2" in b]
    (template,) = [m for m in passthrough.vm_manifests() if m["kind"] == "ResourceClaimTemplate"]
    assert shown["kind"] == "ResourceClaimTemplate" and shown["spec"] == template["spec"]
