"""Switching in without draining: adopt the claims NVIDIA's kubelet plugin prepared, from its ``checkpoint.json``.

NVIDIA's plugin and dradriver share the driver names, plugin directory, CDI spec names
(``k8s.gpu.nvidia.com-claim_<uid>.yaml``) and device names (``Device.DeviceName``). What dradriver lacks after a
switch is which claims are prepared and what was set up for them; NVIDIA's checkpoint says both (format:
:mod:`dradriver.domain.nvcheckpoint`; NVIDIA's ``device_state.go`` in kubernetes-sigs/dra-driver-nvidia-gpu).

Which entries are NVIDIA's: dradriver's own rollback checkpoint (:mod:`dradriver.kubeletplugin.rollback`) names
exactly the claims dradriver's claim state holds, so an entry whose claim UID the claim state does not hold was
written by NVIDIA's plugin. NVIDIA's boot-ID rule applies: a checkpoint of another boot is ignored (nothing
survived the reboot); an empty boot ID is taken as this boot's.

The generic part serves both plugins (the compute-domain plugin's mapping is
:mod:`dradriver.kubeletplugin.cdadoption`): the reader (:func:`read_nvidia_claims`), the switching-back-and-forth
rule (:func:`converge`: whichever driver ran last is the truth; a claim NVIDIA unprepared while dradriver was away
is forgotten, one it prepared again under the same UID is adopted from its newer entry), the store of one claim
(:func:`store_adopted`: a claim that cannot be held, such as a device another claim holds exclusively, is reported
and not adopted, and never stops the start) and the report (:class:`AdoptionReport`). :class:`GpuAdoption` maps the
GPU plugin's entries to dradriver's own claim records and undo records, so that dradriver's normal Unprepare undoes
NVIDIA's side effects. The caller (the plugin's start, before recovery) writes them into the claim state.

Half-prepared claims (``PrepareStarted``), one rule for both plugins: dradriver adopts the entry as a
PREPARE_STARTED claim and its recovery rolls it back as NVIDIA would; once it has, the entry leaves the rollback
checkpoint (:meth:`~dradriver.kubeletplugin.rollback.RollbackCheckpoint.load` is given the adopted started claims
as ``rolled_back``), since the driver that ran last rolled it back and NVIDIA, back on the node, has nothing left
to roll back. An entry dradriver did not adopt (a device another claim holds, an entry it cannot read) stays in
the rollback checkpoint as NVIDIA wrote it, so that NVIDIA's plugin, back on the node, still rolls it back.

Fields read from an entry beyond its devices: ``status.allocation.devices.results[].adminAccess`` (an admin-access
device is held shared, as NVIDIA's overlap check exempts it), the results themselves for a ``PrepareStarted``
entry without ``preparedDevices`` (NVIDIA writes ``PrepareStarted`` with ``status``, ``name`` and ``namespace``
only), and the opaque configs (a time-sliced group without ``timeSliceApplied`` is of a release before that flag,
whose time-slice NVIDIA's unprepare resets). Left as they are: ``mpsApplied`` (NVIDIA's unprepare does not read
it), the kubelet ``Device``'s ``PoolName`` (this node's pool is used) and ``Metadata`` (KEP-5304 files are
dradriver's own), and ``parentPCIBusID`` (the MIG device is found by its parent's UUID).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.domain import configs as device_configs
from dradriver.domain import featuregates
from dradriver.domain.claims import Claim, ClaimError, ClaimRef, claim_from_object
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.migplacements import MigPlacement
from dradriver.domain.nvcheckpoint import (
    GPU_CLAIM,
    CheckpointEntry,
    CheckpointError,
    CheckpointState,
    ClaimSchema,
    DeviceGroup,
    PreparedDevice,
)
from dradriver.domain.passthrough import NVIDIA_DRIVER, VfioDevice, normalize_pci_address, vfio_uuid
from dradriver.domain.ports import UndoRecord
from dradriver.host import nvcheckpointfile
from dradriver.host.claimstate import (
    ClaimConflictError,
    ClaimPhase,
    ClaimRecord,
    ClaimRecordError,
    ClaimState,
    HeldDevice,
)
from dradriver.preparers.dynamicmig import KIND as DYNAMIC_MIG
from dradriver.preparers.dynamicmig import UNDO_VERSION as DYNAMIC_MIG_VERSION
from dradriver.preparers.mps import MpsSharing
from dradriver.preparers.sharing import UNDO_VERSION as SHARING_VERSION
from dradriver.preparers.sharing import TimeSlicing
from dradriver.preparers.vfio import KIND as VFIO_KIND
from dradriver.preparers.vfio import UNDO_VERSION as VFIO_VERSION

__all__ = ["AdoptionReport", "Convergence", "ForeignClaims", "GpuAdoption", "OwnGroups", "adopt_nvidia_claims",
           "converge", "describe_claim", "read_nvidia_claims", "store_adopted"]

log = logging.getLogger(__name__)

SOURCE = "nvidia-checkpoint"
"""The ``source`` label of ``dradriver_adopted_claims_total`` for claims adopted from NVIDIA's checkpoint."""


