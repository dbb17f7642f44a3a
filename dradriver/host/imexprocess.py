"""The ``nvidia-imex`` process of one compute-domain daemon, and the files it reads.

:class:`ImexProcess` starts ``nvidia-imex -c <imexd.cfg>`` once, sends it ``SIGUSR1`` when the peer mapping
changes (not right after a fresh start: a new process reads the files anyway; and never before the process has
installed its handler), restarts it when what changed is more than ``SIGUSR1`` applies, restarts it from a 1 s
watchdog with a back-off when it exits unexpectedly, reports each such exit with its cause (:class:`ImexExit`), and
ends it with ``SIGTERM``. Facts: NVIDIA's ``cmd/compute-domain-daemon/`` ("Process watchdog (1 s tick)", "SIGUSR1 ...
not on fresh start"); ``signal(7)`` (the default action of ``SIGUSR1`` terminates the process); ``proc(5)``
(``SigCgt``).

:func:`write_config_file` writes ``imexd.cfg``/``nodes.cfg`` atomically (temp file + rename); :func:`write_hosts_file`
rewrites the hosts file atomically where it can and in place where it cannot (a container's ``/etc/hosts`` is a
bind mount: renaming over it fails with ``EBUSY``).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dradriver.host import imexchannels
from dradriver.host.cdifiles import write_file_atomically

__all__ = ["BACKOFF_MAX_S", "STABLE_S", "WATCHDOG_INTERVAL_S", "ImexExit", "ImexProcess", "check_own_daemon",
           "command_port", "listens_on", "process_alive", "query_ready", "signal_handled", "write_config_file",
           "write_hosts_file"]

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0
"""Seconds between two looks of the watchdog, and the first restart delay (NVIDIA's 1 s tick)."""
BACKOFF_MAX_S = 60.0
"""Longest delay between two starts of a process that keeps failing."""
STABLE_S = 30.0
"""Seconds a process must run for its failure count to reset (and to be reported recovered)."""
HANDLER_WAIT_S = 5.0
"""Longest wait for a fresh process to install its ``SIGUSR1`` handler before it is restarted instead."""
HANDLER_POLL_S = 0.01
STOP_TIMEOUT_S = 30.0
"""Seconds a restart waits after ``SIGTERM`` before ``SIGKILL`` (the final stop waits without limit)."""
LOG_TAIL_LINES = 20
DEFAULT_CMD_PORT = 50005


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


class ImexExit:
    """One unexpected exit of ``nvidia-imex`` and what the watchdog does about it.

    :param pid: the process that exited.
    :param status: its exit status (negative: killed by that signal, ``-10`` = ``SIGUSR1``).
    :param ran_s: seconds it ran.
    :param failures: unexpected exits in a row (a process that ran :attr:`ImexProcess.stable_s` resets the count).
    :param retry_in_s: seconds until the watchdog starts it again (the back-off).
    :param log_tail: its last lines on stderr (``[ERROR] ...`` lines name the cause).
    """

    __slots__ = ("failures", "log_tail", "pid", "ran_s", "retry_in_s", "status")

    def __init__(self, pid: int, status: int, ran_s: float, failures: int, retry_in_s: float,
                 log_tail: Sequence[str]) -> None:
        self.pid, self.status, self.ran_s = pid, status, ran_s
        self.failures, self.retry_in_s, self.log_tail = failures, retry_in_s, tuple(log_tail)

    @property
    def cause(self) -> str:
        """Its last ``ERROR`` line (without time stamp and level), else its last line, else ``""``."""
        errors = [line for line in self.log_tail if "[ERROR]" in line or "[FATAL]" in line]
        line = (errors or list(self.log_tail) or [""])[-1]
        return line.rsplit("] ", 1)[-1].strip() if "] " in line else line.strip()

    def reason(self) -> str:
        """One line for a log, a probe, a status condition and an Event: how it ended, how often, when it is
        started again, and its cause (whole, never cut)."""
        how = (f"was killed by {signal.Signals(-self.status).name}" if self.status < 0 and
               -self.status in signal.valid_signals() else f"exited with status {self.status}")
        text = (f"nvidia-imex (pid {self.pid}) {how} after {self.ran_s:.1f} s ({self.failures} failure(s) in a row; "
                f"next start in {self.retry_in_s:.0f} s)")
        return f"{text}: {self.cause}" if self.cause else text


def signal_handled(pid: int, signum: int, proc_root: Path = Path("/proc")) -> bool | None:
    """Whether process ``pid`` has installed a handler for ``signum``: bit ``signum - 1`` of ``SigCgt`` in
    ``/proc/<pid>/status`` (proc(5)). ``None``: the status cannot be read (no procfs, the process is gone)."""
    try:
        text = (proc_root / str(pid) / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            try:
                return bool(int(line.split(":", 1)[1].strip(), 16) >> (signum - 1) & 1)
            except ValueError:
                return None
    return None


class ImexProcess:
    """Supervise one ``nvidia-imex`` process.

    * :meth:`ensure_started` starts it once; :meth:`reload` sends ``SIGUSR1`` (re-resolve the peers' names), but
      only once the process has installed its handler (``SigCgt``, :func:`signal_handled`): until then
      ``SIGUSR1``'s default action ends the process (``signal(7)``), which is what a reload 4 ms after a fresh start
      did (status -10). A process that installs no handler within ``handler_wait_s`` is restarted instead.
    * :meth:`restart` (``SIGTERM``, wait, start): for what ``SIGUSR1`` cannot apply (nvidia-imex reads its own
      node identity at start only).
    * A watchdog (every ``watchdog_interval_s``) starts it again after an unexpected exit, with a back-off that
      doubles from ``watchdog_interval_s`` to ``backoff_max_s`` per exit in a row; a process that runs
      ``stable_s`` resets the count and is reported recovered. NVIDIA restarts every second forever
      (NVIDIA's ``cmd/compute-domain-daemon/``); the kubelet's own crash-loop back-off (10 s doubling to 5 min, reset
      after 10 min) is the model.
    * Its stderr (where the template's ``LOG_FILE_NAME=`` sends its log) is passed on to this process's stderr
      line by line, and the last :data:`LOG_TAIL_LINES` are kept: an exit's :class:`ImexExit` carries them.

    :param argv: the command, e.g. ``["nvidia-imex", "-c", "/imexd/imexd.cfg"]``.
    :param env: its environment (``None``: this process's).
    :param on_exit: called (from the watchdog thread) with each unexpected exit.
    :param on_recovered: called (from the watchdog thread) when a process started after failures has run
        ``stable_s``.
    :param on_start: called with the PID after each start.
    """

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 watchdog_interval_s: float = WATCHDOG_INTERVAL_S, backoff_max_s: float = BACKOFF_MAX_S,
                 stable_s: float = STABLE_S, handler_wait_s: float = HANDLER_WAIT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S, proc_root: Path = Path("/proc"),
                 on_exit: Callable[[ImexExit], None] | None = None, on_recovered: Callable[[], None] | None = None,
                 on_start: Callable[[int], None] | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None
        self.watchdog_interval_s = watchdog_interval_s
        self.backoff_max_s = backoff_max_s
        self.stable_s = stable_s
        self.handler_wait_s = handler_wait_s
        self.stop_timeout_s = stop_timeout_s
        self.proc_root = proc_root
        self.on_exit, self.on_recovered, self.on_start = on_exit, on_recovered, on_start
        self.starts = 0
        self.reloads = 0
        self.restarts = 0
        self.failures = 0
        """Unexpected exits in a row (0: running stable, or never failed)."""
        self.last_exit: ImexExit | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._next_start: float | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The running process's PID, or ``None``."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def log_tail(self) -> list[str]:
        """The last lines the current (or last) process wrote to stderr."""
        with self._lock:
            return list(self._tail)

    def _spawn(self) -> None:
        """Start the process (the lock is held)."""
        self._proc = proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._started_at = time.monotonic()
        self._next_start = None
        self._tail.clear()
        self.starts += 1
        log.info("started %s (pid %d)", " ".join(self.argv), proc.pid)
        threading.Thread(target=self._pass_on, args=(proc,), name=f"imex-stderr-{proc.pid}", daemon=True).start()
        if self.on_start is not None:
            self.on_start(proc.pid)

    def _pass_on(self, proc: subprocess.Popen[bytes]) -> None:
        """Copy the process's stderr to ours line by line, keeping the last lines."""
        assert proc.stderr is not None
        out = sys.stderr
        for raw in proc.stderr:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with self._lock:
                if self._proc is proc:
                    self._tail.append(line)
            try:
                out.write(line + "\n")
                out.flush()
            except (OSError, ValueError):
                pass
        proc.stderr.close()

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

    def reload(self) -> bool:
        """``SIGUSR1``: re-resolve the peers' names (the hosts file). Sent only once the process handles it
        (waits up to ``handler_wait_s``; a process that installs no handler by then is restarted). A process that
        does not run is left to the watchdog (its next start reads the files anyway).

        :returns: whether a signal was sent.
        """
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            log.info("nvidia-imex is not running: its next start reads the changed peers")
            return False
        deadline = time.monotonic() + self.handler_wait_s
        while True:
            handled = signal_handled(proc.pid, signal.SIGUSR1, self.proc_root)
            if handled is not False or proc.poll() is not None:
                break  # handled, or gone (the watchdog's), or no procfs to tell (signalled as NVIDIA's does)
            if time.monotonic() >= deadline:
                log.warning("nvidia-imex (pid %d) has installed no SIGUSR1 handler after %.1f s: restarting it "
                            "instead of signalling it", proc.pid, self.handler_wait_s)
                self.restart("it did not become ready for SIGUSR1")
                return False
            time.sleep(HANDLER_POLL_S)
        with self._lock:
            if self._proc is not proc or proc.poll() is not None:
                return False
            proc.send_signal(signal.SIGUSR1)
            self.reloads += 1
        log.info("sent SIGUSR1 to nvidia-imex (pid %d): peer mapping changed", proc.pid)
        return True

    def restart(self, why: str) -> None:
        """Stop the process (``SIGTERM``, then ``SIGKILL`` after ``stop_timeout_s``) and start it again at once;
        not counted as a failure.

        :raises OSError: the program cannot be executed.
        """
        with self._lock:
            proc = self._proc
            self._proc = None  # the watchdog leaves a process it no longer supervises alone
        if proc is not None:
            log.info("restarting nvidia-imex (pid %d): %s", proc.pid, why)
            _terminate(proc, self.stop_timeout_s)
        with self._lock:
            if self._stopping.is_set():
                return
            self._spawn()
            self.restarts += 1
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="imex-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._stopping.wait(self.watchdog_interval_s):
            exited: ImexExit | None = None
            recovered = False
            with self._lock:
                proc = self._proc
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                if proc is None:
                    if self._next_start is not None and now >= self._next_start:
                        try:
                            self._spawn()
                        except OSError as exc:
                            log.error("cannot start nvidia-imex: %s", exc)
                            self._next_start = now + self._backoff()
                    continue
                code = proc.poll()
                if code is None:
                    if self.failures and now - self._started_at >= self.stable_s:
                        self.failures = 0
                        recovered = True
                else:
                    ran = now - self._started_at
                    self.failures = 1 if ran >= self.stable_s else self.failures + 1
                    delay = self._backoff()
                    proc.wait()
                    exited = ImexExit(proc.pid, code, ran, self.failures, delay, self._tail)
                    self.last_exit = exited
                    self._proc = None
                    self._next_start = now + delay
            if exited is not None:
                log.warning("%s", exited.reason())
                if self.on_exit is not None:
                    self.on_exit(exited)
            if recovered:
                log.info("nvidia-imex (pid %d) has run %.0f s: recovered", proc.pid if proc else -1, self.stable_s)
                if self.on_recovered is not None:
                    self.on_recovered()

    def _backoff(self) -> float:
        """Seconds before the next start after :attr:`failures` exits in a row (the lock is held)."""
        return min(self.backoff_max_s, self.watchdog_interval_s * 2 ** max(0, self.failures - 1))

    def stop(self, timeout_s: float | None = None) -> int | None:
        """``SIGTERM`` and wait (``timeout_s`` ``None``: without limit, as NVIDIA's); stops the watchdog.

        :returns: the exit status, or ``None`` when nothing ran (or it did not exit in ``timeout_s``).
        """
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is None:
            return None
        _sigterm(proc)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        log.info("nvidia-imex (pid %d) exited with status %d", proc.pid, code)
        return code


def _sigterm(proc: subprocess.Popen[bytes]) -> None:
    """``SIGTERM`` to ``proc`` unless it has ended."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """``SIGTERM``, wait up to ``timeout_s``, then ``SIGKILL``; returns the exit status."""
    _sigterm(proc)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("nvidia-imex (pid %d) did not end %.0f s after SIGTERM: SIGKILL", proc.pid, timeout_s)
        proc.kill()
        return proc.wait()


def process_alive(pid: int, config_path: Path, proc_root: Path = Path("/proc")) -> bool:
    """Whether ``pid`` runs and is the ``nvidia-imex`` of ``config_path`` (its ``/proc/<pid>/cmdline`` names the
    config file: a PID reused by another program does not count). Without a readable ``cmdline``, the PID alone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        cmdline = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return True
    if not cmdline:
        return False  # a zombie
    return str(config_path).encode() in cmdline.split(b"\0")


def query_ready(ctl: str, config_path: Path, timeout_s: float = 10.0) -> tuple[bool, str]:
    """``<ctl> -c <config_path> -q``: ready only when it prints exactly ``READY\n`` (NVIDIA's probe,
    NVIDIA's ``cmd/compute-domain-daemon/``; the exit status is not consulted).

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


def listens_on(pid: int, port: int, proc_root: Path = Path("/proc")) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port``: one of its descriptors
    (``/proc/<pid>/fd/*`` -> ``socket:[<inode>]``) is a ``LISTEN`` (state ``0A``) entry of ``/proc/<pid>/net/tcp``
    or ``tcp6`` with that local port (proc(5)). ``None``: that cannot be read."""
    try:
        inodes = set()
        for fd in (proc_root / str(pid) / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return None
    found = False
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_root / str(pid) / "net" / table).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port \
                    and fields[9] in inodes:
                return True
    return False if found else None


def command_port(config_path: Path) -> int:
    """``IMEX_CMD_PORT`` of an IMEX config file (default 50005, NVIDIA's IMEX guide); 50005 when unreadable."""
    try:
        for line in config_path.read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "IMEX_CMD_PORT" and value.strip().isdigit():
                return int(value.strip())
    except OSError:
        pass
    return DEFAULT_CMD_PORT


def check_own_daemon(directory: Path, ctl: str, config_path: Path, *, pod_uid: str = "", timeout_s: float = 10.0,
                     proc_root: Path = Path("/proc")) -> tuple[bool, str]:
    """The probe of one daemon pod: ready only when the ``nvidia-imex`` its own ``compute-domain-daemon run``
    started (:class:`~dradriver.domain.imex.ImexProcessRecord` in ``directory``) runs and itself listens on the
    command port of ``config_path`` (:func:`listens_on`; so the answer comes from it), and ``nvidia-imex-ctl``
    answers ``READY`` (:func:`query_ready`). Whatever else answers on the command address (a host
    ``nvidia-imex.service`` holding the port, another pod's daemon) does not make this pod ready.

    :param pod_uid: this pod's UID (``""``: any record counts): a record an earlier pod left is not this pod's.
    :returns: (ready, ``READY`` or why not: while the process is down, the whole cause of its last exit).
    """
    record = imexchannels.read_process_record(directory)
    if record is None or (pod_uid and record.pod_uid != pod_uid):
        return False, "this pod's nvidia-imex has not been started yet (no process record of this pod)"
    if record.pid <= 0:
        return False, record.failure or "this pod's nvidia-imex is not running"
    if not process_alive(record.pid, config_path, proc_root):
        return False, f"this pod's nvidia-imex (pid {record.pid}) is not running"
    port = command_port(config_path)
    if listens_on(record.pid, port, proc_root) is False:
        why = f"this pod's nvidia-imex (pid {record.pid}) does not listen on its command port {port} (yet)"
        return False, f"{why}; its last failure: {record.failure}" if record.failure else why
    ok, output = query_ready(ctl, config_path, timeout_s)
    if not ok and record.failure:
        output = f"{output} (its last failure: {record.failure})"
    return ok, output
