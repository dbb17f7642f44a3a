"""The dynamic-MIG device preparer (``DynamicMIG`` gate): a GPU instance and its compute instance created at prepare,
at exactly the placement the scheduler allocated, and destroyed at unprepare.

Facts (NVIDIA's dynamic MIG, ``cmd/gpu-kubelet-plugin/nvlib.go``; ``nvml.h``; NVIDIA's MIG User Guide):

* prepare: MIG mode on if needed, ``nvmlDeviceCreateGpuInstanceWithPlacement`` at the allocated placement, then
  the full-GI compute instance; the CDI device is the parent's ``/dev/nvidia<minor>`` plus the GI and CI access
  capability nodes (``/dev/nvidia-caps/nvidia-cap<minor>`` for ``.../gpu<m>/mig/gi<g>/access`` and
  ``.../gi<g>/ci<c>/access``);
* unprepare: destroy the CI, then the GI; ``IN_USE`` fails it (the kubelet retries); on Hopper and newer MIG mode
  goes off when the GPU's last instance is gone; older GPUs stay in MIG mode (a reset would be needed).

Crash safety. The batch runner records the claim PREPARE_STARTED with its device names before :meth:`apply` runs;
a name is the placement (:func:`~dradriver.domain.devices.parse_placement_device_name`), so the intent is
durable before the first NVML call. :meth:`apply` returns an :class:`UndoRecord` holding the concrete identity
(parent UUID and minor, GI id, CI id, MIG UUID, placement), stored before the claim is answered. When a failure
leaves a GPU instance that cannot be destroyed, :class:`~dradriver.domain.ports.PartiallyApplied` carries a record
for it. A SIGKILL between any two NVML calls leaves at most an instance no stored record knows: at the next start
the runner rolls the STARTED claim back and :meth:`sweep` destroys every instance that no record owns, found by
placement (not by device name, so a bare GI without compute instance is found too, NVIDIA #1452), never on a GPU
where a process runs.

An instance found on the allocated placement at prepare (a crash's leftover, or created out of band) is reused
when it has the allocated profile and no process, destroyed when it overlaps with another profile and is idle and
owned by no claim, and otherwise fails the claim with the reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dradriver.domain.cdi import ContainerEdits
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef, base_request_name
from dradriver.domain.configs import ConfigGroup
from dradriver.domain.devices import GpuDevice, MigPlacement, parse_placement_device_name
from dradriver.domain.ports import DevicePlan, PartiallyApplied, UndoRecord
from dradriver.errors import DradriverError
from dradriver.host.devicenodes import DeviceNodeInfo, mig_instance_edits
from dradriver.nvml.discovery import is_dynamic_mig_capable
from dradriver.nvml.errors import NvmlError, NvmlGpuIsLost, NvmlInUse
from dradriver.nvml.mig import MigControl, MigInstance, MigModeError
from dradriver.preparers.gpu import StaticMigPreparer

log = logging.getLogger(__name__)

KIND = "dynamic-mig"
UNDO_VERSION = 1


class MigInUseError(DradriverError):
    """A MIG device cannot be destroyed: processes run on it (the unprepare is retried by the kubelet)."""


def identity_of(record: UndoRecord) -> dict[str, Any]:
    """The concrete identity a dynamic-MIG undo record holds, as published in ``ResourceClaim.status.devices[].data``
    (KEP-4817): ``uuid`` (MIG UUID), ``parentUUID``, ``gpuInstanceId``, ``computeInstanceId``, ``profile``,
    ``placement`` ``{start, size}``; ``{}`` for a record without compute instance."""
    data = record.data
    if data.get("ciId") is None:
        return {}
    return {
        "uuid": data["migUUID"],
        "parentUUID": data["parentUUID"],
        "gpuInstanceId": data["giId"],
        "computeInstanceId": data["ciId"],
        "profile": data.get("profile", ""),
        "placement": {"start": data["placementStart"], "size": data["placementSize"]},
    }


class DynamicMigPreparer:
    """Prepares :class:`~dradriver.domain.devices.MigPlacement` devices; kind ``dynamic-mig``.

    :param control: the NVML MIG operations (serialised per GPU).
    :param nodes: where device-node numbers are read.
    :param gpus: current GPUs (the device registry's snapshot), for undo and sweep, which work from records.
    :param on_change: called after instances were created or destroyed (the plugin re-reads its devices and
        replaces the device registry: health monitor and slice publisher follow).
    """

    kind = KIND
    side_effects = True
    owner_kinds = (StaticMigPreparer.kind,)
    """Other record kinds whose MIG instances this preparer's sweep and placement checks treat as owned: a static
    MIG claim prepared before the ``DynamicMIG`` gate was turned on holds an instance on a GPU dynamic MIG now
    manages (:meth:`sweep`)."""

    def __init__(self, control: MigControl, nodes: DeviceNodeInfo, gpus: Callable[[], Sequence[GpuDevice]],
                 on_change: Callable[[], None] | None = None) -> None:
        self.control = control
        self.nodes = nodes
        self.gpus = gpus
        self.on_change = on_change
        self._owned: dict[tuple[str, int], str] = {}
        """(parent UUID, GI id) -> target (device name) of every instance a stored or applied record owns."""
        self._owned_lock = threading.Lock()
        self._busy: dict[str, int] = {}
        """Parent UUID -> applies in progress on it."""

    # -- plan -------------------------------------------------------------------------------------------------

    def handles(self, device: object) -> bool:
        """True for dynamic-MIG placements."""
        return isinstance(device, MigPlacement)

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        """The placement to create and the requests it serves. Pure."""
        assert isinstance(device, MigPlacement)
        names = tuple(dict.fromkeys(base_request_name(r.request) for r in results))
        if any(r.admin_access for r in results):
            raise ClaimError(claim.ref, f"device {device.name!r}: adminAccess is not supported for dynamic MIG "
                                        "devices (the instance exists only while one claim holds it)")
        return DevicePlan(kind=self.kind, device=device.name, entry=device, request_names=names,
                          admin_access=False, results=tuple(results), group=group,
                          details={"profile": device.profile, "giProfileId": device.gi_profile_id,
                                   "start": device.placement_start, "size": device.placement_size})

    def identity_now(self, device: object) -> str | None:
        """The MIG UUID of the instance that exists on the placement ``device`` now (``None``: none, or NVML cannot
        tell): the batch runner checks a static MIG claim's pinned MIG UUID against it once its device name
        resolves to a placement (the ``DynamicMIG`` gate turned on while the claim was prepared)."""
        if not isinstance(device, MigPlacement):
            return None
        try:
            live = self.control.instances(device.parent)
        except NvmlError as exc:
            log.warning("GPU %s: cannot read its MIG instances: %s", device.parent.uuid, exc)
            return None
        return next((i.mig_uuid for i in live if i.mig_uuid and i.gi_profile_id == device.gi_profile_id
                     and i.placement_start == device.placement_start), None)

    # -- apply ------------------------------------------------------------------------------------------------

    def _gpu(self, uuid: str) -> GpuDevice | None:
        return next((g for g in self.gpus() if g.uuid == uuid), None)

    def _record(self, placement: MigPlacement, gi_id: int, ci_id: int | None, mig_uuid: str,
                mig_mode_enabled: bool) -> UndoRecord:
        gpu = placement.parent
        return UndoRecord(self.kind, UNDO_VERSION, placement.name, {
            "parentUUID": gpu.uuid, "parentMinor": gpu.minor, "giId": gi_id, "ciId": ci_id, "migUUID": mig_uuid,
            "giProfileId": placement.gi_profile_id, "profile": placement.profile,
            "placementStart": placement.placement_start, "placementSize": placement.placement_size,
            "migModeEnabled": mig_mode_enabled,
        })

    def _clear_placement(self, ref: ClaimRef, placement: MigPlacement) -> int | None:
        """Deal with instances already on the placement; returns the GI id to reuse, or None to create one."""
        gpu = placement.parent
        found = self.control.find_gpu_instance(gpu, placement.placement_start, placement.placement_size)
        reuse: int | None = None
        for gi_id in sorted({i.gi_id for i in found}):
            parts = [i for i in found if i.gi_id == gi_id]
            first = parts[0]
            where = (f"GPU instance {gi_id} (profile {first.gi_profile_id}, placement {first.placement_start}:"
                     f"{first.placement_size}) on GPU {gpu.uuid}")
            with self._owned_lock:
                owner = self._owned.get((gpu.uuid, gi_id))
            if owner is not None:
                raise ClaimError(ref, f"device {placement.name!r}: its placement is taken by {where}, prepared for "
                                      f"device {owner!r} of another claim")
            procs = sum(i.processes for i in parts)
            if procs:
                raise ClaimError(ref, f"device {placement.name!r}: its placement is taken by {where}, created "
                                      f"outside this driver and in use by {procs} process(es)")
            exact = (first.gi_profile_id == placement.gi_profile_id
                     and first.placement_start == placement.placement_start and len(parts) == 1)
            if exact and reuse is None:
                log.warning("claim %s: reusing idle %s found on the allocated placement of %s", ref, where,
                            placement.name)
                reuse = gi_id
                continue
            log.warning("claim %s: destroying idle %s that no claim owns: it overlaps the allocated placement of %s",
                        ref, where, placement.name)
            self.control.destroy(gpu, gi_id)
        return reuse

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        """Create the GPU instance at the plan's placement, then its compute instance.

        :raises ClaimError: the placement is taken by an instance in use or owned by another claim.
        :raises MigModeError: MIG mode cannot be turned on now (pending a GPU reset).
        :raises NvmlError: a create failed; nothing is left behind.
        :raises PartiallyApplied: the compute instance failed and the GPU instance could not be destroyed.
        """
        placement = plan.entry
        assert isinstance(placement, MigPlacement)
        gpu = placement.parent
        changed = False
        with self._owned_lock:  # applies in flight on a GPU keep another's failure from turning MIG mode off
            self._busy[gpu.uuid] = self._busy.get(gpu.uuid, 0) + 1
        try:
            try:
                enabled = self.control.ensure_mig_enabled(gpu.uuid)
            except MigModeError as exc:
                raise MigModeError(f"device {placement.name!r}: {exc}") from exc
            changed = enabled
            try:
                gi_id = self._clear_placement(claim, placement)
                if gi_id is None:
                    gi_id = self.control.create_gpu_instance(placement)
                    changed = True
            except Exception:
                if enabled:
                    self._disable_quietly(gpu, leaving=True)
                raise
            with self._owned_lock:
                self._owned[(gpu.uuid, gi_id)] = placement.name
            try:
                ci_id, mig_uuid = self.control.create_compute_instance(placement, gi_id)
            except Exception as exc:
                self._take_back(claim, placement, gi_id, enabled, exc)
                raise
            changed = True
            record = self._record(placement, gi_id, ci_id, mig_uuid, enabled)
            log.info("claim %s: created MIG device %s (%s: GPU instance %d, compute instance %d) on GPU %s", claim,
                     mig_uuid, placement.name, gi_id, ci_id, gpu.uuid)
            return record
        finally:
            with self._owned_lock:
                self._busy[gpu.uuid] -= 1
            if changed:
                self._changed()

    def _take_back(self, claim: ClaimRef, placement: MigPlacement, gi_id: int, enabled: bool,
                   cause: BaseException) -> None:
        """The compute instance failed: destroy the GI (and MIG mode if we turned it on); PartiallyApplied when
        the GI stays."""
        gpu = placement.parent
        try:
            self.control.destroy(gpu, gi_id)
        except Exception as exc:
            record = self._record(placement, gi_id, None, "", enabled)
            raise PartiallyApplied(claim, f"device {placement.name!r}: creating the compute instance in GPU "
                                          f"instance {gi_id} failed ({cause}), and destroying that GPU instance "
                                          f"failed too ({exc}); it is destroyed when the claim is unprepared or "
                                          "at the next start", record) from cause
        with self._owned_lock:
            self._owned.pop((gpu.uuid, gi_id), None)
        if enabled:
            self._disable_quietly(gpu, leaving=True)

    def _disable_quietly(self, gpu: GpuDevice, *, leaving: bool = False) -> None:
        """MIG mode off (Hopper and newer) unless an owned instance or another apply in flight is on the GPU.

        :param leaving: called from an apply of this GPU, which counts itself in flight.
        """
        with self._owned_lock:
            if any(u == gpu.uuid for u, _ in self._owned) or self._busy.get(gpu.uuid, 0) > (1 if leaving else 0):
                return
        try:
            self.control.disable_mig_if_unused(gpu)
        except DradriverError as exc:  # nothing is left on the GPU; MIG mode stays on until the next chance
            log.warning("GPU %s: MIG mode stays on: %s", gpu.uuid, exc)

    def _changed(self) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change()
        except Exception:  # the devices are re-read at the next change; the claim itself is fine
            log.exception("re-reading devices after a MIG change failed")

    # -- edits ------------------------------------------------------------------------------------------------

    def metadata_attributes(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord | None) -> dict[str, Any]:
        """The MIG device's ``uuid``, known once it was created (KEP-5304 device metadata)."""
        uuid = (record.data or {}).get("migUUID") if record is not None else None
        return {"uuid": {"string": str(uuid)}} if uuid else {}

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        """The parent's device node plus the GI and CI access capability nodes, from the record alone.

        :raises DeviceNodeError: a major or capability minor cannot be found.
        :raises DradriverError: the record has no compute instance, or lacks a fact (parent minor, GI id).
        """
        ci_id = record.fact("ciId", int, None)
        if ci_id is None:
            raise DradriverError(f"device {plan.device!r}: no compute instance recorded")
        return mig_instance_edits(self.nodes, self.nodes.read_majors(), record.fact("parentMinor", int),
                                  record.fact("giId", int), ci_id)

    # -- undo -------------------------------------------------------------------------------------------------

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Destroy the recorded compute instance, then its GPU instance; turn MIG mode off on Hopper and newer
        when it was the GPU's last instance. Idempotent: what is gone, or a GI id now used at another placement,
        counts as done. Works from the record's facts (parent UUID, GI and CI ids, GI profile and placement
        start), whatever the ``DynamicMIG`` gate says now: with the gate off this preparer is registered to undo
        only (:class:`~dradriver.kubeletplugin.runner.BatchRunner` ``undo_only``).

        :raises MigInUseError: processes run on the MIG device (the kubelet retries the unprepare).
        :raises NvmlError: a destroy failed otherwise.
        :raises UndoRecordFactError: the record lacks a fact the undo needs.
        """
        data = record.data
        uuid, gi_id = record.fact("parentUUID", str), record.fact("giId", int)
        ci_id = record.fact("ciId", int, None)
        start, profile_id = record.fact("placementStart", int), record.fact("giProfileId", int)
        gpu = self._gpu(uuid)
        if gpu is None:
            log.warning("claim %s: GPU %s of %s is gone; nothing to destroy", claim, uuid, record.target)
            self._forget(uuid, gi_id)
            return
        try:
            live = self.control.instances(gpu)
        except NvmlGpuIsLost:  # its instances went with it; a reset or reboot brings it back without them
            log.warning("claim %s: GPU %s of %s is lost; its MIG instances are gone with it", claim, uuid,
                        record.target)
            self._forget(uuid, gi_id)
            return
        mine = [i for i in live if i.gi_id == gi_id and i.placement_start == start and i.gi_profile_id == profile_id]
        if not mine:
            self._forget(uuid, gi_id)
            self._disable_quietly(gpu)
            return
        procs = sum(i.processes for i in mine)
        if procs:
            raise MigInUseError(f"MIG device {data.get('migUUID') or record.target} (GPU instance {gi_id} on GPU "
                                f"{uuid}) is in use by {procs} process(es); it is destroyed when they exit and the "
                                "kubelet retries the unprepare")
        try:
            self.control.destroy(gpu, gi_id, ci_id)
        except NvmlInUse as exc:
            raise MigInUseError(f"MIG device {data.get('migUUID') or record.target} (GPU instance {gi_id} on GPU "
                                f"{uuid}) is in use: {exc}; the kubelet retries the unprepare") from exc
        log.info("claim %s: destroyed MIG device %s (%s: GPU instance %d) on GPU %s", claim,
                 data.get("migUUID") or "-", record.target, gi_id, uuid)
        self._forget(uuid, gi_id)
        self._disable_quietly(gpu)
        self._changed()

    def _forget(self, uuid: str, gi_id: int) -> None:
        with self._owned_lock:
            self._owned.pop((uuid, gi_id), None)

    # -- sweep ------------------------------------------------------------------------------------------------

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """At start: destroy every instance on a dynamic-MIG GPU that no stored record owns, skipping any GPU where
        a process runs; turn MIG mode off on Hopper-and-newer GPUs left without instances. Returns what it
        destroyed (``<GPU UUID>/gi<id>``).

        :param known: the stored records of this kind and of :attr:`owner_kinds`. A static MIG record owns the
            instance it names: by parent UUID and GI id when it carries them, else (a record of an older release)
            by the parent's minor, GI profile and placement start its device name says
            (:func:`~dradriver.domain.devices.parse_placement_device_name`). Owned instances are never
            destroyed, and a dynamic claim whose placement overlaps one is refused (:meth:`apply`).
        """
        by_placement: dict[tuple[int, int, int], str] = {}
        with self._owned_lock:
            self._owned = {}
            for record in known:
                uuid, gi_id = record.data.get("parentUUID"), record.data.get("giId")
                if isinstance(uuid, str) and isinstance(gi_id, int) and not isinstance(gi_id, bool):
                    self._owned[(uuid, gi_id)] = record.target
                elif record.kind != self.kind and (name := parse_placement_device_name(record.target)):
                    by_placement[(name.parent_minor, name.gi_profile_id, name.start)] = record.target
            owned = dict(self._owned)
        removed: list[str] = []
        for gpu in self.gpus():
            if not is_dynamic_mig_capable(gpu):
                continue
            try:
                removed.extend(self._sweep_gpu(gpu, owned, by_placement))
            except NvmlError as exc:
                log.error("GPU %s: cleaning up MIG instances failed: %s", gpu.uuid, exc)
        if removed:
            self._changed()
        return removed

    def _sweep_gpu(self, gpu: GpuDevice, owned: dict[tuple[str, int], str],
                   by_placement: dict[tuple[int, int, int], str]) -> list[str]:
        instances = self.control.instances(gpu)
        for inst in instances:  # a static claim's instance named by its device name only: owned from now on
            target = by_placement.get((gpu.minor, inst.gi_profile_id, inst.placement_start))
            if target is not None:
                owned[(gpu.uuid, inst.gi_id)] = target
                with self._owned_lock:
                    self._owned[(gpu.uuid, inst.gi_id)] = target
        strays: dict[int, list[MigInstance]] = {}
        for inst in instances:
            if (gpu.uuid, inst.gi_id) not in owned:
                strays.setdefault(inst.gi_id, []).append(inst)
        if strays and self.control.gpu_processes(gpu):
            log.warning("GPU %s: %d GPU instance(s) no claim owns left alone: processes run on the GPU", gpu.uuid,
                        len(strays))
            return []
        removed = []
        for gi_id in sorted(strays):
            self.control.destroy(gpu, gi_id)
            removed.append(f"{gpu.uuid}/gi{gi_id}")
        if not any((gpu.uuid, i.gi_id) in owned for i in instances):
            self._disable_quietly(gpu)
        return removed
