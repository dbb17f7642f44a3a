"""The wheel the container image installs, built the way ``deploy/container/Dockerfile`` builds it.

The Dockerfile runs ``pip wheel --no-deps .`` on a build context filtered by ``.dockerignore``. This test
copies the repository through the same filter and runs the same command, with ``--no-build-isolation`` so
that it uses the build requirements already installed from ``[build-system]`` instead of downloading them
again (the image build does download them). Then it checks that the wheel carries every compiled part and
that the compiled modules import from the installed wheel alone.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dradriver.nvml import mock
from dradriver.sandbox.standins.nv_fabricmanager import mock_library_path as mock_fm_library_path
from tools import build_support

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "container" / "Dockerfile"


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's matching for the patterns we use: ``**/x`` at any depth, anything else from the root."""
    for pattern in patterns:
        if pattern.startswith("**/"):
            tail = pattern[3:]
            if fnmatch.fnmatch(rel, tail) or fnmatch.fnmatch(rel, "*/" + tail):
                return True
        elif fnmatch.fnmatch(rel, pattern) or rel.startswith(pattern.rstrip("/") + "/"):
            return True
    return False


def copy_build_context(dest: Path) -> None:
    """Copy the repository into ``dest`` as ``docker build`` would send it (``.dockerignore`` applied)."""
    patterns = dockerignore_patterns()
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO).as_posix()
        prefix = "" if rel_root == "." else rel_root + "/"
        dirs[:] = [d for d in dirs if not _ignored(prefix + d, patterns)]
        for name in files:
            rel = prefix + name
            if not _ignored(rel, patterns):
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(root) / name, target)


def test_dockerfile_builds_the_wheel_with_pip_wheel_no_deps() -> None:
    text = DOCKERFILE.read_text()
    assert "pip wheel --no-cache-dir --no-deps -w /wheels ." in text
    assert "FROM ${PYTHON_IMAGE} AS runtime" in text and 'ENTRYPOINT ["dradriver"]' in text
    # The runtime stage installs from the built wheels only: no compiler and no index.
    runtime = text.split("AS runtime", 1)[1]
    assert "--no-index" in runtime and "apt-get" not in runtime


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("context")
    out = tmp_path_factory.mktemp("wheels")
    copy_build_context(src)
    assert not (src / "tests").exists() and not (src / ".venv").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("DRADRIVER_NO_EXTENSIONS", "DRADRIVER_DEBUG")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "-w",
            str(out),
            ".",
        ],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (built,) = out.glob("dradriver-*.whl")
    return built


@pytest.mark.slow
def test_wheel_carries_the_compiled_modules_and_the_mock_library(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    # Platform wheel: it holds native code.
    assert "-none-any" not in wheel.name
    for module in build_support.CYTHON_MODULES:
        compiled = [n for n in names if fnmatch.fnmatch(n, f"dradriver/_native/{module}.cpython-*.so")]
        assert compiled, f"compiled module dradriver._native.{module} missing from {wheel.name}"
    # The mock NVML library: whenever the setup command built it into the tree, the wheel must carry it too
    # (the image's `--mock-profile` runs on it).
    try:
        in_tree = mock.library_path()
    except mock.MockNvmlError:
        in_tree = None
    if in_tree is not None:
        assert in_tree.relative_to(REPO).as_posix() in names
    fm_mock = mock_fm_library_path()  # the mock libnvfm.so.1 (ext/mocknvfm), built by the same setup command
    if fm_mock.is_file():
        assert fm_mock.relative_to(REPO).as_posix() in names
    profiles = {Path(n).stem for n in names if n.startswith("dradriver/nvml/profiles/") and n.endswith(".json")}
    assert profiles == {p.stem for p in (REPO / "dradriver" / "nvml" / "profiles").glob("*.json")}
    assert "dradriver = dradriver.cli:main" in entry_points
    assert "gpu-kubelet-plugin = dradriver.commands.gpu_kubelet_plugin:main" in entry_points
    assert not any(n.startswith(("tests/", "deploy/", "bench/")) for n in names)


@pytest.mark.slow
def test_compiled_modules_import_from_the_wheel(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        check=True,
        timeout=120,
    )
    modules = [f"dradriver._native.{m}" for m in build_support.CYTHON_MODULES]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    mod = importlib.import_module(name)\n"
        f"    assert mod.__file__.startswith({str(target)!r}), mod.__file__\n"
        "    assert mod.__file__.endswith('.so'), mod.__file__\n"
        "print('ok')\n"
    )
    # Run from an empty directory with only the wheel's files ahead of site-packages: no in-tree build.
    env = {k: v for k, v in os.environ.items() if k != "DRADRIVER_NO_EXTENSIONS"}
    env["PYTHONPATH"] = str(target)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
