"""NVIDIA's node-global plugin locks, ``pu.lock`` and ``cp.lock``, taken as NVIDIA's kubelet plugins take them, so
that NVIDIA's plugin and dradriver's, overlapping on a node during a switch (one DaemonSet's pod terminating while
the other's starts), never interleave a prepare, an unprepare, the start-up adoption or a checkpoint write.

Facts (kubernetes-sigs/dra-driver-nvidia-gpu ``pkg/flock/flock.go``, ``cmd/gpu-kubelet-plugin/device_state.go``,
``cmd/compute-domain-kubelet-plugin/device_state.go``):

* ``<plugin dir>/pu.lock`` is held around each claim's prepare and unprepare, by the GPU plugin and by the
  compute-domain plugin, each in its own plugin directory (``/var/lib/kubelet/plugins/gpu.nvidia.com/``,
  ``.../compute-domain.nvidia.com/``);
* the GPU plugin holds ``<plugin dir>/cp.lock`` around each read-modify-write of ``checkpoint.json``, while it
  holds ``pu.lock``: the lock order is ``pu.lock`` then ``cp.lock``, which dradriver keeps (never ``pu.lock`` while
  holding ``cp.lock``);
* the helper opens the file (created when missing), ``flock(LOCK_EX|LOCK_NB)`` every 100 ms for at most 10 s, and
  releases by closing the descriptor, so a crashed holder's lock is released by the kernel.

Here a wait polls ``LOCK_NB`` from 1 ms growing to NVIDIA's 100 ms (a short hold costs a short wait), in the
calling thread: callers are worker threads (the runner's) or ``asyncio.to_thread``, never the event loop. The
bound is :data:`TIMEOUT_S` unless the caller gives one (read at each call, so tests may lower it).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dradriver.errors import DradriverError

__all__ = [
    "CHECKPOINT_LOCK",
    "POLL_S",
    "PREPARE_LOCK",
    "PROC_LOCKS",
    "TIMEOUT_S",
    "PluginLockTimeout",
    "PluginLocks",
    "held",
    "lock_holders",
]

PREPARE_LOCK = "pu.lock"
"""Held around each prepare and unprepare, by NVIDIA's GPU and compute-domain plugins alike."""
CHECKPOINT_LOCK = "cp.lock"
"""Held around each read-modify-write of ``checkpoint.json`` (NVIDIA's GPU plugin)."""
TIMEOUT_S = 10.0
"""How long, seconds, a lock is waited for when the caller gives no bound (NVIDIA's 10 s)."""
POLL_S = 0.1
"""The longest pause, seconds, between two tries (NVIDIA's polling interval)."""
PROC_LOCKS = Path("/proc/locks")
"""The kernel's table of file locks, read for the holder's PID when a wait times out."""

_FIRST_POLL_S = 0.001

log = logging.getLogger(__name__)


class PluginLockTimeout(DradriverError, TimeoutError):
    """A plugin lock was not acquired within its bound: another plugin (NVIDIA's, or another dradriver instance)
    holds it. An :class:`OSError` too (``TimeoutError``), so a checkpoint write that times out is one more write
    failure to its callers.

    :ivar path: the lock file. :ivar waited_s: seconds waited. :ivar holders: PIDs holding it, as ``/proc/locks``
        shows them (empty when unreadable or not shown, as for a holder in another PID namespace).
    """

    def __init__(self, path: Path, waited_s: float, holders: tuple[int, ...]) -> None:
        self.path = path
        self.waited_s = waited_s
        self.holders = holders
        who = f" by PID {', '.join(map(str, holders))}" if holders else ""
        super().__init__(f"lock {path} still held{who} after {waited_s:.3g} s (another plugin on this node is "
                         "preparing, unpreparing or writing its checkpoint)")


def lock_holders(path: Path | str, proc_locks: Path = PROC_LOCKS) -> tuple[int, ...]:
    """PIDs holding a ``flock`` on ``path`` now, from ``/proc/locks`` (lines ``N: FLOCK ADVISORY WRITE <pid>
    <major hex>:<minor hex>:<inode> 0 EOF``; waiters, ``N: -> FLOCK ...``, are skipped): empty when the file or the
    table cannot be read. Never raises."""
    try:
        st = os.stat(path)
        text = proc_locks.read_text()
    except OSError:
        return ()
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    found: list[int] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            pid = int(fields[4])
        except ValueError:
            continue
        if key == want and pid not in found:
            found.append(pid)
    return tuple(found)


@contextlib.contextmanager
def held(path: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created, mode 0644, when missing) for the
    block; released when the block ends (the descriptor is closed).

    :param timeout_s: how long to wait, seconds (default :data:`TIMEOUT_S`); one try is always made.
    :raises PluginLockTimeout: still held by another process after ``timeout_s``. A wait that begins is logged
        (INFO, with the holder's PID).
    :raises OSError: the file cannot be opened (a missing directory, no permission).
    """
    bound = TIMEOUT_S if timeout_s is None else max(0.0, timeout_s)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        began = time.monotonic()
        pause = _FIRST_POLL_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - began
                if pause == _FIRST_POLL_S:
                    holders = lock_holders(path)
                    log.info("lock %s is held%s; waiting up to %.3g s", path,
                             f" by PID {', '.join(map(str, holders))}" if holders else "", bound)
                if waited >= bound:
                    raise PluginLockTimeout(path, waited, lock_holders(path)) from None
                time.sleep(min(pause, bound - waited))
                pause = min(pause * 2, POLL_S)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PluginLocks:
    """The two locks of one plugin directory (``<kubelet plugins dir>/<driver>``).

    :param timeout_s: the bound of every wait, seconds; ``None``: :data:`TIMEOUT_S` at each call.
    """

    directory: Path
    timeout_s: float | None = None

    @property
    def prepare_path(self) -> Path:
        """``<plugin dir>/pu.lock``."""
        return self.directory / PREPARE_LOCK

    @property
    def checkpoint_path(self) -> Path:
        """``<plugin dir>/cp.lock``."""
        return self.directory / CHECKPOINT_LOCK

    def prepare(self, timeout_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold ``pu.lock`` (around a prepare or unprepare, or the start-up adoption); ``timeout_s`` below the
        configured bound shortens the wait (a call's deadline). :raises PluginLockTimeout: as :func:`held`."""
        bound = self.bound()
        return held(self.prepare_path, bound if timeout_s is None else min(bound, timeout_s))

    def checkpoint(self) -> contextlib.AbstractContextManager[None]:
        """Hold ``cp.lock`` (around a write or read-modify-write of ``checkpoint.json``; take it after
        ``pu.lock``, never before). :raises PluginLockTimeout: as :func:`held`."""
        return held(self.checkpoint_path, self.bound())

    def bound(self) -> float:
        """The wait's bound now, seconds."""
        return TIMEOUT_S if self.timeout_s is None else self.timeout_s
