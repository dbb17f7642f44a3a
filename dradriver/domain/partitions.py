"""Dynamic MIG ResourceSlices: partitionable devices with shared counters (KEP-4815), one pool per node.

Contract (NVIDIA's ``cmd/gpu-kubelet-plugin/driver.go``, ``deviceinfo.go``, ``mig.go``, ``partitions.go``, ``nvlib.go``;
``resource/v1/types.go`` in kubernetes/api):

* per dynamic-MIG GPU (:func:`~dradriver.nvml.discovery.is_dynamic_mig_capable`, placements in
  ``NodeInventory.placements``): the counter set ``gpu-<minor>-counter-set`` with the counters
  ``multiprocessors``, ``copy-engines``, ``decoders``, ``encoders``, ``jpeg-engines``, ``ofa-engines``, ``memory``
  (each the per-dimension maximum over the GPU's profiles, zero values kept) and ``memory-slice-<i> = 1`` for
  ``i`` below the largest placement size seen (8 on every MIG GPU);
* one abstract device per placement (``type=mig``, ``parentUUID``, ``profile`` and the parent's attributes, **no**
  ``uuid``), capacities ``multiprocessors``, ``copyEngines``, ``decoders``, ``encoders``, ``jpegEngines``,
  ``ofaEngines`` (ints) and ``memory`` (``memorySizeMB * 2**20``), consuming the same values plus the
  ``memory-slice-<i>`` counters of its placement;
* on Hopper and newer also the full GPU (its usual attributes with ``uuid``; capacity = the counter maxima, as
  NVIDIA's) consuming every counter of its set; the set is published for an Ampere GPU too (placements only);
* GPUs without placements keep the devices of :mod:`dradriver.domain.resourceslices` (full GPU or static MIG).

Slice layout, by the API server's version (``server_version``):

* before 1.35 (combined, as NVIDIA's): one slice per dynamic-MIG GPU holding its counter set and its devices
  (1.34 requires a device's counter set in its own slice). 1.34 limits: 128 devices, 32 counters over all sets
  of a slice, 1024 consumed counters per slice; a GPU beyond them (no real MIG GPU is) keeps the devices that
  fit, in publish order, and the rest are dropped with a warning (a counter set cannot be split);
* from 1.35 (split): counter sets in slices of their own, at most 8 sets per slice (NVIDIA puts all of them in
  one slice, which the API refuses beyond 8 GPUs), then each GPU's devices in slices of at most 64 devices
  (``ResourceSliceMaxDevicesWithTaintsOrConsumesCounters``) and 1024 consumed counters;
* a counter set of more than 32 counters (``ResourceSliceMaxCountersPerCounterSet``) cannot be published: that GPU
  is published without dynamic MIG (its full GPU / static MIG devices) and a warning says why;
* slices of GPUs without placements follow, cut as :func:`dradriver.domain.pools.build` cuts them.

Device order (the scheduler takes the first device that fits, walking slices in name order (the publisher's
index prefix keeps ours in build order) and devices in list order,
``structured/internal/incubating/allocator_incubating.go`` in k8s.io/dynamic-resource-allocation), chosen so that first
fit packs one GPU before it spreads to the next:

1. GPUs by PCI bus ID, each GPU's devices together (a request tries every device of GPU 0 first);
2. within a GPU, abstract devices by compute slices, then memory, then GI profile ID (smallest first, so a
   small request never takes a big placement that a later big request would need);
3. placements of one profile from the highest start down, which keeps the low starts that the big profiles
   need (4g and 7g only start at 0, 3g at 0 or 4) free the longest;
4. the full GPU last.

Republishing: :class:`PartitionCache` keeps each GPU's built entries keyed by what they are built from, so a
republish rebuilds only GPUs whose attributes or placements changed; creating or destroying an instance changes
neither (the abstract devices stay, the scheduler's counters account for the allocation), so it rebuilds none.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dradriver.domain import resourceslices as rs
from dradriver.domain.devices import DeviceType, GpuDevice, NodeInventory
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.migplacements import MigPlacement, offers_full_gpu

log = logging.getLogger(__name__)

SPLIT_LAYOUT_SINCE = (1, 35)
"""First Kubernetes version whose slices carry either devices or counter sets (``resource/v1/types.go`` in
kubernetes/api)."""
MAX_COUNTER_SETS_PER_SLICE = rs.MAX_COUNTER_SETS_PER_SLICE
MAX_COUNTERS_PER_SET = rs.MAX_COUNTERS_PER_SET
MAX_CONSUMED_COUNTERS_PER_SLICE = rs.MAX_CONSUMED_COUNTERS_PER_SLICE
"""Kept from 1.35 on as well: a 64-device slice of MIG devices stays far below it."""
MAX_DEVICES_PER_SLICE_V134 = rs.MAX_DEVICES_PER_SLICE
"""1.34: 128 devices per slice, counters or not."""

COUNTERS: tuple[tuple[str, str], ...] = (
    ("multiprocessors", "multiprocessors"),
    ("copyEngines", "copy-engines"),
    ("decoders", "decoders"),
    ("encoders", "encoders"),
    ("jpegEngines", "jpeg-engines"),
    ("ofaEngines", "ofa-engines"),
    ("memory", "memory"),
)
"""(capacity name, counter name): NVIDIA's camelCase -> DNS-label conversion (``partitions.go``)."""

