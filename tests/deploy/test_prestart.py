"""``deploy/container/kubelet-plugin-prestart.sh``, the init container of NVIDIA's chart, run with bash.

The driver root is a fake one laid out by the test: the mock ``libnvidia-ml.so.1`` (a real ELF object, so
``LD_PRELOAD`` loads it) and an ``nvidia-smi`` stand-in that answers ``--version`` as the real one does once its
driver is ready, and fails before (as while the GPU Operator's driver container is still installing). The script
reports once and never keeps the plugin from starting.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dradriver.nvml import mock

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "container" / "kubelet-plugin-prestart.sh"

#: The stand-in: refuses to run without LD_PRELOAD naming a file, or with any other variable set (the script
#: must clear the environment, as ``env -i``), or before ``<root>/.ready`` exists; then prints the version.
NVIDIA_SMI = """#!/bin/sh
if [ -z "${LD_PRELOAD:-}" ] || [ ! -f "$LD_PRELOAD" ]; then echo "NVML library not preloaded" >&2; exit 9; fi
if [ -n "${HOME:-}" ] || [ -n "${PATH_MARKER:-}" ]; then echo "environment not cleared" >&2; exit 8; fi
if [ "$1" != "--version" ]; then echo "unexpected arguments: $*" >&2; exit 7; fi
if [ ! -e "@ROOT@/.ready" ]; then
  echo "Failed to initialize NVML: Driver/library version mismatch" >&2
  exit 18
fi
echo "NVIDIA-SMI version  : 570.148.08"
echo "NVML version        : 570.148"
echo "DRIVER version      : 570.148.08"
"""


def lay_out_driver(root: Path, *, libdir: str = "usr/lib/x86_64-linux-gnu", bindir: str = "usr/bin") -> None:
    """The mock NVML library and the nvidia-smi stand-in under ``root``."""
    (root / libdir).mkdir(parents=True, exist_ok=True)
    shutil.copy(mock.library_path(), root / libdir / "libnvidia-ml.so.1")
    smi = root / bindir / "nvidia-smi"
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text(NVIDIA_SMI.replace("@ROOT@", str(root)))
    smi.chmod(0o755)


class Prestart:
    """The script running in the background; :meth:`finish` collects its log lines."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def finish(self) -> int:
        """Read the rest and return the exit status."""
        code = self.proc.wait(timeout=60)
        while (line := self._queue.get(timeout=60)) is not None:
            self.lines.append(line)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


Starter = Callable[..., Prestart]


@pytest.fixture
def run_prestart(tmp_path: Path) -> Iterator[Callable[..., Prestart]]:
    started: list[Prestart] = []

    def start(driver_root: str, **extra: str) -> Prestart:
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PATH_MARKER": "set",
               "NVIDIA_DRIVER_ROOT": driver_root, "DRIVER_ROOT_PARENT": str(tmp_path / "parent"),
               "DRIVER_ROOT_LINK": str(tmp_path / "driver-root"), **extra}
        prestart = Prestart(env)
        started.append(prestart)
        return prestart

    yield start
    for prestart in started:
        prestart.kill()


def test_an_absent_driver_does_not_keep_the_plugin_from_starting(run_prestart: Starter, tmp_path: Path) -> None:
    """A driver reinstall evicts the GPU pods: the plugin must start to unprepare their claims, so the init
    container reports the missing driver (and the chart value to check) and exits 0 at once."""
    parent = tmp_path / "parent"  # the host's /run/nvidia, mounted at /driver-root-parent; no driver mounted
    parent.mkdir()
    prestart = run_prestart("/run/nvidia/driver")
    assert prestart.finish() == 0, "\n".join(prestart.lines)
    log = "\n".join(prestart.lines)
    assert "nvidia-smi not found" in log and "libnvidia-ml.so.1 not found" in log
    hint = next(line for line in prestart.lines if "hint:" in line)
    assert "/run/nvidia/driver" in hint and "nvidiaDriverRoot" in hint
    assert "starting the plugin without the driver" in log


def test_a_driver_that_does_not_answer_yet_does_not_keep_the_plugin_from_starting(run_prestart: Starter,
                                                                                 tmp_path: Path) -> None:
    """The driver's files are there but its module is not usable (nvidia-smi fails): reported, exit 0."""
    parent = tmp_path / "parent"
    lay_out_driver(parent / "driver", libdir="usr/lib64", bindir="usr/sbin")
    prestart = run_prestart("/run/nvidia/driver")
    assert prestart.finish() == 0, "\n".join(prestart.lines)
    failed = next(line for line in prestart.lines if "failed:" in line)
    link = tmp_path / "driver-root"
    assert f"{link}/usr/sbin/nvidia-smi" in failed and f"{link}/usr/lib64/libnvidia-ml.so.1" in failed
    assert "Driver/library version mismatch" in failed
    assert os.readlink(link) == str(parent / "driver")
    assert any("starting the plugin without the driver" in line for line in prestart.lines)


def test_host_installed_driver_is_the_parent_mount_itself(run_prestart: Starter, tmp_path: Path) -> None:
    parent = tmp_path / "parent"  # the host's / mounted at /driver-root-parent
    lay_out_driver(parent)
    (parent / ".ready").touch()
    prestart = run_prestart("/")
    assert prestart.finish() == 0, "\n".join(prestart.lines)
    assert os.readlink(tmp_path / "driver-root") == str(parent)
    assert any("--version' succeeded" in line for line in prestart.lines)


def test_without_a_writable_link_location_the_mount_is_used_directly(run_prestart: Starter, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    lay_out_driver(parent / "driver")
    (parent / "driver" / ".ready").touch()
    prestart = run_prestart("/run/nvidia/driver/", DRIVER_ROOT_LINK=str(tmp_path / "missing" / "driver-root"))
    assert prestart.finish() == 0, "\n".join(prestart.lines)
    assert any(f"under {parent / 'driver'} " in line for line in prestart.lines), prestart.lines


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)
