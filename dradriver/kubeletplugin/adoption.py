"""Switching in without draining: adopt the claims NVIDIA's kubelet plugin prepared, from its ``checkpoint.json``.

NVIDIA's plugin and dradriver share the driver names, plugin directory, CDI spec names
(``k8s.gpu.nvidia.com-claim_<uid>.yaml``) and device names (``Device.DeviceName``). What dradriver lacks after a
switch is which claims are prepared and what was set up for them; NVIDIA's checkpoint says both (format:
:mod:`dradriver.domain.nvcheckpoint`; NVIDIA's ``device_state.go`` in kubernetes-sigs/dra-driver-nvidia-gpu).

Which entries are NVIDIA's: dradriver's own rollback checkpoint (:mod:`dradriver.kubeletplugin.rollback`) names
exactly the claims dradriver's claim state holds, so an entry whose claim UID the claim state does not hold was
written by NVIDIA's plugin. NVIDIA's boot-ID rule applies: a checkpoint of another boot is ignored (nothing
survived the reboot); an empty boot ID is taken as this boot's.

The generic part (:func:`read_nvidia_claims`) serves both plugins; :class:`GpuAdoption` maps the GPU plugin's
entries to dradriver's own claim records and undo records, so that dradriver's normal Unprepare undoes NVIDIA's
side effects. The caller (the plugin's start, before recovery) writes them into the claim state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.domain.devices import MigDevice
from dradriver.domain.migplacements import MigPlacement
from dradriver.domain.nvcheckpoint import (
    GPU_CLAIM,
    CheckpointEntry,
    CheckpointError,
    CheckpointState,
    ClaimSchema,
    PreparedDevice,
)
from dradriver.domain.ports import UndoRecord
from dradriver.host import nvcheckpointfile
from dradriver.host.claimstate import ClaimPhase, ClaimState, HeldDevice
from dradriver.preparers.dynamicmig import KIND as DYNAMIC_MIG
from dradriver.preparers.dynamicmig import UNDO_VERSION as DYNAMIC_MIG_VERSION
from dradriver.preparers.mps import MpsSharing
from dradriver.preparers.sharing import UNDO_VERSION as SHARING_VERSION
from dradriver.preparers.sharing import TimeSlicing

__all__ = ["AdoptionReport", "ForeignClaims", "GpuAdoption", "adopt_nvidia_claims", "describe_claim",
           "read_nvidia_claims"]

log = logging.getLogger(__name__)

SOURCE = "nvidia-checkpoint"
"""The ``source`` label of ``dradriver_adopted_claims_total`` for claims adopted from NVIDIA's checkpoint."""


@dataclass(frozen=True, slots=True)
class ForeignClaims:
    """What NVIDIA's checkpoint says that dradriver's claim state does not.

    :param entries: claim UID -> NVIDIA's entry, for every claim the claim state does not hold.
    :param named: every claim UID the checkpoint names (NVIDIA's and dradriver's).
    :param found: a checkpoint of this boot was read (``False``: no file, or one of another boot).
    """

    entries: Mapping[str, CheckpointEntry] = field(default_factory=dict)
    named: frozenset[str] = frozenset()
    found: bool = False


def read_nvidia_claims(path: Path, *, boot_id: str, held: Set[str], schema: ClaimSchema = GPU_CLAIM) -> ForeignClaims:
    """The entries of NVIDIA's checkpoint at ``path`` whose claim UID is not in ``held`` (the claim state's UIDs).

    :param boot_id: this node's boot ID; a checkpoint with another non-empty ``nodeBootID`` yields nothing.
    :raises CheckpointError: the file is damaged or of an unknown version (never guessed at; the caller keeps the
        claims from their CDI specs as damage).
    :raises OSError: the file exists but cannot be read.
    """
    stored = nvcheckpointfile.read_checkpoint(path, schema)
    if stored is None:
        return ForeignClaims()
    if stored.node_boot_id not in ("", boot_id):
        log.info("NVIDIA's checkpoint %s is of boot %s, not this boot %s: nothing adopted", path,
                 stored.node_boot_id, boot_id)
        return ForeignClaims()
    return ForeignClaims({uid: e for uid, e in stored.claims.items() if uid not in held},
                         frozenset(stored.claims), True)


