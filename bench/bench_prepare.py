"""Scenario 4: NodePrepareResources end to end over the plugin's Unix socket, against the API emulator.

The real plugin (mock NVML with 128 GPUs, API emulator over HTTP, claim state on disk) is driven by the
kubelet emulator. Each round prepares a batch of 1 or 100 one-GPU claims (the unprepare that resets the node
between rounds is not timed). Reported: p50 and p99 latency of the batch, and the share of the batch's wall
time spent outside the ResourceClaim GETs (the API calls).

``prepare_status_1``: the one-claim prepare with the KEP-4817 device status writer on (``writer_on``, as the
plugin runs) and off (``writer_off``: the runner's hooks unset, the baseline in the same run). Each round prepares
a new claim that stays prepared past the writer's settle time (0.5 s), one every settle/4 s, so each claim's
status write (a GET and a PUT of ``resourceclaims/status``) is sent while a later claim is being prepared: the
worst case for the prepare. The plugin, the API emulator and the kubelet emulator share this process (and its
GIL), so the emulator's side of each write is counted against the prepare too; on a node the API server is
elsewhere.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import nvmlenv
from dradriver.app import GpuPlugin, start_plugin
from dradriver.domain.claims import ClaimRef
from dradriver.kubeletplugin.devicestatus import DeviceStatusWriter
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SandboxNode

GPUS = 128


class Harness:
    """One sandbox node with a running plugin and a registered kubelet, on a private event loop."""

    def __init__(self, profile: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.node = SandboxNode(profile=str(profile))
        self.plugin: GpuPlugin = self.loop.run_until_complete(start_plugin(self.node.config(log_level="error")))
        self.kubelet = KubeletEmulator(self.node.config().kubelet_registrar_directory_path)
        self.loop.run_until_complete(self.kubelet.__aenter__())
        self.conn: PluginConnection = self.loop.run_until_complete(self.kubelet.wait_for_plugin("gpu.nvidia.com"))
        self.api_intervals: list[tuple[float, float]] = []
        fetch = self.plugin.runner.fetch_claim

        def timed_fetch(ref: ClaimRef, timeout_s: float) -> Any:
            start = time.perf_counter()
            try:
                return fetch(ref, timeout_s)
            finally:
                self.api_intervals.append((start, time.perf_counter()))

        self.plugin.runner.fetch_claim = timed_fetch

    def claims(self, count: int, prefix: str = "bench") -> list[ClaimRef]:
        """``count`` claims of one GPU each (``gpu-0`` ...), allocated on this node."""
        assert self.node.api is not None
        refs = []
        for i in range(count):
            obj = self.node.api.create({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": f"{prefix}-{count}-{i}", "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
            })
            obj["status"] = {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": self.node.node_name, "device": f"gpu-{i}"}
            ]}}}
            obj = self.node.api.update(obj, subresource="status")
            refs.append(ClaimRef("default", obj["metadata"]["name"], obj["metadata"]["uid"]))
        return refs

    def prepare(self, refs: list[ClaimRef]) -> tuple[float, float]:
        """Prepare the batch; returns (wall seconds, seconds covered by API GETs)."""
        self.api_intervals.clear()
        start = time.perf_counter()
        answer = self.loop.run_until_complete(self.conn.prepare(refs))
        wall = time.perf_counter() - start
        errors = [r.error for r in answer.values() if r.error]
        assert not errors, errors[:3]
        return wall, _union(self.api_intervals)

    def unprepare(self, refs: list[ClaimRef]) -> None:
        answer = self.loop.run_until_complete(self.conn.unprepare(refs))
        assert not any(answer.values())

    def close(self) -> None:
        self.loop.run_until_complete(self.kubelet.__aexit__(None, None, None))
        self.loop.run_until_complete(self.plugin.stop())
        self.node.close()
        self.loop.close()


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(nvmlenv.many_gpu_profile(tmp_path_factory.mktemp("prepare"), GPUS))
    yield h
    h.close()


@pytest.mark.parametrize("batch", [1, 100])
def test_prepare_batch(benchmark: Any, harness: Harness, batch: int) -> None:
    refs = harness.claims(batch)
    walls: list[float] = []
    api: list[float] = []

    def run() -> None:
        wall, api_s = harness.prepare(refs)
        walls.append(wall)
        api.append(api_s)

    benchmark.pedantic(run, setup=lambda: harness.unprepare(refs), rounds=30 if batch == 1 else 12, iterations=1)
    harness.unprepare(refs)
    ordered = sorted(walls)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    outside = 1.0 - sum(api) / sum(walls)
    benchmark.extra_info.update(
        scenario=f"prepare_batch_{batch}",
        variant="plugin",
        figures={
            f"p50 latency, batch of {batch} (ms)": (round(p50 * 1e3, 2), "", None),
            f"p99 latency, batch of {batch} (ms)": (round(p99 * 1e3, 2), "", None),
            "share of the batch outside the ResourceClaim GETs": (round(outside, 3), "", None),
        },
    )


STATUS_BLOCK = 20
"""Claims prepared in a row with one setting of the device status writer (each stays prepared to the end)."""
STATUS_BLOCKS = 4
"""Blocks, the writer off and on in turn (off first): drift of a shared machine's load falls on both."""


