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


def node_name_error(prog: str, value: str) -> str | None:
    """The one line ``prog`` prints for a ``--node-name`` that the API server would refuse as a Node's name
    (an RFC 1123 subdomain, :func:`dradriver.domain.names.dns_subdomain_problems`), or ``None`` when it is
    valid: ``dradriver sandbox: --node-name 'Bad_Name!' is not a valid Node name: a lowercase RFC 1123 ...``."""
    from dradriver.domain.names import dns_subdomain_problems

    problems = dns_subdomain_problems(value)
    if not problems:
        return None
    return f"{prog}: --node-name {value!r} is not a valid Node name: {'; '.join(problems)}"
