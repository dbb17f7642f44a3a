"""Logging set-up: klog's text format for the kubelet plugin, one JSON object per line on request.

Formats (``--log-format``/``LOG_FORMAT``, also NVIDIA's component-base spelling ``--logging-format``/
``LOGGING_FORMAT``):

* ``text`` for the kubelet plugin (``gpu-kubelet-plugin`` and ``dradriver gpu-kubelet-plugin``): klog's header
  format, as NVIDIA's binaries write it, so an operator's grep and log pipelines keep working after the switch::

      I1201 23:59:59.123456   12345 runner.py:123] prepared claim default/c1
      ^    ^                  ^     ^            ^
      |    |                  |     |            message, then key="value" for structured extras
      |    |                  |     Python file:line of the call
      |    |                  process id, right-aligned in 7 columns (klog's "threadid" is the pid)
      |    month, day, local time with microseconds
      I info (also debug), W warning, E error, F critical

* ``text`` for every other ``dradriver`` subcommand (``inspect``, ``demo``, ``sandbox``, ...): the plain
  ``<time> <LEVEL> <logger>: <message>`` lines people read at a terminal (:data:`PLAIN`); those commands are
  dradriver's own and no NVIDIA pipeline parses them.
* ``json``: ``{"ts", "level", "logger", "caller", "msg", ...extras, "exc"}`` per line (:class:`JsonFormatter`).

Verbosity (``-v N``/``V``, klog's flag; NVIDIA's chart passes ``-v $(LOG_VERBOSITY)``, default 4). klog shows a
``V(n)`` message when ``-v >= n``; Kubernetes' logging conventions put debug detail at 4 and HTTP request detail
at 6, and NVIDIA's chart documents its levels the same way (API request/response detail at 6). Python has
levels rather than numbers, so ``-v`` lowers thresholds on top of ``--log-level`` (default ``info``):

======  ==========================  ===================================================
``-v``  ``dradriver.*`` loggers     every other logger (kubernetes, urllib3, grpc, ...)
======  ==========================  ===================================================
0-3     ``--log-level``             ``--log-level``
4-5     debug                       ``--log-level``
6+      debug                       debug (urllib3 logs each HTTP request, as client-go at 6)
======  ==========================  ===================================================

``--vmodule pattern=N,...`` (klog's, text format only) applies that table with ``N`` to records whose Python
file name without ``.py`` matches the glob ``pattern`` (klog matches Go file names the same way).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}

#: The format of the ``dradriver`` CLI's own subcommands.
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: ``-v`` from which dradriver's debug records are shown (klog/Kubernetes convention: V(4) is debug).
DEBUG_VERBOSITY = 4
#: ``-v`` from which other libraries' debug records are shown (client-go logs HTTP round trips at V(6)).
LIBRARY_DEBUG_VERBOSITY = 6

LEVELS = ("debug", "info", "warning", "error")


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}


class KlogFormatter(logging.Formatter):
    """klog's text header: ``Lmmdd hh:mm:ss.uuuuuu <pid, 7 wide> file:line] msg key="value" ...``.

    Level letters as klog's: ``I`` for info and debug, ``W``, ``E``, ``F`` (critical). The time is local, as
    klog writes it. Extras passed with ``extra=`` follow the message as ``key=value`` (strings quoted, as klog's
    structured logging does); a traceback follows on the next lines.
    """

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.CRITICAL:
            letter = "F"
        elif record.levelno >= logging.ERROR:
            letter = "E"
        elif record.levelno >= logging.WARNING:
            letter = "W"
        else:
            letter = "I"
        stamp = time.localtime(record.created)
        micros = min(999_999, round((record.created - int(record.created)) * 1_000_000))
        out = (f"{letter}{stamp.tm_mon:02d}{stamp.tm_mday:02d} {stamp.tm_hour:02d}:{stamp.tm_min:02d}:"
               f"{stamp.tm_sec:02d}.{micros:06d} {record.process or os.getpid():7d} "
               f"{os.path.basename(record.pathname)}:{record.lineno}] {record.getMessage()}")
        for key, value in _extras(record).items():
            rendered = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else str(value)
            out += f" {key}={rendered}"
        if record.exc_info:
            out += "\n" + self.formatException(record.exc_info)
        return out


class JsonFormatter(logging.Formatter):
    """Formats a record as ``{"ts", "level", "logger", "caller", "msg", ...extra fields, "exc"}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "caller": f"{os.path.basename(record.pathname)}:{record.lineno}",
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            out[key] = value if isinstance(value, str | int | float | bool | type(None)) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """How a process logs.

    :param level: ``debug``, ``info``, ``warning`` or ``error`` (``--log-level``).
    :param format: ``text`` or ``json``.
    :param verbosity: klog's ``-v`` (>= 0).
    :param vmodule: ``(glob pattern, verbosity)`` pairs from ``--vmodule``.
    :param split_stream: errors to stderr, everything else to stdout (``--log-text-split-stream`` /
        ``--log-json-split-stream``); otherwise one stream, stderr.
    :param klog: ``text`` means klog's header format (the kubelet plugin) rather than :data:`PLAIN`.
    """

    level: str = "info"
    format: str = "text"
    verbosity: int = 0
    vmodule: tuple[tuple[str, int], ...] = ()
    split_stream: bool = False
    klog: bool = False


