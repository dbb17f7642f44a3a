"""``dradriver feature-gates``: NVIDIA's feature gates, their defaults, and what dradriver does with each.

The kubelet plugin takes them as ``--feature-gates``/``FEATURE_GATES`` in NVIDIA's syntax
(``Name=true,Other=false,``). A gate marked "not implemented" may only be set to NVIDIA's default; any other
value stops the plugin at start-up with an error naming the gate.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``feature-gates`` subcommand."""
    parser = subparsers.add_parser(
        "feature-gates",
        help="list NVIDIA's feature gates and dradriver's support for each",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one line per gate (name, NVIDIA's default, dradriver's default, stage, support); exit code 0."""
    from dradriver.domain.featuregates import GATES

    if args.output == "json":
        print(json.dumps([{"name": g.name, "nvidiaDefault": g.nvidia_default, "default": g.effective_default,
                           "stage": g.stage, "support": g.support.value, "summary": g.summary, "note": g.note}
                          for g in GATES], indent=2))
        return 0
    rows = [("GATE", "NVIDIA", "DRADRIVER", "STAGE", "SUPPORT")]
    rows += [(g.name, str(g.nvidia_default).lower(), str(g.effective_default).lower(), g.stage, g.support.value)
             for g in GATES]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0
