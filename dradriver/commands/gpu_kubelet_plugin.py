"""``dradriver gpu-kubelet-plugin``: run the kubelet plugin for ``gpu.nvidia.com`` on this node."""

from __future__ import annotations

import argparse
from typing import Any

from dradriver import config
from dradriver.commands._options import add_output_alias


def register(subparsers: Any) -> None:
    """Add the ``gpu-kubelet-plugin`` subcommand; every flag has an environment twin."""
    parser = subparsers.add_parser(
        "gpu-kubelet-plugin",
        help="run the DRA kubelet plugin (registration, NodePrepare/Unprepare, ResourceSlices)",
        description=__doc__,
    )
    config.add_flags(parser)
    add_output_alias(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; returns 0 on a clean stop, 1 when the plugin cannot start."""
    import asyncio
    import logging
    import signal
    import sys

    from dradriver import app, logs
    from dradriver.errors import DradriverError

    try:
        cfg = config.config_from_args(args)
    except DradriverError as exc:
        print(f"dradriver gpu-kubelet-plugin: {exc}", file=sys.stderr)
        return 2
    logs.configure(cfg.log_level, cfg.log_format)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            loop.add_signal_handler(sig, stop.set)
        await app.run_plugin(cfg, stop)

    try:
        asyncio.run(main())
    except (DradriverError, OSError) as exc:
        logging.getLogger("dradriver").error("cannot start the kubelet plugin: %s", exc)
        return 1
    return 0
