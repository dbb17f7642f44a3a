"""``dradriver sandbox``'s emulated kubelet with a real plugin: what it prepares and when a pod runs."""

from __future__ import annotations

import asyncio

import yaml

from dradriver.app import start_plugin
from dradriver.sandbox.cluster import ClusterEmulator
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode

from .helpers import REPO

SHARED = [d for d in yaml.safe_load_all((REPO / "deploy" / "examples" / "shared-claim.yaml").read_text()) if d]


def _phase(sandbox: SandboxNode, name: str) -> str:
    assert sandbox.api is not None
    pod = sandbox.api.get("Pod", name, "default")
    return str(((pod or {}).get("status") or {}).get("phase", ""))


def test_both_pods_of_a_shared_claim_run_on_one_preparation(sandbox: SandboxNode) -> None:
    """``deploy/examples/shared-claim.yaml``: the claim is prepared once (as the kubelet's claim cache does) and
    the second pod runs on that preparation instead of staying Pending."""
    assert sandbox.api is not None
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)
    cluster.apply_device_classes()
    pods = [d["metadata"]["name"] for d in SHARED if d["kind"] == "Pod"]

    async def body() -> list[str]:
        plugin = await start_plugin(sandbox.config(log_level="warning"))
        try:
            async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                cluster._kubelet = kubelet
                for obj in SHARED:
                    sandbox.api.create(obj)  # type: ignore[union-attr]
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 30
                while any(_phase(sandbox, name) != "Running" for name in pods) and loop.time() < deadline:
                    await cluster.reconcile()
                    await asyncio.sleep(0.05)
                phases = [_phase(sandbox, name) for name in pods]
                for name in pods:  # the claim stays prepared while a pod uses it, and goes with the last
                    sandbox.api.delete("Pod", name, "default")  # type: ignore[union-attr]
                    await cluster.reconcile()
                    still = bool(cluster.prepared)
                    assert still == (name != pods[-1]), (name, lines)
                return phases
        finally:
            await plugin.stop()

    phases = asyncio.run(body())
    assert phases == ["Running", "Running"], lines
    prepared = [line for line in lines if "claim shared-gpu prepared" in line]
    assert len(prepared) == 1, lines
    assert f"kubelet: pod default/{pods[1]} running" in lines
    assert any(line == "kubelet: claim default/shared-gpu unprepared (no pod uses it)" for line in lines), lines


def test_a_stopped_plugin_is_deregistered_and_its_pods_claim_is_unprepared_by_the_instance_started_next(
        sandbox: SandboxNode) -> None:
    """The plugin stops (its registration socket goes): the kubelet calls nothing while none is registered, so a
    pod deleted meanwhile keeps its claim prepared until the next instance registers and unprepares it."""
    assert sandbox.api is not None
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)
    cluster.apply_device_classes()
    [claim, pod] = SHARED[:2]
    config = sandbox.config(log_level="warning")

    async def body() -> None:
        async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
            cluster._kubelet = kubelet
            first = await start_plugin(config)
            try:
                sandbox.api.create(claim)  # type: ignore[union-attr]
                sandbox.api.create(pod)  # type: ignore[union-attr]
                for _ in range(600):
                    await cluster.reconcile()
                    if _phase(sandbox, pod["metadata"]["name"]) == "Running":
                        break
                    await asyncio.sleep(0.05)
                registered = cluster.plugin
                assert registered is not None and set(cluster.prepared), lines
            finally:
                await first.stop()
            await cluster.reconcile()
            assert cluster.plugin is None and "kubelet: gpu.nvidia.com deregistered (its registration socket is " \
                "gone)" in lines
            sandbox.api.delete("Pod", pod["metadata"]["name"], "default")  # type: ignore[union-attr]
            await cluster.reconcile()  # nothing to call: the claim stays prepared
            assert set(cluster.prepared), lines
            second = await start_plugin(config)
            try:
                for _ in range(600):
                    await cluster.reconcile()
                    if not cluster.prepared:
                        break
                    await asyncio.sleep(0.05)
                assert cluster.plugin not in (None, registered) and not cluster.prepared, lines
            finally:
                await second.stop()

    asyncio.run(body())
    assert "kubelet: claim default/shared-gpu unprepared (no pod uses it)" in lines
