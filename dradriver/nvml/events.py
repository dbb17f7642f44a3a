"""NVML event monitor: a thread that waits on an NVML event set and turns events into health faults.

What it does (NVIDIA's ``cmd/gpu-kubelet-plugin/device_health.go``, extended):

* ``nvmlEventSetCreate``; every full GPU is registered (``nvmlDeviceRegisterEvents``) for the event types in
  :data:`WANTED_EVENT_TYPES` that ``nvmlDeviceGetSupportedEventTypes`` reports (MIG device handles cannot be
  registered: MIG-scoped events arrive on the parent with ``gpuInstanceId``/``computeInstanceId`` set);
* ``nvmlEventSetWait_v2`` with a timeout (:attr:`EventMonitor.wait_timeout_ms`) so :meth:`EventMonitor.stop`
  is prompt; after one event the queue is drained without waiting, and the events read together are handed
  to ``on_events`` as one batch (a burst becomes one health update);
* each event becomes a :class:`~dradriver.domain.faults.HealthEvent`: Xid critical error -> ``XID`` with
  the Xid in ``eventData``; double-bit ECC, DRAM retirement failure, fatal poison and GPU-unavailable ->
  the matching fault; single-bit ECC and other informational types are only counted
  (:attr:`EventMonitor.events_by_type`);
* GPU lost: ``NVML_ERROR_GPU_IS_LOST`` from the wait (or from a probe) -> every registered GPU is probed
  (``nvmlDeviceGetHandleByUUID`` + ``nvmlDeviceGetMemoryInfo``, uncached); each one answering GPU_IS_LOST
  gets a ``GPU_LOST`` fault and the event set is rebuilt without it (so the wait keeps delivering the other
  GPUs' events). Lost GPUs are probed again on every loop turn; one that answers is registered again and
  reported through ``on_return``;
* a GPU whose handle, supported event types or registration fails (NOT_SUPPORTED included) -> an
  ``UNMONITORED`` report (informational taint, reference ``gpu.nvidia.com/unmonitored``) with the reason.

Every NVML call goes through :class:`~dradriver.nvml.session.NvmlSession` (pynvml); failures are counted by
``nvmlReturn_t`` in :attr:`EventMonitor.errors_by_code`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from dradriver.domain.devices import FabricInfo
from dradriver.domain.faults import NO_MIG_SCOPE, FaultKind, HealthEvent
from dradriver.nvml.errors import NvmlError, NvmlGpuIsLost, NvmlTimeout
from dradriver.nvml.session import NvmlSession

log = logging.getLogger(__name__)

RECOVERY_ACTION_FIELD = 230
"""``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (nvml.h): the ``nvmlGpuRecoveryAction_t`` the driver asks for now."""

EVENT_SBE = 0x1  # nvmlEventTypeSingleBitEccError
EVENT_DBE = 0x2  # nvmlEventTypeDoubleBitEccError
EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
EVENT_DRAM_RETIREMENT_FAILURE = 0x800  # nvmlEventTypeDramRetirementFailure
EVENT_FATAL_POISON = 0x2000  # nvmlEventTypeFatalPoisonError
EVENT_GPU_UNAVAILABLE = 0x4000  # nvmlEventTypeGpuUnavailableError

WANTED_EVENT_TYPES = (
    EVENT_SBE | EVENT_DBE | EVENT_XID | EVENT_DRAM_RETIREMENT_FAILURE | EVENT_FATAL_POISON | EVENT_GPU_UNAVAILABLE
)
"""Event types registered when supported (values from ``nvml.h`` ``nvmlEventType*``)."""

_FAULT_OF_TYPE: dict[int, tuple[FaultKind, str]] = {
    EVENT_DBE: (FaultKind.DOUBLE_BIT_ECC, ""),
    EVENT_DRAM_RETIREMENT_FAILURE: (FaultKind.ROW_REMAP_FAILURE, "DRAM retirement failure event"),
    EVENT_FATAL_POISON: (FaultKind.DOUBLE_BIT_ECC, "fatal poison error event"),
    EVENT_GPU_UNAVAILABLE: (FaultKind.GPU_LOST, "GPU unavailable event"),
}

EventsCallback = Callable[[list[HealthEvent]], None]


def _address(handle: Any) -> int:
    """The pointer value of an NVML device handle (pynvml ``c_nvmlDevice_t``)."""
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def probe_gpu(session: NvmlSession, uuid: str) -> NvmlError | None:
    """Ask NVML about a GPU without cached handles; ``None`` when it answers, else the error.

    ``NOT_SUPPORTED`` for the memory query counts as an answer.
    """
    try:
        handle = session.call(pynvml.nvmlDeviceGetHandleByUUID, uuid, context=f"handle of {uuid}")
        session.optional(pynvml.nvmlDeviceGetMemoryInfo, handle, context=f"memory info of {uuid}")
    except NvmlError as exc:
        return exc
    return None


def read_fabric(session: NvmlSession, uuid: str) -> FabricInfo | None:
    """``nvmlDeviceGetGpuFabricInfoV`` of one GPU (v3 carries ``healthSummary``); ``None`` when unsupported.

    Uses the same reader as discovery, so both see the same fields.

    :raises NvmlError: the query failed for another reason (GPU_IS_LOST included).
    """
    from dradriver.nvml import discovery

    return discovery.read_fabric_info(session, session.device_by_uuid(uuid), uuid)


class EventMonitor:
    """Waits on NVML events for a set of GPUs on a daemon thread.

    :param session: the open NVML session (not closed by the monitor).
    :param gpu_uuids: the full GPUs to monitor (``GPU-...``), MIG mode or not.
    :param on_events: receives each batch of faults read together (called on the monitor thread).
    :param on_return: called with the UUID of a lost GPU that answers again.
    :param wait_timeout_ms: milliseconds one ``nvmlEventSetWait_v2`` may block (bounds :meth:`stop`).
    :param clock: time source for :attr:`HealthEvent.time` (seconds).
    :ivar unmonitored: GPU UUID -> reason, for GPUs that could not be registered.
    :ivar lost: UUIDs of GPUs currently lost.
    :ivar events_by_type: ``nvmlEventType`` bit -> number of events received.
    :ivar errors_by_code: ``nvmlReturn_t`` -> number of failed NVML calls (timeouts not counted).
    """

    def __init__(
        self,
        session: NvmlSession,
        gpu_uuids: Sequence[str],
        *,
        on_events: EventsCallback,
        on_return: Callable[[str], None] | None = None,
        wait_timeout_ms: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session = session
        self.gpu_uuids = tuple(gpu_uuids)
        self.on_events = on_events
        self.on_return = on_return
        self.wait_timeout_ms = wait_timeout_ms
        self.clock = clock
        self.unmonitored: dict[str, str] = {}
        self.lost: set[str] = set()
        self.registered: dict[str, int] = {}
        """UUID -> event mask registered in the current set."""
        self.events_by_type: dict[int, int] = {}
        self.errors_by_code: dict[int, int] = {}
        self._set: Any = None
        self._by_address: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Register the GPUs (reporting unmonitored ones) and start the monitor thread."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._emit(self._rebuild())
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (within about one wait timeout) and free the event set."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self.wait_timeout_ms / 1000 + 5)
            if thread.is_alive():
                # Still inside an NVML call (a hung driver): freeing the set under it would be a use after
                # free. Leak it instead; the process is going away or the GPU is beyond help.
                log.error("NVML event thread did not stop within %.1f s; leaving its event set allocated",
                          self.wait_timeout_ms / 1000 + 5)
                return
            self._thread = None
        self._free()

    # -- NVML ------------------------------------------------------------------------------------------------

    def _count_error(self, exc: NvmlError) -> None:
        self.errors_by_code[exc.code] = self.errors_by_code.get(exc.code, 0) + 1

    def _free(self) -> None:
        if self._set is not None:
            try:
                self.session.call(pynvml.nvmlEventSetFree, self._set, context="nvmlEventSetFree")
            except NvmlError as exc:
                self._count_error(exc)
                log.warning("%s", exc)
            self._set = None
        self._by_address.clear()
        self.registered.clear()

    def _rebuild(self) -> list[HealthEvent]:
        """Create a fresh event set with every GPU that is not lost; returns the faults found on the way."""
        self._free()
        found: list[HealthEvent] = []
        try:
            self._set = self.session.call(pynvml.nvmlEventSetCreate, context="nvmlEventSetCreate")
        except NvmlError as exc:
            self._count_error(exc)
            for uuid in self.gpu_uuids:
                found.extend(self._unmonitored(uuid, f"cannot create an NVML event set: {exc}"))
            return found
        for uuid in self.gpu_uuids:
            if uuid in self.lost:
                continue
            found.extend(self._register(uuid))
        return found

    def _unmonitored(self, uuid: str, reason: str) -> list[HealthEvent]:
        if self.unmonitored.get(uuid) == reason:
            return []
        log.warning("GPU %s is not monitored for health events: %s", uuid, reason)
        self.unmonitored[uuid] = reason
        return [HealthEvent(uuid, FaultKind.UNMONITORED, time=self.clock(), detail=reason)]

    def _register(self, uuid: str) -> list[HealthEvent]:
        s = self.session
        try:
            handle = s.call(pynvml.nvmlDeviceGetHandleByUUID, uuid, context=f"handle of {uuid}")
            supported = int(
                s.call(pynvml.nvmlDeviceGetSupportedEventTypes, handle, context=f"supported events of {uuid}")
            )
            mask = supported & WANTED_EVENT_TYPES
            if not mask & (EVENT_XID | EVENT_DBE):
                return self._unmonitored(
                    uuid, f"supports neither Xid nor double-bit ECC events (supported mask {supported:#x})"
                )
            s.call(pynvml.nvmlDeviceRegisterEvents, handle, mask, self._set, context=f"register events on {uuid}")
        except NvmlGpuIsLost as exc:
            self._count_error(exc)
            return self._mark_lost(uuid, str(exc))
        except NvmlError as exc:
            self._count_error(exc)
            return self._unmonitored(uuid, str(exc))
        self.registered[uuid] = mask
        self._by_address[_address(handle)] = uuid
        self.unmonitored.pop(uuid, None)
        return []

    def _mark_lost(self, uuid: str, detail: str) -> list[HealthEvent]:
        first = uuid not in self.lost
        self.lost.add(uuid)
        if first:
            log.error("GPU %s is lost: %s", uuid, detail)
        return [HealthEvent(uuid, FaultKind.GPU_LOST, time=self.clock(), detail=detail)]

    def _find_lost(self) -> list[HealthEvent]:
        """Probe every registered GPU after GPU_IS_LOST; mark the lost ones and rebuild the set if any."""
        found: list[HealthEvent] = []
        for uuid in list(self.registered):
            error = probe_gpu(self.session, uuid)
            if isinstance(error, NvmlGpuIsLost):
                found.extend(self._mark_lost(uuid, str(error)))
        if found:
            found.extend(self._rebuild())
        return found

    def _check_returned(self) -> list[HealthEvent]:
        """Probe lost GPUs; one that answers is registered again and reported through ``on_return``."""
        back = [uuid for uuid in sorted(self.lost) if probe_gpu(self.session, uuid) is None]
        if not back:
            return []
        for uuid in back:
            self.lost.discard(uuid)
            log.warning("GPU %s answers again after being lost", uuid)
        found = self._rebuild()
        for uuid in back:
            if self.on_return is not None:
                self.on_return(uuid)
        return found

    def _convert(self, data: Any) -> HealthEvent | None:
        etype = int(data.eventType)
        self.events_by_type[etype] = self.events_by_type.get(etype, 0) + 1
        uuid = self._by_address.get(_address(data.device))
        if uuid is None:
            try:
                raw = self.session.call(pynvml.nvmlDeviceGetUUID, data.device, context="UUID of an event's device")
            except NvmlError as exc:
                self._count_error(exc)
                log.warning("NVML event type %#x from an unknown device dropped: %s", etype, exc)
                return None
            uuid = raw.decode() if isinstance(raw, bytes) else str(raw)
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        now = self.clock()
        if etype == EVENT_XID:
            return HealthEvent(uuid, FaultKind.XID, time=now, xid=int(data.eventData), gi_id=gi, ci_id=ci,
                               recovery_action=self._recovery_action(data.device))
        fault = _FAULT_OF_TYPE.get(etype)
        if fault is None:
            log.debug("NVML event type %#x on %s (data %d) counted only", etype, uuid, int(data.eventData))
            return None
        kind, detail = fault
        if kind is FaultKind.GPU_LOST:  # scoped loss is still the whole GPU
            gi = ci = NO_MIG_SCOPE
        return HealthEvent(uuid, kind, time=now, gi_id=gi, ci_id=ci, detail=detail)

    def _recovery_action(self, device: Any) -> int | None:
        """The GPU's recovery action right after an Xid (field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, driver
        R565+), or ``None`` when NVML cannot say (older driver, NOT_SUPPORTED): the caller falls back to its
        table of reset Xids."""
        try:
            [value] = self.session.call(pynvml.nvmlDeviceGetFieldValues, device, [RECOVERY_ACTION_FIELD],
                                        context="GPU recovery action of an Xid")
        except NvmlError as exc:
            self._count_error(exc)
            return None
        except Exception as exc:  # a library without the call: pynvml raises its FunctionNotFound
            log.debug("no GPU recovery action: %s", exc)
            return None
        if int(value.nvmlReturn) != pynvml.NVML_SUCCESS:
            return None
        if int(value.valueType) == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
            return int(value.value.uiVal)
        return int(value.value.ullVal)

    def wait_once(self, timeout_ms: int | None = None) -> list[HealthEvent]:
        """One loop turn: probe lost GPUs, wait for one event, drain the queue; returns the faults read.

        Runs on the monitor thread; callable directly when the thread is not running.
        """
        found = self._check_returned() if self.lost else []
        if self._set is None or not self.registered:
            if not found:
                self._stop.wait((self.wait_timeout_ms if timeout_ms is None else timeout_ms) / 1000)
            return found
        timeout = self.wait_timeout_ms if timeout_ms is None else timeout_ms
        while True:
            try:
                data = self.session.call(pynvml.nvmlEventSetWait_v2, self._set, timeout, context="nvmlEventSetWait")
            except NvmlTimeout:
                return found
            except NvmlGpuIsLost:
                lost = self._find_lost()
                if not lost:  # nothing identifiable: do not spin on the error
                    log.warning("nvmlEventSetWait: GPU_IS_LOST but every registered GPU answers")
                    if not found:
                        self._stop.wait(self.wait_timeout_ms / 1000)
                found.extend(lost)
                return found
            except NvmlError as exc:
                self._count_error(exc)
                log.warning("%s", exc)
                if not found:
                    self._stop.wait(self.wait_timeout_ms / 1000)
                return found
            event = self._convert(data)
            if event is not None:
                found.append(event)
            timeout = 0  # drain what is already queued without waiting

    def _emit(self, events: list[HealthEvent]) -> None:
        if events:
            try:
                self.on_events(events)
            except Exception:  # a failing consumer must not end monitoring
                log.exception("health event consumer failed")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._emit(self.wait_once())
            except Exception:  # keep monitoring whatever happens
                log.exception("NVML event monitor turn failed")
                self._stop.wait(self.wait_timeout_ms / 1000)
