"""Consumable GPU shares made real on the node: one MPS control daemon per shared device, every claim's containers
limited to the share the scheduler allocated.

With ``--consumable-shares`` (gate ``ConsumableShares``), full GPUs and MIG devices are published with
``allowMultipleAllocations`` and the scheduler gives each claim a share (``shareID``, ``consumedCapacity``;
KEP-5075). NVIDIA's driver stops there: it enforces nothing on the node and refuses MPS with consumable shares
(NVIDIA's ``cmd/gpu-kubelet-plugin/consumable_shares.go``; ksigs#1283). :class:`SharedDevicePreparer` (kind
``gpu-share``) prepares such a share:

* **plan** (pure): the claim's ``consumedCapacity`` of the device becomes its MPS client limits
  (:func:`dradriver.domain.shares.share_limits`); a user ``MPS`` config is refused (NVIDIA's refusal with
  consumable shares; the share needs none); a share whose config selects ``TimeSlicing`` is time-sliced as in
  NVIDIA's driver (the time-slicing step sets the interval) and gets no daemon and no limits;
* **apply**: the shares of one device must have equal normalised configs (NVIDIA's rule for overlapping
  prepared devices), so one device is either MPS-shared or time-sliced; an MPS share makes the claim a user of
  the device's daemon, ``share-<sha256(device UUID)[:12]>``; the first user starts it through
  :class:`~dradriver.domain.ports.MpsDaemonControl` (:class:`ShareDaemons` over the MPS control-daemon
  component: compute mode ``EXCLUSIVE_PROCESS`` on a full GPU, multi-user mode when the GPU's CUDA compute
  capability is at least 7.0, since the claims' pods may run as different users) and waits until it is ready;
* **edits**: the device's nodes, ``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps``, the daemon's pipe directory and
  shm bind-mounted there and at ``/dev/shm`` (NVIDIA's MPS workload edits), and the claim's own
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``;
* **undo**: the claim stops being a user; the last user stops the daemon.

A claim's MPS shares must be on one device (:meth:`SharedDevicePreparer.check_claim`): a container talks to one MPS
control daemon, through one pipe directory at ``/tmp/nvidia-mps``.

Ownership lives in the claim state: each share's undo record names its daemon and claim, so the users of a
daemon are exactly the stored claims whose records name it. The preparer keeps that relation in memory, loaded
from the claim state before its first apply or undo (so a crash's half-prepared claims, undone at start, never
stop a daemon that completed claims still use), and the start-up sweep stops every daemon no stored record
names (a crash between the last user's removal and the daemon's stop). Per-claim cost is O(1) in the number of
shares on the device: a set insert or removal, plus the daemon start for the first share and its stop for the
last.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dradriver.domain import configs, mps
from dradriver.domain.cdi import ContainerEdits, Mount
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef, base_request_name
from dradriver.domain.configs import ConfigGroup
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.ports import DevicePlan, MpsDaemonControl, MpsDaemonDirs, MpsDaemonSpec, UndoRecord
from dradriver.domain.shares import ShareLimits, ShareMode, share_limits
from dradriver.errors import DradriverError
from dradriver.host.devicenodes import DeviceNodeInfo, device_edits
from dradriver.preparers.mps import ControlDaemons

log = logging.getLogger(__name__)

KIND = "gpu-share"
UNDO_VERSION = 1
PIPE_DIRECTORY = "/tmp/nvidia-mps"
"""Where a client finds its daemon's pipes (``CUDA_MPS_PIPE_DIRECTORY`` and the pipe bind mount)."""
MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
MULTI_USER_MIN_CC = (7, 0)
"""MPS multi-user mode (``-M``) needs CUDA compute capability 7.0 or newer (NVIDIA's
``cmd/gpu-kubelet-plugin/sharing.go``)."""


def daemon_id(uuid: str) -> str:
    """The ID of the MPS control daemon serving every share of the device with GPU or MIG UUID ``uuid``."""
    return "share-" + hashlib.sha256(uuid.encode()).hexdigest()[:12]


RecordSource = Callable[[], Iterable[UndoRecord]]
"""Every undo record the claim state holds (of any kind; others are ignored)."""


class SharedDevicePreparer:
    """Prepares consumable shares of full GPUs and MIG devices (module docstring), kind ``gpu-share``.

    :param mode: the ``--consumable-shares`` mode. When ``disabled`` the preparer handles no device but still
        undoes the share records of claims prepared while the mode was on (the plugin restarted without it).
    :param nodes: device-node lookup for the device's own CDI edits.
    :param daemons: starts and stops the MPS control daemons.
    :param stored_records: reads every stored undo record (the claim state), loaded once before the first apply
        or undo.
    """

    kind = KIND
    side_effects = True

    def __init__(self, mode: ShareMode, nodes: DeviceNodeInfo, daemons: MpsDaemonControl,
                 stored_records: RecordSource) -> None:
        self.mode = mode
        self.nodes = nodes
        self.daemons = daemons
        self._stored_records = stored_records
        self._users: dict[str, _Users] | None = None
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    # ------------------------------------------------------------------------------------ ownership
    def users(self, uuid: str) -> frozenset[str]:
        """Claim UIDs holding a share of the device with GPU or MIG UUID ``uuid`` now."""
        with self._guard:
            entry = self._index().get(uuid)
            return frozenset(entry.claims) if entry else frozenset()

    def share_holders(self, device: object) -> frozenset[str]:
        """Claim UIDs holding a share of the registry entry ``device`` (empty for other kinds); the batch runner
        asks before giving a device to a claim exclusively (e.g. after a restart with consumable shares off)."""
        uuid = getattr(device, "uuid", None)
        return self.users(uuid) if isinstance(uuid, str) else frozenset()

    def _index(self) -> dict[str, _Users]:
        """Device UUID -> its shares; loaded from the claim state on first use (call with ``_guard`` held)."""
        if self._users is None:
            self._users = _owners(self._stored_records())
        return self._users

    def _lock(self, uuid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uuid, threading.Lock())

    # ------------------------------------------------------------------------------------ preparer
    def handles(self, device: object) -> bool:
        """With consumable shares on: true for full GPUs and MIG devices (all are published multi-allocatable)."""
        return self.mode.enabled and type(device) in (GpuDevice, MigDevice)

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        """The share's daemon and limits from its allocation result and config (no I/O; the first plan loads the
        ownership from the in-memory claim state).

        A share whose config selects ``TimeSlicing`` is a time-sliced share (NVIDIA's consumable-shares
        behaviour: the time-slicing step sets the interval, no MPS daemon, no limits); any other share runs under
        the device's MPS daemon with its own limits.

        :raises ClaimError: the result has no ``shareID`` (allocated without consumable shares), the claim holds
            two shares of the device, ``consumedCapacity`` does not fit the device, or the config selects MPS
            (NVIDIA's refusal with consumable shares: the share's MPS daemon needs no user MPS config).
        """
        assert isinstance(device, GpuDevice | MigDevice)
        with self._guard:
            # Load the ownership now, in the runner's thread: applies run in worker threads while that thread
            # holds the claim state's lock, so they must never be the ones to read the claim state.
            self._index()
        index = {id(r): i for i, r in enumerate(claim.results)}
        where = [f"status.allocation.devices.results[{index.get(id(r), '?')}]" for r in results]
        names = tuple(dict.fromkeys(base_request_name(r.request) for r in results))
        shares = [r for r in results if not r.admin_access]
        if not shares:  # admin access only: the device without a share (monitoring tools)
            return DevicePlan(kind=self.kind, device=device.name, entry=device, request_names=names,
                              admin_access=True, results=tuple(results), group=group,
                              details={"uuid": device.uuid, "daemon": "", "limits": {}, "config": ""})
        if len(shares) > 1:
            raise ClaimError(claim.ref, f"{where[0]} and {where[1]}: two shares of device {device.name!r} in one "
                                        "claim; a container reaches one MPS daemon per device, ask for one share")
        result = shares[0]
        at = where[results.index(result)]
        if not result.share_id:
            raise ClaimError(claim.ref, f"{at}.shareID: missing, but device {device.name!r} is published for "
                                        f"consumable shares (--consumable-shares={self.mode}); the claim was "
                                        "allocated without them: delete and re-create it")
        strategy = group.plan.strategy if group is not None else None
        if group is not None and strategy == configs.MPS:
            raise ClaimError(claim.ref, f"{group.entry.parameters_at}.sharing.strategy: MPS sharing is not supported "
                                        "when consumable shares is enabled (each share of the GPU already runs under "
                                        "its own MPS limits, derived from its consumedCapacity)")
        try:
            limits = share_limits(self.mode, result.consumed(), device.memory_bytes)
        except ValueError as exc:
            raise ClaimError(claim.ref, f"{at}.consumedCapacity: {exc}") from None
        time_sliced = strategy == configs.TIME_SLICING
        return DevicePlan(kind=self.kind, device=device.name, entry=device, request_names=names,
                          admin_access=False, results=tuple(results), group=group, shared=True,
                          share_id=result.share_id,
                          details={"uuid": device.uuid, "daemon": "" if time_sliced else daemon_id(device.uuid),
                                   "limits": {} if time_sliced else limits.to_json(),
                                   "config": config_fingerprint(group)})

    def check_claim(self, claim: Claim, plans: Sequence[DevicePlan]) -> None:
        """Refuse a claim whose MPS shares are on more than one device (called by the batch runner with all the
        claim's share plans, before anything is applied). Pure.

        A container talks to one MPS control daemon: one ``CUDA_MPS_PIPE_DIRECTORY``, one pipe directory
        bind-mounted at :data:`PIPE_DIRECTORY`. Each device's shares run under that device's daemon, so shares of two
        devices would give the claim's containers two pipe mounts at the same path, and their CUDA clients would
        reach one daemon only. Time-sliced shares (no daemon) are not counted.

        :raises ClaimError: naming the results, requests and devices, and the reason.
        """
        served = [p for p in plans if p.shared and p.details.get("daemon")]
        if len(served) < 2:
            return
        index = {id(r): i for i, r in enumerate(claim.results)}

        def named(plan: DevicePlan) -> str:
            result = next(r for r in plan.results if not r.admin_access)
            return f'results[{index.get(id(result), "?")}] (request "{result.request}", device "{plan.device}")'

        raise ClaimError(claim.ref, f"status.allocation.devices.{named(served[0])} and {named(served[1])}: MPS "
                                    f"shares of {len(served)} devices in one claim; a container talks to one MPS "
                                    "control daemon (one CUDA_MPS_PIPE_DIRECTORY, its pipe mounted at "
                                    f"{PIPE_DIRECTORY}) and each device's shares run under that device's daemon, so "
                                    "a claim may hold MPS shares of one device only: ask for one device per claim "
                                    "(count 1) and use one claim per GPU")

    def _spec(self, device: GpuDevice | MigDevice, daemon: str) -> MpsDaemonSpec:
        gpu = device if isinstance(device, GpuDevice) else device.parent
        return MpsDaemonSpec(daemon_id=daemon, device_uuids=(device.uuid,),
                             full_gpu_uuids=(device.uuid,) if isinstance(device, GpuDevice) else (),
                             multi_user=tuple(gpu.cuda_compute_capability) >= MULTI_USER_MIN_CC)

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        """Add the claim to the device's shares (their configs must be equal, NVIDIA's rule for overlapping
        devices), starting the device's MPS daemon for the first MPS share (the daemon's start undoes itself when
        it fails). Later shares only join: O(1), no API call.

        :raises ClaimError: another claim's share of the device has a different config.
        :raises DradriverError: the daemon could not be started; the claim is not left a share.
        """
        details = plan.details
        uuid, daemon, fingerprint = str(details["uuid"]), str(details["daemon"]), str(details["config"])
        data: dict[str, Any] = {"claim": claim.uid, "uuid": uuid, "daemon": daemon, "config": fingerprint,
                                "limits": dict(details["limits"])}
        if not plan.shared:
            return UndoRecord(self.kind, UNDO_VERSION, plan.device, data)
        device = plan.entry
        assert isinstance(device, GpuDevice | MigDevice)
        with self._lock(uuid):
            with self._guard:
                entry = self._index().setdefault(uuid, _Users(fingerprint))
                others = entry.claims - {claim.uid}
                if others and entry.config != fingerprint:
                    holders = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
                    raise ClaimError(claim, f"device {plan.device!r} is already prepared for claim(s) {holders} "
                                            "with a different opaque config: consumable shares of one device must "
                                            "use equal configs")
                entry.config = fingerprint
                first = not others
                entry.claims.add(claim.uid)
            if first and daemon:
                try:
                    self.daemons.start(self._spec(device, daemon))
                except BaseException:
                    with self._guard:
                        entry.claims.discard(claim.uid)
                    raise
                log.info("MPS control daemon %s started for the shares of %s (first share: claim %s)", daemon,
                         plan.device, claim)
        if daemon:
            dirs = self.daemons.dirs(daemon)
            data.update({"pipe": dirs.pipe, "shm": dirs.shm})
        return UndoRecord(self.kind, UNDO_VERSION, plan.device, data)

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        """The device nodes, and for an MPS share the daemon's pipe and shm mounts and the claim's MPS limits.

        :raises DeviceNodeError: a major or capability minor cannot be found on this host.
        """
        device = plan.entry
        assert isinstance(device, GpuDevice | MigDevice)
        edits = device_edits(device, self.nodes, self.nodes.read_majors())
        return edits + client_edits(record)

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """The claim's share leaves the device; an MPS daemon stops with the last share. Idempotent.

        :raises DradriverError: stopping the daemon failed (the claim stays a share; the undo is retried).
        """
        uuid = str(record.data.get("uuid") or "")
        if not uuid:
            return
        daemon = str(record.data.get("daemon") or "")
        uid = str(record.data.get("claim") or claim.uid)
        with self._lock(uuid):
            with self._guard:
                entry = self._index().get(uuid)
                if entry is None or uid not in entry.claims:
                    return
                entry.claims.discard(uid)
                last = not entry.claims
            if not last:
                return
            if daemon:
                try:
                    self.daemons.stop(daemon)
                except BaseException:
                    with self._guard:
                        entry.claims.add(uid)
                    raise
                log.info("MPS control daemon %s stopped: its last share (claim %s) left %s", daemon, claim,
                         record.target)
            with self._guard:
                if not entry.claims:
                    self._index().pop(uuid, None)

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Rebuild the ownership from the stored records and stop every daemon none of them names."""
        owners = _owners(known)
        with self._guard:
            self._users = owners
        wanted = {daemon_id(uuid) for uuid, entry in owners.items() if entry.daemon}
        removed = []
        for daemon in sorted(set(self.daemons.running()) - wanted):
            self.daemons.stop(daemon)
            removed.append(f"MPS control daemon {daemon}")
        return removed


@dataclass
class _Users:
    """The shares of one device: their common config fingerprint and claim UIDs; ``daemon``: they use MPS."""

    config: str
    claims: set[str] = field(default_factory=set)
    daemon: bool = False


def config_fingerprint(group: ConfigGroup | None) -> str:
    """A digest of the normalised config of a share (equal configs, equal digests)."""
    if group is None:
        return ""
    return hashlib.sha256(repr(group.config).encode()).hexdigest()[:16]


def _owners(records: Iterable[UndoRecord]) -> dict[str, _Users]:
    owners: dict[str, _Users] = {}
    for record in records:
        if record.kind != KIND:
            continue
        uuid, uid = record.data.get("uuid"), record.data.get("claim")
        if isinstance(uuid, str) and uuid and isinstance(uid, str):
            entry = owners.setdefault(uuid, _Users(str(record.data.get("config") or "")))
            entry.claims.add(uid)
            entry.daemon = entry.daemon or bool(record.data.get("daemon"))
    return owners


def client_edits(record: UndoRecord) -> ContainerEdits:
    """The MPS client edits of a share from its stored record alone: pipe directory env and mounts, limits.

    :raises DradriverError: the record's limits are malformed.
    """
    data = record.data
    if not data.get("daemon"):
        return ContainerEdits()
    try:
        limits = ShareLimits.from_json(data.get("limits") or {})
    except ValueError as exc:
        raise DradriverError(f"share record of {record.target}: {exc}") from None
    mounts = (
        Mount(str(data["shm"]), "/dev/shm", MOUNT_OPTIONS),
        Mount(str(data["pipe"]), PIPE_DIRECTORY, MOUNT_OPTIONS),
    )
    return ContainerEdits(env=(f"CUDA_MPS_PIPE_DIRECTORY={PIPE_DIRECTORY}", *limits.env()), mounts=mounts)


class ShareDaemons:
    """:class:`~dradriver.domain.ports.MpsDaemonControl` over the MPS control-daemon component
    (:class:`dradriver.preparers.mps.ControlDaemons`), for the daemons of shared devices.

    The component is given its own root (``<plugins dir>/gpu.nvidia.com/mps-shares``) and Deployment kind label
    (``share``), so its sweep and the ``MPS`` strategy's never touch each other's daemons. A daemon's
    ``claim_uid`` label is its own ID (it serves the device, not one claim). Readiness is waited for at most
    ``wait_s`` seconds, below the runner's prepare deadline.
    """

    def __init__(self, daemons: ControlDaemons, *, wait_s: float = 30.0) -> None:
        self.component = daemons
        self.wait_s = wait_s

    def dirs(self, daemon_id: str) -> MpsDaemonDirs:
        """``<root>/<id>/pipe`` and ``<root>/<id>/shm``."""
        directory = self.component.directory(daemon_id)
        return MpsDaemonDirs(pipe=str(directory / mps.PIPE_DIR), shm=str(directory / mps.SHM_DIR))

    def start(self, spec: MpsDaemonSpec, *, deadline: float | None = None) -> None:
        """Start the daemon and wait for it (the component undoes a failed start).

        :raises MpsDaemonError: it could not be started or was not ready in time.
        """
        daemon = mps.ControlDaemon(spec.daemon_id, spec.daemon_id, tuple(sorted(spec.device_uuids)),
                                   tuple(sorted(spec.full_gpu_uuids)), multi_user=spec.multi_user)
        limit = time.monotonic() + self.wait_s
        self.component.start(daemon, deadline=limit if deadline is None else min(deadline, limit))

    def stop(self, daemon_id: str) -> None:
        """Stop the daemon (idempotent). :raises MpsDaemonError: a stop step failed."""
        self.component.stop(daemon_id)

    def running(self) -> list[str]:
        """IDs of the share daemons with a directory on this node."""
        return self.component.known()
