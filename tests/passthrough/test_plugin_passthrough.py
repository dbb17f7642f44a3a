"""VFIO passthrough end to end (gate ``PassthroughSupport``): the real plugin over gRPC on a sandbox node whose PCI
tree the PCI bus stand-in serves and whose mock NVML lists only the GPUs bound to ``nvidia``; the API emulator over
HTTP. A ``gpu-vfio-<index>`` claim takes its GPU from ``nvidia`` and gives it back; the sibling ``gpu-<minor>`` is
withdrawn from the pool meanwhile; refusals are per claim and leave the plugin serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.app.gpu import PASSTHROUGH_EVENT_WAIT_MS
from dradriver.config import IMAGE_CDI_HOOK_ENV, MODPROBE_ENV
from dradriver.domain import featuregates as fg
from dradriver.domain.claims import ClaimRef
from dradriver.domain.nvcheckpoint import (
    Checkpoint,
    CheckpointEntry,
    CheckpointState,
    DeviceGroup,
    KubeletDevice,
    PreparedDevice,
    encode,
)
from dradriver.domain.passthrough import vfio_uuid
from dradriver.errors import DradriverError
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint, write_checkpoint
from dradriver.sandbox.node import FIRST_IOMMU_GROUP, SandboxNode
from tests import factories
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for

GATES = fg.parse_feature_gates("PassthroughSupport=true")
GPU0 = "0000:18:00.0"


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile="dgx-h100", pci_tree=True) as n:
        assert n.api is not None
        n.api.create(factories.DEVICE_CLASS)
        yield n


def claim_for(node: SandboxNode, name: str, *devices: str) -> ClaimRef:
    assert node.api is not None
    claim = node.api.create(claim_object(name))
    return ref_of(set_allocation(node, claim, [result(d) for d in devices]))


def published(node: SandboxNode) -> dict[str, dict[str, Any]]:
    """Device name -> its attributes, over the node's ResourceSlices."""
    assert node.api is not None
    return {d["name"]: {k: next(iter(v.values())) for k, v in d.get("attributes", {}).items()}
            for s in node.api.objects("ResourceSlice") for d in s["spec"].get("devices", [])}


def driver_of(node: SandboxNode, address: str = GPU0) -> str | None:
    return node.pci_host().function(address).driver


def spec_of(node: SandboxNode, ref: ClaimRef) -> dict[str, Any]:
    [path] = [p for p in node.cdi_specs() if ref.uid in p.name]
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def test_vfio_devices_are_published_beside_the_gpus_and_a_prepare_swaps_the_gpu_and_back(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            pool = published(node)
            assert {f"gpu-{i}" for i in range(8)} | {f"gpu-vfio-{i}" for i in range(8)} <= set(pool)
            assert pool["gpu-vfio-0"]["type"] == "vfio"
            uuid0 = pool["gpu-0"]["uuid"]
            ref = claim_for(node, "vm", "gpu-vfio-0")
            answer = await kubelet.prepare([ref])
            assert answer[ref.uid].error == ""
            assert driver_of(node) == "vfio-pci"
            spec = spec_of(node, ref)
            [device] = spec["devices"]
            assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [f"/dev/vfio/{FIRST_IOMMU_GROUP}"]
            assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]  # once per claim
            await wait_for(lambda: "gpu-0" not in published(node), 20)
            assert "gpu-vfio-0" in published(node) and "gpu-1" in published(node)
            await wait_for(lambda: all(g.minor != 0 for g in plugin.inventory.gpus), 20)  # NVML no longer lists it
            assert plugin.inventory.vfio[0].sibling == "gpu-0"  # known from its record
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
            await wait_for(lambda: "gpu-0" in published(node), 20)
            assert published(node)["gpu-0"]["uuid"] == uuid0

    asyncio.run(body())


