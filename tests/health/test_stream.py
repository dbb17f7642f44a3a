"""The kubelet health stream: HealthMonitor as the source of v1alpha1.DRAResourceHealth, read by the kubelet
emulator (a client built from our protos) over a real Unix socket."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dradriver.config import PluginConfig
from dradriver.domain.identity import GPU_DRIVER
from dradriver.health.monitor import HealthMonitor
from dradriver.sandbox.kubelet import DeviceHealthReport, KubeletEmulator
from dradriver.server import start_servers
from tests.factories import vfio_for

from .conftest import MockNode, NullPreparer, Services, TaintLog

pytestmark = pytest.mark.timeout(30)

Snapshot = list[DeviceHealthReport]


def _config(base: Path) -> PluginConfig:
    return PluginConfig(
        node_name="node-a",
        kubelet_registrar_directory_path=base / "registry",
        kubelet_plugins_directory_path=base / "plugins",
        healthcheck_port=-1,
    )


async def _with_stream(base: Path, service: HealthMonitor, body: Callable[[Any], Any]) -> Any:
    servers = await start_servers(_config(base), NullPreparer(), health_source=service)
    try:
        async with KubeletEmulator(base / "registry") as kubelet:
            plugin = await kubelet.wait_for_plugin(GPU_DRIVER.driver_name)
            assert "v1alpha1.DRAResourceHealth" in plugin.supported_versions
            stream = plugin.watch_health()
            try:
                return await body(stream)
            finally:
                await stream.aclose()
    finally:
        await servers.stop()


async def _next_matching(stream: Any, predicate: Callable[[Snapshot], bool]) -> Snapshot:
    async for snapshot in stream:
        if predicate(snapshot):
            return list(snapshot)
    raise AssertionError("health stream ended")


def _by_name(snapshot: Snapshot) -> dict[str, DeviceHealthReport]:
    return {d.device_name: d for d in snapshot}


def test_stream_reports_xid_79_unhealthy_with_a_message_and_recovery(
    mock_node: Any, services: Services, short_dir: Path
) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    published = {d.name for d in node.inventory.allocatable()}

    async def body(stream: Any) -> None:
        first = await anext(stream)
        assert {d.device_name for d in first} == published  # complete list on open
        assert {d.pool_name for d in first} == {"node-a"}
        assert {d.health for d in first} == {"Healthy"}
        node.xid(2, 79)
        unhealthy = await _next_matching(stream, lambda s: _by_name(s)["gpu-2"].health == "Unhealthy")
        report = _by_name(unhealthy)["gpu-2"]
        assert "Xid 79" in report.message and node.gpu_uuid(2) in report.message
        assert report.last_updated > 1_700_000_000
        assert {d.device_name for d in unhealthy} == published
        assert all(d.health == "Healthy" for d in unhealthy if d.device_name != "gpu-2")
        await asyncio.to_thread(service.poll_now)
        healthy = await _next_matching(stream, lambda s: _by_name(s)["gpu-2"].health == "Healthy")
        assert _by_name(healthy)["gpu-2"].message == ""

    asyncio.run(asyncio.wait_for(_with_stream(short_dir, service, body), 20))
    assert log.updates[0] == {"gpu-2": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]}


def test_stream_repeats_the_snapshot_without_changes(mock_node: Any, services: Services, short_dir: Path) -> None:
    node: MockNode = mock_node("l4-inference")
    service = services(node, snapshot_interval_s=0.05, health_timeout_s=45)
    service.start()

    async def body(stream: Any) -> list[Snapshot]:
        return [await anext(stream) for _ in range(3)]

    snapshots = asyncio.run(asyncio.wait_for(_with_stream(short_dir, service, body), 20))
    names = {d.name for d in node.inventory.allocatable()}
    for snapshot in snapshots:
        assert {d.device_name for d in snapshot} == names
        assert {(d.health, d.timeout_seconds) for d in snapshot} == {("Healthy", 45)}


def test_stream_ends_when_the_service_stops(mock_node: Any, services: Services, short_dir: Path) -> None:
    node: MockNode = mock_node("l4-inference")
    service = services(node)
    service.start()

    async def body(stream: Any) -> int:
        await anext(stream)
        await asyncio.to_thread(service.stop)
        return len([s async for s in stream])

    assert asyncio.run(asyncio.wait_for(_with_stream(short_dir, service, body), 20)) <= 1


def test_a_pause_keeps_the_stream_open_and_the_restarted_service_goes_on_on_it(
    mock_node: Any, services: Services, short_dir: Path
) -> None:
    """The GPU plugin pauses the service around each VFIO swap's NVML re-initialisation (``stop(end_streams=False)``):
    the kubelet's stream stays open and the service started again publishes on it; a full stop still ends it."""
    node: MockNode = mock_node("dgx-a100")
    service = services(node, snapshot_interval_s=0.2)
    service.start()

    async def body(stream: Any) -> int:
        await anext(stream)
        await asyncio.to_thread(service.stop, end_streams=False)
        assert not service.running
        paused = await anext(stream)  # the snapshot interval's repeat: still open, the last health
        assert _by_name(paused)["gpu-2"].health == "Healthy"
        await asyncio.to_thread(service.start)
        node.xid(2, 79)  # seen by the restarted service's NVML event monitor, sent on the same stream
        await _next_matching(stream, lambda s: _by_name(s)["gpu-2"].health == "Unhealthy")
        await asyncio.to_thread(service.stop)
        return len([s async for s in stream])

    assert asyncio.run(asyncio.wait_for(_with_stream(short_dir, service, body), 25)) <= 1