@dataclass(frozen=True, slots=True)
class ForeignClaims:
    """What NVIDIA's checkpoint says that dradriver's claim state does not.

    :param entries: claim UID -> NVIDIA's entry, for every claim the claim state does not hold.
    :param named: every claim UID the checkpoint names (NVIDIA's and dradriver's).
    :param found: a checkpoint of this boot was read (``False``: no file, or one of another boot).
    :param stored: claim UID -> entry, for every claim the checkpoint names (those the claim state holds too).
    :param ours: the file is byte for byte what dradriver last wrote there
        (:func:`~dradriver.host.nvcheckpointfile.written_by_dradriver`): no other plugin wrote it since.
    """

    entries: Mapping[str, CheckpointEntry] = field(default_factory=dict)
    named: frozenset[str] = frozenset()
    found: bool = False
    stored: Mapping[str, CheckpointEntry] = field(default_factory=dict)
    ours: bool = False


def read_nvidia_claims(path: Path, *, boot_id: str, held: Set[str], schema: ClaimSchema = GPU_CLAIM) -> ForeignClaims:
    """The entries of NVIDIA's checkpoint at ``path`` whose claim UID is not in ``held`` (the claim state's UIDs).

    :param boot_id: this node's boot ID; a checkpoint with another non-empty ``nodeBootID`` yields nothing.
    :raises CheckpointError: the file is damaged or of an unknown version (never guessed at; the caller keeps the
        claims from their CDI specs as damage).
    :raises OSError: the file exists but cannot be read.
    """
    read = nvcheckpointfile.read_checkpoint_and_mark(path, schema)
    if read is None:
        return ForeignClaims()
    stored, ours = read
    if stored.node_boot_id not in ("", boot_id):
        log.info("NVIDIA's checkpoint %s is of boot %s, not this boot %s: nothing adopted", path,
                 stored.node_boot_id, boot_id)
        return ForeignClaims()
    return ForeignClaims({uid: e for uid, e in stored.claims.items() if uid not in held},
                         frozenset(stored.claims), True, dict(stored.claims),
                         ours)


OwnGroups = Callable[[ClaimRecord], tuple[DeviceGroup, ...]]
"""A claim dradriver holds -> the device groups its own entry in the rollback checkpoint has
(:meth:`dradriver.kubeletplugin.rollback.RollbackCheckpoint.groups_of`)."""


@dataclass(frozen=True, slots=True)
class Convergence:
    """What :func:`converge` decided: whichever driver ran last is the truth.

    :param entries: claim UID -> NVIDIA's entry to adopt: the claims the claim state does not hold, and those
        NVIDIA unprepared and prepared again under the same UID (``replaced``).
    :param dropped: claims the claim state held as prepared that NVIDIA unprepared (forgotten, nothing undone).
    :param replaced: claims the claim state held whose entry NVIDIA rewrote (its record is forgotten, nothing
        undone; NVIDIA's newer entry is adopted instead).
    :param unflushed: entries of claims dradriver unprepared before it was stopped, left in a checkpoint it wrote
        last (not adopted; their entries leave the rollback checkpoint, ``RollbackCheckpoint.load``'s
        ``rolled_back``).
    """

    entries: Mapping[str, CheckpointEntry]
    dropped: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    unflushed: tuple[str, ...] = ()


