"""Command-line entry point: ``dradriver <command>`` and ``python -m dradriver <command>``.

Every module in :mod:`dradriver.commands` that defines ``register(subparsers)`` contributes one
subcommand; the module's ``run(args)`` returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from dradriver import __version__, commands
from dradriver.errors import DradriverError


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one subparser per module of :mod:`dradriver.commands`."""
    parser = argparse.ArgumentParser(
        prog="dradriver",
        description="Kubernetes DRA driver for NVIDIA GPUs (driver gpu.nvidia.com).",
    )
    parser.add_argument("--version", action="version", version=f"dradriver {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the chosen command and return its exit code.

    A malformed environment twin of a flag (read while the parsers are built) ends with status 2 and one line.
    """
    try:
        parser = build_parser()
    except DradriverError as exc:
        print(f"dradriver: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    result: int = args.func(args)
    return result