@dataclass(frozen=True, slots=True)
class AdoptedClaim:
    """One NVIDIA claim as dradriver's claim state keeps it: held devices, undo records, pins (device -> UUID)."""

    held: tuple[HeldDevice, ...]
    undo: tuple[UndoRecord, ...]
    pins: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class AdoptionReport:
    """What :func:`adopt_nvidia_claims` did.

    :param adopted: ``PrepareCompleted`` claims now held as PREPARE_COMPLETED.
    :param started: ``PrepareStarted`` claims stored as PREPARE_STARTED with their undo records, so that recovery
        rolls them back as NVIDIA would (undo what was applied, delete the spec).
    :param dropped: claims dradriver's state held as prepared that NVIDIA unprepared while it ran (its checkpoint no
        longer names them and their spec is gone): forgotten, nothing undone.
    :param problem: why the checkpoint was not used (damaged, unknown version), else ``""``.
    """

    adopted: tuple[str, ...] = ()
    started: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    problem: str = ""


class GpuAdoption:
    """Maps a ``gpu.nvidia.com`` entry to dradriver's records (pure but for the device lookup).

    :param pool: this node's pool (its node name).
    :param lookup: DRA device name -> the device this node publishes (registry ``get``), or ``None``.
    """

    def __init__(self, pool: str, lookup: Callable[[str], object | None]) -> None:
        self.pool = pool
        self.lookup = lookup

    def claim(self, entry: CheckpointEntry) -> AdoptedClaim:
        """The devices, undo records and pins of ``entry``: a device record per prepared device (``gpu`` ``{}``; a
        static MIG device's identity; a dynamic MIG device's ``dynamic-mig`` record, whose undo destroys that GPU
        and compute instance) then one sharing record per config group that NVIDIA applied (``timeslicing`` with
        its GPUs, whose undo resets the time-slice to Default as NVIDIA's unprepare does; ``mps`` with the control
        daemon ID, whose undo deletes Deployment ``mps-control-daemon-<id>`` and its host directories)."""
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
                held.append(HeldDevice(request_names=tuple(prepared.device.requests), pool=self.pool, device=name,
                                       cdi_device_ids=tuple(prepared.device.cdi_device_ids),
                                       shared=prepared.device.share_id is not None,
                                       share_id=prepared.device.share_id))
                record, uuid = self._device_record(name, prepared)
                if record is not None:
                    devices.append(record)
                if uuid:
                    pins[name] = uuid
                if prepared.kind == "gpu" and prepared.uuid:
                    gpus.append(prepared.uuid)
            target = ",".join(names)
            state = group.config_state
            if state.time_slice_applied and gpus:
                sharing.append(UndoRecord(TimeSlicing.kind, SHARING_VERSION, target,
                                          {"gpus": [{"uuid": u, "timesliceSet": True} for u in sorted(gpus)]}))
            if state.mps_control_daemon_id:
                sharing.append(UndoRecord(MpsSharing.kind, MpsSharing.UNDO_VERSION, target,
                                          {"id": state.mps_control_daemon_id, "devices": names,
                                           "gpus": sorted(gpus)}))
        return AdoptedClaim(tuple(held), (*devices, *sharing), pins)

    def _device_record(self, name: str, prepared: PreparedDevice) -> tuple[UndoRecord | None, str]:
        """The device preparer's record for ``name`` and its pin (UUID), as dradriver's preparer would write it;
        no record for a VFIO passthrough device (dradriver has no VFIO preparer: the device stays held until
        unprepared, and its binding to ``vfio-pci`` is left as NVIDIA made it, with a warning)."""
        if prepared.kind == "gpu":
            return UndoRecord("gpu", 1, name, {}), prepared.uuid
        mig = prepared.mig
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