def _setup(groups: Sequence[DeviceGroup], *, instances: bool = True) -> tuple[str, ...]:
    """What a prepare set up, as the entry's groups say it, in a form two entries are compared by: each group's
    ``configState`` and, per device, its kubelet ``Device`` (requests, name, CDI device IDs, share ID), channel or
    daemon ID and, with ``instances``, its kind and MIG instance (parent, GPU and compute instance IDs, MIG UUID).
    Facts of the hardware that no prepare changes (``gpu.info.uuid``, ``parentPCIBusID``, the pool) and the
    ``Metadata`` are left out, so a device dradriver cannot describe now does not look like a new prepare."""
    out: list[str] = []
    for group in groups:
        devices = []
        for d in group.devices:
            kubelet = d.device
            mig = d.mig if instances else None
            devices.append(repr((d.kind if instances else "", d.id,
                                 None if kubelet is None else (tuple(kubelet.requests), kubelet.device_name,
                                                               tuple(kubelet.cdi_device_ids), kubelet.share_id),
                                 None if mig is None else (mig.parent_uuid, mig.parent_minor, mig.gi_id, mig.ci_id,
                                                           mig.mig_uuid))))
        out.append(repr((group.config_state, tuple(sorted(devices)))))
    return tuple(sorted(out))


def _same_setup(stored: Sequence[DeviceGroup], own: Sequence[DeviceGroup]) -> bool:
    """Whether the entry on disk (``stored``) sets up what dradriver's entry of the record (``own``) does; where
    dradriver cannot describe one of its devices now (a full GPU without its UUID: the device is not known at this
    start, such as with the driver away), kinds and MIG instances are not compared."""
    described = all(d.kind != "gpu" or d.uuid for g in own for d in g.devices)
    return _setup(stored, instances=described) == _setup(own, instances=described)


def converge(state: ClaimState, foreign: ForeignClaims, *, spec_of: Callable[[str], Path],
             own_groups: OwnGroups | None) -> Convergence:
    """The switching-back-and-forth rule of both kubelet plugins (under ``state.locked()``, before the claims of
    ``foreign`` are adopted): whichever driver ran last is the truth. When ``foreign`` is a checkpoint of this
    boot, for each claim ``state`` holds as PREPARE_COMPLETED:

    * the checkpoint no longer names it and its CDI spec (``spec_of(uid)``) is gone: NVIDIA's plugin unprepared it
      while dradriver was away. Forgotten, nothing undone (NVIDIA's unprepare undid it), never brought back from
      dradriver's older claim state;
    * the checkpoint names it with an entry dradriver did not write (``own_groups`` given, the rollback checkpoint
      kept): not ``PrepareCompleted`` (dradriver writes ``PrepareStarted`` for no claim, and ``PrepareAborted``
      only for a claim it holds as started), or its groups set up something else than dradriver's entry of the
      record says (:func:`_same_setup`; NVIDIA always writes ``preparedDevices`` in a completed entry, dradriver
      leaves them out only for a claim it could not describe). NVIDIA unprepared the claim and prepared it again
      under the same UID: its newer entry wins. The record is forgotten, nothing undone, and the entry is adopted
      like NVIDIA's others.

    An entry the claim state does not hold, in a file byte for byte what dradriver last wrote (``foreign.ours``),
    whose claim has an unprepare tombstone (:meth:`~dradriver.host.claimstate.ClaimState.unprepared_at`) is not
    adopted: dradriver's unprepare removed the claim from its state and was stopped (SIGKILL) before it rewrote the
    checkpoint.

    Without ``own_groups`` (``--nvidia-checkpoint=false``: dradriver writes no checkpoint, so an entry naming one of
    its claims cannot be told from NVIDIA's) only the first rule applies; nor does the second when the file is
    byte for byte what dradriver last wrote (``foreign.ours``): no other plugin wrote it since, so every entry is
    dradriver's own, whatever this release would write for the record now (a restart after an upgrade that changed
    how entries are grouped must not take dradriver's claims for NVIDIA's and forget their undo).

    :raises ClaimStateError: a record could not be removed.
    """
    entries = dict(foreign.entries)
    dropped: list[str] = []
    replaced: list[str] = []
    unflushed: list[str] = []
    if not foreign.found:
        return Convergence(entries)
    if foreign.ours:
        for uid in sorted(entries):
            if state.unprepared_at(uid) is not None:
                unflushed.append(uid)
                # dradriver unprepared it (its tombstone) and was stopped before the checkpoint's rewrite: no other
                # plugin wrote the file since, so the entry is dradriver's own leftover, not NVIDIA's claim
                del entries[uid]
                log.info("claim %s: unprepared by dradriver before it stopped, while NVIDIA's checkpoint still named "
                         "it (the rewrite did not happen); not adopted", uid)
    for uid, record in state.claims().items():
        if record.phase is not ClaimPhase.PREPARE_COMPLETED:
            continue
        entry = foreign.stored.get(uid)
        if entry is None:
            if not spec_of(uid).exists():
                state.remove(uid)
                dropped.append(uid)
                log.warning("claim %s: unprepared by NVIDIA's plugin while dradriver was away (its checkpoint no "
                            "longer names it and its CDI spec is gone); forgotten, nothing undone", record.ref)
            continue
        if own_groups is None or foreign.ours:
            continue
        if entry.state is CheckpointState.PREPARE_COMPLETED and (
                not entry.groups or _same_setup(entry.groups, own_groups(record))):
            continue  # dradriver's own entry (one without groups: a claim it could not describe, named by devices)
        state.remove(uid)
        replaced.append(uid)
        entries[uid] = entry
        log.warning("claim %s: prepared again by NVIDIA's plugin while dradriver was away (its checkpoint entry, %s, "
                    "is not the one dradriver wrote); dradriver's older record is forgotten, nothing undone, and "
                    "NVIDIA's entry is adopted", record.ref, entry.state.value)
    return Convergence(entries, tuple(dropped), tuple(replaced), tuple(unflushed))


@dataclass(frozen=True, slots=True)
class AdoptedClaim:
    """One NVIDIA claim as dradriver's claim state keeps it: held devices, undo records, pins (device -> UUID)."""

    held: tuple[HeldDevice, ...]
    undo: tuple[UndoRecord, ...]
    pins: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class AdoptionReport:
    """What an adoption (:func:`adopt_nvidia_claims`, the compute-domain plugin's
    :func:`~dradriver.kubeletplugin.cdadoption.adopt_compute_domain_claims`) did (claim UIDs).

    :param adopted: ``PrepareCompleted`` claims now held as PREPARE_COMPLETED.
    :param started: ``PrepareStarted`` claims stored as PREPARE_STARTED with their undo records, so that recovery
        rolls them back as NVIDIA would (undo what was applied, delete the spec); their entries leave the rollback
        checkpoint once recovery has (``RollbackCheckpoint.load``'s ``rolled_back``).
    :param dropped: claims dradriver's state held as prepared that NVIDIA unprepared while it ran (its checkpoint no
        longer names them and their spec is gone): forgotten, nothing undone.
    :param replaced: claims dradriver's state held that NVIDIA prepared again under the same UID: NVIDIA's newer
        entry was adopted in place of dradriver's older record (:func:`converge`).
    :param refused: ``(claim UID, why)`` of NVIDIA's claims that were not adopted (a device another claim holds;
        an entry that cannot be stored): the start goes on, their entries stay in the rollback checkpoint for
        NVIDIA, and their CDI specs are left to recovery (as orphan specs, kept as damage).
    :param aborted: compute-domain plugin: ``PrepareAborted`` claims now dradriver's aborted marks.
    :param problem: why the checkpoint was not used (damaged, unknown version), else ``""``.
    :param unflushed: claims dradriver unprepared before it was stopped whose entries its last rewrite of the
        checkpoint still had (:attr:`Convergence.unflushed`): not adopted, their entries to leave the checkpoint.
    """

    adopted: tuple[str, ...] = ()
    started: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()
    aborted: tuple[str, ...] = ()
    problem: str = ""
    unflushed: tuple[str, ...] = ()


def store_adopted(state: ClaimState, uid: str, entry: CheckpointEntry, held: Sequence[HeldDevice],
                  payload: str) -> str:
    """Write one of NVIDIA's claims into ``state`` (under its lock): PREPARE_STARTED with ``held`` and ``payload``,
    then PREPARE_COMPLETED when the entry is ``PrepareCompleted``. Returns ``""``, or why it was not stored (a
    device another claim holds exclusively, named with that claim; a field the claim state cannot store): then
    nothing of it is in ``state``, and the caller reports it (never raises for one claim, so a start is never
    stopped by one claim's entry)."""
    try:
        state.prepare_started(uid, namespace=entry.namespace, name=entry.name, devices=held, payload=payload)
    except (ClaimConflictError, ClaimRecordError) as exc:
        log.error("claim %s in NVIDIA's checkpoint is not adopted: %s", describe_claim(uid, entry), exc)
        return str(exc)
    if entry.state is CheckpointState.PREPARE_COMPLETED:
        state.prepare_completed(uid)
        log.info("claim %s: adopted from NVIDIA's checkpoint, devices %s", describe_claim(uid, entry),
                 ", ".join(h.device for h in held) or "-")
    return ""


_INFERENCE_GATES = featuregates.parse_feature_gates("TimeSlicingSettings=true,MPSSupport=true")
"""The gates a claim's configs are read under to tell what NVIDIA may have applied (a strategy is then known
whichever gates NVIDIA's plugin ran with)."""


