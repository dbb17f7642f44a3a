"""Health over gRPC: the kubelet's DRA device-health stream and the standard ``grpc.health.v1`` probe.

* ``v1alpha1.DRAResourceHealth/NodeWatchResources`` (KEP-4680, kubelet-dra-protocol.md section 3):
  a server stream in which every message holds the complete list of the driver's devices. The kubelet
  marks a device Unknown when it has not been re-reported within its timeout (30 s by default), so the
  source must send a snapshot on open, on every change, and periodically. This module only encodes;
  what is healthy is decided by whatever implements :class:`HealthSource` (the health monitor).
* ``grpc.health.v1.Health`` on a TCP port (``HEALTHCHECK_PORT``) for the DaemonSet's gRPC liveness and
  readiness probes, from the ``grpcio-health-checking`` package.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2

from dradriver._proto import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1024
"""``DeviceHealth.message`` limit; the kubelet truncates longer text (section 3.1)."""

_HEALTH_VALUES = {
    "Healthy": dra_health_v1alpha1_pb2.HEALTHY,
    "Unhealthy": dra_health_v1alpha1_pb2.UNHEALTHY,
    "Unknown": dra_health_v1alpha1_pb2.UNKNOWN,
}


class DeviceHealthStatus(Protocol):
    """The health of one device as the stream reports it (read-only attributes).

    :ivar pool_name: ResourceSlice pool of the device.
    :ivar device_name: device name within the pool, e.g. ``gpu-0``.
    :ivar health: ``"Healthy"``, ``"Unhealthy"`` or ``"Unknown"`` (core/v1 ``ResourceHealthStatus`` values).
    :ivar last_updated: Unix time in seconds when the status was determined.
    :ivar timeout_seconds: kubelet staleness timeout for this device; ``0`` means the kubelet default.
    :ivar message: detail for people (truncated to 1024 characters on the wire).
    """

    @property
    def pool_name(self) -> str: ...
    @property
    def device_name(self) -> str: ...
    @property
    def health(self) -> str: ...
    @property
    def last_updated(self) -> int: ...
    @property
    def timeout_seconds(self) -> int: ...
    @property
    def message(self) -> str: ...


class HealthSource(Protocol):
    """Where the health stream gets its snapshots; implemented by the health monitor.

    ``watch()`` is called once per kubelet stream and returns a fresh async iterator of snapshots, each
    the complete list of the driver's devices: one at once, then on every change and at least every
    few seconds (well inside the kubelet's 30 s staleness window). The iterator is closed when the
    kubelet goes away.
    """

    def watch(self) -> AsyncIterator[Sequence[DeviceHealthStatus]]: ...


def encode_snapshot(
    snapshot: Sequence[DeviceHealthStatus],
) -> dra_health_v1alpha1_pb2.NodeWatchResourcesResponse:
    """One ``NodeWatchResourcesResponse`` for a snapshot; an unknown health word is sent as ``UNKNOWN``."""
    response = dra_health_v1alpha1_pb2.NodeWatchResourcesResponse()
    for status in snapshot:
        health = _HEALTH_VALUES.get(status.health)
        if health is None:
            log.warning(
                "device %s/%s: unknown health %r sent as UNKNOWN",
                status.pool_name,
                status.device_name,
                status.health,
            )
            health = dra_health_v1alpha1_pb2.UNKNOWN
        response.devices.add(
            device=dra_health_v1alpha1_pb2.DeviceIdentifier(
                pool_name=status.pool_name, device_name=status.device_name
            ),
            health=health,
            last_updated_time=int(status.last_updated),
            health_check_timeout_seconds=max(0, int(status.timeout_seconds)),
            message=status.message[:MAX_MESSAGE_CHARS],
        )
    return response


class DRAResourceHealthServicer(dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    """``v1alpha1.DRAResourceHealth``: streams :class:`HealthSource` snapshots to the kubelet.

    A failing source ends the stream with ``UNAVAILABLE``; kubelets 1.34-1.36 reopen it every 5 s.
    """

    def __init__(self, source: HealthSource) -> None:
        self._source = source

    async def NodeWatchResources(
        self, request: dra_health_v1alpha1_pb2.NodeWatchResourcesRequest, context: Any
    ) -> AsyncIterator[dra_health_v1alpha1_pb2.NodeWatchResourcesResponse]:
        snapshots = self._source.watch()
        try:
            async for snapshot in snapshots:
                yield encode_snapshot(snapshot)
        except Exception:
            log.exception("device health source failed; ending the kubelet's health stream")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "device health source failed; see the plugin log"
            )
        finally:
            aclose = getattr(snapshots, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


LIVENESS_SERVICES = ("", "liveness")
"""Service names whose Check runs the end-to-end check (``liveness`` is the name NVIDIA's plugin answers)."""


class LivenessServicer(grpc_health.aio.HealthServicer):
    """``grpc.health.v1`` whose Check for ``""``/``liveness`` proves the plugin works end to end.

    Like NVIDIA's plugin (``nvidia-dra-driver.md`` 6.2): SERVING only if ``GetInfo`` answers on the registration
    socket and an empty ``NodePrepareResources`` answers on the DRA socket, each within ``timeout_s`` seconds, so
    a wedged event loop or a lost socket fails the kubelet's liveness probe. Other registered service names
    report their stored status; graceful shutdown reports NOT_SERVING.
    """

    def __init__(self, *, registration_socket: str, dra_socket: str, timeout_s: float = 1.0) -> None:
        super().__init__()
        self._targets = (f"unix://{registration_socket}", f"unix://{dra_socket}")
        self._timeout_s = timeout_s

    async def Check(self, request: Any, context: Any) -> Any:
        response = await super().Check(request, context)
        if request.service not in LIVENESS_SERVICES or response.status != health_pb2.HealthCheckResponse.SERVING:
            return response
        ok = await self.check_end_to_end()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def check_end_to_end(self) -> bool:
        """GetInfo on the registration socket and an empty NodePrepareResources on the DRA socket."""
        registration_target, dra_target = self._targets
        try:
            async with grpc.aio.insecure_channel(registration_target) as channel:
                stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)
                await stub.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=self._timeout_s)
            async with grpc.aio.insecure_channel(dra_target) as channel:
                dra_stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
                await dra_stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=self._timeout_s)
        except grpc.RpcError as exc:
            log.warning("liveness check failed: %s", exc)
            return False
        return True


async def create_probe_servicer(
    service_names: Sequence[str] = (), *, registration_socket: str, dra_socket: str
) -> LivenessServicer:
    """A ``grpc.health.v1.Health`` servicer: ``""`` and ``liveness`` run the end-to-end check
    (:class:`LivenessServicer`); each of ``service_names`` reports SERVING.

    Call ``await servicer.enter_graceful_shutdown()`` before stopping, so probes see NOT_SERVING.
    """
    servicer = LivenessServicer(registration_socket=registration_socket, dra_socket=dra_socket)
    for name in (*LIVENESS_SERVICES, *service_names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer
