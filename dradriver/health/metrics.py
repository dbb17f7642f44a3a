"""Prometheus metrics with the official ``prometheus-client``, each set on its own ``CollectorRegistry``.

* :class:`DriverMetrics`: what the kubelet plugin does. The six metrics of NVIDIA's driver keep their names,
  labels and semantics (NVIDIA's ``pkg/metrics/``: ``nvidia_dra_requests_total`` etc., successes only,
  buckets ``0.05 * 2**k`` s), so existing dashboards keep working; ``dradriver_*`` metrics add outcomes,
  prepared claims, claim-store operations, ResourceSlice publish errors and NVML errors by return code.
* :class:`DeviceCollector`: per-GPU and per-MIG-device readings from the newest poll sample of a
  :class:`~dradriver.health.monitor.HealthMonitor` (a scrape never calls NVML), plus Xids and health, and with
  ``PassthroughSupport`` ``dradriver_gpu_passthrough`` per VFIO device (1 while its GPU is passed through).
* :func:`serve_metrics`: an HTTP server (prometheus-client's WSGI app on a threading ``wsgiref`` server)
  on ``host:port`` (``:8080``) at a configurable path.

Names follow the Prometheus conventions: base units in the name (bytes, seconds, watts, hertz, celsius,
joules), ratios 0..1, ``_total`` for counters. ``docs/operations/metrics.md`` lists every series and the dcgm-exporter
field it corresponds to.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from dradriver.domain.devices import NodeInventory
from dradriver.domain.holders import DeviceHolder
from dradriver.domain.identity import GPU_DRIVER
from dradriver.health.attribution import ClaimLookup, DeviceSource, HolderLookup, InventoryView, holders_of
from dradriver.nvml import errors as nvml_errors
from dradriver.nvml.poller import Sample

REQUEST_BUCKETS: tuple[float, ...] = tuple(0.05 * 2**k for k in range(9))
"""0.05 s ... 12.8 s, the buckets of ``nvidia_dra_request_duration_seconds`` (reference 6.3)."""

STORE_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Claim-store operation buckets (seconds): journal appends are sub-millisecond, fsyncs milliseconds."""

OPERATIONS = ("prepare", "unprepare")
DEVICE_TYPES = ("gpu", "mig", "vfio", "unknown")
PREPARE_ERROR_TYPES = ("lock_acquire", "prepare_devices", "publish_resources")
UNPREPARE_ERROR_TYPES = ("lock_acquire", "unprepare_devices", "publish_resources")
OUTCOMES = ("success", "error")

def nvml_error_name(code: int) -> str:
    """The ``nvmlReturn_t`` enumerator name for a code (``NVML_ERROR_GPU_IS_LOST``), ``"UNKNOWN"`` if new."""
    cls = nvml_errors.CLASS_BY_CODE.get(code)
    return cls.c_name if cls is not None else "UNKNOWN"


