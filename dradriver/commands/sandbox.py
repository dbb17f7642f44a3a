"""``dradriver sandbox``: a one-node cluster emulator to run ``dradriver gpu-kubelet-plugin`` by hand."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``sandbox`` subcommand."""
    parser = subparsers.add_parser(
        "sandbox",
        help="emulate a one-node cluster (API server, scheduler, kubelet) for a plugin you start by hand",
        description=(
            "Start a Kubernetes API emulator and a node (directories, procfs fixtures, mock NVML profile), write "
            "the plugin's environment to <root>/plugin.env, then act as the resourceclaim controller, the "
            "scheduler and the kubelet for the plugin you start with: "
            "set -a; . <root>/plugin.env; set +a; dradriver gpu-kubelet-plugin"
        ),
    )
    parser.add_argument("--profile", default="dgx-h100", help="mock NVML node profile (default dgx-h100)")
    parser.add_argument("--node-name", default="gpu-node-1", help="name of the emulated node")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="json: print the paths as one JSON object on the first line")
    parser.add_argument("--api-latency", metavar="SETTINGS", default=None,
                        help="seconds the API emulator adds to each read, write and watch event, e.g. "
                             "read=10ms,write=30ms,watch=5ms (default: $DRADRIVER_APISERVER_LATENCY, else none)")
    parser.add_argument("--api-flow-control", metavar="SETTINGS", default=None,
                        help="an API Priority and Fairness limit answered 429 with Retry-After, e.g. "
                             "seats=245,queue=50,wait=15s,retry-after=1 (default: $DRADRIVER_APISERVER_FLOW_CONTROL, "
                             "else none)")
    parser.set_defaults(func=run)


def api_cost_error(args: argparse.Namespace) -> str:
    """Check ``--api-latency`` and ``--api-flow-control`` and hand them to the emulator (through the environment
    it reads, :mod:`dradriver.sandbox.apiserver.flowcontrol`); returns the error line for a value that cannot be
    read, else ``""``."""
    import os

    from dradriver.sandbox.apiserver import flowcontrol

    for value, env, parse in ((args.api_latency, flowcontrol.LATENCY_ENV, flowcontrol.parse_latency),
                              (args.api_flow_control, flowcontrol.FLOW_CONTROL_ENV, flowcontrol.parse_flow_control)):
        if value is None:
            continue
        flag = "--api-latency" if env == flowcontrol.LATENCY_ENV else "--api-flow-control"
        try:
            parse(value, flag)
        except flowcontrol.SettingsError as exc:
            return f"dradriver sandbox: error: {exc}"
        os.environ[env] = value
    return ""


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 on Ctrl-C/SIGTERM, 1 (as ``inspect`` and ``demo``) for an unknown ``--profile``
    or a node that cannot be laid out, 2 for a ``--node-name`` that is not a Node name."""
    import asyncio
    import signal
    import sys

    from dradriver import logs
    from dradriver.commands._options import node_name_error
    from dradriver.errors import DradriverError
    from dradriver.nvml import mock
    from dradriver.sandbox.cluster import ClusterEmulator, describe, dump, plugin_environment, write_env_file
    from dradriver.sandbox.node import SandboxNode

    logs.configure("warning", "text")
    error = node_name_error("dradriver sandbox", args.node_name)
    if error:
        print(error, file=sys.stderr)
        return 2
    error = api_cost_error(args)
    if error:
        print(error, file=sys.stderr)
        return 2
    try:
        mock.load_profile(args.profile)  # before anything starts: the same error as --mock-profile elsewhere
    except mock.MockNvmlError as exc:
        print(f"dradriver sandbox: error: {exc}", file=sys.stderr)
        return 1
    try:
        sandbox = SandboxNode(profile=args.profile, node_name=args.node_name)
    except DradriverError as exc:
        print(f"dradriver sandbox: {exc}", file=sys.stderr)
        return 1
    with sandbox:
        env_file = sandbox.root / "plugin.env"
        # MPS needs real tmpfs mounts from the plugin process started by hand (its mount helper is not a flag)
        config = sandbox.mps_config(log_level="info") if sandbox.real_mounts else sandbox.config(log_level="info")
        write_env_file(env_file, plugin_environment(config))
        if sandbox.real_mounts:
            sandbox.run_workloads(time_scale=1.0)
        info = describe(sandbox, env_file)
        cluster = ClusterEmulator(sandbox, say=lambda text: print(text, flush=True))
        cluster.apply_device_classes()
        if args.output == "json":
            print(dump(info), flush=True)
        else:
            print(f"sandbox node {sandbox.node_name} (mock NVML profile {args.profile}) at {sandbox.root}")
            print(f"  API server   {info['api_server']}   kubeconfig {info['kubeconfig']}")
            print("  start the plugin in another shell:")
            print(f"    set -a; . {env_file}; set +a; dradriver gpu-kubelet-plugin")
            print("  then, for example:")
            print(f"    kubectl --kubeconfig {info['kubeconfig']} get resourceslices")
            print(f"    kubectl --kubeconfig {info['kubeconfig']} apply -f deploy/examples/gpu-40gi.yaml")
            print(f"    kubectl --kubeconfig {info['kubeconfig']} get pods,resourceclaims,events")
            print(f"  CDI specs appear in {info['cdi_root']}; Ctrl-C stops the sandbox\n", flush=True)

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await cluster.run(stop)

        asyncio.run(main())
    return 0
