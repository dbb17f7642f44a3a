"""Scenario: prepare of an MPS claim end to end in the sandbox, with the wait for the control daemon apart.

The real plugin (mock NVML, dgx-h100 profile, MPSSupport on) is driven by the kubelet emulator over its Unix
socket; the API emulator serves HTTP; the sandbox's Deployment controller and container runner run the
daemon's Pod as local processes against the ``nvidia-cuda-mps-control`` stand-in; the shm tmpfs is mounted
for real where permitted. Each round prepares one one-GPU claim with ``sharing: {strategy: MPS}`` and a
thread percentage and pinned-memory limit (its unprepare, which deletes the Deployment and waits for the Pod
to go, is not timed).

Two variants: ``kubelet_1s`` runs the startup probe every second as NVIDIA's template asks (``periodSeconds:
1``), so it measures what a node sees; ``fast_probe`` runs it every 50 ms, so the remainder is the driver's
own cost. Reported per variant: p50/p99 of the prepare, p50/p99 of the time spent waiting for the Deployment
to be ready (:attr:`ControlDaemons.wait_s`), and p50 of the prepare outside that wait.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dradriver.app import GpuPlugin, start_plugin
from dradriver.domain import mps
from dradriver.domain.claims import ClaimRef
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SandboxNode


class Harness:
    """One sandbox node with MPS on, its workloads running, a plugin and a registered kubelet."""

    def __init__(self, time_scale: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.node = SandboxNode(profile="dgx-h100")
        self.node.run_workloads(time_scale=time_scale)
        self.plugin: GpuPlugin = self.loop.run_until_complete(start_plugin(self.node.mps_config(log_level="error")))
        self.kubelet = KubeletEmulator(self.node.config().kubelet_registrar_directory_path)
        self.loop.run_until_complete(self.kubelet.__aenter__())
        self.conn: PluginConnection = self.loop.run_until_complete(self.kubelet.wait_for_plugin("gpu.nvidia.com"))
        self.rounds = 0

    def claim(self) -> ClaimRef:
        assert self.node.api is not None
        self.rounds += 1
        obj = self.node.api.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"mps-{self.rounds}", "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        })
        parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {
            "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                                             "defaultPinnedDeviceMemoryLimit": "10Gi"}}}
        obj["status"] = {"allocation": {"devices": {
            "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": self.node.node_name,
                         "device": "gpu-0"}],
            "config": [{"source": "FromClaim", "requests": ["gpu"],
                        "opaque": {"driver": "gpu.nvidia.com", "parameters": parameters}}]}}}
        obj = self.node.api.update(obj, subresource="status")
        return ClaimRef("default", obj["metadata"]["name"], obj["metadata"]["uid"])

    def prepare(self, ref: ClaimRef) -> tuple[float, float]:
        """(wall seconds of the prepare, seconds of it spent waiting for the Deployment)."""
        start = time.perf_counter()
        answer = self.loop.run_until_complete(self.conn.prepare([ref]))
        wall = time.perf_counter() - start
        assert answer[ref.uid].error == "", answer[ref.uid].error
        assert self.plugin.mps_daemons is not None
        gpu = next(g.uuid for g in self.plugin.inventory.gpus if g.name == "gpu-0")
        return wall, self.plugin.mps_daemons.wait_s[mps.control_daemon_id(ref.uid, [gpu])]

    def unprepare(self, ref: ClaimRef) -> None:
        answer = self.loop.run_until_complete(self.conn.unprepare([ref]))
        assert not any(answer.values()), answer

    def close(self) -> None:
        self.loop.run_until_complete(self.kubelet.__aexit__(None, None, None))
        self.loop.run_until_complete(self.plugin.stop())
        self.node.close()
        self.loop.close()


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@pytest.fixture(params=[("kubelet_1s", 1.0), ("fast_probe", 0.05)], ids=lambda p: p[0])
def harness(request: pytest.FixtureRequest) -> Iterator[tuple[str, Harness]]:
    name, scale = request.param
    h = Harness(scale)
    yield name, h
    h.close()


def test_prepare_mps_claim(benchmark: Any, harness: tuple[str, Harness]) -> None:
    variant, h = harness
    walls: list[float] = []
    waits: list[float] = []
    pending: list[ClaimRef] = []

    def setup() -> tuple[tuple[ClaimRef], dict[str, Any]]:
        for ref in pending:
            h.unprepare(ref)
        pending.clear()
        pending.append(h.claim())
        return (pending[0],), {}

    def run(ref: ClaimRef) -> None:
        wall, wait = h.prepare(ref)
        walls.append(wall)
        waits.append(wait)

    benchmark.pedantic(run, setup=setup, rounds=15 if variant == "kubelet_1s" else 25, iterations=1)
    for ref in pending:
        h.unprepare(ref)
    outside = [w - d for w, d in zip(walls, waits, strict=True)]
    benchmark.extra_info.update(
        scenario="prepare_mps_claim",
        variant=variant,
        figures={
            f"{variant}: p50 prepare (ms)": (round(statistics.median(walls) * 1e3, 1), "", None),
            f"{variant}: p99 prepare (ms)": (round(_p(walls, 0.99) * 1e3, 1), "", None),
            f"{variant}: p50 waiting for the Deployment (ms)": (round(statistics.median(waits) * 1e3, 1), "", None),
            f"{variant}: p99 waiting for the Deployment (ms)": (round(_p(waits, 0.99) * 1e3, 1), "", None),
            f"{variant}: p50 prepare outside the wait (ms)": (round(statistics.median(outside) * 1e3, 1), "", None),
        },
    )
