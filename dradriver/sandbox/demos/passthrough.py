"""``dradriver demo --scenario passthrough``: a GPU passed through to a VM (gate ``PassthroughSupport``), narrated.

The real kubelet plugin runs with ``PassthroughSupport`` on a DGX H100 sandbox node whose PCI tree (each GPU in its
own IOMMU group) the PCI bus stand-in serves, with the mock ``libnvidia-ml.so.1`` listing only the GPUs bound to
``nvidia``; the API emulator over HTTP and the kubelet emulator over the plugin's Unix sockets. Steps:

1. start the plugin (its start checks the host root and the IOMMU groups);
2. the devices offered: every GPU as ``gpu-<minor>`` and as ``gpu-vfio-<index>``;
3. a claim of the DeviceClass ``vfio.gpu.nvidia.com``, allocated by the allocation simulator;
4. NodePrepareResources: the GPU bound to ``vfio-pci``, ``/dev/vfio/<group>`` in the claim's CDI spec, NVML no longer
   lists it and its ``gpu-<minor>`` leaves the ResourceSlice;
5. NodeUnprepareResources: the GPU back on ``nvidia``, ``gpu-<minor>`` published again with the same UUID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dradriver.app import start_plugin
from dradriver.domain import featuregates
from dradriver.domain.identity import GPU_DRIVER
from dradriver.sandbox import scheduler
from dradriver.sandbox.demos.narrator import (
    DemoError,
    DemoRun,
    Narrator,
    Step,
    claim_ref,
    manifests,
    prepare_claim,
    run_steps_async,
)
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode

PROFILE = "dgx-h100"
CLAIM = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
    "metadata": {"name": "vm-gpu", "namespace": "default"},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.nvidia.com"}}]}},
}


def published(sandbox: SandboxNode) -> dict[str, dict[str, Any]]:
    """Device name -> its attributes (values unwrapped), over the node's ResourceSlices."""
    assert sandbox.api is not None
    return {d["name"]: {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
            for s in sandbox.api.objects("ResourceSlice") for d in s["spec"].get("devices") or []}


async def until(what: str, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Wait for ``done()``.

    :raises DemoError: naming ``what`` after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise DemoError(f"{what} did not happen within {timeout_s:.0f} s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def started(node_name: str, narrator: Narrator) -> AsyncIterator[DemoRun]:
    """Steps 1 and 2."""
    narrator.step(1, f"Start the kubelet plugin with PassthroughSupport on node {node_name} (mock NVML profile "
                     f"{PROFILE}, a PCI tree served by the PCI bus stand-in)")
    with SandboxNode(profile=PROFILE, node_name=node_name, pci_tree=True) as sandbox:
        assert sandbox.api is not None
        config = sandbox.config(log_level="warning",
                                feature_gates=featuregates.parse_feature_gates("PassthroughSupport=true"))
        plugin = await start_plugin(config)
        try:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin(GPU_DRIVER.driver_name, timeout=15)
                inv = plugin.inventory
                narrator.say(f"NVML: {len(inv.gpus)} GPU(s) on nvidia; PCI: {len(inv.vfio)} NVIDIA GPU function(s), "
                             "IOMMU groups " + ", ".join(str(d.function.iommu_group) for d in inv.vfio))
                narrator.done()
                narrator.step(2, "The devices offered: each GPU as gpu-<minor> and as gpu-vfio-<index>")
                await until("the ResourceSlice publication", lambda: len(published(sandbox)) >= 2 * len(inv.gpus))
                pool = published(sandbox)
                vfio = sorted(n for n, a in pool.items() if a.get("type") == "vfio")
                narrator.say(f"{len(pool)} devices: {len(pool) - len(vfio)} GPUs and {len(vfio)} VFIO devices",
                             vfio=vfio)
                first = pool[vfio[0]]
                narrator.say(f"e.g. {vfio[0]}: uuid {first['uuid']}, pciBusID "
                             f"{first.get('resource.kubernetes.io/pciBusID', '-')}, {first.get('productName', '-')}")
                narrator.done()
                yield DemoRun(sandbox, plugin, kubelet, connection)
        finally:
            await plugin.stop()


async def run_scenario(run: DemoRun, narrator: Narrator) -> None:
    """Steps 3 to 5."""
    scenario = _Scenario(run, narrator)
    await run_steps_async(narrator, [
        Step("A claim of DeviceClass vfio.gpu.nvidia.com, allocated by the allocation simulator", scenario.allocate),
        Step("NodePrepareResources binds the GPU to vfio-pci; its gpu-<minor> leaves the pool", scenario.prepare),
        Step("NodeUnprepareResources gives it back to nvidia; gpu-<minor> is published again", scenario.unprepare),
    ], first=3)


class _Scenario:
    """The passthrough scenario's steps 3 to 5."""

    def __init__(self, run: DemoRun, narrator: Narrator) -> None:
        assert run.sandbox.api is not None
        self.run, self.narrator, self.api = run, narrator, run.sandbox.api
        self.claim: dict[str, Any] = {}
        self.device = self.sibling = self.uuid = self.address = ""

    async def allocate(self) -> None:
        run, api = self.run, self.api
        for obj in manifests("deviceclasses.yaml"):
            api.create(obj)
        api.create(CLAIM)
        [self.claim] = scheduler.allocate(api, [("default", "vm-gpu")], node_name=run.sandbox.node_name)
        [res] = self.claim["status"]["allocation"]["devices"]["results"]
        self.device = res["device"]
        [entry] = [d for d in run.plugin.inventory.vfio if d.name == self.device]
        if entry.sibling is None or entry.parent_uuid is None:
            raise DemoError(f"{self.device}: its GPU is not known to NVML")
        self.sibling, self.uuid, self.address = entry.sibling, entry.parent_uuid, entry.function.address
        self.narrator.say(f"claim vm-gpu -> {self.device} (PCI {self.address}, the GPU {self.sibling} {self.uuid})",
                          device=self.device)

    async def prepare(self) -> None:
        run, narrator = self.run, self.narrator
        await prepare_claim(run.connection, self.claim)
        function = run.sandbox.pci_host().function(self.address)
        if function.driver != "vfio-pci":
            raise DemoError(f"{self.address} is bound to {function.driver!r}, not vfio-pci")
        spec = json.loads(GPU_DRIVER.cdi.spec_path(run.sandbox.cdi_root, self.claim["metadata"]["uid"]).read_bytes())
        nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
        narrator.say(f"{self.address}: driver vfio-pci (override {function.driver_override}); CDI device nodes "
                     f"{', '.join(nodes)}; env {', '.join(spec['containerEdits'].get('env') or [])}", cdi_spec=spec)
        await until(f"{self.sibling} leaving the ResourceSlice", lambda: self.sibling not in published(run.sandbox))
        await until("NVML re-enumerating", lambda: all(g.uuid != self.uuid for g in run.plugin.inventory.gpus))
        narrator.say(f"NVML now lists {len(run.plugin.inventory.gpus)} GPU(s); {self.sibling} withdrawn from the "
                     f"ResourceSlice while {self.device} is held", withdrawn=self.sibling)

    async def unprepare(self) -> None:
        run, narrator = self.run, self.narrator
        errors = await run.connection.unprepare([claim_ref(self.claim)])
        if any(errors.values()):
            raise DemoError(f"NodeUnprepareResources failed: {errors}")
        function = run.sandbox.pci_host().function(self.address)
        if (function.driver, function.driver_override) != ("nvidia", None):
            raise DemoError(f"{self.address} left on {function.driver!r} (override {function.driver_override!r})")
        await until(f"{self.sibling} published again", lambda: self.sibling in published(run.sandbox))
        again = published(run.sandbox)[self.sibling].get("uuid")
        if again != self.uuid:
            raise DemoError(f"{self.sibling} came back as {again}, not {self.uuid}")
        self.api.delete("ResourceClaim", "vm-gpu", "default")
        narrator.say(f"{self.address}: driver nvidia; {self.sibling} published again as {again}; CDI specs: "
                     f"{len(run.sandbox.cdi_specs())}, prepared claims: {len(run.plugin.state)}", uuid=again)


async def demo(*, node_name: str, narrator: Narrator) -> None:
    """Run the passthrough scenario."""
    async with started(node_name, narrator) as run:
        await run_scenario(run, narrator)
