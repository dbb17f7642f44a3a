"""``dradriver inspect``: print the ResourceSlices this node would publish.

Reads NVML (the system library, ``--nvml-library PATH``, or the bundled mock with ``--mock-profile NAME``),
discovers GPUs and MIG devices, and prints the ``resource.k8s.io/v1`` ResourceSlices as a YAML multi-document
stream (default) or a JSON list. GPUs left out by discovery and other warnings go to stderr and, in YAML,
also into comments at the top. Exit status: 0 on success, 1 when NVML cannot be loaded or initialised.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from dradriver.config import PLUGIN_FLAGS, add_flags

_FLAGS = ("--node-name", "--nvml-library", "--mock-profile", "--sysfs-root")


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand (flags: ``--output``, ``--node-name``, ``--nvml-library``,
    ``--mock-profile``, ``--sysfs-root``, each with its environment twin)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="print the ResourceSlices this node would publish",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument(
        "--output", "-o", choices=("yaml", "json"), default="yaml", help="output format (default yaml)"
    )
    add_flags(parser, [f for f in PLUGIN_FLAGS if f.option in _FLAGS])
    parser.set_defaults(func=run)


def _header(inventory: Any, node: str, slices: list[dict[str, Any]], notes: list[str]) -> list[str]:
    devices = sum(len(s["spec"]["devices"]) for s in slices)
    lines = [
        f"# node {node}: driver {inventory.versions.driver or '?'}, CUDA {inventory.versions.cuda_driver_text}, "
        f"{len(inventory.gpus)} GPU(s), {len(inventory.migs)} MIG device(s); {devices} device(s) in "
        f"{len(slices)} ResourceSlice(s)",
    ]
    if inventory.clique is not None:
        lines.append(f"# fabric clique: {inventory.clique.id}")
    lines += [f"# {note}" for note in notes]
    return lines


def run(args: argparse.Namespace) -> int:
    """Discover, build and print; returns the exit status."""
    import yaml

    from dradriver import _native
    from dradriver.domain.resourceslices import ResourceSliceError, build
    from dradriver.errors import DradriverError
    from dradriver.nvml.discovery import discover
    from dradriver.nvml.session import open_session

    node = args.node_name or socket.gethostname()
    try:
        _native.load_all()  # the hot paths must be there (or twins asked for): a loud error, not a slow path
        with open_session(args.nvml_library or "", args.mock_profile or "") as session:
            inventory = discover(session, sysfs_root=Path(args.sysfs_root or "/sys"))
    except DradriverError as exc:
        print(f"dradriver inspect: error: {exc}", file=sys.stderr)
        return 1
    try:
        result = build(inventory, node)
    except ResourceSliceError as exc:
        print(f"dradriver inspect: error: {exc}", file=sys.stderr)
        return 1

    notes = [
        f"discovery failure: GPU index {f.index}{f' ({f.uuid})' if f.uuid else ''} left out: {f.reason}"
        for f in inventory.failures
    ]
    notes += [f"warning: {w}" for w in (*inventory.warnings, *result.warnings)]
    for note in notes:
        print(f"dradriver inspect: {note}", file=sys.stderr)

    if args.output == "json":
        sys.stdout.write(json.dumps(result.slices, indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(_header(inventory, node, result.slices, notes)) + "\n")
        sys.stdout.write(yaml.safe_dump_all(result.slices, sort_keys=False, explicit_start=True))
    return 0
