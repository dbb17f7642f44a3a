"""``compute-domain-kubelet-plugin`` (also ``dradriver compute-domain-kubelet-plugin``): run the kubelet plugin for
``compute-domain.nvidia.com`` (IMEX channels and IMEX daemons of ComputeDomains).

Both names take NVIDIA's compute-domain-kubelet-plugin flags with their environment twins
(:data:`dradriver.config.COMPUTE_DOMAIN_PLUGIN_FLAGS`, NVIDIA's ``cmd/compute-domain-kubelet-plugin/main.go``) and
klog's logging flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from dradriver import config
from dradriver.commands import _entrypoint
from dradriver.commands._options import add_output_alias

PROG = "compute-domain-kubelet-plugin"
DESCRIPTION = "DRA kubelet plugin for NVIDIA ComputeDomains (driver compute-domain.nvidia.com): IMEX channels and " \
              "IMEX daemons, node labels, ResourceSlices."


def register(subparsers: Any) -> None:
    """Add the ``compute-domain-kubelet-plugin`` subcommand; every flag has an environment twin."""
    parser = subparsers.add_parser(PROG, help="run the ComputeDomain (IMEX) DRA kubelet plugin",
                                   description=DESCRIPTION)
    _entrypoint.add_component_flags(parser, config.COMPUTE_DOMAIN_PLUGIN_FLAGS)
    add_output_alias(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``compute-domain-kubelet-plugin`` console script; returns the exit status."""
    return _entrypoint.console_main(PROG, DESCRIPTION, config.COMPUTE_DOMAIN_PLUGIN_FLAGS, run, argv)


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM/SIGHUP/SIGQUIT; 0 on a clean stop, 1 when the plugin cannot start, 2 on bad flags."""
    import asyncio
    import logging
    import sys

    from dradriver.errors import DradriverError
    from dradriver.kube.lazyimport import defer_kubernetes_subpackages

    defer_kubernetes_subpackages()  # the client's unused subpackages are not imported (start-up time, memory)
    try:
        cfg = config.compute_domain_config_from_args(args)
        _entrypoint.start_logging(PROG, args, cfg.feature_gates)
    except DradriverError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    from dradriver.app.computedomain import run_compute_domain_plugin

    log = logging.getLogger("dradriver.compute_domain_kubelet_plugin")
    log.info("startup config: %s", config.startup_summary(cfg))

    async def main() -> None:
        stop = asyncio.Event()
        _entrypoint.stop_on_signals(stop)
        await run_compute_domain_plugin(cfg, stop)

    try:
        asyncio.run(main())
    except (DradriverError, OSError) as exc:
        log.error("cannot start the kubelet plugin: %s", exc)
        return 1
    return 0
