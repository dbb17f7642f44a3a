"""``dradriver demo --scenario passthrough``: a VM-style pod gets two GPUs of one Fabric Manager partition through
VFIO, then gives them back, narrated.

The real kubelet plugin runs with the gates ``PassthroughSupport`` and ``FabricManagerPartitioning`` on an HGX H100
sandbox node (``dgx-h100``): its PCI tree served by the PCI bus stand-in (:mod:`dradriver.sandbox.standins.pcibus`)
with ``vfio-pci`` installed but not loaded, the mock NVML listing only the GPUs bound to ``nvidia``, an NVSwitch
under the node's ``proc``, the mock ``libnvfm.so.1`` in the driver root and the Fabric Manager stand-in
(:mod:`dradriver.sandbox.standins.nv_fabricmanager`, shared NVSwitch mode, the HGX 8-GPU partition table) on the
driver root's default socket; the API emulator over HTTP, the sandbox's resourceclaim controller, scheduler and
kubelet (:class:`dradriver.sandbox.cluster.ClusterEmulator`). Steps:

1. start Fabric Manager and the plugin;
2. the devices offered: each GPU also as ``gpu-vfio-<index>``, with ``gpuModuleID`` and ``partition<N>``;
3. a VM's launcher pod (as KubeVirt's virt-launcher) whose claim asks for two VFIO devices of one 2-GPU partition
   (``matchAttribute: gpu.nvidia.com/partition2``) with ``VfioDeviceConfig`` ``LegacyOnly`` and the API device:
   allocated, prepared, the pod running;
4. what the VM got: both GPUs on ``vfio-pci`` and gone from NVML, their partition active in Fabric Manager, the
   CDI spec (``/dev/vfio/<group>`` of each, ``/dev/vfio/vfio``, ``NVIDIA_VISIBLE_DEVICES=void``), the siblings
   ``gpu-<minor>`` withdrawn from the pool;
5. the pod deleted: the claim unprepared, both GPUs back on ``nvidia`` and listed by NVML, the partition
   deactivated, the siblings published again, nothing left behind.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dradriver.app import GpuPlugin, start_plugin
from dradriver.domain import featuregates
from dradriver.nvml import mock
from dradriver.sandbox.cluster import ClusterEmulator
from dradriver.sandbox.demos.narrator import DemoError, Narrator, Step, run_steps_async
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.standins.nv_fabricmanager import FabricManager, mock_library_path, table_from_profile

PROFILE = "dgx-h100"
GATES = "PassthroughSupport=true,FabricManagerPartitioning=true"
NAMESPACE = "vms"
POD = "virt-launcher-vm-a"
TEMPLATE = "two-gpus-one-partition"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
FM_SOCKET = Path("run") / "nvidia-fabricmanager" / "socket"
NVSWITCH = "0000:05:00.0"
WAIT_S = 60.0


def vm_manifests() -> list[dict[str, Any]]:
    """The namespace, the ResourceClaimTemplate (two VFIO devices of one 2-GPU partition, KubeVirt's VFIO config)
    and the VM's launcher pod."""
    config = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig",
              "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": True}}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": TEMPLATE, "namespace": NAMESPACE},
         "spec": {"spec": {"devices": {
             "requests": [{"name": "gpus", "exactly": {"deviceClassName": "vfio.gpu.nvidia.com", "count": 2}}],
             "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.nvidia.com/partition2"}],
             "config": [{"requests": ["gpus"], "opaque": {"driver": "gpu.nvidia.com", "parameters": config}}]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NAMESPACE,
                                                         "labels": {"kubevirt.io": "virt-launcher"}},
         "spec": {"containers": [{"name": "compute", "image": "quay.io/kubevirt/virt-launcher",
                                  "resources": {"claims": [{"name": "gpus"}]}}],
                  "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": TEMPLATE}]}},
    ]


def prepare_node(sandbox: SandboxNode) -> FabricManager:
    """Give the sandbox node an NVSwitch fabric: an NVSwitch under its ``proc``, ``libnvfm.so.1`` in its driver
    root and the Fabric Manager stand-in on the root's default socket (not started)."""
    switches = sandbox.root / "proc" / "driver" / "nvidia-nvswitch" / "devices"
    switches.mkdir(parents=True, exist_ok=True)
    (switches / NVSWITCH).write_text("")
    lib = sandbox.driver_root / "usr" / "lib64"
    lib.mkdir(parents=True, exist_ok=True)
    shutil.copy(mock_library_path(), lib / "libnvfm.so.1")
    try:
        table = table_from_profile(json.loads(mock.profile_path(sandbox.profile).read_text()))
    except ValueError as exc:
        raise DemoError(f"profile {sandbox.profile}: no HGX 8-GPU Fabric Manager table for it ({exc})") from exc
    return FabricManager(sandbox.driver_root / FM_SOCKET, table, sandbox.root / "fm-state.json")