def test_a_claim_whose_device_is_the_sibling_of_a_held_one_is_refused_naming_both(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            gpu = claim_for(node, "pod", "gpu-1")
            vm = claim_for(node, "vm", "gpu-vfio-1")  # allocated before either was prepared: the race
            assert (await kubelet.prepare([gpu]))[gpu.uid].error == ""
            error = (await kubelet.prepare([vm]))[vm.uid].error
            assert "'gpu-vfio-1'" in error and "'gpu-1'" in error and "default/pod" in error
            assert driver_of(node, "0000:2a:00.0") == "nvidia"
            both = claim_for(node, "both", "gpu-2", "gpu-vfio-2")
            assert "cannot hold both" in (await kubelet.prepare([both]))[both.uid].error
            assert await kubelet.unprepare([gpu]) == {gpu.uid: ""}
            assert (await kubelet.prepare([vm]))[vm.uid].error == ""
            assert await kubelet.unprepare([vm]) == {vm.uid: ""}

    asyncio.run(body())


def test_with_the_gate_the_health_monitors_event_wait_is_short_so_a_swap_does_not_stall_the_next_claim(
        node: SandboxNode) -> None:
    """Each swap re-initialises NVML with the health monitor stopped, and a stop waits for the NVML event wait in
    progress: with the gate the wait is PASSTHROUGH_EVENT_WAIT_MS (an unprepare right after a VFIO prepare waited
    about 1 s at the default 1000 ms); without it the default stays."""
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (plugin, _kubelet):
            assert plugin.health is not None and plugin.health.wait_timeout_ms == PASSTHROUGH_EVENT_WAIT_MS < 1000
        async with running(node.config()) as (plugin, _kubelet):
            assert plugin.health is not None and plugin.health.wait_timeout_ms == 1000

    asyncio.run(body())


def test_the_kubelets_health_stream_stays_open_across_the_swaps_of_a_vfio_prepare_and_unprepare(
        node: SandboxNode) -> None:
    """Each swap re-initialises NVML with the health monitor paused: the stream the kubelet opened goes on (an
    ended one would have the kubelet report every device of the driver Unknown until it opens another, 5 s
    later), no longer reports gpu-0 Healthy, then Healthy again after the unprepare."""
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            stream = kubelet.watch_health()
            try:
                health = {d.device_name: d.health for d in await anext(stream)}
                assert health["gpu-0"] == "Healthy" and health["gpu-vfio-0"] == "Unknown"
                ref = claim_for(node, "vm", "gpu-vfio-0")
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                async for snapshot in stream:  # the same stream: it did not end at the swap
                    if {d.device_name: d.health for d in snapshot}.get("gpu-0") != "Healthy":
                        break  # gpu-0 withdrawn with the pool's sibling rule (or Unknown: passed through)
                else:
                    raise AssertionError("the health stream ended at the swap")
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}
                async for snapshot in stream:
                    if {d.device_name: d.health for d in snapshot}.get("gpu-0") == "Healthy":
                        break
                else:
                    raise AssertionError("the health stream ended at the swap back")
            finally:
                await stream.aclose()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_the_gate_turned_off_unprepares_a_vfio_claim_prepared_while_it_was_on(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        assert driver_of(node) == "vfio-pci"
        async with running(node.config()) as (plugin, kubelet):
            assert not any(n.startswith("gpu-vfio-") for n in published(node))
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
            await wait_for(lambda: any(g.minor == 0 for g in plugin.inventory.gpus), 20)

    asyncio.run(body())


def test_a_start_without_iommu_groups_is_a_loud_error_naming_the_path(node: SandboxNode) -> None:
    groups = node.root / "sys" / "kernel" / "iommu_groups"
    for group in groups.iterdir():
        for link in (group / "devices").iterdir():
            link.unlink()
        (group / "devices").rmdir()
        group.rmdir()

    async def body() -> None:
        with pytest.raises(DradriverError, match=str(groups)):
            async with running(node.config(feature_gates=GATES)):
                pass

    asyncio.run(body())


def test_a_start_without_the_host_root_is_a_loud_error_naming_it(node: SandboxNode) -> None:
    async def body() -> None:
        with pytest.raises(DradriverError, match="--host-root /nonexistent"):
            async with running(node.config(feature_gates=GATES, host_root=Path("/nonexistent"))):
                pass

    asyncio.run(body())


def test_dradrivers_rollback_checkpoint_names_a_vfio_device_by_its_vfio_info(node: SandboxNode) -> None:
    """NVIDIA's plugin, after a rollback, unprepares dradriver's VFIO claim from ``vfio.info`` (``uuid``,
    ``pciBusID``): dradriver's ``checkpoint.json`` carries both."""
    async def body() -> None:
        config = node.config(feature_gates=GATES)
        async with running(config) as (_plugin, kubelet):
            ref = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            written = read_checkpoint(config.plugin_dir / CHECKPOINT_FILE)
            assert written is not None
            [group] = written.claims[ref.uid].groups
            [device] = group.devices
            assert (device.kind, device.uuid, device.pci_bus_id) == ("vfio", vfio_uuid(GPU0), GPU0)
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


def test_a_vfio_claim_nvidia_prepared_is_adopted_and_its_unprepare_gives_the_gpu_back_to_nvidia(
        node: SandboxNode) -> None:
    """The switch from NVIDIA's plugin: its checkpoint names a claim whose GPU it bound to ``vfio-pci``; dradriver
    adopts it with a VFIO undo record from ``vfio.info``, and the kubelet's unprepare rebinds the GPU to ``nvidia``,
    where NVML lists it again and ``gpu-0`` is published."""
    host = node.pci_host(settle_s=5.0)
    host.load_module("vfio-pci")
    host.set_driver_override(GPU0, "vfio-pci")  # what NVIDIA's plugin did at its prepare
    host.unbind(GPU0)
    host.bind(GPU0, "vfio-pci")
    config = node.config(feature_gates=GATES)
    uid = str(uuid.uuid4())
    kubelet_device = KubeletDevice(("gpu",), node.node_name, "gpu-vfio-0",
                                   (f"k8s.gpu.nvidia.com/claim={uid}-gpu-vfio-0",))
    prepared = PreparedDevice("vfio", kubelet_device, uuid=vfio_uuid(GPU0), pci_bus_id=GPU0)
    status = {"allocation": {"devices": {"results": [result("gpu-vfio-0")]}}}
    entry = CheckpointEntry(CheckpointState.PREPARE_COMPLETED, status, (DeviceGroup((prepared,)),),
                            name="vm", namespace="default")
    config.plugin_dir.mkdir(parents=True, exist_ok=True)
    write_checkpoint(config.plugin_dir / CHECKPOINT_FILE, encode(Checkpoint({uid: entry}, "")))

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert "gpu-0" not in published(node) and "gpu-vfio-0" in published(node)
            [record] = [r for r in json.loads(plugin.state.get(uid).payload)["undo"] if r["kind"] == "vfio"]
            assert record["data"]["address"] == GPU0
            ref = ClaimRef("default", "vm", uid)
            assert await kubelet.unprepare([ref]) == {uid: ""}
            assert driver_of(node) == "nvidia" and host.function(GPU0).driver_override is None
            await wait_for(lambda: "gpu-0" in published(node), 20)

    asyncio.run(body())


AUDIO = "0000:18:00.1"


def test_a_gpu_sharing_its_iommu_group_with_a_bound_function_is_refused_and_the_plugin_serves_on() -> None:
    with SandboxNode(profile="dgx-h100", pci_tree=True, shared_iommu_groups=((GPU0, AUDIO),)) as node:
        async def body() -> None:
            async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
                vm = claim_for(node, "vm", "gpu-vfio-0")
                error = (await kubelet.prepare([vm]))[vm.uid].error
                assert "default/vm" in error and f"{AUDIO} (driver snd_hda_intel)" in error and "IOMMU group" in error
                assert driver_of(node) == "nvidia" and node.pci_host().function(GPU0).driver_override is None
                other = claim_for(node, "other", "gpu-vfio-1")
                assert (await kubelet.prepare([other]))[other.uid].error == ""
                assert await kubelet.unprepare([other]) == {other.uid: ""}

        asyncio.run(body())


def test_a_gpu_in_use_is_refused_naming_the_process_and_the_plugin_serves_on(node: SandboxNode) -> None:
    with open(node.root / "dev" / "nvidia0") as held:
        proc = subprocess.Popen(["sleep", "60"], stdin=held)
    (node.root / "proc" / str(proc.pid)).symlink_to(f"/proc/{proc.pid}")  # the plugin's --proc-root shows it
    try:
        async def body() -> None:
            async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
                vm = claim_for(node, "vm", "gpu-vfio-0")
                error = (await kubelet.prepare([vm]))[vm.uid].error
                assert "default/vm" in error and f"sleep (pid {proc.pid})" in error
                assert driver_of(node) == "nvidia"
                other = claim_for(node, "other", "gpu-1")
                assert (await kubelet.prepare([other]))[other.uid].error == ""

        asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()


ROOT = Path(__file__).resolve().parents[2]


def plugin_env(node: SandboxNode, **extra: str) -> dict[str, str]:
    """``dradriver gpu-kubelet-plugin``'s environment on ``node`` with PassthroughSupport (the sandbox's mock NVML
    sysfs root is in this process's environment)."""
    config = node.config()
    env = dict(os.environ)
    env.update(
        NODE_NAME=config.node_name, KUBECONFIG=config.kubeconfig, CDI_ROOT=str(config.cdi_root),
        KUBELET_REGISTRAR_DIRECTORY_PATH=str(config.kubelet_registrar_directory_path),
        KUBELET_PLUGINS_DIRECTORY_PATH=str(config.kubelet_plugins_directory_path),
        KUBELET_DEVICE_PLUGINS_DIRECTORY_PATH=str(config.kubelet_device_plugins_directory_path),
        DEV_ROOT=str(config.dev_root), SYSFS_ROOT=str(config.sysfs_root), PROC_ROOT=str(config.proc_root),
        HOST_ROOT=str(node.root), DRADRIVER_MOCK_PROFILE=config.mock_profile,
        FEATURE_GATES="PassthroughSupport=true", LOG_LEVEL="warning",
        **{IMAGE_CDI_HOOK_ENV: str(node.image_cdi_hook), MODPROBE_ENV: str(node.root / "bin" / "modprobe")},
    )
    env.update(extra)
    return env


@pytest.mark.parametrize(("fault", "state"), [("unbind", "nvidia"), ("bind", None), ("vfio-node", "vfio-pci")])
def test_a_plugin_sigkilled_in_a_vfio_step_converges_at_its_next_start(node: SandboxNode, fault: str,
                                                                        state: str | None) -> None:
    """The plugin process is SIGKILLed while the PCI bus leaves one of its writes unanswered (after the override:
    on nvidia; after the unbind: on no driver; after the bind: on vfio-pci without its group node); the next start
    rolls the claim back and gives the GPU back to nvidia (nothing half bound), and the kubelet's retry prepares
    it."""
    from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError

    assert node.pci_bus is not None
    pci = node.pci_host()
    ref = claim_for(node, "vm", "gpu-vfio-0")

    async def body() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "gpu-kubelet-plugin", env=plugin_env(node), cwd=str(ROOT),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with KubeletEmulator(node.config().kubelet_registrar_directory_path) as kubelet:
                child = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=30)
                node.pci_bus.inject(fault, GPU0)  # type: ignore[union-attr]
                call = asyncio.create_task(child.prepare([ref]))
                await wait_for(lambda: pci.function(GPU0).driver_override == "vfio-pci"
                               and pci.function(GPU0).driver == state
                               and "count\": 1" not in node.pci_bus.faults.read_text(), 30)  # type: ignore[union-attr]
                proc.kill()
                with pytest.raises(KubeletError):
                    await call
            assert await proc.wait() == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        node.pci_bus.clear_faults()  # type: ignore[union-attr]
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            function = pci.function(GPU0)
            assert (function.driver, function.driver_override) == ("nvidia", None)
            assert plugin.state.get(ref.uid) is None
            await wait_for(lambda: "gpu-0" in published(node), 20)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert driver_of(node) == "vfio-pci"
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"

    asyncio.run(body())


