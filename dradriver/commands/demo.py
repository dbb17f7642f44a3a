"""``dradriver demo``: run the whole driver end to end with no GPU and no cluster (see dradriver.sandbox.demo)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="run the driver end to end on this machine: mock NVML, API and kubelet emulators",
        description=(
            "Start the kubelet plugin against the bundled mock NVML library, an embedded Kubernetes API "
            "emulator and an embedded kubelet emulator; publish ResourceSlices; allocate and prepare the "
            "seed examples; tear down and check nothing is left."
        ),
    )
    parser.add_argument("--profile", default="gb200-nvl72-node",
                        help="mock NVML node profile (see `dradriver mock-profiles`); default gb200-nvl72-node")
    parser.add_argument("--node-name", default="gpu-node-1", help="name of the emulated node")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="progress format")
    parser.add_argument("--scenario", choices=("basic", "sharing"), default="basic",
                        help="basic: the seed examples (default); sharing: GPU sharing (time-slicing) with the "
                             "settings read back through NVML")
    parser.add_argument("--serve", action="store_true",
                        help="stop after publishing and keep the plugin and both emulators running until interrupted")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """0 when every step did what the driver promises; 1 with a clear message otherwise."""
    import asyncio
    import json
    import logging
    import signal
    import sys

    from dradriver import logs
    from dradriver.errors import DradriverError
    from dradriver.sandbox.demo import DemoRun, Narrator, demo

    logs.configure("warning", "text")
    logging.getLogger("dradriver").setLevel(logging.ERROR)
    narrator = Narrator(output=args.output)

    async def serve(run: DemoRun) -> None:
        info = {
            "registration_socket": str(run.connection.registration_socket),
            "dra_socket": str(run.plugin.servers.dra_socket),
            "kubeconfig": str(run.sandbox.kubeconfig),
            "api_server": run.sandbox.api.url if run.sandbox.api else "",
            "cdi_root": str(run.sandbox.cdi_root),
            "node_name": run.sandbox.node_name,
        }
        if args.output == "json":
            print(json.dumps(info), flush=True)
        else:
            print("\nServing until interrupted (Ctrl-C):", flush=True)
            for key, value in info.items():
                print(f"   {key}: {value}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    if args.serve and args.output == "json":
        narrator.output = "quiet"
    try:
        asyncio.run(demo(profile=args.profile, node_name=args.node_name, narrator=narrator,
                         serve=serve if args.serve else None, scenario=args.scenario))
    except DradriverError as exc:
        if args.output == "json" and not args.serve:
            print(json.dumps({"ok": False, "error": str(exc), "steps": narrator.steps}))
        print(f"dradriver demo: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.output == "json" and not args.serve:
        print(json.dumps({"ok": True, "profile": args.profile, "seconds": narrator.total_seconds,
                          "steps": narrator.steps}))
    elif args.output == "text":
        print(f"\ndemo finished in {narrator.total_seconds:.2f} s: every step succeeded")
    return 0
