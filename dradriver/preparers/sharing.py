"""Sharing steps: what a config group's :class:`~dradriver.domain.configs.SharingPlan` does to its devices.

``select_configs()`` computes one plan per config group; the batch runner applies the step registered for the
plan's strategy after the group's devices are prepared, stores its undo record with the claim, adds its CDI
edits, and undoes it on unprepare. Today only exclusive use exists (strategy ``None``, and ``TimeSlicing`` on
MIG devices, which NVIDIA documents as a no-op: a MIG device cannot be time-sliced, ``nvidia-dra-driver.md`` 3.1);
time-slicing of full GPUs is refused earlier by its feature gate (``TimeSlicingSettings``, off by default as in
NVIDIA's driver). ``MPS`` is :class:`dradriver.preparers.mps.MpsSharing` (gate ``MPSSupport``), registered by
the GPU plugin when the gate is on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dradriver.domain.cdi import ContainerEdits
from dradriver.domain.claims import ClaimError, ClaimRef
from dradriver.domain.configs import TIME_SLICING, ConfigGroup
from dradriver.domain.ports import UndoRecord

UNDO_VERSION = 1


class ExclusiveUse:
    """Strategy ``None``: the claim's containers share the devices among themselves only; nothing to set."""

    kind = "exclusive"
    strategy: str | None = None
    side_effects = False

    def apply(self, claim: ClaimRef, group: ConfigGroup, devices: Sequence[object], *,
              deadline: float | None = None) -> UndoRecord:
        """Nothing to do; the (empty) undo record names the group's devices."""
        return UndoRecord(self.kind, UNDO_VERSION, ",".join(group.devices), {})

    def edits(self, claim: ClaimRef, record: UndoRecord) -> Mapping[str, ContainerEdits]:
        """No edits."""
        return {}

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Nothing to undo."""

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Nothing is ever left behind."""
        return []


class MigTimeSlicing(ExclusiveUse):
    """``TimeSlicing`` on MIG devices: valid in NVIDIA's config API and a documented no-op (a MIG device has no
    time-slice setting; its compute instances are already isolated)."""

    kind = "mig-timeslicing"
    strategy = TIME_SLICING

    def apply(self, claim: ClaimRef, group: ConfigGroup, devices: Sequence[object], *,
              deadline: float | None = None) -> UndoRecord:
        """Refuses a group with a full GPU (its time-slicing step is not this one); no-op for MIG devices.

        :raises ClaimError: the plan carries a time-slice interval, i.e. the group holds full GPUs.
        """
        if group.plan.time_slicing is not None:
            raise ClaimError(claim, f"{group.entry.parameters_at}.sharing: time-slicing of full GPUs is not "
                                    "implemented by this plugin")
        return super().apply(claim, group, devices, deadline=deadline)


def default_steps() -> tuple[ExclusiveUse, ...]:
    """The sharing steps of the GPU plugin today."""
    return (ExclusiveUse(), MigTimeSlicing())
