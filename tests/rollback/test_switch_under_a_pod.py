"""Switching drivers while a pod runs on a prepared claim, through the emulated kubelet (:class:`ClusterEmulator`:
real gRPC over the plugins' Unix sockets, one registrar directory that both drivers register in, as on a node).

One driver's plugin prepares the pod's claim and the pod runs; that plugin stops and the other starts on the same
plugin, registrar and CDI directories; the kubelet's plugin watcher sees the new registration socket and calls the
new instance. The pod keeps running (nothing is prepared again), the claim's device is refused to another pod's
claim, and deleting the pod sends the kubelet's unprepare to the new driver, which leaves nothing behind. Skipped,
with the reason, where NVIDIA's binary or its mock NVML is absent."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.identity import GPU_DRIVER
from dradriver.host.claimstate import ClaimState
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint
from dradriver.sandbox.cluster import ClusterEmulator
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.rollback.peers import claim, dradriver_process, needs_nvidia, nvidia_process, stop, switched_node
from tests.rollback.test_nvidia_switchin import on_one_node

pytestmark = needs_nvidia


def _pod(node: SandboxNode, name: str, claim_name: str) -> dict[str, Any]:
    """A pod whose one container uses the existing claim ``claim_name``."""
    assert node.api is not None
    return node.api.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
                 "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}]}})


def _phase(node: SandboxNode, name: str) -> str:
    assert node.api is not None
    pod = node.api.get("Pod", name, "default")
    return str(((pod or {}).get("status") or {}).get("phase", ""))


def _prepare_failures(node: SandboxNode, pod: str) -> list[str]:
    assert node.api is not None
    return [e["message"] for e in node.api.objects("Event") if e.get("reason") == "FailedPrepareDynamicResources"
            and e["involvedObject"]["name"] == pod]


async def _until(cluster: ClusterEmulator, what: str, done: Callable[[], Any], proc: subprocess.Popen[bytes],
                 log: Path, lines: list[str], timeout: float = 60) -> None:
    """Run the emulated kubelet's reconcile passes until ``done()`` (fails with its lines and the plugin's log)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        if proc.poll() is not None or loop.time() > deadline:
            raise AssertionError(f"{what}: not reached (plugin exit {proc.poll()}); kubelet: {lines[-20:]}; "
                                 f"log: {log.read_text(errors='replace')[-3000:]}")
        await cluster.reconcile()
        await asyncio.sleep(0.05)


