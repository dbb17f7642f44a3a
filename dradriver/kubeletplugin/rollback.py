"""The rollback checkpoint: NVIDIA's ``checkpoint.json`` kept true while a dradriver kubelet plugin runs, so that
NVIDIA's plugin (``gpu-kubelet-plugin``, ``compute-domain-kubelet-plugin``), started in its place (a rollback, often
right after a crash), finds every claim dradriver holds as prepared: it refuses their devices to other claims and
unprepares them when the kubelet asks. One writer for both plugins; what differs is said by the identity
(:func:`open_rollback_checkpoint`): the entry shapes, how a device is described and how groups are formed.

The compute-domain plugin's file (``<plugins dir>/compute-domain.nvidia.com/checkpoint.json``, NVIDIA's
``cmd/compute-domain-kubelet-plugin/checkpoint*.go``): each device ``channel`` or ``daemon`` with ``info.id``
(the number in its name), one group per channel or daemon config with ``configState``
``{Type: "channel" | "daemon", ComputeDomain: <UID>}`` (NVIDIA's unprepare of a channel group removes the node
label ``resource.nvidia.com/computeDomain`` naming that ComputeDomain, as dradriver's does), and an aborted
prepare (dradriver's aborted mark, kept its TTL) as ``PrepareAborted`` with ``abortedAt`` (whole seconds, UTC)
and the status its prepare read (NVIDIA refuses a prepare whose claim status is identical as "stale").

What each entry says (format: :mod:`dradriver.domain.nvcheckpoint`; NVIDIA's side: its ``device_state.go``):

* ``checkpointState`` ``PrepareCompleted`` for every claim the claim state holds as PREPARE_COMPLETED (a claim
  still PREPARE_STARTED is in no checkpoint: dradriver rolls it back itself at its next start, and NVIDIA would
  never be asked to unprepare what it was not told was prepared);
* ``status``: the claim's ``status`` as the API server returned it at prepare (NVIDIA reads ``allocation`` to
  refuse held devices, and panics on an entry without it). A claim whose status this process never saw (prepared
  by an instance before a restart whose checkpoint was lost) gets ``allocation.devices.results`` rebuilt from its
  held devices, which is all NVIDIA reads;
* ``preparedDevices``: one group with each device in NVIDIA's layout (``gpu.info.uuid``; ``mig.concrete`` with the
  parent's minor and UUID, GPU and compute instance IDs and the MIG UUID, for a dynamic MIG device those the claim
  created, which NVIDIA's unprepare destroys as dradriver's would) and the kubelet ``Device`` answered;
  a group per sharing step, its ``configState`` saying what NVIDIA's unprepare must undo: ``timeSliceApplied``
  where dradriver set a time-slice, ``mpsControlDaemonID`` where it started an MPS control daemon (dradriver's
  daemons have NVIDIA's ID, Deployment name and host layout, so NVIDIA's unprepare stops them as dradriver's
  would). The MPS daemons of consumable shares are not named (one daemon serves several claims' shares, which
  NVIDIA's ``configState`` of one claim cannot say);
* ``nodeBootID``: the boot ID the claim state uses (NVIDIA drops a checkpoint of another boot).

When it is written (the ordering rule): before the kubelet gets a claim's Prepare answer, a checkpoint naming
the claim is on disk; before it gets an Unprepare answer, one without the claim is. A missing entry would make
NVIDIA hand a held device to another claim (unsafe); a stale one would make it refuse a free device forever.
The runner calls :meth:`RollbackCheckpoint.prepared` / :meth:`RollbackCheckpoint.unprepared` under its lock,
right after the claim state's group commit (in-memory, O(1) per claim), and :meth:`RollbackCheckpoint.flush`
after releasing it and before answering. The file is rewritten whole and fsync'd (NVIDIA's format has no other
way; the fsync is what keeps the file whole across a power loss, see :mod:`dradriver.host.nvcheckpointfile`), once
per Prepare or Unprepare call whatever its claims. NVIDIA's plugin rewrites it twice per prepare
(``PrepareStarted``, then ``PrepareCompleted``) and once per unprepare; one rewrite suffices here because a claim
is named only once its completion is in the claim state (a claim a crash left PREPARE_STARTED is rolled back from
the claim state, never from this file), so nothing of it needs to be on disk before that. The entries are encoded
once per claim and a rewrite joins their bytes (:func:`~dradriver.domain.nvcheckpoint.assemble`). Concurrent calls
share one rewrite (group commit): each flush covers every change made before it began, so N kubelet calls in
flight cost one write, not N. A
process crash after the claim state's commit and before the flush leaves a claim the kubelet was never told was
prepared: its retry is answered from the claim state and flushes the entry then; the unprepare's retry likewise
removes a stale entry.

Entries for claims dradriver does not hold (NVIDIA prepared them, or began to, before the switch) are kept as they
are, until an Unprepare of that claim removes them: they are never lost by a switch, and NVIDIA, back on the node,
still unprepares them or rolls them back. The exception is a half-prepared claim dradriver adopted and rolled back
itself (``rolled_back`` of :meth:`RollbackCheckpoint.load`; the rule is in :mod:`dradriver.kubeletplugin.adoption`):
its entry goes, as the node has nothing of it left. A checkpoint that does not verify is
kept aside as ``checkpoint.json.corrupt-<UTC time>`` and rebuilt from the claim state. Each rewrite holds
``<plugin dir>/cp.lock`` (:mod:`dradriver.host.pluginlocks`), as NVIDIA's GPU plugin holds it around its
read-modify-write, so neither lands inside the other's. Limitation: two plugin
instances on one node (a rolling update's surge) each write their own view; the last writer's view lasts until
the next prepare or unprepare of the surviving instance.
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from dradriver.domain.claims import Claim
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, DriverIdentity
from dradriver.domain.nvcheckpoint import (
    CD_CLAIM,
    GPU_CLAIM,
    CheckpointEntry,
    CheckpointError,
    CheckpointState,
    ClaimSchema,
    ConfigState,
    DeviceGroup,
    EncodedEntry,
    KubeletDevice,
    MigConcrete,
    PreparedDevice,
    assemble,
    encode_entry,
)
from dradriver.domain.passthrough import VfioDevice
from dradriver.domain.ports import UndoRecord
from dradriver.domain.registry import DeviceRegistry
from dradriver.host import nvcheckpointfile
from dradriver.host.claimstate import ClaimPhase, ClaimRecord, HeldDevice, read_boot_id
from dradriver.host.pluginlocks import PluginLocks
from dradriver.kubeletplugin.payload import aborted_mark, held_devices, read_payload
from dradriver.preparers.computedomain import CHANNEL_KIND, CHANNEL_PREFIX, DAEMON_KIND
from dradriver.preparers.dynamicmig import KIND as DYNAMIC_MIG
from dradriver.preparers.mps import MpsSharing
from dradriver.preparers.sharing import TimeSlicing

__all__ = [
    "DescribeDevice",
    "GroupDevices",
    "RollbackCheckpoint",
    "compute_domain_groups",
    "describe_channel",
    "describe_registered",
    "gpu_groups",
    "open_rollback_checkpoint",
    "parse_rfc3339",
    "rfc3339",
]

log = logging.getLogger(__name__)

GroupDevices = Callable[[Mapping[str, PreparedDevice], Sequence[UndoRecord]], tuple[DeviceGroup, ...]]
"""A claim's devices in NVIDIA's layout (DRA device name -> device) and its undo records -> NVIDIA's device groups,
each with the ``configState`` NVIDIA's unprepare reads."""

