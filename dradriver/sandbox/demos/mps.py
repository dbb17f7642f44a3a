"""The MPS step of ``dradriver demo``: a claim with ``sharing: {strategy: MPS}`` and limits, prepared through its
control daemon's Deployment (Deployment -> Pod on the node -> ``nvidia-cuda-mps-control`` running -> startup
probe -> Ready -> claim prepared), shown, and unprepared again."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dradriver.app import GpuPlugin
from dradriver.domain import mps
from dradriver.domain.claims import ClaimRef
from dradriver.errors import DradriverError
from dradriver.nvml import settings
from dradriver.sandbox import scheduler
from dradriver.sandbox.demos.narrator import Narrator
from dradriver.sandbox.kubelet import PluginConnection
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode
from dradriver.sandbox.standins.nvidia_cuda_mps_control import STATE_FILE

MPS_CONFIG = {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "20Gi"}


def mps_claim_object(name: str) -> dict[str, Any]:
    """ResourceClaim ``name``: one GPU with a GpuConfig asking for MPS with a thread percentage and memory limit."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": MPS_CONFIG}}}}],
        }},
    }


MPS_STEP = "An MPS claim with limits: one control daemon per claim, run as a Deployment"
"""The title of :func:`run_mps_step` (a :class:`~dradriver.sandbox.demos.narrator.Step` of ``basic``)."""


async def run_mps_step(sandbox: SandboxNode, plugin: GpuPlugin, kubelet: PluginConnection, narrator: Narrator,
                       error: Callable[[str], DradriverError]) -> None:
    """The step :data:`MPS_STEP`: prepare an MPS claim through its control daemon, show it, unprepare it.

    :raises DradriverError: (made by ``error``) a part of the path did not do what the driver promises.
    """
    api = sandbox.api
    assert api is not None
    api.create(mps_claim_object("mps-gpu"))
    [claim] = scheduler.allocate(api, [("default", "mps-gpu")], node_name=sandbox.node_name)
    meta = claim["metadata"]
    ref = ClaimRef(meta["namespace"], meta["name"], meta["uid"])
    [alloc] = claim["status"]["allocation"]["devices"]["results"]
    device = plugin.inventory.find(alloc["device"])
    daemons = plugin.mps_daemons
    if device is None or daemons is None or plugin.session is None:
        raise error("the plugin runs without MPS support or lost the allocated GPU")
    answer = (await kubelet.prepare([ref]))[ref.uid]
    if answer.error:
        raise error(f"NodePrepareResources failed for the MPS claim: {answer.error}")
    daemon_id = mps.control_daemon_id(ref.uid, [device.uuid])
    name = mps.deployment_name(daemon_id)
    deployment = api.get("Deployment", name, SANDBOX_NAMESPACE)
    pods = api.objects("Pod", SANDBOX_NAMESPACE)
    if deployment is None or len(pods) != 1:
        raise error(f"expected Deployment {SANDBOX_NAMESPACE}/{name} with one Pod, found {len(pods)} Pod(s)")
    narrator.say(f"Deployment {SANDBOX_NAMESPACE}/{name}: Pod {pods[0]['metadata']['name']} on node "
                 f"{pods[0]['spec']['nodeName']} Ready after {daemons.wait_s.get(daemon_id, 0.0) * 1e3:.0f} ms "
                 "(startup probe: cat of the startup marker)", deployment=name)
    state = json.loads((daemons.directory(daemon_id) / mps.PIPE_DIR / STATE_FILE).read_text())
    mode = settings.compute_mode(plugin.session, device.uuid).name
    narrator.say(f"nvidia-cuda-mps-control serves {', '.join(state['visibleDevices'])}: default active thread "
                 f"percentage {state['defaultActiveThreadPercentage']:.0f}, pinned memory limit "
                 f"{state['defaultPinnedMemLimits'].get(device.uuid, '-')}; {alloc['device']} compute mode {mode}",
                 mps=state, compute_mode=mode)
    spec = json.loads(next(p for p in sandbox.cdi_specs() if ref.uid in p.name).read_bytes())
    edits = spec["devices"][0]["containerEdits"]
    mounts = ", ".join(f"{m['containerPath']} <- {m['hostPath'].rsplit('/', 2)[-2]}/{m['hostPath'].rsplit('/', 1)[-1]}"
                       for m in edits.get("mounts", []) if m["containerPath"] in ("/dev/shm", mps.CONTAINER_PIPE_DIR))
    narrator.say(f"the workload's CDI edits: {', '.join(e for e in edits.get('env', []) if 'MPS' in e)}; "
                 f"mounts {mounts}")
    errors = await kubelet.unprepare([ref])
    if any(errors.values()):
        raise error(f"NodeUnprepareResources failed for the MPS claim: {errors}")
    left = api.objects("Deployment") + api.objects("Pod", SANDBOX_NAMESPACE)
    if left or daemons.directory(daemon_id).exists():
        raise error(f"the MPS control daemon was not cleaned up: {[o['metadata']['name'] for o in left]}")
    mode = settings.compute_mode(plugin.session, device.uuid).name
    api.delete("ResourceClaim", "mps-gpu", "default")
    narrator.say(f"unprepared: Deployment and Pod deleted, shm unmounted, directory removed, compute mode {mode}")