def test_prepare_with_device_status(benchmark: Any, harness: Harness) -> None:
    writer = harness.plugin.status_writer
    runner = harness.plugin.runner
    assert writer is not None
    hooks = runner.on_prepared, runner.on_unprepared
    rounds = STATUS_BLOCK * STATUS_BLOCKS
    refs = harness.claims(rounds, prefix="status")
    walls: dict[bool, list[float]] = {False: [], True: []}
    sent = {False: 0, True: 0}
    pace = DeviceStatusWriter.SETTLE_S / 4
    done = [0]  # claims prepared so far
    slot = [time.monotonic()]
    writer_on = [True]
    mark = [writer.writes]  # the writer's count when the current block began

    def close_block() -> None:
        assert writer.flush(timeout_s=30.0)  # the block's writes are sent before the next block starts
        sent[writer_on[0]] += writer.writes - mark[0]
        mark[0] = writer.writes

    def next_round() -> None:  # not timed: the writer's setting for this block, then a new claim every `pace` s
        on = (done[0] // STATUS_BLOCK) % 2 == 1
        if on != writer_on[0]:
            close_block()
            runner.on_prepared, runner.on_unprepared = hooks if on else (None, None)
            writer_on[0], slot[0] = on, time.monotonic()
        slot[0] += pace
        time.sleep(max(0.0, slot[0] - time.monotonic()))

    def run() -> None:
        wall, _api = harness.prepare([refs[done[0]]])
        walls[writer_on[0]].append(wall)
        done[0] += 1

    try:
        benchmark.pedantic(run, setup=next_round, rounds=rounds, iterations=1)
        close_block()
    finally:
        runner.on_prepared, runner.on_unprepared = hooks
        harness.unprepare(refs[:done[0]])
        writer.flush(timeout_s=30.0)
    assert sent == {False: 0, True: rounds // 2}, sent  # the writes really happened, one per claim, writer on only
    p50 = {on: statistics.median(w) for on, w in walls.items()}

    def p99(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]

    benchmark.extra_info.update(
        scenario="prepare_status_1",
        variant="writer_off_and_on",
        figures={
            "p50 one-claim prepare, writer off / on (ms)": (f"{p50[False] * 1e3:.2f} / {p50[True] * 1e3:.2f}", "",
                                                            None),
            "p99 one-claim prepare, writer off / on (ms)": (f"{p99(walls[False]) * 1e3:.1f} / "
                                                            f"{p99(walls[True]) * 1e3:.1f}", "", None),
            "status writes sent while measured (writer on)": (sent[True], "", None),
            "p50 one-claim prepare, writer on / writer off": (round(p50[True] / p50[False], 3), "<=", 1.1),
        },
    )