DescribeDevice = Callable[[str], PreparedDevice | None]
"""DRA device name -> the device in NVIDIA's layout without its kubelet ``Device`` (``kind`` ``gpu`` with the
UUID, ``mig`` with :class:`~dradriver.domain.nvcheckpoint.MigConcrete`), or ``None`` for a name this node does
not know now."""



class RollbackCheckpoint:
    """NVIDIA's ``checkpoint.json`` for the claims dradriver holds (see the module docstring).

    :param path: ``<plugin dir>/checkpoint.json``.
    :param boot_id: the node boot ID to record.
    :param driver: the DRA driver name (``status.allocation`` rebuilt from held devices names it).
    :param describe: how a device name becomes NVIDIA's device layout.
    :param schema: the plugin's entry shapes (:data:`~dradriver.domain.nvcheckpoint.GPU_CLAIM`,
        :data:`~dradriver.domain.nvcheckpoint.CD_CLAIM`).
    :param group: how a claim's devices and undo records become NVIDIA's device groups (default
        :func:`gpu_groups`; the compute-domain plugin's: :func:`compute_domain_groups`).
    :param locks: the plugin directory's locks (:mod:`dradriver.host.pluginlocks`): ``cp.lock`` is held around
        every write of the file and around the start-up read that may keep a damaged file aside, as NVIDIA's GPU
        plugin holds it around each read-modify-write, so neither plugin's rewrite lands inside the other's. None:
        no lock.
    """

    def __init__(self, path: Path, *, boot_id: str, driver: str, describe: DescribeDevice,
                 schema: ClaimSchema = GPU_CLAIM, group: GroupDevices | None = None,
                 locks: PluginLocks | None = None) -> None:
        self.path = path
        self.locks = locks
        self.boot_id = boot_id
        self.driver = driver
        self.describe = describe
        self.schema = schema
        self.group = group or gpu_groups
        self._entries: dict[str, EncodedEntry] = {}
        self._mutex = threading.Lock()  # the entries and the version
        self._write_lock = threading.Lock()  # one rewrite at a time
        self._version = 0
        self._written = -1
        self.writes = 0

    # ---- start --------------------------------------------------------------------------------------------------
    def load(self, claims: Mapping[str, ClaimRecord], rolled_back: Collection[str] = ()) -> None:
        """At start, after the runner's recovery: take the entries of the file on disk that are still true, add
        one for every other PREPARE_COMPLETED claim of ``claims``, drop the rest of dradriver's, and write.
        ``rolled_back``: claims whose entries go although the claim state does not hold them (claims another
        plugin began to prepare that dradriver adopted and recovery rolled back; aborted marks recovery found
        expired).

        A file of another boot is dropped (NVIDIA's rule); a damaged one is kept aside and logged.

        :raises OSError: the file cannot be written, or ``cp.lock`` is held past its bound
            (:class:`~dradriver.host.pluginlocks.PluginLockTimeout`).
        """
        found: dict[str, CheckpointEntry] = {}
        with self._locked():
            try:
                stored = nvcheckpointfile.read_checkpoint(self.path, self.schema)
            except (CheckpointError, OSError) as exc:
                aside = nvcheckpointfile.keep_aside(self.path, "corrupt")
                log.error("NVIDIA-format checkpoint %s cannot be read (%s); kept as %s and rebuilt from the claim "
                          "state", self.path, exc, aside)
                stored = None
        if stored is not None and stored.node_boot_id in ("", self.boot_id):
            found = dict(stored.claims)
        foreign = 0
        entries: dict[str, EncodedEntry] = {}
        for uid, entry in found.items():
            record = claims.get(uid)
            if record is None and uid in rolled_back:
                continue
            if record is None:  # NVIDIA's plugin prepared it (or began to) before the switch: kept until unprepared,
                foreign += 1    # so that NVIDIA, back on the node, still unprepares or rolls it back
                entries[uid] = encode_entry(uid, entry, self.schema)
            elif record.phase is ClaimPhase.PREPARE_COMPLETED and entry.state is CheckpointState.PREPARE_COMPLETED \
                    and isinstance(entry.status.get("allocation"), Mapping):
                entries[uid] = encode_entry(uid, entry, self.schema)
            elif entry.state is CheckpointState.PREPARE_ABORTED and (at := _aborted_at(record)) is not None \
                    and parse_rfc3339(entry.aborted_at) == int(at):
                entries[uid] = encode_entry(uid, entry, self.schema)  # the mark's entry, with the status it had
        rebuilt = 0
        for uid, record in claims.items():
            if record.phase is ClaimPhase.PREPARE_COMPLETED and uid not in entries and record.devices:
                entries[uid] = self._encode(uid, None, held_devices(record), self._undo_of(record),
                                            (record.namespace, record.name))
                rebuilt += 1
            elif self.schema.aborted_at and uid not in entries and (at := _aborted_at(record)) is not None:
                entries[uid] = self._encode_aborted(uid, record.namespace, record.name, at)
        with self._mutex:
            self._entries = entries
            self._version += 1
        self.flush()
        log.info("NVIDIA-format checkpoint %s: %d claim(s) of dradriver (%d rebuilt from the claim state), %d "
                 "prepared by another plugin kept", self.path, len(entries) - foreign, rebuilt, foreign)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        """``cp.lock`` held (:attr:`locks`), else nothing."""
        return contextlib.nullcontext() if self.locks is None else self.locks.checkpoint()

    @staticmethod
    def _undo_of(record: ClaimRecord) -> Sequence[UndoRecord]:
        try:
            return read_payload(record.payload).undo
        except ValueError:
            return ()

    # ---- changes (under the runner's lock; in memory) ----------------------------------------------------------
    def holds(self, uid: str) -> bool:
        """Whether the checkpoint names claim ``uid``."""
        return uid in self._entries

    def prepared(self, uid: str, claim: Claim | None, held: Sequence[HeldDevice], undo: Sequence[UndoRecord]) -> None:
        """Name claim ``uid`` as ``PrepareCompleted`` with its status (from ``claim``; rebuilt from ``held`` when
        ``None`` or not encodable), its ``held`` devices and what ``undo`` says was applied. Written by the next
        :meth:`flush`. Never raises: a claim this code cannot describe is named with its allocation rebuilt from
        ``held`` (what NVIDIA needs to refuse its devices), and the failure is logged."""
        try:
            entry = self._encode(uid, claim, held, undo)
        except Exception:
            log.exception("claim %s: cannot describe it in NVIDIA's checkpoint; named by its devices only", uid)
            entry = encode_entry(uid, CheckpointEntry(CheckpointState.PREPARE_COMPLETED, self._allocation(held)),
                                 self.schema)
        with self._mutex:
            self._entries[uid] = entry
            self._version += 1

    def prepared_again(self, claim: Claim, record: ClaimRecord | None) -> None:
        """A completed claim answered again from the claim state (the kubelet's retry): name it unless the
        checkpoint already does (a crash came between the claim state's commit and the checkpoint's flush). O(1)
        when it does."""
        if record is None or claim.ref.uid in self._entries:
            return
        self.prepared(claim.ref.uid, claim, held_devices(record), self._undo_of(record))

    def aborted(self, uid: str, namespace: str, name: str, at: float, status: Mapping[str, Any] | None = None,
                held: Sequence[HeldDevice] = ()) -> None:
        """Name claim ``uid`` as ``PrepareAborted`` with ``abortedAt`` ``at`` (Unix seconds): an unprepare came
        while its prepare was in progress, and NVIDIA's compute-domain plugin, started in dradriver's place, keeps
        refusing that prepare for the rest of the mark's TTL as dradriver does (it compares the entry's ``status``
        with the prepare's claim: ``status`` when the aborted prepare's claim was read, else the allocation rebuilt
        from ``held``, the devices of its STARTED record). A no-op for a plugin whose entries have no ``abortedAt``
        (the GPU plugin). Written by the next :meth:`flush`."""
        if not self.schema.aborted_at:
            return
        entry = self._encode_aborted(uid, namespace, name, at, status, held)
        with self._mutex:
            self._entries[uid] = entry
            self._version += 1

    def _encode_aborted(self, uid: str, namespace: str, name: str, at: float,
                        status: Mapping[str, Any] | None = None, held: Sequence[HeldDevice] = ()) -> EncodedEntry:
        # An entry always has an allocation (NVIDIA's prepare reads the allocation of every entry it compares).
        def entry(status: Mapping[str, Any]) -> EncodedEntry:
            return encode_entry(uid, CheckpointEntry(CheckpointState.PREPARE_ABORTED, status, name=name,
                                                     namespace=namespace, aborted_at=rfc3339(at)), self.schema)

        if status is not None and isinstance(status.get("allocation"), Mapping):
            try:
                return entry(status)
            except CheckpointError as exc:
                log.warning("claim %s: status not representable in NVIDIA's checkpoint (%s); its allocation "
                            "results are rebuilt from the held devices", uid, exc)
        return entry(self._allocation(held))

    def unprepared(self, uid: str) -> None:
        """Drop claim ``uid`` (also an entry another plugin wrote). Written by the next :meth:`flush`."""
        with self._mutex:
            if self._entries.pop(uid, None) is not None:
                self._version += 1

    # ---- the write ----------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Make every change made before this call durable: one whole-file rewrite, shared by concurrent callers
        (a caller whose changes another caller's rewrite already covered returns at once).

        :raises OSError: the file could not be written, or ``cp.lock`` is held past its bound (the changes stay
            pending; the next flush retries).
        """
        with self._mutex:
            wanted = self._version
        with self._write_lock:
            if self._written >= wanted:
                return
            with self._mutex:
                entries = dict(self._entries)
                version = self._version
            data = assemble(entries, self.boot_id)
            with self._locked():
                nvcheckpointfile.write_checkpoint(self.path, data)
                self._written = version
                try:  # what dradriver wrote, so that the next start can tell it from a file NVIDIA's plugin rewrote
                    nvcheckpointfile.mark_written(self.path, data)
                except OSError as exc:
                    log.warning("cannot record what was written to %s (%s): the next start compares its entries",
                                self.path, exc)
            self.writes += 1

    def flush_or_error(self) -> str:
        """:meth:`flush`; ``""`` when done, else why not (the answer the kubelet gets instead of success: it
        retries, and the retry flushes again)."""
        try:
            self.flush()
        except OSError as exc:
            log.error("NVIDIA-format checkpoint %s cannot be written: %s", self.path, exc)
            return f"cannot write NVIDIA's checkpoint {self.path} (kept for a rollback): {exc}"
        return ""

    # ---- encoding -----------------------------------------------------------------------------------------------
    def groups_of(self, record: ClaimRecord) -> tuple[DeviceGroup, ...]:
        """The device groups dradriver's entry of the claim ``record`` holds has (its devices in NVIDIA's layout
        and what its undo records say was set up), as :meth:`prepared` writes them: what an entry on disk is
        compared with to tell whether NVIDIA rewrote it (:func:`dradriver.kubeletplugin.adoption.converge`)."""
        return self._groups(held_devices(record), self._undo_of(record))

    def _groups(self, held: Sequence[HeldDevice], undo: Sequence[UndoRecord]) -> tuple[DeviceGroup, ...]:
        created = {r.target: r.data for r in undo if r.kind == DYNAMIC_MIG and isinstance(r.data, Mapping)}
        devices = {h.device: self._device(h, created.get(h.device)) for h in held if h.request_names}
        return self.group(devices, undo)

    def _encode(self, uid: str, claim: Claim | None, held: Sequence[HeldDevice], undo: Sequence[UndoRecord],
                owner: tuple[str, str] = ("", "")) -> EncodedEntry:
        # name and namespace as NVIDIA's PrepareCompleted keeps them (its stale-claim cleanup reads them)
        namespace, name = (claim.ref.namespace, claim.ref.name) if claim is not None else owner
        groups = self._groups(held, undo)
        status = claim.status if claim is not None and claim.status is not None else None
        if status is not None:
            try:
                return encode_entry(uid, CheckpointEntry(CheckpointState.PREPARE_COMPLETED, status, groups,
                                                         name=name, namespace=namespace), self.schema)
            except CheckpointError as exc:  # the API server sent a field NVIDIA's types cannot hold
                log.warning("claim %s: status not representable in NVIDIA's checkpoint (%s); its allocation "
                            "results are rebuilt from the held devices", claim.ref if claim else uid, exc)
        return encode_entry(uid, CheckpointEntry(CheckpointState.PREPARE_COMPLETED, self._allocation(held), groups,
                                                 name=name, namespace=namespace), self.schema)

    def _device(self, held: HeldDevice, created: Mapping[str, Any] | None) -> PreparedDevice:
        """``held`` in NVIDIA's layout; ``created``: the dynamic MIG undo record's data when the claim created the
        MIG device (its GPU and compute instance IDs, as NVIDIA's ``mig.concrete`` of a dynamic MIG device)."""
        kubelet = KubeletDevice(requests=tuple(held.request_names), pool_name=held.pool, device_name=held.device,
                                cdi_device_ids=tuple(held.cdi_device_ids), share_id=held.share_id)
        if created is not None:
            return PreparedDevice("mig", kubelet, mig=MigConcrete.from_json(created))
        described = self.describe(held.device)
        if described is None:
            log.warning("device %s is not known on this node now; named in NVIDIA's checkpoint without its UUID",
                        held.device)
            return PreparedDevice("gpu", kubelet)
        return dataclasses.replace(described, device=kubelet)

    def _allocation(self, held: Sequence[HeldDevice]) -> dict[str, Any]:
        results: list[dict[str, Any]] = []
        for h in held:
            for request in h.request_names:
                result: dict[str, Any] = {"request": request, "driver": self.driver, "pool": h.pool,
                                          "device": h.device}
                if h.admin_access and not h.shared:
                    result["adminAccess"] = True
                if h.share_id:
                    result["shareID"] = h.share_id
                results.append(result)
        return {"allocation": {"devices": {"results": results}}}


def rfc3339(at: float) -> str:
    """Unix seconds -> RFC 3339 UTC in whole seconds (``2026-12-04T22:30:00Z``): the bytes Go writes for a
    ``metav1.Time`` and for a ``time.Time`` without fraction alike."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(at)))


def parse_rfc3339(text: str | None) -> int | None:
    """RFC 3339 UTC (``2026-12-04T22:30:00Z``, a fraction ignored) -> whole Unix seconds; ``None`` when absent or
    not that form."""
    if not text:
        return None
    try:
        return calendar.timegm(time.strptime(text.split(".")[0].rstrip("Z"), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _aborted_at(record: ClaimRecord) -> float | None:

    mark = aborted_mark(record)
    return None if mark is None else mark.aborted_at


def gpu_groups(devices: Mapping[str, PreparedDevice], undo: Sequence[UndoRecord]) -> tuple[DeviceGroup, ...]:
    """The GPU plugin's config groups: one per sharing step dradriver applied (its record's target names the group's
    devices) with what NVIDIA's unprepare must undo (``timeSliceApplied``; ``mpsControlDaemonID``: dradriver's MPS
    control daemons have NVIDIA's ID, Deployment name and host layout, so NVIDIA's unprepare stops them as
    dradriver's would), then one group of the devices no sharing step touched."""
    groups: list[DeviceGroup] = []
    left = dict(devices)
    for record in undo:
        data = record.data if isinstance(record.data, Mapping) else {}
        if record.kind == TimeSlicing.kind and data.get("gpus"):
            state = ConfigState(time_slice_applied=True)
        elif record.kind == MpsSharing.kind and data.get("id"):
            state = ConfigState(mps_control_daemon_id=str(data["id"]))
        else:
            continue
        members = tuple(left.pop(name) for name in record.target.split(",") if name in left)
        if members:
            groups.append(DeviceGroup(devices=members, config_state=state))
    if left or not groups:
        groups.append(DeviceGroup(devices=tuple(left.values())))
    return tuple(groups)


