"""VFIO passthrough across an NVIDIA driver unload and load (gate ``PassthroughSupport``): the real plugin over gRPC
on a sandbox node whose PCI bus stand-in models the ``nvidia`` module going (``rmmod``: every GPU on ``nvidia``
unbound, ``sys/bus/pci/drivers/nvidia`` gone, a GPU on ``vfio-pci`` untouched) and coming back (``modprobe``: the
unbound GPUs bound to it again), linked to the mock NVML's ``driver unloaded`` / ``driver loaded``
(:meth:`~dradriver.sandbox.node.SandboxNode.unload_nvidia_module`); the API emulator over HTTP.

What an operator sees: the plugin keeps running, the GPU a VM holds stays on ``vfio-pci`` and nothing touches it,
an unprepare while the driver is away releases the claim at once and keeps its give-back (the GPU stays on
``vfio-pci``, since ``nvidia`` cannot take it) until the driver is back, when the GPU returns to ``nvidia`` and
``gpu-<minor>`` is published again with its UUID."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.app import start_plugin
from dradriver.kubeletplugin import driverstate
from dradriver.kubeletplugin.payload import read_payload
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import FIRST_IOMMU_GROUP, SandboxNode
from tests import factories
from tests.passthrough.test_plugin_passthrough import GATES, GPU0, claim_for, driver_of, node_gpu_uuid, published
from tests.plugin.conftest import running, wait_for
from tests.plugin.test_readiness import NOT_SERVING, SERVING, _status

GPU1 = "0000:2a:00.0"


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> Iterator[SandboxNode]:
    monkeypatch.setattr(driverstate, "RETRY_PERIOD_S", 0.1)
    with SandboxNode(profile="dgx-h100", pci_tree=True) as n:
        assert n.api is not None
        n.api.create(factories.DEVICE_CLASS)
        yield n


def group_node(node: SandboxNode) -> Path:
    return node.root / "dev" / "vfio" / str(FIRST_IOMMU_GROUP)


def test_a_vfio_gpu_stays_passed_through_while_the_driver_is_unloaded_and_its_unprepare_gives_it_back_once_it_is_back(
        node: SandboxNode) -> None:
    """The nvidia module is unloaded under the running plugin while a VM holds GPU 0 on vfio-pci: the plugin
    detects it and serves on (a prepare is refused naming the reason), GPU 0 stays on vfio-pci with its group node.
    The VM's claim is unprepared meanwhile: the kubelet's call succeeds, the spec goes, the device is released, and
    the give-back is kept with the claim with GPU 0 left on vfio-pci (``nvidia`` cannot take it: its driver
    directory is gone). Once the module is loaded again the kept undo binds GPU 0 to nvidia, NVML lists it and
    ``gpu-0`` is published with its UUID."""
    async def body() -> None:
        async with running(node.config(feature_gates=GATES, healthcheck_port=0)) as (plugin, kubelet):
            assert plugin.session is not None and plugin.driver is not None
            session, port = plugin.session, plugin.servers.health_port
            assert port is not None
            uuid0 = published(node)["gpu-0"]["uuid"]
            vm = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([vm]))[vm.uid].error == ""
            await wait_for(lambda: "gpu-0" not in published(node), 20)

            node.unload_nvidia_module()
            await wait_for(lambda: not session.available and bool(plugin.driver.reason()), 10)
            assert "Driver Not Loaded" in plugin.driver.reason()
            assert await _status(port, "readiness") == NOT_SERVING
            function = node.pci_host().function(GPU0)
            assert (function.driver, function.driver_override) == ("vfio-pci", "vfio-pci")  # the VM's GPU
            assert group_node(node).exists() and driver_of(node, GPU1) is None
            during = claim_for(node, "during", "gpu-vfio-1")
            error = (await kubelet.prepare([during]))[during.uid].error
            assert "default/during" in error and "NVIDIA driver is not available" in error, error

            assert await kubelet.unprepare([vm]) == {vm.uid: ""}
            assert not plugin.runner.spec_path(vm.uid).exists()
            kept = plugin.state.get(vm.uid)
            assert kept is not None and kept.devices == ()  # released
            assert [r.kind for r in read_payload(kept.payload).undo] == ["vfio"]
            function = node.pci_host().function(GPU0)
            assert (function.driver, function.driver_override) == ("vfio-pci", "vfio-pci")  # nothing half done
            assert group_node(node).exists()

            node.load_nvidia_module()
            await wait_for(lambda: not plugin.driver.reason(), 30)
            assert plugin.state.get(vm.uid) is None  # the kept undo ran
            function = node.pci_host().function(GPU0)
            assert (function.driver, function.driver_override) == ("nvidia", None)
            await wait_for(lambda: any(g.minor == 0 for g in plugin.inventory.gpus), 20)
            await wait_for(lambda: published(node).get("gpu-0", {}).get("uuid") == uuid0, 20)
            assert await _status(port, "readiness") == SERVING
            assert (await kubelet.prepare([during]))[during.uid].error == ""  # the kubelet's retry
            assert await kubelet.unprepare([during]) == {during.uid: ""}

    asyncio.run(body())


def test_after_a_same_version_reload_a_gpu_still_on_vfio_stays_a_vfio_device_and_its_unprepare_gives_it_back(
        node: SandboxNode) -> None:
    """The driver unloaded and loaded again (same version) while a VM holds GPU 0: NVML initialised again does not
    list it, ``gpu-vfio-0`` stays published with its parent and ``gpu-0`` stays withheld (a claim of it is refused
    naming the VM's claim); the GPUs that were on nvidia are back. The unprepare then gives GPU 0 back to nvidia and
    ``gpu-0`` is published with its UUID again."""
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            assert plugin.session is not None and plugin.driver is not None
            session = plugin.session
            uuid0 = published(node)["gpu-0"]["uuid"]
            vm = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([vm]))[vm.uid].error == ""
            await wait_for(lambda: "gpu-0" not in published(node), 20)

            node.unload_nvidia_module()
            await wait_for(lambda: not session.available and bool(plugin.driver.reason()), 10)
            node.load_nvidia_module()
            await wait_for(lambda: not plugin.driver.reason(), 30)
            assert plugin.driver.reloads == 1
            assert driver_of(node) == "vfio-pci" and driver_of(node, GPU1) == "nvidia"
            assert sorted(g.minor for g in plugin.inventory.gpus) == list(range(1, 8))  # NVML: not GPU 0
            [device] = [d for d in plugin.inventory.vfio if d.name == "gpu-vfio-0"]
            assert (device.sibling, device.parent_uuid) == ("gpu-0", node_gpu_uuid(0))
            await wait_for(lambda: plugin.publisher.in_sync, 20)
            pool = published(node)
            assert "gpu-vfio-0" in pool and "gpu-0" not in pool and "gpu-1" in pool
            pod = claim_for(node, "pod", "gpu-0")
            assert "default/vm" in (await kubelet.prepare([pod]))[pod.uid].error

            assert await kubelet.unprepare([vm]) == {vm.uid: ""}
            function = node.pci_host().function(GPU0)
            assert (function.driver, function.driver_override) == ("nvidia", None)
            await wait_for(lambda: published(node).get("gpu-0", {}).get("uuid") == uuid0, 20)
            assert (await kubelet.prepare([pod]))[pod.uid].error == ""
            assert await kubelet.unprepare([pod]) == {pod.uid: ""}

    asyncio.run(body())


def test_a_plugin_restarted_while_the_driver_is_unloaded_serves_and_keeps_a_vfio_unprepare_until_it_is_back(
        node: SandboxNode) -> None:
    """A restart during a driver upgrade: a VFIO claim was prepared, the plugin stops, the nvidia module is
    unloaded, the plugin starts without it. It starts and serves (not ready), the start-up sweep leaves GPU 0 to the
    claim's record, the kubelet's unprepare succeeds with the give-back kept and GPU 0 on vfio-pci; once the module
    is loaded GPU 0 goes back to nvidia and ``gpu-0`` is published with its UUID."""
    config = node.config(feature_gates=GATES, healthcheck_port=0)

    async def body() -> None:
        async with running(config) as (_plugin, kubelet):
            uuid0 = published(node)["gpu-0"]["uuid"]
            vm = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([vm]))[vm.uid].error == ""
        node.unload_nvidia_module()
        plugin = await start_plugin(config)  # no exit, no crash loop
        try:
            assert plugin.driver is not None and "Driver Not Loaded" in plugin.driver.reason()
            port = plugin.servers.health_port
            assert port is not None
            function = node.pci_host().function(GPU0)
            assert (function.driver, function.driver_override) == ("vfio-pci", "vfio-pci")
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as emulator:
                kubelet = await emulator.wait_for_plugin("gpu.nvidia.com", timeout=10)
                assert await _status(port, "readiness") == NOT_SERVING
                assert await kubelet.unprepare([vm]) == {vm.uid: ""}
                kept = plugin.state.get(vm.uid)
                assert kept is not None and kept.devices == ()
                assert [r.kind for r in read_payload(kept.payload).undo] == ["vfio"]
                assert driver_of(node) == "vfio-pci"

                node.load_nvidia_module()
                await wait_for(lambda: not plugin.driver.reason(), 30)
                assert plugin.state.get(vm.uid) is None
                function = node.pci_host().function(GPU0)
                assert (function.driver, function.driver_override) == ("nvidia", None)
                await wait_for(lambda: published(node).get("gpu-0", {}).get("uuid") == uuid0, 20)
                assert await _status(port, "readiness") == SERVING
        finally:
            await plugin.stop()

    asyncio.run(body())


def test_a_plugin_started_without_the_driver_keeps_a_vfio_gpu_passed_through_once_it_is_back(
        node: SandboxNode) -> None:
    """The same restart, with the claim still prepared when the driver comes back: GPU 0 stays on vfio-pci,
    ``gpu-vfio-0`` gets its parent from the claim's record and ``gpu-0`` stays withheld; the unprepare after gives
    GPU 0 back to nvidia and ``gpu-0`` is published with its UUID."""
    config = node.config(feature_gates=GATES)

    async def body() -> None:
        async with running(config) as (_plugin, kubelet):
            uuid0 = published(node)["gpu-0"]["uuid"]
            vm = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([vm]))[vm.uid].error == ""
        node.unload_nvidia_module()
        plugin = await start_plugin(config)
        try:
            assert plugin.driver is not None and plugin.driver.reason()
            node.load_nvidia_module()
            await wait_for(lambda: not plugin.driver.reason(), 30)
            assert driver_of(node) == "vfio-pci"
            assert sorted(g.minor for g in plugin.inventory.gpus) == list(range(1, 8))
            [device] = [d for d in plugin.inventory.vfio if d.name == "gpu-vfio-0"]
            assert (device.sibling, device.parent_uuid) == ("gpu-0", node_gpu_uuid(0))
            await wait_for(lambda: plugin.publisher.in_sync and "gpu-1" in published(node), 20)
            assert "gpu-0" not in published(node) and "gpu-vfio-0" in published(node)
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as emulator:
                kubelet = await emulator.wait_for_plugin("gpu.nvidia.com", timeout=10)
                assert await kubelet.unprepare([vm]) == {vm.uid: ""}
                function = node.pci_host().function(GPU0)
                assert (function.driver, function.driver_override) == ("nvidia", None)
                await wait_for(lambda: published(node).get("gpu-0", {}).get("uuid") == uuid0, 20)
        finally:
            await plugin.stop()

    asyncio.run(body())
