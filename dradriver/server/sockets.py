"""Unix sockets and server lifecycle: start the DRA, probe and registration servers in order, stop them.

Rules (the kubelet's ``pkg/kubelet/pluginmanager/pluginwatcher/README.md``; ``kubeletplugin/draplugin.go`` in
k8s.io/dynamic-resource-allocation):

* The DRA server answers on its socket before the registration socket appears, so the kubelet never
  registers an endpoint that is not served yet. Each socket is bound under a hidden temporary name in
  its final directory (the kubelet ignores names starting with ``.``), restricted to mode 0600, served,
  and only then renamed to its real name, so it appears atomically, owner-only and already answering.
* Sockets are ours alone: 0600 files in directories we create with mode 0750.
* A socket left by a previous run under our own name is removed, but only if it is a socket and nothing
  answers on it; a live server there means another instance uses the same name, and we refuse.
* ``sun_path`` holds 108 bytes including the NUL terminator; longer paths are refused up front.
* On stop, each socket is removed if it is still the one we created (same inode); the registration
  socket goes first, so the kubelet deregisters the plugin before the DRA server winds down.

With a pod UID in :class:`PluginConfig`, both socket names carry it, so two plugin pods of one driver
(a rolling update) run side by side: ``dra-<podUID>.sock`` and ``<driver>-<podUID>-reg.sock``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import secrets
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from dradriver._proto import (
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2_grpc,
)
from dradriver.config import PluginConfig
from dradriver.errors import DradriverError
from dradriver.server import dra, healthstream, probe, registration

if TYPE_CHECKING:  # the protocol only; importing it loads the domain model (~0.1 s before the sockets)
    from dradriver.domain.ports import ClaimPreparer

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 108
"""Size of ``sockaddr_un.sun_path`` on Linux, including the terminating NUL byte."""

SOCKET_MODE = 0o600
DIRECTORY_MODE = 0o750
DRA_WORKERS = 256
"""Worker threads of the DRA server: kubelet calls served at once (each prepare holds one until its answer, a
health stream for its lifetime); further calls wait in the server's queue. As many as the kubelet's largest usual
``--max-pods`` (110 by default, 250 on dense nodes), so every pod of the node can have a call in flight (a
compute-domain claim waits for its IMEX daemon for up to the prepare deadline) and the liveness probe's empty call
still finds a free worker. Threads start on demand: an idle plugin holds a few."""
PROBE_HOST = "[::]"
"""Interface of the ``grpc.health.v1`` TCP server (all interfaces; gRPC falls back to IPv4 if needed)."""

_DRA_SERVICE_NAMES = (
    "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
    "pluginregistration.Registration",
)


class SocketPathError(DradriverError):
    """A socket path is unusable: too long for ``sun_path``, or occupied by something that is not a socket."""


class SocketInUseError(DradriverError):
    """A live server already answers on one of our socket paths (another instance with the same name)."""


def check_socket_path(path: Path) -> None:
    """Refuse ``path`` if it does not fit ``sun_path`` (108 bytes with NUL) or is relative.

    :raises SocketPathError: naming the path and its length.
    """
    if not path.is_absolute():
        raise SocketPathError(
            f"socket path {str(path)!r} must be absolute (the kubelet dials 'unix://' + path)"
        )
    size = len(os.fsencode(path)) + 1
    if size > UNIX_PATH_MAX:
        raise SocketPathError(
            f"socket path {path} needs {size} bytes with its NUL terminator, more than the {UNIX_PATH_MAX} "
            "bytes of an AF_UNIX address; use shorter --kubelet-plugins-directory-path / "
            "--kubelet-registrar-directory-path values or a shorter pod UID"
        )


def create_socket_directory(directory: Path) -> None:
    """Create ``directory`` and missing parents with mode 0750; existing directories are left as they are."""
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=DIRECTORY_MODE)
        except FileExistsError:
            continue
        os.chmod(path, DIRECTORY_MODE)  # mkdir's mode is filtered by the umask
    if not directory.is_dir():
        raise SocketPathError(f"{directory} is not a directory")


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file left at ``path`` by an earlier run, if nothing answers on it.

    :raises SocketInUseError: a server accepts connections on ``path``.
    :raises SocketPathError: ``path`` exists and is not a socket (never removed), or cannot be probed.
    """
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketPathError(f"{path} exists and is not a Unix socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(os.fspath(path))
    except FileNotFoundError:
        return
    except ConnectionRefusedError:
        log.info("removing stale socket %s from an earlier run", path)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return
    except OSError as exc:
        raise SocketPathError(f"cannot probe existing socket {path}: {exc.strerror or exc}") from exc
    finally:
        probe.close()
    raise SocketInUseError(
        f"a live server answers on {path}: another plugin instance uses the same socket name "
        "(two instances on one node need distinct pod UIDs, --pod-uid / POD_UID)"
    )


def _hidden_path(final: Path) -> Path:
    return final.parent / f".dradriver-{secrets.token_hex(4)}.sock"


@dataclass(slots=True)
class _ExposedSocket:
    path: Path
    device: int
    inode: int

    def remove(self) -> None:
        """Unlink the socket if the path still names the file we created."""
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) != (self.device, self.inode):
            log.warning("not removing %s: it was replaced by another file", self.path)
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


