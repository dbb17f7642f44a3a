"""Dynamic MIG through NVML: MIG mode changes, GPU/compute instance create and destroy, instances and their processes.

The placements a GPU offers are enumerated by discovery (:func:`dradriver.nvml.discovery.mig_placements`).

Facts (NVIDIA's dynamic MIG, ``cmd/gpu-kubelet-plugin/nvlib.go``; ``nvml.h`` documentation of each call; NVIDIA's MIG
User Guide):


* ``nvmlDeviceSetMigMode`` may leave the mode pending: ``activationStatus`` not ``NVML_SUCCESS`` (``IN_USE`` when
  the GPU is not idle, ``RESET_REQUIRED`` where a reset cannot be done) means the change waits for a GPU reset;
* ``nvmlDeviceCreateGpuInstanceWithPlacement`` returns ``INSUFFICIENT_RESOURCES`` for an occupied placement;
  ``nvmlGpuInstanceDestroy``/``nvmlComputeInstanceDestroy`` return ``IN_USE`` while processes run (and, for a GI,
  while compute instances exist).

:class:`MigControl` serialises the calls per parent GPU (one lock per GPU UUID: two GPUs are changed
concurrently, one GPU never) and caches full-GPU handles by UUID (:meth:`NvmlSession.device_by_uuid`). Handles
of GPU instances, compute instances and MIG devices are never cached: they die with the instance.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from dradriver.domain.devices import GpuDevice
from dradriver.domain.migplacements import MigPlacement, offers_full_gpu
from dradriver.errors import DradriverError
from dradriver.nvml.errors import NvmlError, NvmlInvalidArgument, NvmlNotFound, NvmlNotSupported
from dradriver.nvml.session import NvmlSession

log = logging.getLogger(__name__)

T = TypeVar("T")



class MigModeError(DradriverError):
    """The GPU's MIG mode cannot be changed now (pending a GPU reset, or the GPU is in use)."""


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One existing GPU instance and (when it has one) its compute instance: the concrete identity of a MIG device.

    :param parent_uuid: the GPU's UUID; ``parent_minor``: its NVML minor number.
    :param gi_id: GPU instance ID (``nvmlGpuInstanceInfo_t.id``); ``gi_profile_id``: its profile ID.
    :param placement_start: first memory slice; ``placement_size``: memory slices.
    :param ci_id: compute instance ID, ``None`` for a GI without compute instance (e.g. after a crash).
    :param mig_uuid: ``MIG-...`` UUID of the MIG device (``nvmlDeviceGetUUID`` on its handle), ``""`` without CI.
    :param processes: processes running on it (``nvmlDeviceGetComputeRunningProcesses_v3``).
    """

    parent_uuid: str
    parent_minor: int
    gi_id: int
    gi_profile_id: int
    placement_start: int
    placement_size: int
    ci_id: int | None = None
    ci_profile_id: int | None = None
    mig_uuid: str = ""
    processes: int = 0


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class MigControl:
    """MIG operations on the GPUs of one NVML session, serialised per GPU.

    :param session: the plugin's open session (its handle cache is used).
    """

    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # -- serialisation -------------------------------------------------------------------------------------

    @contextmanager
    def gpu_lock(self, parent_uuid: str) -> Iterator[Any]:
        """Hold the GPU's lock; yields its (cached) handle. Every method below takes it."""
        with self._locks_guard:
            lock = self._locks.setdefault(parent_uuid, threading.Lock())
        with lock:
            yield self.session.device_by_uuid(parent_uuid)

    @contextmanager
    def hold(self, parent_uuids: Iterable[str]) -> Iterator[None]:
        """Hold the locks of several GPUs (taken in UUID order, so two holders never deadlock) without touching
        NVML: a reader that must not see an instance half created or destroyed (the device refresher)."""
        with self._locks_guard:
            locks = [self._locks.setdefault(uuid, threading.Lock()) for uuid in sorted(set(parent_uuids))]
        with contextlib.ExitStack() as held:
            for lock in locks:
                held.enter_context(lock)
            yield

    def _call(self, fn: Callable[..., T], *args: Any, context: str) -> T:
        return self.session.call(fn, *args, context=context)

    # -- MIG mode --------------------------------------------------------------------------------------------

    def mig_mode(self, parent_uuid: str) -> tuple[int, int]:
        """``(current, pending)`` of ``nvmlDeviceGetMigMode`` (1 enabled, 0 disabled)."""
        with self.gpu_lock(parent_uuid) as handle:
            current, pending = self._call(pynvml.nvmlDeviceGetMigMode, handle,
                                          context=f"MIG mode of {parent_uuid}")
        return int(current), int(pending)

    def _set_mode(self, handle: Any, parent_uuid: str, mode: int) -> None:
        word = "enable" if mode else "disable"
        status = self._call(pynvml.nvmlDeviceSetMigMode, handle, mode, context=f"{word} MIG mode on {parent_uuid}")
        current, pending = self._call(pynvml.nvmlDeviceGetMigMode, handle, context=f"MIG mode of {parent_uuid}")
        if int(status) != pynvml.NVML_SUCCESS or int(current) != mode:
            reason = pynvml.nvmlErrorString(int(status)) if int(status) else "not active after the call"
            if isinstance(reason, bytes):
                reason = reason.decode(errors="replace")
            raise MigModeError(
                f"GPU {parent_uuid}: cannot {word} MIG mode now: activation status {int(status)} ({reason}); MIG mode "
                f"is current {int(current)}, pending {int(pending)}: the change needs the GPU idle or reset "
                "(nvidia-smi -r, or a node reboot)")

    def ensure_mig_enabled(self, parent_uuid: str) -> bool:
        """Turn MIG mode on if it is off; returns True when this call changed it.

        :raises MigModeError: the change is pending (needs a reset or an idle GPU).
        """
        with self.gpu_lock(parent_uuid) as handle:
            current, _ = self._call(pynvml.nvmlDeviceGetMigMode, handle, context=f"MIG mode of {parent_uuid}")
            if int(current) == pynvml.NVML_DEVICE_MIG_ENABLE:
                return False
            try:
                self._set_mode(handle, parent_uuid, pynvml.NVML_DEVICE_MIG_ENABLE)
            except MigModeError:
                # withdraw the pending change, so a later reset does not switch the GPU behind our back
                try:
                    self._call(pynvml.nvmlDeviceSetMigMode, handle, int(current),
                               context=f"withdraw pending MIG mode on {parent_uuid}")
                except NvmlError as exc:
                    log.warning("GPU %s: pending MIG mode not withdrawn: %s", parent_uuid, exc)
                raise
            self.session.forget_mig_handles(parent_uuid)
            return True

    def disable_mig_if_unused(self, gpu: GpuDevice) -> bool:
        """On Hopper and newer, turn MIG mode off when no GPU instance is left; returns True when it did.

        Pre-Hopper GPUs stay in MIG mode (turning it off needs a reset, NVIDIA PR #1018).

        :raises MigModeError: MIG mode could not be turned off.
        """
        if not offers_full_gpu(gpu):
            return False
        with self.gpu_lock(gpu.uuid) as handle:
            current, _ = self._call(pynvml.nvmlDeviceGetMigMode, handle, context=f"MIG mode of {gpu.uuid}")
            if int(current) != pynvml.NVML_DEVICE_MIG_ENABLE or self._gpu_instances(handle, gpu.uuid):
                return False
            self._set_mode(handle, gpu.uuid, pynvml.NVML_DEVICE_MIG_DISABLE)
            self.session.forget_mig_handles(gpu.uuid)
            return True

    # -- instances -------------------------------------------------------------------------------------------

    def _gpu_instances(self, handle: Any, parent_uuid: str) -> list[Any]:
        """Handles of every GPU instance on the GPU (all profiles); [] when MIG mode is off."""
        out: list[Any] = []
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = self._call(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, index,
                                  context=f"GPU-instance profile {index} on {parent_uuid}")
            except (NvmlNotSupported, NvmlInvalidArgument):
                continue
            array = (pynvml.c_nvmlGpuInstance_t * int(info.instanceCount or 1))()
            count = ctypes.c_uint(len(array))
            try:
                self._call(pynvml.nvmlDeviceGetGpuInstances, handle, int(info.id), array, ctypes.byref(count),
                           context=f"GPU instances of profile {int(info.id)} on {parent_uuid}")
            except NvmlNotSupported:  # MIG mode off
                return []
            out.extend(array[k] for k in range(count.value))
        return out

    def instances(self, gpu: GpuDevice) -> list[MigInstance]:
        """Every GPU instance on ``gpu`` with its compute instances (one entry per CI; one without CI for a bare
        GI) and the processes running on each."""
        with self.gpu_lock(gpu.uuid) as handle:
            return self._instances(handle, gpu)

    def _instances(self, handle: Any, gpu: GpuDevice) -> list[MigInstance]:
        migs = self._mig_devices(handle, gpu)
        out: list[MigInstance] = []
        for gi in self._gpu_instances(handle, gpu.uuid):
            info = self._call(pynvml.nvmlGpuInstanceGetInfo, gi, context=f"GPU instance on {gpu.uuid}")
            gi_id = int(info.id)
            base = MigInstance(gpu.uuid, gpu.minor, gi_id, int(info.profileId), int(info.placement.start),
                               int(info.placement.size))
            cis = [(c, u, p) for (g, c), (u, p) in migs.items() if g == gi_id]
            if not cis:
                out.append(base)
            for ci_id, uuid, procs in sorted(cis):
                out.append(MigInstance(gpu.uuid, gpu.minor, gi_id, base.gi_profile_id, base.placement_start,
                                       base.placement_size, ci_id, None, uuid, procs))
        return out

    def _mig_devices(self, handle: Any, gpu: GpuDevice) -> dict[tuple[int, int], tuple[str, int]]:
        """(GI id, CI id) -> (MIG UUID, process count) for every MIG device handle of the GPU."""
        current, _ = self._call(pynvml.nvmlDeviceGetMigMode, handle, context=f"MIG mode of {gpu.uuid}")
        if int(current) != pynvml.NVML_DEVICE_MIG_ENABLE:
            return {}
        count = int(self._call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle, context=f"MIG count of {gpu.uuid}"))
        out: dict[tuple[int, int], tuple[str, int]] = {}
        for slot in range(count):
            try:
                mh = self._call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot,
                                context=f"MIG slot {slot} of {gpu.uuid}")
            except (NvmlNotFound, NvmlInvalidArgument):
                continue
            where = f"MIG slot {slot} of {gpu.uuid}"
            gi_id = int(self._call(pynvml.nvmlDeviceGetGpuInstanceId, mh, context=f"GI id of {where}"))
            ci_id = int(self._call(pynvml.nvmlDeviceGetComputeInstanceId, mh, context=f"CI id of {where}"))
            uuid = _text(self._call(pynvml.nvmlDeviceGetUUID, mh, context=f"UUID of {where}"))
            procs = self._call(pynvml.nvmlDeviceGetComputeRunningProcesses_v3, mh, context=f"processes on {where}")
            out[(gi_id, ci_id)] = (uuid, len(procs))
        return out

    def gpu_processes(self, gpu: GpuDevice) -> int:
        """Processes running anywhere on ``gpu`` (full GPU and every MIG device)."""
        with self.gpu_lock(gpu.uuid) as handle:
            procs = self._call(pynvml.nvmlDeviceGetComputeRunningProcesses_v3, handle,
                               context=f"processes on {gpu.uuid}")
        return len(procs)

    def find_gpu_instance(self, gpu: GpuDevice, start: int, size: int) -> list[MigInstance]:
        """The instances whose placement overlaps memory slices ``start..start+size-1`` of ``gpu`` (the lookup by
        placement a crash or an out-of-band client needs; NVIDIA looks up by name and misses a bare GI, #1452)."""
        end = start + size
        return [i for i in self.instances(gpu) if i.placement_start < end and start < i.placement_start
                + i.placement_size]

    def create_gpu_instance(self, placement: MigPlacement) -> int:
        """``nvmlDeviceCreateGpuInstanceWithPlacement`` at exactly ``placement``; returns the new GI id.

        :raises NvmlInsufficientResources: the placement is occupied or the profile's instances are used up.
        :raises NvmlNotSupported: MIG mode is off.
        """
        gpu = placement.parent
        with self.gpu_lock(gpu.uuid) as handle:
            info = self._call(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, placement.gi_profile_index,
                              context=f"GPU-instance profile {placement.gi_profile_index} on {gpu.uuid}")
            where = pynvml.c_nvmlGpuInstancePlacement_t()
            where.start, where.size = placement.placement_start, placement.placement_size
            gi = self._call(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, handle, int(info.id),
                            ctypes.byref(where), context=(
                                f"create GPU instance {placement.profile} at {placement.placement_start}:"
                                f"{placement.placement_size} on {gpu.uuid}"))
            self.session.forget_mig_handles(gpu.uuid)
            gi_info = self._call(pynvml.nvmlGpuInstanceGetInfo, gi, context=f"new GPU instance on {gpu.uuid}")
            return int(gi_info.id)

    def create_compute_instance(self, placement: MigPlacement, gi_id: int) -> tuple[int, str]:
        """Create the full-GI compute instance in GI ``gi_id``; returns ``(CI id, MIG UUID)``.

        An existing compute instance of that GI (a crash after its creation) is returned instead of a second one.

        :raises NvmlInsufficientResources: the GI has no room left.
        """
        gpu = placement.parent
        with self.gpu_lock(gpu.uuid) as handle:
            gi = self._call(pynvml.nvmlDeviceGetGpuInstanceById, handle, gi_id, context=f"GI {gi_id} on {gpu.uuid}")
            existing = [(c, u) for (g, c), (u, _) in self._mig_devices(handle, gpu).items() if g == gi_id]
            if existing:
                return min(existing)
            info = self._call(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, placement.ci_profile_index,
                              pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                              context=f"compute-instance profile {placement.ci_profile_index} of GI {gi_id}")
            ci = self._call(pynvml.nvmlGpuInstanceCreateComputeInstance, gi, int(info.id),
                            context=f"create compute instance in GI {gi_id} on {gpu.uuid}")
            self.session.forget_mig_handles(gpu.uuid)
            ci_info = self._call(pynvml.nvmlComputeInstanceGetInfo, ci, context=f"new CI in GI {gi_id}")
            ci_id = int(ci_info.id)
            uuid = self._mig_devices(handle, gpu).get((gi_id, ci_id), ("", 0))[0]
            if not uuid:
                raise NvmlError(f"GPU {gpu.uuid}: compute instance {ci_id} of GI {gi_id} has no MIG device handle")
            return ci_id, uuid

    def destroy(self, gpu: GpuDevice, gi_id: int, ci_id: int | None = None) -> bool:
        """Destroy the compute instances of GI ``gi_id`` (``ci_id`` first), then the GI; True when anything was
        destroyed. Idempotent: a GI already gone (NOT_FOUND) or MIG mode off (NOT_SUPPORTED) succeeds.

        :raises NvmlInUse: processes run on it ("in use"; the kubelet retries the unprepare).
        """
        with self.gpu_lock(gpu.uuid) as handle:
            try:
                gi = self._call(pynvml.nvmlDeviceGetGpuInstanceById, handle, gi_id,
                                context=f"GI {gi_id} on {gpu.uuid}")
            except (NvmlNotFound, NvmlNotSupported):
                return False
            ids = sorted({c for (g, c) in self._mig_devices(handle, gpu) if g == gi_id},
                         key=lambda c: (c != ci_id, c))
            for cid in ids:
                try:
                    ci = self._call(pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, cid,
                                    context=f"CI {cid} of GI {gi_id} on {gpu.uuid}")
                except NvmlNotFound:
                    continue
                self._call(pynvml.nvmlComputeInstanceDestroy, ci,
                           context=f"destroy compute instance {cid} of GI {gi_id} on {gpu.uuid}")
                self.session.forget_mig_handles(gpu.uuid)
            self._call(pynvml.nvmlGpuInstanceDestroy, gi, context=f"destroy GPU instance {gi_id} on {gpu.uuid}")
            self.session.forget_mig_handles(gpu.uuid)
            return True
