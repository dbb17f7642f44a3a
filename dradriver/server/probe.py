"""The ``grpc.health.v1.Health`` probe on a TCP port (``HEALTHCHECK_PORT``) for the DaemonSet's gRPC liveness
and readiness probes, from the ``grpcio-health-checking`` package; its liveness check proves the plugin answers
end to end (NVIDIA's ``cmd/*-kubelet-plugin/health.go``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2

from dradriver._proto import dra_v1_pb2, dra_v1_pb2_grpc, pluginregistration_v1_pb2, pluginregistration_v1_pb2_grpc

log = logging.getLogger(__name__)


READINESS_SERVICE = "readiness"
"""Service name whose Check reports whether this node's ResourceSlices are published (the readinessProbe)."""

LIVENESS_SERVICES = ("", "liveness")
"""Service names whose Check runs the end-to-end check (``liveness`` is the name NVIDIA's plugin answers)."""


class LivenessServicer(grpc_health.aio.HealthServicer):
    """``grpc.health.v1`` whose Check for ``""``/``liveness`` proves the plugin works end to end.

    Like NVIDIA's plugin (NVIDIA's ``cmd/*-kubelet-plugin/health.go``): SERVING only if ``GetInfo`` answers on the
    registration socket and an empty ``NodePrepareResources`` answers on the DRA socket, each within ``timeout_s``
    seconds, so a wedged event loop (the registration server), a DRA server whose every worker is stuck (the empty call
    queues) or a lost socket fails the kubelet's liveness probe. Other registered service names
    report their stored status; graceful shutdown reports NOT_SERVING.
    """

    def __init__(self, *, registration_socket: str, dra_socket: str, timeout_s: float = 1.0,
                 ready: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._targets = (f"unix://{registration_socket}", f"unix://{dra_socket}")
        self._timeout_s = timeout_s
        self._ready = ready

    async def Check(self, request: Any, context: Any) -> Any:
        response = await super().Check(request, context)
        if request.service == READINESS_SERVICE and response.status == health_pb2.HealthCheckResponse.SERVING:
            ready = self._ready() if self._ready is not None else True
            if not ready:
                return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
            return response
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
    service_names: Sequence[str] = (), *, registration_socket: str, dra_socket: str,
    ready: Callable[[], bool] | None = None,
) -> LivenessServicer:
    """A ``grpc.health.v1.Health`` servicer: ``""`` and ``liveness`` run the end-to-end check
    (:class:`LivenessServicer`); ``readiness`` reports SERVING only while ``ready()`` is true (this node's
    ResourceSlices are published and the newest sync succeeded); each of ``service_names`` reports SERVING.

    Call ``await servicer.enter_graceful_shutdown()`` before stopping, so probes see NOT_SERVING.
    """
    servicer = LivenessServicer(registration_socket=registration_socket, dra_socket=dra_socket, ready=ready)
    for name in (*LIVENESS_SERVICES, READINESS_SERVICE, *service_names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer
