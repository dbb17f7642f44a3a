"""The batch runner: NodePrepareResources / NodeUnprepareResources for any kubelet plugin, over its device
preparers.

For each claim of a prepare batch (``kubeletplugin/draplugin.go``, NVIDIA's ``cmd/gpu-kubelet-plugin/device_state.go``):

1. GET the ResourceClaim (outside the lock; the claims of one batch are fetched concurrently), check its UID
   and allocation, keep the results for our driver and this node's pool;
2. under the node-wide lock: a claim already PREPARE_COMPLETED returns its stored answer (its CDI spec is
   rewritten if it vanished); otherwise each result's device must exist in the device registry and must not
   be held by another claim (admin-access results excepted); its configs are selected; each device's
   preparer makes a pure plan, and the claim is recorded PREPARE_STARTED;
3. the plans are applied: each device's preparer, then the sharing step of each config group; every apply
   returns an :class:`~dradriver.domain.ports.UndoRecord`. Claims whose preparers have side effects are applied
   concurrently in worker threads (a slow or failing one does not hold up the others), and their records are
   stored with the claim (one group commit) before anything is acknowledged;
4. the claim's CDI spec is written (preparers' device edits, sharing edits, the plugin's spec-level edits),
   and the claim is recorded PREPARE_COMPLETED with its undo records.

Any failure undoes exactly what was applied for that claim (in reverse order), rolls it back and becomes that
claim's error string; other claims of the batch are unaffected. An apply that fails half-way raises
:class:`~dradriver.domain.ports.PartiallyApplied` with the record of what it did: that record is stored and undone
with the others. Sharing steps that keep a setting several claims share get :meth:`BatchRunner.stored_records`
(through their ``bind_records``), and steps may name older record kinds they undo (``undo_kinds``).

Unprepare works from the stored claim state alone (the ResourceClaim may be gone): delete the CDI spec, undo
the stored records in reverse order, then forget the claim. Unknown claims succeed. A failed undo keeps the
claim recorded and answers an error, so the kubelet's retry undoes again (undo is idempotent). A prepare that
was in flight when the same claim UID was unprepared is refused, so a slow prepare never brings an unprepared
claim back: each unprepare leaves a tombstone in the claim state (:meth:`ClaimState.note_unprepared`, on disk under
the node-wide lock), and each attempt of a prepare call checks it under the same lock, held until the claim is
recorded PREPARE_COMPLETED. So the guard holds across plugin instances (the old and the new pod of a rolling update)
and between a waiting prepare's attempts, when the claim has no record; a Prepare the kubelet sends after the
Unprepare was answered began later than the tombstone and is served.

Each record is undone by the part of the kind stored with it, whatever the feature gates say now (the parts of
features turned off are registered ``undo_only``), once the record says this release can read it
(:meth:`~dradriver.domain.ports.UndoRecord.check_readable`: records carry facts, and a newer writer's record is
undone unless it declares a newer reader).

A preparer that waits for something outside the node's control (the compute-domain channel preparer, for this
node's IMEX daemon to be Ready) raises :class:`~dradriver.domain.ports.NotReadyYet`: the claim is rolled back like
any failure (nothing of that attempt is undone) and retried with a doubling pause, outside the locks, until the
call's deadline. Preparers may also name further devices a claim holds, their own CDI IDs and their own spec
(:class:`~dradriver.domain.ports.ClaimSpecPreparer`). With ``aborted_ttl_s`` an unprepare that arrives while the
claim's prepare is in progress makes later prepares of the same allocation stale for that long (NVIDIA's
``PrepareAborted``): the claim's record becomes an aborted mark (PREPARE_STARTED, no devices, ``aborted_at`` in
its payload), which survives a restart.

At start, :meth:`BatchRunner.recover` keeps unexpired aborted marks and deletes expired ones, undoes and rolls back
other claims a crash left PREPARE_STARTED, lets every
preparer sweep side effects no record knows, and removes CDI specs of ours that no stored claim owns, so the
node converges after a SIGKILL at any point.

Claim-state payload: JSON ``{"spec": <spec path>, "undo": [<UndoRecord.to_json()>...]}`` plus the optional keys
``pins``, ``shares``, ``aborted_at`` (Unix seconds) and ``allocation`` (:class:`StoredPayload`); a payload that is
a bare spec path (written before undo records existed) reads as a claim without records. The claim store's record
format is unchanged: an older plugin reads an aborted mark as a half-prepared claim without devices and rolls it
back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dradriver.domain import cdi
from dradriver.domain.cdi import LEGACY_SPEC_SUFFIX, SPEC_SUFFIX
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef, ClaimResult
from dradriver.domain.configs import ConfigGroup, ConfigSelection
from dradriver.domain.devicemetadata import runtime_attributes
from dradriver.domain.identity import DriverIdentity
from dradriver.domain.ports import (
    UNDO_LAYOUT,
    ClaimStep,
    DevicePlan,
    DevicePreparer,
    NotReadyYet,
    PartiallyApplied,
    RequestMetrics,
    SharingStep,
    UndoRecord,
)
from dradriver.domain.registry import DeviceRegistry
from dradriver.errors import DradriverError
from dradriver.host import cdifiles
from dradriver.host.claimstate import ClaimConflictError, ClaimPhase, ClaimRecord, ClaimState, HeldDevice
from dradriver.host.devicemetadata import DeviceMetadataFiles
from dradriver.host.pluginlocks import PluginLocks, PluginLockTimeout
from dradriver.kubeletplugin.claimviews import ClaimViews, PreparedDevices
from dradriver.kubeletplugin.fairlock import FairLock
from dradriver.kubeletplugin.payload import (
    aborted_mark,
    encode_payload,
    held_devices,
    read_payload,
    shares_of,
)
from dradriver.kubeletplugin.rollback import RollbackCheckpoint

log = logging.getLogger(__name__)

FetchClaim = Callable[[ClaimRef, float], Claim]
"""Blocking: GET the claim and reduce it, giving up after the given seconds (``dradriver.kube.claims.fetch_claim``
bound to a client and passed ``timeout_s``); a claim-level problem raises :class:`ClaimError`, a GET that did not
answer in time a :class:`~dradriver.errors.DradriverError`."""

SelectConfigs = Callable[[Claim, Mapping[str, Any]], ConfigSelection]
"""Decode, select and validate a claim's opaque configs for its devices (``configs.select_configs``).

:raises ClaimError: naming the claim and the config's field path."""

DEFAULT_PREPARE_DEADLINE_S = 40.0
"""Default bound of one NodePrepareResources, seconds: the kubelet gives up after 45 s
(``defaultClientCallTimeout``, ``pkg/kubelet/cm/dra/plugin/dra_plugin.go``), so the answer must come before."""


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`BatchRunner.recover` did at start."""

    rolled_back: tuple[str, ...]
    orphan_specs_removed: tuple[str, ...]
    """CDI specs of claims prepared before the node rebooted (deleted)."""
    claims_kept: int
    missing_devices: tuple[str, ...]
    adopted: tuple[str, ...] = ()
    swept: tuple[str, ...] = ()
    undo_failed: tuple[str, ...] = ()
    rebuilt_specs: tuple[str, ...] = ()
    """Completed claims whose CDI spec was missing or invalid and was rebuilt."""
    unusable: tuple[str, ...] = ()
    """Completed claims whose devices moved to another physical device or are gone (spec left alone)."""
    damage: str = ""
    """Why recovery took the damaged-state path although the claim state reported no damage ("" if it did not)."""
    aborted_kept: tuple[str, ...] = ()
    """Claims whose aborted-prepare mark (``PrepareAborted``) is still within its TTL (prepares stay refused)."""
    aborted_expired: tuple[str, ...] = ()
    """Claims whose aborted-prepare mark had expired (deleted)."""


@dataclass(slots=True)
class _Recovery:
    """What :meth:`BatchRunner.recover`'s steps found and did so far (claim UIDs; :class:`RecoveryReport`)."""

    rolled_back: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    undo_failed: list[str] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    unusable: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    kept_aborted: list[str] = field(default_factory=list)
    damage: str = ""

    def report(self, claims_kept: int, missing: Sequence[str]) -> RecoveryReport:
        return RecoveryReport(tuple(self.rolled_back), tuple(self.removed), claims_kept, tuple(missing),
                              tuple(self.adopted), tuple(self.swept), tuple(self.undo_failed), tuple(self.rebuilt),
                              tuple(self.unusable), self.damage, tuple(self.kept_aborted), tuple(self.expired))


@dataclass(slots=True)
class _Work:
    """One claim of a prepare batch after phase 1."""

    claim: Claim
    held: list[HeldDevice]
    plans: list[DevicePlan]
    groups: list[ConfigGroup]
    stale: list[UndoRecord]
    applied: list[UndoRecord] = field(default_factory=list)
    error: str = ""
    retry: bool = False
    """The apply raised :class:`~dradriver.domain.ports.NotReadyYet`: retried until the deadline."""
    ready_hint: Callable[[], bool] | None = None
    """That error's test of when to try again (:attr:`~dradriver.domain.ports.NotReadyYet.ready_hint`)."""
    deadline: float | None = None
    """``time.monotonic()`` by which its applies must be done (the kubelet's deadline less the runner's margin)."""

    @property
    def uid(self) -> str:
        return self.claim.ref.uid


def allocation_digest(claim: Claim) -> str:
    """A short digest (16 hex digits) of what the claim was allocated on this node: its allocation results for our
    driver and pool and its opaque configs. Two prepares of one claim UID see the same digest unless the claim's
    allocation changed (NVIDIA compares the whole stored ``status`` for its ``PrepareAborted`` check, 4.8)."""
    doc = [[dataclasses.asdict(r) for r in claim.results], list(claim.configs)]
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def all_undo_records(state: ClaimState) -> list[UndoRecord]:
    """Every undo record of every stored claim, PREPARE_STARTED ones included (unreadable payloads are logged and
    skipped), for preparers that derive shared ownership from the claim state (consumable shares)."""
    out: list[UndoRecord] = []
    for record in state.claims().values():
        try:
            out.extend(read_payload(record.payload).undo)
        except ValueError as exc:
            log.error("claim %s: unreadable undo records: %s", record.ref, exc)
    return out


def _pin_of(device: object) -> str | None:
    """The physical identity of a registry entry: its ``uuid`` (GPU or MIG UUID) when it has one."""
    uuid = getattr(device, "uuid", None)
    return uuid if isinstance(uuid, str) and uuid else None


RETRY_PAUSE_S = (0.1, 2.0)
"""Default first and longest pause, seconds, between the attempts of a not-ready claim (doubling from the first;
NVIDIA's compute-domain plugin uses 250 ms -> 3 s, ``cmd/compute-domain-kubelet-plugin/device_state.go``)."""
RetryHints = dict[str, Callable[[], bool] | None]
"""Claim UID -> the ready hint of its not-ready error (:attr:`~dradriver.domain.ports.NotReadyYet.ready_hint`)."""
FETCH_WORKERS = 16
"""Default threads of the runner's claim-fetch pool (a batch's ResourceClaim GETs, half of them at a time)."""
HINT_POLL_S = 0.05
"""How often, seconds, a pause polls the ready hints of the claims it waits for (a local file read each)."""


