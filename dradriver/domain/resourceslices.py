"""``resource.k8s.io/v1`` ResourceSlice objects for one node's GPUs and MIG devices: each device's entry, the
per-slice limits and their check (the pool's slices are put together by :mod:`dradriver.domain.pools`).

Contract (NVIDIA's ``cmd/gpu-kubelet-plugin/driver.go``, ``deviceinfo.go``, ``mig.go``; ``resource/v1/types.go`` in
kubernetes/api):

* driver ``gpu.nvidia.com``; one pool per node, named after the node; ``spec.nodeName`` set;
  ``spec.pool.generation`` and ``spec.pool.resourceSliceCount`` filled in; no ``metadata.name`` (the API
  server or the publisher names the slices; ``metadata.generateName`` is set when asked for).
* full GPU (``type=gpu``): attributes ``type``, ``uuid``, ``productName``, ``brand``, ``architecture``,
  ``driverVersion``, ``cudaDriverVersion``, ``cudaComputeCapability`` (versions, semver-normalised),
  ``pcieBusID`` and ``resource.kubernetes.io/pciBusID``, ``resource.kubernetes.io/pcieRoot`` and
  ``resource.kubernetes.io/numaNode`` when known, ``addressingMode`` (``HMM``/``ATS``/``None``) when NVML
  reports it; capacity ``memory`` in bytes (omitted when NVML reports NOT_SUPPORTED).
* MIG device (``type=mig``): ``uuid``, ``parentUUID``, ``profile`` plus the parent's attributes;
  capacities ``multiprocessors``, ``copyEngines``, ``decoders``, ``encoders``, ``jpegEngines``,
  ``ofaEngines``, ``memory`` (``memorySizeMB * 2**20`` bytes) and ``memorySlice<i> = 1`` for every
  memory slice of its placement.
* a GPU in MIG mode publishes only its MIG devices (:meth:`NodeInventory.allocatable`).
* VFIO passthrough device (``type=vfio``, gate ``PassthroughSupport``, :attr:`NodeInventory.vfio`; NVIDIA's
  ``deviceinfo.go`` ``GetVfioDevice``): ``uuid`` (:func:`dradriver.domain.passthrough.vfio_uuid`), ``deviceID`` and
  ``vendorID`` (``0x%04x``), ``productName``, ``iommuFDEnabled`` (bool: the host has ``/dev/iommu``),
  ``resource.kubernetes.io/pciBusID``, ``pcieRoot`` and ``numaNode`` when known; capacity ``addressableMemory``
  (bytes of the function's memory BARs); never shareable. A GPU and its VFIO sibling are both published until
  one of them is held by a prepared claim; the other is then left out (``held``,
  :func:`dradriver.domain.passthrough.withdrawn`).
* with ``FabricManagerPartitioning`` (``fabric_partitions``): full GPUs and VFIO devices add ``gpuModuleID``
  (int, NVML ``nvmlDeviceGetModuleId``) and ``partition<size>`` (int, the Fabric Manager partition of that size
  holding the GPU) when known.
* with consumable shares (``--consumable-shares`` other than ``disabled``, NVIDIA's
  ``cmd/gpu-kubelet-plugin/consumable_shares.go``): full GPUs and MIG devices get ``allowMultipleAllocations: true``,
  ``memory`` rounded down to a multiple of 1Mi with a ``requestPolicy`` (``default`` and ``validRange``), and in the
  integer mode a ``shares`` capacity (:func:`dradriver.domain.shares.request_policies`).

API limits enforced here: at most 128 devices per slice, 64 when any device of the pool carries taints or
consumes counters; at most 32 attributes plus capacities per device (the lowest-priority entries are dropped
with a warning); string attribute values at most 64 characters (a longer value is dropped with a warning,
never truncated into a wrong value). Devices are ordered by PCI bus ID then name and cut into equal-size
slices, so the same inventory always yields the same slices.

Value shapes: attributes ``{"string": s}``, ``{"int": i}``, ``{"bool": b}``, ``{"version": v}``; capacities
``{"value": "<quantity>"}`` where byte counts use the canonical Kubernetes binary-SI form (``"40Gi"``,
``"81559Mi"``, plain bytes when not a multiple of 1024).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dradriver.domain.devices import DeviceType, GpuDevice, MigDevice, NodeInventory
from dradriver.domain.passthrough import VfioDevice, withdrawn
from dradriver.domain.quantity import parse_quantity
from dradriver.domain.shares import ShareMode, request_policies
from dradriver.domain.versions import normalize_version
from dradriver.errors import DradriverError

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MAX_DEVICES_PER_SLICE = 128
"""``ResourceSliceMaxDevices``."""
MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS = 64
"""``ResourceSliceMaxDevicesWithTaintsOrConsumesCounters`` (Kubernetes 1.35+)."""
MAX_ATTRIBUTES_AND_CAPACITIES = 32
"""``ResourceSliceMaxAttributesAndCapacitiesPerDevice``."""
MAX_STRING_LENGTH = 64
"""``DeviceAttributeMaxValueLength`` for ``string`` and ``version`` values."""
MAX_TAINTS_PER_DEVICE = 16
"""``DeviceTaintsMaxLength`` (Kubernetes 1.35)."""

K8S_DOMAIN = "resource.kubernetes.io"
PCI_BUS_ID = f"{K8S_DOMAIN}/pciBusID"
PCIE_ROOT = f"{K8S_DOMAIN}/pcieRoot"
NUMA_NODE = f"{K8S_DOMAIN}/numaNode"

# Highest priority first. When a device exceeds the attribute+capacity limit, entries are dropped from the
# end of this order (names not listed rank just before the legacy ``pcieBusID`` duplicate).
_PRIORITY: tuple[str, ...] = (
    "type",
    "uuid",
    "parentUUID",
    "profile",
    "memory",
    "shares",
    "multiprocessors",
    "productName",
    "driverVersion",
    "cudaDriverVersion",
    "cudaComputeCapability",
    "architecture",
    "brand",
    PCI_BUS_ID,
    PCIE_ROOT,
    NUMA_NODE,
    "addressingMode",
    "deviceID",
    "vendorID",
    "iommuFDEnabled",
    "addressableMemory",
    "gpuModuleID",
    *(f"partition{n}" for n in (1, 2, 4, 8, 16)),
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
    *(f"memorySlice{i}" for i in range(16)),
)
_LEGACY_LAST = "pcieBusID"

Device = dict[str, Any]
Taint = Mapping[str, Any]


class ResourceSliceError(DradriverError):
    """The inventory cannot be published: duplicate device names or invalid taints (named in the message)."""


@dataclass(slots=True)
class SliceBuild:
    """Result of :func:`dradriver.domain.pools.build`: the slices and every warning issued while building them."""

    slices: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)


def quantity_bytes(value: int) -> str:
    """Canonical Kubernetes binary-SI quantity for a byte count: ``42949672960`` -> ``"40Gi"``.

    The largest suffix among Ki, Mi, Gi, Ti, Pi, Ei that divides ``value`` exactly is used (what
    ``resource.NewQuantity(v, BinarySI).String()`` prints); otherwise the plain integer.
    """
    if value < 0:
        raise ValueError(f"negative byte count {value}")
    if value == 0:
        return "0"
    for exponent, suffix in ((6, "Ei"), (5, "Pi"), (4, "Ti"), (3, "Gi"), (2, "Mi"), (1, "Ki")):
        unit = 1024**exponent
        if value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def _string(value: str) -> dict[str, Any]:
    return {"string": value}


def _int(value: int) -> dict[str, Any]:
    return {"int": value}


def _bool(value: bool) -> dict[str, Any]:
    return {"bool": value}


def _version(value: str) -> dict[str, Any]:
    return {"version": value}


def _count(value: int) -> dict[str, Any]:
    return {"value": str(value)}


@dataclass(frozen=True, slots=True)
class _CommonValues:
    """Node-wide version attributes, normalised once."""

    driver: str | None
    cuda_driver: str | None
    fabric_partitions: bool = False
    """``FabricManagerPartitioning``: publish ``gpuModuleID`` and ``partition<size>``."""


def _fabric_attributes(module_id: int | None, partitions: Mapping[int, int],
                       common: _CommonValues) -> dict[str, dict[str, Any]]:
    """``gpuModuleID`` and ``partition<size>`` of a full GPU or VFIO device, with ``FabricManagerPartitioning``."""
    if not common.fabric_partitions:
        return {}
    attrs: dict[str, dict[str, Any]] = {}
    if module_id is not None:
        attrs["gpuModuleID"] = _int(module_id)
    for size in sorted(partitions):
        attrs[f"partition{size}"] = _int(partitions[size])
    return attrs


def _gpu_attributes(gpu: GpuDevice, common: _CommonValues) -> dict[str, dict[str, Any]]:
    """Attributes shared by a GPU and the MIG devices carved from it (everything but type/uuid)."""
    attrs: dict[str, dict[str, Any]] = {
        "productName": _string(gpu.product_name),
        "brand": _string(gpu.brand),
        "architecture": _string(gpu.architecture),
    }
    if common.driver is not None:
        attrs["driverVersion"] = _version(common.driver)
    if common.cuda_driver is not None:
        attrs["cudaDriverVersion"] = _version(common.cuda_driver)
    cc = normalize_version(
        "{}.{}".format(*gpu.cuda_compute_capability), what=f"cudaComputeCapability of {gpu.name}"
    )
    if cc is not None:
        attrs["cudaComputeCapability"] = _version(cc)
    attrs["pcieBusID"] = _string(gpu.pci_bus_id)
    attrs[PCI_BUS_ID] = _string(gpu.pci_bus_id)
    if gpu.pcie_root:
        attrs[PCIE_ROOT] = _string(gpu.pcie_root)
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attrs[NUMA_NODE] = _int(gpu.numa_node)
    if gpu.addressing_mode is not None:
        attrs["addressingMode"] = _string(gpu.addressing_mode)
    return attrs


def _gpu_entry(gpu: GpuDevice, common: _CommonValues) -> Device:
    attrs = {"type": _string(DeviceType.GPU.value), "uuid": _string(gpu.uuid), **_gpu_attributes(gpu, common),
             **_fabric_attributes(gpu.module_id, gpu.partitions, common)}
    capacity: dict[str, dict[str, Any]] = {}
    if gpu.memory_bytes is not None:
        capacity["memory"] = {"value": quantity_bytes(gpu.memory_bytes)}
    return {"name": gpu.name, "attributes": attrs, "capacity": capacity}


def _vfio_entry(device: VfioDevice, common: _CommonValues) -> Device:
    function = device.function
    attrs: dict[str, dict[str, Any]] = {
        "type": _string(DeviceType.VFIO.value),
        "uuid": _string(device.uuid),
        "deviceID": _string(f"0x{function.device_id:04x}"),
        "vendorID": _string(f"0x{function.vendor_id:04x}"),
        "productName": _string(device.product_name),
        "iommuFDEnabled": _bool(device.iommufd),
        PCI_BUS_ID: _string(function.address),
    }
    if function.pcie_root:
        attrs[PCIE_ROOT] = _string(function.pcie_root)
    if function.numa_node is not None and function.numa_node >= 0:
        attrs[NUMA_NODE] = _int(function.numa_node)
    attrs.update(_fabric_attributes(device.module_id, device.partitions, common))
    capacity = {"addressableMemory": {"value": quantity_bytes(function.bar_bytes)}}
    return {"name": device.name, "attributes": attrs, "capacity": capacity}


def _mig_entry(mig: MigDevice, common: _CommonValues) -> Device:
    attrs = {
        "type": _string(DeviceType.MIG.value),
        "uuid": _string(mig.uuid),
        "parentUUID": _string(mig.parent.uuid),
        "profile": _string(mig.profile),
        **_gpu_attributes(mig.parent, common),
    }
    capacity: dict[str, dict[str, Any]] = {
        "multiprocessors": _count(mig.multiprocessors),
        "copyEngines": _count(mig.copy_engines),
        "decoders": _count(mig.decoders),
        "encoders": _count(mig.encoders),
        "jpegEngines": _count(mig.jpeg_engines),
        "ofaEngines": _count(mig.ofa_engines),
        "memory": {"value": quantity_bytes(mig.memory_bytes)},
    }
    for i in range(mig.placement_start, mig.placement_start + mig.placement_size):
        capacity[f"memorySlice{i}"] = _count(1)
    return {"name": mig.name, "attributes": attrs, "capacity": capacity}


def _policy_capacity(policy: Mapping[str, int], binary: bool) -> dict[str, Any]:
    """A ``DeviceCapacity`` with ``requestPolicy.default`` and ``requestPolicy.validRange`` from integer amounts."""
    render = quantity_bytes if binary else str
    return {
        "value": render(policy["value"]),
        "requestPolicy": {
            "default": render(policy["default"]),
            "validRange": {"min": render(policy["min"]), "max": render(policy["max"]),
                           "step": render(policy["step"])},
        },
    }


def _make_shareable(entry: Device, memory_bytes: int | None, shares: ShareMode) -> None:
    """Mark ``entry`` multi-allocatable and give it the request policies of ``shares`` (in place)."""
    entry["allowMultipleAllocations"] = True
    for name, policy in request_policies(shares, memory_bytes).items():
        entry["capacity"][name] = _policy_capacity(policy, binary=name == "memory")


def _rank(key: str) -> int:
    if key == _LEGACY_LAST:
        return len(_PRIORITY) + 1
    try:
        return _PRIORITY.index(key)
    except ValueError:
        return len(_PRIORITY)


def _enforce_device_limits(device: Device, warnings: list[str]) -> None:
    """Drop over-long strings, then the lowest-priority entries beyond the per-device limit (in place)."""
    attrs: dict[str, dict[str, Any]] = device["attributes"]
    for key in sorted(attrs):
        value = attrs[key]
        text = value.get("string", value.get("version"))
        if isinstance(text, str) and len(text) > MAX_STRING_LENGTH:
            del attrs[key]
            warnings.append(
                f"device {device['name']}: attribute {key} dropped, value longer than {MAX_STRING_LENGTH} "
                f"characters ({len(text)}): {text!r}"
            )
    capacity: dict[str, dict[str, Any]] = device["capacity"]
    keys = sorted([*attrs, *capacity], key=lambda k: (_rank(k), k))
    for key in keys[MAX_ATTRIBUTES_AND_CAPACITIES:]:
        attrs.pop(key, None)
        capacity.pop(key, None)
        warnings.append(
            f"device {device['name']}: {key} dropped, more than {MAX_ATTRIBUTES_AND_CAPACITIES} "
            "attributes and capacities"
        )
    if not capacity:
        del device["capacity"]


def _sort_key(dev: GpuDevice | MigDevice | VfioDevice) -> tuple[str, str]:
    if isinstance(dev, VfioDevice):
        return (dev.function.address, dev.name)
    bus = dev.pci_bus_id if isinstance(dev, GpuDevice) else dev.parent.pci_bus_id
    return (bus, dev.name)


def common_values(inventory: NodeInventory, *, fabric_partitions: bool = False) -> _CommonValues:
    """The node-wide values every entry of ``inventory``'s pool shares (versions normalised once)."""
    return _CommonValues(
        driver=normalize_version(inventory.versions.driver, what="driverVersion"),
        cuda_driver=(
            normalize_version(inventory.versions.cuda_driver_text, what="cudaDriverVersion")
            if inventory.versions.cuda_driver > 0
            else None
        ),
        fabric_partitions=fabric_partitions,
    )


