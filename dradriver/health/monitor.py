"""The device health service: NVML events + polling -> device taints and the kubelet health stream.

One :class:`HealthMonitor` per node ties together

* the NVML event monitor (:class:`dradriver.nvml.events.EventMonitor`: Xid, ECC, GPU lost and returned,
  unmonitored GPUs),
* the Cython poller (:class:`dradriver.nvml.poller.PollLoop`) for what has no event: pages pending
  retirement (``NVML_FI_DEV_RETIRED_PENDING``), row-remap failure (``NVML_FI_DEV_REMAPPED_FAILURE``), a
  rising volatile double-bit ECC counter, GPU_IS_LOST answers, and on GPUs with NVLink fabric support the
  fabric info (``nvmlDeviceGetGpuFabricInfoV`` v3: a registration that failed, a ``healthSummary`` UNHEALTHY,
  NVIDIA's #626); a GPU that answers with none of those is reported to the tracker as recovered,
* the pure :class:`dradriver.domain.faults.HealthTracker` (classification, MIG scoping, quiet period).

Outputs:

* ``on_taints_changed({device name: [taint, ...]})`` (the ResourceSlice builder's ``taints`` argument),
  called once per coalesced change: changes are collected for ``debounce_s`` after the last one (at most
  ``max_delay_s`` after the first), so a burst of events becomes one slice update;
* :meth:`HealthMonitor.watch`, the :class:`dradriver.server.healthstream.HealthSource` of the kubelet's
  ``v1alpha1.DRAResourceHealth`` stream (KEP-4680, ``pkg/apis/dra-health/v1alpha1/api.proto`` in kubernetes/kubelet): a
  complete snapshot when a stream opens, again every ``snapshot_interval_s`` (default 10 s, well inside the kubelet's 30
  s staleness window), and one per change. A device with a taint other than effect ``None`` is ``Unhealthy`` with the
  fault as message; a device of a GPU that cannot be monitored is ``Unknown``; a VFIO passthrough device
  (``gpu-vfio-<index>``, gate ``PassthroughSupport``) is always ``Unknown``, and so is a GPU while passed through
  (its VFIO sibling held by a prepared claim, or on a VFIO driver at discovery, :meth:`HealthMonitor.set_held`):
  the host's NVML cannot see a GPU bound to ``vfio-pci``, so neither is polled through NVML (the NVML event set,
  opened at start, leaves out the GPUs passed through then; one passed through later stays in it until a restart);
* the readings the Prometheus device collector (:mod:`dradriver.health.metrics`) serves: latest sample,
  health states, Xid statistics, NVML errors by return code.

Threads: the event monitor's, and one worker that polls every ``poll_interval_s``, runs the quiet-period
clock and publishes changes. Time is ``time.monotonic()`` seconds throughout (the poller stamps samples
with it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dradriver.domain.devices import FABRIC_STATE_NOT_SUPPORTED, GpuDevice, NodeInventory
from dradriver.domain.faults import (
    DEFAULT_IGNORED_XIDS,
    TAINT_DOMAIN,
    DeviceHealthReport,
    Effect,
    FaultKind,
    HealthEvent,
    HealthTracker,
)
from dradriver.domain.migplacements import MigPlacement, instance_ids, published_devices
from dradriver.domain.passthrough import VfioDevice, passed_through, withdrawn
from dradriver.nvml import errors as nvml_errors
from dradriver.nvml.events import EventMonitor, read_fabric
from dradriver.nvml.poller import PollLoop, Sample
from dradriver.nvml.session import NvmlSession

log = logging.getLogger(__name__)

TaintMap = dict[str, list[dict[str, str]]]
"""Device name -> ``resource.k8s.io/v1`` DeviceTaint dicts (``key``, ``value``?, ``effect``)."""

HEALTHY, UNHEALTHY, UNKNOWN = "Healthy", "Unhealthy", "Unknown"
VFIO_UNMONITORED = "passed through to a VM (VFIO): the host's NVML cannot see the GPU, its health is not monitored"
"""The health-stream message of a VFIO device and of a GPU passed through."""



DeviceStatus = DeviceHealthReport
"""One device in a health-stream snapshot (the domain's :class:`DeviceHealthReport`)."""


@dataclass(slots=True)
class XidStats:
    """Xids seen on one device (GPU or MIG device UUID), informational ones included."""

    last: int = 0
    counts: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeviceView:
    """What the metrics collector needs about one published device (copied under the service lock).

    :param taints: ``(key, value, effect)`` of each taint.
    """

    name: str
    uuid: str
    health: str
    taints: tuple[tuple[str, str, str], ...]


class HealthMonitor:
    """Device health for one node; see the module docstring.

    :param inventory: discovered devices; published names and GPU/MIG UUIDs come from it.
    :param pool_name: the ResourceSlice pool (the node name) for the health stream.
    :param session: open NVML session for the event monitor and fabric queries; ``None``: polling only.
    :param ignored_xids: Xids that only get an informational (effect ``None``) taint.
    :param quiet_period_s: seconds without a fault, after NVML shows recovery, before taints are removed.
    :param snapshot_interval_s: seconds between unchanged snapshots on each health stream.
    :param poll_interval_s: seconds between polls (also bounds how soon recovery is seen).
    :param debounce_s: a change is published once no further change came for this long.
    :param max_delay_s: ... but at most this long after the first unpublished change.
    :param health_timeout_s: ``health_check_timeout_seconds`` sent to the kubelet (0: its default).
    :param informational_taints: publish effect-``None`` taints (Kubernetes >= 1.35).
    :param on_taints_changed: receives the full taint map after each coalesced change (worker thread);
        exceptions are logged.
    :param on_nvml_error: called with the ``nvmlReturn_t`` of each NVML failure the service sees.
    :param wait_timeout_ms: the event monitor's wait timeout (bounds :meth:`stop`).
    """

    def __init__(
        self,
        inventory: NodeInventory,
        *,
        pool_name: str,
        session: NvmlSession | None = None,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        quiet_period_s: float = 60.0,
        snapshot_interval_s: float = 10.0,
        poll_interval_s: float = 10.0,
        debounce_s: float = 0.25,
        max_delay_s: float = 2.0,
        health_timeout_s: int = 0,
        informational_taints: bool = True,
        on_taints_changed: Callable[[TaintMap], None] | None = None,
        on_nvml_error: Callable[[int], None] | None = None,
        wait_timeout_ms: int = 1000,
        taint_domain: str = TAINT_DOMAIN,
    ) -> None:
        self.inventory = inventory
        self._unmonitored_key = f"{taint_domain}/{FaultKind.UNMONITORED.value}"
        self.pool_name = pool_name
        self.session = session
        self.snapshot_interval_s = snapshot_interval_s
        self.poll_interval_s = poll_interval_s
        self.debounce_s = debounce_s
        self.max_delay_s = max(max_delay_s, debounce_s)
        self.health_timeout_s = health_timeout_s
        self.on_taints_changed = on_taints_changed
        self.on_nvml_error = on_nvml_error
        self.wait_timeout_ms = wait_timeout_ms
        self.tracker = HealthTracker(
            inventory,
            ignored_xids=ignored_xids,
            quiet_period_s=quiet_period_s,
            informational_taints=informational_taints,
            taint_domain=taint_domain,
        )
        self._held: frozenset[str] = frozenset()
        self._index(inventory)
        self.taint_updates = 0
        """Number of ``on_taints_changed`` calls so far."""
        self.published: TaintMap = {}
        """The taint map last handed to ``on_taints_changed``."""
        self.monitor: EventMonitor | None = None
        self.poll_loop: PollLoop | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._ended = threading.Event()  # set by a stop that ends the health streams (not by a pause)
        self._worker: threading.Thread | None = None
        self._first_change: float | None = None
        self._last_change: float | None = None
        self._version = 0
        self._watchers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._xids: dict[str, XidStats] = {}
        self._dbe: dict[str, float] = {}
        self._errors: dict[int, int] = {}
        self._errors_lock = threading.Lock()  # the poll, monitor and fabric paths all count errors
        self._poller_errors_seen: dict[int, int] = {}
        self._monitor_errors_seen: dict[int, int] = {}

    def _index(self, inventory: NodeInventory) -> None:
        passed = passed_through(inventory.vfio, self._held)
        away = {d.parent_uuid for d in passed if d.parent_uuid is not None}
        self._passed_gpus: frozenset[str] = frozenset(d.sibling for d in passed if d.sibling is not None)
        """Names of the GPUs passed through (``Unknown``, not polled)."""
        left_out = withdrawn(inventory.vfio, self._held)
        self._vfio: tuple[VfioDevice, ...] = tuple(d for d in inventory.vfio if d.name not in left_out)
        """The published VFIO devices (``Unknown``)."""
        self._passed_vfio: frozenset[str] = frozenset(d.name for d in passed)
        self.gpu_uuids: tuple[str, ...] = tuple(g.uuid for g in inventory.gpus if g.uuid not in away)
        self.device_uuids: tuple[str, ...] = self.gpu_uuids + tuple(
            m.uuid for m in inventory.migs if m.parent.uuid not in away)
        # the device's own UUID; a dynamic-MIG placement's is its instance's MIG UUID ("" while none exists)
        instances = instance_ids(inventory)
        self._uuid_of: dict[str, str] = {
            d.name: (instances[d.name][3] if d.name in instances else "") if isinstance(d, MigPlacement) else d.uuid
            for d in published_devices(inventory)}
        self._parent_of: dict[str, str] = {
            d.name: d.uuid if isinstance(d, GpuDevice) else d.parent.uuid for d in published_devices(inventory)}
        self._mig_uuid: dict[tuple[str, int, int], str] = {
            (m.parent.uuid, m.gi_id, m.ci_id): m.uuid for m in inventory.migs
        }

    def replace_inventory(self, inventory: NodeInventory) -> None:
        """Device-registry subscriber: health, snapshots and metrics follow the new device set at once.

        Devices that stay keep their health; new ones start healthy; gone ones leave the health stream. The
        poller is reopened for the new device set; the NVML event set keeps the GPUs it was opened for until the
        monitor restarts (devices added at run time by dynamic MIG are MIG devices of those GPUs, whose GPU-wide
        faults they inherit).
        """
        with self._lock:
            polled = self.device_uuids
            self.inventory = inventory
            self.tracker.replace_inventory(inventory)
            self._index(inventory)
            self._changed_locked(time.monotonic())
        if self.device_uuids != polled:
            self._repoll()

    def set_held(self, held: Collection[str]) -> None:
        """The devices prepared claims hold now (the batch runner's prepared devices), after each prepare and
        unprepare: a GPU whose VFIO sibling is held is passed through, so it leaves NVML polling (the poller is
        reopened without it) and reports ``Unknown``; it comes back when the sibling is released. Any thread.

        :param held: DRA device names; only VFIO devices and their siblings matter.
        """
        with self._lock:
            inventory = self.inventory
            relevant = {d.name for d in inventory.vfio} | {d.sibling for d in inventory.vfio if d.sibling}
            new = frozenset(held) & relevant
            if new == self._held:
                return
            polled = self.device_uuids
            self._held = new
            self._index(inventory)
            self._changed_locked(time.monotonic())
        if self.device_uuids != polled:
            self._repoll()

    def _repoll(self) -> None:
        """The poller samples the UUIDs it was opened for: open one for the new set and poll it (this thread)
        before it replaces the old one, so a MIG device created at run time has readings (and metrics) at once
        and a scrape meanwhile still reads the old sample."""
        if self._worker is None or not self.device_uuids:  # not started (start() opens it), or nothing to poll
            with self._poll_lock:
                loop, self.poll_loop = self.poll_loop, None
            if loop is not None:
                loop.stop()
            return
        try:
            fresh = PollLoop(self.device_uuids, interval_s=self.poll_interval_s, library=self._library())
        except nvml_errors.NvmlError as exc:
            self._count_error(exc.code)
            log.error("cannot reopen the NVML poller for the new device set: %s", exc)
            return
        try:
            sample = fresh.poll_once()
        except Exception as exc:
            log.error("NVML poll failed: %s", exc)
            fresh.stop()
            return
        with self._poll_lock:
            loop, self.poll_loop = self.poll_loop, fresh
            self._poller_errors_seen = {}
            self._collect_errors(fresh.errors_by_code, self._poller_errors_seen)
        if loop is not None:
            loop.stop()
        self._apply_sample(sample)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the poller and take the first sample (on this thread), register NVML events, start the worker.

        A poller that cannot be opened is logged and retried at every poll interval.
        """
        if self._worker is not None:
            return
        self._stop.clear()
        self._ended.clear()
        self._open_poller()
        self.poll_now()
        if self.session is not None and self.gpu_uuids:
            self.monitor = EventMonitor(
                self.session,
                self.gpu_uuids,
                on_events=self.record_many,
                on_return=self._gpu_returned,
                wait_timeout_ms=self.wait_timeout_ms,
            )
            self.monitor.start()
        self._worker = threading.Thread(target=self._run, name="device-health", daemon=True)
        self._worker.start()

    @property
    def running(self) -> bool:
        """Between :meth:`start` and :meth:`stop`."""
        return self._worker is not None

    def stop(self, *, end_streams: bool = True) -> None:
        """Stop the monitor and the worker, close the poller; open health streams end.

        :param end_streams: False for a pause (NVML initialised anew under a running plugin, after a VFIO swap): the
            kubelet's health streams stay open, answering the last snapshot, until :meth:`start` takes over. An
            ended stream makes the kubelet (``pkg/kubelet/cm/dra/manager.go``) report every device of the driver
            ``Unknown`` in the pods' ``allocatedResourcesStatus`` until it opens a new one, 5 s later.
        """
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self.monitor is not None:
            self.monitor.stop()
        if self._worker is not None:
            self._worker.join(timeout=10)
            self._worker = None
        if self._poll_lock.acquire(timeout=10):
            try:
                if self.poll_loop is not None:
                    self.poll_loop.stop()
                    self.poll_loop = None
            finally:
                self._poll_lock.release()
        else:  # a poll is stuck inside NVML: closing the poller under it would free what it uses
            log.error("an NVML poll did not finish within 10 s; leaving the poller open")
        if end_streams:
            self._ended.set()
            self._notify_watchers()

    def __enter__(self) -> HealthMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults in -------------------------------------------------------------------------------------------

    def record(self, event: HealthEvent) -> None:
        """Apply one fault (any thread)."""
        self.record_many([event])

    def record_many(self, events: Sequence[HealthEvent]) -> None:
        """Apply faults read together; the resulting change is published once (any thread)."""
        with self._wake:
            changed: set[str] = set()
            for event in events:
                if event.kind is FaultKind.XID and event.xid is not None:
                    target = event.gpu_uuid
                    if event.mig_scoped:
                        target = self._mig_uuid.get((event.gpu_uuid, event.gi_id or 0, event.ci_id or 0), target)
                    stats = self._xids.setdefault(target, XidStats())
                    stats.last = event.xid
                    stats.counts[event.xid] = stats.counts.get(event.xid, 0) + 1
                changed |= self.tracker.record(event)
            if changed:
                self._changed_locked(time.monotonic())

    def _gpu_returned(self, uuid: str) -> None:
        """A lost GPU answers again and is registered: drop a stale unmonitored taint."""
        if self.monitor is not None and uuid not in self.monitor.unmonitored:
            with self._wake:
                if self.tracker.clear(uuid, FaultKind.UNMONITORED, time.monotonic()):
                    self._changed_locked(time.monotonic())

    def _changed_locked(self, now: float) -> None:
        if self._first_change is None:
            self._first_change = now
        self._last_change = now
        self._wake.notify_all()

    # -- polling ---------------------------------------------------------------------------------------------

    def _open_poller(self) -> None:
        with self._poll_lock:
            if self.poll_loop is not None or not self.device_uuids:
                return
            try:
                self.poll_loop = PollLoop(self.device_uuids, interval_s=self.poll_interval_s, library=self._library())
            except nvml_errors.NvmlError as exc:
                self._count_error(exc.code)
                log.error("cannot open the NVML poller (retrying every %g s): %s", self.poll_interval_s, exc)

    def _library(self) -> str | None:
        """The NVML library file the session opened (after a driver reload: the new driver's), for the poller."""
        return self.session.library if self.session is not None else None

    def _count_error(self, code: int, n: int = 1) -> None:
        with self._errors_lock:
            self._errors[code] = self._errors.get(code, 0) + n
        if self.on_nvml_error is not None:
            for _ in range(n):
                self.on_nvml_error(code)

    def _collect_errors(self, source: Mapping[int, int], seen: dict[int, int]) -> None:
        for code, total in dict(source).items():  # copy: the owning thread may add codes meanwhile
            new = total - seen.get(code, 0)
            if new > 0:
                self._count_error(code, new)
                seen[code] = total

    def poll_now(self) -> Sample | None:
        """Poll NVML now on the calling thread and apply what the sample shows; returns the sample."""
        self._open_poller()
        with self._poll_lock:
            if self.poll_loop is None:
                return None
            try:
                sample = self.poll_loop.poll_once()
            except Exception as exc:
                log.error("NVML poll failed: %s", exc)
                return None
            self._collect_errors(self.poll_loop.errors_by_code, self._poller_errors_seen)
        self._apply_sample(sample)
        return sample

    def latest_sample(self) -> Sample | None:
        """The newest poll (never waits on NVML)."""
        loop = self.poll_loop
        return loop.latest if loop is not None else None

    def _fabric_fault(self, gpu: GpuDevice, now: float) -> HealthEvent | None:
        """A fabric fault of a GPU with fabric support (:attr:`~dradriver.domain.devices.FabricInfo.fault`:
        registration failed, or health summary UNHEALTHY), read now; a GPU still registering has none."""
        if self.session is None or gpu.fabric is None or gpu.fabric.state == FABRIC_STATE_NOT_SUPPORTED:
            return None
        try:
            info = read_fabric(self.session, gpu.uuid)
        except nvml_errors.NvmlError as exc:
            self._count_error(exc.code)
            if isinstance(exc, nvml_errors.NvmlGpuIsLost):
                return HealthEvent(gpu.uuid, FaultKind.GPU_LOST, time=now, detail=str(exc))
            return None
        fault = info.fault if info is not None else None
        if fault is None:
            return None
        return HealthEvent(gpu.uuid, FaultKind.FABRIC_UNHEALTHY, time=now, detail=fault.message, value=fault.reason)

    def _faults_in(self, sample: Sample, gpu: GpuDevice, now: float) -> list[HealthEvent]:
        uuid = gpu.uuid
        if any(sample.code(uuid, f) == nvml_errors.NvmlGpuIsLost.code for f in sample.fields):
            return [HealthEvent(uuid, FaultKind.GPU_LOST, time=now, detail="GPU_IS_LOST while polling")]
        found: list[HealthEvent] = []
        fields = set(sample.fields)
        if "retired_pages_pending" in fields and sample.get(uuid, "retired_pages_pending"):
            found.append(HealthEvent(uuid, FaultKind.RETIRED_PAGES_PENDING, time=now))
        if "remapped_rows_failure" in fields and sample.get(uuid, "remapped_rows_failure"):
            found.append(HealthEvent(uuid, FaultKind.ROW_REMAP_FAILURE, time=now))
        if "ecc_dbe_volatile_total" in fields:
            dbe = sample.get(uuid, "ecc_dbe_volatile_total")
            if dbe is not None:
                before = self._dbe.get(uuid)
                self._dbe[uuid] = dbe
                if before is not None and dbe > before:
                    found.append(
                        HealthEvent(
                            uuid,
                            FaultKind.DOUBLE_BIT_ECC,
                            time=now,
                            detail=f"volatile double-bit ECC count rose from {before:.0f} to {dbe:.0f}",
                        )
                    )
        fabric = self._fabric_fault(gpu, now)
        if fabric is not None:
            found.append(fabric)
        return found

    def _apply_sample(self, sample: Sample) -> None:
        now = time.monotonic()
        events: list[HealthEvent] = []
        recovered: list[str] = []
        rows = set(sample.devices)
        lost = self.monitor.lost if self.monitor is not None else set()
        for gpu in self.inventory.gpus:
            if gpu.uuid not in rows:
                continue
            faults = self._faults_in(sample, gpu, now)
            events.extend(faults)
            if not faults and gpu.uuid not in lost:
                recovered.append(gpu.uuid)
        with self._wake:
            changed: set[str] = set()
            for event in events:
                changed |= self.tracker.record(event)
            for uuid in recovered:
                changed |= self.tracker.observe_recovery(uuid, now, observed_at=sample.timestamp)
            if changed:
                self._changed_locked(now)

    # -- the worker ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_poll = time.monotonic() + self.poll_interval_s
        tick_every = max(0.05, min(1.0, self.tracker.quiet_period_s / 4))
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_poll:
                self.poll_now()
                next_poll = time.monotonic() + self.poll_interval_s
            if self.monitor is not None:
                with self._wake:
                    self._collect_errors(self.monitor.errors_by_code, self._monitor_errors_seen)
            with self._wake:
                now = time.monotonic()
                if self.tracker.tick(now):
                    self._changed_locked(now)
                due = self._due_locked()
                if due is None or due > now:
                    wake_at = min(next_poll, now + tick_every, due if due is not None else next_poll)
                    self._wake.wait(max(0.0, wake_at - now))
                    continue
            self.flush()

    def _due_locked(self) -> float | None:
        if self._first_change is None or self._last_change is None:
            return None
        return min(self._last_change + self.debounce_s, self._first_change + self.max_delay_s)

    def flush(self) -> bool:
        """Publish pending changes now (taint callback if the taints differ, health streams); True if any."""
        with self._wake:
            if self._first_change is None:
                return False
            self._first_change = self._last_change = None
            self._version += 1
            taints = self.tracker.taints()
        if taints != self.published:
            self.published = taints
            self.taint_updates += 1
            log.info("device taints changed: %s", {name: [t["key"] for t in ts] for name, ts in taints.items()})
            if self.on_taints_changed is not None:
                try:
                    self.on_taints_changed(taints)
                except Exception:
                    log.exception("publishing device taints failed")
        self._notify_watchers()
        return True

    # -- the kubelet health stream ---------------------------------------------------------------------------

    def taints(self) -> TaintMap:
        """The current taint map (published or not)."""
        with self._lock:
            return self.tracker.taints()

    def _health_locked(self, name: str) -> tuple[str, str]:
        state = self.tracker.states()[name]
        if not state.healthy:
            return UNHEALTHY, state.message
        if self._unmonitored_key in state.taints:
            parent = self._parent_of.get(name, "")
            reason = self.monitor.unmonitored.get(parent, "") if self.monitor is not None else ""
            return UNKNOWN, f"health events cannot be monitored: {reason}".rstrip(": ")
        informational = [t for t in state.taints.values() if t.effect is Effect.NONE]
        return HEALTHY, state.message if informational else ""

    def snapshot(self) -> list[DeviceStatus]:
        """Every published device's health now (the complete list the kubelet expects): GPUs and MIG devices, a GPU
        passed through and every published VFIO device ``Unknown`` (:data:`VFIO_UNMONITORED`)."""
        stamp = int(time.time())
        with self._lock:
            out = []
            for name in self.tracker.states():
                health, message = (UNKNOWN, VFIO_UNMONITORED) if name in self._passed_gpus \
                    else self._health_locked(name)
                out.append(DeviceStatus(self.pool_name, name, health, stamp, self.health_timeout_s, message))
            out.extend(DeviceStatus(self.pool_name, d.name, UNKNOWN, stamp, self.health_timeout_s, VFIO_UNMONITORED)
                       for d in self._vfio)
        return out

    def devices(self) -> list[DeviceView]:
        """Published devices with UUID, health word and taints (for the metrics collector); VFIO devices last,
        ``Unknown`` and untainted."""
        with self._lock:
            out = []
            for name, state in self.tracker.states().items():
                health = UNKNOWN if name in self._passed_gpus else self._health_locked(name)[0]
                taints = tuple((t.key, t.value, t.effect.value) for t in state.taints.values())
                out.append(DeviceView(name, self._uuid_of.get(name, ""), health, taints))
            out.extend(DeviceView(d.name, d.uuid, UNKNOWN, ()) for d in self._vfio)
        return out

    def passthrough(self) -> list[tuple[VfioDevice, bool]]:
        """Every VFIO device of the inventory with whether its GPU is passed through now (held by a claim, or on a
        VFIO driver at discovery), index order (the ``dradriver_gpu_passthrough`` metric)."""
        with self._lock:
            return [(d, d.name in self._passed_vfio) for d in self.inventory.vfio]

    def xid_stats(self) -> dict[str, XidStats]:
        """Device UUID -> Xids seen (copies)."""
        with self._lock:
            return {uuid: XidStats(s.last, dict(s.counts)) for uuid, s in self._xids.items()}

    def nvml_errors(self) -> dict[int, int]:
        """``nvmlReturn_t`` -> failed NVML calls seen by the poller, the monitor and the fabric queries."""
        with self._errors_lock:
            return dict(self._errors)

    def _notify_watchers(self) -> None:
        for loop, event in list(self._watchers):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop closed
                self._watchers.discard((loop, event))

    async def watch(self) -> AsyncIterator[list[DeviceStatus]]:
        """A new snapshot stream: one now, then on every published change and every ``snapshot_interval_s``.

        Ends when the service stops (not at a pause: :meth:`stop` with ``end_streams=False``).
        """
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        entry = (loop, changed)
        self._watchers.add(entry)
        try:
            while True:
                changed.clear()
                yield self.snapshot()
                if self._ended.is_set():
                    return
                try:
                    await asyncio.wait_for(changed.wait(), timeout=self.snapshot_interval_s)
                except TimeoutError:
                    pass
                if self._ended.is_set():
                    return
        finally:
            self._watchers.discard(entry)
