"""What NVIDIA-named entry points share: the executable's own parser, klog logging, the start-up log.

NVIDIA's chart runs its binaries by name (``gpu-kubelet-plugin -v $(LOG_VERBOSITY)``, NVIDIA's chart
``deployments/helm/dra-driver-nvidia-gpu/templates/``).
dradriver's image provides each as a console script whose ``main`` is :func:`console_main` with the component's
flags and run function; the same component is also a ``dradriver`` subcommand of the same name:
``gpu-kubelet-plugin`` (:mod:`dradriver.commands.gpu_kubelet_plugin`), ``compute-domain-kubelet-plugin``
(:mod:`dradriver.commands.compute_domain_kubelet_plugin`, flags :data:`dradriver.config.COMPUTE_DOMAIN_PLUGIN_FLAGS`)
and ``compute-domain-daemon`` (:mod:`dradriver.commands.compute_domain_daemon`, whose ``run``/``check``
subcommands need its own ``main`` around :func:`build_parser`). ``compute-domain-controller`` calls
:func:`console_main` the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dradriver import __version__, config, logs
from dradriver.domain.featuregates import FeatureGates
from dradriver.errors import DradriverError

CLOSED_PIPE_STATUS = 128 + signal.SIGPIPE
"""141: the status a shell reports for a process that SIGPIPE ended, what ``yes | head -1`` leaves behind."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals that end a component cleanly (the kubelet's and the container runtime's stop signals)."""


def stop_on_signals(stop: asyncio.Event | threading.Event) -> None:
    """Set ``stop`` on any of :data:`STOP_SIGNALS`: through the running event loop for an :class:`asyncio.Event`
    (call it inside the loop), through ``signal.signal`` for a :class:`threading.Event` (main thread only)."""
    if isinstance(stop, asyncio.Event):
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
    else:
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda *_: stop.set())


INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that end a command run to completion (``demo``) early, its cleanup done: Ctrl-C and ``kill``."""


class Interrupted(KeyboardInterrupt):
    """One of :data:`INTERRUPT_SIGNALS` arrived (:func:`interrupted_by_signals`). A :class:`KeyboardInterrupt`, so
    no ``except Exception`` on the way swallows it and asyncio lets it out of the event loop.

    :param signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_status(self) -> int:
        """``128 + signum``: 130 for SIGINT, 143 for SIGTERM, what a shell reports for a process the signal ended."""
        return 128 + self.signum


@contextlib.contextmanager
def interrupted_by_signals(signals: Sequence[int] = INTERRUPT_SIGNALS) -> Iterator[None]:
    """Inside, the first of ``signals`` raises :class:`Interrupted` in the main thread, wherever it is (a wait, the
    event loop of ``asyncio.run``, whose tasks are then cancelled and their cleanup awaited); later ones are
    ignored so the cleanup that the exception unwinds through is not cut short. The previous handlers are back
    on exit.

    A signal the process inherited as ignored (SIGINT of a job a non-interactive shell started with ``&``) is
    caught too, as Go's ``signal.Notify`` does: a command that says "Ctrl-C stops it" is stopped by it.
    Main thread only (``signal.signal``).
    """
    fired: list[int] = []

    def interrupt(signum: int, _frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stdout_closed() -> bool:
    """Whether standard output is a pipe or socket whose reader has gone (``poll`` reports ``POLLERR`` or
    ``POLLHUP`` for it); ``False`` for a file, a terminal, or a stream without a descriptor (pytest's capture)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def exit_quietly_on_closed_stdout(body: Callable[[], int]) -> int:
    """``body()``'s exit status, with its output flushed; :data:`CLOSED_PIPE_STATUS` and no traceback when the
    reader of standard output went away (``dradriver inspect | head -1``).

    Python ignores SIGPIPE, so a write to a closed pipe raises :class:`BrokenPipeError` wherever the command
    happens to be; this is the one place every command and console script meets it. Standard output is then
    pointed at ``/dev/null`` so the interpreter's final flush of what is still buffered cannot fail a second
    time (the recipe in the Python documentation, "Note on SIGPIPE" in the ``signal`` module). A
    :class:`BrokenPipeError` from anything else (a socket, a child's pipe) is not swallowed. ``SystemExit``
    (``--help``, argparse's usage errors) passes through after the flush.
    """
    try:
        try:
            return body()
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        if not stdout_closed():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return CLOSED_PIPE_STATUS


def build_parser(prog: str, description: str, flags: Sequence[config.Flag]) -> argparse.ArgumentParser:
    """The parser of executable ``prog``: ``flags`` plus klog's logging flags and ``--version``.

    :raises dradriver.errors.FlagError: an environment twin holds a malformed value.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"{prog} (dradriver {__version__})")
    add_component_flags(parser, flags)
    return parser


def add_component_flags(parser: argparse.ArgumentParser, flags: Sequence[config.Flag]) -> None:
    """Add ``flags`` and :data:`~dradriver.config.LOGGING_FLAGS` to ``parser`` (a subcommand's or an executable's).

    :raises dradriver.errors.FlagError: an environment twin holds a malformed value.
    """
    config.add_flags(parser, (*flags, *config.LOGGING_FLAGS))


def start_logging(prog: str, args: argparse.Namespace, gates: FeatureGates) -> None:
    """klog-format logging from the parsed flags (:func:`dradriver.config.logging_config_from_args`), then a
    warning for each NVIDIA variable that is set but inert here (:func:`dradriver.config.inert_environment`).

    :raises dradriver.errors.FlagError: a logging flag cannot be honoured.
    """
    logs.setup(config.logging_config_from_args(args, gates, klog=True))
    log = logging.getLogger(f"dradriver.{prog}")
    for warning in config.inert_environment():
        log.warning("%s", warning)


def console_main(prog: str, description: str, flags: Sequence[config.Flag],
                 run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) for executable ``prog`` and return ``run(args)``.

    A malformed environment variable ends the process with status 2 and one line on stderr, as argparse does
    for a malformed flag; a closed standard output ends it quietly (:func:`exit_quietly_on_closed_stdout`).
    """
    def body() -> int:
        try:
            parser = build_parser(prog, description, flags)
        except DradriverError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        return run(parser.parse_args(argv))

    return exit_quietly_on_closed_stdout(body)