Device = dict[str, Any]


def counter_set_name(gpu: GpuDevice) -> str:
    """``gpu-<minor>-counter-set``."""
    return f"gpu-{gpu.minor}-counter-set"


def memory_slice_counter(index: int) -> str:
    """``memory-slice-<i>``."""
    return f"memory-slice-{index}"


def _values(p: MigPlacement) -> dict[str, int]:
    return {"multiprocessors": p.multiprocessors, "copyEngines": p.copy_engines, "decoders": p.decoders,
            "encoders": p.encoders, "jpegEngines": p.jpeg_engines, "ofaEngines": p.ofa_engines,
            "memory": p.memory_bytes}


def _quantity(capacity: str, value: int) -> dict[str, str]:
    return {"value": rs.quantity_bytes(value) if capacity == "memory" else str(value)}


def placement_order(p: MigPlacement) -> tuple[int, int, int, int]:
    """Sort key of the abstract devices of one GPU (rules 2 and 3 of the module docstring)."""
    return (p.slice_count, p.memory_bytes, p.gi_profile_id, -p.placement_start)


@dataclass(frozen=True, slots=True)
class GpuPartitions:
    """One dynamic-MIG GPU and what it offers.

    :param placements: its abstract devices, in publish order (:func:`placement_order`).
    :param full_gpu: whether the whole GPU is offered too (Hopper and newer).
    """

    gpu: GpuDevice
    placements: tuple[MigPlacement, ...]
    full_gpu: bool

    @property
    def memory_slices(self) -> int:
        """Memory slices of the GPU: the largest placement size seen (NVIDIA's rule; 8 on every MIG GPU)."""
        return max((p.placement_size for p in self.placements), default=0)

    @property
    def maxima(self) -> dict[str, int]:
        """Per-dimension maximum over the placements, by capacity name (the shared set and the full GPU)."""
        out = dict.fromkeys((c for c, _ in COUNTERS), 0)
        for p in self.placements:
            for key, value in _values(p).items():
                out[key] = max(out[key], value)
        return out


def partitioned_gpus(inventory: NodeInventory) -> list[GpuPartitions]:
    """The GPUs of ``inventory`` that have placements, by PCI bus ID, their placements in publish order."""
    by_parent: dict[str, list[MigPlacement]] = {}
    for p in inventory.placements:
        by_parent.setdefault(p.parent.uuid, []).append(p)
    out: list[GpuPartitions] = []
    for gpu in sorted(inventory.gpus, key=lambda g: (g.pci_bus_id, g.minor)):
        placements = by_parent.get(gpu.uuid)
        if placements:
            out.append(GpuPartitions(gpu, tuple(sorted(placements, key=placement_order)), offers_full_gpu(gpu)))
    return out


