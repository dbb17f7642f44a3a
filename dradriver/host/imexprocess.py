"""The ``nvidia-imex`` process of one compute-domain daemon, and the files it reads.

:class:`ImexProcess` starts ``nvidia-imex -c <imexd.cfg>`` once, sends it ``SIGUSR1`` when the peer mapping
changes (not right after a fresh start: a new process reads the files anyway), restarts it from a 1 s watchdog
when it exits unexpectedly, and ends it with ``SIGTERM`` (no kill timeout, as NVIDIA's process manager).
Facts: ``nvidia-dra-driver.md`` 7.4 ("Process watchdog (1 s tick)", "SIGUSR1 ... not on fresh start").

:func:`write_config_file` writes ``imexd.cfg``/``nodes.cfg`` atomically (temp file + rename); :func:`write_hosts_file`
rewrites the hosts file atomically where it can and in place where it cannot (a container's ``/etc/hosts`` is a
bind mount: renaming over it fails with ``EBUSY``).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from dradriver.host.cdifiles import write_file_atomically

__all__ = ["WATCHDOG_INTERVAL_S", "ImexProcess", "query_ready", "write_config_file", "write_hosts_file"]

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0


def write_config_file(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` atomically (mode 0644) unless it already holds exactly that.

    :returns: whether the file changed.
    :raises OSError: the directory is not writable.
    """
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    write_file_atomically(path, text.encode(), mode=0o644)
    return True


def write_hosts_file(path: Path, text: str) -> bool:
    """Replace the hosts file's content with ``text``: atomically, or in place when ``path`` is a mount point
    that cannot be renamed over (``EBUSY``/``EXDEV``).

    :returns: whether the file changed.
    :raises OSError: it cannot be written at all.
    """
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    try:
        write_file_atomically(path, text.encode(), mode=0o644)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EACCES, errno.EPERM):
            raise
        with open(path, "w", encoding="utf-8") as out:  # the bind-mounted /etc/hosts of a container
            out.write(text)
    return True


class ImexProcess:
    """Supervise one ``nvidia-imex`` process.

    :param argv: the command, e.g. ``["nvidia-imex", "-c", "/imexd/imexd.cfg"]``.
    :param env: its environment (``None``: this process's).
    :param watchdog_interval_s: seconds between liveness checks of the watchdog thread.
    """

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 watchdog_interval_s: float = WATCHDOG_INTERVAL_S) -> None:
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None
        self.watchdog_interval_s = watchdog_interval_s
        self.starts = 0
        self.reloads = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The running process's PID, or ``None``."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _spawn(self) -> None:
        self._proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL)
        self.starts += 1
        log.info("started %s (pid %d)", " ".join(self.argv), self._proc.pid)

    def ensure_started(self) -> bool:
        """Start the process unless it runs; start the watchdog with the first start.

        :returns: True when it was started now (then no SIGUSR1 is needed for the current files).
        :raises OSError: the program cannot be executed.
        """
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return False
            self._spawn()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="imex-watchdog", daemon=True)
            self._watchdog.start()
        return True

    def reload(self) -> None:
        """``SIGUSR1``: re-read ``nodes.cfg`` and the hosts file. A process that is not running is started."""
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
                self.reloads += 1
                log.info("sent SIGUSR1 to nvidia-imex (pid %d): peer mapping changed", proc.pid)
                return
        self.ensure_started()

    def _watch(self) -> None:
        while not self._stopping.wait(self.watchdog_interval_s):
            with self._lock:
                proc = self._proc
                if self._stopping.is_set() or proc is None:
                    return
                code = proc.poll()
                if code is None:
                    continue
                log.warning("nvidia-imex (pid %d) exited unexpectedly with status %s; restarting", proc.pid, code)
                try:
                    self._spawn()
                except OSError as exc:
                    log.error("cannot restart nvidia-imex: %s", exc)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """``SIGTERM`` and wait (``timeout_s`` ``None``: without limit, as NVIDIA's); stops the watchdog.

        :returns: the exit status, or ``None`` when nothing ran (or it did not exit in ``timeout_s``).
        """
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        log.info("nvidia-imex (pid %d) exited with status %d", proc.pid, code)
        return code


def query_ready(ctl: str, config_path: Path, timeout_s: float = 10.0) -> tuple[bool, str]:
    """``<ctl> -c <config_path> -q``: ready only when it prints exactly ``READY\n`` (NVIDIA's probe,
    ``nvidia-dra-driver.md`` 7.4; the exit status is not consulted).

    :param timeout_s: seconds before the query counts as failed (the probes' timeout is 10 s).
    :returns: (ready, ``READY`` or what was printed and why it is not ready).
    """
    argv = [ctl, "-c", str(config_path), "-q"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{' '.join(argv)}: {exc}"
    if done.stdout == "READY\n":
        return True, "READY"
    return False, f"{' '.join(argv)} printed {done.stdout!r} (status {done.returncode}) {done.stderr.strip()}".strip()
