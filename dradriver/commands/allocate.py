"""``dradriver allocate``: allocate ResourceClaims the way kube-scheduler's structured allocator does.

Reads multi-document YAML (files, or stdin for ``-``/no file) holding ResourceSlices, DeviceClasses,
ResourceClaims, ResourceClaimTemplates, Pods, Nodes; prints the claims with ``status.allocation`` filled in
(a YAML stream, or with ``-o json`` one ``v1`` ``List``).
Exit code 0 when every claim is allocated, 1 when some cannot be ("cannot allocate claim ns/name: ..." on
stderr), 2 on invalid input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``allocate`` subcommand."""
    parser = subparsers.add_parser(
        "allocate",
        help="allocate ResourceClaims against ResourceSlices like kube-scheduler (simulation)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="*", metavar="FILE", help="YAML files ('-' or none: stdin)")
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml",
                        help="format of the allocated claims: a YAML stream (default) or a JSON List")
    parser.set_defaults(func=run)


def read_inputs(files: list[str]) -> list[str]:
    """Texts of ``files`` (``-`` or an empty list reads stdin). :raises OSError: unreadable file."""
    texts = []
    for name in files or ["-"]:
        if name == "-":
            texts.append(sys.stdin.read())
        else:
            with open(name, encoding="utf-8") as handle:
                texts.append(handle.read())
    return texts


def run(args: argparse.Namespace) -> int:
    """Allocate and print the claims as YAML; return the exit code."""
    from dradriver.allocator.simulation import dump, load, simulate
    from dradriver.errors import DradriverError

    try:
        inputs = load(read_inputs(args.files))
        outcome = simulate(inputs)
    except OSError as exc:
        print(f"dradriver allocate: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except DradriverError as exc:
        print(f"dradriver allocate: {exc}", file=sys.stderr)
        return 2
    if outcome.claims and getattr(args, "output", "yaml") == "json":
        import json

        sys.stdout.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": outcome.claims}, indent=2) + "\n")
    elif outcome.claims:
        sys.stdout.write(dump(outcome.claims))
    for failure in outcome.failures:
        print(failure, file=sys.stderr)
    return 1 if outcome.failures else 0