class NvmlErrorCollector(Collector):
    """``dradriver_nvml_errors_total{return_code, error}``: own counts plus cumulative sources."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._sources: list[Callable[[], Mapping[int, int]]] = []
        self._lock = threading.Lock()

    def count(self, code: int, n: int = 1) -> None:
        """Count ``n`` failed NVML calls that returned ``code``."""
        with self._lock:
            self._counts[code] = self._counts.get(code, 0) + n

    def add_source(self, source: Callable[[], Mapping[int, int]]) -> None:
        """Add a callable returning cumulative ``{nvmlReturn_t: count}`` (read at every scrape)."""
        self._sources.append(source)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            totals = dict(self._counts)
        for source in self._sources:
            for code, n in source().items():
                totals[code] = totals.get(code, 0) + n
        family = CounterMetricFamily(
            "dradriver_nvml_errors", "Failed NVML calls by nvmlReturn_t.", labels=("return_code", "error")
        )
        for code in sorted(totals):
            family.add_metric((str(code), nvml_error_name(code)), totals[code])
        yield family


class DriverMetrics:
    """The kubelet plugin's metrics on a private registry (several can coexist, e.g. in tests).

    :param node: node name (label ``node`` of the per-node gauges).
    :param driver: driver name (label ``driver``).
    :param registry: registry to use; a new one by default.
    :param process_metrics: also register prometheus-client's process and platform collectors.
    """

    def __init__(
        self,
        *,
        node: str,
        driver: str = GPU_DRIVER.driver_name,
        registry: CollectorRegistry | None = None,
        process_metrics: bool = True,
    ) -> None:
        self.node = node
        self.driver = driver
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if process_metrics:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
        self.requests = Counter(
            "nvidia_dra_requests", "Successful per-claim prepare/unprepare operations.",
            ("driver", "operation"), registry=r,
        )  # fmt: skip
        self.request_duration = Histogram(
            "nvidia_dra_request_duration_seconds", "Duration of successful per-claim operations.",
            ("driver", "operation"), buckets=REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "nvidia_dra_requests_inflight", "Per-claim operations in progress.", ("driver", "operation"), registry=r
        )
        self.prepared_devices = Gauge(
            "nvidia_dra_prepared_devices", "Devices of completely prepared claims, by type.",
            ("node", "driver", "device_type"), registry=r,
        )  # fmt: skip
        self.prepare_errors = Counter(
            "nvidia_dra_node_prepare_errors", "Failed prepare operations by stage.", ("driver", "error_type"),
            registry=r,
        )  # fmt: skip
        self.unprepare_errors = Counter(
            "nvidia_dra_node_unprepare_errors", "Failed unprepare operations by stage.", ("driver", "error_type"),
            registry=r,
        )  # fmt: skip
        self.stale_claims = Counter(
            "dradriver_stale_claims_unprepared", "Prepared claims unprepared by the stale-claim cleanup.",
            ("driver", "reason"), registry=r,
        )  # fmt: skip
        self.adopted_claims = Counter(
            "dradriver_adopted_claims", "Claims another plugin prepared, adopted at start, by source.",
            ("driver", "source"), registry=r,
        )  # fmt: skip
        self.claim_requests = Counter(
            "dradriver_claim_requests", "Per-claim prepare/unprepare operations by outcome.",
            ("driver", "operation", "outcome"), registry=r,
        )  # fmt: skip
        self.claim_request_duration = Histogram(
            "dradriver_claim_request_duration_seconds", "Duration of per-claim operations by outcome.",
            ("driver", "operation", "outcome"), buckets=REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.prepared_claims = Gauge(
            "dradriver_prepared_claims", "Claims prepared on this node.", ("node", "driver"), registry=r
        )
        self.store_operations = Counter(
            "dradriver_claim_store_operations", "Claim-store (journal) operations by outcome.",
            ("driver", "operation", "outcome"), registry=r,
        )  # fmt: skip
        self.store_duration = Histogram(
            "dradriver_claim_store_operation_duration_seconds", "Claim-store operation duration.",
            ("driver", "operation"), buckets=STORE_BUCKETS, registry=r,
        )  # fmt: skip
        self.publishes = Counter(
            "dradriver_resourceslice_publishes", "ResourceSlice syncs that wrote to the API server.",
            ("driver",), registry=r,
        )  # fmt: skip
        self.publish_errors = Counter(
            "dradriver_resourceslice_publish_errors", "Failed ResourceSlice syncs by reason.",
            ("driver", "reason"), registry=r,
        )  # fmt: skip
        self.driver_reloads = Counter(
            "dradriver_nvidia_driver_reloads", "NVIDIA driver reloads detected under the running plugin.",
            ("driver",), registry=r,
        )  # fmt: skip
        self.driver_available = Gauge(
            "dradriver_nvidia_driver_available", "1 while the NVIDIA driver is usable and prepares are served, "
            "0 while it is absent or its devices are being read again.", ("node", "driver"), registry=r,
        )  # fmt: skip
        self.nvml_errors = NvmlErrorCollector()
        r.register(self.nvml_errors)
        # Zero series exist from the start, as in NVIDIA's driver.
        for op in OPERATIONS:
            self.requests.labels(driver, op)
            self.request_duration.labels(driver, op)
            self.inflight.labels(driver, op)
            for outcome in OUTCOMES:
                self.claim_requests.labels(driver, op, outcome)
        for device_type in DEVICE_TYPES:
            self.prepared_devices.labels(node, driver, device_type)
        for et in PREPARE_ERROR_TYPES:
            self.prepare_errors.labels(driver, et)
        for et in UNPREPARE_ERROR_TYPES:
            self.unprepare_errors.labels(driver, et)
        self.prepared_claims.labels(node, driver)
        self.driver_reloads.labels(driver)
        self.driver_available.labels(node, driver)
        self.publishes.labels(driver)
        self.adopted_claims.labels(driver, "nvidia-checkpoint")

    # -- what the plugin calls -------------------------------------------------------------------------------

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: the library's lookup takes a lock and rebuilds the key on
        every call, which every claim paid ~20 times (a series, once made, is never removed here)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _observe(self, operation: str, outcome: str, seconds: float, error_type: str | None) -> None:
        d = self.driver
        self._child(self.claim_requests, d, operation, outcome).inc()
        self._child(self.claim_request_duration, d, operation, outcome).observe(seconds)
        if outcome == "success":
            self._child(self.requests, d, operation).inc()
            self._child(self.request_duration, d, operation).observe(seconds)
        else:
            errors = self.prepare_errors if operation == "prepare" else self.unprepare_errors
            default = "prepare_devices" if operation == "prepare" else "unprepare_devices"
            errors.labels(d, error_type or default).inc()

    def observe_prepare(self, outcome: str, seconds: float, *, error_type: str | None = None) -> None:
        """One claim's NodePrepareResources finished.

        :param outcome: ``"success"`` or ``"error"``.
        :param seconds: how long the claim took.
        :param error_type: stage that failed (``lock_acquire``, ``prepare_devices``, ``publish_resources``).
        """
        self._observe("prepare", outcome, seconds, error_type)

    def observe_unprepare(self, outcome: str, seconds: float, *, error_type: str | None = None) -> None:
        """One claim's NodeUnprepareResources finished (see :meth:`observe_prepare`)."""
        self._observe("unprepare", outcome, seconds, error_type)

    @contextlib.contextmanager
    def in_flight(self, operation: str) -> Iterator[None]:
        """Count an operation (``prepare``/``unprepare``) as in flight while the block runs."""
        gauge = self._child(self.inflight, self.driver, operation)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def set_prepared(self, claims: int, devices_by_type: Mapping[str, int]) -> None:
        """Prepared claims and their devices by type (``gpu``, ``mig``, ``vfio``, ``unknown``); types left out
        of ``devices_by_type`` are set to 0."""
        self._child(self.prepared_claims, self.node, self.driver).set(claims)
        for device_type in DEVICE_TYPES:
            self._child(self.prepared_devices, self.node, self.driver, device_type).set(
                devices_by_type.get(device_type, 0))
        for device_type in devices_by_type.keys() - set(DEVICE_TYPES):
            self._child(self.prepared_devices, self.node, self.driver, device_type).set(devices_by_type[device_type])

    def observe_claim_store(self, operation: str, outcome: str = "success", seconds: float | None = None) -> None:
        """One claim-store operation (``append``, ``compact``, ``recover``, ...) and its duration."""
        self.store_operations.labels(self.driver, operation, outcome).inc()
        if seconds is not None:
            self.store_duration.labels(self.driver, operation).observe(seconds)

    def count_stale_claim(self, reason: str) -> None:
        """The stale-claim cleanup unprepared a claim (``reason``: ``gone``, ``replaced``, ``unallocated``)."""
        self.stale_claims.labels(self.driver, reason).inc()

    def count_adopted_claims(self, source: str, n: int) -> None:
        """``n`` claims adopted at start from ``source`` (``nvidia-checkpoint``)."""
        self._child(self.adopted_claims, self.driver, source).inc(n)

    def observe_publish(self) -> None:
        """A ResourceSlice sync wrote to the API server."""
        self.publishes.labels(self.driver).inc()

    def count_publish_error(self, reason: str) -> None:
        """A ResourceSlice sync failed (``reason``: the error class, e.g. ``Conflict``, ``Timeout``)."""
        self.publish_errors.labels(self.driver, reason).inc()

    def count_driver_reload(self) -> None:
        """A reload of the NVIDIA driver under the running plugin was detected."""
        self._child(self.driver_reloads, self.driver).inc()

    def watch_driver(self, available: Callable[[], bool]) -> None:
        """Report ``available()`` (True: the driver is usable and prepares are served) at each scrape as
        ``dradriver_nvidia_driver_available`` (1/0)."""
        self._child(self.driver_available, self.node, self.driver).set_function(lambda: 1.0 if available() else 0.0)

    def count_nvml_error(self, code: int) -> None:
        """An NVML call of the plugin failed with ``nvmlReturn_t`` ``code``."""
        self.nvml_errors.count(code)

    def attach_devices(self, source: DeviceSource, *, claim_of: ClaimLookup | None = None,
                       dcgm_compatible: bool = False) -> Collector:
        """Register the device collector for ``source`` and its NVML error counts; returns the collector.

        :param dcgm_compatible: a :class:`dradriver.health.dcgm.DcgmCollector` (dcgm-exporter's names, units
            and labels, ``dra_*`` attribution from ``claim_of``) instead of a :class:`DeviceCollector`.
        """
        collector = device_collector(source, node=self.node, claim_of=claim_of, dcgm_compatible=dcgm_compatible,
                                     driver=self.driver)
        self.registry.register(collector)
        self.nvml_errors.add_source(source.nvml_errors)
        return collector