async def _serve_unix(server: Any, final: Path) -> _ExposedSocket:
    """Bind ``server`` (``grpc.aio`` or synchronous) under a hidden name beside ``final``, chmod 0600, start, rename
    to ``final``."""
    hidden = _hidden_path(final)
    check_socket_path(hidden)
    try:
        server.add_insecure_port(f"unix:{hidden}")
    except RuntimeError as exc:
        raise SocketPathError(f"cannot listen on {hidden} (for {final}): {exc}") from exc
    try:
        os.chmod(hidden, SOCKET_MODE)
        started = server.start()
        if started is not None:  # grpc.aio: a coroutine
            await started
        os.rename(hidden, final)
    except BaseException:
        try:
            hidden.unlink()
        except FileNotFoundError:
            pass
        raise
    info = final.lstat()
    return _ExposedSocket(final, info.st_dev, info.st_ino)


@dataclass(slots=True)
class Servers:
    """The running gRPC servers of one plugin instance; stop with :meth:`stop`.

    :ivar dra_socket: absolute path of the DRA socket (``PluginInfo.endpoint``).
    :ivar registration_socket: absolute path of the socket in the kubelet's registrar directory.
    :ivar health_port: TCP port of ``grpc.health.v1``, or ``None`` when disabled.
    :ivar registration: the registration servicer; ``await servers.registration.wait_status()`` waits
        for the kubelet's verdict.
    """

    dra_socket: Path
    registration_socket: Path
    health_port: int | None
    registration: registration.RegistrationServicer
    _dra_server: Any = None
    _registration_server: Any = None
    _probe_server: Any = None
    _probe: Any = None
    _sockets: list[_ExposedSocket] = field(default_factory=list)
    _stopped: bool = False

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop serving; idempotent.

        Order: remove the registration socket (the kubelet deregisters), stop the registration server,
        report NOT_SERVING to probes, let in-flight DRA calls finish for up to ``grace`` seconds
        (``None``: cancel them at once; a health stream lasts until cancelled, so it takes the whole grace),
        remove the DRA socket, stop the probe server.
        """
        if self._stopped:
            return
        self._stopped = True
        for exposed in self._sockets:
            if exposed.path == self.registration_socket:
                exposed.remove()
        if self._registration_server is not None:
            await self._registration_server.stop(0)
        if self._probe is not None:
            await self._probe.enter_graceful_shutdown()
        if self._dra_server is not None:
            stopped = self._dra_server.stop(grace)  # a threading.Event, set when its calls are over
            await asyncio.to_thread(stopped.wait)
        for exposed in self._sockets:
            exposed.remove()
        if self._probe_server is not None:
            await self._probe_server.stop(0)
        log.info("plugin servers stopped")

    async def __aenter__(self) -> Servers:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def _dra_services(health_source: healthstream.HealthSource | None) -> Sequence[str]:
    names = list(_DRA_SERVICE_NAMES)
    if health_source is not None:
        names.append(registration.HEALTH_SERVICE)
    return names


async def start_servers(
    config: PluginConfig,
    preparer: ClaimPreparer,
    *,
    health_source: healthstream.HealthSource | None = None,
    on_registration_status: registration.StatusCallback | None = None,
    ready: Callable[[], bool] | None = None,
) -> Servers:
    """Serve the DRA API and register with the kubelet; returns once the registration socket exists.

    Sockets: ``config.dra_socket`` and ``config.registration_socket`` (pod-UID variants when
    ``config.pod_uid`` is set). The health stream ``v1alpha1.DRAResourceHealth`` is served and advertised
    only with a ``health_source``; ``grpc.health.v1`` listens on TCP ``config.healthcheck_port`` unless
    it is negative (0 picks a free port, see :attr:`Servers.health_port`).

    :param preparer: receives the decoded claims of every NodePrepareResources/NodeUnprepareResources.
    :param on_registration_status: called with each :class:`registration.RegistrationStatus`.
    :param ready: the ``readiness`` probe service's verdict (e.g. "this node's ResourceSlices are published").
    :raises SocketPathError: a socket path is too long, relative, or occupied by a non-socket.
    :raises SocketInUseError: a live server answers on one of the socket paths.
    """
    dra_path = config.dra_socket.absolute()
    registration_path = config.registration_socket.absolute()
    for path in (dra_path, registration_path):
        check_socket_path(path)
        check_socket_path(_hidden_path(path))
    for path in (dra_path, registration_path):
        create_socket_directory(path.parent)
    for path in (dra_path, registration_path):
        remove_stale_socket(path)

    servicer = registration.RegistrationServicer(
        driver_name=config.driver_name,
        endpoint=dra_path,
        versions=registration.supported_versions(with_health=health_source is not None),
        on_status=on_registration_status,
    )
    servers = Servers(
        dra_socket=dra_path, registration_socket=registration_path, health_port=None, registration=servicer
    )
    try:
        # Synchronous: each call runs in a worker thread that calls the blocking preparer directly. gRPC's
        # asyncio server spent more CPU per call and answered later (issue 17: the event loop's hops to the
        # runner's threads and back, and grpc.aio's own per-call cost).
        dra_server = grpc.server(concurrent.futures.ThreadPoolExecutor(DRA_WORKERS, thread_name_prefix="dra-call"))
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(dra.DRAPluginV1Servicer(preparer), dra_server)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
            dra.DRAPluginV1Beta1Servicer(preparer), dra_server
        )
        if health_source is not None:
            dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
                healthstream.DRAResourceHealthServicer(health_source, asyncio.get_running_loop()), dra_server
            )
        servers._dra_server = dra_server
        servers._sockets.append(await _serve_unix(dra_server, dra_path))
        log.info("DRA server listening on %s", dra_path)

        if config.healthcheck_port >= 0:
            liveness = await probe.create_probe_servicer(
                _dra_services(health_source), registration_socket=str(registration_path), dra_socket=str(dra_path),
                ready=ready,
            )
            probe_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(liveness, probe_server)
            servers._probe, servers._probe_server = liveness, probe_server
            try:
                port = probe_server.add_insecure_port(f"{PROBE_HOST}:{config.healthcheck_port}")
            except RuntimeError as exc:
                raise SocketPathError(f"cannot listen on TCP port {config.healthcheck_port}: {exc}") from exc
            await probe_server.start()
            servers.health_port = port
            log.info("gRPC health service listening on TCP port %d", port)

        registration_server = grpc.aio.server()
        pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(servicer, registration_server)
        servers._registration_server = registration_server
        servers._sockets.append(await _serve_unix(registration_server, registration_path))
        log.info("registration socket %s exposed to the kubelet", registration_path)
    except BaseException:
        await servers.stop(0)
        raise
    return servers


def is_socket(path: Path) -> bool:
    """True when ``path`` is a Unix socket file (does not follow symlinks)."""
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise
