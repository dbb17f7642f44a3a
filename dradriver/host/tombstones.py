"""Unprepare tombstones: when each claim UID was last unprepared on this node, kept beside the claim state.

Why this file exists: during a rolling update two plugin instances run on one node (the DaemonSet's surge, each
with its own sockets, :attr:`dradriver.config.PluginConfig.dra_socket`), and the kubelet may send the Unprepare of a
claim to the new instance while a Prepare of the same claim is still in flight in the old one: waiting for its
ResourceClaim GET, or between two attempts of a preparer that is not ready yet (the compute-domain channel waiting
for its IMEX daemon), when no claim record exists. A prepare that began before an unprepare of its claim must never
complete afterwards (it would hold the claim's devices, CDI spec and node label for a claim the kubelet has
forgotten). A guard in one process's memory cannot see the other instance's calls, so the knowledge "this UID was
unprepared at time T" is shared by the instances: on disk, changed and read only under the claim state's node-wide
``flock`` (:meth:`dradriver.host.claimstate.ClaimState.locked`).

Each tombstone is a claim UID and a ``CLOCK_MONOTONIC`` stamp in nanoseconds. That clock is one clock for every
process of a boot (Linux ``clock_gettime(2)``; Kubernetes gives pods no time namespace), so a stamp written by one
instance orders against a prepare call's start taken by another: the call lost to the unprepare when the stamp is
later than its start. A new Prepare the kubelet sends after the Unprepare was answered starts later than the stamp
and is not affected, exactly as the single-process guard it replaces.

File ``<journal>.unprepared`` (UTF-8 JSON lines, created at the first unprepare):

``{"format": "dradriver-unprepared", "version": 1, "boot": "<boot ID>"}``
    header: the node boot ID (``/proc/sys/kernel/random/boot_id``), since stamps mean nothing after a reboot;
``[<stamp ns>, "<claim UID>"]``
    one line per unprepared claim, appended with one ``write`` per batch (``O_APPEND``).

Rules: a file of another boot, another format or version, or with a damaged header is replaced by an empty one (a
tombstone only refuses prepares that began before it, and none of those survived a reboot); a damaged line is
skipped; a last line without its newline (a write cut short by a crash, never acknowledged) is truncated away.
Tombstones older than the TTL are dropped, and the file is rewritten (temporary file, ``rename``) when it holds more
than twice the live lines plus :data:`REWRITE_SLACK`, so it stays small. No ``fsync``: a power loss changes the
boot ID, which voids the file (see Durability in :mod:`dradriver.host.claimstate`). The claim-state journal's format
is untouched, so an older release, which does not know this file, reads the state as before and ignores it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from dradriver.host import cdifiles

log = logging.getLogger(__name__)

FORMAT = "dradriver-unprepared"
VERSION = 1
REWRITE_SLACK = 256
"""Dead lines the file may hold beyond the live ones before it is rewritten."""


def remove_temp_files(path: Path) -> None:
    """Remove the temporary files ``.<name>.tmp-*`` a crashed atomic rewrite of ``path`` left beside it (its
    temporary name, :func:`dradriver.host.cdifiles.write_file_atomically`'s); the caller holds the claim state's lock,
    so no rewrite is in progress."""
    prefix = f".{path.name}.tmp-"
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path.parent):
            if entry.name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


class Tombstones:
    """The tombstone file of one claim state; every method expects the caller to hold the claim state's lock.

    :param path: the file (``<journal>.unprepared``).
    :param boot_id: this boot's ID (stamped in the header; a file of another boot is discarded).
    :param ttl_ns: how long, nanoseconds, a tombstone is kept.
    :param clock_ns: ``CLOCK_MONOTONIC`` in nanoseconds (``time.monotonic_ns``; tests pass their own).
    """

    def __init__(self, path: Path, boot_id: str, ttl_ns: int, clock_ns: Callable[[], int]) -> None:
        self.path = path
        self.boot_id = boot_id
        self.ttl_ns = ttl_ns
        self.clock_ns = clock_ns
        self._stamps: dict[str, int] = {}  # claim UID -> newest stamp, oldest first
        self._fd = -1
        self._ino = (-1, -1)
        self._offset = 0
        self._lines = 0  # tombstone lines in the file (live or not)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._ino = (-1, -1)

    def sync(self) -> None:
        """Read what other instances appended since the last read (a full reload after a rewrite or a removal).

        :raises OSError: the file cannot be read.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.close()
            self._stamps.clear()
            self._lines = 0
            self._offset = 0
            return
        if (st.st_dev, st.st_ino) != self._ino or st.st_size < self._offset:
            self._load()
        elif st.st_size > self._offset:
            self._read_from(self._offset)

    def stamp(self, uid: str) -> int | None:
        """The newest unexpired tombstone of ``uid`` (``CLOCK_MONOTONIC`` ns), or ``None``; call :meth:`sync`
        first."""
        stamp = self._stamps.get(uid)
        if stamp is None or stamp < self.clock_ns() - self.ttl_ns:
            return None
        return stamp

    def add(self, uids: Sequence[str]) -> int:
        """Append one tombstone per UID, all with the stamp now; returns that stamp. Call :meth:`sync` first (in the
        same hold of the lock).

        :raises OSError: the file cannot be written (nothing is kept in memory then).
        """
        if self._fd < 0:
            self._rewrite()
        now = self.clock_ns()
        data = "".join(f"[{now}, {json.dumps(uid)}]\n" for uid in uids).encode()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._offset)
            raise
        self._offset += len(data)
        for uid in uids:
            self._stamps.pop(uid, None)
            self._stamps[uid] = now
            self._lines += 1
        self._expire()
        if self._lines > 2 * len(self._stamps) + REWRITE_SLACK:
            try:
                self._rewrite()
            except OSError as exc:  # the tombstones are written; the file stays longer until the next rewrite
                log.warning("cannot rewrite unprepare tombstones %s: %s", self.path, exc)
        return now

    def __len__(self) -> int:
        return len(self._stamps)

    def lines(self) -> int:
        """Tombstone lines in the file (live and expired), as last read."""
        return self._lines

    # ---- internals ---------------------------------------------------------------------------------------------

    def _expire(self) -> None:
        oldest = self.clock_ns() - self.ttl_ns
        while self._stamps:
            uid, stamp = next(iter(self._stamps.items()))
            if stamp >= oldest:
                break  # the dict is oldest first
            del self._stamps[uid]

    def _load(self) -> None:
        self.close()
        self._stamps.clear()
        self._lines = 0
        self._offset = 0
        remove_temp_files(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        st = os.fstat(fd)
        self._fd, self._ino = fd, (st.st_dev, st.st_ino)
        head = os.pread(fd, 4096, 0)
        end = head.find(b"\n")
        why = ""
        if end < 0:
            why = "no complete header line"
        else:
            try:
                doc = json.loads(head[:end])
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
                why = f"header {head[:end][:120]!r} is not a version-{VERSION} {FORMAT} header"
            elif doc.get("boot") != self.boot_id:
                why = f"written in boot {doc.get('boot')!r}, not in this boot {self.boot_id!r} (node rebooted)"
        if why:
            log.warning("unprepare tombstones %s: %s; starting an empty file", self.path, why)
            self._rewrite()
            return
        self._offset = end + 1
        self._read_from(self._offset)
        self._expire()

    def _read_from(self, start: int) -> None:
        chunks: list[bytes] = []
        pos = start
        while chunk := os.pread(self._fd, 1 << 20, pos):
            chunks.append(chunk)
            pos += len(chunk)
        data = b"".join(chunks)
        complete = data.rfind(b"\n") + 1
        if complete < len(data):  # a write cut short by a crash: never acknowledged
            log.warning("unprepare tombstones %s: incomplete last line at byte %d (%d bytes) truncated", self.path,
                        start + complete, len(data) - complete)
            os.ftruncate(self._fd, start + complete)
        skipped = 0
        for line in data[:complete].splitlines():
            try:
                stamp, uid = json.loads(line)
                if not isinstance(stamp, int) or isinstance(stamp, bool) or not isinstance(uid, str):
                    raise ValueError(line)
            except ValueError:
                skipped += 1
                continue
            self._lines += 1
            if stamp >= self._stamps.get(uid, -1):
                self._stamps.pop(uid, None)
                self._stamps[uid] = stamp
        if skipped:
            log.warning("unprepare tombstones %s: %d damaged line(s) skipped", self.path, skipped)
        self._offset = start + complete

    def _rewrite(self) -> None:
        """Replace the file by header + the live tombstones, oldest first (temporary file, ``rename``).

        :raises OSError: the file cannot be written (the old one stays).
        """
        self._expire()
        header = json.dumps({"format": FORMAT, "version": VERSION, "boot": self.boot_id}) + "\n"
        body = "".join(json.dumps([stamp, uid]) + "\n" for uid, stamp in sorted(self._stamps.items(),
                                                                                  key=lambda kv: kv[1]))
        data = (header + body).encode()
        cdifiles.write_file_atomically(self.path, data, mode=0o600, sync_dir=False)  # no fsync: see the module
        self.close()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        self._ino = (st.st_dev, st.st_ino)
        self._offset = len(data)
        self._lines = len(self._stamps)