def device_collector(source: DeviceSource, *, node: str, claim_of: ClaimLookup | None = None,
                     holders: HolderLookup | None = None, dcgm_compatible: bool = False,
                     driver: str = GPU_DRIVER.driver_name) -> Collector:
    """The device collector of one naming mode: :class:`DeviceCollector` (``dradriver_*``) or, with
    ``dcgm_compatible``, :class:`dradriver.health.dcgm.DcgmCollector` (``DCGM_FI_*``); both attribute the same
    way (:func:`holders_of`)."""
    if dcgm_compatible:
        from dradriver.health.dcgm import DcgmCollector  # imports this module's types

        return DcgmCollector(source, node=node, claim_of=claim_of, holders=holders, driver=driver)
    return DeviceCollector(source, node=node, claim_of=claim_of, holders=holders)


# -- device metrics ----------------------------------------------------------------------------------------


class _DeviceView(Protocol):
    name: str
    uuid: str
    health: str
    taints: tuple[tuple[str, str, str], ...]


_LABELS = ("uuid", "device", "node", "namespace", "claim")
POD_LABELS = ("pod", "container")
"""Added to every device series where the users come from the kubelet's PodResources (``dradriver exporter``);
the kubelet plugin knows claims, not pods, and leaves them out."""

LabelSets = Mapping[str, Sequence[tuple[str, ...]]]
"""Device UUID -> the label values of each of its series (one per holder; one unattributed when none)."""

