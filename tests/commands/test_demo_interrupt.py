"""Ctrl-C (SIGINT) or SIGTERM ends ``dradriver demo`` early: the scenario's cleanup runs, one line says it was
interrupted, the status is 128 + the signal (130, 143), and nothing it started is left: no process, no node
directory (with its sockets). The signal goes to the demo's whole process group, as a terminal's Ctrl-C does."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_ROOT = re.compile(r"/tmp/dra-[A-Za-z0-9_]+")


def _marked(mark: str) -> tuple[list[int], set[str]]:
    """PIDs of the processes whose environment carries ``mark`` (the demo and all it started) and the node
    directories named in their environments."""
    pids, roots = [], set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"DEMO_INTERRUPT_MARK={mark}" in environ:
            pids.append(int(entry))
            roots.update(NODE_ROOT.findall(environ))
    return pids, roots


def _interrupt(argv: list[str], after: str, sig: int, *, ignore_sigint: bool = False) -> tuple[int, str, set[str], str]:
    """Run ``dradriver demo <argv>``, send ``sig`` to its process group once a line contains ``after``; return the
    exit status, the output, the node directories seen before the signal and the test's mark.

    :param ignore_sigint: start it with SIGINT ignored, as a non-interactive shell starts a job with ``&``.
    """
    mark = uuid.uuid4().hex
    command = [sys.executable, "-m", "dradriver", "demo", *argv]
    if ignore_sigint:
        command = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, sys.argv[1:])", *command]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "DEMO_INTERRUPT_MARK": mark})
    assert proc.stdout is not None
    lines: list[str] = []
    roots: set[str] = set()
    try:
        for line in proc.stdout:
            lines.append(line)
            roots.update(NODE_ROOT.findall(line))
            if after in line:
                roots |= _marked(mark)[1]
                os.killpg(proc.pid, sig)
                break
        lines.extend(proc.stdout)
        status = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return status, "".join(lines), roots, mark


def _assert_left_nothing(mark: str, roots: set[str], *, roots_seen: bool = True) -> None:
    deadline = time.monotonic() + 5  # a process the demo reaped may take a moment to leave /proc
    while (pids := _marked(mark)[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = []
    for pid in pids:  # reported, then ended, so a failure leaves nothing running either
        with contextlib.suppress(OSError):
            leftovers.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            os.kill(pid, signal.SIGKILL)
    assert leftovers == []
    assert bool(roots) == roots_seen, roots
    assert not [r for r in roots if os.path.exists(r)]


def test_ctrl_c_ends_the_compute_domain_demo_with_cleanup_and_status_130() -> None:
    """Even when SIGINT came ignored (a job started with ``&``): the demo said Ctrl-C stops it."""
    status, output, roots, mark = _interrupt(["--scenario", "compute-domain"], "   node rack1-node00:",
                                             signal.SIGINT, ignore_sigint=True)
    assert status == 130, output
    assert "dradriver demo: interrupted by SIGINT in step " in output, output
    assert "Traceback" not in output and "every step succeeded" not in output, output
    _assert_left_nothing(mark, roots)
    assert len(roots) == 4, roots  # the four nodes' directories (sockets, CDI specs, claim state) were seen


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_ends_the_multi_tenant_compute_domain_demo_with_cleanup_and_its_status(sig: int) -> None:
    """``--tenants``: Ctrl-C exits 130, SIGTERM 143, each after the same cleanup."""
    status, output, roots, mark = _interrupt(["--scenario", "compute-domain", "--tenants", "2"],
                                             "   node rack1-node00:", sig)
    assert status == 128 + sig, output
    assert f"dradriver demo: interrupted by {signal.Signals(sig).name} in step " in output, output
    assert "Traceback" not in output and "every step succeeded" not in output, output
    _assert_left_nothing(mark, roots)


def test_sigterm_ends_the_pre_warmed_compute_domain_demo_with_cleanup_and_status_143() -> None:
    """``--imex pre-warmed``, stopped while job-3 is held at binding: the clique daemons, the Pending daemon Pod
    of the node whose image pulls, the plugins and the controller are all stopped and the node directories
    removed."""
    status, output, roots, mark = _interrupt(["--scenario", "compute-domain", "--imex", "pre-warmed"],
                                             "== 5.", signal.SIGTERM)
    assert status == 143, output
    assert "dradriver demo: interrupted by SIGTERM in step 5 " in output, output
    assert "Traceback" not in output and "every step succeeded" not in output, output
    _assert_left_nothing(mark, roots)
    assert len(roots) == 2, roots


@pytest.mark.parametrize("scenario", ["basic", "dynamic-mig"])
def test_ctrl_c_ends_an_in_process_demo_with_cleanup_and_status_130(scenario: str) -> None:
    """The scenarios that run the plugin in this process (asyncio): its tasks are cancelled and the plugin and
    the emulators stopped before the line is printed (basic names its node directory, in the DRA socket's path)."""
    status, output, roots, mark = _interrupt(["--scenario", scenario], "== 2.", signal.SIGINT)
    assert status == 130, output
    assert "dradriver demo: interrupted by SIGINT in step " in output, output
    assert "Traceback" not in output and "every step succeeded" not in output, output
    _assert_left_nothing(mark, roots, roots_seen=scenario == "basic")