class BatchRunner:
    """Implements :class:`dradriver.domain.ports.ClaimPreparer` for the gRPC layer, over device preparers.

    :param identity: the plugin's names (CDI kind of its specs).
    :param registry: this node's devices (DRA device name -> device); looked up per claim.
    :param state: the durable claim state (holds the node-wide lock for every mutation).
    :param fetch_claim: blocking claim GET + reduction; raises :class:`ClaimError` for a claim-level problem.
    :param cdi_root: directory for the per-claim CDI specs.
    :param pool: this node's pool name (the node name).
    :param preparers: one per device kind; the first whose ``handles(device)`` is true prepares a device. A
        preparer with ``check_claim(claim, plans)`` is shown all its plans of a claim before anything is applied
        (rules over several devices of one claim; raises :class:`ClaimError`).
    :param sharing: sharing steps by strategy (``None`` = exclusive use).
    :param claim_steps: steps applied once per claim over its (non-admin-access) devices after the sharing steps,
        when their ``applies(devices)`` is true (:class:`~dradriver.domain.ports.ClaimStep`: the Fabric Manager
        partition); undone by kind, swept at start, given ``bind_records`` like sharing steps.
    :param undo_only: preparers and sharing steps of features turned off now (their feature gate or flag): they
        undo the records of their kind that claims prepared while the feature was on still hold, and nothing
        else (no prepare, no start-up sweep). Teardown follows the kind stored with each record, never the
        current gates, so every kind that ever wrote a record must be in ``preparers``, ``sharing`` or here.
    :param select_configs: the plugin's config selection; ``None``: the plugin takes no configs (every
        device gets no config group, and no sharing step runs).
    :param spec_edits: the spec-level CDI edits (called once per spec written; e.g. control nodes and the
        driver's user space).
    :param apply_workers: worker threads for side-effecting applies of one batch.
    :param fetch_workers: threads for ResourceClaim GETs (their own pool, see :meth:`prepare_claims`).
    :param prepare_deadline_s: the longest a NodePrepareResources may take (seconds), below the kubelet's 45 s.
    :param chunk_size: claims of a batch prepared or unprepared per turn of the lock (each chunk has its own group
        commits); a batch submits at most half the fetch workers' GETs at a time, so another batch's GETs and
        chunks interleave with it instead of queueing behind it.
    :param on_prepared: told each newly prepared claim and its undo records once its completion is durable (e.g.
        to publish dynamic MIG identities in ``status.devices``); must not block; exceptions are logged.
    :param on_unprepared: told each unprepared claim and the records it held, once it is forgotten.
    :param checkpoint: NVIDIA's ``checkpoint.json`` kept for a rollback (:mod:`dradriver.kubeletplugin.rollback`):
        told each prepared and unprepared claim under the lock, flushed before the answers.
    :param aborted_ttl_s: when > 0, a claim unprepared while its prepare was in progress (retrying, or left
        PREPARE_STARTED) is marked aborted in the claim state for this many seconds and a prepare of the same
        allocation in that time is refused as stale (NVIDIA's compute-domain ``PrepareAborted`` with ``abortedAt``,
        TTL 90 s, kept in its checkpoint: NVIDIA's ``cmd/compute-domain-kubelet-plugin/checkpoint.go``,
        ``device_state.go``). The mark survives a plugin restart;
        expired marks are deleted at start (:meth:`recover`), at each unprepare and by
        :meth:`forget_expired_aborts` (the periodic cleanup, 4.9). 0 (the GPU plugin) keeps only the in-flight
        tombstones.
    :param retry_pause_s: first and longest pause, seconds, between the attempts of a claim whose preparer raised
        :class:`~dradriver.domain.ports.NotReadyYet` (doubling from the first); a pause ends early when the ready
        hint of a waiting claim's error (:attr:`~dradriver.domain.ports.NotReadyYet.ready_hint`, polled every
        :data:`HINT_POLL_S`) says another attempt may succeed.
    :param clock: wall-clock seconds (Unix time) for ``abortedAt`` (tests pass their own); wall clock, not
        monotonic, because the mark must mean the same after a restart.
    :param driver_unavailable: why the device driver cannot be used now (``""`` when it can; the GPU plugin: the
        NVML session's reason). While it says why, an unprepare whose undo fails still succeeds: the spec is
        deleted, the devices are released, and the records not undone are kept with the claim (a PREPARE_STARTED
        record without devices) until :meth:`resume_undo`; a start-up sweep that fails is logged, and every part
        sweeps again there.
    :param driver_kinds: record kinds whose undo acts on devices through the driver and finds them in the device
        registry (dynamic MIG instances, time-slice settings): while the driver is unavailable the registry holds
        no device, so such an undo would take its device for gone; their records are kept without being tried.
    :param refuse_device: why a claim not prepared yet may not be prepared on a device now (DRA device name,
        registry entry -> reason, ``""`` when it may; the GPU plugin: its per-node device policy). A prepared
        claim is answered from the claim state without asking.
    :param sibling_of: DRA device name -> the name of the other device that is the same hardware (a GPU's
        ``gpu-<minor>`` and its VFIO ``gpu-vfio-<index>``), ``None`` when it has none. Both may be allocated, to
        two claims, before either is prepared (the pool withdraws a sibling only once one is held), so a claim
        whose device's sibling another claim holds (completed or in progress, by this or another plugin
        instance: the claim state's holder index under its lock), or that asks for both, is refused before
        anything is recorded, naming both devices and the other claim.
    :param locks: NVIDIA's plugin locks of the plugin directory (:mod:`dradriver.host.pluginlocks`): ``pu.lock``
        is held around each prepare and unprepare chunk and around :meth:`recover`, inside the runner's lock and
        outside the claim state's, so NVIDIA's plugin running on the node at the same time (a switch) never
        interleaves with them. A chunk whose wait times out answers each of its claims with the lock's error.

    A preparer may give the spec-level edits of its claims itself (``claim_edits(ref, plans, records)``: the VFIO
    preparer's env and API device, once per claim): when every device of a claim is of such kinds they replace
    :attr:`spec_edits` (the driver's user space), else they are added to them.
    """

    def __init__(
        self,
        *,
        identity: DriverIdentity,
        registry: DeviceRegistry[Any],
        state: ClaimState,
        fetch_claim: FetchClaim,
        cdi_root: Path,
        pool: str,
        preparers: Sequence[DevicePreparer],
        sharing: Sequence[SharingStep] = (),
        undo_only: Sequence[DevicePreparer | SharingStep | ClaimStep] = (),
        select_configs: SelectConfigs | None = None,
        spec_edits: Callable[[], cdi.ContainerEdits] = cdi.ContainerEdits,
        metrics: RequestMetrics | None = None,
        apply_workers: int = 8,
        fetch_workers: int = FETCH_WORKERS,
        prepare_deadline_s: float = DEFAULT_PREPARE_DEADLINE_S,
        chunk_size: int = 128,
        on_prepared: Callable[[ClaimRef, Sequence[UndoRecord]], None] | None = None,
        on_unprepared: Callable[[ClaimRef, Sequence[UndoRecord]], None] | None = None,
        checkpoint: RollbackCheckpoint | None = None,
        aborted_ttl_s: float = 0.0,
        retry_pause_s: tuple[float, float] = RETRY_PAUSE_S,
        clock: Callable[[], float] = time.time,
        driver_unavailable: Callable[[], str] | None = None,
        driver_kinds: Collection[str] = (),
        device_metadata: DeviceMetadataFiles | None = None,
        refuse_device: Callable[[str, object], str] | None = None,
        claim_steps: Sequence[ClaimStep] = (),
        sibling_of: Callable[[str], str | None] | None = None,
        locks: PluginLocks | None = None,
    ) -> None:
        kinds = [p.kind for p in preparers] + [s.kind for s in sharing] + [c.kind for c in claim_steps] \
            + [u.kind for u in undo_only]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"preparer and sharing-step kinds must be unique: {kinds}")
        self.identity = identity
        self.registry = registry
        self.state = state
        self.fetch_claim = fetch_claim
        self.cdi_root = cdi_root
        self._cdi_dir = str(Path(cdi_root))  # normalised as Path joins it: payloads keep the same spec string
        self.pool = pool
        self.preparers = tuple(preparers)
        self.sharing = {s.strategy: s for s in sharing}
        self._device_kinds: dict[str, DevicePreparer] = {p.kind: p for p in preparers}
        self.claim_steps = tuple(claim_steps)
        self._by_kind: dict[str, DevicePreparer | SharingStep | ClaimStep] = dict(self._device_kinds)
        self._by_kind.update({s.kind: s for s in sharing})
        self._by_kind.update({c.kind: c for c in claim_steps})
        self._by_kind.update({u.kind: u for u in undo_only})
        for step in (*sharing, *claim_steps, *undo_only):
            # kinds an older release wrote for what this step now undoes (records must stay undoable)
            for alias in getattr(step, "undo_kinds", ()):
                self._by_kind.setdefault(alias, step)
            bind = getattr(step, "bind_records", None)
            if callable(bind):
                bind(self.stored_records)
        self._payload_cache: dict[str, tuple[bytes | str, tuple[UndoRecord, ...]]] = {}
        self.select_configs = select_configs
        self.spec_edits = spec_edits
        self.device_metadata = device_metadata
        self.metrics = metrics
        self.apply_workers = apply_workers
        self.prepare_deadline_s = prepare_deadline_s
        self.deadline_margin_s = min(2.0, prepare_deadline_s / 4)
        # A batch's claim GETs on their own bounded pool (each within the call's fetch budget); they never delay an
        # unprepare, which needs no API call and runs in the caller's thread.
        self._fetch_pool = concurrent.futures.ThreadPoolExecutor(fetch_workers, thread_name_prefix="claim-fetch")
        self._fetch_share = max(1, fetch_workers // 2)
        self._closed = threading.Event()
        # In-process serialisation, first come first served, taken per chunk of a batch so that a small batch
        # never waits for a large one to finish; ClaimState adds the node-wide flock.
        self._lock = FairLock()
        self.chunk_size = chunk_size
        self.on_prepared = on_prepared
        self.on_unprepared = on_unprepared
        self.checkpoint = checkpoint
        self.aborted_ttl_s = aborted_ttl_s
        self.retry_pause_s = retry_pause_s
        self.clock = clock
        self.driver_unavailable = driver_unavailable
        self.driver_kinds = frozenset(driver_kinds)
        self.refuse_device = refuse_device
        self.sibling_of = sibling_of
        self.locks = locks
        self._allocations: dict[str, str] = {}
        """Claim UID -> :func:`allocation_digest` of claims with a prepare in flight (with ``aborted_ttl_s``): the
        allocation an aborted mark records when the claim has no STARTED record (it is between two attempts)."""
        self._statuses: dict[str, Mapping[str, Any] | None] = {}
        """Claim UID -> ``status`` of claims with a prepare in flight (with ``aborted_ttl_s`` and ``checkpoint``):
        what NVIDIA's ``PrepareAborted`` entry records, its compute-domain plugin comparing it at prepare."""
        self._in_flight: dict[str, int] = {}
        """Claim UID -> prepare calls in progress for it (to tell an unprepare that aborts one)."""
        self._flight_lock = threading.Lock()  # prepare calls of several DRA server threads count in _in_flight
        self.preparations = 0  # claims actually prepared (not answered from state); for tests and metrics
        self.views = ClaimViews(self._device_kind)
        """What the stored claims hold (metrics): updated by the claims each batch changed, rebuilt from every
        claim only when the claim state says any may have changed (:meth:`_refresh_views`)."""
        self._counts: tuple[int, dict[str, int]] = (0, {})
        self._refresh_views()

    # ---------------------------------------------------------------------------------- helpers
    def preparer_for(self, device: object) -> DevicePreparer | None:
        """The preparer of ``device``, or ``None`` when no preparer handles it."""
        for preparer in self.preparers:
            if preparer.handles(device):
                return preparer
        return None

    def stored_records(self, kind: str, exclude_uid: str) -> list[tuple[str, UndoRecord]]:
        """The undo records of ``kind`` stored with PREPARE_COMPLETED claims other than ``exclude_uid``, as
        (claim UID, record) in claim-state order (:data:`~dradriver.domain.ports.StoredRecords`). Parsed
        payloads are cached by payload text, so a call costs one pass over the claims."""
        out: list[tuple[str, UndoRecord]] = []
        for uid, _record, undo in self._completed_undo():
            if uid != exclude_uid:
                out.extend((uid, r) for r in undo if r.kind == kind)
        return out

    def prepared_claims(self) -> list[tuple[ClaimRef, tuple[UndoRecord, ...]]]:
        """Every PREPARE_COMPLETED claim that carries its name (not one adopted from a CDI spec after claim-state
        damage: its name is unknown) with its undo records, in claim-state order; for the device status writer's
        start-up re-queue (:meth:`~dradriver.kubeletplugin.devicestatus.DeviceStatusWriter.requeue`)."""
        return [(record.ref, undo) for _uid, record, undo in self._completed_undo()
                if record.namespace and record.name]

    def _completed_undo(self) -> list[tuple[str, ClaimRecord, tuple[UndoRecord, ...]]]:
        """(UID, record, undo records) of each PREPARE_COMPLETED claim whose payload reads; parsed payloads are
        cached by payload text."""
        out: list[tuple[str, ClaimRecord, tuple[UndoRecord, ...]]] = []
        claims = self.state.claims()
        if len(self._payload_cache) > 2 * len(claims) + 64:
            self._payload_cache = {u: c for u, c in self._payload_cache.items() if u in claims}
        for uid, record in claims.items():
            if record.phase is not ClaimPhase.PREPARE_COMPLETED:
                continue
            cached = self._payload_cache.get(uid)
            if cached is None or cached[0] != record.payload:
                try:
                    cached = (record.payload, tuple(read_payload(record.payload).undo))
                except ValueError:
                    continue
                self._payload_cache[uid] = cached
            out.append((uid, record, cached[1]))
        return out

    def spec_path(self, uid: str) -> Path:
        """This plugin's CDI spec file for claim ``uid``."""
        return self.identity.cdi.spec_path(self.cdi_root, uid)

    def _spec_file(self, uid: str) -> str:
        """:meth:`spec_path` as the string the claim's payload stores (built without pathlib: once per claim
        record written)."""
        return os.path.join(self._cdi_dir, self.identity.cdi.spec_name(uid))

    def _device_kind(self, name: str) -> str:
        device = self.registry.get(name)
        preparer = None if device is None else self.preparer_for(device)
        return "unknown" if preparer is None else preparer.kind

    # ---------------------------------------------------------------------------------- prepare
    def prepare_claims(self, claims: Sequence[ClaimRef], *,
                       deadline_s: float | None = None) -> Mapping[str, ClaimResult]:
        """Prepare a batch; every UID gets a result (see the module docstring), within the deadline.

        Blocking: called from the DRA server's worker thread (one per call), which it keeps until the answer.
        A one-claim call fetches and prepares in that thread (:meth:`_prepare_single`); a batch fetches on the
        fetch pool and prepares in the calling thread (:meth:`_prepare_batch`).

        :param deadline_s: seconds left of the kubelet's gRPC deadline; the answer comes before
            ``min(deadline_s, prepare_deadline_s)``. A claim whose ResourceClaim GET has not finished by then
            (a hung API server) gets a per-claim error and nothing is prepared for it; the kubelet retries.
        """
        started = self.state.monotonic_ns()  # compared with unprepare tombstones (ClaimState.unprepared_at)
        began = time.monotonic()
        with self._flight_lock:
            for ref in claims:
                self._in_flight[ref.uid] = self._in_flight.get(ref.uid, 0) + 1
        try:
            return self._prepare_claims(claims, started, began, deadline_s)
        finally:
            with self._flight_lock:
                for ref in claims:
                    left = self._in_flight.get(ref.uid, 1) - 1
                    if left > 0:
                        self._in_flight[ref.uid] = left
                    else:
                        self._in_flight.pop(ref.uid, None)
                        self._allocations.pop(ref.uid, None)
                        self._statuses.pop(ref.uid, None)

    def _prepare_claims(self, claims: Sequence[ClaimRef], started: int, began: float,
                        deadline_s: float | None) -> Mapping[str, ClaimResult]:
        budget = self.prepare_deadline_s if deadline_s is None else min(deadline_s, self.prepare_deadline_s)
        fetch_budget = max(0.0, budget - self.deadline_margin_s)
        results: dict[str, ClaimResult]
        with self.metrics.in_flight("prepare") if self.metrics else contextlib.nullcontext():
            retry: RetryHints = {}
            items: list[tuple[ClaimRef, Claim | str]] = []
            if len(claims) == 1:  # the common case: GET and preparation in this thread
                results = self._prepare_single(claims[0], started, began, fetch_budget, budget, retry, items)
            else:
                results = self._prepare_batch(claims, started, began, fetch_budget, budget, retry, items)
            apply_deadline = began + max(0.0, budget - self.deadline_margin_s)
            pause, longest = self.retry_pause_s
            while retry:
                # Claims whose preparer is waiting for something (an IMEX daemon's readiness): pause without any
                # lock, then try again, until the deadline; the last attempt's error is the answer. With ready
                # hints the pause may end early, so it is worth taking even when it would reach the deadline.
                hints = [h for h in retry.values() if h is not None]
                if self._closed.is_set() or time.monotonic() + (0.0 if hints else pause) >= apply_deadline:
                    waited = time.monotonic() - began
                    why = "the plugin is stopping" if self._closed.is_set() else "the kubelet retries"
                    for uid in retry:
                        results[uid] = ClaimResult(error=f"{results[uid].error} (still not ready after "
                                                         f"{waited:.1f} s of retries; {why})")
                    break
                self._pause(min(pause, apply_deadline - time.monotonic()), hints)
                if self._closed.is_set():
                    continue  # answered above with the last error
                pause = min(longest, pause * 2)
                again = [(ref, got) for ref, got in items if ref.uid in retry]
                retry = {}
                results.update(self._prepare_all(again, started, apply_deadline, retry))
        if self.metrics is not None:
            seconds = time.monotonic() - began
            for res in results.values():
                outcome = "success" if res.ok else "error"
                self.metrics.observe_prepare(outcome, seconds, error_type=None if res.ok else "prepare_devices")
        self._changed()
        return results

    def _pause(self, seconds: float, hints: Sequence[Callable[[], bool]]) -> None:
        """Sleep ``seconds`` in the calling thread, or less: until one of ``hints`` says try now (each polled every
        :data:`HINT_POLL_S`; a hint is a small local read; one that raises counts as "not yet")."""
        end = time.monotonic() + max(0.0, seconds)
        if not hints:
            self._closed.wait(max(0.0, seconds))
            return
        while (left := end - time.monotonic()) > 0 and not self._closed.is_set():
            self._closed.wait(min(HINT_POLL_S, left))
            for hint in hints:
                try:
                    if hint():
                        return
                except Exception:  # a hint is advice: a broken one leaves the pause as it is
                    log.debug("ready hint failed", exc_info=True)

    def _prepare_batch(self, claims: Sequence[ClaimRef], started: int, began: float, fetch_budget: float,
                       budget: float, retry: RetryHints,
                       items: list[tuple[ClaimRef, Claim | str]]) -> dict[str, ClaimResult]:
        """Fetch every claim on the fetch pool (at most half of it at a time, so that another batch's GETs
        interleave with this one's), then prepare them in the calling thread.

        :param retry: filled with the UIDs of claims whose preparer is not ready yet, each with that preparer's
            ready hint or ``None`` (retried by the caller).
        :param items: filled with the fetched claims (what a retry prepares again).
        """
        fetched: list[Claim | str | None] = [None] * len(claims)
        waiting = list(range(len(claims)))
        waiting.reverse()
        running: dict[concurrent.futures.Future[Claim | str], int] = {}
        fetch_deadline = time.monotonic() + fetch_budget
        while waiting or running:
            left = fetch_deadline - time.monotonic()
            if left <= 0:
                break
            while waiting and len(running) < self._fetch_share:
                index = waiting.pop()
                running[self._fetch_pool.submit(self._fetch, claims[index], left)] = index
            done, _ = concurrent.futures.wait(running, timeout=left,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                fetched[running.pop(future)] = future.result()
        for future in running:  # the GET goes on in its thread; its answer is dropped
            future.cancel()
        items.extend((ref, _fetch_timeout(ref, fetch_budget) if got is None else got)
                     for ref, got in zip(claims, fetched, strict=True))
        apply_deadline = began + max(0.0, budget - self.deadline_margin_s)
        return self._prepare_all(items, started, apply_deadline, retry)

    def _prepare_single(self, ref: ClaimRef, started: int, began: float, fetch_budget: float,
                        budget: float, retry: RetryHints,
                        items: list[tuple[ClaimRef, Claim | str]]) -> dict[str, ClaimResult]:
        """One claim: its GET and then its preparation in the calling thread, no hand-off to another thread. The
        GET gets ``fetch_budget`` as its time limit (:data:`FetchClaim`): one that has not answered by then is the
        claim's per-claim error and nothing is prepared, as in a batch."""
        fetched = self._fetch(ref, fetch_budget)
        if isinstance(fetched, str) and time.monotonic() - began >= fetch_budget:
            fetched = _fetch_timeout(ref, fetch_budget)
        items.append((ref, fetched))
        return self._prepare_all([(ref, fetched)], started, began + max(0.0, budget - self.deadline_margin_s), retry)

    def close(self) -> None:
        """Stop the runner's threads (fetches in flight are abandoned, retry pauses end; idempotent)."""
        self._closed.set()
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    def _changed(self) -> None:
        """After a batch: publish the counts :meth:`_refresh_views` computed (no locking)."""
        if self.metrics is not None:
            claims, by_type = self._counts
            self.metrics.set_prepared(claims, by_type)

    def _refresh_views(self) -> None:
        """With the runner's lock held, after a batch: bring :attr:`views` up to date by the claims whose records
        changed since the last refresh (:meth:`ClaimState.take_changes`; O(1) per claim changed, whatever the
        claims held), or from every claim when any may have changed (at start, after another instance's
        records), and take the metric counts."""
        changed = self.state.take_changes()
        if changed is None:
            self.views.rebuild(self.state.claims().values())
        else:
            for uid in changed:
                self.views.update(uid, self.state.get(uid))
        self._counts = self.views.counts()

    def _fetch(self, ref: ClaimRef, timeout_s: float) -> Claim | str:
        try:
            return self.fetch_claim(ref, timeout_s)
        except ClaimError as exc:
            return str(exc)
        except DradriverError as exc:
            return f"claim {ref}: cannot read the ResourceClaim: {exc}"
        except Exception as exc:  # one claim's problem is that claim's answer (RecursionError included)
            return _claim_error(ref, exc)

    def _prepare_all(self, items: list[tuple[ClaimRef, Claim | str]], started: int,
                     deadline: float | None = None, retry: RetryHints | None = None) -> dict[str, ClaimResult]:
        """Prepare a batch chunk by chunk (:meth:`_prepare_chunk`), taking the lock per chunk.

        :param deadline: ``time.monotonic()`` by which side effects must be applied (sharing steps that wait,
            such as an MPS control daemon's readiness, wait at most until then).
        """
        out: dict[str, ClaimResult] = {}
        for i in range(0, len(items), self.chunk_size):
            out.update(self._prepare_chunk(items[i:i + self.chunk_size], started, deadline, retry))
        return out

    def _prepare_chunk(self, items: list[tuple[ClaimRef, Claim | str]], started: int,
                       deadline: float | None = None, retry: RetryHints | None = None) -> dict[str, ClaimResult]:
        """Prepare a chunk in phases, so its durability costs O(1) syncs of the claim state.

        1. under one group commit: check and plan every claim, record the valid ones PREPARE_STARTED (one sync);
        2. apply the plans (side effects; concurrently per claim); under one group commit, store the undo
           records of claims with side effects (one sync, only when some preparer has side effects);
        3. write each claim's CDI spec (atomic rename, no fsync: see :mod:`dradriver.host.claimstate`);
        4. under one group commit: record them PREPARE_COMPLETED (one sync); failed ones are undone and
           rolled back.

        A claim's answer is given only after phase 4 is durable. A crash at any point leaves STARTED claims,
        which the next start undoes and rolls back (:meth:`recover`), or COMPLETED ones whose specs are on disk.
        Any error, expected or not, stays with its claim: every UID of the batch gets an answer.
        """
        out: dict[str, ClaimResult] = {}
        with self._lock:
            try:
                with self._plugin_lock(deadline):
                    done = self._prepare_locked(items, started, deadline, retry, out)
            except PluginLockTimeout as exc:  # nothing of the chunk began: each claim's answer is the lock's error
                for ref, fetched in items:
                    out[ref.uid] = ClaimResult(error=fetched if isinstance(fetched, str) else f"claim {ref}: {exc}")
                done = []
            finally:
                self._refresh_views()  # O(claims of the chunk)
        if self.checkpoint is not None and (unsaved := self.checkpoint.flush_or_error()):
            answered = [w.uid for w in done] + [u for u, r in out.items() if r.devices]
            out.update((uid, ClaimResult(error=f"claim {uid}: {unsaved}")) for uid in answered)
            done = []
        for work in done:
            self.preparations += 1
            log.info("prepared claim %s: %s", work.claim.ref, ", ".join(h.device for h in work.held))
            out[work.uid] = ClaimResult(devices=tuple(h.to_prepared() for h in work.held if h.request_names))
            self._tell(self.on_prepared, work.claim.ref, work.applied)
        return out

    def _prepare_locked(self, items: list[tuple[ClaimRef, Claim | str]], started: int, deadline: float | None,
                        retry: RetryHints | None, out: dict[str, ClaimResult]) -> list[_Work]:
        """:meth:`_prepare_chunk`'s phases 1 to 4, the runner's lock held: fills ``out`` with the answers known so
        far (errors, answers from the claim state) and returns the claims newly prepared."""
        todo: list[_Work] = []
        done: list[_Work] = []
        try:
            with self.state.locked():
                with self.state.group_commit():
                    for ref, fetched in items:
                        if isinstance(fetched, str):
                            out[ref.uid] = ClaimResult(error=fetched)
                            continue
                        try:
                            answer = self._start_one(fetched, started)
                        except Exception as exc:  # one claim's problem is that claim's answer
                            out[ref.uid] = ClaimResult(error=_claim_error(ref, exc))
                            continue
                        if isinstance(answer, ClaimResult):
                            out[ref.uid] = answer
                            if answer.devices and self.checkpoint is not None:
                                self.checkpoint.prepared_again(fetched, self.state.get(ref.uid))
                        else:
                            answer.deadline = deadline
                            todo.append(answer)
                self._apply_all(todo)
                ready = [w for w in todo if not w.error]
                for work in ready:
                    try:
                        self._write_spec(work)
                    except Exception as exc:
                        work.error = _claim_error(work.claim.ref, exc)
                failed = [w for w in todo if w.error]
                for work in failed:
                    self._undo_applied(work)
                with self.state.group_commit():
                    for work in todo:
                        if not work.error:
                            pins = {p.device: pin for p in work.plans if (pin := _pin_of(p.entry))}
                            self.state.prepare_completed(work.uid, payload=encode_payload(
                                self._spec_file(work.uid), work.applied, pins, shares_of(work.held)))
                            done.append(work)
                    for work in failed:
                        out[work.uid] = ClaimResult(error=work.error)
                        if work.retry and retry is not None:
                            retry[work.uid] = work.ready_hint
                        self._roll_back_failed(work)
            if self.checkpoint is not None:
                for work in done:
                    self.checkpoint.prepared(work.uid, work.claim, work.held, work.applied)
        except (OSError, DradriverError) as exc:
            # The claim state or the CDI directory could not be made durable: no claim of the batch that
            # was still in progress is acknowledged. STARTED records are undone and rolled back at the next
            # start, or redone when the kubelet retries.
            for work in todo:
                out.setdefault(work.uid, ClaimResult(error=f"claim {work.claim.ref}: cannot record claim "
                                                            f"state: {exc}"))
            done = []
        return done

    @staticmethod
    def _tell(hook: Callable[[ClaimRef, Sequence[UndoRecord]], None] | None, ref: ClaimRef,
              records: Sequence[UndoRecord]) -> None:
        if hook is None:
            return
        try:
            hook(ref, list(records))
        except Exception:
            log.exception("claim %s: prepare/unprepare hook failed", ref)

    def _start_one(self, claim: Claim, started: int) -> ClaimResult | _Work:
        """Phase 1 for one claim: the stored answer of a completed claim, or its plans, recorded STARTED.

        :param started: the prepare call's start (:meth:`ClaimState.monotonic_ns`); the call lost to an unprepare
            of the claim, by any instance, whose tombstone is later (the state lock is held from here until the
            claim is recorded PREPARE_COMPLETED, so no unprepare comes between).
        """
        ref = claim.ref
        record = self.state.get(ref.uid)
        digest = ""
        if self.aborted_ttl_s > 0:
            digest = allocation_digest(claim)
            self._allocations[ref.uid] = digest
            if self.checkpoint is not None:
                self._statuses[ref.uid] = claim.status
        self._refuse_if_unprepared(ref, record, started, digest)
        if self.aborted_ttl_s > 0:
            mark = aborted_mark(record) if record is not None else None
            if mark is not None:
                assert mark.aborted_at is not None
                age = self.clock() - mark.aborted_at
                same = not mark.allocation or mark.allocation == digest
                if abs(age) < self.aborted_ttl_s and same:
                    raise ClaimError(ref, f"stale prepare: the claim was unprepared {age:.0f} s ago while its prepare "
                                          f"was in progress (PrepareAborted); a prepare of the same allocation is "
                                          f"refused for {self.aborted_ttl_s:.0f} s")
                why = "expired" if same else "the claim's allocation changed"
                log.info("claim %s: aborted-prepare mark of %.0f s ago no longer applies (%s)", ref, age, why)
        adopted = record is not None and not record.namespace and not record.name \
            and not any(d.request_names for d in record.devices)  # from a CDI spec (NVIDIA's checkpoint names them)
        if record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED and not adopted:
            self._ensure_spec(record)
            return ClaimResult(devices=tuple(d.to_prepared() for d in held_devices(record) if d.request_names))
        # New, half-prepared (its stale records are undone before the new apply), or adopted from a CDI spec
        # after state damage (request names unknown): prepare from the claim itself; the devices it already
        # holds count as its own in the conflict check.
        stale = list(read_payload(record.payload).undo) if record is not None else []
        work = self._plan(claim)
        work.stale = stale
        self.state.prepare_started(ref.uid, namespace=ref.namespace, name=ref.name, devices=work.held,
                                   payload=encode_payload(self._spec_file(ref.uid), stale + self._planned(work),
                                                    shares=shares_of(work.held), allocation=digest))
        return work

    def _refuse_if_unprepared(self, ref: ClaimRef, record: ClaimRecord | None, started: int, digest: str) -> None:
        """Refuse a prepare call that lost to an unprepare of its claim (state lock held by the caller).

        The loser drops what its earlier attempts kept for the next one (the preparers' ``unprepared_unknown``,
        e.g. the compute-domain node label), unless the claim has a record again (a Prepare the kubelet sent after
        the Unprepare, answered meanwhile, owns what exists now). With ``aborted_ttl_s`` it also leaves the
        aborted-prepare mark the unpreparing instance could not write, not knowing the prepare was in flight.

        :raises ClaimError: the claim was unprepared after the call began, or the call is older than the tombstones
            kept (it cannot tell).
        """
        unprepared = self.state.unprepared_at(ref.uid)
        if unprepared is not None and unprepared > started:
            if record is None or aborted_mark(record) is not None:
                self._unprepared_unknown(ref)
            if self.aborted_ttl_s > 0 and record is None:
                at = self.clock()
                self.state.prepare_started(ref.uid, namespace=ref.namespace, name=ref.name, devices=[],
                                           payload=encode_payload(self._spec_file(ref.uid), [], aborted_at=at,
                                                            allocation=digest))
                if self.checkpoint is not None:
                    self.checkpoint.aborted(ref.uid, ref.namespace, ref.name, at, self._statuses.get(ref.uid), ())
                log.warning("claim %s: unprepared by another plugin instance while this prepare was in progress; a "
                            "prepare of the same allocation is refused for %.0f s (PrepareAborted)", ref,
                            self.aborted_ttl_s)
            raise ClaimError(ref, "the claim was unprepared while this prepare was in flight; not preparing it")
        age = self.state.monotonic_ns() - started
        if age > self.state.tombstone_ttl_ns:
            raise ClaimError(ref, f"this prepare call has run for {age / 1e9:.0f} s, longer than unprepares are "
                                  "remembered; not preparing it (the kubelet retries)")

    def _planned(self, work: _Work) -> list[UndoRecord]:
        """Write-ahead records of the sharing steps that can say before applying what they will change
        (``planned_record(claim, group, devices)``): stored with the STARTED record in the same sync, so a crash
        in the middle of the apply is undone at the next start (or by the kubelet's retry) instead of leaving a
        GPU setting no record knows. The records of the apply replace them."""
        out: list[UndoRecord] = []
        for group in work.groups:
            planned = getattr(self.sharing[group.plan.strategy], "planned_record", None)
            if callable(planned):
                record = planned(work.claim.ref, group, [self.registry.get(name) for name in group.devices])
                if record is not None:
                    out.append(record)
        return out

    def _plan(self, claim: Claim) -> _Work:
        """Allocation results -> devices (results naming one device merged), conflict check, configs, plans."""
        ref = claim.ref
        order: list[str] = []
        results: dict[str, list[AllocationResult]] = {}
        entries: dict[str, object] = {}
        preparers: dict[str, DevicePreparer] = {}
        if self.sibling_of is not None:
            self._refuse_if_sibling_held(ref, [r.device for r in claim.results if not r.admin_access])
        for i, result in enumerate(claim.results):
            device = self.registry.get(result.device)
            if device is None:
                raise ClaimError(ref, f"status.allocation.devices.results[{i}] (request {result.request!r}): "
                                      f"device {result.device!r} does not exist in pool {self.pool!r} on this node")
            preparer = self.preparer_for(device)
            if preparer is None:
                raise ClaimError(ref, f"status.allocation.devices.results[{i}] (request {result.request!r}): "
                                      f"device {result.device!r} is of a kind this plugin cannot prepare")
            refusal = self.refuse_device(result.device, device) if self.refuse_device is not None else ""
            if refusal:
                raise ClaimError(ref, f"status.allocation.devices.results[{i}] (request {result.request!r}): "
                                      f"device {result.device!r} {refusal}")
            if result.device not in results:
                order.append(result.device)
                results[result.device] = []
                entries[result.device] = device
                preparers[result.device] = preparer
            results[result.device].append(result)
        for name in order:
            holder = self.state.holder(self.pool, name)
            admin = all(r.admin_access for r in results[name])
            if holder is not None and holder != ref.uid and not admin:
                other = self.state.get(holder)
                who = f"{other.namespace}/{other.name} (uid {holder})" if other else f"uid {holder}"
                raise ClaimError(ref, f"device {name!r} is already prepared for claim {who}")
        # (A consumable share never enters the holder index, so shares of one device never conflict; a device
        # held exclusively still refuses a share.)
        # Opaque configs: decoded, selected and validated per result before anything is written.
        groups: list[ConfigGroup] = []
        group_of: dict[str, ConfigGroup] = {}
        if self.select_configs is not None:
            selection = self.select_configs(claim, entries)
            groups = list(selection.groups)
            for group in groups:
                for name in group.devices:
                    group_of.setdefault(name, group)
                if group.plan.strategy not in self.sharing:
                    raise ClaimError(ref, f"{group.entry.parameters_at}.sharing.strategy: "
                                          f"{group.plan.strategy!r} is not implemented by this plugin")
        plans = [preparers[n].plan(claim, entries[n], results[n], group_of.get(n)) for n in order]
        for preparer in dict.fromkeys(preparers.values()):  # rules over a claim's devices of one kind
            check_claim = getattr(preparer, "check_claim", None)
            if callable(check_claim):
                check_claim(claim, [p for p in plans if p.kind == preparer.kind])
        for plan in plans:
            if not plan.shared and not plan.admin_access:
                self._refuse_if_shared(ref, plan)
        held: list[HeldDevice] = []
        for plan in plans:
            preparer = self._preparer(plan.kind)
            custom_ids = getattr(preparer, "cdi_device_ids", None)
            ids = custom_ids(ref, plan) if callable(custom_ids) else None
            held.append(HeldDevice(
                request_names=plan.request_names,
                pool=self.pool,
                device=plan.device,
                cdi_device_ids=(self.identity.cdi.device_id(ref.uid, plan.device),) if ids is None else ids,
                admin_access=plan.admin_access,
                shared=plan.shared,
                share_id=plan.share_id,
            ))
            holds = getattr(preparer, "holds", None)
            if callable(holds):  # held beside the allocated device, never answered to the kubelet
                held.extend(HeldDevice(request_names=(), pool=self.pool, device=name) for name in holds(plan))
        return _Work(claim, held, plans, groups, stale=[])

    def _refuse_if_sibling_held(self, ref: ClaimRef, devices: Sequence[str]) -> None:
        """Refuse a claim asking for a device whose sibling (:attr:`sibling_of`) it asks for too, or another claim
        holds (state lock held by the caller). Checked before the devices are looked up: a GPU passed through has
        left NVML, so its ``gpu-<minor>`` is not in the registry while its sibling is held.

        :raises ClaimError: naming both devices and the other claim.
        """
        assert self.sibling_of is not None
        asked = set(devices)
        for name in dict.fromkeys(devices):
            sibling = self.sibling_of(name)
            if sibling is None:
                continue
            if sibling in asked:
                raise ClaimError(ref, f"devices {name!r} and {sibling!r} are the same GPU (its full GPU and its VFIO "
                                      "passthrough device); a claim cannot hold both")
            holder = self.state.holder(self.pool, sibling)
            if holder is not None and holder != ref.uid:
                other = self.state.get(holder)
                who = f"{other.namespace}/{other.name} (uid {holder})" if other and other.name else f"uid {holder}"
                raise ClaimError(ref, f"device {name!r} is the same GPU as device {sibling!r}, which is prepared for "
                                      f"claim {who}; not preparing it while that claim holds the GPU (the claim "
                                      "can be prepared once the other is unprepared)")

    def _refuse_if_shared(self, ref: ClaimRef, plan: DevicePlan) -> None:
        """Refuse to hand a device exclusively to ``ref`` while other claims hold consumable shares of it (shares
        never enter the claim state's holder index; a preparer that keeps shares answers ``share_holders``)."""
        for preparer in self.preparers:
            holders = getattr(preparer, "share_holders", None)
            others = sorted(set(holders(plan.entry)) - {ref.uid}) if holders is not None else []
            if others:
                raise ClaimError(ref, f"device {plan.device!r} is already prepared for consumable shares of claim(s) "
                                      f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}; it cannot be "
                                      "given to this claim exclusively")

    # -------------------------------------------------------------------------------- apply
    def _side_effects(self, work: _Work) -> bool:
        if work.stale:
            return True
        if any(self._preparer(p.kind).side_effects for p in work.plans):
            return True
        if any(self.sharing[g.plan.strategy].side_effects for g in work.groups):
            return True
        entries = self._claim_step_devices(work)
        return any(c.side_effects and c.applies(entries) for c in self.claim_steps)

    @staticmethod
    def _claim_step_devices(work: _Work) -> list[object]:
        """The registry entries a claim step sees: the claim's planned devices, admin-access ones left out."""
        return [p.entry for p in work.plans if not p.admin_access]

    def _preparer(self, kind: str) -> DevicePreparer:
        return self._device_kinds[kind]

    def _apply_all(self, todo: list[_Work]) -> None:
        """Phase 2: apply every claim's plans; side-effecting claims concurrently, and record their undo."""
        effectful: list[_Work] = []
        for work in todo:
            if self._side_effects(work):
                effectful.append(work)
            else:
                self._apply_one(work)
        if not effectful:
            return
        if len(effectful) == 1:
            self._apply_one(effectful[0])
        else:
            workers = min(self.apply_workers, len(effectful))
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="prepare-apply") as pool:
                list(pool.map(self._apply_one, effectful))
        # The side effects exist now: their undo records reach the claim state before anything else happens, so
        # a crash from here on is undone from the records at the next start.
        with self.state.group_commit():
            for work in effectful:
                self.state.prepare_started(work.uid, namespace=work.claim.ref.namespace, name=work.claim.ref.name,
                                           devices=work.held,
                                           payload=encode_payload(self._spec_file(work.uid), work.stale + work.applied,
                                                            shares=shares_of(work.held)))

    def _apply_one(self, work: _Work) -> None:
        """Undo stale records of an earlier attempt, then apply device plans and sharing steps in order.

        On failure, ``work.error`` is set; ``work.applied`` keeps exactly what was applied (undone later).
        """
        ref = work.claim.ref
        try:
            for record in reversed(work.stale):
                self._undo(ref, record)
            work.stale = []
            for plan in work.plans:
                preparer = self._preparer(plan.kind)
                if getattr(preparer, "apply_takes_deadline", False):
                    work.applied.append(preparer.apply(ref, plan, deadline=work.deadline))  # type: ignore[call-arg]
                else:
                    work.applied.append(preparer.apply(ref, plan))
            for group in work.groups:
                step = self.sharing[group.plan.strategy]
                devices = [self.registry.get(name) for name in group.devices]
                work.applied.append(step.apply(ref, group, devices, deadline=work.deadline))
            entries = self._claim_step_devices(work)
            for claim_step in self.claim_steps:
                if claim_step.applies(entries):
                    work.applied.append(claim_step.apply(ref, entries))
        except PartiallyApplied as exc:  # its record joins the others: stored, then undone newest first
            work.applied.append(exc.record)
            work.error = _claim_error(ref, exc)
        except NotReadyYet as exc:  # nothing to undo; retried until the deadline
            work.retry = True
            work.ready_hint = exc.ready_hint
            work.error = _claim_error(ref, exc)
        except Exception as exc:
            work.error = _claim_error(ref, exc)

    def _undo(self, ref: ClaimRef, record: UndoRecord) -> None:
        """Undo one stored record with the part of its stored kind (whatever the feature gates say now), once the
        record says this release can read it (:meth:`~dradriver.domain.ports.UndoRecord.check_readable`)."""
        part = self._by_kind.get(record.kind)
        if part is None:
            raise DradriverError(f"claim {ref}: no preparer of kind {record.kind!r} to undo {record.target!r}")
        record.check_readable(getattr(part, "undo_layout", UNDO_LAYOUT))
        part.undo(ref, record)

    def _undo_applied(self, work: _Work) -> None:
        """Undo what was applied for a failed claim, newest first; what fails to undo stays in ``applied``."""
        left: list[UndoRecord] = []
        for record in reversed(work.applied):
            if left:
                left.append(record)
                continue
            try:
                self._undo(work.claim.ref, record)
            except Exception as exc:
                log.error("claim %s: undo of %s %s failed: %s", work.claim.ref, record.kind, record.target, exc)
                left.append(record)
        work.applied = list(reversed(left))

    def _roll_back_failed(self, work: _Work) -> None:
        """Forget a failed claim, or keep it STARTED with the records whose undo failed (retried later)."""
        try:
            try:
                self._delete_spec(work.uid, clean_temp=False)
            except Exception:  # a leftover spec is removed at the next start or by an unprepare
                log.exception("claim %s: removing its CDI spec failed", work.claim.ref)
            left = work.stale + work.applied
            if left:
                ref = work.claim.ref
                self.state.prepare_started(ref.uid, namespace=ref.namespace, name=ref.name, devices=work.held,
                                           payload=encode_payload(self._spec_file(ref.uid), left,
                                                            shares=shares_of(work.held)))
                log.error("claim %s: %d undo record(s) kept for the next unprepare or start", ref, len(left))
            else:
                self.state.remove(work.uid)
        except Exception:  # left STARTED: rolled back by the kubelet's retry or at start
            log.exception("rolling back claim %s failed", work.claim.ref)

    # -------------------------------------------------------------------------------- CDI spec
    def _device_edits(self, ref: ClaimRef, plans: Sequence[DevicePlan],
                      records: Sequence[UndoRecord]) -> list[tuple[str, cdi.ContainerEdits]]:
        by_target = {(r.kind, r.target): r for r in records}
        extras: dict[str, cdi.ContainerEdits] = {}
        steps = {s.kind: s for s in self.sharing.values()}
        for record in records:
            step = steps.get(record.kind)
            if step is None:
                continue
            for name, edits in step.edits(ref, record).items():
                extras[name] = extras.get(name, cdi.ContainerEdits()) + edits
        out: list[tuple[str, cdi.ContainerEdits]] = []
        for plan in plans:
            record = by_target.get((plan.kind, plan.device)) or UndoRecord(plan.kind, 0, plan.device)
            edits = self._preparer(plan.kind).edits(ref, plan, record)
            if plan.device in extras:
                edits = edits + extras[plan.device]
            out.append((plan.device, edits))
        return out

    def _render(self, ref: ClaimRef, plans: Sequence[DevicePlan], records: Sequence[UndoRecord],
                metadata: Mapping[str, cdi.ContainerEdits] | None = None) -> bytes:
        """The claim's CDI spec; ``b""`` when the claim's preparer says it needs none.

        :param metadata: device name -> the mounts of its device metadata files (``DeviceMetadata`` gate); a
            preparer that renders the whole spec (one device per claim) gets them as spec-level edits.
        """
        kinds = {p.kind for p in plans}
        if len(kinds) == 1:
            custom = getattr(self._preparer(next(iter(kinds))), "render_spec", None)
            if callable(custom):
                common = self.spec_edits()
                for edits in (metadata or {}).values():
                    common = common + edits
                rendered = custom(ref, plans, records, common)
                if rendered is not None:
                    return bytes(rendered)
        try:
            devices = self._device_edits(ref, plans, records)
            spec_edits = self._claim_spec_edits(ref, plans, records)
        except cdi.DeviceNodeError as exc:
            raise cdi.DeviceNodeError(f"claim {ref.uid}: CDI spec: {exc}") from exc
        if metadata:
            devices = [(name, edits + metadata[name] if name in metadata else edits) for name, edits in devices]
        return cdi.render_claim_spec(self.identity.cdi, ref.uid, devices, spec_edits)

    def _claim_spec_edits(self, ref: ClaimRef, plans: Sequence[DevicePlan],
                          records: Sequence[UndoRecord]) -> cdi.ContainerEdits:
        """The claim's spec-level edits: the plugin's (:attr:`spec_edits`), replaced by (every kind of the claim
        gives them) or joined with its preparers' ``claim_edits``."""
        own = cdi.ContainerEdits()
        every = True
        for kind in dict.fromkeys(p.kind for p in plans):
            claim_edits = getattr(self._preparer(kind), "claim_edits", None)
            if callable(claim_edits):
                own = own + claim_edits(ref, [p for p in plans if p.kind == kind], records)
            else:
                every = False
        if every and plans:
            return own
        return self.spec_edits() + own

    def _delete_spec(self, uid: str, *, clean_temp: bool = True) -> None:
        """Delete the claim's CDI spec, then the device metadata files it mounted."""
        cdifiles.delete_claim_spec(self.identity.cdi, self.cdi_root, uid, clean_temp=clean_temp)
        if self.device_metadata is not None:
            self.device_metadata.remove(uid)

    def _write_metadata(self, work: _Work) -> dict[str, cdi.ContainerEdits]:
        """Write the claim's device metadata files (before its spec names them); their mounts by device."""
        if self.device_metadata is None:
            return {}
        return self.device_metadata.write(work.claim, self._metadata_extra(work.claim.ref, work.plans, work.applied))

    def _metadata_extra(self, ref: ClaimRef, plans: Sequence[DevicePlan],
                        records: Sequence[UndoRecord]) -> dict[str, list[Any]]:
        """What each planned device adds to its published attributes in the metadata files: its preparer's
        ``metadata_attributes`` (from the device's undo record), then its run-time attributes."""
        by_target = {(r.kind, r.target): r for r in records}
        extra: dict[str, list[Any]] = {}
        for plan in plans:
            parts = [runtime_attributes(plan.entry)]
            more = getattr(self._preparer(plan.kind), "metadata_attributes", None)
            if callable(more):
                parts.insert(0, more(ref, plan, by_target.get((plan.kind, plan.device))))
            extra[plan.device] = parts
        return extra

    def _write_spec(self, work: _Work) -> None:
        ref = work.claim.ref
        data = self._render(ref, work.plans, work.applied, self._write_metadata(work))
        if not data:  # no edits at all (an IMEX channel on a node in no clique): no spec, as NVIDIA's
            self._delete_spec(ref.uid, clean_temp=False)
            return
        cdifiles.write_claim_spec(self.identity.cdi, self.cdi_root, ref.uid, data, sync_dir=False, clean_temp=False)

    def check_pins(self, record: ClaimRecord) -> None:
        """Refuse a completed claim whose device names now resolve to other physical devices.

        GPU minors renumber after a driver reload or when a GPU falls off the bus: ``gpu-1`` may then be another
        GPU than the one the claim's containers were given. Claims stored before pins existed are not checked.

        :raises ClaimError: naming the device, the UUID it was prepared with and the one it resolves to now (or
            that it is gone).
        """
        pins = read_payload(record.payload).pins
        for name, pinned in sorted(pins.items()):
            device = self.registry.get(name)
            now = self._pin_now(device) if device is not None else None
            if now != pinned:
                seen = f"is now {now}" if now else "is no longer on this node"
                raise ClaimError(record.ref, f"device {name!r} was {pinned} when the claim was prepared and {seen}; "
                                             "not handing the claim another device (unprepare it and prepare again)")

    def _withdraw_if_moved(self, record: ClaimRecord) -> None:
        """:meth:`check_pins`, and when a device moved or is gone, delete the claim's CDI spec: its device nodes
        (``/dev/nvidia<minor>``) may be another GPU's now, so a container the claim's pod creates later (a restart)
        must fail to resolve the claim's CDI device (the runtime's "unresolvable CDI devices") rather than get that
        GPU. Running containers keep what they were given; once the pins hold again (the GPU is back under its
        name), :meth:`_ensure_spec` writes the spec again. The metadata files stay until the claim is unprepared.

        :raises ClaimError: from :meth:`check_pins`, after the spec was deleted.
        """
        try:
            self.check_pins(record)
        except ClaimError:
            if cdifiles.delete_claim_spec(self.identity.cdi, self.cdi_root, record.uid):
                log.warning("claim %s: CDI spec withdrawn: its devices are other GPUs now", record.ref)
            raise

    def _pin_now(self, device: object) -> str | None:
        """The physical identity of a registry entry now: its own UUID, or for an entry that has none (a dynamic-MIG
        placement that a static MIG claim of before the ``DynamicMIG`` gate names) the one its preparer finds
        there (``identity_now(device)``: the MIG UUID of the instance on the placement)."""
        pin = _pin_of(device)
        if pin is None:
            identity_now = getattr(self.preparer_for(device), "identity_now", None)
            pin = identity_now(device) if callable(identity_now) else None
        return pin

    def spec_valid(self, record: ClaimRecord) -> bool:
        """True when the claim's CDI spec file parses, has this plugin's kind and names exactly the claim devices the
        kubelet was given (its CDI IDs of this kind: an IMEX ``All`` claim holds 2048 channels through one device);
        a record without CDI IDs: one claim device per held device."""
        try:
            spec = json.loads(self.spec_path(record.uid).read_bytes())
            names = sorted(str(d["name"]) for d in spec["devices"])
            kind = spec["kind"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        ours = f"{self.identity.cdi.kind}="
        ids = [i for d in record.devices for i in d.cdi_device_ids]
        if ids:
            wanted = sorted({i[len(ours):] for i in ids if i.startswith(ours)})
        else:
            wanted = sorted(self.identity.cdi.device_name(record.uid, d.device) for d in record.devices)
        return kind == self.identity.cdi.kind and names == wanted

    def _ensure_spec(self, record: ClaimRecord) -> bool:
        """Rewrite a completed claim's CDI spec when it is missing, unreadable or names other devices (e.g.
        ``/var/run/cdi`` was cleaned, or a crash of another writer left it damaged); True when rewritten.

        :raises ClaimError: a device moved to another physical device or is gone (the spec is then deleted:
            :meth:`_withdraw_if_moved`), or has no preparer (the spec is left as it is).
        """
        self._withdraw_if_moved(record)
        if self.spec_valid(record):
            return False
        data = self._render_record(record, "CDI spec missing or invalid")
        if not data:  # the claim has no spec by design
            return False
        cdifiles.write_claim_spec(self.identity.cdi, self.cdi_root, record.uid, data)
        log.warning("rewrote the missing or invalid CDI spec of claim %s", record.ref)
        return True

    def _render_record(self, record: ClaimRecord, why: str, *, refresh_metadata: bool = False) -> bytes:
        """The CDI spec of a completed claim, rendered again from its record and the devices now (``b""``: the claim
        has no spec by design).

        :param refresh_metadata: first write the claim's device metadata files again with its devices' attributes
            now (:meth:`~dradriver.host.devicemetadata.DeviceMetadataFiles.rewrite`: after a driver reload), else
            mount them as they are.
        :raises ClaimError: a device is no longer on this node or has no preparer (the message starts with ``why``).
        :raises DradriverError: a metadata file cannot be rewritten.
        """
        missing = sorted(d.device for d in record.devices if self.registry.get(d.device) is None)
        if missing:
            raise ClaimError(record.ref, f"{why} and devices {missing} are no longer on this node")
        plans = []
        for held in record.devices:
            device = self.registry.get(held.device)
            preparer = self.preparer_for(device)
            if preparer is None:
                raise ClaimError(record.ref, f"{why} and device {held.device!r} has no preparer")
            plans.append(DevicePlan(preparer.kind, held.device, device, held.request_names, held.admin_access, ()))
        undo = list(read_payload(record.payload).undo)
        metadata = None
        if self.device_metadata is not None:
            if refresh_metadata and self.device_metadata.rewrite(record.uid,
                                                                 self._metadata_extra(record.ref, plans, undo)):
                log.info("rewrote the device metadata of prepared claim %s for the devices now", record.ref)
            metadata = self.device_metadata.mounts(record.uid)
        return self._render(record.ref, plans, undo, metadata)

    def refresh_specs(self) -> tuple[list[str], list[str]]:
        """Render the CDI spec of every prepared claim again and rewrite, atomically, each one whose content changed.

        After a driver reload the spec-level edits name the new driver's files (``libcuda.so.<new version>``) and
        the device nodes may have new numbers: the runtime reads a claim's spec when it creates a container, so a
        container that a prepared claim's pod starts later (a restart, a new init container) must get the new
        driver, not the paths of one that no longer exists. The claim's KEP-5304 device metadata files are
        written again first with the attributes published now (the new ``driverVersion``), generation + 1. A
        claim whose device now resolves to another physical device or is gone loses its spec
        (:meth:`_withdraw_if_moved`: a container it starts later fails instead of getting another GPU) and is
        answered per claim at its next Prepare.

        :returns: the claim UIDs whose spec was rewritten, and those that could not be rendered (logged).
        """
        rewritten: list[str] = []
        unusable: list[str] = []
        with self._lock, self.state.locked():
            for record in list(self.state.claims().values()):
                if record.phase is not ClaimPhase.PREPARE_COMPLETED:
                    continue
                try:
                    self._withdraw_if_moved(record)
                    data = self._render_record(record, "CDI spec not rendered again", refresh_metadata=True)
                except (ClaimError, DradriverError) as exc:
                    unusable.append(record.uid)
                    log.error("claim %s: %s", record.ref, exc)
                    continue
                path = self.spec_path(record.uid)
                try:
                    if not data or path.read_bytes() == data:
                        continue
                except OSError:
                    pass  # missing or unreadable: written below
                try:
                    cdifiles.write_claim_spec(self.identity.cdi, self.cdi_root, record.uid, data)
                except DradriverError as exc:  # the old spec stays whole (the write is atomic)
                    unusable.append(record.uid)
                    log.error("claim %s: %s", record.ref, exc)
                    continue
                rewritten.append(record.uid)
                log.info("rewrote the CDI spec of prepared claim %s for the driver now loaded", record.ref)
        return rewritten, unusable

    # -------------------------------------------------------------------------------- unprepare
    def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare a batch from stored state alone; returns UID -> error ("" on success).

        Blocking: runs in the calling thread (the DRA server's worker for the call); no API call, so it never
        waits for anything but the locks."""
        began = time.monotonic()
        with self.metrics.in_flight("unprepare") if self.metrics else contextlib.nullcontext():
            results = self._unprepare_all(list(claims))
            if self.checkpoint is not None and (unsaved := self.checkpoint.flush_or_error()):
                results = {uid: error or f"claim {uid}: {unsaved}" for uid, error in results.items()}
        if self.metrics is not None:
            seconds = time.monotonic() - began
            for error in results.values():
                outcome = "error" if error else "success"
                self.metrics.observe_unprepare(outcome, seconds, error_type="unprepare_devices" if error else None)
        self._changed()
        return results

    def _unprepare_all(self, claims: list[ClaimRef]) -> dict[str, str]:
        """Unprepare a batch chunk by chunk (:meth:`_unprepare_chunk`), taking the lock per chunk."""
        out: dict[str, str] = {}
        for i in range(0, len(claims), self.chunk_size):
            out.update(self._unprepare_chunk(claims[i:i + self.chunk_size]))
        return out

    def _unprepare_chunk(self, claims: list[ClaimRef]) -> dict[str, str]:
        """Delete each claim's CDI spec, undo its records, then forget the batch's claims under one group commit.

        Specs go first, so a crash never leaves a spec without a claim; a claim whose spec is gone but whose
        removal was not yet durable is simply unprepared again when the kubelet retries (undo is idempotent).
        """
        with self._lock:
            try:
                with self._plugin_lock(None):
                    return self._unprepare_locked(claims)
            except PluginLockTimeout as exc:  # nothing of the chunk was touched; the kubelet retries
                return {ref.uid: f"claim {ref}: {exc}" for ref in claims}
            finally:
                self._refresh_views()  # O(claims of the chunk)

    def _plugin_lock(self, deadline: float | None) -> contextlib.AbstractContextManager[None]:
        """NVIDIA's ``pu.lock`` (:attr:`locks`), its wait bounded by ``deadline`` (``time.monotonic()``) too; a
        no-op without :attr:`locks`. Taken with the runner's lock held, before the claim state's."""
        if self.locks is None:
            return contextlib.nullcontext()
        return self.locks.prepare(None if deadline is None else deadline - time.monotonic())

    def _unprepare_locked(self, claims: list[ClaimRef]) -> dict[str, str]:
        """:meth:`_unprepare_chunk`'s work; the caller holds the runner's lock."""
        out: dict[str, str] = {}
        held_records: dict[str, list[UndoRecord]] = {}
        stored: list[ClaimRef] = []
        aborts: dict[str, tuple[ClaimRef, str]] = {}
        abort_held: dict[str, Sequence[HeldDevice]] = {}
        kept: dict[str, list[UndoRecord]] = {}
        try:
            with self.state.locked():
                # First, the tombstones: from now on no prepare call of these claims that began earlier, in this
                # instance or another, goes on (see _refuse_if_unprepared).
                self.state.note_unprepared([ref.uid for ref in claims])
                for ref in claims:
                    record = self.state.get(ref.uid)
                    if self.aborted_ttl_s > 0 and record is not None and aborted_mark(record) is not None:
                        out[ref.uid] = ""  # NVIDIA: unpreparing a PrepareAborted claim is a no-op (mark kept)
                        continue
                    if self.aborted_ttl_s > 0 and (ref.uid in self._in_flight or (
                            record is not None and record.phase is ClaimPhase.PREPARE_STARTED)):
                        try:
                            known = read_payload(record.payload).allocation if record is not None else ""
                        except ValueError:
                            known = ""
                        aborts[ref.uid] = (ref, known or self._allocations.get(ref.uid, ""))
                        abort_held[ref.uid] = held_devices(record) if record is not None else ()
                    try:
                        # Unknown claims succeed; a spec of that UID (adopted or leaked) goes too.
                        self._delete_spec(ref.uid, clean_temp=False)
                        held = list(read_payload(record.payload).undo) if record is not None else []
                        left = self._undo_or_keep(ref, held)
                        if left:
                            kept[ref.uid] = left
                    except Exception as exc:
                        aborts.pop(ref.uid, None)
                        if not isinstance(exc, DradriverError):
                            log.error("unprepare of claim %s failed unexpectedly", ref, exc_info=exc)
                        out[ref.uid] = f"claim {ref}: unprepare failed: {exc}"
                        continue
                    if record is None:
                        self._unprepared_unknown(ref)
                        if ref.uid not in aborts:
                            out[ref.uid] = ""
                    else:
                        stored.append(ref)
                        held_records[ref.uid] = held
                with self.state.group_commit():
                    for ref in stored:
                        if ref.uid in kept and ref.uid not in aborts:
                            # released, and kept only for the undo the driver's return allows (resume_undo)
                            self.state.prepare_started(ref.uid, namespace=ref.namespace, name=ref.name, devices=[],
                                                       payload=encode_payload(self._spec_file(ref.uid), kept[ref.uid]))
                        elif ref.uid not in aborts:
                            self.state.remove(ref.uid)
                    for uid, (ref, allocation) in aborts.items():
                        # The STARTED record (or none, between two attempts) becomes the aborted mark.
                        self.state.prepare_started(uid, namespace=ref.namespace, name=ref.name, devices=[],
                                                   payload=encode_payload(self._spec_file(uid), [],
                                                                    aborted_at=self.clock(),
                                                                    allocation=allocation))
                        log.warning("claim %s: unprepared while its prepare was in progress; a prepare of the "
                                    "same allocation is refused for %.0f s (PrepareAborted, kept in the claim "
                                    "state)", ref, self.aborted_ttl_s)
                        if ref.uid not in {r.uid for r in stored}:
                            out[uid] = ""
                    if self.aborted_ttl_s > 0:
                        self._forget_expired_aborts(keep=set(aborts))
                if self.checkpoint is not None:
                    for ref in claims:
                        now = self.state.get(ref.uid) if not out.get(ref.uid) else None
                        mark = aborted_mark(now) if now is not None else None
                        if mark is None or mark.aborted_at is None:
                            if not out.get(ref.uid):
                                self.checkpoint.unprepared(ref.uid)
                        elif ref.uid in aborts:  # an aborted mark kept by an earlier unprepare stays named
                            self.checkpoint.aborted(ref.uid, ref.namespace, ref.name, mark.aborted_at,
                                                    self._statuses.get(ref.uid), abort_held.get(ref.uid, ()))
        except (OSError, DradriverError) as exc:
            for ref in stored:
                out[ref.uid] = f"claim {ref}: unprepare failed: {exc}"
            for uid, (ref, _) in aborts.items():
                out[uid] = f"claim {ref}: unprepare failed: {exc}"
            for ref in claims:  # not reached (the lock or the tombstones failed): the kubelet retries
                out.setdefault(ref.uid, f"claim {ref}: unprepare failed: {exc}")
            stored = []
        for ref in stored:
            log.info("unprepared claim %s", ref)
            out[ref.uid] = ""
            self._tell(self.on_unprepared, ref, held_records.get(ref.uid, []))
        return out

    def _unprepared_unknown(self, ref: ClaimRef) -> None:
        """Tell preparers with an ``unprepared_unknown(ref)`` part that a claim without a record was unprepared (a
        prepare that never completed may have left something meant for its next attempt, such as a node label)."""
        for preparer in self.preparers:
            hook = getattr(preparer, "unprepared_unknown", None)
            if callable(hook):
                try:
                    hook(ref)
                except Exception as exc:
                    log.warning("claim %s: %s cleanup after an unprepare failed: %s", ref, preparer.kind, exc)

    def _undo_or_keep(self, ref: ClaimRef, records: Sequence[UndoRecord]) -> list[UndoRecord]:
        """Undo ``records`` newest first; while the device driver is unavailable (:attr:`driver_unavailable`), the
        records left (in stored order) from the first one of :attr:`driver_kinds` or whose undo fails: that one and
        every older one, kept for :meth:`resume_undo`.

        :raises Exception: what the failing undo raised, when the driver is available.
        """
        for i in range(len(records) - 1, -1, -1):
            why = self.driver_unavailable() if self.driver_unavailable is not None else ""
            failure: Exception | str = "needs the driver's devices"
            if not why or records[i].kind not in self.driver_kinds:
                try:
                    self._undo(ref, records[i])
                    continue
                except Exception as exc:
                    why = self.driver_unavailable() if self.driver_unavailable is not None else ""
                    if not why:
                        raise
                    failure = exc
            log.warning("claim %s: undo of %s %s kept until the NVIDIA driver is available (%s): %s", ref,
                        records[i].kind, records[i].target, why, failure)
            return list(records[:i + 1])
        return []

    def resume_undo(self) -> tuple[list[str], list[str]]:
        """Blocking, once the device driver is available again (before prepares are served): undo the records kept
        by unprepares while it was not (claims recorded PREPARE_STARTED without devices, not aborted marks) and
        forget those claims, then let every preparer and sharing step sweep what no stored record knows, as at start
        (the start-up sweep ran without the driver's devices). An undo that fails again keeps its claim's records
        (the next call, the kubelet's or the stale-claim cleanup's unprepare tries again).

        :returns: (claim UIDs whose records were undone, ``kind:what`` of what the sweeps removed).
        """
        done: list[str] = []
        swept: list[str] = []
        with self._lock, self.state.locked():
            for uid, record in list(self.state.claims().items()):
                if record.phase is not ClaimPhase.PREPARE_STARTED or record.devices or aborted_mark(record):
                    continue
                try:
                    records = list(read_payload(record.payload).undo)
                    for undo in reversed(records):
                        self._undo(record.ref, undo)
                except Exception as exc:
                    log.error("claim %s: kept undo failed again: %s", record.ref, exc)
                    continue
                self.state.remove(uid)
                done.append(uid)
                log.info("claim %s: undo kept while the driver was unavailable done", record.ref)
            swept = self._sweep([*self.preparers, *self.sharing.values(), *self.claim_steps])
            self._refresh_views()
        return done, swept

    def _sweep(self, parts: Sequence[DevicePreparer | SharingStep | ClaimStep]) -> list[str]:
        """Let each of ``parts`` sweep what no stored record knows (state lock held); ``kind:what`` of each thing
        removed. A sweep that fails while the device driver is unavailable is logged (:meth:`resume_undo` sweeps
        again)."""
        known: dict[str, list[UndoRecord]] = {}
        for record in self.state.claims().values():
            try:
                for undo in list(read_payload(record.payload).undo):
                    known.setdefault(undo.kind, []).append(undo)
            except ValueError as exc:
                log.error("claim %s: unreadable undo records: %s", record.ref, exc)
        swept: list[str] = []
        for part in parts:
            # A part whose side effects another kind's records may own too (a static MIG claim's instance on a
            # GPU dynamic MIG now manages) sees those records as well: it never removes what a claim holds.
            owned = [r for k in (part.kind, *getattr(part, "owner_kinds", ())) for r in known.get(k, [])]
            try:
                removed = part.sweep(owned)
            except Exception as exc:
                why = self.driver_unavailable() if self.driver_unavailable is not None else ""
                if not why:
                    raise
                log.warning("%s sweep waits for the NVIDIA driver (%s): %s", part.kind, why, exc)
                continue
            for what in removed:
                swept.append(f"{part.kind}:{what}")
                log.warning("removed %s %s that no prepared claim owns", part.kind, what)
        return swept

    def _forget_expired_aborts(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Delete the aborted marks older than ``aborted_ttl_s`` (state lock held by the caller); their UIDs."""
        now = self.clock()
        gone: list[str] = []
        for uid, record in list(self.state.claims().items()):
            mark = aborted_mark(record)
            if uid in keep or mark is None or mark.aborted_at is None:
                continue
            if abs(now - mark.aborted_at) >= self.aborted_ttl_s:
                self.state.remove(uid)
                if self.checkpoint is not None:
                    self.checkpoint.unprepared(uid)
                gone.append(uid)
                log.info("claim %s: aborted-prepare mark expired (%.0f s old); deleted", record.ref,
                         now - mark.aborted_at)
        return gone

    def forget_expired_aborts(self) -> list[str]:
        """Blocking: delete the expired aborted-prepare marks (NVIDIA's periodic cleanup deletes expired
        ``PrepareAborted`` entries, NVIDIA's ``cmd/*-kubelet-plugin/cleanup.go``); the UIDs deleted. A no-op without
        ``aborted_ttl_s``."""
        if self.aborted_ttl_s <= 0:
            return []
        with self._lock, self.state.locked(), self.state.group_commit():
            gone = self._forget_expired_aborts()
            self._refresh_views()
        if gone and self.checkpoint is not None:
            self.checkpoint.flush_or_error()  # logged; the next prepare or unprepare writes it again
        return gone

    # ---------------------------------------------------------------------------------- startup
    def recover(self, *, state_damaged: bool = False, torn_tail: bool = False,
                rebooted: bool = False) -> RecoveryReport:
        """Converge after a crash: undo and roll back PREPARE_STARTED claims, let every preparer sweep side
        effects no record knows, deal with CDI specs no claim owns, then rebuild the missing or invalid spec of
        every completed claim whose devices are still the physical devices it was prepared with.

        :param state_damaged: the claim state lost records to damage. Then an orphan spec may belong to a
            claim that still holds its devices: it is adopted (recorded as prepared under its claim UID, with
            the devices its spec names) instead of deleted, so the devices stay protected and the kubelet's
            unprepare of that UID cleans up, and a half-prepared claim whose spec exists is kept as prepared
            (its completion may be the record damage destroyed).
        :param rebooted: the node's boot ID changed since the claim state was written: no container of a claim
            prepared before survived, so CDI specs no claim owns are leftovers of the old boot and are deleted.
        :param torn_tail: the claim state's last write was cut short and truncated. A torn write loses only
            records that were never acknowledged, so it explains half-prepared claims of the last batch but never
            a CDI spec whose claim has no record at all.

        The damaged path is also taken, and :attr:`RecoveryReport.damage` says why, when the file cannot be what
        the specs say: a spec of ours whose claim has no record (an emptied, truncated or replaced state file),
        or a torn tail with more than one half-prepared claim whose spec exists (a cut-off file read as a torn
        final write). Orphan specs are therefore adopted, never deleted: a device a spec references is never
        freed on the claim state's word alone.

        Holds NVIDIA's ``pu.lock`` (:attr:`locks`) throughout, so the specs it reads are not those of a prepare
        NVIDIA's plugin has in flight on the node.

        :raises PluginLockTimeout: ``pu.lock`` still held by another plugin after its bound (nothing was done).
        """
        found = _Recovery()
        with self._lock, self._plugin_lock(None), self.state.locked():
            orphans, half = self._read_specs()
            orphans = self._check_specs_against_state(found, orphans, half, state_damaged=state_damaged,
                                                      torn_tail=torn_tail, rebooted=rebooted)
            state_damaged = state_damaged or bool(found.damage)
            if self.aborted_ttl_s > 0:
                found.expired = self._forget_expired_aborts()
            self._roll_back_half_prepared(found, state_damaged=state_damaged)
            self._sweep_leftovers(found, orphans)
            self._adopt_orphans(found, orphans)
            self._rebuild_specs(found)
            held = {d.device for r in self.state.claims().values() for d in r.devices}
            missing = sorted(d for d in held if self.registry.get(d) is None)
            self._refresh_views()
        if missing:
            log.error("prepared claims hold devices this node no longer has: %s", ", ".join(missing))
        return found.report(len(self.state) - len(found.kept_aborted), missing)

    def _read_specs(self) -> tuple[list[str], list[str]]:
        """Recovery step: the claims of the CDI specs no claim record owns (orphans, sorted), and the half-prepared
        (PREPARE_STARTED) claims whose spec exists."""
        try:
            spec_names = os.listdir(self.cdi_root)
        except FileNotFoundError:
            spec_names = []
        claims = self.state.claims()
        spec_uids = {u for u in map(self.identity.cdi.spec_uid, spec_names) if u is not None}
        orphans = sorted(spec_uids - set(claims))
        half = [u for u, r in claims.items() if r.phase is ClaimPhase.PREPARE_STARTED and u in spec_uids]
        return orphans, half

    def _check_specs_against_state(self, found: _Recovery, orphans: list[str], half: list[str], *,
                                   state_damaged: bool, torn_tail: bool, rebooted: bool) -> list[str]:
        """Recovery step: after a reboot delete the orphan specs (leftovers of the old boot); otherwise name the
        damage the specs show that the claim state did not report (:attr:`RecoveryReport.damage`). Returns the
        orphans left to adopt."""
        if rebooted:
            for uid in orphans:
                self._delete_spec(uid)
                log.warning("removed CDI spec of claim %s, prepared before the node rebooted", uid)
            found.removed = orphans
            return []
        if not state_damaged and orphans:
            found.damage = (f"{len(orphans)} CDI spec(s) of claims the claim state has no record of (emptied, cut "
                            "short or replaced state file)")
        elif not state_damaged and torn_tail and len(half) > 1:
            found.damage = (f"the claim state ends in a torn write and {len(half)} half-prepared claims have CDI "
                            "specs: more was lost than one unacknowledged write")
        if found.damage:
            log.error("claim state %s does not match the CDI specs: %s; adopting claims from their specs",
                      self.state.path, found.damage)
        return orphans

    def _roll_back_half_prepared(self, found: _Recovery, *, state_damaged: bool) -> None:
        """Recovery step: each PREPARE_STARTED claim is undone and rolled back, unless it carries an aborted-prepare
        mark (kept within the TTL) or the state was damaged and its spec exists (kept as prepared)."""
        for uid, record in list(self.state.claims().items()):
            if record.phase is not ClaimPhase.PREPARE_STARTED:
                continue
            if aborted_mark(record) is not None:
                if self.aborted_ttl_s > 0:
                    found.kept_aborted.append(uid)  # still refusing prepares of that allocation
                    continue
                self.state.remove(uid)  # a plugin without the TTL does not honour marks
                found.expired.append(uid)
                continue
            if state_damaged and self.spec_path(uid).exists():
                # Its PREPARE_COMPLETED record may be the one damage destroyed: the claim may have been
                # acknowledged and its containers may run. Keep it (and its devices protected) as completed.
                self.state.prepare_completed(uid)
                found.adopted.append(uid)
                log.error("claim %s: the claim state was damaged and the claim's CDI spec exists; kept as "
                          "prepared until the kubelet unprepares it", record.ref)
                continue
            try:
                for undo in reversed(list(read_payload(record.payload).undo)):
                    self._undo(record.ref, undo)
            except Exception as exc:
                found.undo_failed.append(uid)
                log.error("claim %s left half-prepared by an earlier run: undo failed (%s); kept for the "
                          "kubelet's unprepare or the next start", record.ref, exc)
                continue
            self._roll_back(uid)
            found.rolled_back.append(uid)
            log.warning("rolled back claim %s left half-prepared by an earlier run", record.ref)

    def _sweep_leftovers(self, found: _Recovery, orphans: Collection[str]) -> None:
        """Recovery step: every preparer and sharing step sweeps side effects no record knows; device metadata
        files of claims rolled back or forgotten and temporary CDI files of a crashed write are removed."""
        found.swept = self._sweep([*self.preparers, *self.sharing.values(), *self.claim_steps])
        if self.device_metadata is not None:  # files of claims rolled back or forgotten (written before a spec)
            found.swept += [f"device metadata of claim {u}" for u in
                            self.device_metadata.sweep({*self.state.claims(), *orphans})]
        temps = cdifiles.remove_stale_temp_files(self.identity.cdi, self.cdi_root)  # once, so prepares stay O(1)
        if temps:
            log.warning("removed %d temporary CDI file(s) a crashed write left behind", temps)

    def _adopt_orphans(self, found: _Recovery, orphans: Sequence[str]) -> None:
        """Recovery step: each orphan spec (there are orphans only on the damaged path) is adopted, or kept."""
        for uid in orphans:
            # The spec may belong to a running container whose claim record was lost: never delete it.
            name = self.identity.cdi.spec_name(uid)
            if not (self.cdi_root / name).exists():  # an older release's .json spec
                name = name.removesuffix(SPEC_SUFFIX) + LEGACY_SPEC_SUFFIX
            if self._adopt(uid, self.cdi_root / name):
                found.adopted.append(uid)
            else:
                log.error("kept orphan CDI spec %s: the claim state was damaged and the spec could not be "
                          "adopted; the kubelet's unprepare of its claim removes it", name)

    def _rebuild_specs(self, found: _Recovery) -> None:
        """Recovery step: the missing or invalid spec of every completed claim not adopted is rebuilt while its
        devices are still the physical devices it was prepared with (else the claim is unusable)."""
        for record in self.state.claims().values():
            if record.phase is not ClaimPhase.PREPARE_COMPLETED or record.uid in found.adopted:
                continue
            try:
                if self._ensure_spec(record):
                    found.rebuilt.append(record.uid)
            except ClaimError as exc:  # answered again, per claim, when the kubelet re-sends Prepare
                found.unusable.append(record.uid)
                log.error("%s", exc)
            except DradriverError as exc:
                found.unusable.append(record.uid)
                log.error("claim %s: cannot rebuild its CDI spec: %s", record.ref, exc)

    def _roll_back(self, uid: str) -> None:
        try:
            self._delete_spec(uid)
        finally:
            self.state.remove(uid)

    def _adopt(self, uid: str, path: Path) -> bool:
        """Record the claim ``uid`` as prepared from its CDI spec alone; False when the spec is unreadable."""
        try:
            spec = yaml.load(path.read_bytes(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # JSON is YAML
            names = [str(d["name"]) for d in spec.get("devices", [])]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError) as exc:
            log.error("cannot adopt orphan CDI spec %s: %s", path, exc)
            return False
        prefix = f"{uid}-"
        devices = [n[len(prefix):] for n in names if n.startswith(prefix)]
        held = [
            HeldDevice(request_names=(), pool=self.pool, device=d,
                       cdi_device_ids=(self.identity.cdi.device_id(uid, d),))
            for d in devices
        ]
        try:
            self.state.prepare_started(uid, namespace="", name="", devices=held, payload=encode_payload(path, []))
            self.state.prepare_completed(uid)
        except (ClaimConflictError, DradriverError) as exc:
            log.error("cannot adopt orphan CDI spec %s: %s", path, exc)
            return False
        log.error("claim state lost claim %s; adopted it from its CDI spec (devices %s) until it is unprepared",
                  uid, ", ".join(devices))
        return True

    def between_batches(self) -> FairLock:
        """The runner's lock, as a context manager: held, no prepare or unprepare chunk of this instance runs (the
        GPU plugin re-initialises NVML under it after VFIO passthrough moved a GPU between drivers, so no apply
        uses a handle meanwhile). Never take it in a preparer's call (it is held there)."""
        return self._lock

    def prepared_devices(self) -> PreparedDevices:
        """DRA device name -> ``(claim namespace, claim name)`` of every completed claim holding it, sorted (metrics
        labels: one series per claim; :meth:`ClaimViews.prepared_devices`).

        As of the last batch; safe to call from any thread, never waits on the claim state.
        """
        return self.views.prepared_devices()


def _fetch_timeout(ref: ClaimRef, fetch_budget: float) -> str:
    return (f"claim {ref}: the API server did not answer the ResourceClaim GET within {fetch_budget:.1f} s; "
            "nothing was prepared (the kubelet retries)")


def _claim_error(ref: ClaimRef, exc: BaseException) -> str:
    """The per-claim error string for ``exc``: its own message for our errors, a logged traceback otherwise."""
    if isinstance(exc, ClaimError | ClaimConflictError | cdi.CdiSpecError):
        return str(exc)
    if isinstance(exc, DradriverError):
        log.error("prepare of claim %s failed: %s", ref, exc)
        return f"claim {ref}: {exc}"
    log.error("prepare of claim %s failed unexpectedly", ref, exc_info=exc)
    return f"claim {ref}: internal error ({type(exc).__name__}: {exc}); see the plugin log"
