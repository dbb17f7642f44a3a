"""``dradriver exporter``: the GPU health and metrics exporter alone, for nodes where another driver allocates GPUs.

Discovers the node's GPUs and MIG devices through NVML (the system library, ``--nvml-library PATH``, or the
bundled mock with ``--mock-profile NAME``), polls them every ``--poll-interval`` seconds with the compiled
poller, watches NVML events (Xid, ECC, GPU lost), and serves Prometheus metrics on ``--http-endpoint`` at
``--metrics-path`` until SIGINT or SIGTERM. Scrapes are answered from the latest poll; they never wait on
NVML. The devices are re-read every poll interval, so MIG devices another NVML client creates (the kubelet
plugin's dynamic MIG) are followed; the kubelet's PodResources (``--pod-resources-socket``) attributes each
device to every pod container using it. Metric names: ``docs/operations/metrics.md``; ``--dcgm-compatible`` serves
dcgm-exporter's ``DCGM_FI_*`` names, units and labels instead (see :mod:`dradriver.health.dcgm`). Exit status
0 after a signal, 1 when NVML cannot be used or the endpoint cannot be served, 2 for bad flags (a
``--pod-resources-socket`` that is not a socket among them).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from dradriver.commands._options import add_output_alias
from dradriver.config import PLUGIN_FLAGS, FlagError, add_flags

_SHARED_FLAGS = (
    "--node-name",
    "--nvml-library",
    "--mock-profile",
    "--sysfs-root",
    "--metrics-path",
    "--additional-xids-to-ignore",
    "--log-level",
    "--log-format",
    "--dcgm-compatible",
)


def register(subparsers: Any) -> None:
    """Add the ``exporter`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "exporter",
        help="serve GPU health and Prometheus metrics without allocating GPUs",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    add_flags(parser, [f for f in PLUGIN_FLAGS if f.option in _SHARED_FLAGS])
    add_output_alias(parser)
    parser.add_argument(
        "--http-endpoint",
        default=_env("HTTP_ENDPOINT", ":9400"),
        help="host:port of the metrics server (default ':9400', the dcgm-exporter port) [env HTTP_ENDPOINT]",
    )
    parser.add_argument(
        "--pod-resources-socket",
        default=_env("DRADRIVER_POD_RESOURCES_SOCKET", ""),
        help="the kubelet's PodResources socket (default /var/lib/kubelet/pod-resources/kubelet.sock, skipped "
             "while it does not exist; one given here must exist): each scrape asks it which pods, containers "
             "and ResourceClaims hold each device (pod, namespace, container, claim / dra_* labels) "
             "[env DRADRIVER_POD_RESOURCES_SOCKET]",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=float(_env("DRADRIVER_POLL_INTERVAL", "10")),
        help="seconds between NVML polls (default 10) [env DRADRIVER_POLL_INTERVAL]",
    )
    parser.set_defaults(func=run)


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _xids(text: str) -> tuple[int, ...]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise FlagError(f"--additional-xids-to-ignore: {part!r} is not an integer Xid")
        out.append(int(part))
    return tuple(out)


def pod_resources_socket(path: str) -> str:
    """The PodResources socket to ask: ``path`` when given (it must be a socket: a typo would otherwise
    silently attribute nothing), else the kubelet's default (asked only while it exists, as dcgm-exporter does).

    :raises FlagError: ``path`` is given and is not an existing Unix socket.
    """
    from dradriver.server.podresources import DEFAULT_SOCKET

    if not path:
        return DEFAULT_SOCKET
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise FlagError(f"--pod-resources-socket {path}: {exc.strerror or exc} (the kubelet serves PodResources "
                        f"at {DEFAULT_SOCKET}; mount its directory into the exporter)") from exc
    if not stat.S_ISSOCK(mode):
        raise FlagError(f"--pod-resources-socket {path}: not a Unix socket")
    return path


def holder_lookup(socket_path: str, node: str | None, log: logging.Logger) -> Any:
    """A per-scrape PodResources lookup of the ``gpu.nvidia.com`` devices held on this node.

    :param node: the ``--node-name``: only devices of that pool are attributed, and pods holding devices of
        other pools only are reported (once per change) as the likely cause of missing attribution; ``None``:
        every pool (a kubelet lists only its own node's pods, and the GPU driver's pool is its node's name).

    A missing socket, or one that does not answer, reads as "nothing held" and is logged once per change.
    """
    from dradriver.domain.identity import GPU_DRIVER
    from dradriver.server.podresources import PodResourcesError, list_holders

    last_problem = [""]

    def say(problem: str) -> None:
        if problem and problem != last_problem[0]:
            log.warning("no pod attribution: %s", problem)
        last_problem[0] = problem

    def lookup() -> Any:
        if not os.path.exists(socket_path):
            say(f"no kubelet PodResources socket at {socket_path}")
            return {}
        try:
            found = list_holders(socket_path, driver=GPU_DRIVER.driver_name, pool=None)
        except PodResourcesError as exc:
            say(str(exc))
            return {}
        if node is None:
            say("")
            return found
        mine = {device: kept for device, held in found.items() if (kept := [h for h in held if h.pool == node])}
        others = sorted({h.pool for held in found.values() for h in held} - {node})
        if others and not mine:
            say(f"PodResources on {socket_path} lists {GPU_DRIVER.driver_name} devices of pool(s) "
                f"{', '.join(others)}, none of node {node!r}: set --node-name (NODE_NAME) to this node's name, "
                "or leave it unset to attribute every pool the kubelet lists")
        else:
            say("")
        return mine

    return lookup


class DeviceFollower:
    """Re-reads the node's devices every ``interval_s`` seconds and replaces ``registry``'s snapshot when the
    set changed: MIG devices another NVML client created or destroyed (the kubelet plugin's dynamic MIG,
    ``nvidia-smi mig``) get their series, labels and pod attribution at the next scrape.

    The health monitor subscribes to the registry (as in the kubelet plugin), and the collectors follow the
    monitor's inventory. A failed re-read is logged and the last snapshot kept.
    """

    def __init__(self, session: Any, registry: Any, *, sysfs_root: Path, interval_s: float,
                 log: logging.Logger) -> None:
        self.session, self.registry, self.sysfs_root = session, registry, sysfs_root
        self.interval_s = interval_s
        self.log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-follower", daemon=True)

    @staticmethod
    def device_set(inventory: Any) -> tuple[frozenset[object], ...]:
        """What a change is judged on: each GPU's UUID and MIG mode, each MIG device's UUID (in any order)."""
        return frozenset((g.uuid, g.mig_enabled) for g in inventory.gpus), frozenset(m.uuid for m in inventory.migs)

    def refresh(self) -> bool:
        """Re-read now (this thread); True when the snapshot was replaced.

        A GPU of the last snapshot that the re-read leaves out (fallen off the bus, a failing query) stays, with
        its MIG devices: its health series (``gpu-lost``) must not vanish with it.
        """
        from dradriver.nvml.discovery import discover

        self.session.forget_mig_handles()
        inventory = discover(self.session, sysfs_root=self.sysfs_root)
        last = self.registry.snapshot
        kept = {g.uuid for g in last.gpus} - {g.uuid for g in inventory.gpus}
        if kept:
            inventory = dataclasses.replace(
                inventory, gpus=(*inventory.gpus, *(g for g in last.gpus if g.uuid in kept)),
                migs=(*inventory.migs, *(m for m in last.migs if m.parent.uuid in kept)))
        if self.device_set(inventory) == self.device_set(last):
            return False
        self.log.info("device set changed: %d GPU(s), %d MIG device(s)", len(inventory.gpus), len(inventory.migs))
        self.registry.replace(inventory)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception as exc:  # the next interval tries again; the last snapshot stays
                self.log.warning("re-reading devices failed: %s", exc)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; returns the exit status."""
    from dradriver import logs
    from dradriver.domain.faults import DEFAULT_IGNORED_XIDS
    from dradriver.domain.registry import DeviceRegistry
    from dradriver.errors import DradriverError
    from dradriver.health.metrics import MetricsEndpointError, exporter_registry, parse_endpoint, serve_metrics
    from dradriver.health.monitor import HealthMonitor
    from dradriver.nvml.discovery import discover
    from dradriver.nvml.session import open_session

    logs.configure(str(args.log_level), str(args.log_format))
    log = logging.getLogger("dradriver.exporter")
    node = args.node_name or socket.gethostname()
    try:
        ignored = DEFAULT_IGNORED_XIDS | set(_xids(args.additional_xids_to_ignore or ""))
        parse_endpoint(args.http_endpoint)
        if not args.poll_interval > 0:
            raise FlagError(f"--poll-interval must be positive, got {args.poll_interval:g}")
        pod_socket = pod_resources_socket(args.pod_resources_socket)
    except (FlagError, MetricsEndpointError) as exc:
        print(f"dradriver exporter: error: {exc}", file=sys.stderr)
        return 2
    if not args.node_name:
        log.info("--node-name not set: Hostname/node label %r; pods are attributed whatever pool the kubelet lists "
                 "their %s devices in", node, "gpu.nvidia.com")

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    try:
        session = open_session(args.nvml_library or "", args.mock_profile or "")
    except DradriverError as exc:
        print(f"dradriver exporter: error: {exc}", file=sys.stderr)
        return 1
    try:
        sysfs_root = Path(args.sysfs_root or "/sys")
        inventory = discover(session, sysfs_root=sysfs_root)
        for failure in inventory.failures:
            log.warning("GPU index %d left out: %s", failure.index, failure.reason)
        devices: DeviceRegistry[Any] = DeviceRegistry(inventory, lambda inv: {d.name: d for d in inv.allocatable()})
        service = HealthMonitor(
            inventory,
            pool_name=node,
            session=session,
            ignored_xids=ignored,
            poll_interval_s=args.poll_interval,
        )
        devices.subscribe(service.replace_inventory)
        follower = DeviceFollower(session, devices, sysfs_root=sysfs_root, interval_s=args.poll_interval, log=log)
        service.start()
        try:
            holders = holder_lookup(pod_socket, args.node_name or None, log)
            registry = exporter_registry(service, node=node, dcgm_compatible=args.dcgm_compatible,
                                         holders=holders)
            server = serve_metrics(registry, args.http_endpoint, args.metrics_path,
                                   dcgm_compatible=args.dcgm_compatible)
        except OSError as exc:
            print(f"dradriver exporter: error: cannot serve metrics on {args.http_endpoint}: {exc}", file=sys.stderr)
            service.stop()
            return 1
        follower.start()
        log.info(
            "serving metrics of %d GPU(s) and %d MIG device(s) at %s", len(inventory.gpus), len(inventory.migs),
            server.url,
        )  # fmt: skip
        while not stop.wait(1.0):
            pass
        log.info("stopping")
        follower.stop()
        server.stop()
        service.stop()
    except DradriverError as exc:
        print(f"dradriver exporter: error: {exc}", file=sys.stderr)
        return 1
    finally:
        session.close()
    return 0