def device_entries(
    inventory: NodeInventory,
    *,
    taints: Mapping[str, Sequence[Taint]] | None = None,
    warnings: list[str] | None = None,
    shares: ShareMode | None = None,
    advertised: Collection[str] | None = None,
    held: Collection[str] = (),
    fabric_partitions: bool = False,
) -> list[Device]:
    """The ``spec.devices`` entries of the whole pool (GPUs, MIG devices, VFIO devices), ordered by PCI bus ID then
    device name.

    :param shares: the ``--consumable-shares`` mode; when enabled every device is multi-allocatable with
        request policies (module docstring).
    :param advertised: the device types to publish (``gpu``, ``mig``, ``vfio``; the per-node device policy,
        :mod:`dradriver.domain.driverconfig`); ``None``: every device. Taints of a device left out are dropped
        silently.
    :param held: names of the devices completed claims hold (the batch runner's prepared devices): the sibling of
        each held GPU or VFIO device is left out (:func:`dradriver.domain.passthrough.withdrawn`), its taints
        dropped silently.
    :param fabric_partitions: ``FabricManagerPartitioning``: publish ``gpuModuleID`` and ``partition<size>``.

    :param taints: device name -> taints (each ``{"key", "effect", "value"?, "timeAdded"?}``), copied
        onto the device; taints for names not in the pool are reported as warnings.
    :param warnings: list that receives one line per dropped attribute or ignored taint (also logged).
    :raises ResourceSliceError: two devices share a name, or a device has more than 16 taints.
    """
    sink = warnings if warnings is not None else []
    start = len(sink)
    common = common_values(inventory, fabric_partitions=fabric_partitions)
    left_out = withdrawn(inventory.vfio, held)
    devices: list[Device] = []
    seen: set[str] = set()
    for dev in sorted((*inventory.allocatable(), *inventory.vfio), key=_sort_key):
        if dev.name in seen:
            raise ResourceSliceError(f"device name {dev.name!r} appears twice in the pool")
        seen.add(dev.name)
        if dev.name in left_out or not advertises(advertised, DeviceType.of(dev).value):
            continue
        entry: Device
        if isinstance(dev, VfioDevice):
            entry = _vfio_entry(dev, common)  # never shareable (NVIDIA's consumable_shares.go)
        else:
            entry = _gpu_entry(dev, common) if isinstance(dev, GpuDevice) else _mig_entry(dev, common)
            if shares is not None and shares.enabled:
                _make_shareable(entry, dev.memory_bytes, shares)
        _enforce_device_limits(entry, sink)
        device_taints = list((taints or {}).get(dev.name, ()))
        if len(device_taints) > MAX_TAINTS_PER_DEVICE:
            raise ResourceSliceError(
                f"device {dev.name}: {len(device_taints)} taints, at most {MAX_TAINTS_PER_DEVICE} allowed"
            )
        if device_taints:
            entry["taints"] = [dict(t) for t in device_taints]
        devices.append(entry)
    for name in sorted(set(taints or {}) - seen):
        sink.append(f"taints for unknown device {name} ignored")
    for line in sink[start:]:
        log.warning("%s", line)
    return devices