# (poller field, metric name, help, factor to the base unit)
_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("gpu_utilization_percent", "dradriver_gpu_utilization_ratio", "GPU busy fraction over the sample period.", 0.01),
    ("memory_utilization_percent", "dradriver_gpu_memory_utilization_ratio", "Memory controller busy fraction.", 0.01),
    ("memory_total_bytes", "dradriver_gpu_memory_total_bytes", "Framebuffer memory size.", 1.0),
    ("memory_used_bytes", "dradriver_gpu_memory_used_bytes", "Framebuffer memory allocated.", 1.0),
    ("memory_free_bytes", "dradriver_gpu_memory_free_bytes", "Framebuffer memory free.", 1.0),
    ("temperature_celsius", "dradriver_gpu_temperature_celsius", "GPU core temperature.", 1.0),
    ("power_usage_milliwatts", "dradriver_gpu_power_usage_watts", "Board power draw.", 0.001),
    ("sm_clock_mhz", "dradriver_gpu_sm_clock_hertz", "SM clock.", 1e6),
    ("memory_clock_mhz", "dradriver_gpu_memory_clock_hertz", "Memory clock.", 1e6),
    ("pcie_tx_kilobytes_per_second", "dradriver_gpu_pcie_transmit_bytes_per_second", "PCIe TX throughput.", 1024.0),
    ("pcie_rx_kilobytes_per_second", "dradriver_gpu_pcie_receive_bytes_per_second", "PCIe RX throughput.", 1024.0),
    ("retired_pages_pending", "dradriver_gpu_retired_pages_pending", "1 when retired pages wait for a reset.", 1.0),
    ("remapped_rows_pending", "dradriver_gpu_remapped_rows_pending", "1 when a row remap waits for a reset.", 1.0),
    ("remapped_rows_failure", "dradriver_gpu_remapped_rows_failure", "1 when a row remap failed.", 1.0),
)  # fmt: skip


class DeviceCollector(Collector):
    """Device series from the newest poll sample; never calls NVML.

    Each device's series carry ``namespace`` and ``claim`` of the ResourceClaim holding it and, with
    ``holders``, ``pod`` and ``container`` of the pod container using it (:func:`holders_of`); a device several
    users hold has one series per user, as dcgm-exporter writes them; a device nobody holds, one with those
    labels empty.

    :param source: the health service (sample, inventory, health, Xids); its device set is followed
        (:class:`~dradriver.health.attribution.InventoryView`).
    :param node: value of the ``node`` label.
    :param claim_of: device name -> ``(namespace, claim)`` of each prepared claim holding it (the kubelet
        plugin).
    :param holders: the PodResources view, called once per scrape (``dradriver exporter``); wins over
        ``claim_of``.
    """

    def __init__(self, source: DeviceSource, *, node: str, claim_of: ClaimLookup | None = None,
                 holders: HolderLookup | None = None) -> None:
        self.source = source
        self.node = node
        self.claim_of = claim_of
        self.holders = holders
        self.labels = _LABELS + POD_LABELS if holders is not None else _LABELS
        """The label names of every device series (then each family's own)."""
        self._names = InventoryView(source, _device_names)

    def _label_sets(self, uuid: str, name: str, held: Mapping[str, Sequence[DeviceHolder]] | None
                    ) -> list[tuple[str, ...]]:
        found = holders_of(name, held, self.claim_of)
        pods = self.holders is not None
        if not found:
            return [(uuid, name, self.node, "", "", "", "") if pods else (uuid, name, self.node, "", "")]
        if pods:
            return [(uuid, name, self.node, h.claim_namespace, h.claim_name, h.pod, h.container) for h in found]
        return [(uuid, name, self.node, h.claim_namespace, h.claim_name) for h in found]

    def collect(self) -> Iterator[Metric]:
        sample = self.source.latest_sample()
        held = self.holders() if self.holders is not None else None
        labels = {uuid: self._label_sets(uuid, name, held) for uuid, name in self._names.get().items()}
        if sample is not None:
            yield from self._sample_metrics(sample, labels)
        yield from self._health_metrics(labels, held)

    def _sample_metrics(self, sample: Sample, labels: LabelSets) -> Iterator[Metric]:
        fields = set(sample.fields)
        rows = [u for u in sample.devices if u in labels]
        for field_name, metric, help_text, scale in _GAUGES:
            if field_name not in fields:
                continue
            family = GaugeMetricFamily(metric, help_text, labels=self.labels)
            for uuid in rows:
                value = sample.get(uuid, field_name)
                if value is not None:
                    _add(family, labels[uuid], value * scale)
            yield family
        if "energy_millijoules" in fields:
            energy = CounterMetricFamily(
                "dradriver_gpu_energy_consumption_joules", "Energy used since the driver loaded.", labels=self.labels
            )
            for uuid in rows:
                value = sample.get(uuid, "energy_millijoules")
                if value is not None:
                    _add(energy, labels[uuid], value / 1000.0)
            yield energy
        ecc = CounterMetricFamily(
            "dradriver_gpu_ecc_errors", "ECC errors (volatile: since driver load; aggregate: lifetime).",
            labels=(*self.labels, "error", "counter"),
        )  # fmt: skip
        for field_name, error, counter in (
            ("ecc_sbe_volatile_total", "corrected", "volatile"),
            ("ecc_dbe_volatile_total", "uncorrected", "volatile"),
            ("ecc_sbe_aggregate_total", "corrected", "aggregate"),
            ("ecc_dbe_aggregate_total", "uncorrected", "aggregate"),
        ):
            if field_name in fields:
                for uuid in rows:
                    value = sample.get(uuid, field_name)
                    if value is not None:
                        _add(ecc, labels[uuid], value, error, counter)
        yield ecc
        retired = GaugeMetricFamily(
            "dradriver_gpu_retired_pages", "Framebuffer pages retired, by cause.", labels=(*self.labels, "cause")
        )
        for field_name, cause in (("retired_pages_sbe", "single_bit_ecc"), ("retired_pages_dbe", "double_bit_ecc")):
            if field_name in fields:
                for uuid in rows:
                    value = sample.get(uuid, field_name)
                    if value is not None:
                        _add(retired, labels[uuid], value, cause)
        yield retired
        remapped = GaugeMetricFamily(
            "dradriver_gpu_remapped_rows", "Memory rows remapped, by error type.", labels=(*self.labels, "error")
        )
        remap_fields = (("remapped_rows_correctable", "corrected"), ("remapped_rows_uncorrectable", "uncorrected"))
        for field_name, error in remap_fields:
            if field_name in fields:
                for uuid in rows:
                    value = sample.get(uuid, field_name)
                    if value is not None:
                        _add(remapped, labels[uuid], value, error)
        yield remapped
        stamp = GaugeMetricFamily(
            "dradriver_nvml_sample_timestamp_seconds", "Unix time of the poll these readings come from.",
            labels=("node",),
        )  # fmt: skip
        stamp.add_metric((self.node,), time.time() - (time.monotonic() - sample.timestamp))
        yield stamp

    def _health_metrics(self, labels: LabelSets, held: Mapping[str, Sequence[DeviceHolder]] | None
                        ) -> Iterator[Metric]:
        xids = self.source.xid_stats()
        last = GaugeMetricFamily(
            "dradriver_gpu_last_xid", "Most recent Xid reported for the device (0: none).", labels=self.labels
        )
        count = CounterMetricFamily("dradriver_gpu_xid_errors", "Xid errors by Xid.", labels=(*self.labels, "xid"))
        for uuid, label_sets in labels.items():
            stats = xids.get(uuid)
            _add(last, label_sets, stats.last if stats is not None else 0)
            if stats is not None:
                for xid, n in sorted(stats.counts.items()):
                    _add(count, label_sets, n, str(xid))
        yield last
        yield count
        health = GaugeMetricFamily(
            "dradriver_device_health", "1 for the published device's current health state.",
            labels=(*self.labels, "state"),
        )  # fmt: skip
        taints = GaugeMetricFamily(
            "dradriver_device_taint", "1 for each DRA device taint on a published device.",
            labels=(*self.labels, "key", "value", "effect"),
        )  # fmt: skip
        for view in self.source.devices():
            # a published device without a UUID (a dynamic-MIG placement with no instance) is labelled by name
            label_sets = labels.get(view.uuid) or self._label_sets(view.uuid, view.name, held)
            for state in ("Healthy", "Unhealthy", "Unknown"):
                _add(health, label_sets, 1.0 if view.health == state else 0.0, state.lower())
            for key, value, effect in view.taints:
                _add(taints, label_sets, 1.0, key, value, effect)
        yield health
        yield taints
        passthrough = GaugeMetricFamily(
            "dradriver_gpu_passthrough", "1 while the VFIO device's GPU is passed through to a VM (bound to a VFIO "
            "driver), 0 while the host has it; one series per VFIO device (gate PassthroughSupport).",
            labels=(*self.labels, "gpu", "pci_bus_id"),
        )  # fmt: skip
        for vfio, passed in self.source.passthrough():
            _add(passthrough, self._label_sets(vfio.uuid, vfio.name, held), 1.0 if passed else 0.0,
                 vfio.sibling or "", vfio.function.address)
        yield passthrough


