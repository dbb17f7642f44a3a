"""The kubelet's DRA device-health stream: ``v1alpha1.DRAResourceHealth/NodeWatchResources``.

KEP-4680, ``pkg/apis/dra-health/v1alpha1/api.proto`` in kubernetes/kubelet: a server stream in which every message holds
the complete list of the driver's devices. The kubelet marks a device Unknown when it has not been re-reported within
its timeout (30 s by default), so the source must send a snapshot on open, on every change, and periodically. This
module only encodes; what is healthy is decided by whatever implements :class:`HealthSource` (the health monitor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from dradriver._proto import dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

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


STREAM_POLL_S = 1.0
"""How often, seconds, a stream waiting for its next snapshot checks that the kubelet is still there and that the
event loop still runs (a cancelled stream is also woken at once by its gRPC callback)."""


class DRAResourceHealthServicer(dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    """``v1alpha1.DRAResourceHealth``: streams :class:`HealthSource` snapshots to the kubelet.

    The DRA server is synchronous (:mod:`dradriver.server.sockets`): a stream holds one of its worker threads,
    which asks the event loop ``loop`` (where the source's async iterator lives) for each next snapshot and
    sends it, so the source is read no faster than the kubelet takes the messages. The iterator is opened, read
    and closed on ``loop``. A failing source ends the stream with ``UNAVAILABLE``; kubelets 1.34-1.36 reopen it
    every 5 s.
    """

    def __init__(self, source: HealthSource, loop: asyncio.AbstractEventLoop) -> None:
        self._source = source
        self._loop = loop

    def NodeWatchResources(
        self, request: dra_health_v1alpha1_pb2.NodeWatchResourcesRequest, context: Any
    ) -> Iterator[dra_health_v1alpha1_pb2.NodeWatchResourcesResponse]:
        pending: list[concurrent.futures.Future[Any]] = []

        def cancel() -> None:  # gRPC calls it when the stream ends (the kubelet left, or the server stops)
            for future in pending:
                future.cancel()

        context.add_callback(cancel)
        snapshots: AsyncIterator[Sequence[DeviceHealthStatus]] | None = None
        try:
            snapshots = self._on_loop(self._open(), context, pending)
            while snapshots is not None:
                snapshot = self._on_loop(_next(snapshots), context, pending)
                if snapshot is None:
                    return
                yield encode_snapshot(snapshot)
        except Exception:
            log.exception("device health source failed; ending the kubelet's health stream")
            context.abort(grpc.StatusCode.UNAVAILABLE, "device health source failed; see the plugin log")
        finally:
            aclose = getattr(snapshots, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(aclose(), self._loop).result(STREAM_POLL_S)

    async def _open(self) -> AsyncIterator[Sequence[DeviceHealthStatus]]:
        return self._source.watch()

    def _on_loop(self, coroutine: Coroutine[Any, Any, T], context: Any,
                 pending: list[concurrent.futures.Future[Any]]) -> T | None:
        """Run ``coroutine`` on the event loop and wait for it; ``None`` when the stream ended meanwhile (the
        kubelet cancelled it, the server stopped, or the loop is gone) or the source has no more snapshots."""
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError:  # the loop is closed: the plugin is going away
            coroutine.close()
            return None
        pending[:] = [future]
        try:
            while True:
                try:
                    return future.result(STREAM_POLL_S)
                except concurrent.futures.TimeoutError:
                    if future.done():  # the source itself raised TimeoutError: a failure, not our wait
                        raise
                    if not context.is_active() or self._loop.is_closed():
                        future.cancel()
                        return None
        except (concurrent.futures.CancelledError, StopAsyncIteration):
            return None
        finally:
            pending.clear()


async def _next(snapshots: AsyncIterator[T]) -> T:
    return await anext(snapshots)