class GpuAdoption:
    """Maps a ``gpu.nvidia.com`` entry to dradriver's records (pure but for the device lookup).

    :param pool: this node's pool (its node name).
    :param lookup: DRA device name -> the device this node publishes (registry ``get``), or ``None``.
    :param driver: the DRA driver name whose allocation results are this plugin's (``gpu.nvidia.com``).
    """

    def __init__(self, pool: str, lookup: Callable[[str], object | None], driver: str = GPU_DRIVER.driver_name) -> None:
        self.pool = pool
        self.lookup = lookup
        self.driver = driver

    def claim(self, entry: CheckpointEntry, uid: str = "") -> AdoptedClaim:
        """The devices, undo records and pins of ``entry``: a device record per prepared device (``gpu`` ``{}``; a
        static MIG device's identity; a dynamic MIG device's ``dynamic-mig`` record, whose undo destroys that GPU
        and compute instance) then one sharing record per config group that NVIDIA applied (``timeslicing`` with
        its GPUs, whose undo resets the time-slice to Default as NVIDIA's unprepare does; ``mps`` with the control
        daemon ID, whose undo deletes Deployment ``mps-control-daemon-<id>`` and its host directories).

        From the entry's ``status.allocation`` (NVIDIA's ``device_state.go`` reads it the same way): a device whose
        allocation result has ``adminAccess`` is held as admin access (shared with the claims that use the GPU, as
        NVIDIA's overlap check exempts it); a group without ``timeSliceApplied`` whose devices the claim's config
        time-slices was prepared by a release before that flag, and NVIDIA's unprepare resets the time-slice when
        the flag is absent, so dradriver's does too (NVIDIA writes the flag only as ``true``). A ``PrepareStarted``
        entry in NVIDIA's shape (``status``, ``name``, ``namespace``; no ``preparedDevices``, written before any
        device is prepared) holds the devices of its allocation results, with a ``timeslicing`` record for the
        full GPUs its config time-slices (NVIDIA may have set it before it stopped); the MIG devices NVIDIA may
        have created for it are owned by no record, so recovery's dynamic-MIG sweep destroys them as NVIDIA's
        rollback would. ``uid`` names the claim in messages.
        """
        allocation = self._allocation(entry, uid)
        admin = {(r.request, r.device) for r in allocation.results if r.admin_access} if allocation else set()
        sliced = self._time_sliced(allocation)
        held: list[HeldDevice] = []
        devices: list[UndoRecord] = []
        sharing: list[UndoRecord] = []
        pins: dict[str, str] = {}
        for group in entry.groups:
            names: list[str] = []
            gpus: list[str] = []
            for prepared in group.devices:
                if prepared.device is None:
                    continue
                name = prepared.device.device_name
                names.append(name)
                share_id = prepared.device.share_id
                held.append(HeldDevice(request_names=tuple(prepared.device.requests), pool=self.pool, device=name,
                                       cdi_device_ids=tuple(prepared.device.cdi_device_ids),
                                       admin_access=share_id is None and any(
                                           (request, name) in admin for request in prepared.device.requests),
                                       shared=share_id is not None, share_id=share_id))
                record, uuid = self._device_record(name, prepared)
                if record is not None:
                    devices.append(record)
                if uuid:
                    pins[name] = uuid
                if prepared.kind == "gpu" and prepared.uuid:
                    gpus.append(prepared.uuid)
            target = ",".join(names)
            state = group.config_state
            legacy = not state.time_slice_applied and bool(names) and all(n in sliced for n in names)
            if (state.time_slice_applied or legacy) and gpus:
                sharing.append(self._time_slicing(target, gpus))
            if state.mps_control_daemon_id:
                sharing.append(UndoRecord(MpsSharing.kind, MpsSharing.UNDO_VERSION, target,
                                          {"id": state.mps_control_daemon_id, "devices": names,
                                           "gpus": sorted(gpus)}))
        if not held and allocation is not None and entry.state is CheckpointState.PREPARE_STARTED:
            return self._started(allocation, sliced)
        return AdoptedClaim(tuple(held), (*devices, *sharing), pins)

    def _allocation(self, entry: CheckpointEntry, uid: str) -> Claim | None:
        """The entry's ``status`` as a claim (its allocation results of this driver and pool, its configs), or
        ``None`` when it has no allocation."""
        ref = ClaimRef(entry.namespace, entry.name, uid)
        try:
            return claim_from_object({"metadata": {"uid": uid, "namespace": entry.namespace, "name": entry.name},
                                      "status": entry.status}, ref, driver=self.driver, pool=self.pool)
        except ClaimError:
            return None

    def _time_sliced(self, allocation: Claim | None) -> dict[str, tuple[str, ...]]:
        """DRA device name -> the devices of its config group, for each device whose winning config (NVIDIA's
        selection, :func:`~dradriver.domain.configs.select_configs`) is a GpuConfig with strategy TimeSlicing;
        ``{}`` when the configs cannot be read or a device is not known here."""
        if allocation is None or not allocation.configs:
            return {}
        known: dict[str, Any] = {}
        for result in allocation.results:
            device = self.lookup(result.device)
            if not isinstance(device, GpuDevice | MigDevice | MigPlacement):
                return {}
            known[result.device] = device
        try:
            selection = device_configs.select_configs(allocation, known, _INFERENCE_GATES)
        except ClaimError as exc:
            log.warning("claim %s: its configs in NVIDIA's checkpoint cannot be read (%s); no time-slice is assumed",
                        allocation.ref, exc)
            return {}
        out: dict[str, tuple[str, ...]] = {}
        for group in selection.groups:
            config = group.config
            if isinstance(config, device_configs.GpuConfig) and config.sharing is not None \
                    and config.sharing.strategy == device_configs.TIME_SLICING:
                for name in group.devices:
                    out[name] = group.devices
        return out

    @staticmethod
    def _time_slicing(target: str, gpus: Sequence[str]) -> UndoRecord:
        return UndoRecord(TimeSlicing.kind, SHARING_VERSION, target,
                          {"gpus": [{"uuid": u, "timesliceSet": True} for u in sorted(gpus)]})

    def _started(self, allocation: Claim, sliced: Mapping[str, tuple[str, ...]]) -> AdoptedClaim:
        """A ``PrepareStarted`` entry without devices: what its allocation results say (see :meth:`claim`)."""
        held = tuple(HeldDevice(request_names=(r.request,), pool=self.pool, device=r.device,
                                admin_access=r.admin_access and r.share_id is None, shared=r.share_id is not None,
                                share_id=r.share_id) for r in allocation.results)
        undo: list[UndoRecord] = []
        for group in dict.fromkeys(sliced.values()):
            gpus = [d.uuid for d in map(self.lookup, group) if isinstance(d, GpuDevice)]
            if gpus:
                undo.append(self._time_slicing(",".join(group), gpus))
        return AdoptedClaim(held, tuple(undo), {})

    def _device_record(self, name: str, prepared: PreparedDevice) -> tuple[UndoRecord | None, str]:
        """The device preparer's record for ``name`` and its pin (UUID), as dradriver's preparer would write it;
        a VFIO passthrough device's from its ``vfio.info`` (:meth:`_vfio_record`: its unprepare gives the GPU back
        to ``nvidia``); no record for a MIG device without ``mig.concrete`` (NVIDIA always writes it; without it
        dradriver does not know which instance is the claim's: held, its instance left as it is, with a
        warning)."""
        if prepared.kind == "gpu":
            return UndoRecord("gpu", 1, name, {}), prepared.uuid
        if prepared.kind == "vfio":
            return self._vfio_record(name, prepared)
        mig = prepared.mig
        if prepared.kind == "mig" and mig is None:
            log.warning("MIG device %s adopted from NVIDIA's checkpoint without its mig.concrete: held, and its GPU "
                        "and compute instance are left as they are at unprepare (the entry does not say which they "
                        "are)", name)
            return None, ""
        if mig is None:
            log.warning("device %s (%s) adopted from NVIDIA's checkpoint: dradriver's unprepare leaves what NVIDIA "
                        "set up for it (its vfio-pci binding) as it is", name, prepared.kind)
            return None, ""
        known = self.lookup(name)
        if isinstance(known, MigPlacement):  # NVIDIA created this MIG device for the claim: destroy it at unprepare
            return UndoRecord(DYNAMIC_MIG, DYNAMIC_MIG_VERSION, name, {
                "parentUUID": mig.parent_uuid, "parentMinor": mig.parent_minor, "giId": mig.gi_id,
                "ciId": mig.ci_id, "migUUID": mig.mig_uuid, "giProfileId": known.gi_profile_id,
                "profile": known.profile, "placementStart": known.placement_start,
                "placementSize": known.placement_size, "migModeEnabled": False}), mig.mig_uuid
        data: dict[str, Any] = {"parentUUID": mig.parent_uuid, "giId": mig.gi_id, "ciId": mig.ci_id,
                                "migUUID": mig.mig_uuid}
        if isinstance(known, MigDevice):
            data.update(giProfileId=known.gi_profile_id, placementStart=known.placement_start,
                        placementSize=known.placement_size)
        return UndoRecord("mig", 1, name, data), mig.mig_uuid


    def _vfio_record(self, name: str, prepared: PreparedDevice) -> tuple[UndoRecord | None, str]:
        """The VFIO preparer's record of a device NVIDIA bound to its vfio driver (NVIDIA's ``vfio.info``:
        ``uuid``, the VFIO device's, and ``pciBusID``; kubernetes-sigs/dra-driver-nvidia-gpu
        ``cmd/gpu-kubelet-plugin/checkpoint.go``), with what this node's devices add (IOMMU group, the GPU's minor
        and UUID where known); pinned to the VFIO UUID. Without a PCI bus ID the device is held and left as it is
        at unprepare, with a warning."""
        address = normalize_pci_address(prepared.pci_bus_id) if prepared.pci_bus_id else ""
        known = self.lookup(name)
        if not address and isinstance(known, VfioDevice):
            address = known.function.address
        if not address:
            log.warning("VFIO device %s adopted from NVIDIA's checkpoint without its vfio.info.pciBusID: held, and its "
                        "GPU is left on its vfio driver at unprepare", name)
            return None, prepared.uuid
        data: dict[str, Any] = {"address": address, "originalDriver": NVIDIA_DRIVER, "vfioDriver": None,
                                "vfioModule": None, "minor": None, "uuid": None, "cdev": None, "steps": [],
                                "adopted": True}
        if isinstance(known, VfioDevice) and known.function.address == address:
            data.update(iommuGroup=known.function.iommu_group, vfioDriver=known.function.driver,
                        minor=known.parent_minor, uuid=known.parent_uuid, cdev=known.function.vfio_cdev)
        return UndoRecord(VFIO_KIND, VFIO_VERSION, name, data), prepared.uuid or vfio_uuid(address)


