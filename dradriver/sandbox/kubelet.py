"""A kubelet emulator: the kubelet's side of plugin registration and the DRA node API, over real sockets.

Built from our own protos, it does what kubelet 1.34+ does with a DRA plugin (the kubelet's
``pkg/kubelet/pluginmanager/``, ``pkg/kubelet/cm/dra/manager.go`` and ``pkg/kubelet/cm/dra/plugin/``), so tests and
``dradriver demo`` exercise the plugin through the same Unix sockets, gRPC paths and validation rules as a real node:

1. find sockets in the registrar directory (any socket file whose name does not start with ``.``,
   subdirectories included; :meth:`KubeletEmulator.scan` polls, there is no inotify);
2. ``GetInfo`` with a 1 s deadline; type must be ``DRAPlugin``; the DRA service is the **first** entry of
   the plugin's ``supported_versions`` that the kubelet knows (``v1.DRAPlugin``, ``v1beta1.DRAPlugin``);
   an empty endpoint means the registration socket; an endpoint already registered for the driver is
   refused;
3. ``NotifyRegistrationStatus`` with the verdict (5 s deadline); refused plugins get ``false`` and the
   reason;
4. then :meth:`PluginConnection.prepare` / :meth:`PluginConnection.unprepare` (45 s deadline, the
   kubelet's; a response with a missing or an unexpected claim UID is an error, as in the kubelet) and
   :meth:`PluginConnection.watch_health`. With several instances of one driver (rolling update),
   :meth:`KubeletEmulator.plugin` returns the most recently registered one, as the kubelet prefers.

Two APIs with the same methods:

* :class:`KubeletEmulator` — asyncio; use it when the plugin runs in the same event loop::

      async with KubeletEmulator(registrar_dir) as kubelet:
          plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
          results = await plugin.prepare([ClaimRef("default", "claim", "uid-1")])

* :class:`SyncKubeletEmulator` — blocking; runs the asyncio emulator on a private loop in a thread, for
  a plugin in another process or thread::

      with SyncKubeletEmulator(registrar_dir) as kubelet:
          plugin = kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)
          results = plugin.prepare([ClaimRef("default", "claim", "uid-1")])
"""

from __future__ import annotations

import asyncio
import itertools
import os
import stat
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, TypeVar

import grpc

from dradriver._proto import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from dradriver.domain.claims import ClaimRef, ClaimResult, PreparedDevice
from dradriver.domain.faults import DeviceHealthReport
from dradriver.errors import DradriverError

T = TypeVar("T")

DRA_PLUGIN_TYPE = "DRAPlugin"
KUBELET_DRA_SERVICES: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""``servicesSupportedByKubelet`` of kubelet 1.34+ (``pkg/kubelet/cm/dra/plugin/dra_plugin.go``)."""

GET_INFO_TIMEOUT = 1.0
"""Seconds; the kubelet's ``GetInfo`` deadline."""
NOTIFY_TIMEOUT = 5.0
"""Seconds; the kubelet's ``NotifyRegistrationStatus`` deadline."""
CALL_TIMEOUT = 45.0
"""Seconds; the kubelet's deadline for NodePrepareResources / NodeUnprepareResources."""

_STUBS: dict[str, tuple[ModuleType, Any]] = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginStub),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginStub),
}
_HEALTH_WORDS = {
    dra_health_v1alpha1_pb2.HEALTHY: "Healthy",
    dra_health_v1alpha1_pb2.UNHEALTHY: "Unhealthy",
}


class KubeletError(DradriverError):
    """What the kubelet would report: a refused registration, a failed call, or a malformed answer.

    :ivar code: the gRPC status code name (e.g. ``"DEADLINE_EXCEEDED"``) when a call failed, else ``""``.
    """

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def _call_error(what: str, exc: grpc.RpcError) -> KubeletError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    return KubeletError(f"{what} failed: {name}: {details}", code=name)


