"""``gpu-kubelet-plugin`` (also ``dradriver gpu-kubelet-plugin``): run the kubelet plugin for ``gpu.nvidia.com``.

Both names take every flag of NVIDIA's gpu-kubelet-plugin with its environment twin (:data:`dradriver.config.
PLUGIN_FLAGS`, klog's :data:`dradriver.config.LOGGING_FLAGS`) and log in klog's text format unless
``--log-format json`` (:mod:`dradriver.logs`). The console script is what NVIDIA's chart runs:
``bash -c '... gpu-kubelet-plugin -v $(LOG_VERBOSITY)'``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from dradriver import config
from dradriver.commands import _entrypoint
from dradriver.commands._options import add_output_alias

PROG = "gpu-kubelet-plugin"
DESCRIPTION = "DRA kubelet plugin for NVIDIA GPUs (driver gpu.nvidia.com): registration, NodePrepareResources/" \
              "NodeUnprepareResources, ResourceSlices, device health."


def register(subparsers: Any) -> None:
    """Add the ``gpu-kubelet-plugin`` subcommand; every flag has an environment twin."""
    parser = subparsers.add_parser(
        PROG,
        help="run the DRA kubelet plugin (registration, NodePrepare/Unprepare, ResourceSlices)",
        description=DESCRIPTION,
    )
    _entrypoint.add_component_flags(parser, config.PLUGIN_FLAGS)
    add_output_alias(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``gpu-kubelet-plugin`` console script (``[project.scripts]``); returns the exit status."""
    return _entrypoint.console_main(PROG, DESCRIPTION, config.PLUGIN_FLAGS, run, argv)


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM/SIGHUP/SIGQUIT; 0 on a clean stop, 1 when the plugin cannot start, 2 on bad flags."""
    import asyncio
    import logging
    import sys

    from dradriver.errors import DradriverError
    from dradriver.kube.lazyimport import defer_kubernetes_subpackages

    defer_kubernetes_subpackages()  # the client's unused subpackages are not imported (start-up time)
    try:
        cfg = config.config_from_args(args)
        _entrypoint.start_logging(PROG, args, cfg.feature_gates)
    except DradriverError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    log = logging.getLogger("dradriver.gpu_kubelet_plugin")
    log.info("startup config: %s", config.startup_summary(cfg))

    async def main() -> None:
        import gc
        import importlib

        from dradriver.kube.kubeconfig import check_kubeconfig

        # Registration and the DRA socket first (claims wait for the rest: dradriver.server.deferred), then
        # the plugin's parts, imported on a worker thread so the event loop keeps answering the kubelet.
        from dradriver.server import deferred

        stop = asyncio.Event()
        _entrypoint.stop_on_signals(stop)
        loop = asyncio.get_running_loop()
        check_kubeconfig(cfg.kubeconfig)  # validate, then touch the host (sockets, directories)
        early = await deferred.start_early(cfg)
        # Start-up allocates the modules' objects, nearly all of which live as long as the process: the
        # cyclic collector only slows that down (~10 %). Collected once the plugin runs, and what is left
        # is frozen out of later collections (gc.freeze), so they do not walk it again on the claim path.
        gc.disable()
        loop.call_later(30.0, gc.enable)  # a start stuck retrying the API server does not run without GC

        def started() -> None:
            from dradriver.host.memory import trim_heap

            gc.enable()
            gc.collect()
            gc.freeze()
            trim_heap()  # start-up's freed pages back to the kernel

        try:
            app = await asyncio.to_thread(importlib.import_module, "dradriver.app")
        except BaseException as exc:
            gc.enable()
            early.readiness.fail(exc)
            await early.servers.stop(grace=1.0)  # the waiting calls are answered with the failure
            raise
        try:
            await app.run_plugin(cfg, stop, early=early, on_started=started)
        finally:
            gc.enable()

    try:
        asyncio.run(main())
    except (DradriverError, OSError) as exc:
        log.error("cannot start the kubelet plugin: %s", exc)
        return 1
    return 0
