"""``dradriver rollback-check``: would rolling this node back to NVIDIA's driver strand anything?

Run it on the node (in the plugin's container, or on the host against its directories) before switching back: it
reads dradriver's claim state and the NVIDIA-format ``checkpoint.json`` kept beside it, for the GPU plugin
(``<kubelet plugins dir>/gpu.nvidia.com``) and the compute-domain plugin
(``<kubelet plugins dir>/compute-domain.nvidia.com``), and says per claim whether NVIDIA's kubelet plugin, started
in dradriver's place, would hold it (refuse its devices to other claims) and undo it fully at its unprepare
(verdict ``held``), or what would be stranded and why (verdict ``stranded``, one finding per reason):
``half-prepared`` (PREPARE_STARTED: the checkpoint names completed claims only), ``not-in-checkpoint`` (no
checkpoint, ``--nvidia-checkpoint=false``, one that does not verify or is of another boot, or no entry),
``consumable-share-mps`` (a share enforced by dradriver's per-device MPS control daemon), ``channel-isolation``
(``--imex-isolation channel``), ``device-metadata`` (KEP-5304 files NVIDIA never removes), ``json-spec`` (a
``.json`` CDI spec NVIDIA does not delete) and ``unknown-undo``. NEEDS names NVIDIA's gates its unprepare needs
to undo everything (``MPSSupport``, ``DynamicMIG``, ``HostManagedIMEXDaemon``): set them in NVIDIA's chart.
Nothing is written: no lock is taken and no file is created, repaired or removed, so it may run beside the plugin.

``-o table`` (default): one line per claim (DRIVER, CLAIM, UID, STATE, VERDICT, FINDINGS, NEEDS), then one line
per finding with its reason; ``-o json``: ``{node, bootID, stranded, drivers}``, each driver
``{driver, pluginDir, stranded, problems, notes, claims}``, each claim
``{driver, uid, namespace, name, state, verdict, findings: [{feature, reason}], needs}``.
Exit status: 0 when nothing would be stranded, 1 when something would (or a claim state is damaged, so records may
be missing), 2 on bad input (a plugins directory that does not exist, an unreadable or newer claim state).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from dradriver.config import PLUGIN_FLAGS, add_flags
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, GPU_DRIVER

_FLAGS = ("--node-name", "--kubelet-plugins-directory-path", "--proc-root")
_DRIVERS = (GPU_DRIVER, COMPUTE_DOMAIN_DRIVER)
PROG = "dradriver rollback-check"


def register(subparsers: Any) -> None:
    """Add the ``rollback-check`` subcommand (flags: ``--output``, the plugin's ``--node-name``,
    ``--kubelet-plugins-directory-path`` and ``--proc-root`` with their environment twins, ``--driver``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "rollback-check",
        help="tell whether rolling this node back to NVIDIA's driver would strand a claim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output", "-o", choices=("table", "json"), default="table",
                        help="table (default: a line per claim, then a line per finding) or json")
    add_flags(parser, [f for f in PLUGIN_FLAGS if f.option in _FLAGS])
    parser.add_argument("--driver", choices=("all", *(d.driver_name for d in _DRIVERS)), default="all",
                        help="whose claims to check: both kubelet plugins' (default) or one driver's")
    parser.set_defaults(func=run)


def format_report(reports: list[Any]) -> str:
    """The ``-o table`` text of :class:`~dradriver.kubeletplugin.rollbackcheck.DriverReport` objects."""
    from dradriver.commands.inspect import format_table

    rows: list[tuple[str, ...]] = [("DRIVER", "CLAIM", "UID", "STATE", "VERDICT", "FINDINGS", "NEEDS")]
    details: list[str] = []
    for report in reports:
        for claim in report.claims:
            label = f"{claim.namespace}/{claim.name}" if claim.name else "-"
            rows.append((claim.driver, label, claim.uid, claim.state, claim.verdict.value,
                         ",".join(f.feature.value for f in claim.findings) or "-", ",".join(claim.needs) or "-"))
            details += [f"{claim.driver} {label} ({claim.uid}): {f.feature.value}: {f.reason}" for f in claim.findings]
        details += [f"{report.driver}: problem: {p}" for p in report.problems]
        details += [f"{report.driver}: note: {n}" for n in report.notes]
    text = format_table(rows) if len(rows) > 1 else "no claims\n"
    return text + ("\n" + "".join(line + "\n" for line in details) if details else "")


def run(args: argparse.Namespace) -> int:
    """Check the chosen drivers' claims and print; returns 0 (nothing stranded), 1 (something) or 2 (bad input)."""
    from dradriver.commands._options import node_name_error
    from dradriver.host.claimstate import ClaimStateError, read_boot_id
    from dradriver.kubeletplugin.rollbackcheck import check_driver

    error = node_name_error(PROG, args.node_name) if args.node_name else None
    if error:
        print(error, file=sys.stderr)
        return 2
    plugins = Path(args.kubelet_plugins_directory_path)
    if not plugins.is_dir():
        print(f"{PROG}: error: --kubelet-plugins-directory-path (env KUBELET_PLUGINS_DIRECTORY_PATH) {plugins} is "
              "not a directory", file=sys.stderr)
        return 2
    boot_id = read_boot_id(Path(args.proc_root) / "sys" / "kernel" / "random" / "boot_id")
    reports = []
    for identity in _DRIVERS:
        if args.driver not in ("all", identity.driver_name):
            continue
        try:
            reports.append(check_driver(identity, plugins, boot_id))
        except (ClaimStateError, OSError) as exc:
            print(f"{PROG}: error: {identity.driver_name}: cannot read the claim state: {exc}", file=sys.stderr)
            return 2
    stranded = any(r.stranded for r in reports)
    node = args.node_name or socket.gethostname().strip().lower()
    if args.output == "json":
        doc = {"node": node, "bootID": boot_id, "stranded": stranded, "drivers": [r.to_json() for r in reports]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(f"# node {node}: a rollback to NVIDIA's driver "
                         f"{'would strand claims' if stranded else 'strands nothing'}\n" + format_report(reports))
    return 1 if stranded else 0