@dataclass(slots=True)
class PluginConnection:
    """A registered plugin instance and the kubelet's channel to its DRA endpoint.

    :ivar service: the DRA service chosen at registration, ``"v1.DRAPlugin"`` or ``"v1beta1.DRAPlugin"``.
    """

    name: str
    endpoint: str
    service: str
    supported_versions: tuple[str, ...]
    registration_socket: Path
    sequence: int
    _channel: Any = field(default=None, repr=False)

    def _stub(self, service: str | None = None) -> tuple[ModuleType, Any]:
        if self._channel is None:
            raise KubeletError(f"plugin {self.name} at {self.endpoint} is closed")
        pb2, stub = _STUBS[service or self.service]
        return pb2, stub(self._channel)

    async def prepare(
        self, claims: Sequence[ClaimRef], *, service: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> dict[str, ClaimResult]:
        """``NodePrepareResources`` for ``claims``; returns claim UID -> result (per-claim errors included).

        :param service: override the negotiated DRA service (``"v1.DRAPlugin"``/``"v1beta1.DRAPlugin"``).
        :raises KubeletError: the call failed, or the answer misses or adds claim UIDs.
        """
        pb2, stub = self._stub(service)
        request = pb2.NodePrepareResourcesRequest(
            claims=[pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        try:
            response = await stub.NodePrepareResources(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _call_error("NodePrepareResources", exc) from exc
        _check_uids("NodePrepareResources", claims, response.claims)
        return {uid: _decode_prepared(entry) for uid, entry in response.claims.items()}

    async def unprepare(
        self, claims: Sequence[ClaimRef], *, service: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> dict[str, str]:
        """``NodeUnprepareResources`` for ``claims``; returns claim UID -> error string (empty: success).

        :raises KubeletError: the call failed, or the answer misses or adds claim UIDs.
        """
        pb2, stub = self._stub(service)
        request = pb2.NodeUnprepareResourcesRequest(
            claims=[pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        try:
            response = await stub.NodeUnprepareResources(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _call_error("NodeUnprepareResources", exc) from exc
        _check_uids("NodeUnprepareResources", claims, response.claims)
        return {uid: entry.error for uid, entry in response.claims.items()}

    async def watch_health(self) -> AsyncGenerator[list[DeviceHealthReport], None]:
        """Open ``v1alpha1.DRAResourceHealth/NodeWatchResources``; yields each message's device list.

        Closing the iterator (``aclose()`` or leaving ``async for``) cancels the stream.

        :raises KubeletError: the stream failed (``code`` ``"UNIMPLEMENTED"`` when not served).
        """
        if self._channel is None:
            raise KubeletError(f"plugin {self.name} at {self.endpoint} is closed")
        stub = dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub(self._channel)
        call = stub.NodeWatchResources(dra_health_v1alpha1_pb2.NodeWatchResourcesRequest())
        try:
            async for response in call:
                yield [
                    DeviceHealthReport(
                        pool_name=d.device.pool_name,
                        device_name=d.device.device_name,
                        health=_HEALTH_WORDS.get(d.health, "Unknown"),
                        last_updated=d.last_updated_time,
                        timeout_seconds=d.health_check_timeout_seconds,
                        message=d.message,
                    )
                    for d in response.devices
                ]
        except grpc.RpcError as exc:
            raise _call_error("NodeWatchResources", exc) from exc
        finally:
            call.cancel()

    async def get_info(self, *, timeout: float = GET_INFO_TIMEOUT) -> pluginregistration_v1_pb2.PluginInfo:
        """``GetInfo`` on the registration socket again, as the kubelet's connection monitor does."""
        return await _get_info(self.registration_socket, timeout=timeout)

    async def close(self) -> None:
        """Close the channel to the DRA endpoint."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()


def _check_uids(what: str, claims: Sequence[ClaimRef], answered: Any) -> None:
    requested = {c.uid for c in claims}
    unknown = sorted(set(answered) - requested)
    if unknown:
        raise KubeletError(f"{what} returned result for unknown claim UID(s) {unknown}")
    skipped = requested - set(answered)
    if skipped:
        raise KubeletError(f"{what} skipped {len(skipped)} ResourceClaims: {sorted(skipped)}")


def _decode_prepared(entry: Any) -> ClaimResult:
    if entry.error:
        return ClaimResult(error=entry.error)
    devices = tuple(
        PreparedDevice(
            request_names=tuple(d.request_names),
            pool_name=d.pool_name,
            device_name=d.device_name,
            cdi_device_ids=tuple(d.cdi_device_ids),
            share_id=d.share_id
            if "share_id" in d.DESCRIPTOR.fields_by_name and d.HasField("share_id")
            else None,
        )
        for d in entry.devices
    )
    return ClaimResult(devices=devices)


async def _get_info(socket_path: Path, *, timeout: float) -> pluginregistration_v1_pb2.PluginInfo:
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)
        try:
            info: pluginregistration_v1_pb2.PluginInfo = await stub.GetInfo(
                pluginregistration_v1_pb2.InfoRequest(), timeout=timeout
            )
        except grpc.RpcError as exc:
            raise _call_error(f"GetInfo on {socket_path}", exc) from exc
        return info


async def _notify(socket_path: Path, *, registered: bool, error: str = "") -> None:
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)
        try:
            await stub.NotifyRegistrationStatus(
                pluginregistration_v1_pb2.RegistrationStatus(plugin_registered=registered, error=error),
                timeout=NOTIFY_TIMEOUT,
            )
        except grpc.RpcError as exc:
            raise _call_error(f"NotifyRegistrationStatus on {socket_path}", exc) from exc


def _socket_files(directory: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            path = Path(root, name)
            try:
                if stat.S_ISSOCK(path.lstat().st_mode):
                    yield path
            except FileNotFoundError:
                continue


class KubeletEmulator:
    """The kubelet's plugin watcher and DRA plugin manager (asyncio API; see the module docstring).

    :param registrar_dir: the directory the kubelet watches (``plugins_registry``); created if missing.
    :param kubelet_services: DRA services this emulated kubelet knows (default: 1.34+).

    :ivar failures: registration socket -> the reason it was refused (cleared when it registers).
    """

    def __init__(
        self, registrar_dir: Path, *, kubelet_services: Sequence[str] = KUBELET_DRA_SERVICES
    ) -> None:
        self.registrar_dir = Path(registrar_dir)
        self.kubelet_services = tuple(kubelet_services)
        self.failures: dict[Path, str] = {}
        self._plugins: dict[Path, PluginConnection] = {}
        self._seen: dict[Path, tuple[int, int]] = {}
        self._sequence = itertools.count(1)

    async def __aenter__(self) -> KubeletEmulator:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def instances(self, driver_name: str) -> list[PluginConnection]:
        """Registered instances of ``driver_name``, oldest first."""
        return sorted((p for p in self._plugins.values() if p.name == driver_name), key=lambda p: p.sequence)

    def plugin(self, driver_name: str) -> PluginConnection:
        """The instance the kubelet would call: the most recently registered one.

        :raises KubeletError: ``DRA driver <name> is not registered`` (the kubelet's pod error).
        """
        instances = self.instances(driver_name)
        if not instances:
            raise KubeletError(f"DRA driver {driver_name} is not registered")
        return instances[-1]

    async def register(self, socket_path: Path) -> PluginConnection:
        """Run the kubelet's registration sequence against one registration socket.

        :raises KubeletError: ``GetInfo`` failed, the plugin was refused (after telling it so), or the
            ``NotifyRegistrationStatus`` call failed (the registration is then rolled back).
        """
        socket_path = Path(socket_path)
        info = await _get_info(socket_path, timeout=GET_INFO_TIMEOUT)
        try:
            connection = self._validate(socket_path, info)
        except KubeletError as exc:
            await _notify(socket_path, registered=False, error=str(exc))
            raise
        connection._channel = grpc.aio.insecure_channel(f"unix:{connection.endpoint}")
        try:
            await _notify(socket_path, registered=True)
        except KubeletError:
            await connection.close()
            raise
        old = self._plugins.pop(socket_path, None)
        if old is not None:
            await old.close()
        self._plugins[socket_path] = connection
        self.failures.pop(socket_path, None)
        return connection

    def _validate(self, socket_path: Path, info: pluginregistration_v1_pb2.PluginInfo) -> PluginConnection:
        if info.type != DRA_PLUGIN_TYPE:
            raise KubeletError(f"no handler registered for plugin type: {info.type} at socket {socket_path}")
        if not info.name:
            raise KubeletError(f"plugin at {socket_path} has an empty name")
        versions = tuple(info.supported_versions)
        if not versions:
            raise KubeletError(f"plugin {info.name}: empty list of supported gRPC services")
        service = next((v for v in versions if v in self.kubelet_services), None)
        if service is None:
            raise KubeletError(
                f"plugin {info.name}: none of services supported by the plugin {list(versions)} "
                f"are supported by the kubelet {list(self.kubelet_services)}"
            )
        endpoint = info.endpoint or str(socket_path)
        for other_path, other in self._plugins.items():
            if other.name == info.name and other.endpoint == endpoint and other_path != socket_path:
                raise KubeletError(f"plugin {info.name}: endpoint {endpoint} is already registered")
        return PluginConnection(
            name=info.name,
            endpoint=endpoint,
            service=service,
            supported_versions=versions,
            registration_socket=socket_path,
            sequence=next(self._sequence),
        )

    async def scan(self) -> list[PluginConnection]:
        """One pass of the plugin watcher: register new or re-created sockets, drop removed ones.

        Returns the instances registered in this pass; refusals are recorded in :attr:`failures`.
        """
        present: dict[Path, tuple[int, int]] = {}
        if self.registrar_dir.is_dir():
            for path in _socket_files(self.registrar_dir):
                try:
                    info = path.lstat()
                except FileNotFoundError:
                    continue
                present[path] = (info.st_ino, info.st_mtime_ns)
        for path in [p for p in self._plugins if p not in present]:
            await self._plugins.pop(path).close()
        for path in [p for p in self._seen if p not in present]:
            del self._seen[path]
        registered: list[PluginConnection] = []
        for path, identity in sorted(present.items()):
            if self._seen.get(path) == identity:
                continue
            self._seen[path] = identity
            try:
                registered.append(await self.register(path))
            except KubeletError as exc:
                self.failures[path] = str(exc)
        return registered

    async def wait_for_plugin(
        self, driver_name: str, *, timeout: float = 10.0, poll_interval: float = 0.05
    ) -> PluginConnection:
        """Scan until an instance of ``driver_name`` is registered; returns the newest one.

        :raises KubeletError: none registered within ``timeout`` seconds (refusal reasons included).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.scan()
            if self.instances(driver_name):
                return self.plugin(driver_name)
            if loop.time() >= deadline:
                reasons = "; ".join(f"{p}: {r}" for p, r in self.failures.items()) or "no socket found"
                raise KubeletError(
                    f"DRA driver {driver_name} did not register within {timeout:g} s in "
                    f"{self.registrar_dir} ({reasons})"
                )
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        """Close every channel; registered plugins are forgotten."""
        plugins, self._plugins = self._plugins, {}
        for connection in plugins.values():
            await connection.close()


class SyncPluginConnection:
    """Blocking twin of :class:`PluginConnection`, bound to a :class:`SyncKubeletEmulator`'s loop."""

    def __init__(self, owner: SyncKubeletEmulator, connection: PluginConnection) -> None:
        self._owner = owner
        self.connection = connection

    @property
    def name(self) -> str:
        return self.connection.name

    @property
    def endpoint(self) -> str:
        return self.connection.endpoint

    @property
    def service(self) -> str:
        return self.connection.service

    @property
    def supported_versions(self) -> tuple[str, ...]:
        return self.connection.supported_versions

    def prepare(
        self, claims: Sequence[ClaimRef], *, service: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> dict[str, ClaimResult]:
        """See :meth:`PluginConnection.prepare`."""
        return self._owner._run(self.connection.prepare(claims, service=service, timeout=timeout))

    def unprepare(
        self, claims: Sequence[ClaimRef], *, service: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> dict[str, str]:
        """See :meth:`PluginConnection.unprepare`."""
        return self._owner._run(self.connection.unprepare(claims, service=service, timeout=timeout))

    def read_health(self, count: int = 1, *, timeout: float = 10.0) -> list[list[DeviceHealthReport]]:
        """Open the health stream, read ``count`` messages, close it.

        :raises KubeletError: the stream failed or ended early, or ``timeout`` seconds passed.
        """

        async def read() -> list[list[DeviceHealthReport]]:
            out: list[list[DeviceHealthReport]] = []
            stream = self.connection.watch_health()
            try:
                async with asyncio.timeout(timeout):
                    async for snapshot in stream:
                        out.append(snapshot)
                        if len(out) >= count:
                            return out
            except TimeoutError:
                raise KubeletError(
                    f"health stream: {len(out)} of {count} messages within {timeout:g} s"
                ) from None
            finally:
                await stream.aclose()
            raise KubeletError(f"health stream ended after {len(out)} of {count} messages")

        return self._owner._run(read())

    def get_info(self, *, timeout: float = GET_INFO_TIMEOUT) -> pluginregistration_v1_pb2.PluginInfo:
        """See :meth:`PluginConnection.get_info`."""
        return self._owner._run(self.connection.get_info(timeout=timeout))


class SyncKubeletEmulator:
    """Blocking :class:`KubeletEmulator`: a private event loop in a daemon thread runs every call.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self, registrar_dir: Path, *, kubelet_services: Sequence[str] = KUBELET_DRA_SERVICES
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kubelet-emulator", daemon=True)
        self._thread.start()
        self.emulator = KubeletEmulator(registrar_dir, kubelet_services=kubelet_services)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __enter__(self) -> SyncKubeletEmulator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def failures(self) -> dict[Path, str]:
        return self.emulator.failures

    def scan(self) -> list[SyncPluginConnection]:
        """See :meth:`KubeletEmulator.scan`."""
        return [SyncPluginConnection(self, c) for c in self._run(self.emulator.scan())]

    def register(self, socket_path: Path) -> SyncPluginConnection:
        """See :meth:`KubeletEmulator.register`."""
        return SyncPluginConnection(self, self._run(self.emulator.register(socket_path)))

    def wait_for_plugin(
        self, driver_name: str, *, timeout: float = 10.0, poll_interval: float = 0.05
    ) -> SyncPluginConnection:
        """See :meth:`KubeletEmulator.wait_for_plugin`."""
        connection = self._run(
            self.emulator.wait_for_plugin(driver_name, timeout=timeout, poll_interval=poll_interval)
        )
        return SyncPluginConnection(self, connection)

    def plugin(self, driver_name: str) -> SyncPluginConnection:
        """See :meth:`KubeletEmulator.plugin`."""
        return SyncPluginConnection(self, self.emulator.plugin(driver_name))

    def instances(self, driver_name: str) -> list[SyncPluginConnection]:
        """See :meth:`KubeletEmulator.instances`."""
        return [SyncPluginConnection(self, c) for c in self.emulator.instances(driver_name)]

    def close(self) -> None:
        """Close all channels and stop the private loop; idempotent."""
        if self._loop.is_closed():
            return
        self._run(self.emulator.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