def describe_claim(uid: str, entry: CheckpointEntry | None = None, namespace: str = "", name: str = "") -> str:
    """``<namespace>/<name> (<uid>)``, or the UID alone where the entry does not name the claim (``name`` and
    ``namespace`` are ``omitempty``; NVIDIA's plugin at kubernetes-sigs/dra-driver-nvidia-gpu 95932046 left them
    empty)."""
    if entry is not None:
        namespace, name = entry.namespace, entry.name
    return f"{namespace}/{name} ({uid})" if name else uid


def adopt_nvidia_claims(state: ClaimState, path: Path, *, boot_id: str, adoption: GpuAdoption,
                        encode_payload: Callable[[str, Sequence[UndoRecord], Mapping[str, str]], str],
                        spec_of: Callable[[str], Path], own_groups: OwnGroups | None = None) -> AdoptionReport:
    """At start, before recovery: write NVIDIA's claims into ``state`` (see the module docstring).

    ``PrepareCompleted`` -> PREPARE_COMPLETED with its devices (held, refused to other claims), undo records and
    pins; ``PrepareStarted`` -> PREPARE_STARTED with the undo records of what its entry says was applied (recovery
    rolls it back); what dradriver's state held that NVIDIA unprepared or prepared again converges on NVIDIA's
    (:func:`converge`, ``own_groups``: the rollback checkpoint's). A claim that cannot be stored (a device another
    claim holds) is not adopted and is named in ``refused``. Nothing is created or destroyed on the node here.

    :param encode_payload: ``(spec path, undo records, pins) -> payload`` (the runner's payload format).
    :raises OSError: the checkpoint exists but cannot be read.
    """
    with state.locked():
        try:
            foreign = read_nvidia_claims(path, boot_id=boot_id, held=set(state.claims()))
        except CheckpointError as exc:
            log.error("NVIDIA's checkpoint %s is not used (%s): its claims are kept from their CDI specs", path, exc)
            return AdoptionReport(problem=str(exc))
        converged = converge(state, foreign, spec_of=spec_of, own_groups=own_groups)
        adopted: list[str] = []
        started: list[str] = []
        refused: list[tuple[str, str]] = []
        for uid, entry in sorted(converged.entries.items()):
            if entry.state not in (CheckpointState.PREPARE_COMPLETED, CheckpointState.PREPARE_STARTED):
                continue
            try:
                claim = adoption.claim(entry, uid)
            except (ValueError, TypeError) as exc:
                log.error("claim %s in NVIDIA's checkpoint cannot be adopted (%s); its CDI spec decides", uid, exc)
                refused.append((uid, str(exc)))
                continue
            why = store_adopted(state, uid, entry, claim.held, encode_payload(str(spec_of(uid)), claim.undo,
                                                                              claim.pins))
            if why:
                refused.append((uid, why))
            elif entry.state is CheckpointState.PREPARE_COMPLETED:
                adopted.append(uid)
            else:
                started.append(uid)
    log.info("NVIDIA's checkpoint %s: %d claim(s) adopted, %d half-prepared to roll back, %d dropped (unprepared by "
             "NVIDIA), %d replaced (prepared again by NVIDIA), %d not adopted", path, len(adopted), len(started),
             len(converged.dropped), len(converged.replaced), len(refused))
    return AdoptionReport(tuple(adopted), tuple(started), converged.dropped, converged.replaced, tuple(refused),
                          unflushed=converged.unflushed)
