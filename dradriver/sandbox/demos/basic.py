"""``dradriver demo``: the whole driver end to end on a machine with no GPU and no cluster, narrated.

The real kubelet plugin (:func:`dradriver.app.start_plugin`) runs against the bundled mock
``libnvidia-ml.so.1``, the in-process Kubernetes API emulator over HTTP and the kubelet emulator over the
plugin's Unix sockets. Claims are allocated by the scheduler emulator (our allocation simulator) and prepared
through NodePrepareResources exactly as on a node. Steps:

1. start the plugin, the API emulator and the kubelet emulator (the kubelet registers the plugin);
2. show the published ResourceSlice;
3. apply DeviceClasses and the ``big-gpu`` template with Pod ``dra-gpu-pod`` (a GPU with at least 40Gi),
   allocate, prepare, show the CDI spec and what ``nvidia-smi -L`` would print in the container;
4. apply ResourceClaim ``shared-gpu`` with two pods: both get the same device from one preparation;
5. apply Pod ``cuda-vectoradd``, written for the device plugin (``nvidia.com/gpu: 1`` in its limits, no
   resourceClaims): the scheduler emulator creates the claim KEP-5004 prescribes from DeviceClass
   ``gpu.nvidia.com`` (``spec.extendedResourceName: nvidia.com/gpu``), fills in the Pod's
   ``status.extendedResourceClaimStatus``, and the claim is prepared like any other;
6. an MPS claim with limits (:mod:`dradriver.sandbox.demos.mps`): its control daemon's Deployment runs as a local
   process (the sandbox's Deployment controller and container runner), becomes Ready, the claim is prepared and
   unprepared;
7. tear down (unprepare, delete pods and claims) and check nothing is left (CDI specs, claim state).

``--scenario time-slicing`` runs :mod:`dradriver.sandbox.demos.time_slicing` after step 2 instead;
``--scenario sharing`` is :mod:`dradriver.sandbox.demos.sharing` (its own node and plugin configurations).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from dradriver.app import start_plugin
from dradriver.domain import devicemetadata
from dradriver.domain.featuregates import FeatureGates
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.passthrough import VfioDevice
from dradriver.host.devicemetadata import read_metadata
from dradriver.sandbox import scheduler
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.cluster import create_claim_from_template
from dradriver.sandbox.demos.mps import MPS_STEP, run_mps_step
from dradriver.sandbox.demos.narrator import (
    DemoError,
    DemoRun,
    Narrator,
    Step,
    claim_ref,
    device_table,
    manifests,
    nvidia_smi_line,
    prepare_claim,
    run_steps_async,
)
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode


def _claim_from_template(api: ApiServerEmulator, pod: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """Create the Pod's claim from its template and record it in the Pod's status (resourceclaim controller)."""
    claim = create_claim_from_template(api, pod, entry, suffix=uuid.uuid4().hex[:5])
    status = pod.setdefault("status", {}).setdefault("resourceClaimStatuses", [])
    status.append({"name": entry["name"], "resourceClaimName": claim["metadata"]["name"]})
    return claim


def _pod_ref(pod: dict[str, Any]) -> dict[str, str]:
    return {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}


@contextlib.asynccontextmanager
async def started(profile: str, node_name: str, narrator: Narrator,
                  feature_gates: FeatureGates | None = None) -> Any:
    """Step 1 and 2: start everything and show the ResourceSlice; stops everything on exit.

    :param feature_gates: the plugin's ``--feature-gates`` (default: NVIDIA's defaults).
    """
    narrator.step(1, f"Start the kubelet plugin on node {node_name} (mock NVML profile {profile})")
    with SandboxNode(profile=profile, node_name=node_name) as sandbox:
        assert sandbox.api is not None
        sandbox.run_workloads()
        # MPSSupport is always on in the demo: step 5 (and the sharing scenario) prepare MPS claims
        gates = (feature_gates or sandbox.config().feature_gates).with_gates(MPSSupport=True)
        plugin = await start_plugin(sandbox.mps_config(log_level="warning", feature_gates=gates))
        try:
            narrator.say(f"Kubernetes API emulator at {sandbox.api.url}")
            narrator.say(f"DRA socket {plugin.servers.dra_socket}")
            async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin(GPU_DRIVER.driver_name, timeout=15)
                narrator.say(f"kubelet registered {GPU_DRIVER.driver_name} via {connection.registration_socket.name}, "
                             f"speaking {connection.service}")
                inv = plugin.inventory
                narrator.say(f"NVML: driver {inv.versions.driver}, CUDA {inv.versions.cuda_driver_text}, "
                             f"{len(inv.gpus)} GPU(s), {len(inv.migs)} MIG device(s)"
                             + (f", NVLink clique {inv.clique.id}" if inv.clique else ""))
                narrator.done()
                narrator.step(2, "The published ResourceSlice")
                deadline = time.monotonic() + 15
                while not sandbox.api.objects("ResourceSlice"):
                    if time.monotonic() > deadline:
                        raise DemoError("no ResourceSlice was published within 15 s")
                    await asyncio.sleep(0.02)
                slices = sandbox.api.objects("ResourceSlice")
                names = ", ".join(s["metadata"]["name"] for s in slices)
                narrator.say(f"{len(slices)} ResourceSlice(s) in pool {node_name}: {names}",
                             slices=[s["metadata"]["name"] for s in slices])
                narrator.say(device_table(slices))
                narrator.done()
                yield DemoRun(sandbox, plugin, kubelet, connection)
        finally:
            await plugin.stop()


async def run_scenarios(run: DemoRun, narrator: Narrator) -> None:
    """Steps 3 to 7."""
    scenario = _Scenario(run, narrator)
    await run_steps_async(narrator, [
        Step("One GPU with at least 40Gi: ResourceClaimTemplate big-gpu and Pod dra-gpu-pod", scenario.one_gpu),
        Step("One ResourceClaim shared-gpu referenced by two pods", scenario.shared_claim),
        Step("A device-plugin-style pod: nvidia.com/gpu: 1 in its limits, served by DRA", scenario.device_plugin_pod),
        Step(MPS_STEP, lambda: run_mps_step(run.sandbox, run.plugin, run.connection, narrator, DemoError)),
        Step("Tear down and check that nothing is left behind", scenario.tear_down),
    ], first=3)


class _Scenario:
    """The ``basic`` scenario's steps (:func:`run_scenarios`) and the objects they create, for the teardown."""

    def __init__(self, run: DemoRun, narrator: Narrator) -> None:
        assert run.sandbox.api is not None
        self.run, self.narrator, self.api = run, narrator, run.sandbox.api
        self.plugin, self.kubelet, self.node = run.plugin, run.connection, run.sandbox.node_name
        self.claims: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []

    async def one_gpu(self) -> None:
        """A claim from a template, for a GPU with at least 40Gi: its allocation, CDI spec, device status, driver
        files, device metadata and what the container sees."""
        api, narrator = self.api, self.narrator
        for obj in manifests("deviceclasses.yaml"):
            api.create(obj)
        template, pod = manifests("gpu-40gi.yaml")
        api.create(template)
        pod = api.create(pod)
        self.pods.append(pod)
        claim = _claim_from_template(api, pod, pod["spec"]["resourceClaims"][0])
        [claim] = scheduler.allocate(api, [("default", claim["metadata"]["name"])], node_name=self.node,
                                     reserved_for=[_pod_ref(pod)])
        self.claims.append(claim)
        [alloc] = claim["status"]["allocation"]["devices"]["results"]
        narrator.say(f"claim {claim['metadata']['name']} allocated {alloc['device']} on {alloc['pool']} "
                     "(selector: memory >= 40Gi)", device=alloc["device"])
        result = await prepare_claim(self.kubelet, claim)
        [prepared] = result.devices
        narrator.say(f"NodePrepareResources -> CDI device {prepared.cdi_device_ids[0]}",
                     cdi_device_ids=list(prepared.cdi_device_ids))
        spec_path = GPU_DRIVER.cdi.spec_path(self.run.sandbox.cdi_root, claim["metadata"]["uid"])
        spec = json.loads(spec_path.read_bytes())
        nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
        common = [n["path"] for n in spec.get("containerEdits", {}).get("deviceNodes", [])]
        narrator.say(f"CDI spec {spec_path.name} (cdiVersion {spec['cdiVersion']}, kind {spec['kind']}): "
                     f"device nodes {', '.join(nodes + common)}", cdi_spec=spec)
        self._show_device_status(claim)
        self._show_driver_files(spec)
        device = self.plugin.inventory.find(alloc["device"])
        assert device is not None and not isinstance(device, VfioDevice)  # the basic demo allocates gpu.nvidia.com
        narrator.say("the container would see (nvidia-smi -L):\n  " + nvidia_smi_line(device).replace("\n", "\n  "),
                     nvidia_smi=nvidia_smi_line(device))

    def _show_device_status(self, claim: dict[str, Any]) -> None:
        """The claim's ``status.devices`` (KEP-4817), written off the prepare's path."""
        status_writer = self.plugin.status_writer
        if status_writer is not None and not status_writer.flush():
            raise DemoError(f"claim {claim['metadata']['name']}: status.devices not written within 10 s")
        for entry in (self.api.get("ResourceClaim", claim["metadata"]["name"], "default") or {}).get(
                "status", {}).get("devices") or []:
            self.narrator.say(f"claim status.devices[]: {entry['device']} data "
                              f"{json.dumps(entry.get('data'), sort_keys=True)}", device_status=entry)

    def _show_driver_files(self, spec: dict[str, Any]) -> None:
        """The driver's user space the spec mounts and its hooks, and the device metadata files (KEP-5304)."""
        edits = spec.get("containerEdits", {})
        mounts, hooks = edits.get("mounts", []), edits.get("hooks", [])
        if mounts or hooks:
            binaries = [m["containerPath"].rsplit("/", 1)[-1] for m in mounts if "/bin/" in m["containerPath"]]
            self.narrator.say(f"driver user space: {len(mounts)} mounts (libraries, "
                              f"{', '.join(binaries[:3]) or 'no binaries'}{', ...' if len(binaries) > 3 else ''}), "
                              "hooks " + ", ".join(h["args"][1] for h in hooks if len(h.get("args", [])) > 1))
        for mounts in devicemetadata.spec_mounts(spec).values():  # the DeviceMetadata gate (KEP-5304)
            for mount in mounts:
                doc = read_metadata(mount["hostPath"])
                self.narrator.say(f"device metadata file {mount['containerPath']} (read-only, first object of its "
                                  "stream):\n  " + json.dumps(doc, indent=2).replace("\n", "\n  "),
                                  device_metadata=doc)

    async def shared_claim(self) -> None:
        """One claim referenced by two pods: prepared once, the same devices for both."""
        api, plugin = self.api, self.plugin
        shared, pod1, pod2 = manifests("shared-claim.yaml")
        api.create(shared)
        pod1, pod2 = api.create(pod1), api.create(pod2)
        self.pods += [pod1, pod2]
        [shared] = scheduler.allocate(api, [("default", "shared-gpu")], node_name=self.node,
                                      reserved_for=[_pod_ref(pod1), _pod_ref(pod2)])
        self.claims.append(shared)
        before = plugin.runner.preparations
        first = await prepare_claim(self.kubelet, shared)
        second = await prepare_claim(self.kubelet, shared)
        if first.devices != second.devices:
            raise DemoError("the two pods of shared-gpu got different devices")
        if plugin.runner.preparations - before != 1:
            raise DemoError(f"shared-gpu was prepared {plugin.runner.preparations - before} times, expected once")
        self.narrator.say(f"pod {pod1['metadata']['name']} and pod {pod2['metadata']['name']} both get "
                          f"{first.devices[0].device_name} ({first.devices[0].cdi_device_ids[0]}); preparations: 1",
                          device=first.devices[0].device_name)

    async def device_plugin_pod(self) -> None:
        """A pod asking for ``nvidia.com/gpu: 1``: the scheduler's generated claim, the pod's status naming it."""
        api, narrator = self.api, self.narrator
        [legacy] = manifests("device-plugin-pod.yaml")
        legacy = api.create(legacy)
        self.pods.append(legacy)
        generated = scheduler.schedule_extended(api, legacy, node_name=self.node)
        if generated is None:
            raise DemoError("no claim was generated for pod cuda-vectoradd (is nvidia.com/gpu mapped by a "
                            "DeviceClass?)")
        self.claims.append(generated)
        [request] = generated["spec"]["devices"]["requests"]
        [result] = generated["status"]["allocation"]["devices"]["results"]
        narrator.say(f"scheduler created claim {generated['metadata']['name']} (annotation "
                     f"resource.kubernetes.io/extended-resource-claim=true, owner pod cuda-vectoradd): request "
                     f"{request['name']} of class {request['exactly']['deviceClassName']} -> {result['device']}",
                     claim=generated["metadata"]["name"], device=result["device"])
        legacy = api.get("Pod", legacy["metadata"]["name"], "default") or legacy
        status = legacy.get("status", {}).get("extendedResourceClaimStatus")
        if not status or status.get("resourceClaimName") != generated["metadata"]["name"]:
            raise DemoError(f"pod cuda-vectoradd has no status.extendedResourceClaimStatus naming its claim: {status}")
        narrator.say("pod status.extendedResourceClaimStatus: " + json.dumps(status, sort_keys=True),
                     extended_resource_claim_status=status)
        prepared_legacy = await prepare_claim(self.kubelet, generated)
        narrator.say(f"NodePrepareResources -> CDI device {prepared_legacy.devices[0].cdi_device_ids[0]}")

    async def tear_down(self) -> None:
        """Unprepare the claims, delete the pods and claims: no CDI spec and no claim state left."""
        api, plugin = self.api, self.plugin
        for c in self.claims:
            errors = await self.kubelet.unprepare([claim_ref(c)])
            if any(errors.values()):
                raise DemoError(f"NodeUnprepareResources failed: {errors}")
        for p in self.pods:
            api.delete("Pod", p["metadata"]["name"], "default")
        for c in self.claims:
            if api.get("ResourceClaim", c["metadata"]["name"], "default") is not None:
                api.delete("ResourceClaim", c["metadata"]["name"], "default")
        leftovers = self.run.sandbox.cdi_specs()
        if leftovers or len(plugin.state):
            raise DemoError(f"left behind: CDI specs {[p.name for p in leftovers]}, {len(plugin.state)} claim(s) in "
                            "state")
        self.narrator.say(f"unprepared {len(self.claims)} claims, deleted {len(self.pods)} pods and "
                          f"{len(self.claims)} claims; CDI specs: 0, prepared claims: 0")