class _Scenario:
    """The steps, over one running plugin, Fabric Manager and cluster."""

    def __init__(self, sandbox: SandboxNode, fm: FabricManager, plugin: GpuPlugin, cluster: ClusterEmulator,
                 narrator: Narrator) -> None:
        assert sandbox.api is not None
        self.sandbox, self.fm, self.plugin, self.cluster, self.narrator = sandbox, fm, plugin, cluster, narrator
        self.api = sandbox.api
        self.addresses: dict[str, str] = {}
        self.siblings: dict[str, str] = {}
        self.gpus_before: int = 0

    def devices(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: {k: next(iter(v.values())) for k, v in d.get("attributes", {}).items()}
                for s in self.api.objects("ResourceSlice") for d in s["spec"].get("devices", [])}

    async def until(self, what: str, check: Callable[[], Any]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not check():
            if loop.time() > deadline:
                raise DemoError(f"{what}: not within {WAIT_S:g} s")
            await self.cluster.reconcile()
            await asyncio.sleep(0.05)

    def claim(self) -> dict[str, Any] | None:
        return next(iter(c for c in self.api.objects("ResourceClaim") if c["metadata"]["namespace"] == NAMESPACE),
                    None)

    def pod_running(self) -> bool:
        pod = self.api.get("Pod", POD, NAMESPACE) or {}
        return bool((pod.get("status") or {}).get("phase") == "Running")

    async def offered(self) -> None:
        await self.until("the VFIO devices published",
                         lambda: any(n.startswith("gpu-vfio-") and "partition2" in a
                                     for n, a in self.devices().items()))
        devices = self.devices()
        vfio = sorted((n for n in devices if n.startswith("gpu-vfio-")), key=lambda n: int(n.rsplit("-", 1)[1]))
        self.gpus_before = len(self.plugin.inventory.gpus)
        self.narrator.say(f"{len(devices)} devices: {len(devices) - len(vfio)} GPUs and {len(vfio)} VFIO devices "
                          "(the same GPUs, for VMs)", vfio=vfio)
        for name in vfio:
            a = devices[name]
            self.narrator.say(f"{name}: {a[PCI_BUS_ID]}, gpuModuleID {a.get('gpuModuleID')}, partition2 "
                              f"{a.get('partition2')}, partition4 {a.get('partition4')}, partition8 "
                              f"{a.get('partition8')}")
        pairs = sorted((p.partition_id, sorted(p.module_ids)) for p in self.fm.table.values() if len(p.module_ids) == 2)
        self.narrator.say("Fabric Manager's 2-GPU partitions (ID, module IDs): "
                          + ", ".join(f"{i} {m}" for i, m in pairs) + f"; active: {sorted(self.fm.active) or 'none'}")

    async def vm_starts(self) -> None:
        for obj in vm_manifests():
            self.api.create(obj)
        self.narrator.say(f"pod {NAMESPACE}/{POD} claims 2 x vfio.gpu.nvidia.com with matchAttribute "
                          "gpu.nvidia.com/partition2 and a VfioDeviceConfig (LegacyOnly, enableAPIDevice)")
        await self.until(f"pod {POD} running", self.pod_running)
        claim = self.claim()
        assert claim is not None
        results = claim["status"]["allocation"]["devices"]["results"]
        devices = self.devices()
        for r in results:
            self.addresses[r["device"]] = devices[r["device"]][PCI_BUS_ID]
        vfio = {d.name: d for d in self.plugin.inventory.vfio}
        self.siblings = {name: sib for name in self.addresses if (sib := vfio[name].sibling)}
        partition = {devices[r["device"]].get("partition2") for r in results}
        self.narrator.say(f"claim {claim['metadata']['name']} -> " + ", ".join(
            f"{r['device']} ({self.addresses[r['device']]})" for r in results) + f", partition2 {partition}",
            devices=sorted(self.addresses))
        if len(results) != 2 or len(partition) != 1:
            raise DemoError(f"the claim did not get two VFIO devices of one 2-GPU partition: {results}")
        self.narrator.say(f"pod {POD}: Running")

    async def vm_has(self) -> None:
        host = self.sandbox.pci_host()
        drivers = {a: host.function(a).driver for a in self.addresses.values()}
        if set(drivers.values()) != {"vfio-pci"}:
            raise DemoError(f"the GPUs are not on vfio-pci: {drivers}")
        self.narrator.say("drivers: " + ", ".join(f"{a} {d}" for a, d in sorted(drivers.items())))
        await self.until("NVML no longer listing them", lambda: len(self.plugin.inventory.gpus) == self.gpus_before - 2)
        self.narrator.say(f"NVML lists {len(self.plugin.inventory.gpus)} GPU(s) (was {self.gpus_before})")
        if len(self.fm.active) != 1:
            raise DemoError(f"Fabric Manager's active partitions: {sorted(self.fm.active)}")
        self.narrator.say(f"Fabric Manager: partition {sorted(self.fm.active)[0]} active")
        claim = self.claim()
        assert claim is not None
        (path,) = [p for p in self.sandbox.cdi_specs() if claim["metadata"]["uid"] in p.name]
        spec = json.loads(path.read_text())
        nodes = [n["path"] for n in spec.get("containerEdits", {}).get("deviceNodes", [])] + [
            n["path"] for d in spec["devices"] for n in d.get("containerEdits", {}).get("deviceNodes", [])]
        self.narrator.say(f"CDI spec {path.name}: device nodes {', '.join(nodes)}; env "
                          f"{', '.join(spec.get('containerEdits', {}).get('env', []))}", cdi_spec=spec)
        await self.until("the siblings withdrawn", lambda: not set(self.siblings.values()) & set(self.devices()))
        self.narrator.say("withdrawn from the pool while the VM has them: "
                          + ", ".join(sorted(self.siblings.values())))

    async def vm_stops(self) -> None:
        self.api.delete("Pod", POD, NAMESPACE)
        await self.until("the claim unprepared and deleted", lambda: self.claim() is None)
        self.narrator.say("claim unprepared (no pod uses it) and deleted")
        host = self.sandbox.pci_host()
        drivers = {a: host.function(a).driver for a in self.addresses.values()}
        if set(drivers.values()) != {"nvidia"}:
            raise DemoError(f"the GPUs are not back on nvidia: {drivers}")
        self.narrator.say("drivers: " + ", ".join(f"{a} {d}" for a, d in sorted(drivers.items())))
        await self.until("NVML listing them again", lambda: len(self.plugin.inventory.gpus) == self.gpus_before)
        await self.until("the siblings published again", lambda: set(self.siblings.values()) <= set(self.devices()))
        left = [p.name for p in self.sandbox.cdi_specs()]
        if self.fm.active or left or len(self.plugin.state):
            raise DemoError(f"left behind: active partitions {sorted(self.fm.active)}, CDI specs {left}, "
                            f"{len(self.plugin.state)} claim(s) in state")
        self.narrator.say(f"NVML lists {len(self.plugin.inventory.gpus)} GPU(s); Fabric Manager: no active partition; "
                          f"{', '.join(sorted(self.siblings.values()))} published again; CDI specs: 0, prepared "
                          "claims: 0")


async def demo(*, profile: str = PROFILE, node_name: str, narrator: Narrator) -> None:
    """Run the passthrough scenario on an HGX 8-GPU ``profile``.

    :raises DemoError: a step did not do what the driver promises, or ``profile`` has no GPUs with module IDs 1-8.
    """
    narrator.step(1, f"Start Fabric Manager (shared NVSwitch mode) and the kubelet plugin with {GATES} on node "
                     f"{node_name} (mock NVML profile {profile}, PCI bus and modprobe stand-ins)")
    with SandboxNode(profile=profile, node_name=node_name, pci_tree=True) as sandbox:
        assert sandbox.api is not None
        with prepare_node(sandbox) as fm:
            config = sandbox.config(log_level="warning", feature_gates=featuregates.parse_feature_gates(GATES))
            plugin = await start_plugin(config)
            try:
                async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                    cluster = ClusterEmulator(sandbox, say=lambda _line: None)
                    cluster._kubelet = kubelet
                    cluster.apply_device_classes()
                    narrator.say(f"{len(plugin.inventory.gpus)} GPU(s) on nvidia, {len(plugin.inventory.vfio)} VFIO "
                                 f"device(s); Fabric Manager at {sandbox.driver_root / FM_SOCKET}, "
                                 f"{len(fm.table)} supported partitions")
                    narrator.done()
                    scenario = _Scenario(sandbox, fm, plugin, cluster, narrator)
                    await run_steps_async(narrator, [
                        Step("The devices offered: each GPU also as a VFIO device, with its Fabric Manager "
                             "partitions", scenario.offered),
                        Step("A VM's launcher pod claims two GPUs of one 2-GPU partition", scenario.vm_starts),
                        Step("What the VM got: GPUs on vfio-pci, the partition active, /dev/vfio in its CDI spec",
                             scenario.vm_has),
                        Step("The VM stops: GPUs back on nvidia, the partition deactivated", scenario.vm_stops),
                    ], first=2)
            finally:
                await plugin.stop()