def describe_claim(uid: str, entry: CheckpointEntry | None = None, namespace: str = "", name: str = "") -> str:
    """``<namespace>/<name> (<uid>)``, or the UID alone where the entry does not name the claim (``name`` and
    ``namespace`` are ``omitempty``; NVIDIA's plugin at kubernetes-sigs/dra-driver-nvidia-gpu 95932046 left them
    empty)."""
    if entry is not None:
        namespace, name = entry.namespace, entry.name
    return f"{namespace}/{name} ({uid})" if name else uid


def adopt_nvidia_claims(state: ClaimState, path: Path, *, boot_id: str, adoption: GpuAdoption,
                        encode_payload: Callable[[str, Sequence[UndoRecord], Mapping[str, str]], str],
                        spec_of: Callable[[str], Path]) -> AdoptionReport:
    """At start, before recovery: write NVIDIA's claims into ``state`` (see the module docstring).

    ``PrepareCompleted`` -> PREPARE_COMPLETED with its devices (held, refused to other claims), undo records and
    pins; ``PrepareStarted`` -> PREPARE_STARTED with the undo records of what its entry says was applied (recovery
    rolls it back); a PREPARE_COMPLETED claim of ``state`` that the checkpoint no longer names and whose spec
    (``spec_of(uid)``) is gone was unprepared by NVIDIA: dropped, nothing undone. Nothing is created or destroyed on
    the node here.

    :param encode_payload: ``(spec path, undo records, pins) -> payload`` (the runner's payload format).
    :raises OSError: the checkpoint exists but cannot be read.
    """
    with state.locked():
        claims = state.claims()
        try:
            foreign = read_nvidia_claims(path, boot_id=boot_id, held=set(claims))
        except CheckpointError as exc:
            log.error("NVIDIA's checkpoint %s is not used (%s): its claims are kept from their CDI specs", path, exc)
            return AdoptionReport(problem=str(exc))
        adopted: list[str] = []
        started: list[str] = []
        dropped: list[str] = []
        if foreign.found:
            for uid, record in claims.items():
                if record.phase is ClaimPhase.PREPARE_COMPLETED and uid not in foreign.named \
                        and not spec_of(uid).exists():
                    state.remove(uid)
                    dropped.append(uid)
                    log.warning("claim %s: unprepared by NVIDIA's plugin while dradriver was away (its checkpoint no "
                                "longer names it and its CDI spec is gone); forgotten, nothing undone", record.ref)
        for uid, entry in sorted(foreign.entries.items()):
            if entry.state not in (CheckpointState.PREPARE_COMPLETED, CheckpointState.PREPARE_STARTED):
                continue
            try:
                claim = adoption.claim(entry)
            except (ValueError, TypeError) as exc:
                log.error("claim %s in NVIDIA's checkpoint cannot be adopted (%s); its CDI spec decides", uid, exc)
                continue
            state.prepare_started(uid, namespace=entry.namespace, name=entry.name, devices=claim.held,
                                  payload=encode_payload(str(spec_of(uid)), claim.undo, claim.pins))
            if entry.state is CheckpointState.PREPARE_COMPLETED:
                state.prepare_completed(uid)
                adopted.append(uid)
                log.info("claim %s: adopted from NVIDIA's checkpoint, devices %s", describe_claim(uid, entry),
                         ", ".join(h.device for h in claim.held) or "-")
            else:
                started.append(uid)
    log.info("NVIDIA's checkpoint %s: %d claim(s) adopted, %d half-prepared to roll back, %d dropped (unprepared by "
             "NVIDIA)", path, len(adopted), len(started), len(dropped))
    return AdoptionReport(tuple(adopted), tuple(started), tuple(dropped))