def counter_set(part: GpuPartitions) -> dict[str, Any]:
    """The ``sharedCounters`` entry of one GPU."""
    counters = {name: _quantity(cap, part.maxima[cap]) for cap, name in COUNTERS}
    for i in range(part.memory_slices):
        counters[memory_slice_counter(i)] = {"value": "1"}
    return {"name": counter_set_name(part.gpu), "counters": counters}


def _abstract_entry(p: MigPlacement, common: rs._CommonValues, set_name: str) -> Device:
    attrs = {
        "type": {"string": DeviceType.MIG.value},
        "parentUUID": {"string": p.parent.uuid},
        "profile": {"string": p.profile},
        **rs._gpu_attributes(p.parent, common),
    }
    values = _values(p)
    capacity = {cap: _quantity(cap, values[cap]) for cap, _ in COUNTERS}
    consumed = {name: _quantity(cap, values[cap]) for cap, name in COUNTERS}
    for i in p.memory_slices:
        consumed[memory_slice_counter(i)] = {"value": "1"}
    return {"name": p.name, "attributes": attrs, "capacity": capacity,
            "consumesCounters": [{"counterSet": set_name, "counters": consumed}]}


def _full_gpu_entry(part: GpuPartitions, common: rs._CommonValues, shared: Mapping[str, Any]) -> Device:
    gpu = part.gpu
    attrs = {"type": {"string": DeviceType.GPU.value}, "uuid": {"string": gpu.uuid},
             **rs._gpu_attributes(gpu, common), **rs._fabric_attributes(gpu.module_id, gpu.partitions, common)}
    maxima = part.maxima
    capacity = {cap: _quantity(cap, maxima[cap]) for cap, _ in COUNTERS}
    return {"name": gpu.name, "attributes": attrs, "capacity": capacity,
            "consumesCounters": [{"counterSet": shared["name"], "counters": dict(shared["counters"])}]}


@dataclass(frozen=True, slots=True)
class BuiltGpu:
    """One GPU's counter set and device entries (shared between builds: never mutate them)."""

    counter_set: dict[str, Any]
    devices: tuple[Device, ...]
    warnings: tuple[str, ...] = ()


def build_gpu(part: GpuPartitions, common: rs._CommonValues) -> BuiltGpu:
    """Counter set and devices of one GPU, in publish order, per-device API limits enforced."""
    warnings: list[str] = []
    shared = counter_set(part)
    devices = [_abstract_entry(p, common, shared["name"]) for p in part.placements]
    if part.full_gpu:
        devices.append(_full_gpu_entry(part, common, shared))
    for d in devices:
        rs._enforce_device_limits(d, warnings)
    return BuiltGpu(shared, tuple(devices), tuple(warnings))


def _gpu_key(part: GpuPartitions, common: rs._CommonValues) -> tuple[Any, ...]:
    """Everything the entries of one GPU are built from, and nothing else: MIG mode and existing instances do not
    change the published devices (the abstract devices stay; allocation consumes their counters), so creating or
    destroying an instance is a cache hit."""
    g = part.gpu
    return (
        g.uuid, g.minor, g.product_name, g.brand, g.architecture, g.cuda_compute_capability, g.pci_bus_id,
        g.pcie_root, g.numa_node, g.addressing_mode, g.module_id, tuple(sorted(g.partitions.items())), part.full_gpu,
        common,
        tuple((p.profile, p.gi_profile_id, p.placement_start, p.placement_size, p.memory_bytes, p.slice_count,
               p.multiprocessors, p.copy_engines, p.decoders, p.encoders, p.jpeg_engines, p.ofa_engines)
              for p in part.placements),
    )


