"""``dradriver demo --scenario sharing``: GPU sharing end to end on an H200 node, narrated.

The real kubelet plugin runs against the mock NVML (an 8x H200 node, :func:`dradriver.sandbox.profiles.h200_node`),
the API emulator over HTTP and the kubelet emulator over gRPC; claims are allocated by the scheduler emulator (our
allocation simulator, with consumable capacity) and prepared through NodePrepareResources. MPS control daemons
are Deployments whose Pods the sandbox runs as local processes against the ``nvidia-cuda-mps-control`` stand-in.

NVIDIA's driver refuses per-claim MPS while consumable shares are on, so the node runs in two configurations:

1. **consumable shares** (``ConsumableShares``, ``--consumable-shares=memory``, plus ``TimeSlicingSettings``):
   the ResourceSlice with its request policies; two claims of 70Gi time-sliced on one GPU (interval and compute
   mode read back through NVML); four claims of 10Gi sharing the next H200, one MPS control daemon serving all
   four (its ``nvidia-cuda-mps-control`` state and the GPU's compute mode read back), each container's MPS limits
   shown; what ``explain`` says about a claim that fits nowhere; the daemon goes with the last share;
2. **MPS** (``MPSSupport``; the plugin restarted): one claim with NVIDIA's MPS config, its own daemon and the
   defaults the daemon took.

Every part must do what the driver promises or the demo fails (:class:`~dradriver.sandbox.demos.basic.DemoError`);
nothing is skipped. Nothing is left behind at the end (CDI specs, claim state, Deployments, daemon directories).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from dradriver.allocator.simulation import explain, load
from dradriver.app import GpuPlugin, start_plugin
from dradriver.config import PluginConfig
from dradriver.domain import configs
from dradriver.domain.devices import GpuDevice
from dradriver.domain.featuregates import TIME_SLICING_SETTINGS
from dradriver.domain.identity import GPU_DRIVER
from dradriver.nvml import settings as nvml_settings
from dradriver.preparers.shares import daemon_id
from dradriver.sandbox import scheduler
from dradriver.sandbox.demos.narrator import DemoError, Narrator, Step, claim_ref, device_table, run_steps_async
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode
from dradriver.sandbox.profiles import h200_node
from dradriver.sandbox.standins.nvidia_cuda_mps_control import STATE_FILE

DEVICE_CLASS = {
    "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com' && "
                                                  "device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]},
}
SHARE = "10Gi"
TIME_SLICED = "70Gi"
"""Two time-sliced claims of 70Gi fill one H200 (143771 MiB), so the 10Gi shares land on the next GPU."""
CONFIG_API = "resource.nvidia.com/v1beta1"


def _claim(name: str, memory: str | None, config: dict[str, Any] | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config is not None:
        devices["config"] = [{"requests": ["gpu"], "opaque": {"driver": GPU_DRIVER.driver_name,
                                                               "parameters": {"apiVersion": CONFIG_API, **config}}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": devices}}



@dataclasses.dataclass
class _Node:
    sandbox: SandboxNode
    plugin: GpuPlugin
    kubelet: PluginConnection

    @property
    def api(self) -> Any:
        assert self.sandbox.api is not None
        return self.sandbox.api

    def allocate(self, claim: dict[str, Any]) -> dict[str, Any]:
        self.api.create(claim)
        [allocated] = scheduler.allocate(self.api, [("default", claim["metadata"]["name"])],
                                         node_name=self.sandbox.node_name)
        return allocated

    async def prepare(self, claim: dict[str, Any]) -> Any:
        ref = claim_ref(claim)
        result = (await self.kubelet.prepare([ref]))[ref.uid]
        if result.error:
            raise DemoError(f"NodePrepareResources failed for claim {ref}: {result.error}")
        return result

    async def unprepare(self, *claims: dict[str, Any]) -> None:
        refs = [claim_ref(c) for c in claims]
        errors = {uid: e for uid, e in (await self.kubelet.unprepare(refs)).items() if e}
        if errors:
            raise DemoError(f"NodeUnprepareResources failed: {errors}")
        for claim in claims:
            self.api.delete("ResourceClaim", claim["metadata"]["name"], "default")

    def container_env(self, claim: dict[str, Any]) -> list[str]:
        """The environment the claim's container gets from its CDI device (the runtime applies these edits)."""
        spec = json.loads(GPU_DRIVER.cdi.spec_path(self.sandbox.cdi_root, claim["metadata"]["uid"]).read_bytes())
        return [e for d in spec["devices"] for e in d["containerEdits"].get("env", [])]

    def daemons(self) -> list[dict[str, Any]]:
        return [d for d in self.api.objects("Deployment") if d["metadata"].get("namespace") == SANDBOX_NAMESPACE]