def test_vfio_devices_and_a_gpu_passed_through_are_unknown_and_the_gpu_leaves_nvml_polling(
    mock_node: Any, services: Services, short_dir: Path
) -> None:
    node: MockNode = mock_node("l4-inference")
    gpu = node.inventory.gpus[0]
    node.inventory = dataclasses.replace(node.inventory, vfio=vfio_for(gpu))
    service = services(node)
    service.start()
    (vfio,) = node.inventory.vfio
    others = {g.name for g in node.inventory.gpus[1:]}
    sample = service.latest_sample()
    assert sample is not None and gpu.uuid in sample.devices

    async def body(stream: Any) -> None:
        first = _by_name(await anext(stream))
        assert set(first) == {gpu.name, vfio.name} | others
        assert (first[gpu.name].health, first[vfio.name].health) == ("Healthy", "Unknown")
        assert "passed through to a VM (VFIO)" in first[vfio.name].message
        await asyncio.to_thread(service.set_held, {vfio.name})  # its claim prepared: the GPU is on vfio-pci
        passed = _by_name(await _next_matching(stream, lambda s: _by_name(s)[gpu.name].health == "Unknown"))
        assert "passed through to a VM (VFIO)" in passed[gpu.name].message
        assert passed[vfio.name].health == "Unknown"
        await asyncio.to_thread(service.set_held, set())  # unprepared: back on nvidia
        await _next_matching(stream, lambda s: _by_name(s)[gpu.name].health == "Healthy")

    asyncio.run(asyncio.wait_for(_with_stream(short_dir, service, body), 20))


def test_a_gpu_passed_through_is_not_polled_and_gives_no_nvml_errors(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    node.inventory = dataclasses.replace(node.inventory, vfio=vfio_for(*node.inventory.gpus))
    service = services(node)
    service.start()
    vfio = node.inventory.vfio[0]
    assert vfio.parent_uuid is not None
    service.set_held({vfio.name, "gpu-1"})
    sample = service.poll_now()
    assert sample is not None and vfio.parent_uuid not in sample.devices
    assert vfio.parent_uuid not in service.device_uuids and vfio.parent_uuid not in service.gpu_uuids
    assert service.nvml_errors() == {}
    assert [(d.name, passed) for d, passed in service.passthrough()][:2] == [(vfio.name, True),
                                                                            (node.inventory.vfio[1].name, False)]
    service.set_held(set())
    sample = service.poll_now()
    assert sample is not None and vfio.parent_uuid in sample.devices
