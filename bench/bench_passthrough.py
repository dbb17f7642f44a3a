"""VFIO passthrough: one GPU taken from ``nvidia`` for a VM and given back, the stand-in kernel's time apart.

``vfio_prepare_unprepare``: :class:`~dradriver.preparers.vfio.VfioPreparer` ``plan`` + ``apply`` + ``undo`` of
``gpu-vfio-0`` on an 8-GPU H100 sandbox node whose PCI tree is served by the PCI bus stand-in
(:mod:`dradriver.sandbox.standins.pcibus`, a thread answering the ``bind``/``unbind``/``drivers_probe`` FIFOs).
One round: the in-use scan of ``/dev/nvidia<minor>`` (over this machine's ``/proc``), the IOMMU group check,
``driver_override``, unbind ``nvidia``, bind ``vfio-pci``, ``/dev/vfio/<group>``; then override cleared, unbind
``vfio-pci``, bind ``nvidia``. The module is loaded once before the timed rounds (the first prepare on a node runs
``modprobe``; reported apart).

A real kernel changes the driver link before the sysfs write returns; the stand-in answers a moment later from its
own thread. The time the host layer spends waiting for each written state to show
(:meth:`dradriver.host.pci.PciHost._settle`, polled every 0.2 ms here) is the stand-in's, measured per round and
reported apart: ``own`` = round - stand-in time is the driver's cost on a real kernel.

Variant ``preparer``; baseline ``direct``: the same writes to the same files in a direct sequence, each followed
by the same wait for its state (no reads of the function, no checks, no records), same run: the floor under the
preparer on this stand-in.

``vfio_claim_prepare_unprepare``: the real plugin with ``PassthroughSupport`` on the same node (API emulator over
HTTP, kubelet emulator over the plugin's sockets, claim state and CDI specs on disk): NodePrepareResources and
NodeUnprepareResources of a ``gpu-vfio-0`` claim, each timed; between them (untimed, as a VM runs a while) the
swap's background work settles: NVML initialised anew, the devices read again, the sibling withdrawn or published
again. Variant ``vfio``; beside it ``full_gpu``: the same for a ``gpu-1`` claim on the same plugin. The plugin's
host layer polls a written state every 20 ms (its default); that wait is the stand-in's (a real kernel's write has
taken effect when it returns) and is reported apart. Also reported: one unprepare sent right after its prepare,
which waits for that swap's re-enumeration. The pytest-benchmark medians of this scenario include the untimed
settling and are not the figures.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dradriver.domain.claims import AllocationResult, Claim, ClaimRef
from dradriver.domain.passthrough import VfioDevice
from dradriver.host.pci import PciHost
from dradriver.nvml import mock
from dradriver.preparers.vfio import VfioPreparer
from dradriver.sandbox.node import FIRST_IOMMU_GROUP, SandboxNode

PROFILE = "dgx-h100"
GPU0 = "0000:18:00.0"
REF = ClaimRef("vms", "vm-bench", "7a1c0de0-0000-4000-8000-00000000b0b0")
ROUNDS = 40
POLL_S = 0.0002
_T = TypeVar("_T")


@dataclass
class TimedPciHost(PciHost):
    """The host layer with the time spent waiting for written states to show (the stand-in's answer) summed."""

    waited_s: float = field(default=0.0, repr=False)
    scanned_s: float = field(default=0.0, repr=False)

    def holders(self, minor: int) -> Any:
        start = time.perf_counter()
        try:
            return super().holders(minor)
        finally:
            self.scanned_s += time.perf_counter() - start

    def _settle(self, check: Callable[[], _T | None], address: str, written: str,
                found: Callable[[], str]) -> _T:
        start = time.perf_counter()
        try:
            return super()._settle(check, address, written, found)
        finally:
            self.waited_s += time.perf_counter() - start


class Harness:
    """A sandbox node with its PCI tree, the timed host layer and the preparer, ``vfio-pci`` loaded."""

    def __init__(self) -> None:
        self.node = SandboxNode(profile=PROFILE, pci_tree=True)
        base = self.node.pci_host()
        self.host = TimedPciHost(**{f: getattr(base, f) for f in (
            "sysfs_root", "dev_root", "proc_root", "process_root", "modprobe", "modules_root")},
            settle_s=5.0, poll_s=POLL_S)
        self.preparer = VfioPreparer(self.host)
        gpu = next(g for g in mock.resolved_gpus(mock.load_profile(PROFILE)) if g["pciBusId"][4:].lower() == GPU0)
        self.minor = int(gpu["minorNumber"])
        self.device = VfioDevice(index=0, function=self.host.function(GPU0), product_name=gpu["name"],
                                 parent_minor=self.minor, parent_uuid=gpu["uuid"])
        self.claim = Claim(REF, (AllocationResult("vm", "gpu.nvidia.com", self.node.node_name, self.device.name),))
        start = time.perf_counter()
        self.preparer_round()  # loads vfio-pci through the modprobe stand-in
        self.first_round_s = time.perf_counter() - start
        self.sys = self.host.sysfs_root / "bus" / "pci"
        self.group_node = self.host.vfio_group_node(FIRST_IOMMU_GROUP)

    def preparer_round(self) -> None:
        plan = self.preparer.plan(self.claim, self.device, self.claim.results, None)
        record = self.preparer.apply(REF, plan)
        self.preparer.undo(REF, record)

    def _write(self, path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def _wait(self, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 5.0
        while not check():
            assert time.monotonic() < deadline, "the stand-in did not answer"
            time.sleep(POLL_S)

    def _driver(self) -> str | None:
        try:
            return os.path.basename(os.readlink(self.sys / "devices" / GPU0 / "driver"))
        except OSError:
            return None

    def direct_round(self) -> None:
        """The preparer's writes with nothing around them: override, unbind, bind, group node; and back."""
        override = self.sys / "devices" / GPU0 / "driver_override"
        self._write(override, "vfio-pci\n")
        self._wait(lambda: override.read_text().strip() == "vfio-pci")
        self._write(self.sys / "drivers" / "nvidia" / "unbind", GPU0 + "\n")
        self._wait(lambda: self._driver() is None)
        self._write(self.sys / "drivers" / "vfio-pci" / "bind", GPU0 + "\n")
        self._wait(lambda: self._driver() == "vfio-pci")
        self._wait(lambda: os.path.lexists(self.group_node))
        self._write(override, "\n")
        self._wait(lambda: override.read_text().strip() in ("", "(null)"))
        self._write(self.sys / "drivers" / "vfio-pci" / "unbind", GPU0 + "\n")
        self._wait(lambda: self._driver() is None)
        self._write(self.sys / "drivers" / "nvidia" / "bind", GPU0 + "\n")
        self._wait(lambda: self._driver() == "nvidia")

    def close(self) -> None:
        self.node.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


@pytest.mark.parametrize("variant", ["direct", "preparer"])
def test_vfio_prepare_unprepare(benchmark: Any, harness: Harness, variant: str) -> None:
    walls: list[float] = []
    standin: list[float] = []
    scans: list[float] = []
    body = harness.preparer_round if variant == "preparer" else harness.direct_round

    def run() -> None:
        harness.host.waited_s = harness.host.scanned_s = 0.0
        start = time.perf_counter()
        body()
        walls.append(time.perf_counter() - start)
        standin.append(harness.host.waited_s)
        scans.append(harness.host.scanned_s)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    assert harness.host.function(GPU0).driver == "nvidia"
    figures: dict[str, tuple[float, str, float | None]] = {
        f"p50 round, {variant} (ms)": (_ms(statistics.median(walls)), "", None),
    }
    if variant == "preparer":
        own = [w - s for w, s in zip(walls, standin, strict=True)]
        rest = [o - s for o, s in zip(own, scans, strict=True)]
        processes = sum(1 for e in os.scandir("/proc") if e.name.isdigit())
        figures.update({
            "p50 stand-in's answer time inside a preparer round (ms)": (_ms(statistics.median(standin)), "", None),
            "p50 preparer round without the stand-in's time (ms)": (_ms(statistics.median(own)), "", None),
            f"p50 in-use scan of /dev/nvidia<minor> inside it, {processes} processes (ms)": (
                _ms(statistics.median(scans)), "", None),
            "p50 preparer round without the stand-in's time and the scan (ms)": (
                _ms(statistics.median(rest)), "", None),
            "first prepare+unprepare, modprobe vfio-pci included (ms)": (_ms(harness.first_round_s), "", None),
        })
    benchmark.extra_info.update(scenario="vfio_prepare_unprepare", variant=variant, figures=figures)


class PluginHarness:
    """The real plugin with ``PassthroughSupport`` on the same kind of node, registered with the kubelet emulator, on
    a private event loop; the host layer's settle waits (the stand-in's answers) summed for every PciHost."""

    def __init__(self) -> None:
        from dradriver.app import GpuPlugin, start_plugin
        from dradriver.domain import featuregates
        from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection

        self.waited_s = 0.0
        settle = PciHost._settle
        harness = self

        def timed(host: PciHost, check: Any, address: str, written: str, found: Any) -> Any:
            start = time.perf_counter()
            try:
                return settle(host, check, address, written, found)
            finally:
                harness.waited_s += time.perf_counter() - start

        self._settle = settle
        PciHost._settle = timed  # type: ignore[assignment,method-assign]
        self.loop = asyncio.new_event_loop()
        self.node = SandboxNode(profile=PROFILE, pci_tree=True)
        gates = featuregates.parse_feature_gates("PassthroughSupport=true")
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
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.nvidia.com"}}]}},
        })
        obj["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": self.node.node_name, "device": device}]}}}
        obj = self.node.api.update(obj, subresource="status")
        return ClaimRef("default", obj["metadata"]["name"], obj["metadata"]["uid"])

    def prepare(self, ref: ClaimRef) -> float:
        """NodePrepareResources of ``ref``; its wall time (s)."""
        start = time.perf_counter()
        answer = self.loop.run_until_complete(self.conn.prepare([ref]))
        wall = time.perf_counter() - start
        assert not answer[ref.uid].error, answer[ref.uid].error
        return wall

    def unprepare(self, ref: ClaimRef) -> float:
        """NodeUnprepareResources of ``ref``; its wall time (s)."""
        start = time.perf_counter()
        errors = self.loop.run_until_complete(self.conn.unprepare([ref]))
        wall = time.perf_counter() - start
        assert not any(errors.values()), errors
        return wall

    def quiesce(self, gpus: int = 8, sibling: bool = True) -> None:
        """Let the background work of the last change finish (after a swap: NVML initialised anew, the devices read
        again, ``gpu-0`` withdrawn or published again; the status write), so a measured call is only its own: the
        API emulator runs in this interpreter."""
        assert self.node.api is not None
        deadline = time.monotonic() + 20
        while not (len(self.plugin.inventory.gpus) == gpus and sibling == ("gpu-0" in {
                d["name"] for s in self.node.api.objects("ResourceSlice") for d in s["spec"].get("devices", [])})):
            assert time.monotonic() < deadline, "the swap's republish did not come within 20 s"
            self.loop.run_until_complete(asyncio.sleep(0.01))  # the plugin's tasks run on this loop
        if self.plugin.status_writer is not None:
            self.plugin.status_writer.flush()
        self.loop.run_until_complete(asyncio.sleep(0.05))

    def close(self) -> None:
        self.loop.run_until_complete(self.kubelet.__aexit__(None, None, None))
        self.loop.run_until_complete(self.plugin.stop())
        self.node.close()
        self.loop.close()
        PciHost._settle = self._settle  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def plugin_harness() -> Iterator[PluginHarness]:
    h = PluginHarness()
    yield h
    h.close()