def test_two_plugin_instances_of_a_rolling_update_never_both_take_one_gpu(node: SandboxNode) -> None:
    """Old and new pod side by side share the claim state: a GPU the old one passed through is refused to the new
    one, as its full GPU and as its VFIO device, naming the claim; the new one unprepares what the old prepared."""
    from dradriver.app import start_plugin
    from dradriver.sandbox.kubelet import KubeletEmulator

    async def body() -> None:
        old = await start_plugin(node.config(feature_gates=GATES, pod_uid="0f1e2d3c-old"))
        new = None
        try:
            await wait_for(lambda: old.publisher.last_result is not None)
            new = await start_plugin(node.config(feature_gates=GATES, pod_uid="9a8b7c6d-new"))
            async with KubeletEmulator(node.config().kubelet_registrar_directory_path) as kubelet:
                await kubelet.wait_for_plugin("gpu.nvidia.com")
                await wait_for(lambda: len(kubelet.instances("gpu.nvidia.com")) == 2)
                by_endpoint = {c.endpoint: c for c in kubelet.instances("gpu.nvidia.com")}
                via_old, via_new = by_endpoint[str(old.servers.dra_socket)], by_endpoint[str(new.servers.dra_socket)]
                vm = claim_for(node, "vm", "gpu-vfio-0")
                assert (await via_old.prepare([vm]))[vm.uid].error == ""
                pod = claim_for(node, "pod", "gpu-0")
                error = (await via_new.prepare([pod]))[pod.uid].error
                assert "'gpu-0'" in error and "'gpu-vfio-0'" in error and "default/vm" in error
                again = claim_for(node, "vm2", "gpu-vfio-0")
                assert "already prepared" in (await via_new.prepare([again]))[again.uid].error
                assert driver_of(node) == "vfio-pci"
                await old.stop()
                assert await via_new.unprepare([vm]) == {vm.uid: ""}
                assert driver_of(node) == "nvidia"
        finally:
            await old.stop()
            if new is not None:
                await new.stop()

    asyncio.run(body())


