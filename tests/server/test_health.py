"""The DRA health stream (v1alpha1.DRAResourceHealth) and the grpc.health.v1 probe service."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dradriver.sandbox.kubelet import DeviceHealthReport, KubeletEmulator, KubeletError
from dradriver.server import start_servers

from .conftest import TablePreparer, claims, make_config, run

pytestmark = pytest.mark.timeout(15)


@dataclass(frozen=True)
class Status:
    pool_name: str
    device_name: str
    health: str
    last_updated: int = 1_700_000_000
    timeout_seconds: int = 0
    message: str = ""


class ScriptedSource:
    """A HealthSource that plays fixed snapshots, then waits until the stream is closed."""

    def __init__(self, snapshots: Sequence[Sequence[Status]]) -> None:
        self.snapshots = snapshots
        self.closed = asyncio.Event()
        self.opened = 0

    async def watch(self) -> AsyncIterator[Sequence[Status]]:
        self.opened += 1
        try:
            for snapshot in self.snapshots:
                yield snapshot
            await asyncio.Event().wait()
        finally:
            self.closed.set()


def test_health_stream_delivers_snapshots_to_the_kubelet(short_dir: Path) -> None:
    source = ScriptedSource(
        [
            [Status("node-a", "gpu-0", "Healthy"), Status("node-a", "gpu-1", "Healthy", timeout_seconds=60)],
            [
                Status("node-a", "gpu-0", "Healthy"),
                Status("node-a", "gpu-1", "Unhealthy", message="Xid 79: GPU has fallen off the bus " + "x" * 2000),
                Status("node-a", "gpu-2", "Degraded"),
            ],
        ]
    )

    async def scenario() -> list[list[DeviceHealthReport]]:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer(), health_source=source):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                received: list[list[DeviceHealthReport]] = []
                stream = plugin.watch_health()
                async for snapshot in stream:
                    received.append(snapshot)
                    if len(received) == 2:
                        break
                await stream.aclose()
                await source.closed.wait()  # the plugin side noticed the kubelet leaving
                return received

    first, second = run(scenario())
    assert [(d.device_name, d.health, d.timeout_seconds) for d in first] == [
        ("gpu-0", "Healthy", 0),
        ("gpu-1", "Healthy", 60),
    ]
    assert [(d.device_name, d.health) for d in second] == [
        ("gpu-0", "Healthy"),
        ("gpu-1", "Unhealthy"),
        ("gpu-2", "Unknown"),
    ]
    assert second[1].message.startswith("Xid 79: GPU has fallen off the bus")
    assert len(second[1].message) == 1024
    assert second[0].pool_name == "node-a" and second[0].last_updated == 1_700_000_000


def test_health_stream_unimplemented_without_a_source(short_dir: Path) -> None:
    async def scenario() -> None:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer()):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                assert "v1alpha1.DRAResourceHealth" not in plugin.supported_versions
                with pytest.raises(KubeletError) as info:
                    async for _ in plugin.watch_health():
                        pass
                assert info.value.code == "UNIMPLEMENTED"

    run(scenario())


@pytest.mark.parametrize("failure", [RuntimeError("NVML event set lost"), TimeoutError("NVML event wait")])
def test_failing_source_ends_the_stream_with_unavailable(short_dir: Path, failure: Exception) -> None:
    """Any exception of the source ends the stream, a TimeoutError too (not taken for the stream's own wait)."""

    class Broken:
        async def watch(self) -> AsyncIterator[Sequence[Status]]:
            yield [Status("node-a", "gpu-0", "Healthy")]
            raise failure

    async def scenario() -> None:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer(), health_source=Broken()):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                received = []
                with pytest.raises(KubeletError) as info:
                    async for snapshot in plugin.watch_health():
                        received.append(snapshot)
                assert info.value.code == "UNAVAILABLE"
                assert len(received) == 1
                assert (await plugin.get_info()).name == "gpu.nvidia.com"  # the plugin lives on

    run(scenario())


def test_grpc_health_probe_on_tcp(short_dir: Path) -> None:
    async def scenario() -> None:
        config = make_config(short_dir, healthcheck_port=0)
        servers = await start_servers(config, TablePreparer())
        assert servers.health_port is not None and servers.health_port > 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", "pluginregistration.Registration"):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=2)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await servers.stop()

    run(scenario())


def test_probe_disabled_by_default(short_dir: Path) -> None:
    async def scenario() -> int | None:
        async with await start_servers(make_config(short_dir), TablePreparer()) as servers:
            return servers.health_port

    assert run(scenario()) is None


def test_liveness_fails_when_the_plugin_stops_answering(short_dir: Path) -> None:
    """``""``/``liveness`` checks GetInfo and an empty NodePrepareResources end to end (NVIDIA's semantics)."""

    async def scenario() -> None:
        config = make_config(short_dir, healthcheck_port=0)
        servers = await start_servers(config, TablePreparer())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.health_port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in ("", "liveness"):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                # The DRA server goes away while the probe server stays: liveness must notice.
                assert servers._dra_server is not None
                await asyncio.to_thread(servers._dra_server.stop(0).wait)
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await servers.stop()

    run(scenario())


@pytest.mark.timeout(40)
def test_liveness_stays_serving_while_every_pod_of_a_node_waits_in_a_prepare(short_dir: Path) -> None:
    """Each NodePrepareResources holds a DRA server thread until its answer (a compute-domain claim may wait for its
    IMEX daemon for most of the kubelet's deadline). With a call in flight for each of 120 pods (more than the
    kubelet's default 110 pods a node), the liveness probe's empty call still gets a worker, so waiting claims never
    get the plugin restarted; released, every call answers."""

    async def scenario() -> None:
        config = make_config(short_dir, healthcheck_port=0)
        gate = threading.Event()
        preparer = TablePreparer(gate=gate)
        servers = await start_servers(config, preparer)
        try:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
                pending = [asyncio.ensure_future(plugin.prepare(claims(f"pod-{i}"))) for i in range(120)]
                while len(preparer.prepared) < len(pending):
                    await asyncio.sleep(0.02)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.health_port}") as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                assert not any(p.done() for p in pending)
                gate.set()
                answers = await asyncio.gather(*pending)
                assert all(answer[f"pod-{i}"].ok for i, answer in enumerate(answers))
        finally:
            gate.set()
            await servers.stop()

    run(scenario(), timeout=30)
