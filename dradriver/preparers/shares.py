"""Consumable GPU shares made real on the node: one MPS control daemon per shared device, every claim's containers
limited to the share the scheduler allocated.

With ``--consumable-shares`` (gate ``ConsumableShares``), full GPUs and MIG devices are published with
``allowMultipleAllocations`` and the scheduler gives each claim a share (``shareID``, ``consumedCapacity``;
KEP-5075). NVIDIA's driver stops there: it enforces nothing on the node and refuses MPS with consumable shares
(``nvidia-dra-driver.md`` 2.6; NVIDIA/k8s-dra-driver-gpu#1283). :class:`SharedDevicePreparer` (kind
``gpu-share``) prepares such a share:

* **plan** (pure): the claim's ``consumedCapacity`` of the device becomes its MPS client limits
  (:func:`dradriver.domain.shares.share_limits`); a user ``MPS`` or ``TimeSlicing`` config on a shared device is
  refused (the device's MPS daemon belongs to all its shares; time-slicing would change the compute mode under it);
* **apply**: the claim becomes a user of the device's daemon, ``share-<sha256(device UUID)[:12]>``; the first
  user starts it through :class:`~dradriver.domain.ports.MpsDaemonControl` (compute mode ``EXCLUSIVE_PROCESS`` on a
  full GPU, multi-user mode when the GPU's CUDA compute capability is at least 7.0, since the claims' pods may run
  as different users) and waits until it is ready;
* **edits**: the device's nodes, ``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps``, the daemon's pipe directory and
  shm bind-mounted there and at ``/dev/shm`` (NVIDIA's MPS workload edits), and the claim's own
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``;
* **undo**: the claim stops being a user; the last user stops the daemon.

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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dradriver.domain import configs
from dradriver.domain.cdi import ContainerEdits, Mount
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef, base_request_name
from dradriver.domain.configs import ConfigGroup
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.ports import DevicePlan, MpsDaemonControl, MpsDaemonSpec, UndoRecord
from dradriver.domain.shares import ShareLimits, ShareMode, share_limits
from dradriver.errors import DradriverError
from dradriver.host.devicenodes import DeviceNodeInfo, device_edits

log = logging.getLogger(__name__)

KIND = "gpu-share"
UNDO_VERSION = 1
PIPE_DIRECTORY = "/tmp/nvidia-mps"
"""Where a client finds its daemon's pipes (``CUDA_MPS_PIPE_DIRECTORY`` and the pipe bind mount)."""
MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
MULTI_USER_MIN_CC = (7, 0)
"""MPS multi-user mode (``-M``) needs CUDA compute capability 7.0 or newer (``nvidia-dra-driver-updates.md`` 2a)."""


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
        self._users: dict[str, set[str]] | None = None
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    # ------------------------------------------------------------------------------------ ownership
    def users(self, daemon: str) -> frozenset[str]:
        """Claim UIDs whose shares use ``daemon`` now."""
        with self._guard:
            return frozenset(self._index().get(daemon, ()))

    def _index(self) -> dict[str, set[str]]:
        """Daemon ID -> claim UIDs; loaded from the claim state on first use (call with ``_guard`` held)."""
        if self._users is None:
            self._users = _owners(self._stored_records())
        return self._users

    def _lock(self, daemon: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(daemon, threading.Lock())

    # ------------------------------------------------------------------------------------ preparer
    def handles(self, device: object) -> bool:
        """With consumable shares on: true for full GPUs and MIG devices (all are published multi-allocatable)."""
        return self.mode.enabled and type(device) in (GpuDevice, MigDevice)

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        """The share's daemon and limits from its allocation result.

        :raises ClaimError: the result has no ``shareID`` (allocated without consumable shares), the claim holds
            two shares of the device, ``consumedCapacity`` does not fit the device, or the device's config selects
            MPS or TimeSlicing (refused with consumable shares; NVIDIA refuses MPS the same way).
        """
        assert isinstance(device, GpuDevice | MigDevice)
        index = {id(r): i for i, r in enumerate(claim.results)}
        where = [f"status.allocation.devices.results[{index.get(id(r), '?')}]" for r in results]
        shares = [r for r in results if not r.admin_access]
        if not shares:  # admin access only: the device without a share (monitoring tools)
            names = tuple(dict.fromkeys(base_request_name(r.request) for r in results))
            return DevicePlan(kind=self.kind, device=device.name, entry=device, request_names=names,
                              admin_access=True, results=tuple(results), group=group,
                              details={"daemon": "", "uuid": device.uuid, "limits": {}})
        if len(shares) > 1:
            raise ClaimError(claim.ref, f"{where[0]} and {where[1]}: two shares of device {device.name!r} in one "
                                        "claim; a container reaches one MPS daemon per device, ask for one share")
        result = shares[0]
        at = where[results.index(result)]
        if not result.share_id:
            raise ClaimError(claim.ref, f"{at}.shareID: missing, but device {device.name!r} is published for "
                                        f"consumable shares (--consumable-shares={self.mode}); the claim was "
                                        "allocated without them: delete and re-create it")
        if group is not None and group.plan.strategy in (configs.MPS, configs.TIME_SLICING):
            message = ("MPS sharing is not supported when consumable shares is enabled: every share of the GPU "
                       "already runs under its own MPS limits" if group.plan.strategy == configs.MPS else
                       "TimeSlicing is not supported with consumable shares: the GPU is shared through MPS, and a "
                       "time-slice setting would change its compute mode under the other shares")
            raise ClaimError(claim.ref, f"{group.entry.parameters_at}.sharing.strategy: {message}")
        try:
            limits = share_limits(self.mode, result.consumed(), device.memory_bytes)
        except ValueError as exc:
            raise ClaimError(claim.ref, f"{at}.consumedCapacity: {exc}") from None
        names = tuple(dict.fromkeys(base_request_name(r.request) for r in results))
        return DevicePlan(kind=self.kind, device=device.name, entry=device, request_names=names,
                          admin_access=False, results=tuple(results), group=group, shared=True,
                          share_id=result.share_id,
                          details={"daemon": daemon_id(device.uuid), "uuid": device.uuid,
                                   "limits": limits.to_json()})

    def _spec(self, device: GpuDevice | MigDevice, daemon: str) -> MpsDaemonSpec:
        gpu = device if isinstance(device, GpuDevice) else device.parent
        return MpsDaemonSpec(daemon_id=daemon, device_uuids=(device.uuid,),
                             full_gpu_uuids=(device.uuid,) if isinstance(device, GpuDevice) else (),
                             multi_user=tuple(gpu.cuda_compute_capability) >= MULTI_USER_MIN_CC)

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        """Make the claim a user of the device's daemon, starting it for the first user (the daemon's start undoes
        itself when it fails). Later shares only join: O(1), no API call.

        :raises DradriverError: the daemon could not be started; the claim is not left a user.
        """
        daemon = str(plan.details["daemon"])
        data: dict[str, Any] = {"claim": claim.uid, "daemon": daemon, "uuid": plan.details["uuid"],
                                "limits": dict(plan.details["limits"])}
        if not daemon:
            return UndoRecord(self.kind, UNDO_VERSION, plan.device, data)
        device = plan.entry
        assert isinstance(device, GpuDevice | MigDevice)
        with self._lock(daemon):
            with self._guard:
                users = self._index().setdefault(daemon, set())
                first = not (users - {claim.uid})
                users.add(claim.uid)
            if first:
                try:
                    self.daemons.start(self._spec(device, daemon))
                except BaseException:
                    with self._guard:
                        users.discard(claim.uid)
                    raise
                log.info("MPS control daemon %s started for the shares of %s (first share: claim %s)", daemon,
                         plan.device, claim)
        dirs = self.daemons.dirs(daemon)
        data.update({"pipe": dirs.pipe, "shm": dirs.shm})
        return UndoRecord(self.kind, UNDO_VERSION, plan.device, data)

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        """The device nodes, the daemon's pipe and shm mounts, and the claim's MPS client limits.

        :raises DeviceNodeError: a major or capability minor cannot be found on this host.
        """
        device = plan.entry
        assert isinstance(device, GpuDevice | MigDevice)
        edits = device_edits(device, self.nodes, self.nodes.read_majors())
        return edits + client_edits(record)

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """The claim stops using its daemon; the daemon stops with its last user. Idempotent.

        :raises DradriverError: stopping the daemon failed (the claim stays a user; the undo is retried).
        """
        daemon = str(record.data.get("daemon") or "")
        if not daemon:
            return
        uid = str(record.data.get("claim") or claim.uid)
        with self._lock(daemon):
            with self._guard:
                users = self._index().setdefault(daemon, set())
                users.discard(uid)
                last = not users
            if not last:
                return
            try:
                self.daemons.stop(daemon)
            except BaseException:
                with self._guard:
                    users.add(uid)
                raise
            with self._guard:
                if not self._index().get(daemon):
                    self._index().pop(daemon, None)
        log.info("MPS control daemon %s stopped: its last share (claim %s) left %s", daemon, claim, record.target)

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Rebuild the ownership from the stored records and stop every daemon none of them names."""
        owners = _owners(known)
        with self._guard:
            self._users = owners
        removed = []
        for daemon in sorted(set(self.daemons.running()) - set(owners)):
            self.daemons.stop(daemon)
            removed.append(f"MPS control daemon {daemon}")
        return removed


def _owners(records: Iterable[UndoRecord]) -> dict[str, set[str]]:
    owners: dict[str, set[str]] = {}
    for record in records:
        if record.kind != KIND:
            continue
        daemon, uid = record.data.get("daemon"), record.data.get("claim")
        if isinstance(daemon, str) and daemon and isinstance(uid, str):
            owners.setdefault(daemon, set()).add(uid)
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
