"""Sharing steps: what a config group's :class:`~dradriver.domain.configs.SharingPlan` does to its devices.

``select_configs()`` computes one plan per config group; the batch runner applies the step registered for the
plan's strategy after the group's devices are prepared, stores its undo record with the claim, adds its CDI
edits, and undoes it on unprepare. Steps: exclusive use (strategy ``None``), :class:`TimeSlicing` (full GPUs;
on MIG devices NVIDIA's documented no-op, ``api/nvidia.com/resource/v1beta1/sharing.go``, ``migconfig.go``; needs
``TimeSlicingSettings`` on, as in NVIDIA's driver) and ``MPS``, :class:`dradriver.preparers.mps.MpsSharing` (gate
``MPSSupport``), registered by the GPU plugin when the gate is on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dradriver.domain.cdi import ContainerEdits
from dradriver.domain.claims import ClaimError, ClaimRef
from dradriver.domain.configs import TIME_SLICING, ConfigGroup
from dradriver.domain.devices import GpuDevice
from dradriver.domain.ports import JSONValue, PartiallyApplied, SharingStep, StoredRecords, UndoRecord
from dradriver.errors import DradriverError
from dradriver.host.nvidiasmi import NvidiaSmi, NvidiaSmiError
from dradriver.nvml import settings
from dradriver.nvml.errors import NvmlError, NvmlGpuIsLost, NvmlNotFound, NvmlNotSupported
from dradriver.nvml.session import NvmlSession

log = logging.getLogger(__name__)

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


class TimeSlicing:
    """Strategy ``TimeSlicing`` (gate ``TimeSlicingSettings``; NVIDIA's ``cmd/gpu-kubelet-plugin/sharing.go``,
    ``device_state.go``, ``api/nvidia.com/resource/v1beta1/sharing.go``).

    Apply, per full GPU of the group in UUID order: compute mode ``DEFAULT`` through NVML
    (``nvmlDeviceSetComputeMode``; NVIDIA runs ``nvidia-smi -c DEFAULT``), then the interval's time-slice
    (Default 0, Short 1, Medium 2, Long 3) with ``nvidia-smi compute-policy -i <uuid> --set-timeslice <n>``
    from the driver root (NVML has no call for it; :mod:`dradriver.host.nvidiasmi` runs it with NVIDIA's
    ``LD_PRELOAD`` rule). MIG devices of the group are skipped: TimeSlicing on a MigDeviceConfig is NVIDIA's
    documented no-op. No CDI edits (NVIDIA's ``cmd/gpu-kubelet-plugin/sharing.go``: time-slicing changes GPU settings
    only).

    Undo record (version 1): ``{"gpus": [{"uuid", "computeMode", "timesliceSet"}...], "timeslice": n}`` with
    each GPU's compute mode before the apply and whether its time-slice was set; before the apply the runner
    stores a write-ahead version (:meth:`planned_record`: no compute modes, ``"planned": true``), so a crash
    in the middle is undone at the next start. A failure part-way raises
    :class:`~dradriver.domain.ports.PartiallyApplied` holding the GPUs already changed, which the runner undoes.

    The undo reads the record's facts only (the GPUs, each one's compute mode before and whether its time-slice
    was set), never its layout version, and ignores facts it does not know: a record a newer release wrote with
    more facts is undone the same (:class:`~dradriver.domain.ports.UndoRecord`).

    Undo, per GPU (newest first), unless another PREPARE_COMPLETED claim still has a time-slicing record for that
    GPU: compute mode back to the recorded one (NVML) and time-slice back to 0 (Default), as NVIDIA resets it.
    While another claim still shares the GPU its own interval is put back if it differs (NVIDIA leaves the last
    writer's). A compute mode already equal to the recorded one is not written. A GPU that is gone or lost, or
    cannot take the setting (NOT_SUPPORTED, which NVIDIA tolerates too), counts as undone; any other failure
    fails the undo after every GPU was tried, and the undo is retried.

    Settings are per physical GPU: claims sharing one GPU with different intervals get the last writer's, as
    in NVIDIA's driver.

    :param session: the plugin's NVML session.
    :param nvidia_smi: returns the driver root's ``nvidia-smi`` (called at first use, so a node without it
        fails time-slicing claims with a clear error instead of failing start-up).
    """

    kind = "timeslicing"
    strategy: str | None = TIME_SLICING
    side_effects = True
    undo_kinds = ("mig-timeslicing",)
    """Records an older release wrote for TimeSlicing on MIG devices (no-ops); undone here."""

    def __init__(self, session: NvmlSession, nvidia_smi: Callable[[], NvidiaSmi]) -> None:
        self.session = session
        self._find_nvidia_smi = nvidia_smi
        self._nvidia_smi: NvidiaSmi | None = None
        self._stored: StoredRecords | None = None
        self._lock = threading.Lock()

    def bind_records(self, stored: StoredRecords) -> None:
        """Called by the batch runner: how to see other claims' time-slicing records."""
        self._stored = stored

    def _tool(self) -> NvidiaSmi:
        with self._lock:
            if self._nvidia_smi is None:
                self._nvidia_smi = self._find_nvidia_smi()
            return self._nvidia_smi

    def apply(self, claim: ClaimRef, group: ConfigGroup, devices: Sequence[object], *,
              deadline: float | None = None) -> UndoRecord:
        """Set compute mode DEFAULT and the time-slice on every full GPU of the group (nothing waits, so
        ``deadline`` is not needed).

        :raises ClaimError: ``nvidia-smi`` is missing under the driver root (nothing changed); the message names
            ``<parameters>.sharing``.
        :raises PartiallyApplied: NVML or ``nvidia-smi`` failed on a GPU; the message names
            ``<parameters>.sharing.timeSlicingConfig``, the GPU, and the tool's exit status and output.
        """
        target = ",".join(group.devices)
        gpus = sorted((d for d in devices if isinstance(d, GpuDevice)), key=lambda d: d.uuid)
        plan = group.plan.time_slicing
        if plan is None or not gpus:  # MIG devices only: NVIDIA's no-op
            return UndoRecord(self.kind, UNDO_VERSION, target, {"gpus": [], "timeslice": None})
        at = f"{group.entry.parameters_at}.sharing"
        try:
            tool = self._tool()
        except NvidiaSmiError as exc:
            raise ClaimError(claim, f"{at}: time-slicing needs nvidia-smi from the driver root: {exc}") from exc
        done: list[dict[str, JSONValue]] = []
        for gpu in gpus:
            try:
                previous = settings.compute_mode(self.session, gpu.uuid)
                if previous is not settings.ComputeMode.DEFAULT:
                    settings.set_compute_mode(self.session, gpu.uuid, settings.ComputeMode.DEFAULT)
                done.append({"uuid": gpu.uuid, "computeMode": int(previous), "timesliceSet": False})
                tool.set_timeslice(gpu.uuid, plan.timeslice)
                done[-1]["timesliceSet"] = True
            except (NvmlError, NvidiaSmiError) as exc:
                record = UndoRecord(self.kind, UNDO_VERSION, target, {"gpus": done, "timeslice": plan.timeslice})
                raise PartiallyApplied(
                    claim, f"{at}.timeSlicingConfig: setting time-slice interval {plan.interval} on device "
                           f"{gpu.name!r} ({gpu.uuid}) failed: {exc}", record) from exc
        log.info("claim %s: time-slice %s (%d) on %s", claim, plan.interval, plan.timeslice,
                 ", ".join(g.uuid for g in gpus))
        return UndoRecord(self.kind, UNDO_VERSION, target, {"gpus": done, "timeslice": plan.timeslice})

    def planned_record(self, claim: ClaimRef, group: ConfigGroup, devices: Sequence[object]) -> UndoRecord | None:
        """The write-ahead record the runner stores before :meth:`apply` (pure): every full GPU of the group with
        its time-slice to reset; compute modes are not known yet, so its undo leaves them as they are. ``None``
        for a group without full GPUs."""
        gpus = sorted((d for d in devices if isinstance(d, GpuDevice)), key=lambda d: d.uuid)
        plan = group.plan.time_slicing
        if plan is None or not gpus:
            return None
        return UndoRecord(self.kind, UNDO_VERSION, ",".join(group.devices),
                          {"gpus": [{"uuid": g.uuid, "timesliceSet": True} for g in gpus],
                           "timeslice": plan.timeslice, "planned": True})

    def edits(self, claim: ClaimRef, record: UndoRecord) -> Mapping[str, ContainerEdits]:
        """No edits: time-slicing changes GPU settings only."""
        return {}

    def _shared(self, claim: ClaimRef) -> dict[str, int]:
        """GPU UUID -> the time-slice of the newest other prepared claim that time-slices it."""
        out: dict[str, int] = {}
        for _uid, record in (self._stored(self.kind, claim.uid) if self._stored else ()):
            value = record.data.get("timeslice")
            for entry in record.data.get("gpus", ()):
                if isinstance(entry, Mapping) and isinstance(value, int):
                    out[str(entry.get("uuid"))] = value
        return out

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Reset the GPUs of the record (see the class docstring); idempotent.

        :raises DradriverError: NVML or ``nvidia-smi`` failed on a GPU that is still there (retried later).
        """
        if record.kind != self.kind:
            return  # a MIG-only record of an older release: nothing was set
        gpus = [e for e in record.fact("gpus", list, []) if isinstance(e, Mapping)]
        if not gpus:
            return
        shared = self._shared(claim)
        tool = self._tool()
        failures: list[DradriverError] = []
        for gpu in reversed(gpus):
            uuid = str(record.fact("uuid", str, of=gpu))
            try:
                if uuid in shared:
                    if shared[uuid] != record.data.get("timeslice"):
                        self._tolerant(uuid, tool.set_timeslice, uuid, shared[uuid])
                    log.info("claim %s: GPU %s still time-sliced by another claim; settings kept", claim, uuid)
                    continue
                mode = record.fact("computeMode", int, None, of=gpu)  # absent in a write-ahead record: not known
                if mode is not None:
                    self._tolerant(uuid, self._restore_compute_mode, uuid, mode)
                if record.fact("timesliceSet", bool, True, of=gpu):  # when absent, resetting is the safe side
                    self._tolerant(uuid, tool.set_timeslice, uuid, 0)
            except DradriverError as exc:  # try every GPU, then fail (the runner retries the whole undo)
                failures.append(exc)
        if failures:
            raise DradriverError(f"claim {claim}: time-slicing undo: " + "; ".join(str(f) for f in failures))

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Nothing to sweep: GPU settings carry no owner to tell a crash's leftover from a prepared claim's (as in
        NVIDIA's driver, which does not roll time-slicing back for half-prepared claims); a record stored with a
        half-prepared claim is undone by the runner's recovery."""
        return []

    def _restore_compute_mode(self, uuid: str, mode: int) -> None:
        """Set ``uuid``'s compute mode back to ``mode`` when it differs (no write, so no privilege, otherwise)."""
        wanted = settings.ComputeMode(mode)
        if settings.compute_mode(self.session, uuid) is not wanted:
            settings.set_compute_mode(self.session, uuid, wanted)

    @staticmethod
    def _tolerant(uuid: str, action: Callable[..., object], *args: Any) -> None:
        """Run ``action(*args)``; a GPU that is gone, lost or cannot take the setting counts as reset."""
        try:
            action(*args)
        except (NvmlNotFound, NvmlGpuIsLost, NvmlNotSupported) as exc:
            log.warning("GPU %s: setting not reset (%s); nothing left to undo", uuid, exc)
        except NvidiaSmiError as exc:
            if exc.returncode not in _GONE_EXIT_CODES:
                raise
            log.warning("GPU %s: time-slice not reset (%s); nothing left to undo", uuid, exc)


_GONE_EXIT_CODES = (3, 6, 15)
"""``nvidia-smi`` exit statuses meaning not supported, no such device, GPU lost (its manual, "RETURN VALUE")."""


def default_steps(session: NvmlSession, nvidia_smi: Callable[[], NvidiaSmi]) -> tuple[SharingStep, ...]:
    """The sharing steps of the GPU plugin without MPS: exclusive use and time-slicing (the plugin adds
    :class:`dradriver.preparers.mps.MpsSharing` with the MPSSupport gate)."""
    return (ExclusiveUse(), TimeSlicing(session, nvidia_smi))
