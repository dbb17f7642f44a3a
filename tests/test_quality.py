"""Static checks that gate every change: ruff (lint), mypy (types), import-linter (layer rules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean() -> None:
    proc = _run("ruff", "check", "dradriver", "tests", "bench", "tools", "setup.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_is_clean() -> None:
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_layer_rules_hold() -> None:
    proc = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout
