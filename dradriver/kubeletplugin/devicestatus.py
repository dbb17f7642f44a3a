"""``ResourceClaim.status.devices[]`` (KEP-4817 ``AllocatedDeviceStatus``): the concrete identity of every device a
kubelet plugin prepared, written off the prepare's path and removed at unprepare (``docs/user-guide/device-status.md``).

KEP-4817 ("DRA: Resource Claim Status with possible standardized network interface data", GA in Kubernetes 1.37;
the ``DRAResourceClaimDeviceStatus`` gate is on by default from 1.33) lets the driver that prepared a device publish
``data`` (any JSON object, at most 10 KiB) and ``conditions`` for it, one entry per allocated device keyed by
driver, pool, device and ``shareID``. NVIDIA's users asked for the concrete identity there (kubernetes-sigs/
dra-driver-nvidia-gpu#1456: dcgm-exporter and job tooling map a pod's devices to UUIDs without reading the node).

``data`` schema (stable: keys are only ever added; a consumer ignores keys it does not know):

================= =====================================================================================
device            ``data``
================= =====================================================================================
full GPU          ``uuid`` (``GPU-...``), ``pciBusID`` (``dddd:bb:dd.f``, lowercase)
MIG device        ``uuid`` (``MIG-...``), ``parentUUID``, ``gpuInstanceId``, ``computeInstanceId``,
(static and       ``profile`` (``1g.10gb``), ``placement`` ``{start, size}`` (memory slices)
dynamic)
VFIO device       ``uuid`` (the published ``uuid``), ``pciBusID``, ``parentUUID`` (the GPU's ``GPU-...``) and
                  ``iommuGroup`` (``/dev/vfio/<group>``) when known
MPS               the device's keys plus ``mpsControlDaemon`` ``{namespace, name}``: the Deployment of the MPS
                  control daemon serving it (a claim with ``sharing.strategy: MPS``, or an MPS consumable share)
IMEX channel      ``computeDomain`` ``{namespace, name, uid}``, ``clique`` (``<clusterUUID>.<cliqueID>``, ``""`` off
                  an NVLink clique), ``channels`` (the channel numbers the container gets)
IMEX daemon       ``computeDomain`` ``{namespace, name, uid}``, ``clique``
================= =====================================================================================

Each entry also carries the condition ``Ready=True`` (reason ``Prepared``). A consumable share's entry carries the
allocation result's ``shareID``. The entries are removed again when the claim is unprepared (the API also requires
each entry to match an allocated device, so a deallocated claim cannot keep them).

Cost on the prepare path: one :meth:`DeviceStatusWriter.prepared` call per prepared claim builds the entries from
the claim's undo records and the device registry (microseconds) and queues them; one background thread writes them
:attr:`DeviceStatusWriter.SETTLE_S` (0.5 s) later, one claim at a time, through
:func:`dradriver.kube.claims.publish_device_status` (a GET and a PUT of the status subresource; the same at
unprepare). Pending writes of one claim are coalesced (an unprepare before the prepare's write was sent cancels
both: a claim that lives less than the settle time costs nothing), a failed write is retried with backoff until it
succeeds, the claim is unprepared or the plugin stops, and nothing of it ever fails a prepare. The writes share the
plugin's interpreter with its gRPC calls, so the settle time also keeps them out of a burst of prepares. Pending writes
live in this process only, so each start queues the entries of every claim prepared before it again
(:meth:`DeviceStatusWriter.requeue`: one GET per claim in the background, a PUT only where they are missing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dradriver.domain import mps
from dradriver.domain.claims import ClaimRef
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.passthrough import VfioDevice
from dradriver.domain.ports import UndoRecord
from dradriver.kube import claims as kube_claims
from dradriver.kube import errors as kube_errors
from dradriver.kube.client import KubeClient
from dradriver.preparers import shares
from dradriver.preparers.computedomain import CHANNEL_KIND, DAEMON_KIND
from dradriver.preparers.dynamicmig import KIND as DYNAMIC_MIG_KIND
from dradriver.preparers.dynamicmig import identity_of
from dradriver.preparers.gpu import FullGpuPreparer, StaticMigPreparer
from dradriver.preparers.mps import MpsSharing

log = logging.getLogger(__name__)

DeviceData = dict[str, Any]
"""One device's ``status.devices[].data``."""

Describe = Callable[[Sequence[UndoRecord]], dict[str, DeviceData]]
"""A claim's undo records -> ``{DRA device name: data}`` for the devices it prepared."""


def device_data(device: object) -> DeviceData:
    """The identity of a full GPU, MIG or VFIO device as published (module docstring's schema); ``{}`` for anything else
    (a dynamic-MIG placement has no identity until its instance exists: its record gives it)."""
    if isinstance(device, GpuDevice):
        return {"uuid": device.uuid, "pciBusID": device.pci_bus_id}
    if isinstance(device, VfioDevice):
        data: DeviceData = {"uuid": device.uuid, "pciBusID": device.function.address}
        if device.parent_uuid is not None:
            data["parentUUID"] = device.parent_uuid
        if device.function.iommu_group is not None:
            data["iommuGroup"] = device.function.iommu_group
        return data
    if isinstance(device, MigDevice):
        return {"uuid": device.uuid, "parentUUID": device.parent.uuid, "gpuInstanceId": device.gi_id,
                "computeInstanceId": device.ci_id, "profile": device.profile,
                "placement": {"start": device.placement_start, "size": device.placement_size}}
    return {}


def gpu_describer(lookup: Callable[[str], object | None], *, mps_namespace: str) -> Describe:
    """The ``gpu.nvidia.com`` plugin's :data:`Describe`: full GPUs, static MIG and VFIO devices from the device registry
    (``lookup``: name -> device, read at prepare time, when the device exists), dynamic MIG devices and consumable
    shares from their records, the MPS control daemon (in ``mps_namespace``) of the MPS sharing step or share."""
    def daemon(daemon_id: str) -> dict[str, str]:
        return {"namespace": mps_namespace, "name": mps.deployment_name(daemon_id)}

    def describe(records: Sequence[UndoRecord]) -> dict[str, DeviceData]:
        out: dict[str, DeviceData] = {}
        daemons: dict[str, dict[str, str]] = {}
        for record in records:
            if record.kind in (FullGpuPreparer.kind, StaticMigPreparer.kind):
                if data := device_data(lookup(record.target)):
                    out[record.target] = data
            elif record.kind == DYNAMIC_MIG_KIND:
                if identity := identity_of(record):
                    out[record.target] = identity
            elif record.kind == shares.KIND:
                data = device_data(lookup(record.target)) or {"uuid": str(record.data.get("uuid", ""))}
                if record.data.get("daemon"):
                    data["mpsControlDaemon"] = daemon(str(record.data["daemon"]))
                out[record.target] = data
            elif record.kind == MpsSharing.kind and record.data.get("id"):
                for name in record.target.split(","):
                    daemons[name] = daemon(str(record.data["id"]))
            elif isinstance(vfio := lookup(record.target), VfioDevice):  # any step of the VFIO device preparer
                out.setdefault(record.target, device_data(vfio))
        for name, where in daemons.items():
            if name in out:
                out[name]["mpsControlDaemon"] = where
        return out

    return describe


def describe_channels(records: Sequence[UndoRecord]) -> dict[str, DeviceData]:
    """The ``compute-domain.nvidia.com`` plugin's :data:`Describe`: each IMEX channel or daemon device's
    ComputeDomain and clique (and a channel's channel numbers) from its record."""
    out: dict[str, DeviceData] = {}
    for record in records:
        if record.kind not in (CHANNEL_KIND, DAEMON_KIND) or not record.data.get("domain"):
            continue
        data: DeviceData = {
            "computeDomain": {"namespace": str(record.data.get("namespace", "")),
                              "name": str(record.data.get("name", "")), "uid": str(record.data["domain"])},
            "clique": str(record.data.get("clique") or "")}
        if record.kind == CHANNEL_KIND:
            channel = record.data.get("channel")
            channels = [channel] if isinstance(channel, int) else record.data.get("channels") or []
            data["channels"] = list(channels) if isinstance(channels, list) else []
        out[record.target] = data
    return out


@dataclass(slots=True)
class _Write:
    """A claim's pending write: ``devices`` to publish, or ``None`` to remove every entry of this driver's pool."""

    ref: ClaimRef
    devices: dict[str, DeviceData] | None
    due: float
    attempt: int = 0


PERMANENT = (kube_errors.KubeBadRequestError, kube_errors.KubeUnauthorizedError, kube_errors.KubeForbiddenError,
             kube_errors.KubeUnprocessableError)
"""Errors a retry cannot cure (a 403 means the plugin's role lacks ``update`` on ``resourceclaims/status``)."""


class DeviceStatusWriter:
    """Writes each prepared claim's device status once, on one background thread (module docstring).

    :param describe: a claim's undo records -> its devices' ``data`` (:func:`gpu_describer`,
        :func:`describe_channels`); called on the prepare's thread, so it must be cheap and do no I/O.
    :param retry_delays_s: pauses before the 1st, 2nd ... retry of a failed write, seconds (the last repeats).
    :param settle_s: how long a prepared claim's write waits before it is sent, seconds: a claim unprepared
        within it costs no write at all, and a burst of prepares is not slowed by writes competing for the
        process (the plugin's gRPC calls and these writes share one interpreter).
    :param requeue_spacing_s: seconds between the start-up writes of :meth:`requeue`.
    """

    RETRY_DELAYS_S: tuple[float, ...] = (0.2, 1.0, 5.0, 15.0, 60.0)
    SETTLE_S = 0.5
    REQUEUE_SPACING_S = 0.01
    """Seconds between the writes :meth:`requeue` queues at start (at most 100 claim reads a second)."""

    def __init__(self, client: KubeClient, *, driver: str, pool: str, describe: Describe,
                 retry_delays_s: Sequence[float] = RETRY_DELAYS_S, settle_s: float = SETTLE_S,
                 requeue_spacing_s: float = REQUEUE_SPACING_S) -> None:
        self.client, self.driver, self.pool, self.describe = client, driver, pool, describe
        self.retry_delays_s = tuple(retry_delays_s) or (1.0,)
        self.settle_s = settle_s
        self.requeue_spacing_s = requeue_spacing_s
        self.writes = 0
        """Writes sent to the API server (each a GET and, when something changed, a PUT), failed ones included."""
        self._cond = threading.Condition()
        self._pending: dict[str, _Write] = {}  # by claim UID, oldest first
        self._sent: set[str] = set()  # claims whose entries a write of this process may have published
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ runner hooks (the prepare's thread)
    def prepared(self, ref: ClaimRef, records: Sequence[UndoRecord]) -> None:
        """Runner hook: a claim's preparation is durable; queue its devices' entries (nothing to write: no-op)."""
        devices = self.describe(records)
        if devices:
            self._queue(_Write(ref, devices, time.monotonic() + self.settle_s))

    def unprepared(self, ref: ClaimRef, records: Sequence[UndoRecord]) -> None:
        """Runner hook: a claim was unprepared; queue the removal of its entries, or drop its write not yet sent."""
        with self._cond:
            pending = self._pending.get(ref.uid)
            if pending is not None and pending.devices is not None and ref.uid not in self._sent:
                del self._pending[ref.uid]
                self._cond.notify_all()
                return
        self._queue(_Write(ref, None, 0.0))

    # ------------------------------------------------------------------ start-up
    def requeue(self, claims: Iterable[tuple[ClaimRef, Sequence[UndoRecord]]]) -> int:
        """Start step, after recovery and before the servers answer a prepare: queue the entries of every claim
        prepared before this start (:meth:`~dradriver.kubeletplugin.runner.BatchRunner.prepared_claims`), so that
        none is left without them for good.

        A write lives in this process only (:attr:`SETTLE_S`, retries): a plugin killed within the settle time,
        or stopped while the API server refused a write, leaves a prepared claim without its ``status.devices``
        entries, and nothing but this start would write them (the kubelet does not prepare a claim again that
        its pod already uses). The start cannot know which claims lack them without asking the API server: the
        claim the kubelet's prepare fetched is not kept, and reading each claim here would make the start wait on
        one GET per claim. So every prepared claim is queued, and the writer's own read decides: each write GETs
        the claim and PUTs only when this driver's entries differ (:func:`~dradriver.kube.claims.
        publish_device_status`), so a claim whose entries are in place costs one GET and no write. The writes are
        spaced :attr:`REQUEUE_SPACING_S` apart after the settle time (1,000 claims: one GET every 10 ms, 10 s in
        the background, none on the prepare path), one at a time on the writer's thread, retried like any write.
        The start itself only builds the entries (microseconds per claim, no I/O). A claim the kubelet prepares
        or unprepares meanwhile has its newer write queued in place of this one.

        :param claims: (claim, its undo records) of each prepared claim.
        :returns: how many claims were queued (a claim with nothing to describe is not).
        """
        now = time.monotonic() + self.settle_s
        queued = 0
        for ref, records in claims:
            devices = self.describe(records)
            if not devices:
                continue
            if self._queue(_Write(ref, devices, now + queued * self.requeue_spacing_s), newer=False):
                queued += 1
        if queued:
            log.info("device status of %d prepared claim(s) queued for a check", queued)
        return queued

    # ------------------------------------------------------------------ the writer thread
    def _queue(self, write: _Write, *, newer: bool = True) -> bool:
        """Queue ``write``; it replaces a pending write of its claim when ``newer``, else yields to it. Returns
        whether it was queued."""
        with self._cond:
            if self._closed or (not newer and write.ref.uid in self._pending):
                return False
            self._pending.pop(write.ref.uid, None)  # the newer state replaces a pending one
            self._pending[write.ref.uid] = write
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="device-status", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def _next(self) -> _Write | None:
        """The oldest due write, waiting for one; ``None`` once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                due = [w for w in self._pending.values() if w.due <= now]
                if due:
                    write = due[0]
                    del self._pending[write.ref.uid]
                    if write.devices is not None:
                        self._sent.add(write.ref.uid)
                    self._busy = True
                    return write
                wait = min((w.due - now for w in self._pending.values()), default=None)
                self._cond.wait(timeout=wait)

    def _run(self) -> None:
        while (write := self._next()) is not None:
            try:
                self._write(write)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, write: _Write) -> None:
        self.writes += 1
        try:
            kube_claims.publish_device_status(self.client, write.ref, driver=self.driver, pool=self.pool,
                                              devices=write.devices, retry=False)
        except PERMANENT as exc:
            log.warning("claim %s: device status not written (the API server refused it; not retried): %s",
                        write.ref, exc)
        except kube_errors.KubeAPIError as exc:
            delay = self.retry_delays_s[min(write.attempt, len(self.retry_delays_s) - 1)]
            log.info("claim %s: device status not written (%s); retry %d in %.1f s", write.ref, exc,
                     write.attempt + 1, delay)
            with self._cond:
                if write.ref.uid not in self._pending:  # else a newer state of the claim supersedes this one
                    self._pending[write.ref.uid] = _Write(write.ref, write.devices, time.monotonic() + delay,
                                                          write.attempt + 1)
                    self._cond.notify_all()
            return
        if write.devices is None:
            with self._cond:
                self._sent.discard(write.ref.uid)

    # ------------------------------------------------------------------ control
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (retries waiting for their pause count as queued); False on
        timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the writes queued so far (at most ``timeout_s``), then stop the thread; writes still pending are
        dropped, logged (the next start queues the entries of every claim still prepared again: :meth:`requeue`)."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            left = list(self._pending.values())
            self._pending.clear()
            self._cond.notify_all()
            thread = self._thread
        if left:
            log.warning("device status of %d claim(s) not written at stop: %s", len(left),
                        ", ".join(str(w.ref) for w in left[:5]) + (", ..." if len(left) > 5 else ""))
        if thread is not None:
            thread.join(timeout=timeout_s)

