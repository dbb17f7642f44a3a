"""Dynamic MIG: prepare of one 1g claim end to end, and claim-state bookkeeping with live MIG instances.

``prepare_1g_dynamic_mig``: NodePrepareResources over the plugin's Unix socket (real plugin with the DynamicMIG
gate, 8-GPU H200 mock node with its MIG state file, API emulator over HTTP, claim state and CDI specs on disk) for
one claim of a ``1g.18gb`` placement: MIG mode on, GPU instance at the placement, compute instance, undo record,
CDI spec. Variant ``dynamic_mig``; baseline ``full_gpu``: the same for a full-GPU claim on the same plugin. The
unprepare between rounds (instance destroyed, MIG mode off) is not timed, so every round is a first instance on
its GPU; between rounds the background work of the last change (device refresh, slice republish, status write,
all answered by the in-process API emulator) is let finish. Reported: p50/p99 of both, with and without the
time spent inside NVML calls (the mock's: its state and capability files), and their ratio: everything but
NVML's own time, which on a real GPU is dominated by creating the GI (~1 s, NVIDIA's code notes).

``claimstate_dynamic_mig``: one prepare+unprepare pair of the claim state (PREPARE_STARTED, PREPARE_COMPLETED with a
dynamic-MIG undo record, remove; each durable, tmpfs so ``fdatasync`` does not hide the store's own cost) with
8 GPUs x 7 instances live (56 claims holding dynamic-MIG records) after 10 and after 10,000 historical claims
(prepared and unprepared before); variants ``history_10`` and ``history_10000``; the ratio shows flatness.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.app import GpuPlugin, start_plugin
from dradriver.domain import featuregates
from dradriver.domain.claims import ClaimRef
from dradriver.domain.ports import UndoRecord
from dradriver.host.claimstate import ClaimState, HeldDevice
from dradriver.preparers.dynamicmig import DynamicMigPreparer
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SandboxNode

PROFILE = "dgx-h200"
ONE_G = "gpu-0-mig-1g18gb-19-0"
FULL = "gpu-1"
TMPFS = Path("/dev/shm")
BOOT_ID = "d95dacd9-6a44-4f58-a9c9-ced799e1caa1"


class Harness:
    """A dynamic-MIG plugin on an 8-GPU H200 sandbox with a registered kubelet, on a private event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.node = SandboxNode(profile=PROFILE, mig_state=True)
        gates = featuregates.parse_feature_gates("DynamicMIG=true")
        self.plugin: GpuPlugin = self.loop.run_until_complete(
            start_plugin(self.node.config(log_level="error", feature_gates=gates)))
        self.kubelet = KubeletEmulator(self.node.config().kubelet_registrar_directory_path)
        self.loop.run_until_complete(self.kubelet.__aenter__())
        self.conn: PluginConnection = self.loop.run_until_complete(self.kubelet.wait_for_plugin("gpu.nvidia.com"))

    def claim(self, name: str, device: str) -> ClaimRef:
        assert self.node.api is not None
        obj = self.node.api.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        })
        obj["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": self.node.node_name, "device": device}]}}}
        obj = self.node.api.update(obj, subresource="status")
        return ClaimRef("default", obj["metadata"]["name"], obj["metadata"]["uid"])

    def prepare(self, ref: ClaimRef) -> float:
        start = time.perf_counter()
        answer = self.loop.run_until_complete(self.conn.prepare([ref]))
        wall = time.perf_counter() - start
        assert not answer[ref.uid].error, answer[ref.uid].error
        return wall

    def unprepare(self, ref: ClaimRef) -> None:
        answer = self.loop.run_until_complete(self.conn.unprepare([ref]))
        assert not any(answer.values()), answer
        self.quiesce()

    def quiesce(self) -> None:
        """Let the background work of the last change finish (device refresh and the ResourceSlice republish it
        causes, status.devices write), so a round measures its own prepare: in the sandbox the API emulator
        answering those writes runs in this interpreter and would compete for the GIL."""
        if self.plugin.refresher is not None:
            self.plugin.refresher.wait_idle()
        if self.plugin.status_writer is not None:
            self.plugin.status_writer.flush()
        time.sleep(0.05)  # the publisher's debounced PUT of the slices

    def close(self) -> None:
        self.loop.run_until_complete(self.kubelet.__aexit__(None, None, None))
        self.loop.run_until_complete(self.plugin.stop())
        self.node.close()
        self.loop.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def _percentiles(walls: list[float]) -> tuple[float, float]:
    ordered = sorted(walls)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


_P50: dict[str, float] = {}


