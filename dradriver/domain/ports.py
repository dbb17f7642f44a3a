"""Interfaces the layers meet at, as ``typing.Protocol`` classes, and the records that cross them.

* :class:`ClaimPreparer`: what the gRPC layer calls (implemented by the batch runner,
  :class:`dradriver.kubeletplugin.runner.BatchRunner`).
* :class:`DevicePreparer`: one implementation per device kind (full GPU, static MIG; dynamic MIG, IMEX channel
  and IMEX daemon next), plugged into the batch runner. A preparer turns the allocation results of its
  devices into a :class:`DevicePlan` (pure), performs the plan's side effect in :meth:`DevicePreparer.apply`
  and returns an :class:`UndoRecord` the claim state stores with the claim before the claim is acknowledged,
  gives the CDI container edits of each device, and undoes a stored record idempotently
  (:meth:`DevicePreparer.undo`, called by unprepare and by start-up recovery alike).
* :class:`SharingStep`: a sharing strategy (exclusive use, time-slicing, MPS control daemons) applied to a
  config group, chosen from the :class:`~dradriver.domain.configs.SharingPlan` that
  :func:`~dradriver.domain.configs.select_configs` computes; the same apply/undo/edits contract. An apply
  that fails half-way raises :class:`PartiallyApplied` with the record of what it did, and the runner undoes
  it with everything else applied for the claim.
* :class:`MpsDaemonControl`: MPS control daemons on this node (started, waited for, stopped), used by the
  consumable-share preparer.
* :class:`RequestMetrics`: what the batch runner reports (implemented by the Prometheus metrics).

Changing what an undo record holds (:class:`UndoRecord`; every release must unprepare what an older or a newer one
prepared, across an upgrade and a rollback of the DaemonSet):

* add facts, never rename, remove or retype one an older release's undo reads; an older reader ignores the new
  facts and still undoes what the record changed, so ``reader`` stays as it was (``version`` may go up; it is
  informational);
* when a fact changes meaning, raise ``reader`` to the first layout that understands it and :data:`UNDO_LAYOUT`
  with it; releases before that refuse the record with :class:`UndoRecordTooNew` instead of guessing (the release
  of commit 97aaf35 predates ``reader`` and ignores it, so a record that release may still meet keeps it at 1);
* a new kind is undone only by releases that know it: keep its preparer registered in every later release, undo
  only when its feature is turned off (``BatchRunner(undo_only=...)``);
* record the release's payloads as golden fixtures, never editing an older release's
  (``python -m tests.plugin.undo_fixtures`` writes ``tests/plugin/fixtures/undo-records/<release>/<kind>.json``):
  ``tests/plugin/test_undo_records.py`` undoes every release's fixtures with this release and checks each
  against the frozen reading rule of commit 97aaf35 (add a frozen copy of a later release's rule there when it
  changes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dradriver.domain.cdi import ContainerEdits
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef, ClaimResult
from dradriver.domain.configs import ConfigGroup
from dradriver.errors import DradriverError

JSONValue = Any
"""A value ``json.dumps`` accepts (undo records are stored as JSON inside the claim state)."""


class ClaimPreparer(Protocol):
    """What the gRPC layer calls; implemented by the batch runner.

    Blocking: the DRA server calls it from its worker threads, one thread per kubelet call, several calls at once;
    a call may keep its thread until its answer (at most its deadline). Every UID in the input gets an entry in
    the output; an error for one claim never fails the batch.
    """

    def prepare_claims(self, claims: Sequence[ClaimRef], *,
                       deadline_s: float | None = None) -> Mapping[str, ClaimResult]:
        """Prepare ``claims``; returns claim UID -> result, within ``deadline_s`` seconds (the caller's gRPC
        deadline, ``None`` when it sent none; the implementation's own default bounds it)."""
        ...

    def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare ``claims``; returns claim UID -> error string (empty on success)."""
        ...


UNDO_LAYOUT = 1
"""The undo-record layout every preparer and sharing step of this release reads (:attr:`UndoRecord.reader`)."""


class UndoRecordTooNew(DradriverError):
    """An undo record says it can only be undone by a newer release than this one (:meth:`UndoRecord.check_readable`).

    The claim stays prepared; the message names the record's kind, target, layouts and facts and what to do (run
    the release that prepared it, or a newer one, to unprepare the claim)."""


class UndoRecordFactError(DradriverError):
    """A fact an undo needs is missing from its record or of the wrong type (:meth:`UndoRecord.fact`)."""


@dataclass(frozen=True, slots=True)
class UndoRecord:
    """How to undo what one :meth:`DevicePreparer.apply` or :meth:`SharingStep.apply` did.

    Stored as JSON inside the claim's claim-state record, so it must survive a process restart, a plugin upgrade
    and a downgrade. A record holds the undo's *facts* (what was changed, on which device, the value to restore),
    never instructions for one release's code, and carries two numbers:

    * ``version`` (``"v"``): the layout the writer wrote; informational, a reader never refuses a record for it;
    * ``reader`` (``"reader"``, written only when above 1): the oldest reader layout that undoes the record
      correctly from the facts it knows. A writer that only adds facts keeps ``reader`` (an older reader ignores
      what it does not know and still undoes what the record changed); a writer whose facts change meaning raises
      it, and an older release then answers the unprepare with :class:`UndoRecordTooNew` (what to do) instead
      of undoing the wrong thing.

    A reader of layout ``L`` undoes every record with ``reader <= L`` (:meth:`check_readable`, called by the batch
    runner for every undo), reads its facts with :meth:`fact` (a missing or mistyped fact is a clear error, never
    a guess) and ignores data fields it does not know.

    :param kind: the preparer's or sharing step's :attr:`~DevicePreparer.kind` that wrote it.
    :param version: layout of ``data`` the writer wrote (starts at 1).
    :param target: what the record is about: a DRA device name, or a config group's devices joined by ``,``.
    :param data: the kind's own JSON object of facts (e.g. GPU-instance and compute-instance IDs); ``{}`` when
        the apply had no side effect.
    :param reader: the oldest reader layout that can undo it (1 unless a writer says otherwise).
    """

    kind: str
    version: int
    target: str
    data: Mapping[str, JSONValue] = field(default_factory=dict)
    reader: int = 1

    def to_json(self) -> dict[str, JSONValue]:
        """The stored form ``{"kind", "v", "target", "data"}``, plus ``"reader"`` when it is above 1."""
        out: dict[str, JSONValue] = {"kind": self.kind, "v": self.version, "target": self.target,
                                     "data": dict(self.data)}
        if self.reader > 1:
            out["reader"] = self.reader
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, JSONValue]) -> UndoRecord:
        """Inverse of :meth:`to_json`; keys it does not know are ignored (a newer writer's).

        :raises ValueError: a field is missing or of the wrong type.
        """
        try:
            kind, version, target, data = raw["kind"], raw["v"], raw["target"], raw.get("data", {})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"undo record {raw!r}: missing field {exc}") from None
        reader = raw.get("reader", 1)
        if not isinstance(kind, str) or not isinstance(version, int) or not isinstance(target, str) \
                or not isinstance(data, Mapping) or not isinstance(reader, int) or isinstance(reader, bool):
            raise ValueError(f"undo record {raw!r}: wrong field types")
        return cls(kind, version, target, dict(data), max(1, reader))

    def check_readable(self, layout: int = UNDO_LAYOUT) -> None:
        """Refuse a record a reader of ``layout`` cannot undo correctly (``reader > layout``).

        :raises UndoRecordTooNew: naming the kind, target, both layouts, the record's facts and what to do.
        """
        if self.reader <= layout:
            return
        raise UndoRecordTooNew(f"the {self.kind!r} undo record of {self.target!r} (layout {self.version}) "
                               f"needs a reader of layout {self.reader} or newer, and this plugin reads "
                               f"layout {layout}: a newer release prepared the claim and changed what the "
                               "record means. Run that release (or a newer one) to unprepare the claim; "
                               "the claim stays prepared until then. What the record says was changed: "
                               f"{dict(self.data)}")

    def fact(self, name: str, kind: type | tuple[type, ...], default: JSONValue = ...,
             of: Mapping[str, JSONValue] | None = None) -> Any:
        """The fact ``name`` of :attr:`data`, checked to be of ``kind`` (``bool`` is never taken for ``int``).

        :param default: returned when the fact is absent (or ``None``); without it an absent fact is an error.
        :param of: read it from this nested object of the record (an entry of a list fact) instead of ``data``.
        :raises UndoRecordFactError: the fact is missing (and has no default) or of another type.
        """
        value = (self.data if of is None else of).get(name)
        if value is None:
            if default is not ...:
                return default
            raise UndoRecordFactError(f"the {self.kind!r} undo record of {self.target!r} (layout "
                                      f"{self.version}) lacks the fact {name!r} its undo needs; record data: "
                                      f"{dict(self.data)}")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise UndoRecordFactError(f"the {self.kind!r} undo record of {self.target!r}: fact {name!r} is "
                                      f"{value!r}, not of type {'/'.join(k.__name__ for k in kinds)}")
        return value


class PartiallyApplied(ClaimError):
    """An :meth:`DevicePreparer.apply` or :meth:`SharingStep.apply` failed after some of its side effects were
    made; :attr:`record` undoes exactly those.

    The batch runner stores the record with the claim's other records (so a crash from here on is still
    undone at the next start), then undoes everything applied for the claim, newest first, and answers the
    claim with this error. A step that changes several things (one setting per GPU, a daemon then a mount)
    raises this instead of cleaning up itself, so its partial work is undone by the same, retried, idempotent
    :meth:`~SharingStep.undo` as a complete one.

    :param ref: the claim.
    :param cause: the claim error text (names the field path and what failed).
    :param record: the undo record of what was done before the failure.
    """

    def __init__(self, ref: ClaimRef | str, cause: str, record: UndoRecord) -> None:
        super().__init__(ref, cause)
        self.record = record


class NotReadyYet(ClaimError):
    """A prepare that cannot finish now but may shortly: what it waits for (an IMEX daemon's readiness) is not there
    yet. Raised by :meth:`DevicePreparer.apply` with nothing left to undo (what it did, such as a node label the
    waited-for daemon is scheduled by, is meant to stay for the next attempt).

    The batch runner answers such a claim only when it is still not ready at its deadline: until then it retries
    the claim with a growing pause (outside its locks, so other claims, the waited-for daemon's among them,
    prepare meanwhile), as NVIDIA's compute-domain plugin retries a prepare within the kubelet's 45 s
    (NVIDIA's ``cmd/compute-domain-kubelet-plugin/device_state.go``).

    :param ref: the claim.
    :param cause: what it waits for (names the object or file read).
    :param ready_hint: a cheap test (a local file read, no API request, no lock) that says when another attempt
        may succeed (the IMEX daemon's readiness record turned ready): the runner polls it during its pause and
        tries again as soon as it says so, instead of at the pause's end. ``None``: the pause alone.
    """

    def __init__(self, ref: ClaimRef | str, cause: str, *, ready_hint: Callable[[], bool] | None = None) -> None:
        super().__init__(ref, cause)
        self.ready_hint = ready_hint


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """What preparing one device of a claim means, decided before any side effect (pure).

    :param kind: the :attr:`DevicePreparer.kind` that made the plan and applies it.
    :param device: DRA device name (``gpu-0``, ``gpu-1-mig-1g.10gb-19-0``).
    :param entry: the device registry's entry for it (e.g. a :class:`~dradriver.domain.devices.GpuDevice`).
    :param request_names: requests it serves (DRA ``Device.request_names``, sub-request suffix removed).
    :param admin_access: every result naming it has ``adminAccess``.
    :param results: the allocation results naming the device, in claim order.
    :param group: the winning config group of its first result (None only for preparers without configs).
    :param details: the kind's own plan data (e.g. the MIG profile and placement to create).
    :param shared: the claim takes a consumable share of the device (other claims' shares may hold it too).
    :param share_id: the share's ``shareID`` when ``shared``.
    """

    kind: str
    device: str
    entry: object
    request_names: tuple[str, ...]
    admin_access: bool
    results: tuple[AllocationResult, ...]
    group: ConfigGroup | None = None
    details: Mapping[str, JSONValue] = field(default_factory=dict)
    shared: bool = False
    share_id: str | None = None


@runtime_checkable
class DevicePreparer(Protocol):
    """Prepares the devices of one kind (full GPU, static MIG, dynamic MIG, IMEX channel, IMEX daemon).

    Threading: :meth:`apply` and :meth:`undo` may run in worker threads, for different claims concurrently;
    :meth:`plan` and :meth:`edits` are called under the batch runner's lock.

    :ivar kind: unique name of the kind, stored in every :class:`UndoRecord` it writes.
    :ivar side_effects: ``False`` when :meth:`apply` changes nothing outside the claim state and the CDI spec
        (the runner then applies inline and stores the record with the completed claim, without an extra
        claim-state sync).
    """

    kind: str
    side_effects: bool

    def handles(self, device: object) -> bool:
        """True when ``device`` (an entry of the device registry) is of this kind."""
        ...

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        """The plan for ``device`` from the results naming it and its config group. Pure: no I/O.

        :raises ClaimError: the allocation result or config cannot be prepared (names claim and field).
        """
        ...

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        """Perform the plan's side effect (may be slow, may fail) and return how to undo it.

        Must leave nothing behind when it raises, or raise :class:`PartiallyApplied` carrying the record that
        undoes what is left. A crash after the side effect but before the runner stored the record is found by
        :meth:`sweep` at the next start.

        :raises DradriverError: the side effect failed (becomes the claim's error; the runner undoes every
            other record applied for that claim).
        """
        ...

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        """The CDI container edits of the device (device nodes, env, mounts), after :meth:`apply`.

        :raises DradriverError: a device node cannot be resolved.
        """
        ...

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Undo a stored record. Idempotent: undoing what is already gone succeeds.

        :raises DradriverError: the undo failed; the claim stays recorded and the undo is retried.
        """
        ...

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """At start: remove side effects of this kind that no stored record knows; return what was removed."""
        ...


class ClaimSpecPreparer(Protocol):
    """Optional parts of a :class:`DevicePreparer` the batch runner uses when a preparer has them (the IMEX channel
    and daemon preparers of the compute-domain plugin): each is looked up with ``getattr``.

    * ``apply_takes_deadline = True``: :meth:`DevicePreparer.apply` takes ``deadline=`` (``time.monotonic()`` by
      which it must return, the kubelet's deadline less the runner's margin).
    * ``holds(plan)``: further device names of this node the claim holds beside ``plan.device`` (recorded in the
      claim state, so no other claim is given them, but not answered to the kubelet): an ``All`` IMEX channel
      claim holds ``channel-1 .. channel-<n-1>`` beside the allocated ``channel-0``.
    * ``cdi_device_ids(ref, plan)``: the CDI device IDs answered for ``plan.device`` instead of the claim
      device alone (``()``: none at all).
    * ``render_spec(ref, plans, records, spec_edits)``: the claim's whole CDI spec (bytes), ``b""`` when the claim
      needs no spec, ``None`` to let the runner render it; called when every plan of the claim is this kind's.
    * ``metadata_attributes(ref, plan, record)``: attributes the device's KEP-5304 metadata file carries beside
      its published ones (typed form; ``record`` is the device's undo record of this prepare, ``None`` if none):
      a dynamic MIG device's ``uuid``, a channel's ComputeDomain (``DeviceMetadata`` gate).
    * ``unprepared_unknown(ref)``: a claim the claim state has no record of was unprepared (its prepare never
      completed); the preparer removes what an attempt left for the next one (best effort, errors are logged).
    """

    def holds(self, plan: DevicePlan) -> Sequence[str]: ...

    def cdi_device_ids(self, ref: ClaimRef, plan: DevicePlan) -> tuple[str, ...] | None: ...

    def render_spec(self, ref: ClaimRef, plans: Sequence[DevicePlan], records: Sequence[UndoRecord],
                    spec_edits: ContainerEdits) -> bytes | None: ...


@runtime_checkable
class SharingStep(Protocol):
    """A sharing strategy applied to a config group of a claim, after its devices were applied.

    :ivar strategy: the :attr:`~dradriver.domain.configs.SharingPlan.strategy` it implements (``None``:
        exclusive use).
    """

    kind: str
    strategy: str | None
    side_effects: bool

    def apply(self, claim: ClaimRef, group: ConfigGroup, devices: Sequence[object], *,
              deadline: float | None = None) -> UndoRecord:
        """Apply the group's sharing plan to ``devices`` (the registry entries of ``group.devices``).

        Must leave nothing behind when it raises.

        :param deadline: ``time.monotonic()`` value by which the step must be done (the kubelet's deadline less
            the runner's margin; ``None``: no bound from the caller). A step that waits (an MPS control daemon's
            readiness) waits at most until then.
        :raises DradriverError: the step failed.
        """
        ...

    def edits(self, claim: ClaimRef, record: UndoRecord) -> Mapping[str, ContainerEdits]:
        """Per DRA device name, the CDI edits the step adds (e.g. the MPS pipe directory), from its stored
        record alone (so a vanished spec can be rewritten from the claim state)."""
        ...

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Undo a stored record; idempotent.

        :raises DradriverError: the undo failed.
        """
        ...

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """At start: remove side effects of this step that no stored record of its kind knows (a crash between
        the side effect and storing its record); return what was removed."""
        ...


@runtime_checkable
class ClaimStep(Protocol):
    """A step applied once per claim over all of its devices, after the device preparers and sharing steps (the
    Fabric Manager partition a claim's GPUs form: :mod:`dradriver.preparers.fabricpartition`). The batch runner
    calls :meth:`apply` when :meth:`applies` says so, stores its record with the claim's others, undoes it by
    kind, and hands it ``bind_records`` and the start-up sweep as it does sharing steps."""

    kind: str
    side_effects: bool

    def applies(self, devices: Sequence[object]) -> bool:
        """True when the claim's devices (registry entries, admin-access ones left out) need the step."""
        ...

    def apply(self, claim: ClaimRef, devices: Sequence[object]) -> UndoRecord:
        """Perform the step for the claim; must leave nothing behind when it raises.

        :raises DradriverError: the step failed (the claim's error; its other records are undone).
        """
        ...

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Undo a stored record; idempotent.

        :raises DradriverError: the undo failed (retried).
        """
        ...

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """At start: remove side effects of this step no stored record of its kind knows; what was removed."""
        ...


@dataclass(frozen=True, slots=True)
class MpsDaemonSpec:
    """One MPS control daemon to run (NVIDIA's MPS contract, ``cmd/gpu-kubelet-plugin/sharing.go``).

    :param daemon_id: the daemon's ID (its Deployment is ``mps-control-daemon-<id>``; its host directory
        ``<plugins dir>/gpu.nvidia.com/mps/<id>``); a DNS label of at most 44 characters.
    :param device_uuids: GPU or MIG UUIDs the daemon serves (``CUDA_VISIBLE_DEVICES``), sorted.
    :param full_gpu_uuids: the full GPUs among them, whose compute mode becomes ``EXCLUSIVE_PROCESS``.
    :param multi_user: start the daemon with ``-M`` (clients of any UID; needs CUDA compute capability >= 7.0).
    """

    daemon_id: str
    device_uuids: tuple[str, ...]
    full_gpu_uuids: tuple[str, ...]
    multi_user: bool = False


@dataclass(frozen=True, slots=True)
class MpsDaemonDirs:
    """Host paths a daemon's clients mount: its pipe directory (``/tmp/nvidia-mps``) and shm (``/dev/shm``)."""

    pipe: str
    shm: str


class MpsDaemonControl(Protocol):
    """Runs MPS control daemons on this node. Methods block and may run in worker threads."""

    def dirs(self, daemon_id: str) -> MpsDaemonDirs:
        """The host directories of the daemon ``daemon_id`` (pure: a path computation)."""
        ...

    def start(self, spec: MpsDaemonSpec, *, deadline: float | None = None) -> None:
        """Start the daemon and wait until it is ready, by ``deadline`` (``time.monotonic()``; ``None``: the
        implementation's default bound).

        :raises DradriverError: it could not be started or did not become ready (nothing is left behind).
        """
        ...

    def stop(self, daemon_id: str) -> None:
        """Stop the daemon and remove what it left on the node; idempotent.

        :raises DradriverError: it could not be stopped (retried by the next undo).
        """
        ...

    def running(self) -> list[str]:
        """The IDs of every daemon of this plugin on this node (for the start-up sweep)."""
        ...


StoredRecords = Callable[[str, str], Sequence[tuple[str, UndoRecord]]]
"""``stored(kind, exclude_uid)``: the undo records of ``kind`` stored with PREPARE_COMPLETED claims other than
``exclude_uid``, as (claim UID, record) pairs in claim-state order. The batch runner hands it to every sharing
step that has a ``bind_records(stored)`` method, for settings several claims share (a GPU's time-slice stays
while another prepared claim still uses it)."""


class RequestMetrics(Protocol):
    """What the batch runner reports per batch (``nvidia_dra_requests_*`` and prepared-claim gauges)."""

    def in_flight(self, operation: str) -> AbstractContextManager[None]: ...

    def observe_prepare(self, outcome: str, seconds: float, *, error_type: str | None = None) -> None: ...

    def observe_unprepare(self, outcome: str, seconds: float, *, error_type: str | None = None) -> None: ...

    def set_prepared(self, claims: int, devices_by_type: Mapping[str, int]) -> None: ...

