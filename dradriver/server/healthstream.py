"""The kubelet's DRA device-health stream: ``v1alpha1.DRAResourceHealth/NodeWatchResources``.

KEP-4680, ``kubelet-dra-protocol.md`` section 3: a server stream in which every message holds the complete list
of the driver's devices. The kubelet marks a device Unknown when it has not been re-reported within its timeout
(30 s by default), so the source must send a snapshot on open, on every change, and periodically. This module
only encodes; what is healthy is decided by whatever implements :class:`HealthSource` (the health monitor).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc

from dradriver._proto import dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc

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