@pytest.mark.parametrize(("variant", "device"), [("dynamic_mig", ONE_G), ("full_gpu", FULL)])
def test_prepare_one_claim(benchmark: Any, harness: Harness, variant: str, device: str) -> None:
    ref = harness.claim(f"bench-{variant.replace('_', '-')}", device)
    control = next((p.control for p in harness.plugin.runner.preparers if isinstance(p, DynamicMigPreparer)), None)
    assert control is not None
    nvml_s = [0.0]
    call = control._call

    def timed_call(fn: Any, *args: Any, context: str) -> Any:  # NVML's own time (the mock's, here)
        start = time.perf_counter()
        try:
            return call(fn, *args, context=context)
        finally:
            nvml_s[0] += time.perf_counter() - start

    control._call = timed_call  # type: ignore[method-assign]
    walls: list[float] = []
    outside: list[float] = []

    def run() -> None:
        nvml_s[0] = 0.0
        wall = harness.prepare(ref)
        walls.append(wall)
        outside.append(wall - nvml_s[0])

    try:
        benchmark.pedantic(run, setup=lambda: harness.unprepare(ref), rounds=30, iterations=1)
    finally:
        control._call = call  # type: ignore[method-assign]
    harness.unprepare(ref)
    p50, p99 = _percentiles(walls)
    q50, q99 = _percentiles(outside)
    _P50[variant] = q50
    figures: dict[str, tuple[float, str, float | None]] = {
        f"p50 latency, {variant} (ms)": (round(p50 * 1e3, 2), "", None),
        f"p99 latency, {variant} (ms)": (round(p99 * 1e3, 2), "", None),
        f"p50 latency without NVML's time, {variant} (ms)": (round(q50 * 1e3, 2), "", None),
        f"p99 latency without NVML's time, {variant} (ms)": (round(q99 * 1e3, 2), "", None),
    }
    if variant == "full_gpu" and "dynamic_mig" in _P50:
        figures["dynamic MIG 1g / full GPU, p50 without NVML's time"] = (
            round(_P50["dynamic_mig"] / q50, 3), "<=", 2.0)
    benchmark.extra_info.update(scenario="prepare_1g_dynamic_mig", variant=variant, figures=figures)


def _mig_payload(uid: str, gpu: int, gi: int, start: int) -> str:
    record = UndoRecord("dynamic-mig", 1, f"gpu-{gpu}-mig-1g18gb-19-{start}", {
        "parentUUID": f"GPU-00000000-0000-0000-0000-{gpu:012d}", "parentMinor": gpu, "giId": gi, "ciId": 0,
        "migUUID": f"MIG-00000000-0000-5000-8000-{gpu * 16 + gi:012d}", "giProfileId": 19, "profile": "1g.18gb",
        "placementStart": start, "placementSize": 1, "migModeEnabled": start == 0})
    return json.dumps({"spec": f"/var/run/cdi/k8s.gpu.nvidia.com-claim_{uid}.yaml", "undo": [record.to_json()]})


def _held(uid: str, device: str) -> list[HeldDevice]:
    return [HeldDevice(("mig",), "node-a", device, (f"k8s.gpu.nvidia.com/claim={uid}-{device}",), False)]


@pytest.fixture
def tmpdir_fast(tmp_path: Path) -> Iterator[Path]:
    if not TMPFS.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=TMPFS, prefix="dradriver-bench-") as tmp:
        yield Path(tmp)


@pytest.mark.parametrize("history", [10, 10_000])
def test_claimstate_with_live_instances(benchmark: Any, tmpdir_fast: Path, history: int) -> None:
    (tmpdir_fast / "boot_id").write_text(BOOT_ID + "\n")
    store = ClaimState.open(tmpdir_fast / "claims.state", boot_id_path=tmpdir_fast / "boot_id")
    for i in range(history):  # claims that came and went
        uid = f"0f1e2d3c-4b5a-4978-8a9b-{i:012d}"
        device = f"gpu-{i % 8}-mig-1g18gb-19-{i % 7}"
        store.prepare_started(uid, namespace="team-a", name=f"old-{i}", devices=_held(uid, device),
                              payload=_mig_payload(uid, i % 8, 7 + i % 7, i % 7))
        store.prepare_completed(uid)
        store.remove(uid)
    for gpu in range(8):  # 8 GPUs x 7 instances live
        for start in range(7):
            uid = f"1f1e2d3c-4b5a-4978-8a9b-{gpu * 7 + start:012d}"
            device = f"gpu-{gpu}-mig-1g18gb-19-{start}"
            store.prepare_started(uid, namespace="team-a", name=f"live-{gpu}-{start}", devices=_held(uid, device),
                                  payload=_mig_payload(uid, gpu, 7 + start, start))
            store.prepare_completed(uid)
    uid = "2f1e2d3c-4b5a-4978-8a9b-000000000000"
    device = "gpu-0-mig-3g71gb-9-0"  # a placement none of the live ones overlaps by name
    payload = _mig_payload(uid, 0, 2, 0)
    held = _held(uid, device)

    def pair() -> None:
        store.prepare_started(uid, namespace="team-b", name="bench", devices=held, payload=payload)
        store.prepare_completed(uid)
        store.remove(uid)

    benchmark(pair)
    assert len(store) == 56
    store.close()
    benchmark.extra_info.update(scenario="claimstate_dynamic_mig", variant=f"history_{history}", history=history)