@contextlib.asynccontextmanager
async def _running(sandbox: SandboxNode, config: PluginConfig) -> AsyncIterator[_Node]:
    plugin = await start_plugin(config)
    try:
        async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
            connection = await kubelet.wait_for_plugin(GPU_DRIVER.driver_name, timeout=15)
            deadline = time.monotonic() + 15
            while plugin.publisher.last_result is None:
                if time.monotonic() > deadline:
                    raise DemoError("no ResourceSlice was published within 15 s")
                await asyncio.sleep(0.02)
            yield _Node(sandbox, plugin, connection)
    finally:
        await plugin.stop()


def _policy_lines(slices: list[dict[str, Any]]) -> str:
    lines = []
    for obj in slices:
        for dev in obj["spec"].get("devices") or []:
            policy = (dev.get("capacity", {}).get("memory") or {}).get("requestPolicy")
            if policy:
                rng = policy.get("validRange", {})
                lines.append(f"{dev['name']}: allowMultipleAllocations={dev.get('allowMultipleAllocations')}, "
                             f"memory {dev['capacity']['memory']['value']} (default {policy.get('default')}, "
                             f"valid {rng.get('min')}..{rng.get('max')} step {rng.get('step')})")
    return "\n".join(lines[:2] + ([f"... and {len(lines) - 2} more"] if len(lines) > 2 else []))


async def _time_slicing(node: _Node, narrator: Narrator) -> list[dict[str, Any]]:
    """Two claims of 70Gi on one GPU with TimeSlicing (Long): NVIDIA's consumable-shares time-slicing."""
    config = {"kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
    claims = [node.allocate(_claim(f"time-sliced-{i}", TIME_SLICED, config)) for i in (1, 2)]
    devices = {c["status"]["allocation"]["devices"]["results"][0]["device"] for c in claims}
    if len(devices) != 1:
        raise DemoError(f"the two time-sliced claims were allocated {sorted(devices)}, expected one GPU")
    for claim in claims:
        result = await node.prepare(claim)
        narrator.say(f"claim {claim['metadata']['name']}: {TIME_SLICED} of {result.devices[0].device_name}, "
                     f"share {result.devices[0].share_id}, TimeSlicing interval Long",
                     device=result.devices[0].device_name)
    [device] = devices
    gpu = node.plugin.inventory.find(device)
    assert gpu is not None and node.plugin.session is not None
    slice_ = nvml_settings.compute_timeslice(node.plugin.session, gpu.uuid)
    mode = nvml_settings.compute_mode(node.plugin.session, gpu.uuid)
    if slice_ != 3 or node.daemons():
        raise DemoError(f"{device}: time-slice {slice_} (expected 3, Long), MPS daemons {len(node.daemons())}")
    narrator.say(f"{device} is time-sliced between both claims: time-slice {slice_} (Long) and compute mode "
                 f"{mode.name} read back through NVML; no MPS daemon (NVIDIA's time-slicing of shares)")
    return claims


async def _consumable_shares(node: _Node, narrator: Narrator) -> list[dict[str, Any]]:
    """Four claims of 10Gi on one H200, one MPS daemon, each container's limits."""
    claims = [node.allocate(_claim(f"share-{i}", SHARE)) for i in range(1, 5)]
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in claims]
    devices = {r["device"] for r in results}
    if len(devices) != 1:
        raise DemoError(f"the four 10Gi shares were allocated {sorted(devices)}, expected one GPU")
    [device] = devices
    gpu = node.plugin.inventory.find(device)
    if not isinstance(gpu, GpuDevice):
        raise DemoError(f"{device} is not a full GPU of this node")
    narrator.say(f"scheduler: 4 claims x {SHARE} -> {device} ({gpu.product_name}, {gpu.uuid}), consumedCapacity "
                 + ", ".join(r["consumedCapacity"]["memory"] for r in results))
    for claim, alloc in zip(claims, results, strict=True):
        result = await node.prepare(claim)
        if result.devices[0].share_id != alloc["shareID"]:
            raise DemoError(f"claim {claim['metadata']['name']}: prepared share {result.devices[0].share_id}, "
                            f"allocated {alloc['shareID']}")
    daemons = node.daemons()
    expected = f"mps-control-daemon-{daemon_id(gpu.uuid)}"
    if [d["metadata"]["name"] for d in daemons] != [expected]:
        raise DemoError(f"expected one MPS control daemon {expected}, found {[d['metadata']['name'] for d in daemons]}")
    status = daemons[0].get("status", {})
    daemon = _daemon_state(node.plugin.config.plugin_dir / "mps-shares" / daemon_id(gpu.uuid))
    narrator.say(f"one MPS control daemon for all four shares: Deployment {SANDBOX_NAMESPACE}/{expected} "
                 f"(ready replicas {status.get('readyReplicas', 0)}); nvidia-cuda-mps-control runs with "
                 f"CUDA_VISIBLE_DEVICES={','.join(daemon.get('visibleDevices', []))}, multi-user "
                 f"{daemon.get('multiUser')}", deployment=expected, daemon=daemon)
    assert node.plugin.session is not None
    mode = nvml_settings.compute_mode(node.plugin.session, gpu.uuid)
    if mode is not nvml_settings.ComputeMode.EXCLUSIVE_PROCESS:
        raise DemoError(f"{device} is in compute mode {mode.name} while its MPS daemon runs")
    narrator.say(f"{device} compute mode read back through NVML: {mode.name}")
    for claim in claims:
        env = [e for e in node.container_env(claim) if e.startswith("CUDA_MPS_")]
        narrator.say(f"container of claim {claim['metadata']['name']}: " + " ".join(env), env=env)
        if not any(e.startswith("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=") for e in env):
            raise DemoError(f"claim {claim['metadata']['name']}: no MPS memory limit in its container")
    return claims


