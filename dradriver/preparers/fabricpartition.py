"""The Fabric Manager partition step (gate ``FabricManagerPartitioning``): per claim, the partition its GPUs form is
activated at prepare and deactivated at unprepare.

Facts (kubernetes-sigs/dra-driver-nvidia-gpu ``cmd/gpu-kubelet-plugin/device_state.go``, ``pkg/fabricmanager/``;
NVIDIA Fabric Manager User Guide, "Shared NVSwitch Virtualization Model"; ``nv_fm_agent.h``):

* prepare: the claim's full GPUs and VFIO devices must form exactly one supported partition
  (:func:`~dradriver.domain.fmpartitions.match_partition`), which is activated; a partition already active is
  taken as it is (idempotent: FM itself would answer ``FM_ST_IN_USE``);
* unprepare: the partition is deactivated, unless another prepared claim's record holds one of its GPUs (a
  shared claim of the same GPUs); one that FM reports inactive already (``FM_ST_UNINITIALIZED``) is done;
* start-up sweep: an active partition that no stored record knows (a crash between the activation and storing
  its record) is deactivated; a partition a record holds never is.

The step is per claim, not per device: :meth:`FabricPartitionStep.apply` takes the claim's registry entries. Its
undo record (kind ``fm-partition``) holds the partition ID, its GPUs' module IDs and whether it was active before
the apply (a diagnostic: the undo deactivates either way, as NVIDIA's unprepare does).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from dradriver.domain.claims import ClaimError, ClaimRef
from dradriver.domain.fmpartitions import claim_module_ids, held_by_others, match_partition, orphan_partitions
from dradriver.domain.passthrough import FabricPartition
from dradriver.domain.ports import StoredRecords, UndoRecord
from dradriver.host.fabricmanager import FM_ST_CONNECTION_NOT_VALID, FM_ST_UNINITIALIZED, FabricManagerError

log = logging.getLogger(__name__)

KIND = "fm-partition"
UNDO_VERSION = 1


class FabricManagerPort(Protocol):
    """What the step needs of :class:`~dradriver.host.fabricmanager.FabricManagerClient`."""

    def partitions(self) -> list[FabricPartition]: ...

    def activate(self, partition_id: int) -> None: ...

    def deactivate(self, partition_id: int) -> None: ...


class FabricPartitionStep:
    """Activates and deactivates a claim's Fabric Manager partition.

    :param fm: the Fabric Manager client (a fresh connection per call).
    """

    kind = KIND
    side_effects = True

    def __init__(self, fm: FabricManagerPort) -> None:
        self.fm = fm
        self._stored: StoredRecords | None = None

    def bind_records(self, stored: StoredRecords) -> None:
        """Called by the batch runner: how to see other prepared claims' partition records."""
        self._stored = stored

    def applies(self, devices: Sequence[object]) -> bool:
        """The claim has a full GPU or VFIO device (MIG devices and channels have no partition)."""
        return bool(claim_module_ids(devices))

    def apply(self, claim: ClaimRef, devices: Sequence[object]) -> UndoRecord:
        """Activate the partition of the claim's GPUs (``devices``: its registry entries).

        :raises ClaimError: the GPUs form no supported partition (names the claim, GPUs, module IDs, nearest
            partitions; nothing changed), or FM refused or could not be reached (names the partition and the
            ``fmReturn_t``; nothing changed).
        """
        gpus = claim_module_ids(devices)
        try:
            partitions = self.fm.partitions()
        except FabricManagerError as exc:
            raise ClaimError(claim, f"Fabric Manager partitioning: {exc}") from exc
        partition = match_partition(claim, gpus, partitions)
        target = ",".join(sorted(gpus))
        data = {"partitionId": partition.partition_id, "moduleIds": list(partition.module_ids),
                "wasActive": partition.active}
        if partition.active:
            log.info("claim %s: Fabric Manager partition %d %s is active already", claim, partition.partition_id,
                     list(partition.module_ids))
            return UndoRecord(self.kind, UNDO_VERSION, target, data)
        try:
            self.fm.activate(partition.partition_id)
        except FabricManagerError as exc:
            raise ClaimError(claim, f"Fabric Manager partitioning: GPUs {target} (module IDs "
                                    f"{list(partition.module_ids)}): {exc}") from exc
        log.info("claim %s: Fabric Manager partition %d %s activated", claim, partition.partition_id,
                 list(partition.module_ids))
        return UndoRecord(self.kind, UNDO_VERSION, target, data)

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Deactivate the record's partition unless another prepared claim's record holds one of its GPUs;
        idempotent (inactive already is done).

        :raises FabricManagerError: FM refused or could not be reached (the claim stays recorded; retried).
        """
        pid = record.fact("partitionId", int)
        modules = [int(m) for m in record.fact("moduleIds", list)]
        others = [[int(m) for m in r.fact("moduleIds", list, default=[])]
                  for _uid, r in (self._stored(self.kind, claim.uid) if self._stored else ())]
        if held_by_others(modules, others):
            log.info("claim %s: Fabric Manager partition %d stays active: another prepared claim holds its GPUs",
                     claim, pid)
            return
        try:
            self.fm.deactivate(pid)
        except FabricManagerError as exc:
            if exc.code != FM_ST_UNINITIALIZED:
                raise
        log.info("claim %s: Fabric Manager partition %d deactivated", claim, pid)

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Deactivate active partitions that no record of ``known`` holds; ``partition <id> {modules}`` of each.
        FM unreachable: nothing is swept (logged), the next start tries again."""
        try:
            active = [p for p in self.fm.partitions() if p.active]
        except FabricManagerError as exc:
            if exc.code != FM_ST_CONNECTION_NOT_VALID:
                raise
            log.warning("Fabric Manager partition sweep skipped: %s", exc)
            return []
        held = [r.fact("partitionId", int) for r in known if r.kind == self.kind]
        by_id = {p.partition_id: p for p in active}
        removed: list[str] = []
        for pid in orphan_partitions(by_id, held):
            self.fm.deactivate(pid)
            removed.append(f"partition {pid} {list(by_id[pid].module_ids)}")
        return removed
