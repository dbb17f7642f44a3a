"""Serve the kubelet before the plugin's parts exist: registration and the DRA socket first, claims wait.

Why: the kubelet sees a plugin only once its registration socket exists, and NVIDIA's Go plugin exposes it
~50 ms after process start (issue 17). Loading NVML, discovering devices, connecting to the API server and
opening the claim state take far longer in Python, so :func:`start_early` starts the gRPC servers
(:func:`dradriver.server.sockets.start_servers`, the same servicers) over a :class:`Readiness` that the
composition root completes with :meth:`Readiness.attach` once the batch runner, the health source and the
publisher are running.

What the servers answer meanwhile (nothing is refused that could be answered):
- ``GetInfo``/``NotifyRegistrationStatus``: at once (they need only the driver name and socket paths);
- ``NodePrepareResources``/``NodeUnprepareResources``: an empty request at once (the DRA layer answers it
  without the preparer); otherwise the call waits for readiness within the kubelet's gRPC deadline, then runs
  on the real runner. If the start fails, every waiting and later call gets that failure as each claim's error
  (:mod:`dradriver.server.dra` turns the :class:`PluginStartError` into per-claim errors);
- ``NodeWatchResources``: the stream opens and yields its first snapshot once the health source is attached;
- ``grpc.health.v1`` ``readiness``: NOT_SERVING until attached, then the attached verdict.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dradriver.config import PluginConfig
from dradriver.domain.claims import ClaimRef, ClaimResult
from dradriver.errors import DradriverError
from dradriver.server.healthstream import DeviceHealthStatus, HealthSource
from dradriver.server.sockets import Servers, start_servers

if TYPE_CHECKING:  # the protocol only; importing it loads the domain model (~0.1 s before the sockets)
    from dradriver.domain.ports import ClaimPreparer

__all__ = ["DeferredHealthSource", "DeferredPreparer", "EarlyServers", "PluginStartError", "Readiness",
           "start_early"]


KUBELET_CALL_TIMEOUT_S = 45.0
"""The kubelet's deadline for each DRA call, seconds (``defaultClientCallTimeout``, the kubelet's
``pkg/kubelet/cm/dra/plugin/dra_plugin.go``)."""


class PluginStartError(DradriverError):
    """The plugin's start failed after its sockets were served; the message names the cause."""


class Readiness:
    """The plugin's start as the early servers see it: pending, attached (ready), or failed.

    Create inside the running event loop; :meth:`attach` and :meth:`fail` are called from that loop. The DRA
    server's threads wait with :meth:`wait`, the loop's coroutines with :meth:`health_source`.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._settled = threading.Event()  # the same moment as _event, for the DRA server's worker threads
        self._preparer: ClaimPreparer | None = None
        self._health: HealthSource | None = None
        self._ready: Callable[[], bool] | None = None
        self._error: BaseException | None = None
        self.waiting_for = ""
        """What the start waits for now (e.g. NVLink fabric registration), for the calls that time out; ``""``."""

    @property
    def attached(self) -> bool:
        """The real parts are attached (claims no longer wait)."""
        return self._preparer is not None

    def attach(self, preparer: ClaimPreparer, *, health_source: HealthSource | None = None,
               ready: Callable[[], bool] | None = None) -> None:
        """The plugin's parts are running: hand waiting and later calls to them."""
        self._preparer, self._health, self._ready = preparer, health_source, ready
        self._settled.set()
        self._event.set()

    def fail(self, error: BaseException) -> None:
        """The start failed: waiting and later calls get ``error`` as their claims' error."""
        self._error = error
        self._settled.set()
        self._event.set()

    def ready(self) -> bool:
        """The probe's ``readiness`` verdict: False until attached, then the attached verdict (default True)."""
        if self._preparer is None:
            return False
        return self._ready() if self._ready is not None else True

    def wait(self, timeout_s: float | None = None) -> ClaimPreparer:
        """The attached preparer, once there is one (blocking: for the DRA server's worker threads).

        :raises PluginStartError: the start failed, or did not finish within ``timeout_s`` seconds.
        """
        if self._preparer is None and self._error is None and not self._settled.wait(timeout_s):
            waiting = f", waiting for {self.waiting_for}" if self.waiting_for else ""
            raise PluginStartError(f"the plugin is still starting after {timeout_s:.1f} s (the kubelet's "
                                   f"deadline){waiting}; retry")
        if self._preparer is None:
            raise PluginStartError(f"the plugin failed to start: {self._error}")
        return self._preparer

    async def health_source(self) -> HealthSource:
        """The attached health source.

        :raises PluginStartError: the start failed, or the plugin has no health source.
        """
        await self._event.wait()
        if self._error is not None:
            raise PluginStartError(f"the plugin failed to start: {self._error}")
        if self._health is None:
            raise PluginStartError("the plugin serves no device health")
        return self._health


class DeferredPreparer:
    """A :class:`~dradriver.domain.ports.ClaimPreparer` that waits for :class:`Readiness`, then delegates."""

    def __init__(self, readiness: Readiness) -> None:
        self._readiness = readiness

    def prepare_claims(self, claims: Sequence[ClaimRef], *,
                       deadline_s: float | None = None) -> Mapping[str, ClaimResult]:
        """Prepare on the real runner once it is attached; the wait counts against ``deadline_s``."""
        started = time.monotonic()
        preparer = self._readiness.wait(deadline_s)
        if deadline_s is not None:
            deadline_s = max(0.0, deadline_s - (time.monotonic() - started))
        return preparer.prepare_claims(claims, deadline_s=deadline_s)

    def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare on the real runner once it is attached, waiting for it at most
        :data:`KUBELET_CALL_TIMEOUT_S` (after that the kubelet has given up on the call, and the DRA server's
        thread is free again; the kubelet retries)."""
        return self._readiness.wait(KUBELET_CALL_TIMEOUT_S).unprepare_claims(claims)


class DeferredHealthSource:
    """A :class:`~dradriver.server.healthstream.HealthSource` whose streams start once the real one is attached."""

    def __init__(self, readiness: Readiness) -> None:
        self._readiness = readiness

    def watch(self) -> AsyncIterator[Sequence[DeviceHealthStatus]]:
        """A stream of the attached source's snapshots (nothing is sent before it is attached)."""
        return self._watch()

    async def _watch(self) -> AsyncIterator[Sequence[DeviceHealthStatus]]:
        source = await self._readiness.health_source()
        snapshots = source.watch()
        try:
            async for snapshot in snapshots:
                yield snapshot
        finally:
            aclose: Any = getattr(snapshots, "aclose", None)
            if aclose is not None:
                await aclose()


class EarlyServers:
    """Servers started by :func:`start_early` and the :class:`Readiness` they wait on."""

    def __init__(self, servers: Servers, readiness: Readiness) -> None:
        self.servers = servers
        self.readiness = readiness


async def start_early(config: PluginConfig, *, health_stream: bool = True) -> EarlyServers:
    """Serve the DRA socket, the probe and the registration socket now, over a pending :class:`Readiness`.

    :param health_stream: advertise the health stream (the GPU plugin always serves one; the compute-domain
        plugin none). Same errors as :func:`~dradriver.server.sockets.start_servers`.
    """
    readiness = Readiness()
    servers = await start_servers(config, DeferredPreparer(readiness),
                                  health_source=DeferredHealthSource(readiness) if health_stream else None,
                                  ready=readiness.ready)
    return EarlyServers(servers, readiness)
