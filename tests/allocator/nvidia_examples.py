"""NVIDIA's example manifests (``fixtures/nvidia/``, copied with their provenance in each file's header), the
DeviceClasses we deploy, and ResourceSlices as ``dradriver inspect`` prints them: the input of the tests that
allocate the examples."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from dradriver.cli import main

REPO = Path(__file__).resolve().parents[2]
NVIDIA = Path(__file__).resolve().parent / "fixtures" / "nvidia"
CLASSES = (REPO / "deploy" / "kustomize" / "base" / "deviceclasses.yaml").read_text()


def example(name: str) -> str:
    """The text of ``fixtures/nvidia/<name>``."""
    return (NVIDIA / name).read_text()


def inspected(*args: str) -> list[dict[str, Any]]:
    """The slices ``dradriver inspect <args> -o json`` prints, each given a name (as the API server would)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["inspect", *args, "-o", "json"]) == 0
    slices: list[dict[str, Any]] = json.loads(printed.getvalue())
    for i, s in enumerate(slices):
        s["metadata"] = {"name": f"{s['spec']['nodeName']}-{s['spec']['driver']}-{i}"}
    return slices