def advertises(advertised: Collection[str] | None, device_type: str) -> bool:
    """Whether a device of ``device_type`` is published under ``advertised`` (``None``: every type)."""
    return advertised is None or device_type in advertised


def needs_small_slices(devices: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the devices must go in slices of at most 64: any of them has taints or consumes counters."""
    return any(d.get("taints") or d.get("consumesCounters") for d in devices)


MAX_COUNTER_SETS_PER_SLICE = 8
"""``ResourceSliceMaxCounterSets`` (1.35)."""
MAX_COUNTERS_PER_SET = 32
"""``ResourceSliceMaxCountersPerCounterSet`` (1.35)."""
MAX_CONSUMPTIONS_PER_DEVICE = 2
"""``consumesCounters`` entries per device (1.35)."""
MAX_COUNTERS_PER_CONSUMPTION = 32
"""Counters of one ``consumesCounters`` entry (1.35)."""
MAX_CONSUMED_COUNTERS_PER_SLICE = 1024
"""1.34 ``ResourceSliceMaxDeviceCountersPerSlice``: counters consumed by all devices of one slice."""


def limit_violations(resource_slice: Mapping[str, Any], server_version: tuple[int, int] = (1, 35)) -> list[str]:
    """API limits that ``resource_slice`` breaks (empty when none); the OpenAPI schema does not check these.

    Checks: device count (128, or from 1.35 64 with taints/counters), attributes+capacities per device (32),
    ``string``/``version`` value length (64), device names unique within the slice, taints per device (16);
    counter sets per slice (8), counters per set (32), ``consumesCounters`` entries per device (2) and counters
    per entry (32), counters consumed per slice (1024); from ``server_version`` 1.35 a slice with both devices
    and ``sharedCounters``; before 1.35 more than 32 counters over all sets of a slice, or a device consuming a
    counter set that is not in its own slice (``resource/v1/types.go`` in kubernetes/api).
    """
    problems: list[str] = []
    spec = resource_slice.get("spec", {})
    sets: list[Mapping[str, Any]] = list(spec.get("sharedCounters") or [])
    if len(sets) > MAX_COUNTER_SETS_PER_SLICE:
        problems.append(f"{len(sets)} counter sets, limit {MAX_COUNTER_SETS_PER_SLICE}")
    for counter_set in sets:
        if len(counter_set.get("counters") or {}) > MAX_COUNTERS_PER_SET:
            problems.append(f"counter set {counter_set.get('name')}: more than {MAX_COUNTERS_PER_SET} counters")
    split = server_version >= (1, 35)
    if split and sets and spec.get("devices"):
        problems.append("devices and sharedCounters in one slice (Kubernetes 1.35+ allows one or the other)")
    if not split:
        total = sum(len(c.get("counters") or {}) for c in sets)
        if total > MAX_COUNTERS_PER_SET:
            problems.append(f"{total} counters over all counter sets, limit {MAX_COUNTERS_PER_SET} (1.34)")
    local_sets = {c.get("name") for c in sets}
    consumed = 0
    devices: list[Mapping[str, Any]] = list(resource_slice.get("spec", {}).get("devices") or [])
    limit = (
        MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
        if needs_small_slices(devices) and server_version >= (1, 35)
        else MAX_DEVICES_PER_SLICE
    )
    if len(devices) > limit:
        problems.append(f"{len(devices)} devices, limit {limit}")
    names = [d.get("name") for d in devices]
    for name in sorted({n for n in names if names.count(n) > 1}, key=str):
        problems.append(f"device name {name} repeated")
    for dev in devices:
        attrs = dev.get("attributes") or {}
        count = len(attrs) + len(dev.get("capacity") or {})
        if count > MAX_ATTRIBUTES_AND_CAPACITIES:
            problems.append(f"device {dev.get('name')}: {count} attributes and capacities")
        for key, value in attrs.items():
            text = value.get("string", value.get("version"))
            if isinstance(text, str) and len(text) > MAX_STRING_LENGTH:
                problems.append(f"device {dev.get('name')}: attribute {key} longer than {MAX_STRING_LENGTH}")
        if len(dev.get("taints") or []) > MAX_TAINTS_PER_DEVICE:
            problems.append(f"device {dev.get('name')}: more than {MAX_TAINTS_PER_DEVICE} taints")
        consumptions = list(dev.get("consumesCounters") or [])
        if len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
            problems.append(f"device {dev.get('name')}: {len(consumptions)} consumesCounters entries")
        for consumption in consumptions:
            counters = consumption.get("counters") or {}
            consumed += len(counters)
            if len(counters) > MAX_COUNTERS_PER_CONSUMPTION:
                problems.append(f"device {dev.get('name')}: consumes {len(counters)} counters of one set")
            if not split and consumption.get("counterSet") not in local_sets:
                problems.append(f"device {dev.get('name')}: counter set {consumption.get('counterSet')} not in "
                                "its slice (1.34)")
        for key, cap in (dev.get("capacity") or {}).items():
            problems.extend(f"device {dev.get('name')}: capacity {key}: {p}"
                            for p in _policy_violations(cap, bool(dev.get("allowMultipleAllocations"))))
    if consumed > MAX_CONSUMED_COUNTERS_PER_SLICE:
        problems.append(f"{consumed} consumed counters, limit {MAX_CONSUMED_COUNTERS_PER_SLICE}")
    return problems


def _amount(text: Any) -> int:
    value = parse_quantity(str(text)).value
    return int(value) if value.denominator == 1 else -1


def _policy_violations(capacity: Mapping[str, Any], multiple: bool) -> list[str]:
    """The ``DeviceCapacity.requestPolicy`` rules the OpenAPI schema cannot state (``resource/v1/types.go`` in
    kubernetes/api): only with ``allowMultipleAllocations``; ``validValues`` at most 10, ascending, each <= value,
    holding the default; ``validRange.min`` <= default <= ``max`` <= value, default on the step grid from ``min``."""
    policy = capacity.get("requestPolicy")
    if policy is None:
        return []
    if not multiple:
        return ["requestPolicy without allowMultipleAllocations"]
    value = _amount(capacity.get("value"))
    default = _amount(policy["default"]) if "default" in policy else None
    problems: list[str] = []
    if "validValues" in policy and "validRange" in policy:
        problems.append("both validValues and validRange")
    values = [_amount(v) for v in policy.get("validValues") or []]
    if values:
        if len(values) > 10 or values != sorted(set(values)) or values[-1] > value:
            problems.append("validValues must be at most 10 ascending values up to the capacity")
        if default is not None and default not in values:
            problems.append("default is not one of validValues")
    valid_range = policy.get("validRange")
    if valid_range is not None:
        low = _amount(valid_range.get("min"))
        high = _amount(valid_range["max"]) if "max" in valid_range else value
        step = _amount(valid_range["step"]) if "step" in valid_range else None
        if not 0 <= low <= high <= value:
            problems.append("validRange must satisfy 0 <= min <= max <= value")
        if default is not None and not low <= default <= high:
            problems.append("default outside validRange")
        if step is not None and (step <= 0 or (default is not None and (default - low) % step)):
            problems.append("default not on the validRange step grid")
    return problems