def _device_names(inventory: NodeInventory) -> dict[str, str]:
    """GPU and MIG device UUID -> DRA device name (a dynamic-MIG instance's is its placement's name)."""
    names = {g.uuid: g.name for g in inventory.gpus}
    names.update({m.uuid: m.name for m in inventory.migs})
    return names


def _add(family: Metric, label_sets: Sequence[tuple[str, ...]], value: float, *extra: str) -> None:
    """One sample of ``family`` per label set of a device (``extra``: the family's own labels after them)."""
    for label_values in label_sets:
        family.add_metric((*label_values, *extra), value)  # type: ignore[attr-defined]


def exporter_registry(source: DeviceSource, *, node: str, process_metrics: bool = True,
                      dcgm_compatible: bool = False, claim_of: ClaimLookup | None = None,
                      holders: HolderLookup | None = None) -> CollectorRegistry:
    """A registry with the device collector and NVML error counts only (``dradriver exporter``).

    :param dcgm_compatible: device series under dcgm-exporter's ``DCGM_FI_*`` names, units and labels
        (:class:`dradriver.health.dcgm.DcgmCollector`) instead of the ``dradriver_*`` ones.
    :param claim_of: device name -> ``(namespace, claim)`` of each prepared claim holding it (attribution).
    :param holders: the kubelet's PodResources view (:data:`HolderLookup`), in both naming modes: ``pod``,
        ``namespace``, ``container`` and the claim labels, one series per container using a device.
    """
    registry = CollectorRegistry()
    if process_metrics:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    registry.register(device_collector(source, node=node, claim_of=claim_of, holders=holders,
                                       dcgm_compatible=dcgm_compatible))
    errors = NvmlErrorCollector()
    errors.add_source(source.nvml_errors)
    registry.register(errors)
    return registry