@dataclass
class PartitionCache:
    """Built GPUs from the previous publish, keyed by what their entries are built from (:func:`_gpu_key`).
    Bounded by the GPUs of the last build: entries of GPUs that are gone are dropped. Counts :attr:`hits` and
    :attr:`misses`."""

    entries: dict[tuple[Any, ...], BuiltGpu] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def get(self, part: GpuPartitions, common: rs._CommonValues) -> tuple[tuple[Any, ...], BuiltGpu]:
        """``(key, built GPU)``, from the cache when nothing it is built from changed."""
        key = _gpu_key(part, common)
        built = self.entries.get(key)
        if built is None:
            self.misses += 1
            built = self.entries[key] = build_gpu(part, common)
        else:
            self.hits += 1
        return key, built

    def keep_only(self, keys: set[tuple[Any, ...]]) -> None:
        """Forget every entry not in ``keys``."""
        for key in [k for k in self.entries if k not in keys]:
            del self.entries[key]


def _consumed(device: Mapping[str, Any]) -> int:
    return sum(len(c.get("counters") or {}) for c in device.get("consumesCounters") or ())


def _chunks(devices: Sequence[Device], max_devices: int) -> list[list[Device]]:
    """Cut ``devices`` in order into runs of at most ``max_devices`` devices and 1024 consumed counters."""
    out: list[list[Device]] = []
    current: list[Device] = []
    counters = 0
    for d in devices:
        n = _consumed(d)
        if current and (len(current) >= max_devices or counters + n > MAX_CONSUMED_COUNTERS_PER_SLICE):
            out.append(current)
            current, counters = [], 0
        current.append(d)
        counters += n
    if current:
        out.append(current)
    return out


def _with_taints(devices: Sequence[Device], taints: Mapping[str, Sequence[rs.Taint]], seen: set[str]) -> list[Device]:
    out: list[Device] = []
    for d in devices:
        seen.add(d["name"])
        device_taints = list(taints.get(d["name"], ()))
        if len(device_taints) > rs.MAX_TAINTS_PER_DEVICE:
            raise rs.ResourceSliceError(
                f"device {d['name']}: {len(device_taints)} taints, at most {rs.MAX_TAINTS_PER_DEVICE} allowed")
        out.append({**d, "taints": [dict(t) for t in device_taints]} if device_taints else d)
    return out


def _advertised(devices: list[Device], advertised: Collection[str] | None) -> list[Device]:
    """``devices`` whose ``type`` attribute is in ``advertised`` (all of them when ``None``)."""
    if advertised is None:
        return devices
    return [d for d in devices if rs.advertises(advertised, d["attributes"]["type"]["string"])]


