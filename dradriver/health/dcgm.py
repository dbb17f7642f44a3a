"""dcgm-exporter's metric names, units and labels, from the same poll samples (``--dcgm-compatible``).

Dashboards and alerts written for NVIDIA's dcgm-exporter keep working when dradriver serves the metrics:
:class:`DcgmCollector` writes the ``DCGM_FI_*`` series of dcgm-exporter's default counters
(``etc/default-counters.csv`` of NVIDIA/dcgm-exporter) that NVML can give without DCGM, in dcgm-exporter's
units (MHz, MiB, percent, W, mJ, Celsius), with its Prometheus types (a dcgm-exporter counter has no
``_total`` suffix) and its labels, in its order:

* ``gpu`` -- the GPU's NVML index (DCGM's GPU id); ``UUID`` -- the GPU's UUID (for a MIG device: its parent's);
  ``pci_bus_id`` -- NVML's bus id spelling (``00000000:07:00.0``, eight-digit domain, upper case);
  ``device`` -- ``nvidia<minor>``; ``modelName`` -- the product name;
* for a MIG device also ``GPU_I_PROFILE`` (``1g.10gb``) and ``GPU_I_ID`` (the GPU instance ID);
* ``Hostname`` -- the node name; ``DCGM_FI_DRIVER_VERSION`` -- the driver version (a ``label`` counter in
  dcgm-exporter's csv);
* on a device of a prepared claim, the DRA attribution labels dcgm-exporter >= 4.6 adds from the kubelet's
  PodResources and the ``gpu.nvidia.com`` ResourceSlices (NVIDIA/dcgm-exporter ``internal/pkg/transformation/dra.go``):
  ``dra_claim_name``, ``dra_claim_namespace``, ``dra_device_name``, ``dra_driver_name``, ``dra_pool_name``,
  and for a MIG device ``dra_mig_device_uuid`` and ``dra_mig_profile``; where the holder comes from the
  kubelet's PodResources (``dradriver exporter``), also ``pod``, ``namespace`` and ``container``, one series per
  container using the device (dcgm-exporter's series per pod of a shared GPU).

Series NVML answers NOT_SUPPORTED for (on MIG handles: everything but memory) are left out, never written
as 0, as dcgm-exporter leaves out blank fields. ``DCGM_FI_DEV_XID_ERRORS`` is the last Xid seen (0: none), a
gauge as in dcgm-exporter. ``docs/operations/metrics.md`` lists every series and its NVML source.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dradriver.domain.devices import GpuDevice, MigDevice, NodeInventory
from dradriver.domain.holders import DeviceHolder
from dradriver.domain.identity import GPU_DRIVER
from dradriver.health.attribution import ClaimLookup, DeviceSource, HolderLookup, InventoryView, holders_of

_MIB = float(1 << 20)

#: (DCGM field, Prometheus type, help as in dcgm-exporter's csv, poller field, factor to dcgm's unit).
FIELDS: tuple[tuple[str, str, str, str, float], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "sm_clock_mhz", 1.0),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "memory_clock_mhz", 1.0),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "temperature_celsius", 1.0),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "power_usage_milliwatts", 0.001),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
     "energy_millijoules", 1.0),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "gpu_utilization_percent", 1.0),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "memory_utilization_percent", 1.0),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "memory_free_bytes", 1 / _MIB),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "memory_used_bytes", 1 / _MIB),
    ("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB).", "memory_total_bytes", 1 / _MIB),
    ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "gauge", "PCIe transmit throughput (in KB/s).",
     "pcie_tx_kilobytes_per_second", 1.0),
    ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "gauge", "PCIe receive throughput (in KB/s).",
     "pcie_rx_kilobytes_per_second", 1.0),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors.",
     "ecc_sbe_volatile_total", 1.0),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.",
     "ecc_dbe_volatile_total", 1.0),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "Total number of single-bit persistent ECC errors.",
     "ecc_sbe_aggregate_total", 1.0),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Total number of double-bit persistent ECC errors.",
     "ecc_dbe_aggregate_total", 1.0),
    ("DCGM_FI_DEV_RETIRED_SBE", "counter", "Total number of retired pages due to single-bit errors.",
     "retired_pages_sbe", 1.0),
    ("DCGM_FI_DEV_RETIRED_DBE", "counter", "Total number of retired pages due to double-bit errors.",
     "retired_pages_dbe", 1.0),
    ("DCGM_FI_DEV_RETIRED_PENDING", "counter", "Total number of pages pending retirement.",
     "retired_pages_pending", 1.0),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for uncorrectable errors",
     "remapped_rows_uncorrectable", 1.0),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
     "remapped_rows_correctable", 1.0),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", "remapped_rows_failure", 1.0),
)  # fmt: skip

XID_METRIC = "DCGM_FI_DEV_XID_ERRORS"
BASE_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName")
MIG_LABELS = ("GPU_I_PROFILE", "GPU_I_ID")
NODE_LABELS = ("Hostname", "DCGM_FI_DRIVER_VERSION")
DRA_LABELS = ("dra_claim_name", "dra_claim_namespace", "dra_device_name", "dra_driver_name", "dra_pool_name")
DRA_MIG_LABELS = ("dra_mig_device_uuid", "dra_mig_profile")


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format version dcgm-exporter serves."""


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format, with counters named as dcgm-exporter names them.

    prometheus-client's own writer names every counter family ``<name>_total``; dcgm-exporter writes
    ``# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter`` and samples without the suffix. Here a family's
    ``# HELP``/``# TYPE`` line carries the name its samples carry (``_total`` unless they all lack it), so the
    ``DCGM_FI_*`` counters keep dcgm-exporter's names and prometheus-client's own counters keep theirs.
    """
    lines: list[str] = []
    for family in registry.collect():
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        name = family.name
        if family.type == "counter" and not (samples and all(s.name == name for s in samples)):
            name = f"{name}_total"  # prometheus-client's counters (their samples end in _total)
        kind = family.type if family.type in ("counter", "gauge", "histogram", "summary") else "untyped"
        lines.append(f"# HELP {name} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {name} {kind}")
        for s in samples:
            labels = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in s.labels.items())
            lines.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}" if labels
                         else f"{s.name} {floatToGoString(s.value)}")
    return ("\n".join(lines) + "\n").encode()


def nvml_bus_id(pci_bus_id: str) -> str:
    """``0000:07:00.0`` -> ``00000000:07:00.0``: NVML's ``busId`` spelling, which dcgm-exporter's
    ``pci_bus_id`` label carries (eight-digit domain, upper-case hex)."""
    parts = pci_bus_id.split(":")
    if len(parts) != 3:
        return pci_bus_id.upper()
    domain, bus, device_function = parts
    return f"{int(domain, 16):08X}:{bus.upper()}:{device_function.upper()}"


@dataclass(frozen=True, slots=True)
class _Entity:
    uuid: str
    name: str
    labels: dict[str, str]
    mig: MigDevice | None = None


class DcgmCollector(Collector):
    """``DCGM_FI_*`` series from the newest poll sample of ``source``; never calls NVML.

    A device several pod containers use has one series per container (``pod``, ``namespace``, ``container``),
    as dcgm-exporter writes them for a shared GPU (NVIDIA/dcgm-exporter PR #432); the device set follows the
    source's (:class:`~dradriver.health.attribution.InventoryView`), so a dynamic-MIG instance created after the
    start is labelled and attributed at the next scrape.

    :param node: the ``Hostname`` label and the DRA pool name.
    :param claim_of: device name -> ``(namespace, claim name)`` of each prepared claim holding it (the kubelet
        plugin).
    :param holders: the PodResources view of who holds which device (``dradriver exporter``); it wins over
        ``claim_of`` and adds ``pod``, ``namespace``, ``container``. With neither, no attribution labels.
    """

    def __init__(self, source: DeviceSource, *, node: str, claim_of: ClaimLookup | None = None,
                 holders: HolderLookup | None = None, driver: str = GPU_DRIVER.driver_name) -> None:
        self.source = source
        self.node = node
        self.claim_of = claim_of
        self.holders = holders
        self.driver = driver
        self._entities = InventoryView(source, self._derive)

    def _derive(self, inventory: NodeInventory) -> dict[str, _Entity]:
        version = inventory.versions.driver or ""
        entities: dict[str, _Entity] = {}
        for gpu in inventory.gpus:
            entities[gpu.uuid] = _Entity(gpu.uuid, gpu.name, self._base(gpu, version))
        for mig in inventory.migs:
            labels = self._base(mig.parent, version)
            labels = {**{k: labels[k] for k in BASE_LABELS}, "GPU_I_PROFILE": mig.profile,
                      "GPU_I_ID": str(mig.gi_id), **{k: labels[k] for k in NODE_LABELS}}
            entities[mig.uuid] = _Entity(mig.uuid, mig.name, labels, mig)
        return entities

    def _base(self, gpu: GpuDevice, version: str) -> dict[str, str]:
        return {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": nvml_bus_id(gpu.pci_bus_id),
                "device": f"nvidia{gpu.minor}", "modelName": gpu.product_name, "Hostname": self.node,
                "DCGM_FI_DRIVER_VERSION": version}

    def _label_sets(self, entity: _Entity, held: Mapping[str, Sequence[DeviceHolder]] | None
                    ) -> list[dict[str, str]]:
        """One label set per holder of the device (:func:`holders_of`) with the attribution labels, or one
        without them when nobody holds it; ``held`` is this scrape's PodResources view."""
        return [self._attributed(entity, h) for h in holders_of(entity.name, held, self.claim_of)] or [
            dict(entity.labels)]

    def _attributed(self, entity: _Entity, holder: DeviceHolder) -> dict[str, str]:
        out = dict(entity.labels)
        if holder.pod:
            out.update({"pod": holder.pod, "namespace": holder.namespace, "container": holder.container})
        out.update({"dra_claim_name": holder.claim_name, "dra_claim_namespace": holder.claim_namespace,
                    "dra_device_name": entity.name, "dra_driver_name": self.driver,
                    "dra_pool_name": holder.pool or self.node})
        if entity.mig is not None:
            out.update({"dra_mig_device_uuid": entity.mig.uuid, "dra_mig_profile": entity.mig.profile})
        return out

    def collect(self) -> Iterator[Metric]:
        sample = self.source.latest_sample()
        held = self.holders() if self.holders is not None else None
        labels = {uuid: self._label_sets(entity, held) for uuid, entity in self._entities.get().items()}
        if sample is not None:
            fields = set(sample.fields)
            rows = [u for u in sample.devices if u in labels]
            for metric, kind, help_text, field_name, scale in FIELDS:
                if field_name not in fields:
                    continue
                family = Metric(metric, help_text, kind)
                for uuid in rows:
                    value = sample.get(uuid, field_name)
                    if value is not None:
                        for label_set in labels[uuid]:
                            family.add_sample(metric, label_set, value * scale)
                if family.samples:
                    yield family
        yield self._xids(labels)

    def _xids(self, labels: Mapping[str, Sequence[dict[str, str]]]) -> Metric:
        xids = self.source.xid_stats()
        family = GaugeMetricFamily(XID_METRIC, "Value of the last XID error encountered.")
        for uuid, label_sets in labels.items():
            stats = xids.get(uuid)
            for label_set in label_sets:
                family.add_sample(XID_METRIC, label_set, float(stats.last if stats is not None else 0))
        return family