def thresholds(level: str, verbosity: int) -> tuple[int, int]:
    """``(dradriver loggers, other loggers)`` Python levels for ``--log-level`` and ``-v`` (table above)."""
    base = logging.getLevelName(level.upper())
    if not isinstance(base, int):
        raise ValueError(f"unknown log level {level!r} (one of {', '.join(LEVELS)})")
    own = min(base, logging.DEBUG) if verbosity >= DEBUG_VERBOSITY else base
    other = min(base, logging.DEBUG) if verbosity >= LIBRARY_DEBUG_VERBOSITY else base
    return own, other


def _is_own(name: str) -> bool:
    return name == "dradriver" or name.startswith("dradriver.")


class _VmoduleFilter(logging.Filter):
    """Per-record thresholds: ``--vmodule`` verbosity for matching files, ``-v`` for the rest."""

    def __init__(self, config: LoggingConfig) -> None:
        super().__init__()
        self._config = config
        self._default = thresholds(config.level, config.verbosity)
        self._cache: dict[str, tuple[int, int]] = {}

    def _for_module(self, module: str) -> tuple[int, int]:
        found = self._cache.get(module)
        if found is None:
            found = self._default
            for pattern, verbosity in self._config.vmodule:
                if fnmatch.fnmatchcase(module, pattern):
                    found = thresholds(self._config.level, verbosity)
                    break
            self._cache[module] = found
        return found

    def filter(self, record: logging.LogRecord) -> bool:
        own, other = self._for_module(record.module)
        return record.levelno >= (own if _is_own(record.name) else other)


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def _formatter(config: LoggingConfig) -> logging.Formatter:
    if config.format == "json":
        return JsonFormatter()
    return KlogFormatter() if config.klog else logging.Formatter(PLAIN)


def _handlers(config: LoggingConfig, stdout: TextIO, stderr: TextIO) -> Sequence[logging.Handler]:
    if not config.split_stream:
        return [logging.StreamHandler(stderr)]
    errors = logging.StreamHandler(stderr)
    errors.setLevel(logging.ERROR)
    infos = logging.StreamHandler(stdout)
    infos.addFilter(_BelowError())
    return [infos, errors]


def setup(config: LoggingConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
    """Configure the root and ``dradriver`` loggers for the process (idempotent; replaces earlier handlers).

    :raises ValueError: an unknown level name.
    """
    own, other = thresholds(config.level, config.verbosity)
    handlers = _handlers(config, stdout or sys.stdout, stderr or sys.stderr)
    formatter = _formatter(config)
    for handler in handlers:
        handler.setFormatter(formatter)
        if config.vmodule:
            handler.addFilter(_VmoduleFilter(config))
    if config.vmodule:  # records must reach the filter, which decides per file
        levels = [thresholds(config.level, v) for _, v in config.vmodule]
        own = min([own, *(o for o, _ in levels)])
        other = min([other, *(t for _, t in levels)])
    root = logging.getLogger()
    root.handlers[:] = list(handlers)
    root.setLevel(other)
    logging.getLogger("dradriver").setLevel(own)


def configure(level: str = "info", fmt: str = "text", *, klog: bool = False, verbosity: int = 0) -> None:
    """Configure the process's logging from a level and a format (see :func:`setup`).

    :param level: ``debug``, ``info``, ``warning`` or ``error``.
    :param fmt: ``text`` or ``json``.
    :param klog: ``text`` is klog's header format rather than :data:`PLAIN`.
    :param verbosity: klog's ``-v``.
    """
    setup(LoggingConfig(level=level, format=fmt, verbosity=verbosity, klog=klog))
