"""``dradriver demo``: run the whole driver end to end with no GPU and no cluster (see dradriver.sandbox.demos)."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

IMEX_CHOICES = ("driver-managed", "host-managed", "pre-warmed")
"""``--imex``: the IMEX modes the compute-domain scenario shows (``--imex-mode`` driverManaged, hostManaged,
preWarmed)."""


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
    parser.add_argument("--profile", default=None,
                        help="mock NVML node profile (see `dradriver mock-profiles`); default gb200-nvl72-node, "
                             "dgx-h200 for --scenario dynamic-mig, dgx-h100 for --scenario passthrough (an HGX 8-GPU "
                             "board: Fabric Manager's partition table needs module IDs 1-8; the sharing scenario "
                             "ignores it)")
    parser.add_argument("--node-name", default="gpu-node-1", help="name of the emulated node")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="progress format")
    parser.add_argument("--scenario", choices=("basic", "sharing", "time-slicing", "dynamic-mig", "compute-domain",
                                               "passthrough"),
                        default="basic",
                        help="basic: the seed examples (default); sharing: time-slicing, consumable GPU shares "
                             "enforced through MPS, and an MPS claim, on an H200 node; time-slicing: one GPU "
                             "time-sliced by its claim, which admin-access claims never change, settings read back "
                             "via NVML; dynamic-mig: MIG devices "
                             "created at prepare and destroyed at unprepare on an H200 node (DynamicMIG gate); "
                             "compute-domain: a ComputeDomain across two nodes of one of two emulated NVL72 racks, "
                             "IMEX daemons and channels, deletion leaving nothing behind; passthrough: a VM's pod "
                             "gets two GPUs of one Fabric Manager partition through VFIO on an HGX H100 node "
                             "(PassthroughSupport, FabricManagerPartitioning) and gives them back")
    parser.add_argument("--tenants", type=int, default=1,
                        help="compute-domain only: 1 (default) runs one domain with driver-managed IMEX; 2-4 run that "
                             "many jobs from as many namespaces on one rack with host-managed IMEX and "
                             "IMEX_ISOLATION=channel (each its own channel), a node killed mid-run and healed")
    parser.add_argument("--imex", choices=IMEX_CHOICES, default=None,
                        help="compute-domain only: how the IMEX daemons run. driver-managed (the default with one "
                             "tenant): a daemon pod per node of each domain; host-managed: the host's own daemon, "
                             "what --tenants 2-4 runs (only with them); pre-warmed: one long-lived daemon per node of "
                             "each NVLink clique before any domain exists (--imex-mode preWarmed) with binding "
                             "conditions on: two jobs' domains timed from creation to claims prepared, and a job "
                             "held at binding until its domain is ready")
    parser.add_argument("--feature-gates", default="",
                        help="basic and time-slicing scenarios: the plugin's feature gates in NVIDIA's syntax "
                             "(Name=true,...), e.g. DeviceMetadata=true to print the claim's KEP-5304 device "
                             "metadata file")
    parser.add_argument("--serve", action="store_true",
                        help="stop after publishing and keep the plugin and the emulators running until interrupted: "
                             "the API server, and the resourceclaim controller, scheduler and kubelet of "
                             "`dradriver sandbox`, so pods applied with kubectl run")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """0 when every step did what the driver promises (with ``--serve``: until Ctrl-C or SIGTERM); 1 with a clear
    message otherwise; 2 for flags that do not fit (a ``--node-name`` that is not a Node name, ``--tenants`` or
    ``--imex`` without the compute-domain scenario, an ``--imex`` mode the scenario does not run); 130 (Ctrl-C)
    or 143 (SIGTERM) when a scenario is interrupted, after its cleanup (plugins, controllers, daemons and emulators
    stopped, node directories removed), with one line saying so."""
    import asyncio
    import json
    import logging
    import signal
    import sys

    from dradriver import logs
    from dradriver.commands._entrypoint import Interrupted, interrupted_by_signals
    from dradriver.commands._options import node_name_error
    from dradriver.errors import DradriverError
    from dradriver.sandbox.cluster import ClusterEmulator
    from dradriver.sandbox.demos.narrator import DemoRun, Narrator

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
        # the resourceclaim controller, scheduler and kubelet of `dradriver sandbox`, so applied pods run
        cluster = ClusterEmulator(run.sandbox, say=lambda text: print(
            text, flush=True, file=sys.stderr if args.output == "json" else sys.stdout))
        cluster.apply_device_classes()
        await cluster.run(stop)

    if args.serve and args.output == "json":
        narrator.output = "quiet"
    if args.profile is None:
        args.profile = {"dynamic-mig": "dgx-h200", "passthrough": "dgx-h100"}.get(args.scenario, "gb200-nvl72-node")
    if args.serve and args.scenario in ("sharing", "dynamic-mig", "compute-domain", "passthrough"):
        print(f"dradriver demo: --serve does not run the {args.scenario} scenario", file=sys.stderr)
        return 2
    error = node_name_error("dradriver demo", args.node_name)
    if error:
        print(error, file=sys.stderr)
        return 2
    from dradriver.domain.featuregates import FeatureGateError, parse_feature_gates

    try:
        args.gates = parse_feature_gates(args.feature_gates) if args.feature_gates else None
    except FeatureGateError as exc:
        print(f"dradriver demo: {exc}", file=sys.stderr)
        return 2
    if args.gates is not None and args.scenario not in ("basic", "time-slicing"):
        print(f"dradriver demo: --feature-gates applies to the basic and time-slicing scenarios, not {args.scenario}",
              file=sys.stderr)
        return 2
    if args.tenants != 1 and args.scenario != "compute-domain":
        print(f"dradriver demo: --tenants applies to --scenario compute-domain, not {args.scenario}", file=sys.stderr)
        return 2
    error = imex_error(args)
    if error:
        print(f"dradriver demo: {error}", file=sys.stderr)
        return 2
    try:
        with interrupted_by_signals():  # Ctrl-C or kill: the scenario's cleanup runs as the exception unwinds
            _run_scenario(args, narrator, serve)
    except Interrupted as exc:
        step = f" in step {narrator.steps[-1]['step']} ({narrator.steps[-1]['title']})" if narrator.steps else ""
        if args.output == "json" and not args.serve:
            print(json.dumps({"ok": False, "interrupted": str(exc), "steps": narrator.steps}), flush=True)
        print(f"\ndradriver demo: interrupted by {exc}{step}; everything it started is stopped and removed",
              file=sys.stderr)
        return exc.exit_status
    except DradriverError as exc:
        if args.output == "json" and not args.serve:
            print(json.dumps({"ok": False, "error": str(exc), "steps": narrator.steps}))
        print(f"dradriver demo: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.output == "json" and not args.serve:
        print(json.dumps({"ok": True, "scenario": args.scenario, "profile": args.profile, "tenants": args.tenants,
                          **({"imex": args.imex} if args.imex else {}), "seconds": narrator.total_seconds,
                          "steps": narrator.steps}))
    elif args.output == "text":
        skipped = [s["title"] for s in narrator.steps if any(d.get("skipped") for d in s["details"])]
        note = f" ({len(skipped)} part(s) skipped, not in this build: {'; '.join(skipped)})" if skipped else ""
        print(f"\ndemo finished in {narrator.total_seconds:.2f} s: every step succeeded{note}")
    return 0


def imex_error(args: argparse.Namespace) -> str:
    """Why ``--imex`` does not fit the other options (``""``: it does); sets ``args.imex`` to the mode the
    compute-domain scenario runs when it was left out (driver-managed, host-managed with ``--tenants`` 2-4)."""
    if args.scenario != "compute-domain":
        return f"--imex applies to --scenario compute-domain, not {args.scenario}" if args.imex else ""
    scenario_mode = "driver-managed" if args.tenants == 1 else "host-managed"
    if args.imex is None:
        args.imex = scenario_mode
    elif args.imex == "pre-warmed" and args.tenants != 1:
        return "--imex pre-warmed runs its own three jobs: --tenants applies to the host-managed scenario"
    elif args.imex != "pre-warmed" and args.imex != scenario_mode:
        return (f"--imex {args.imex} is not what --tenants {args.tenants} runs ({scenario_mode}): the single-domain "
                "scenario is driver-managed, --tenants 2-4 host-managed")
    return ""


def _run_scenario(args: argparse.Namespace, narrator: Any, serve: Callable[[Any], Awaitable[None]]) -> None:
    """Run the scenario ``args`` name to its end (or, with ``--serve``, until interrupted).

    :raises dradriver.errors.DradriverError: a step did not do what the driver promises.
    """
    import asyncio

    if args.scenario == "dynamic-mig":
        from dradriver.sandbox.demos import dynamic_mig

        asyncio.run(dynamic_mig.demo(profile=args.profile, node_name=args.node_name, narrator=narrator))
    elif args.scenario == "passthrough":
        from dradriver.sandbox.demos import passthrough

        asyncio.run(passthrough.demo(profile=args.profile, node_name=args.node_name, narrator=narrator))
    elif args.scenario == "compute-domain" and args.imex == "pre-warmed":
        from dradriver.sandbox.demos import compute_domain_prewarmed

        compute_domain_prewarmed.run(narrator)
    elif args.scenario == "compute-domain" and args.tenants != 1:
        from dradriver.sandbox.demos import compute_domain_tenants

        compute_domain_tenants.run(narrator, args.tenants)
    elif args.scenario == "compute-domain":
        from dradriver.sandbox.demos import compute_domain

        compute_domain.run(narrator)
    elif args.scenario == "sharing":
        from dradriver.sandbox.demos.sharing import sharing_demo

        asyncio.run(sharing_demo(narrator))
    else:
        from dradriver.sandbox.demos.basic import demo

        asyncio.run(demo(profile=args.profile, node_name=args.node_name, narrator=narrator,
                         serve=serve if args.serve else None, scenario=args.scenario, feature_gates=args.gates))