def describe_registered(registry: DeviceRegistry[Any]) -> DescribeDevice:
    """:data:`DescribeDevice` over this node's devices as discovered: a full GPU by its UUID, a MIG device by its
    parent (minor, UUID, PCI bus ID), GPU and compute instance IDs and UUID, a VFIO device by its UUID and PCI
    bus ID (``vfio.info``, which NVIDIA's unprepare reads to give the GPU back to ``nvidia``)."""

    def describe(name: str) -> PreparedDevice | None:
        device = registry.get(name)
        if isinstance(device, GpuDevice):
            return PreparedDevice("gpu", None, uuid=device.uuid)
        if isinstance(device, MigDevice):
            parent = device.parent
            return PreparedDevice("mig", None, mig=MigConcrete(
                parent_minor=parent.minor, gi_id=device.gi_id, ci_id=device.ci_id, mig_uuid=device.uuid,
                parent_uuid=parent.uuid, parent_pci_bus_id=parent.pci_bus_id))
        if isinstance(device, VfioDevice):  # NVIDIA's vfio.info: the VFIO device's UUID and its PCI address
            return PreparedDevice("vfio", None, uuid=device.uuid, pci_bus_id=device.function.address)
        return None

    return describe


def compute_domain_groups(devices: Mapping[str, PreparedDevice],
                          undo: Sequence[UndoRecord]) -> tuple[DeviceGroup, ...]:
    """The compute-domain plugin's config groups: one per channel or daemon config dradriver applied, its
    ``configState`` ``{Type: "channel" | "daemon", ComputeDomain: <ComputeDomain UID>}`` as NVIDIA's
    ``DeviceConfigState`` (its ``ComputeDomainChannelType`` / ``ComputeDomainDaemonType``): NVIDIA's unprepare
    of a ``channel`` group removes the node label ``resource.nvidia.com/computeDomain`` when it names that
    ComputeDomain, as dradriver's does; then one group of the devices no config touched."""
    groups: list[DeviceGroup] = []
    left = dict(devices)
    for record in undo:
        data = record.data if isinstance(record.data, Mapping) else {}
        kind = {CHANNEL_KIND: "channel", DAEMON_KIND: "daemon"}.get(record.kind)
        if kind is None or record.target not in left:
            continue
        groups.append(DeviceGroup(devices=(left.pop(record.target),),
                                  config_state=ConfigState(type=kind, compute_domain=str(data.get("domain") or ""))))
    if left or not groups:
        groups.append(DeviceGroup(devices=tuple(left.values())))
    return tuple(groups)


