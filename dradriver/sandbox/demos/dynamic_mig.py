"""``dradriver demo --scenario dynamic-mig``: MIG devices created at prepare and destroyed at unprepare, narrated.

The real kubelet plugin runs with the ``DynamicMIG`` gate against the mock ``libnvidia-ml.so.1`` (with its MIG state
file and capability files under the sandbox's ``proc``), the API emulator over HTTP and the kubelet emulator over
the plugin's Unix sockets. Steps:

1. start the plugin on an H200 node (``dgx-h200``: 8 GPUs, MIG mode off, no instances);
2. the published devices: every (MIG profile, placement) of every GPU, beside the full GPUs;
3. a claim for a ``1g.18gb`` device and one for a ``3g.71gb`` device, allocated by the allocation simulator;
4. NodePrepareResources: MIG mode on, the GPU and compute instances created at the allocated placements; the CDI
   specs (parent node plus GI/CI capability nodes), the identity in ``status.devices``, and what
   ``nvidia-smi -L`` would print in each container;
5. NodeUnprepareResources: the instances destroyed, MIG mode back off, nothing left behind.

When the ResourceSlices of this build carry no placement devices (the simulator then finds none), step 3 names
that and allocates the first free placement of each profile itself, in the published device order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from dradriver.app import start_plugin
from dradriver.domain import featuregates
from dradriver.domain.devices import MigDevice
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.migplacements import MigPlacement, dynamic_allocatable, instance_of
from dradriver.sandbox import scheduler
from dradriver.sandbox.demos.narrator import (
    DemoError,
    DemoRun,
    Narrator,
    Step,
    claim_ref,
    manifests,
    nvidia_smi_line,
    prepare_claim,
    run_steps_async,
)
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode

PROFILE = "dgx-h200"
WANTED = ("1g.18gb", "3g.71gb")


def _claim(name: str, profile: str) -> dict[str, Any]:
    selector = f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": selector}}]}}]}},
    }


def _mig_state(sandbox: SandboxNode) -> tuple[list[list[str]], list[list[str]], dict[int, tuple[int, int]]]:
    lines = [ln.split() for ln in sandbox.mig_state_path.read_text().splitlines() if ln and not ln.startswith("#")]
    modes = {int(p[1]): (int(p[2]), int(p[3])) for p in lines if p[0] == "gpu"}
    return [p for p in lines if p[0] == "gi"], [p for p in lines if p[0] == "ci"], modes


@contextlib.asynccontextmanager
async def started(profile: str, node_name: str, narrator: Narrator) -> AsyncIterator[DemoRun]:
    """Steps 1 and 2."""
    narrator.step(1, f"Start the kubelet plugin with DynamicMIG on node {node_name} (mock NVML profile {profile})")
    with SandboxNode(profile=profile, node_name=node_name, mig_state=True) as sandbox:
        assert sandbox.api is not None
        config = sandbox.config(log_level="warning", feature_gates=featuregates.parse_feature_gates("DynamicMIG=true"))
        plugin = await start_plugin(config)
        try:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin(GPU_DRIVER.driver_name, timeout=15)
                inv = plugin.inventory
                gis, _, modes = _mig_state(sandbox)
                narrator.say(f"NVML: driver {inv.versions.driver}, {len(inv.gpus)} GPU(s) "
                             f"({inv.gpus[0].product_name if inv.gpus else '-'}), MIG mode on: "
                             f"{sum(1 for m in modes.values() if m[0])}, GPU instances: {len(gis)}")
                narrator.done()
                narrator.step(2, "The devices offered: full GPUs and every MIG placement (abstract devices)")
                devices = dynamic_allocatable(inv)
                by_profile: dict[str, int] = {}
                for dev in devices:
                    if isinstance(dev, MigPlacement):
                        by_profile[dev.profile] = by_profile.get(dev.profile, 0) + 1
                narrator.say(f"{len(devices)} devices: {sum(1 for d in devices if not isinstance(d, MigPlacement))} "
                             f"full GPUs and {sum(by_profile.values())} placements ("
                             + ", ".join(f"{n} x {p}" for p, n in sorted(by_profile.items())) + ")",
                             placements=by_profile)
                first = next(d for d in devices if isinstance(d, MigPlacement))
                last = first.placement_start + first.placement_size - 1
                narrator.say(f"e.g. {first.name}: profile {first.profile}, GI profile {first.gi_profile_id}, "
                             f"memory slices {first.placement_start}..{last}")
                deadline = time.monotonic() + 15
                def pool_complete() -> bool:  # every slice of the pool (dynamic MIG publishes one per GPU)
                    assert sandbox.api is not None
                    published = sandbox.api.objects("ResourceSlice")
                    return bool(published) and len(published) == max(
                        s["spec"]["pool"]["resourceSliceCount"] for s in published)

                while not pool_complete():
                    if time.monotonic() > deadline:
                        raise DemoError("the ResourceSlice pool was not published within 15 s")
                    await asyncio.sleep(0.02)
                slices = sandbox.api.objects("ResourceSlice")
                sets = sum(len(s["spec"].get("sharedCounters") or []) for s in slices)
                narrator.say(f"{len(slices)} ResourceSlice(s), {sets} counter set(s), "
                             f"{sum(len(s['spec'].get('devices') or []) for s in slices)} devices published",
                             slices=[s["metadata"]["name"] for s in slices])
                slices = sandbox.api.objects("ResourceSlice")
                sets = sum(len(s["spec"].get("sharedCounters") or []) for s in slices)
                narrator.say(f"{len(slices)} ResourceSlice(s), {sets} counter set(s), "
                             f"{sum(len(s['spec'].get('devices') or []) for s in slices)} devices published",
                             slices=[s["metadata"]["name"] for s in slices])
                narrator.done()
                yield DemoRun(sandbox, plugin, kubelet, connection)
        finally:
            await plugin.stop()


def _fallback_allocation(run: DemoRun, name: str, profile: str, taken: list[MigPlacement]) -> dict[str, Any]:
    """The first placement of ``profile`` in published order that overlaps nothing allocated (first fit)."""
    api = run.sandbox.api
    assert api is not None
    for dev in dynamic_allocatable(run.plugin.inventory):
        if isinstance(dev, MigPlacement) and dev.profile == profile and not any(dev.overlaps(t) for t in taken):
            taken.append(dev)
            stored = api.get("ResourceClaim", name, "default")
            assert stored is not None
            stored.setdefault("status", {})["allocation"] = {"devices": {"results": [{
                "request": "mig", "driver": GPU_DRIVER.driver_name, "pool": run.sandbox.node_name,
                "device": dev.name}]}}
            return api.update(stored, subresource="status")
    raise DemoError(f"no free placement of profile {profile}")


async def run_scenario(run: DemoRun, narrator: Narrator) -> None:
    """Steps 3 to 5."""
    scenario = _Scenario(run, narrator)
    await run_steps_async(narrator, [
        Step("Claims for a 1g.18gb and a 3g.71gb MIG device, allocated by the allocation simulator",
             scenario.allocate),
        Step("NodePrepareResources creates the instances at exactly those placements", scenario.prepare),
        Step("NodeUnprepareResources destroys them; MIG mode goes back off", scenario.unprepare),
    ], first=3)


class _Scenario:
    """The dynamic-MIG scenario's steps 3 to 5 and the claims they allocate."""

    def __init__(self, run: DemoRun, narrator: Narrator) -> None:
        assert run.sandbox.api is not None
        self.run, self.narrator, self.api = run, narrator, run.sandbox.api
        self.claims: list[dict[str, Any]] = []

    async def allocate(self) -> None:
        """Claims for the :data:`WANTED` profiles, allocated by the simulator (first fit when it cannot)."""
        run, narrator, api = self.run, self.narrator, self.api
        for obj in manifests("deviceclasses.yaml"):
            api.create(obj)
        names = {profile: f"mig-{profile.replace('.', '-')}" for profile in WANTED}
        for profile, name in names.items():
            api.create(_claim(name, profile))
        try:
            claims = scheduler.allocate(api, [("default", n) for n in names.values()],
                                        node_name=run.sandbox.node_name)
            how = "allocation simulator"
        except scheduler.AllocationError as exc:
            narrator.say(f"the simulator cannot allocate them from this build's ResourceSlices ({exc}); allocating "
                         "the first free placement of each profile in published order instead")
            taken: list[MigPlacement] = []
            claims = [_fallback_allocation(run, n, p, taken) for p, n in names.items()]
            how = "first fit"
        for claim in claims:
            [res] = claim["status"]["allocation"]["devices"]["results"]
            narrator.say(f"claim {claim['metadata']['name']} -> {res['device']} ({how})", device=res["device"])
        self.claims = claims

    async def prepare(self) -> None:
        """Prepare the claims: the instances at those placements, the registry and the claims' status follow."""
        run, narrator, api, claims = self.run, self.narrator, self.api, self.claims
        plugin, kubelet = run.plugin, run.connection
        for claim in claims:
            result = await prepare_claim(kubelet, claim)
            [prepared] = result.devices
            spec_path = GPU_DRIVER.cdi.spec_path(run.sandbox.cdi_root, claim["metadata"]["uid"])
            spec = json.loads(spec_path.read_bytes())
            nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
            narrator.say(f"{prepared.device_name}: CDI device {prepared.cdi_device_ids[0]}; device nodes "
                         f"{', '.join(nodes)}", cdi_spec=spec)
        gis, cis, modes = _mig_state(run.sandbox)
        narrator.say(f"NVML now: {len(gis)} GPU instance(s), {len(cis)} compute instance(s); MIG mode on for "
                     "GPU(s) " + ", ".join(str(i) for i, m in sorted(modes.items()) if m[0]))
        deadline = time.monotonic() + 10
        while len(plugin.inventory.migs) < len(claims):  # the device registry learns of the instances
            if time.monotonic() > deadline:
                raise DemoError("the plugin's devices did not show the created instances within 10 s")
            await asyncio.sleep(0.02)
        for claim in claims:
            [res] = claim["status"]["allocation"]["devices"]["results"]
            placement = plugin.registry.get(res["device"]) if plugin.registry else None
            if not isinstance(placement, MigPlacement):
                raise DemoError(f"{res['device']} is not a dynamic MIG placement")
            mig = instance_of(plugin.inventory, placement)
            if not isinstance(mig, MigDevice):
                raise DemoError(f"no MIG device was created on {res['device']}")
            narrator.say(f"container of claim {claim['metadata']['name']} would see (nvidia-smi -L):\n  "
                         + nvidia_smi_line(mig).replace("\n", "\n  "), nvidia_smi=nvidia_smi_line(mig))
            deadline = time.monotonic() + 10
            while True:
                stored = api.get("ResourceClaim", claim["metadata"]["name"], "default") or {}
                status = (stored.get("status") or {}).get("devices") or []
                if status or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            if not status:
                raise DemoError(f"claim {claim['metadata']['name']}: no status.devices published")
            narrator.say(f"status.devices[0].data: {json.dumps(status[0]['data'], sort_keys=True)}",
                         device_status=status[0])

    async def unprepare(self) -> None:
        """Unprepare the claims: no instance, MIG mode, capability file, CDI spec or claim state left."""
        run, plugin, kubelet = self.run, self.run.plugin, self.run.connection
        for claim in self.claims:
            errors = await kubelet.unprepare([claim_ref(claim)])
            if any(errors.values()):
                raise DemoError(f"NodeUnprepareResources failed: {errors}")
            self.api.delete("ResourceClaim", claim["metadata"]["name"], "default")
        gis, cis, modes = _mig_state(run.sandbox)
        caps = run.sandbox.root / "proc" / "driver" / "nvidia" / "capabilities"
        cap_files = [p for p in caps.glob("gpu*/mig/**/access")]
        if gis or cis or any(m != (0, 0) for m in modes.values()) or cap_files or run.sandbox.cdi_specs() \
                or len(plugin.state):
            raise DemoError(f"left behind: {len(gis)} GPU instance(s), {len(cis)} compute instance(s), MIG modes "
                            f"{modes}, {len(cap_files)} capability file(s), {len(run.sandbox.cdi_specs())} CDI "
                            f"spec(s), {len(plugin.state)} claim(s) in state")
        self.narrator.say("GPU instances: 0, compute instances: 0, MIG mode off on every GPU, capability files: 0, "
                     "CDI specs: 0, prepared claims: 0")


async def demo(*, profile: str = PROFILE, node_name: str, narrator: Narrator) -> None:
    """Run the dynamic-MIG scenario."""
    async with started(profile, node_name, narrator) as run:
        await run_scenario(run, narrator)