def build(
    inventory: NodeInventory,
    node_name: str,
    *,
    server_version: tuple[int, int],
    generation: int = 1,
    taints: Mapping[str, Sequence[rs.Taint]] | None = None,
    generate_name: bool = True,
    driver: str = GPU_DRIVER.driver_name,
    cache: PartitionCache | None = None,
    advertised: Collection[str] | None = None,
    fabric_partitions: bool = False,
) -> rs.SliceBuild:
    """Every ResourceSlice of ``node_name``'s pool with dynamic MIG (layout and order: module docstring).

    :param server_version: ``(major, minor)`` of the API server (``GET /version``), chooses the layout.
    :param taints: device name -> taints, copied onto the devices (names not in the pool: a warning).
    :param cache: reuse the GPUs that did not change since the previous build with the same cache.
    :param advertised: the device types published (``gpu``, ``mig``; ``None``: every one); the counter sets are
        published whatever is left out.
    :param fabric_partitions: ``FabricManagerPartitioning``: full GPUs carry ``gpuModuleID`` and
        ``partition<size>``.
    :returns: slices (at least one) and warnings.
    :raises dradriver.domain.resourceslices.ResourceSliceError: duplicate device names or more than 16 taints on
        one device.
    """
    warnings: list[str] = []
    taints = taints or {}
    cache = cache if cache is not None else PartitionCache()
    common = rs.common_values(inventory, fabric_partitions=fabric_partitions)
    split = server_version >= SPLIT_LAYOUT_SINCE
    built: list[BuiltGpu] = []
    partitioned: set[str] = set()
    keys: set[tuple[Any, ...]] = set()
    for part in partitioned_gpus(inventory):
        key, gpu_built = cache.get(part, common)
        keys.add(key)
        n_counters = len(gpu_built.counter_set["counters"])
        if n_counters > MAX_COUNTERS_PER_SET:
            warnings.append(f"{part.gpu.name} ({part.gpu.uuid}): counter set of {n_counters} counters, the API "
                            f"allows {MAX_COUNTERS_PER_SET}; published without dynamic MIG")
            continue
        partitioned.add(part.gpu.uuid)
        warnings.extend(gpu_built.warnings)
        built.append(gpu_built)
    cache.keep_only(keys)

    seen: set[str] = set()
    specs: list[dict[str, Any]] = []  # each: {"devices": [...]} and/or {"sharedCounters": [...]}
    if split:
        sets = [b.counter_set for b in built]
        for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE):
            specs.append({"sharedCounters": sets[i : i + MAX_COUNTER_SETS_PER_SLICE]})
        for b in built:
            tainted = _advertised(_with_taints(b.devices, taints, seen), advertised)
            for chunk in _chunks(tainted, rs.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS):
                specs.append({"devices": chunk})
    else:
        for b in built:
            devices = _advertised(_with_taints(b.devices, taints, seen), advertised)
            kept = _chunks(devices, MAX_DEVICES_PER_SLICE_V134)[0] if devices else []
            if len(kept) < len(devices):
                warnings.append(f"counter set {b.counter_set['name']}: {len(devices) - len(kept)} device(s) beyond "
                                "the Kubernetes 1.34 per-slice limits not published")
            specs.append({"sharedCounters": [b.counter_set], "devices": kept})

    rest = dataclasses.replace(
        inventory,
        gpus=tuple(g for g in inventory.gpus if g.uuid not in partitioned),
        migs=tuple(m for m in inventory.migs if m.parent.uuid not in partitioned),
        placements=(),
    )
    rest_taints = {k: v for k, v in taints.items() if k not in seen}
    legacy = (rs.device_entries(rest, taints=rest_taints, warnings=warnings, advertised=advertised)
              if rest.gpus else [])
    seen.update(d["name"] for d in legacy)
    legacy_size = (rs.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS if rs.needs_small_slices(legacy)
                   else rs.MAX_DEVICES_PER_SLICE)
    for i in range(0, len(legacy), legacy_size):
        specs.append({"devices": legacy[i : i + legacy_size]})
    # unknown-taint warnings come from device_entries for the legacy part; names in neither part:
    if not rest.gpus:
        for name in sorted(set(taints) - seen):
            warnings.append(f"taints for unknown device {name} ignored")
    names = [d["name"] for s in specs for d in s.get("devices", ())]
    if len(names) != len(set(names)):
        dup = next(n for n in names if names.count(n) > 1)
        raise rs.ResourceSliceError(f"device name {dup!r} appears twice in the pool")
    if not specs:
        specs.append({"devices": []})

    slices: list[dict[str, Any]] = []
    for body in specs:
        metadata: dict[str, Any] = {"generateName": f"{node_name}-{driver}-"} if generate_name else {}
        spec: dict[str, Any] = {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(specs)},
        }
        if "sharedCounters" in body:
            spec["sharedCounters"] = body["sharedCounters"]
        if "devices" in body:
            spec["devices"] = body["devices"]
        slices.append({"apiVersion": rs.API_VERSION, "kind": rs.KIND, "metadata": metadata, "spec": spec})
    for line in warnings:
        log.warning("%s", line)
    return rs.SliceBuild(slices, warnings)
