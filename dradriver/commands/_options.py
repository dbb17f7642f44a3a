"""Options shared by several subcommands (a module whose name starts with ``_`` registers no subcommand)."""

from __future__ import annotations

import argparse


def add_output_alias(parser: argparse.ArgumentParser) -> None:
    """Add ``-o FORMAT`` to a long-running command: the same as its ``--log-format`` (the only output such a
    command writes), with the same choices; given neither, ``--log-format``'s default and environment twin
    apply.

    :raises ValueError: ``parser`` has no ``--log-format`` option.
    """
    for action in parser._actions:
        if action.dest == "log_format":
            parser.add_argument("-o", "--output", dest="log_format", choices=action.choices,
                                default=argparse.SUPPRESS, help="log output format; the same as --log-format")
            return
    raise ValueError(f"{parser.prog}: no --log-format option to alias with -o")
