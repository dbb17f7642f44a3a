"""``dradriver exporter``: the GPU health and metrics exporter alone, for nodes where another driver allocates GPUs.

Discovers the node's GPUs and MIG devices through NVML (the system library, ``--nvml-library PATH``, or the
bundled mock with ``--mock-profile NAME``), polls them every ``--poll-interval`` seconds with the compiled
poller, watches NVML events (Xid, ECC, GPU lost), and serves Prometheus metrics on ``--http-endpoint`` at
``--metrics-path`` until SIGINT or SIGTERM. Scrapes are answered from the latest poll; they never wait on
NVML. Metric names: ``docs/metrics.md``; ``--dcgm-compatible`` serves dcgm-exporter's ``DCGM_FI_*``
names, units and labels instead (see :mod:`dradriver.health.dcgm`). Exit status 0 after a signal, 1 when
NVML cannot be used or the endpoint cannot be served, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
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
        default=_env("DRADRIVER_POD_RESOURCES_SOCKET", "/var/lib/kubelet/pod-resources/kubelet.sock"),
        help="the kubelet's PodResources socket; with --dcgm-compatible, each scrape asks it which pod, container "
             "and ResourceClaim hold each device (pod, namespace, container, dra_* labels) "
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
    import os

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


def holder_lookup(socket_path: str, node: str, log: logging.Logger) -> Any:
    """A per-scrape PodResources lookup for ``node``'s ``gpu.nvidia.com`` devices: an unreachable socket is
    logged once per change of the error and reads as "nothing held"."""
    from dradriver.domain.identity import GPU_DRIVER
    from dradriver.server.podresources import PodResourcesError, list_holders

    last_error = [""]

    def lookup() -> Any:
        try:
            found = list_holders(socket_path, driver=GPU_DRIVER.driver_name, pool=node)
        except PodResourcesError as exc:
            if str(exc) != last_error[0]:
                last_error[0] = str(exc)
                log.warning("no pod attribution: %s", exc)
            return {}
        last_error[0] = ""
        return found

    return lookup


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; returns the exit status."""
    from dradriver import logs
    from dradriver.domain.faults import DEFAULT_IGNORED_XIDS
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
    except (FlagError, MetricsEndpointError) as exc:
        print(f"dradriver exporter: error: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    try:
        session = open_session(args.nvml_library or "", args.mock_profile or "")
    except DradriverError as exc:
        print(f"dradriver exporter: error: {exc}", file=sys.stderr)
        return 1
    try:
        inventory = discover(session, sysfs_root=Path(args.sysfs_root or "/sys"))
        for failure in inventory.failures:
            log.warning("GPU index %d left out: %s", failure.index, failure.reason)
        service = HealthMonitor(
            inventory,
            pool_name=node,
            session=session,
            ignored_xids=ignored,
            poll_interval_s=args.poll_interval,
        )
        service.start()
        try:
            holders = holder_lookup(args.pod_resources_socket, node, log) if args.dcgm_compatible else None
            registry = exporter_registry(service, node=node, dcgm_compatible=args.dcgm_compatible,
                                         holders=holders)
            server = serve_metrics(registry, args.http_endpoint, args.metrics_path,
                                   dcgm_compatible=args.dcgm_compatible)
        except OSError as exc:
            print(f"dradriver exporter: error: cannot serve metrics on {args.http_endpoint}: {exc}", file=sys.stderr)
            service.stop()
            return 1
        log.info(
            "serving metrics of %d GPU(s) and %d MIG device(s) at %s", len(inventory.gpus), len(inventory.migs),
            server.url,
        )  # fmt: skip
        while not stop.wait(1.0):
            pass
        log.info("stopping")
        server.stop()
        service.stop()
    except DradriverError as exc:
        print(f"dradriver exporter: error: {exc}", file=sys.stderr)
        return 1
    finally:
        session.close()
    return 0
