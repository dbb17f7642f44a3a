"""``dradriver.logs``: klog's text header, the ``-v`` table, ``--vmodule``, split streams, JSON."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
from collections.abc import Iterator

import pytest

from dradriver import logs


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    yield
    logs.configure()


def _record(msg: str, level: int = logging.INFO, name: str = "dradriver.x", **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, level, "/src/dradriver/kubeletplugin/runner.py", 123, msg, (), None)
    record.created = 1_764_633_599.123456
    record.__dict__.update(extra)
    return record


def test_klog_header() -> None:
    line = logs.KlogFormatter().format(_record("prepared claim default/c1"))
    stamp = __import__("time").localtime(1_764_633_599)
    expected = (f"I{stamp.tm_mon:02d}{stamp.tm_mday:02d} {stamp.tm_hour:02d}:{stamp.tm_min:02d}:{stamp.tm_sec:02d}"
                f".123456 {os.getpid():7d} runner.py:123] prepared claim default/c1")
    assert line == expected


@pytest.mark.parametrize(("level", "letter"), [(logging.DEBUG, "I"), (logging.INFO, "I"), (logging.WARNING, "W"),
                                                (logging.ERROR, "E"), (logging.CRITICAL, "F")])
def test_klog_level_letters(level: int, letter: str) -> None:
    assert logs.KlogFormatter().format(_record("m", level)).startswith(letter)


def test_klog_extras_and_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed", logging.ERROR, claim="default/c1", attempt=2)
        record.exc_info = sys.exc_info()
    text = logs.KlogFormatter().format(record)
    first, *rest = text.splitlines()
    assert first.endswith('] failed claim="default/c1" attempt=2')
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: boom"


def test_json_has_caller() -> None:
    out = json.loads(logs.JsonFormatter().format(_record("m", claim="c")))
    assert out["caller"] == "runner.py:123" and out["msg"] == "m" and out["claim"] == "c"
    assert out["level"] == "info" and out["logger"] == "dradriver.x"


@pytest.mark.parametrize(("verbosity", "own", "other"), [
    (0, logging.INFO, logging.INFO), (3, logging.INFO, logging.INFO), (4, logging.DEBUG, logging.INFO),
    (5, logging.DEBUG, logging.INFO), (6, logging.DEBUG, logging.DEBUG), (10, logging.DEBUG, logging.DEBUG)])
def test_verbosity_table(verbosity: int, own: int, other: int) -> None:
    assert logs.thresholds("info", verbosity) == (own, other)


def test_log_level_still_raises_the_bar_and_debug_lowers_it() -> None:
    assert logs.thresholds("warning", 0) == (logging.WARNING, logging.WARNING)
    assert logs.thresholds("warning", 4) == (logging.DEBUG, logging.WARNING)
    assert logs.thresholds("debug", 0) == (logging.DEBUG, logging.DEBUG)
    with pytest.raises(ValueError, match="unknown log level"):
        logs.thresholds("loud", 0)


def _emit(config: logs.LoggingConfig) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    logs.setup(config, stdout=out, stderr=err)
    logging.getLogger("dradriver.kubeletplugin.runner").debug("own debug")
    logging.getLogger("urllib3.connectionpool").debug("library debug")
    logging.getLogger("dradriver.x").info("own info")
    logging.getLogger("dradriver.x").error("own error")
    return out.getvalue(), err.getvalue()


def test_setup_applies_verbosity_to_own_and_library_loggers() -> None:
    _, err = _emit(logs.LoggingConfig(verbosity=4, klog=True))
    assert "own debug" in err and "library debug" not in err and "own info" in err
    _, err = _emit(logs.LoggingConfig(verbosity=6, klog=True))
    assert "library debug" in err
    _, err = _emit(logs.LoggingConfig(verbosity=0, klog=True))
    assert "own debug" not in err and "own error" in err
    assert all(re.match(r"^[IWEF]\d{4} ", line) for line in err.splitlines())


def test_vmodule_raises_verbosity_of_matching_files_only() -> None:
    # The records come from this file (module test_logs): its pattern decides, whatever the logger's name.
    _, err = _emit(logs.LoggingConfig(verbosity=0, vmodule=(("test_l*", 6),), klog=True))
    assert "own debug" in err and "library debug" in err
    _, err = _emit(logs.LoggingConfig(verbosity=6, vmodule=(("test_logs", 0),), klog=True))
    assert "own debug" not in err and "library debug" not in err and "own info" in err


def test_split_stream_sends_errors_to_stderr_only() -> None:
    out, err = _emit(logs.LoggingConfig(split_stream=True, klog=True))
    assert "own info" in out and "own error" not in out
    assert "own error" in err and "own info" not in err


def test_plain_format_for_the_cli() -> None:
    _, err = _emit(logs.LoggingConfig())
    assert re.search(r" INFO dradriver\.x: own info$", err, re.MULTILINE), err
