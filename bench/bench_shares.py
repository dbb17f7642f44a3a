"""Consumable GPU shares: 32 claims sharing one H200, prepared and unprepared one at a time.

The real plugin (``--consumable-shares=memory``, mock NVML H200 node, API emulator over HTTP, claim state and CDI
specs on disk, the sandbox running each MPS control daemon Deployment as a local process) is driven by the
kubelet emulator. Each round prepares claims 1..32 (4Gi each, allocated by the scheduler emulator onto the same
GPU), one NodePrepareResources each, then unprepares them in reverse order, one NodeUnprepareResources each.

Reported: the prepare of the k-th share (k-1 shares already on the GPU) and the unprepare with k shares on the
GPU. The first share starts the GPU's MPS control daemon and the last unprepare stops it, so flatness is judged
on shares that join or leave a running daemon, as the median over shares 29-32 against the median over shares
2-5 (all rounds; one position alone is too noisy on a shared machine), target <= 1.5 for both; the 32nd / 1st
ratio is reported beside it (the 1st includes the daemon's start).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.app import GpuPlugin, start_plugin
from dradriver.domain.claims import ClaimRef
from dradriver.sandbox import scheduler
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.profiles import h200_node

SHARES = 32
ROUNDS = 8
DEVICE_CLASS = {
    "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
}


class SharesHarness:
    """One sandbox H200 node with a running plugin in consumable-shares mode and a registered kubelet."""

    def __init__(self, directory: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.node = SandboxNode(profile=h200_node(directory, gpus=1))
        assert self.node.api is not None
        self.node.api.create(DEVICE_CLASS)
        self.node.run_workloads()
        config = self.node.shares_config("memory", log_level="error")
        self.plugin: GpuPlugin = self.loop.run_until_complete(start_plugin(config))
        self.kubelet = KubeletEmulator(config.kubelet_registrar_directory_path)
        self.loop.run_until_complete(self.kubelet.__aenter__())
        self.conn: PluginConnection = self.loop.run_until_complete(self.kubelet.wait_for_plugin("gpu.nvidia.com"))
        self.loop.run_until_complete(self._published())

    async def _published(self) -> None:
        assert self.node.api is not None
        while not self.node.api.objects("ResourceSlice"):
            await asyncio.sleep(0.02)

    def claims(self, count: int) -> list[ClaimRef]:
        assert self.node.api is not None
        refs = []
        for i in range(count):
            self.node.api.create({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": f"share-{i}", "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "gpu.nvidia.com", "capacity": {"requests": {"memory": "4Gi"}}}}]}},
            })
            [obj] = scheduler.allocate(self.node.api, [("default", f"share-{i}")], node_name=self.node.node_name)
            [result] = obj["status"]["allocation"]["devices"]["results"]
            assert result["device"] == "gpu-0" and result.get("shareID"), result
            refs.append(ClaimRef("default", obj["metadata"]["name"], obj["metadata"]["uid"]))
        return refs

    def prepare(self, ref: ClaimRef) -> float:
        start = time.perf_counter()
        answer = self.loop.run_until_complete(self.conn.prepare([ref]))
        seconds = time.perf_counter() - start
        assert not answer[ref.uid].error, answer[ref.uid].error
        return seconds

    def unprepare(self, ref: ClaimRef) -> float:
        start = time.perf_counter()
        answer = self.loop.run_until_complete(self.conn.unprepare([ref]))
        seconds = time.perf_counter() - start
        assert not answer[ref.uid], answer[ref.uid]
        return seconds

    def close(self) -> None:
        self.loop.run_until_complete(self.kubelet.__aexit__(None, None, None))
        self.loop.run_until_complete(self.plugin.stop())
        self.node.close()
        self.loop.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharesHarness]:
    h = SharesHarness(tmp_path_factory.mktemp("shares"))
    yield h
    h.close()


def test_shares_prepare_unprepare_flat(benchmark: Any, harness: SharesHarness) -> None:
    refs = harness.claims(SHARES)
    prepare: list[list[float]] = [[] for _ in refs]
    unprepare: list[list[float]] = [[] for _ in refs]  # index k-1: with k shares on the GPU

    def run() -> None:
        for k, ref in enumerate(refs):
            prepare[k].append(harness.prepare(ref))
        for k in range(len(refs) - 1, -1, -1):
            unprepare[k].append(harness.unprepare(refs[k]))

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)

    def group(samples: list[list[float]], positions: range) -> float:
        return statistics.median([x for k in positions for x in samples[k]])

    early, late = range(1, 5), range(SHARES - 4, SHARES)  # shares 2-5 and 29-32 (0-based indices)
    p_early, p_late = group(prepare, early), group(prepare, late)
    u_early, u_late = group(unprepare, early), group(unprepare, late)
    p = [statistics.median(v) for v in prepare]
    u = [statistics.median(v) for v in unprepare]
    benchmark.extra_info.update(
        scenario="shares_32_on_one_gpu",
        variant="plugin",
        figures={
            "prepare: shares 29-32 / shares 2-5 (flatness)": (round(p_late / p_early, 3), "<=", 1.5),
            "unprepare: with 29-32 / with 2-5 shares on the GPU (flatness)": (round(u_late / u_early, 3), "<=", 1.5),
            "prepare: 32nd share / 1st share (the 1st starts the MPS daemon)": (round(p[-1] / p[0], 3), "", None),
            "unprepare: with 32 shares / the last share (which stops the daemon)": (round(u[-1] / u[0], 3), "",
                                                                                    None),
            "median prepare, 1st share (ms)": (round(p[0] * 1e3, 2), "", None),
            "median prepare, shares 2-5 (ms)": (round(p_early * 1e3, 2), "", None),
            "median prepare, shares 29-32 (ms)": (round(p_late * 1e3, 2), "", None),
            "median unprepare, last share (ms)": (round(u[0] * 1e3, 2), "", None),
            "median unprepare, 2-5 shares on the GPU (ms)": (round(u_early * 1e3, 2), "", None),
            "median unprepare, 29-32 shares on the GPU (ms)": (round(u_late * 1e3, 2), "", None),
        },
    )