def _spec_files(cdi_root: Path, uid: str) -> list[str]:
    return sorted(p.name for p in cdi_root.iterdir() if uid in p.name)


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_a_running_pods_claim_nvidia_prepared_is_held_by_dradriver_and_unprepared_when_the_pod_goes(
        sandbox: SandboxNode, tmp_path: Path) -> None:
    config, cdi_root, plugin_dir = switched_node(sandbox)
    registrar = Path(config.kubelet_registrar_directory_path)
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)
    ref = claim(sandbox, "workload", "gpu-3")
    _pod(sandbox, "workload", "workload")
    nvidia_log, log = tmp_path / "nvidia.log", tmp_path / "dradriver.log"

    async def body() -> None:
        async with KubeletEmulator(registrar) as kubelet:
            cluster._kubelet = kubelet
            with nvidia_process(sandbox, tmp_path, registrar=registrar) as (nvidia, _registrar):
                await _until(cluster, "the pod runs on NVIDIA's plugin", lambda: _phase(sandbox, "workload") ==
                             "Running", nvidia, nvidia_log, lines)
                by_nvidia = cluster.plugin
                assert _spec_files(cdi_root, ref.uid) == [f"k8s.gpu.nvidia.com-claim_{ref.uid}.yaml"]
                stop(nvidia, "graceful")
            on_one_node(sandbox, plugin_dir / CHECKPOINT_FILE)
            with dradriver_process(sandbox, log) as proc:
                await _until(cluster, "dradriver registers in NVIDIA's place",
                             lambda: cluster.plugin not in (None, by_nvidia), proc, log, lines)
                assert _phase(sandbox, "workload") == "Running"
                # another pod's claim on the same GPU (a scheduler's mistake) is refused: dradriver holds it
                claim(sandbox, "intruder", "gpu-3")
                _pod(sandbox, "intruder", "intruder")
                await _until(cluster, "the intruder's prepare fails", lambda: _prepare_failures(sandbox, "intruder"),
                             proc, log, lines)
                assert f"already prepared for claim / (uid {ref.uid})" in _prepare_failures(sandbox, "intruder")[0]
                assert _phase(sandbox, "intruder") != "Running" and _phase(sandbox, "workload") == "Running"
                assert sandbox.api is not None
                sandbox.api.delete("Pod", "intruder", "default")
                sandbox.api.delete("Pod", "workload", "default")
                await _until(cluster, "the claim is unprepared", lambda: not cluster.prepared, proc, log, lines)
                assert _spec_files(cdi_root, ref.uid) == []
                kept = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
                assert kept is not None and not kept.claims
                stop(proc, "graceful")

    asyncio.run(body())
    # prepared once, by NVIDIA's plugin; the switch prepared nothing again
    assert [line for line in lines if "claim workload prepared" in line] == [
        f"kubelet: pod default/workload claim workload prepared: k8s.gpu.nvidia.com/claim={ref.uid}-gpu-3"], lines
    assert "kubelet: claim default/workload unprepared (no pod uses it)" in lines
    assert "1 claim(s) adopted, 0 half-prepared to roll back, 0 dropped" in log.read_text()
    with ClaimState.open(plugin_dir / GPU_DRIVER.state_file, boot_id_path=config.boot_id_path) as state:
        assert state.claims() == {}


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
@pytest.mark.parametrize("how", ["graceful", "sigkill"])
def test_a_running_pods_claim_dradriver_prepared_is_held_by_nvidia_and_unprepared_when_the_pod_goes(
        sandbox: SandboxNode, tmp_path: Path, how: str) -> None:
    config, cdi_root, plugin_dir = switched_node(sandbox)
    registrar = Path(config.kubelet_registrar_directory_path)
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)
    ref = claim(sandbox, "workload", "gpu-3")
    _pod(sandbox, "workload", "workload")
    nvidia_log, log = tmp_path / "nvidia.log", tmp_path / "dradriver.log"

    async def body() -> None:
        async with KubeletEmulator(registrar) as kubelet:
            cluster._kubelet = kubelet
            with dradriver_process(sandbox, log) as proc:
                await _until(cluster, "the pod runs on dradriver", lambda: _phase(sandbox, "workload") == "Running",
                             proc, log, lines)
                by_dradriver = cluster.plugin
                stop(proc, how)
            with nvidia_process(sandbox, tmp_path, registrar=registrar) as (nvidia, _registrar):
                await _until(cluster, "NVIDIA's plugin registers in dradriver's place",
                             lambda: cluster.plugin not in (None, by_dradriver), nvidia, nvidia_log, lines)
                assert _phase(sandbox, "workload") == "Running"
                claim(sandbox, "intruder", "gpu-3")
                _pod(sandbox, "intruder", "intruder")
                await _until(cluster, "the intruder's prepare fails", lambda: _prepare_failures(sandbox, "intruder"),
                             nvidia, nvidia_log, lines)
                assert f"already allocated to different claim {ref.uid}" in _prepare_failures(sandbox, "intruder")[0]
                assert _phase(sandbox, "intruder") != "Running" and _phase(sandbox, "workload") == "Running"
                assert sandbox.api is not None
                sandbox.api.delete("Pod", "intruder", "default")
                sandbox.api.delete("Pod", "workload", "default")
                await _until(cluster, "the claim is unprepared", lambda: not cluster.prepared, nvidia, nvidia_log,
                             lines)
                assert _spec_files(cdi_root, ref.uid) == []
                kept = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
                assert kept is not None and not kept.claims
                assert nvidia.poll() is None

    asyncio.run(body())
    assert [line for line in lines if "claim workload prepared" in line] == [
        f"kubelet: pod default/workload claim workload prepared: k8s.gpu.nvidia.com/claim={ref.uid}-gpu-3"], lines
    assert "kubelet: claim default/workload unprepared (no pod uses it)" in lines