def test_a_plugin_sigkilled_while_giving_a_gpu_back_converges_at_the_retried_unprepare(node: SandboxNode) -> None:
    """SIGKILL in the middle of the unprepare (the override cleared and vfio-pci unbound; the bind to nvidia left
    unanswered): the claim is still recorded with its VFIO record, so the next start's sweep leaves the GPU to it,
    and the kubelet's retried unprepare binds it to nvidia."""
    from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError

    assert node.pci_bus is not None
    pci = node.pci_host()
    ref = claim_for(node, "vm", "gpu-vfio-0")

    async def body() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "gpu-kubelet-plugin", env=plugin_env(node), cwd=str(ROOT),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with KubeletEmulator(node.config().kubelet_registrar_directory_path) as kubelet:
                child = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=30)
                assert (await child.prepare([ref]))[ref.uid].error == ""
                node.pci_bus.inject("bind", GPU0)  # type: ignore[union-attr]
                call = asyncio.create_task(child.unprepare([ref]))
                await wait_for(lambda: pci.function(GPU0).driver is None
                               and pci.function(GPU0).driver_override is None
                               and "count\": 1" not in node.pci_bus.faults.read_text(), 30)  # type: ignore[union-attr]
                proc.kill()
                with pytest.raises(KubeletError):
                    await call
            assert await proc.wait() == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        node.pci_bus.clear_faults()  # type: ignore[union-attr]
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            assert plugin.state.get(ref.uid) is not None and pci.function(GPU0).driver is None  # the claim's own
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            function = pci.function(GPU0)
            assert (function.driver, function.driver_override) == ("nvidia", None)
            await wait_for(lambda: "gpu-0" in published(node), 20)

    asyncio.run(body())


