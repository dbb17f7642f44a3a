"""``dradriver mock-profiles``: list the bundled mock NVML node profiles, one name per line.

Each name can be given to ``--mock-profile`` (for example ``dradriver inspect --mock-profile dgx-a100``); the
profiles live in ``dradriver/nvml/profiles/`` and their format is described in ``ext/mocknvml/README.md``.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``mock-profiles`` subcommand."""
    parser = subparsers.add_parser(
        "mock-profiles",
        help="list the bundled mock NVML node profiles",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print every bundled profile name on its own line; exit code 0."""
    from dradriver.nvml import mock

    for name in mock.profile_names():
        print(name)
    return 0
