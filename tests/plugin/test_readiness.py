"""Ready means published: the probe's ``readiness`` service follows this node's ResourceSlice publication."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dradriver.app import start_plugin
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=5)
        return int(reply.status)


def test_not_ready_while_every_slice_write_is_rejected_then_ready_once_published(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None
    api.fail_next(10_000, status=422, method="POST", path="/apis/resource.k8s.io/v1/resourceslices")

    async def body() -> None:
        plugin = await start_plugin(sandbox.config(healthcheck_port=0))
        try:
            port = plugin.servers.health_port
            assert port is not None
            await wait_for(lambda: plugin.publisher.failures >= 2)
            assert await _status(port, "readiness") == NOT_SERVING  # nothing published: not ready
            assert await _status(port, "liveness") == SERVING  # ... but alive: no restart for an API problem
            api.clear_faults()  # the API server accepts slices again
            await wait_for(lambda: plugin.publisher.in_sync, timeout=30)
            assert await _status(port, "readiness") == SERVING
            assert [s["spec"]["driver"] for s in api.objects("ResourceSlice")] == ["gpu.nvidia.com"]
        finally:
            await plugin.stop()

    asyncio.run(body())
