"""``dradriver explain``: why each ResourceClaim gets the devices it gets, or why it stays pending.

Same input as ``dradriver allocate``. For every claim and request it prints what is asked, in words, then
every candidate device with the first selector, constraint, taint or other reason that rejected it and the
value it saw (``gpu-1  rejected by request selector #1: memory 24Gi < 40Gi``), or ``accepted``; a selector
that reads an attribute a device does not publish is named with the attribute and the devices. Then one
line per Pod: scheduled where, or pending and why (an extended resource such as ``nvidia.com/gpu`` that no
DeviceClass maps and no device plugin offers). Unused objects and what workloads became come first.
With ``-o json`` the same text comes as a list of lines in one JSON object, beside the allocated claims and
the failures (``{"allocatable", "claims", "failures", "explanation"}``).
Exit code 0 when every claim can be allocated, 1 when some cannot, 2 on invalid input or nothing to explain
(the same cases as ``dradriver allocate``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``explain`` subcommand."""
    parser = subparsers.add_parser(
        "explain",
        help="explain, device by device, how ResourceClaims would be allocated",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="*", metavar="FILE", help="YAML files ('-' or none: stdin)")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="text (default) or one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the explanation; return the exit code."""
    from dradriver.allocator.simulation import explain, load, simulate
    from dradriver.commands.allocate import read_inputs
    from dradriver.errors import DradriverError

    try:
        inputs = load(*read_inputs(args.files))
        text, code = explain(inputs)
        if args.output == "json":
            import json

            outcome = simulate(inputs)
            text = json.dumps({"allocatable": code == 0, "claims": outcome.claims, "failures": outcome.failures,
                               "explanation": text.splitlines()}, indent=2) + "\n"
    except OSError as exc:
        print(f"dradriver explain: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except DradriverError as exc:
        print(f"dradriver explain: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return code