def test_after_a_restart_a_gpu_on_vfio_keeps_its_sibling_from_the_claims_record(node: SandboxNode) -> None:
    """NVML does not list a GPU on vfio-pci at start: its ``gpu-vfio-<index>`` gets its parent from the stored VFIO
    record, so ``gpu-0`` stays refused to another claim by name, and is published again after the unprepare."""
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            vm = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([vm]))[vm.uid].error == ""
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            [device] = [d for d in plugin.inventory.vfio if d.name == "gpu-vfio-0"]
            assert (device.sibling, device.parent_uuid) == ("gpu-0", node_gpu_uuid(0))
            assert "gpu-0" not in published(node)
            pod = claim_for(node, "pod", "gpu-0")
            assert "default/vm" in (await kubelet.prepare([pod]))[pod.uid].error
            assert await kubelet.unprepare([vm]) == {vm.uid: ""}
            await wait_for(lambda: "gpu-0" in published(node), 20)

    asyncio.run(body())


def node_gpu_uuid(minor: int) -> str:
    from dradriver.nvml import mock

    [uuid_] = [g["uuid"] for g in mock.resolved_gpus(mock.load_profile("dgx-h100")) if g["minorNumber"] == minor]
    return str(uuid_)


def test_a_claim_of_two_vfio_devices_gets_the_env_and_the_api_device_once_and_each_its_group_node(
        node: SandboxNode) -> None:
    from tests.configs.helpers import entry, params
    from tests.configs.test_plugin import allocate

    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            config = entry(params("VfioDeviceConfig", iommu={"enableAPIDevice": True}))
            ref = ref_of(allocate(node, "vms", [result("gpu-vfio-0"), result("gpu-vfio-1")], [config]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            spec = spec_of(node, ref)
            groups = {d.name: d.function.iommu_group for d in plugin.inventory.vfio}
            assert [[n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]] == [
                [f"/dev/vfio/{groups['gpu-vfio-0']}"], [f"/dev/vfio/{groups['gpu-vfio-1']}"]]
            assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
            assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/vfio/vfio"]
            assert "mounts" not in spec["containerEdits"] and "hooks" not in spec["containerEdits"]
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())