def _daemon_state(directory: Path) -> dict[str, Any]:
    """What the ``nvidia-cuda-mps-control`` stand-in of a daemon reports (its state file in the pipe directory)."""
    try:
        state = json.loads((directory / "pipe" / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise DemoError(f"MPS control daemon {directory.name}: no state from nvidia-cuda-mps-control: {exc}") from exc
    return state if isinstance(state, dict) else {}


def _explain_too_big(node: _Node, narrator: Narrator) -> None:
    claim = _claim("too-big", "200Gi")
    objects = [*node.api.objects("ResourceSlice"), *node.api.objects("DeviceClass"), *node.api.objects("Node"),
               *[c for c in node.api.objects("ResourceClaim") if (c.get("status") or {}).get("allocation")], claim]
    text, code = explain(load([yaml.safe_dump_all(objects)]))
    block = text.split("claim default/too-big", 1)[1]
    reasons = [line.strip() for line in block.splitlines() if "rejected:" in line][:2]
    if code != 1 or not reasons:
        raise DemoError("explain did not refuse a 200Gi claim on a node of 141GB GPUs")
    narrator.say("dradriver explain, claim too-big (200Gi):\n  " + "\n  ".join(reasons), explain=reasons)


async def _mps_claim(sandbox: SandboxNode, narrator: Narrator) -> None:
    """The node restarted with MPSSupport: one claim with NVIDIA's MPS config and its limits."""
    config = sandbox.mps_config(log_level="error")
    async with _running(sandbox, config) as node:
        if configs.MPS not in node.plugin.runner.sharing:
            raise DemoError("the plugin started with MPSSupport has no MPS sharing step")
        mps = {"kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "20Gi"}}}
        claim = node.allocate(_claim("mps-claim", None, mps))
        result = await node.prepare(claim)
        env = [e for e in node.container_env(claim) if e.startswith("CUDA_MPS_")]
        names = [d["metadata"]["name"] for d in node.daemons()]
        if len(names) != 1:
            raise DemoError(f"expected one MPS control daemon for mps-claim, found {names}")
        daemon = _daemon_state(config.mps_root / names[0].removeprefix("mps-control-daemon-"))
        narrator.say(f"claim mps-claim: {result.devices[0].device_name}, its own MPS control daemon {names[0]}; "
                     f"the daemon's defaults (nvidia-cuda-mps-control): active thread percentage "
                     f"{daemon.get('defaultActiveThreadPercentage')}, pinned memory limits "
                     f"{daemon.get('defaultPinnedMemLimits')}; container: " + " ".join(env),
                     daemons=names, daemon=daemon)
        if daemon.get("defaultActiveThreadPercentage") != 50:
            raise DemoError(f"the MPS daemon of mps-claim did not take the thread percentage: {daemon}")
        await node.unprepare(claim)
        if node.daemons():
            raise DemoError(f"the MPS claim's daemon was left behind: {names}")


async def sharing_demo(narrator: Narrator) -> None:
    """Run the sharing scenario (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="dra-h200-") as tmp:
        profile = h200_node(Path(tmp))
        with SandboxNode(profile=profile) as sandbox:
            assert sandbox.api is not None
            sandbox.api.create(DEVICE_CLASS)
            sandbox.run_workloads()
            narrator.step(1, "Start the plugin with consumable shares on an H200 node "
                             f"(mock NVML {Path(profile).stem})")
            config = sandbox.shares_config("memory", log_level="error")
            config = dataclasses.replace(
                config, feature_gates=config.feature_gates.with_gates(**{TIME_SLICING_SETTINGS: True}))
            async with _running(sandbox, config) as node:
                narrator.say(f"gates {config.feature_gates.render()}; --consumable-shares={config.consumable_shares}")
                slices = node.api.objects("ResourceSlice")
                narrator.say(device_table(slices))
                narrator.say(_policy_lines(slices))
                narrator.done()

                scene = _Scene(node, narrator)
                await run_steps_async(narrator, [
                    Step(f"One GPU time-sliced between two claims of {TIME_SLICED}", scene.time_slicing),
                    Step(f"Four claims of {SHARE} sharing one H200, limits enforced through MPS", scene.shares),
                    Step("Unprepare: the daemon outlives single shares and goes with the last one", scene.unprepare),
                ], first=2)
            await run_steps_async(narrator, [
                Step("Restart the node's plugin with MPSSupport: one MPS claim with limits",
                     lambda: _mps_claim(sandbox, narrator)),
                Step("Nothing left behind", lambda: _nothing_left(sandbox, config, narrator)),
            ], first=5)


class _Scene:
    """Steps 2 to 4 of the sharing scenario on the running node, and the claims they prepare."""

    def __init__(self, node: _Node, narrator: Narrator) -> None:
        self.node, self.narrator = node, narrator
        self.sliced: list[dict[str, Any]] = []
        self.shared: list[dict[str, Any]] = []

    async def time_slicing(self) -> None:
        self.sliced = await _time_slicing(self.node, self.narrator)

    async def shares(self) -> None:
        self.shared = await _consumable_shares(self.node, self.narrator)
        _explain_too_big(self.node, self.narrator)

    async def unprepare(self) -> None:
        node, shares = self.node, self.shared
        for claim in shares[:-1]:
            await node.unprepare(claim)
        if len(node.daemons()) != 1:
            raise DemoError("the MPS control daemon did not outlive the first three shares")
        await node.unprepare(shares[-1], *self.sliced)
        if node.daemons():
            raise DemoError("the MPS control daemon was left behind after the last share")
        self.narrator.say("3 shares unprepared: daemon still running; last share unprepared: daemon gone")


def _nothing_left(sandbox: SandboxNode, config: PluginConfig, narrator: Narrator) -> None:
    leftovers = sandbox.cdi_specs()
    daemon_dirs = sorted((config.plugin_dir / "mps-shares").glob("*"))
    if leftovers or daemon_dirs or (sandbox.api is not None and sandbox.api.objects("Deployment")):
        raise DemoError(f"left behind: CDI specs {[p.name for p in leftovers]}, daemon directories "
                        f"{[p.name for p in daemon_dirs]}")
    narrator.say("CDI specs: 0, MPS control daemons: 0, daemon directories: 0")