def describe_channel(name: str) -> PreparedDevice | None:
    """:data:`DescribeDevice` of the compute-domain plugin: ``channel-<id>`` -> ``channel.info.id``,
    ``daemon-<id>`` -> ``daemon.info.id`` (the names NVIDIA publishes, so the ID is in the name)."""
    for kind, prefix in (("channel", CHANNEL_PREFIX), ("daemon", "daemon-")):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return PreparedDevice(kind, None, id=int(name[len(prefix):]))
    return None


def open_rollback_checkpoint(identity: DriverIdentity, plugin_dir: Path, boot_id_path: Path,
                             registry: DeviceRegistry[Any] | None = None) -> RollbackCheckpoint:
    """The rollback checkpoint ``<plugin dir>/checkpoint.json`` of the plugin ``identity`` names (load it with
    :meth:`RollbackCheckpoint.load` once recovery has run): the GPU plugin's (devices described from
    ``registry``) or the compute-domain plugin's (:data:`~dradriver.domain.nvcheckpoint.CD_CLAIM`, channel and
    daemon devices, :func:`compute_domain_groups`, ``PrepareAborted`` marks); its writes hold the directory's
    ``cp.lock``."""
    path = plugin_dir / nvcheckpointfile.CHECKPOINT_FILE
    boot_id = read_boot_id(boot_id_path)
    locks = PluginLocks(plugin_dir)
    if identity.driver_name == COMPUTE_DOMAIN_DRIVER.driver_name:
        return RollbackCheckpoint(path, boot_id=boot_id, driver=identity.driver_name, describe=describe_channel,
                                  schema=CD_CLAIM, group=compute_domain_groups, locks=locks)
    if registry is None:
        raise ValueError(f"the rollback checkpoint of {identity.driver_name} needs the device registry")
    return RollbackCheckpoint(path, boot_id=boot_id, driver=identity.driver_name,
                              describe=describe_registered(registry), locks=locks)