@pytest.mark.parametrize(("variant", "device"), [("full_gpu", "gpu-1"), ("vfio", "gpu-vfio-0")])
def test_claim_prepare_unprepare(benchmark: Any, plugin_harness: PluginHarness, variant: str, device: str) -> None:
    h = plugin_harness
    ref = h.claim(f"bench-{variant.replace('_', '-')}", device)
    swapped = (7, False) if variant == "vfio" else (8, True)
    h.prepare(ref)  # the first VFIO prepare loads vfio-pci
    h.quiesce(*swapped)
    h.unprepare(ref)
    h.quiesce()
    prepares: list[float] = []
    unprepares: list[float] = []
    standin: list[float] = []

    def run() -> None:
        h.waited_s = 0.0
        prepares.append(h.prepare(ref))
        h.quiesce(*swapped)  # a VM runs a while before it stops
        unprepares.append(h.unprepare(ref))
        standin.append(h.waited_s)

    benchmark.pedantic(run, setup=h.quiesce, rounds=ROUNDS, iterations=1)
    pairs = [p + u for p, u in zip(prepares, unprepares, strict=True)]
    own = [w - s for w, s in zip(pairs, standin, strict=True)]
    figures: dict[str, tuple[float, str, float | None]] = {
        f"p50 prepare over gRPC, {variant} (ms)": (_ms(statistics.median(prepares)), "", None),
        f"p50 unprepare over gRPC, {variant} (ms)": (_ms(statistics.median(unprepares)), "", None),
        f"p50 stand-in's answer time in the pair, {variant} (ms)": (_ms(statistics.median(standin)), "", None),
        f"p50 pair without the stand-in's time, {variant} (ms)": (_ms(statistics.median(own)), "", None),
    }
    benchmark.extra_info.update(scenario="vfio_claim_prepare_unprepare", variant=variant, figures=figures,
                                pair_s=statistics.median(pairs))
    if variant == "vfio":
        h.prepare(ref)  # an unprepare sent while the prepare's swap is still being re-read
        figures["unprepare sent right after the prepare, vfio (ms)"] = (_ms(h.unprepare(ref)), "", None)
        h.quiesce()
