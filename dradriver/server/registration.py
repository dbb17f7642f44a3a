"""The kubelet plugin registration service (``pluginregistration.Registration``).

The kubelet finds our registration socket in its registrar directory, calls ``GetInfo`` with a 1 s
deadline, validates the answer, and reports its verdict through ``NotifyRegistrationStatus``. Newer
kubelets re-send ``GetInfo`` every 10 s and deregister a plugin after two failures, so this servicer
answers from a precomputed message and never waits on anything (the kubelet's
``pkg/kubelet/pluginmanager/pluginwatcher/monitor.go`` and ``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from dradriver._proto import pluginregistration_v1_pb2, pluginregistration_v1_pb2_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
"""``PluginInfo.type`` of a DRA driver (kubelet ``pluginregistration/v1`` constant ``DRAPlugin``)."""

DRA_SERVICES: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""DRA node services we serve, in preference order; kubelet 1.34+ picks the first it knows (section 1.4)."""

HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
"""Service identifier of the DRA health stream; advertised only when it is served (section 3.3)."""

StatusCallback = Callable[["RegistrationStatus"], "Awaitable[None] | None"]


@dataclass(frozen=True, slots=True)
class RegistrationStatus:
    """The kubelet's verdict from ``NotifyRegistrationStatus``.

    :param registered: ``plugin_registered``; true when the kubelet accepted the plugin.
    :param error: the kubelet's reason when it refused; empty on success.
    """

    registered: bool
    error: str = ""


def supported_versions(*, with_health: bool) -> tuple[str, ...]:
    """``PluginInfo.supported_versions``: ``v1.DRAPlugin``, ``v1beta1.DRAPlugin`` [, the health service]."""
    return (*DRA_SERVICES, HEALTH_SERVICE) if with_health else DRA_SERVICES


class RegistrationServicer(pluginregistration_v1_pb2_grpc.RegistrationServicer):
    """Answers the kubelet's ``GetInfo`` and records its ``NotifyRegistrationStatus``.

    :param driver_name: ``PluginInfo.name``; must equal ``spec.driver`` of our ResourceSlices.
    :param endpoint: absolute path of the DRA socket (``PluginInfo.endpoint``).
    :param versions: ``PluginInfo.supported_versions``, see :func:`supported_versions`.
    :param on_status: called (and awaited if it returns an awaitable) with every verdict. If it raises,
        the RPC fails with ``INTERNAL`` so that a kubelet 1.36+ rolls the registration back and retries.
    :raises ValueError: ``endpoint`` is relative or ``versions`` is empty (the kubelet would refuse both).
    """

    def __init__(
        self,
        *,
        driver_name: str,
        endpoint: Path,
        versions: Sequence[str],
        on_status: StatusCallback | None = None,
    ) -> None:
        if not endpoint.is_absolute():
            raise ValueError(f"DRA endpoint must be an absolute socket path, got {str(endpoint)!r}")
        if not versions:
            raise ValueError("supported_versions must not be empty (the kubelet rejects an empty list)")
        self._info = pluginregistration_v1_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=driver_name, endpoint=str(endpoint), supported_versions=list(versions)
        )
        self._on_status = on_status
        self._changed = asyncio.Event()
        self.status: RegistrationStatus | None = None
        """The latest verdict, ``None`` until the kubelet has sent one."""

    @property
    def info(self) -> pluginregistration_v1_pb2.PluginInfo:
        """The ``PluginInfo`` answered to every ``GetInfo`` (a copy)."""
        copy = pluginregistration_v1_pb2.PluginInfo()
        copy.CopyFrom(self._info)
        return copy

    async def wait_status(self) -> RegistrationStatus:
        """Wait until the kubelet has sent a verdict; returns the latest one (no timeout of its own)."""
        while self.status is None:
            self._changed.clear()
            await self._changed.wait()
        return self.status

    async def GetInfo(
        self, request: pluginregistration_v1_pb2.InfoRequest, context: Any
    ) -> pluginregistration_v1_pb2.PluginInfo:
        return self._info

    async def NotifyRegistrationStatus(
        self, request: pluginregistration_v1_pb2.RegistrationStatus, context: Any
    ) -> pluginregistration_v1_pb2.RegistrationStatusResponse:
        status = RegistrationStatus(registered=request.plugin_registered, error=request.error)
        self.status = status
        self._changed.set()
        if status.registered:
            log.info("kubelet registered DRA plugin %s (endpoint %s)", self._info.name, self._info.endpoint)
        else:
            log.error(
                "kubelet refused to register DRA plugin %s: %s",
                self._info.name,
                status.error or "(no reason)",
            )
        if self._on_status is not None:
            try:
                result = self._on_status(status)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("registration status callback failed")
                await context.abort(
                    grpc.StatusCode.INTERNAL, "plugin failed to process the registration status"
                )
        return pluginregistration_v1_pb2.RegistrationStatusResponse()
