"""Crash-safe claim state of the kubelet plugin: which claims are prepared and which devices they hold.

Why this module exists: NVIDIA's Go driver rewrites one whole JSON checkpoint per change, with an fsync
(NVIDIA's ``cmd/gpu-kubelet-plugin/checkpoint.go``), so every prepare costs time linear in the number of
prepared claims. Here the state is a journal of appended, CRC-checked records (format in
:mod:`dradriver._native.claimstore_py`): one prepare or unprepare appends one record with one ``write``,
whatever the table size. The table and the encoding live in the native module picked by
``dradriver._native.load("claimstore")`` (compiled by default, twin with ``DRADRIVER_NO_EXTENSIONS=1``).

Durability: which failures the state must survive, and which syncs that takes
- **The state is per boot.** At open, a journal whose header carries another boot ID
  (``/proc/sys/kernel/random/boot_id``) is discarded whole, and the runner then deletes every claim CDI spec
  left from that boot (:meth:`dradriver.kubeletplugin.runner.BatchRunner.recover` with ``rebooted``): no
  container of the old boot survives, and the kubelet prepares its claims again. NVIDIA does the same
  (section 4.4). A power loss or kernel crash always changes the boot ID, so nothing written since the last
  boot is ever needed after one: syncing records or CDI specs to the disk protects no case that can occur.
- **What must survive is a process crash** (SIGKILL, OOM kill, a bug): the kernel keeps running, and every
  ``write``/``rename`` the process completed is in the page cache, which every later reader on this kernel
  (the restarted plugin, a second instance during a rolling update, the container runtime) sees, in the order
  the calls were made. So ordered writes suffice: a record is acknowledged once its ``write`` returned, a CDI
  spec once its ``rename`` returned, and the runner writes STARTED before any side effect, the spec after it,
  COMPLETED after the spec (section 4.2). A write the crash cut short is a torn last record, never
  acknowledged, and is truncated at the next open (the crash and torn-file tests in ``tests/claimstate`` and
  ``tests/plugin/test_recovery.py`` kill the plugin at each step).
- **The syncs that stay** are those that make the boot-ID rule itself hold after a power loss: a new journal
  (created, compacted or migrated, :meth:`ClaimState._write_journal`) is fsync'd before it is renamed into
  place and the directory after. Without them, a power loss could leave a journal whose header (the boot ID) is
  lost or damaged while later pages survive; recovery would keep the readable records of a damaged header as
  current claims, and a missing journal would turn the old boot's specs into "orphans" to adopt. Both run at
  start-up and once per compaction (amortised), never per claim.
- **Not protected** (as with any page-cache write): a disk that fails to write back while the kernel keeps
  running. The kernel reports that on a later fsync, not to this process; the node is then unhealthy anyway.

Contracts
- **Two-phase prepare** (section 4.2): :meth:`ClaimState.prepare_started` before any side effect,
  :meth:`ClaimState.prepare_completed` after; :meth:`ClaimState.remove` on unprepare. Each returns only
  once its record is written to the journal (in the page cache: acknowledged, see Durability).
- **Conflicts**: a device held without admin access by one claim cannot be taken by another
  (:class:`ClaimConflictError` names both claims); admin-access devices are exempt.
- **Late completion**: completing a claim that was removed meanwhile raises :class:`ClaimUnknownError`, so
  a slow prepare that finishes after the unprepare never brings the claim back.
- **Rolling updates**: every mutation holds a node-wide ``flock`` on the lock file (``serialize.lock``)
  and first reads what another instance appended since our last read; a changed inode (the other
  instance compacted) triggers a full reload. Use :meth:`ClaimState.locked` to read and modify atomically.
- **Compaction**: synchronous, inside the mutation that crosses the threshold: when the dead bytes exceed
  ``compact_ratio`` times the live bytes and ``compact_min_bytes``, the live records are written to a
  temporary file, fsync'd, renamed over the journal, and the directory is fsync'd. Amortised O(1).
- **Recovery at open** (reported as :class:`ClaimStateProblem`, passed to ``on_problem`` and kept in
  :attr:`ClaimState.problems`):
  a torn final record (a write cut short by a crash, never acknowledged) is truncated away;
  a damaged header or record keeps every readable record, keeps the damaged file as
  ``<file>.corrupt-<UTC timestamp>``, writes a clean journal, and (``strict=True``) raises
  :class:`ClaimStateCorruptError` whose ``state`` is the recovered, usable store;
  a changed node boot ID (``/proc/sys/kernel/random/boot_id``) discards the prepared state, which a reboot
  invalidated, keeping the old file as ``<file>.boot-<UTC timestamp>``;
  a newer format version raises :class:`ClaimStateVersionError`; an older known version is read and
  rewritten in the current version.
- **Unprepare tombstones** (:mod:`dradriver.host.tombstones`, the file ``<journal>.unprepared``):
  :meth:`ClaimState.note_unprepared` stamps claim UIDs as unprepared now (``CLOCK_MONOTONIC``, one clock for every
  instance of a boot) and :meth:`ClaimState.unprepared_at` reads the stamp back, both under the node-wide lock, so
  a prepare call that began before an unprepare of its claim, in any instance, can tell it lost (the runner's
  guard, :meth:`dradriver.kubeletplugin.runner.BatchRunner.prepare_claims`). Kept beside the journal, not in it:
  the journal's format is unchanged, and an older release ignores the file.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dradriver import _native
from dradriver._native.claimstore_py import (
    ClaimConflictError,
    ClaimRecordError,
    ClaimStateCorruptError,
    ClaimStateError,
    ClaimStateVersionError,
    ClaimUnknownError,
)
from dradriver.domain.claims import ClaimRef, PreparedDevice
from dradriver.host.tombstones import Tombstones, remove_temp_files

if TYPE_CHECKING:
    from dradriver._native import claimstore

__all__ = [
    "BOOT_ID_PATH",
    "ClaimConflictError",
    "ClaimPhase",
    "ClaimRecord",
    "ClaimRecordError",
    "ClaimSnapshot",
    "ClaimState",
    "ClaimStateCorruptError",
    "ClaimStateError",
    "ClaimStateLockError",
    "ClaimStateProblem",
    "ClaimStateVersionError",
    "ClaimUnknownError",
    "HeldDevice",
    "ProblemKind",
    "read_claims",
]

log = logging.getLogger(__name__)

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
DEFAULT_COMPACT_MIN_BYTES = 1 << 20
DEFAULT_COMPACT_RATIO = 2.0
DEFAULT_LOCK_TIMEOUT = 10.0
DEFAULT_TOMBSTONE_TTL_S = 300.0
"""How long, seconds, an unprepare tombstone is kept: far longer than any prepare call (the kubelet gives up after
45 s, ``pkg/kubelet/cm/dra/plugin/dra_plugin.go``); a call that has run longer is refused
(:attr:`ClaimState.tombstone_ttl_ns`)."""
_LOCK_POLL = 0.005


class ClaimStateLockError(ClaimStateError):
    """The node-wide claim-state lock was not acquired within the timeout (another instance holds it)."""


class ClaimPhase(enum.IntEnum):
    """Checkpoint state of a claim (NVIDIA ``checkpointState``: ``PrepareStarted``/``PrepareCompleted``)."""

    PREPARE_STARTED = 1
    PREPARE_COMPLETED = 2


@dataclass(frozen=True, slots=True)
class HeldDevice:
    """One device a claim holds.

    :param request_names: requests it serves (DRA ``Device.request_names``).
    :param pool: ResourceSlice pool name (this node's name for ``gpu.nvidia.com``).
    :param device: device name within the pool, e.g. ``gpu-0``.
    :param cdi_device_ids: fully-qualified CDI device names given to the runtime.
    :param admin_access: the allocation result has ``adminAccess`` (may share the device).
    :param shared: the claim holds a consumable share of the device (``shareID``), so other claims' shares may
        hold it too.
    :param share_id: the allocation result's ``shareID`` (returned to the kubelet as ``Device.share_id``).

    The store records one "not held exclusively" flag per device: admin access and shares both set it, and
    neither enters the index of exclusively held devices. Read back, that flag is :attr:`admin_access`; the
    share itself (``shared``, ``share_id``) is restored from the claim's payload by the batch runner.
    """

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...] = ()
    admin_access: bool = False
    shared: bool = False
    share_id: str | None = None

    def as_tuple(self) -> tuple[tuple[str, ...], str, str, tuple[str, ...], bool]:
        """The native module's device tuple."""
        return (
            tuple(self.request_names),
            self.pool,
            self.device,
            tuple(self.cdi_device_ids),
            self.admin_access or self.shared,
        )

    def to_prepared(self) -> PreparedDevice:
        """The DRA ``Device`` answer for this device."""
        return PreparedDevice(
            request_names=self.request_names,
            pool_name=self.pool,
            device_name=self.device,
            cdi_device_ids=self.cdi_device_ids,
            share_id=self.share_id,
        )


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """A stored claim: phase, identity, held devices, and the driver's opaque undo payload."""

    uid: str
    phase: ClaimPhase
    namespace: str
    name: str
    devices: tuple[HeldDevice, ...]
    payload: bytes | str

    @property
    def ref(self) -> ClaimRef:
        """The claim reference (namespace, name, UID)."""
        return ClaimRef(namespace=self.namespace, name=self.name, uid=self.uid)


class ProblemKind(enum.Enum):
    """What recovery found in the claim-state file."""

    TORN_TAIL = "torn-tail"  # a last record cut short by a crash; never acknowledged, truncated away
    CORRUPT_HEADER = "corrupt-header"
    CORRUPT_RECORD = "corrupt-record"  # one complete record fails its checksum or does not decode; skipped
    CORRUPT_TAIL = "corrupt-tail"  # a record frame is damaged: the bytes after it cannot be read
    BOOT_ID_CHANGED = "boot-id-changed"
    MIGRATED = "migrated"  # an older format version was rewritten in the current one
    MISSING = "missing"  # the journal vanished under us; rewritten from memory


#: problems where claims may have been lost or altered: logged as errors, reported as Events.
DAMAGE = frozenset({ProblemKind.CORRUPT_HEADER, ProblemKind.CORRUPT_RECORD, ProblemKind.CORRUPT_TAIL})


@dataclass(frozen=True, slots=True)
class ClaimStateProblem:
    """One finding of recovery.

    :param offset: byte offset in the file where it was found, when it has one.
    :param kept_at: where the damaged or discarded file was kept, when it was.
    :param discarded: number of claims dropped (boot ID change) or records skipped.
    """

    kind: ProblemKind
    message: str
    path: Path
    offset: int | None = None
    kept_at: Path | None = None
    discarded: int = 0

    @property
    def damage(self) -> bool:
        """True when claims may have been lost or altered by damage to the file."""
        return self.kind in DAMAGE

    def __str__(self) -> str:
        kept = f" (file kept at {self.kept_at})" if self.kept_at else ""
        return f"claim state {self.path}: {self.message}{kept}"


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """The node boot ID (``/proc/sys/kernel/random/boot_id``), stripped; ``""`` when the file is absent."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return ""


def _timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def _read_all(fd: int, start: int = 0) -> bytes:
    chunks: list[bytes] = []
    pos = start
    while True:
        chunk = os.pread(fd, 1 << 20, pos)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        pos += len(chunk)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the descriptor's position (opened ``O_APPEND``): one ``write`` normally.

    :raises OSError: from ``write`` (disk full, I/O error).
    """
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ClaimState:
    """The claim table of one node, backed by the journal at ``path``. Create with :meth:`open`.

    Thread-safe: every public method takes an internal re-entrant lock (and mutations the node-wide
    ``flock``), so one instance may be shared by gRPC worker threads.
    """

    def __init__(self, *, path: Path, lock_path: Path, boot_id: str, backend: _native.ClaimstoreModule,
                 compact_min_bytes: int, compact_ratio: float, lock_timeout: float,
                 on_problem: Callable[[ClaimStateProblem], None] | None, tombstones: Tombstones) -> None:
        self._path = path
        self._lock_path = lock_path
        self._boot_id = boot_id
        self._backend = backend
        self._compact_min_bytes = compact_min_bytes
        self._compact_ratio = compact_ratio
        self._lock_timeout = lock_timeout
        self._on_problem = on_problem
        self._mutex = threading.RLock()
        self._depth = 0
        self._lock_fd = -1
        self._fd = -1
        self._ino = (-1, -1)
        self._offset = 0
        self._header_len = 0
        self._table: claimstore.Table = backend.Table()
        self._pending: list[bytes] | None = None  # frames of an open group commit
        self.compaction_failures = 0
        self._problems: list[ClaimStateProblem] = []
        self._compactions = 0
        self._tombstones = tombstones
        self._tombstones_read = False  # read in this hold of the lock (reset when it is released)
        self._changed: set[str] | None = None  # see take_changes; None: any record may have changed

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: Path | str,
        *,
        lock_path: Path | str | None = None,
        boot_id_path: Path | str = BOOT_ID_PATH,
        strict: bool = True,
        compact_min_bytes: int = DEFAULT_COMPACT_MIN_BYTES,
        compact_ratio: float = DEFAULT_COMPACT_RATIO,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        on_problem: Callable[[ClaimStateProblem], None] | None = None,
        backend: _native.ClaimstoreModule | None = None,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> ClaimState:
        """Open (creating if absent) the claim state at ``path`` and recover it (see the module docstring).

        :param lock_path: node-wide lock file; default ``serialize.lock`` beside ``path``
            (:attr:`dradriver.config.PluginConfig.lock_path`).
        :param boot_id_path: where to read the current boot ID (tests inject a file).
        :param strict: raise :class:`ClaimStateCorruptError` (carrying ``.state``, the recovered store, and
            ``.problems``) when damage was found; with ``False`` the damage is only reported.
        :param compact_min_bytes: dead journal bytes (bytes) below which no compaction happens.
        :param compact_ratio: compact when dead bytes exceed this multiple of the live bytes.
        :param lock_timeout: seconds to wait for the node-wide lock.
        :param on_problem: called with each :class:`ClaimStateProblem` (for logs and Kubernetes Events).
        :param backend: the native module; default ``dradriver._native.load("claimstore")``.
        :param tombstone_ttl_s: how long, seconds, an unprepare tombstone is kept (:meth:`note_unprepared`).
        :param clock_ns: ``CLOCK_MONOTONIC`` in nanoseconds for the tombstones (tests pass their own).
        :raises ClaimStateVersionError: the file was written in a newer format version.
        :raises ClaimStateCorruptError: damage found and ``strict`` (the state is recovered regardless).
        :raises ClaimStateLockError: the lock was not acquired in time.
        :raises OSError: the directory or files cannot be created or read.
        """
        path = Path(path)
        boot_id = read_boot_id(Path(boot_id_path))
        state = cls(
            path=path,
            lock_path=Path(lock_path) if lock_path is not None else path.parent / "serialize.lock",
            boot_id=boot_id,
            backend=backend if backend is not None else _native.load("claimstore"),
            compact_min_bytes=compact_min_bytes,
            compact_ratio=compact_ratio,
            lock_timeout=lock_timeout,
            on_problem=on_problem,
            tombstones=Tombstones(path.with_name(path.name + ".unprepared"), boot_id, int(tombstone_ttl_s * 1e9),
                                  clock_ns),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        state._lock_fd = os.open(state._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            with state._mutex:
                state._acquire()
                try:
                    found = state._load()
                finally:
                    state._release()
        except BaseException:
            state.close()
            raise
        damage = [p for p in found if p.damage]
        if damage and strict:
            err = ClaimStateCorruptError(
                "; ".join(str(p) for p in damage)
                + f"; recovered {len(state)} claim(s) from the readable records"
            )
            err.problems = tuple(found)
            err.state = state
            raise err
        return state

    def close(self) -> None:
        """Close the journal, tombstone and lock descriptors (idempotent)."""
        with self._mutex:
            self._tombstones.close()
            for attr in ("_fd", "_lock_fd"):
                fd = getattr(self, attr)
                if fd >= 0:
                    os.close(fd)
                    setattr(self, attr, -1)

    def __enter__(self) -> ClaimState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- queries (in-memory; call inside locked() to see other instances' latest changes) -----

    @property
    def path(self) -> Path:
        """The journal file."""
        return self._path

    @property
    def problems(self) -> tuple[ClaimStateProblem, ...]:
        """Every problem found since open, oldest first."""
        return tuple(self._problems)

    @property
    def implementation(self) -> str:
        """``"c"`` (compiled) or ``"py"`` (twin): which native module backs this store."""
        return "py" if self._backend.__name__.endswith("_py") else "c"

    @property
    def compactions(self) -> int:
        """How many compactions this instance has done."""
        return self._compactions

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, str) and self._table.get(uid) is not None

    def get(self, uid: str) -> ClaimRecord | None:
        """The record of claim ``uid``, or ``None``."""
        with self._mutex:
            raw = self._table.get(uid)
        return None if raw is None else _record(uid, raw)

    def claims(self) -> dict[str, ClaimRecord]:
        """Every stored claim by UID, in table order."""
        with self._mutex:
            return {uid: self._stored(uid) for uid in self._table.uids()}

    def _stored(self, uid: str) -> ClaimRecord:
        """The record of ``uid``, known to be in the table (caller holds the mutex)."""
        raw = self._table.get(uid)
        assert raw is not None
        return _record(uid, raw)

    def holder(self, pool: str, device: str) -> str | None:
        """UID of the claim that holds ``pool``/``device`` without admin access, or ``None``."""
        with self._mutex:
            result: str | None = self._table.holder(pool, device)
            return result

    def journal_size(self) -> int:
        """Bytes of the journal file as this instance last saw it."""
        return self._offset

    def take_changes(self) -> set[str] | None:
        """The UIDs of the claims whose records this instance changed (stored, replaced or forgotten) since the last
        call, or ``None`` when any record may have changed: the table was loaded or reloaded from the file (at open,
        after another instance's compaction, after a failed write) or took records another instance appended. For
        one reader (the batch runner's :class:`~dradriver.kubeletplugin.claimviews.ClaimViews`), which then reads
        only those claims again instead of every claim: O(1) per change."""
        with self._mutex:
            changed, self._changed = self._changed, set()
            return changed

    def _touched(self, uid: str) -> None:
        """Note that this instance changed the record of ``uid`` (caller holds the mutex)."""
        if self._changed is not None:
            self._changed.add(uid)

    # ---- mutations ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[ClaimState]:
        """Hold the node-wide lock (re-entrant) and bring the table up to date with the file.

        :raises ClaimStateLockError: not acquired within ``lock_timeout`` seconds.
        """
        with self._mutex:
            self._acquire()
            try:
                yield self
            finally:
                self._release()

    @contextlib.contextmanager
    def group_commit(self) -> Iterator[ClaimState]:
        """Hold the lock and make every record written in the block durable together, at its end.

        Within the block, mutations update the table at once but their records are buffered; when the block
        ends (normally or by an exception) they are appended with one ``write``. So a batch of N claims costs
        one system call instead of N. Records of the block are acknowledged only when it
        has exited without :class:`ClaimStateError`: callers must not act on them (write CDI specs, answer
        the kubelet) inside the block. Nested blocks join the outer one.

        :raises ClaimStateError: the records could not be written; the table is reloaded from the file, so
            none of the block's changes remain.
        """
        with self.locked():
            if self._pending is not None:
                yield self
                return
            self._pending = []
            try:
                yield self
            finally:
                frames, self._pending = self._pending, None
                if frames:
                    self._append(b"".join(frames))

    def refresh(self) -> None:
        """Read what other instances wrote since our last read."""
        with self.locked():
            pass

    def prepare_started(self, uid: str, *, namespace: str, name: str, devices: Sequence[HeldDevice],
                        payload: bytes | str = b"") -> ClaimRecord:
        """Record claim ``uid`` as PREPARE_STARTED (replacing an earlier record of it) and persist it.

        :raises ClaimConflictError: a non-admin device is held by another claim (both named).
        :raises ClaimRecordError: a field cannot be stored (wrong type, empty UID, longer than 65535 bytes).
        :raises ClaimStateError: the record could not be written (the table is left as on disk).
        """
        with self.locked():
            try:
                frame = self._table.prepare_started(
                    uid, namespace, name, [d.as_tuple() for d in devices], payload
                )
            except ClaimConflictError as exc:
                raise self._conflict(exc, namespace, name) from None
            self._touched(uid)
            self._append(frame)
            return self._stored(uid)

    def prepare_completed(self, uid: str, *, devices: Sequence[HeldDevice] | None = None,
                          payload: bytes | str | None = None) -> ClaimRecord:
        """Mark claim ``uid`` PREPARE_COMPLETED, replacing devices and payload when given, and persist it.

        :raises ClaimUnknownError: the claim is not stored (unprepared meanwhile, or never started).
        :raises ClaimConflictError: a new non-admin device is held by another claim.
        :raises ClaimRecordError: a field cannot be stored.
        :raises ClaimStateError: the record could not be written.
        """
        with self.locked():
            tuples = None if devices is None else [d.as_tuple() for d in devices]
            try:
                frame = self._table.prepare_completed(uid, tuples, payload)
            except ClaimConflictError as exc:
                current = self._table.get(uid)
                assert current is not None  # an unknown UID raised ClaimUnknownError instead
                raise self._conflict(exc, current[1], current[2]) from None
            self._touched(uid)
            self._append(frame)
            return self._stored(uid)

    def remove(self, uid: str) -> bool:
        """Forget claim ``uid`` and persist that; ``False`` (nothing written) when it was not stored.

        :raises ClaimStateError: the record could not be written.
        """
        with self.locked():
            frame = self._table.remove(uid)
            if not frame:
                return False
            self._touched(uid)
            self._append(frame)
            return True

    def note_unprepared(self, uids: Sequence[str]) -> int:
        """Leave an unprepare tombstone for each claim UID, stamped now, for every instance on the node to see; returns
        the stamp (``CLOCK_MONOTONIC`` ns, :meth:`monotonic_ns`). Call it before the unprepare's side effects: a
        prepare call of one of these claims that began earlier, in any instance, then refuses to go on.

        :raises ClaimStateError: the tombstones could not be written (nothing was unprepared: answer an error).
        """
        with self.locked():
            self._read_tombstones()
            try:
                return self._tombstones.add(uids)
            except OSError as exc:
                raise ClaimStateError(f"cannot write unprepare tombstones {self._tombstones.path}: "
                                      f"{errno.errorcode.get(exc.errno or 0, '')} {exc}") from exc

    def unprepared_at(self, uid: str) -> int | None:
        """When claim ``uid`` was last unprepared on this node, by any instance, within the tombstone TTL
        (``CLOCK_MONOTONIC`` ns, comparable with :meth:`monotonic_ns`), or ``None``. Holds the lock; the file is read
        once per hold of it, so a check made inside :meth:`locked` stays true until that block ends.

        :raises ClaimStateError: the tombstone file could not be read.
        """
        with self.locked():
            self._read_tombstones()
            return self._tombstones.stamp(uid)

    def _read_tombstones(self) -> None:
        """Read the tombstones other instances wrote, once per hold of the lock (the caller holds it)."""
        if self._tombstones_read:
            return
        try:
            self._tombstones.sync()
        except OSError as exc:
            raise ClaimStateError(f"cannot read unprepare tombstones {self._tombstones.path}: "
                                  f"{errno.errorcode.get(exc.errno or 0, '')} {exc}") from exc
        self._tombstones_read = True

    def monotonic_ns(self) -> int:
        """Now on the tombstones' clock (``CLOCK_MONOTONIC``, nanoseconds): a prepare call's start, to compare with
        :meth:`unprepared_at`."""
        return self._tombstones.clock_ns()

    @property
    def tombstone_ttl_ns(self) -> int:
        """How long a tombstone is kept, nanoseconds: a prepare call older than this cannot be told apart from one
        that lost to an unprepare."""
        return self._tombstones.ttl_ns

    def compact(self) -> None:
        """Rewrite the journal as a snapshot of the live records now (normally automatic)."""
        with self.locked():
            self._compact()

    # ---- internals -----------------------------------------------------------------------------

    def _conflict(self, exc: ClaimConflictError, namespace: str, name: str) -> ClaimConflictError:
        held = self._table.get(exc.holder)
        holder = f"{held[1]}/{held[2]} (uid {exc.holder})" if held else f"uid {exc.holder}"
        return ClaimConflictError(
            exc.uid,
            exc.holder,
            exc.pool,
            exc.device,
            f"claim {namespace}/{name} (uid {exc.uid}): device {exc.pool}/{exc.device} is already "
            f"prepared for claim {holder}",
        )

    def _acquire(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        if self._lock_fd < 0:
            self._depth -= 1
            raise ClaimStateError(f"claim state {self._path} is closed")
        deadline = time.monotonic() + self._lock_timeout
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self._depth -= 1
                    raise ClaimStateLockError(
                        f"lock {self._lock_path} still held by another plugin instance after "
                        f"{self._lock_timeout:g} s"
                    ) from None
                time.sleep(_LOCK_POLL)
        try:
            if self._fd >= 0:
                self._sync()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._tombstones_read = False
        if self._depth == 0 and self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _report(self, problem: ClaimStateProblem) -> ClaimStateProblem:
        self._problems.append(problem)
        if self._on_problem is not None:
            self._on_problem(problem)
        return problem

    def _sync(self) -> None:
        """Bring the table up to date with the file (other instances' appends or compactions)."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            self._report(ClaimStateProblem(ProblemKind.MISSING, "journal vanished; rewritten from memory",
                                           self._path))
            self._compact()
            return
        if (st.st_dev, st.st_ino) != self._ino or st.st_size < self._offset:
            self._load()
            return
        if st.st_size == self._offset:
            return
        chunk = _read_all(self._fd, self._offset)
        self._changed = None  # another instance's records (which claims they touch is not decoded here)
        status, stop, _resume = self._table.apply(chunk, 0, self._backend.FORMAT_VERSION)
        if status == self._backend.APPLY_OK:
            self._offset += len(chunk)
        elif status == self._backend.APPLY_TORN:
            self._report(ClaimStateProblem(
                ProblemKind.TORN_TAIL,
                f"another instance left an incomplete record at byte {self._offset + stop}; truncated",
                self._path, offset=self._offset + stop))
            os.ftruncate(self._fd, self._offset + stop)  # no fsync: see Durability in the module docstring
            self._offset += stop
        else:
            self._load()

    def _load(self) -> list[ClaimStateProblem]:
        """Read the whole file into a fresh table, recovering as the module docstring says."""
        be = self._backend
        remove_temp_files(self._path)  # from a crashed compaction (we hold the lock: none is in progress)
        self._changed = None  # a fresh table: any record may differ from what a reader saw
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._table = be.Table()
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except FileNotFoundError:
            self._write_journal()
            return []
        try:
            data = _read_all(fd)
        except BaseException:
            os.close(fd)
            raise
        if not data:
            os.close(fd)
            self._write_journal()
            return []
        try:
            scan = _scan(be, self._table, data, self._path)
        except ClaimStateVersionError:
            os.close(fd)
            raise
        found, version, boot_id, header_len, torn_at = (list(scan.found), scan.version, scan.boot_id,
                                                        scan.header_len, scan.torn_at)
        if boot_id is not None and boot_id != self._boot_id:
            os.close(fd)
            discarded = len(self._table)
            self._table = be.Table()
            kept = self._keep_aside("boot")
            self._write_journal()
            found = [ClaimStateProblem(
                ProblemKind.BOOT_ID_CHANGED,
                f"node boot ID changed from {boot_id!r} to {self._boot_id!r}: the node rebooted, "
                f"discarded {discarded} prepared claim(s)", self._path, kept_at=kept, discarded=discarded)]
        elif any(p.damage for p in found):
            os.close(fd)
            kept = self._keep_aside("corrupt")
            self._write_journal()
            found = [
                ClaimStateProblem(p.kind, p.message, p.path, p.offset, kept, p.discarded) if p.damage else p
                for p in found
            ]
        else:
            if torn_at is not None:
                os.ftruncate(fd, torn_at)  # no fsync: see Durability in the module docstring
                data = data[:torn_at]
            st = os.fstat(fd)
            self._fd = fd
            self._ino = (st.st_dev, st.st_ino)
            self._offset = len(data)
            self._header_len = header_len
            if version != be.FORMAT_VERSION:
                self._write_journal()
                found.append(ClaimStateProblem(
                    ProblemKind.MIGRATED, f"format version {version} rewritten as version "
                    f"{be.FORMAT_VERSION}", self._path))
        for problem in found:
            self._report(problem)
        return found

    def _keep_aside(self, tag: str) -> Path:
        """Hard-link the current file to ``<file>.<tag>-<timestamp>`` (the journal itself stays in place)."""
        for attempt in range(100):
            kept = self._path.with_name(f"{self._path.name}.{tag}-{_timestamp()}"
                                        + (f".{attempt}" if attempt else ""))
            try:
                os.link(self._path, kept)
                return kept
            except FileExistsError:
                continue
        raise ClaimStateError(f"cannot keep a copy of {self._path}: too many files named {kept.name}")

    def _temp_prefix(self) -> str:
        return f".{self._path.name}.tmp-"

    def _write_journal(self) -> None:
        """Atomically replace the journal with header + snapshot of the table: temp, fsync, rename, fsync dir.

        The two syncs keep the header's boot ID readable after a power loss (see Durability).
        """
        be = self._backend
        data = be.encode_header(self._boot_id) + self._table.snapshot()
        tmp = self._path.with_name(f"{self._temp_prefix()}{os.getpid()}-{threading.get_ident()}")
        tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(tfd, view):]
            os.fsync(tfd)
        except BaseException:
            os.close(tfd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(tfd)
        os.rename(tmp, self._path)
        _fsync_dir(self._path.parent)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        self._ino = (st.st_dev, st.st_ino)
        self._offset = len(data)
        self._header_len = len(data) - self._table.live_bytes

    def _compact(self) -> None:
        """Rewrite the journal as a snapshot of the table.

        :raises ClaimStateError: the snapshot could not be written (the old journal stays in place).
        """
        try:
            self._write_journal()
        except OSError as exc:
            raise ClaimStateError(
                f"cannot compact claim state {self._path}: {errno.errorcode.get(exc.errno or 0, '')} {exc}"
            ) from exc
        self._compactions += 1

    def _append(self, frame: bytes) -> None:
        if self._pending is not None:
            self._pending.append(frame)
            return
        try:
            _write_all(self._fd, frame)  # no fdatasync: see Durability in the module docstring
        except OSError as exc:
            # Undo the half-applied change: cut the file back and reload the table from what is on disk.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._offset)
            self._load()
            raise ClaimStateError(
                f"cannot write claim state {self._path}: {errno.errorcode.get(exc.errno or 0, '')} {exc}"
            ) from exc
        self._offset += len(frame)
        dead = self._offset - self._header_len - self._table.live_bytes
        if dead > self._compact_min_bytes and dead > self._compact_ratio * self._table.live_bytes:
            # The record is already durable: a failed compaction (disk full, say) must not turn this
            # acknowledged change into an error. The journal keeps growing and the next change tries again.
            try:
                self._compact()
            except ClaimStateError as exc:
                self.compaction_failures += 1
                if self.compaction_failures == 1 or self.compaction_failures % 100 == 0:
                    log.warning("%s (%d failures); the journal keeps growing until compaction succeeds", exc,
                                self.compaction_failures)


def _record(uid: str, raw: tuple[Any, ...]) -> ClaimRecord:
    state, namespace, name, devices, payload = raw
    return ClaimRecord(
        uid=uid,
        phase=ClaimPhase(state),
        namespace=namespace,
        name=name,
        devices=tuple(HeldDevice(d[0], d[1], d[2], d[3], d[4]) for d in devices),
        payload=payload,
    )


@dataclass(frozen=True, slots=True)
class _Scan:
    """What :func:`_scan` read from a journal's bytes."""

    found: tuple[ClaimStateProblem, ...]
    version: int
    boot_id: str | None
    header_len: int
    torn_at: int | None


def _scan(be: _native.ClaimstoreModule, table: claimstore.Table, data: bytes, path: Path) -> _Scan:
    """Apply every readable record of the journal bytes ``data`` to ``table``: the one parse that opening the claim
    state (:meth:`ClaimState._load`) and reading it without writing (:func:`read_claims`) share. Nothing is written.

    :raises ClaimStateVersionError: the header names a newer format version.
    """
    found: list[ClaimStateProblem] = []
    version = be.FORMAT_VERSION
    boot_id: str | None = None
    try:
        version, boot_id, header_len = be.decode_header(data)
    except ClaimStateVersionError as exc:
        raise ClaimStateVersionError(f"claim state {path}: {exc}") from None
    except ClaimStateCorruptError as exc:
        header_len = exc.header_len
        found.append(ClaimStateProblem(ProblemKind.CORRUPT_HEADER, f"damaged header: {exc}", path,
                                       offset=0))
    torn_at: int | None = None
    if header_len:
        pos = header_len
        while True:
            status, stop, resume = table.apply(data, pos, version)
            if status == be.APPLY_OK:
                break
            if status == be.APPLY_TORN:
                torn_at = stop
                found.append(ClaimStateProblem(
                    ProblemKind.TORN_TAIL,
                    f"incomplete last record at byte {stop} ({len(data) - stop} bytes, never "
                    "acknowledged) truncated", path, offset=stop))
                break
            if status == be.APPLY_BAD_RECORD:
                found.append(ClaimStateProblem(
                    ProblemKind.CORRUPT_RECORD,
                    f"record at byte {stop} ({resume - stop} bytes) fails its checksum or does not "
                    "decode; skipped", path, offset=stop, discarded=1))
                pos = resume
                continue
            found.append(ClaimStateProblem(
                ProblemKind.CORRUPT_TAIL,
                f"record frame at byte {stop} is damaged; the {len(data) - stop} bytes from there on "
                "cannot be read", path, offset=stop))
            break
    return _Scan(tuple(found), version, boot_id, header_len, torn_at)


@dataclass(frozen=True, slots=True)
class ClaimSnapshot:
    """The claim state as a reader that writes nothing sees it (:func:`read_claims`).

    :param path: the journal file.
    :param exists: the file was there (``False``: the plugin never ran with this directory, or nothing was kept).
    :param boot_id: the boot ID in its header (``None``: the header is damaged; ``""`` with no file).
    :param claims: claim UID -> record, every readable record in table order.
    :param problems: what the plugin's next open would find (a torn last record, damage); the file is untouched.
    """

    path: Path
    exists: bool
    boot_id: str | None
    claims: dict[str, ClaimRecord]
    problems: tuple[ClaimStateProblem, ...]


def read_claims(path: Path | str, *, backend: _native.ClaimstoreModule | None = None) -> ClaimSnapshot:
    """Read the claim state at ``path`` without writing anything: no lock taken, no file created, truncated, kept
    aside or rewritten (for ``dradriver rollback-check``, which may run beside the plugin). The records are parsed
    as :meth:`ClaimState.open` parses them; a record the plugin is appending meanwhile reads as a torn tail, which
    is never acknowledged and left out, as the plugin would leave it out.

    :raises ClaimStateVersionError: the journal is of a newer format version (names the file).
    :raises OSError: the file exists but cannot be read.
    """
    path = Path(path)
    be = backend if backend is not None else _native.load("claimstore")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ClaimSnapshot(path, False, "", {}, ())
    if not data:  # as the plugin's open takes it: a journal created and not yet written, no claims
        return ClaimSnapshot(path, True, "", {}, ())
    table = be.Table()
    scan = _scan(be, table, data, path)
    claims: dict[str, ClaimRecord] = {}
    for uid in table.uids():
        raw = table.get(uid)
        if raw is not None:
            claims[uid] = _record(uid, raw)
    return ClaimSnapshot(path, True, scan.boot_id, claims, scan.found)