# -- HTTP ----------------------------------------------------------------------------------------------------


class MetricsEndpointError(ValueError):
    """``--http-endpoint`` is not ``[host]:port``."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``":8080"`` -> ``("0.0.0.0", 8080)``, ``"127.0.0.1:0"``, ``"[::1]:9400"`` -> ``("::1", 9400)``.

    :raises MetricsEndpointError: no port, or a port outside 0..65535.
    """
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise MetricsEndpointError(f"metrics endpoint {endpoint!r}: expected [host]:port, e.g. ':8080'")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class MetricsServer:
    """A running metrics HTTP server; :attr:`port` is the bound port, :meth:`stop` shuts it down."""

    def __init__(self, server: Any, thread: threading.Thread, path: str) -> None:
        self._server = server
        self._thread = thread
        self.path = path
        self.host: str = server.server_address[0]
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}{self.path}"

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, endpoint: str = ":8080", path: str = "/metrics", *,
                  dcgm_compatible: bool = False) -> MetricsServer:
    """Serve ``registry`` over HTTP at ``path`` (other paths: 404) on a daemon thread.

    :param dcgm_compatible: write the text format with :func:`dradriver.health.dcgm.exposition` (counters
        without the ``_total`` prometheus-client adds, as dcgm-exporter writes them).

    :raises MetricsEndpointError: malformed endpoint.
    :raises OSError: the address cannot be bound (port in use).
    """
    host, port = parse_endpoint(endpoint)
    metrics_app = make_wsgi_app(registry)
    wanted = "/" + path.strip("/")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO", "/").rstrip("/") != wanted.rstrip("/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"metrics are served at {wanted}\n".encode()]
        if dcgm_compatible:
            from dradriver.health import dcgm

            body = dcgm.exposition(registry)
            start_response("200 OK", [("Content-Type", dcgm.CONTENT_TYPE), ("Content-Length", str(len(body)))])
            return [body]
        return metrics_app(environ, start_response)

    server_class = ThreadingWSGIServer
    if ":" in host:
        import socket

        class _V6(ThreadingWSGIServer):
            address_family = socket.AF_INET6

        server_class = _V6
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(server, thread, wanted)
