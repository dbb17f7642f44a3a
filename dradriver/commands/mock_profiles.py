"""``dradriver mock-profiles``: list the bundled mock NVML node profiles, one line each with its description.

Each name can be given to ``--mock-profile`` (for example ``dradriver inspect --mock-profile dgx-a100``) or to
``dradriver sandbox --profile``/``dradriver demo --profile``; the profiles live in ``dradriver/nvml/profiles/``
and their format (the ``description`` field included) is described in ``ext/mocknvml/README.md``.
Output (``-o``): ``table`` (default; NAME, GPUS, DESCRIPTION), ``name`` (names only) or ``json``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``mock-profiles`` subcommand."""
    parser = subparsers.add_parser(
        "mock-profiles",
        help="list the bundled mock NVML node profiles",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-o", "--output", choices=("table", "name", "json"), default="table",
                        help="output format (default table)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the bundled profiles; exit code 0, 1 when a profile file cannot be read."""
    import sys

    from dradriver.nvml import mock

    rows: list[dict[str, Any]] = []
    for name in mock.profile_names():
        try:
            profile = mock.load_profile(name)
        except mock.MockNvmlError as exc:
            print(f"dradriver mock-profiles: error: {exc}", file=sys.stderr)
            return 1
        rows.append({"name": name, "gpus": len(profile.get("gpus") or []),
                     "description": " ".join(str(profile.get("description") or "").split())})
    if args.output == "name":
        for row in rows:
            print(row["name"])
    elif args.output == "json":
        print(json.dumps(rows, indent=2))
    else:
        table = [("NAME", "GPUS", "DESCRIPTION"), *((r["name"], str(r["gpus"]), r["description"]) for r in rows)]
        widths = [max(len(row[i]) for row in table) for i in range(2)]
        for name, gpus, description in table:
            print(f"{name.ljust(widths[0])}  {gpus.ljust(widths[1])}  {description}".rstrip())
    return 0
