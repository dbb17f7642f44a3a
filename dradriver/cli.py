"""Command-line entry point: ``dradriver <command>`` and ``python -m dradriver <command>``.

Every module in :mod:`dradriver.commands` that defines ``register(subparsers)`` contributes one
subcommand; the module's ``run(args)`` returns the process exit code. Descriptions often come from module
docstrings written in reStructuredText; :func:`plain` renders them as plain text for ``--help``. A flag a
subcommand does not know is reported with that subcommand's usage, not the top-level one.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
from collections.abc import Sequence

from dradriver import __version__, commands
from dradriver.commands._entrypoint import exit_quietly_on_closed_stdout
from dradriver.errors import DradriverError

# reST inline markup found in docstrings: roles (:class:`~a.b.C`, :func:`text <target>`), ``literals``,
# `interpreted text`, and a trailing "::" that introduces a literal block.
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`]*)`")
_LITERAL = re.compile(r"``(.+?)``")
_INTERPRETED = re.compile(r"(?<![`\w])`([^`]+)`(?![`\w])")


def _role_text(match: re.Match[str]) -> str:
    text = match.group(1)
    labelled = re.fullmatch(r"(.+?)\s*<[^>]+>", text)
    if labelled:
        return labelled.group(1)
    if text.startswith("~"):
        return text[1:].rsplit(".", 1)[-1]
    return text


def plain(text: str | None) -> str | None:
    """``text`` with reST inline markup removed: ``:class:`~a.B``` -> ``B``, ````x```` -> ``x``,
    ```x``` -> ``x``, a paragraph-ending ``::`` -> ``:``. ``None`` stays ``None``."""
    if text is None:
        return None
    text = _ROLE.sub(_role_text, text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    return re.sub(r"(\S)::(\s*(?:\n|$))", r"\1:\2", text)


def _plain_help(parser: argparse.ArgumentParser) -> None:
    parser.description = plain(parser.description)
    parser.epilog = plain(parser.epilog)
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain(action.help)


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
    for action in subparsers._choices_actions:
        if isinstance(action.help, str):
            action.help = plain(action.help)
    for sub in subparsers.choices.values():
        _plain_help(sub)
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    """The subparser of ``command`` in a parser from :func:`build_parser`, or ``None``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser | None = action.choices.get(command)
            return found
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the chosen command and return its exit code.

    A malformed environment twin of a flag (read while the parsers are built) ends with status 2 and one line;
    an unknown flag exits with status 2 and the usage of the subcommand it was given to; a reader of standard
    output that goes away (``dradriver inspect | head -1``) ends any command quietly with status 141
    (:func:`~dradriver.commands._entrypoint.exit_quietly_on_closed_stdout`).
    """
    return exit_quietly_on_closed_stdout(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()
    except DradriverError as exc:
        print(f"dradriver: {exc}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help(sys.stderr)
        return 2
    if extra:
        sub = subcommand_parser(parser, args.command) or parser
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    result: int = args.func(args)
    return result