SCENARIOS = ("basic", "time-slicing")
"""``basic``: steps 3-7 above; ``time-slicing``: :mod:`dradriver.sandbox.demos.time_slicing` (sharing gates on). The
assembled ``dradriver demo --scenario sharing`` (time-slicing, consumable shares, MPS) is
:mod:`dradriver.sandbox.demos.sharing`."""


async def demo(*, profile: str, node_name: str, narrator: Narrator,
               serve: Callable[[DemoRun], Any] | None = None, scenario: str = "basic",
               feature_gates: FeatureGates | None = None) -> None:
    """Run the demo; with ``serve``, stop after step 2 and await ``serve(run)`` instead of the scenario's
    steps (3-7 for ``basic``).

    :param feature_gates: gates the operator set (``dradriver demo --feature-gates``), on top of the scenario's.

    :raises DemoError: ``scenario`` is not one of :data:`SCENARIOS`, or a step failed.
    """
    if scenario not in SCENARIOS:
        raise DemoError(f"unknown scenario {scenario!r}; scenarios: {', '.join(SCENARIOS)}")
    from dradriver.sandbox.demos import time_slicing

    gates = time_slicing.SHARING_GATES if scenario == "time-slicing" else None
    if feature_gates is not None:
        gates = (gates or FeatureGates()).with_gates(**feature_gates.explicit)
    async with started(profile, node_name, narrator, gates) as run:
        if serve is not None:
            await serve(run)
        elif scenario == "time-slicing":
            await time_slicing.run_sharing(run, narrator)
        else:
            await run_scenarios(run, narrator)
