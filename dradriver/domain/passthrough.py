"""VFIO passthrough: the PCI functions of a node's GPUs, their ``gpu-vfio-<index>`` devices, and Fabric Manager
partitions. Pure records and rules, no I/O (sysfs is read by :mod:`dradriver.host.pci`, Fabric Manager asked by
:mod:`dradriver.host.fabricmanager`).

Facts (kubernetes-sigs/dra-driver-nvidia-gpu ``cmd/gpu-kubelet-plugin/deviceinfo.go``, ``nvlib.go``,
``vfio-device.go``; the Linux kernel's ``Documentation/driver-api/vfio.rst`` and ``Documentation/ABI/testing/
sysfs-bus-pci``; NVIDIA Fabric Manager User Guide, "Shared NVSwitch virtualization model" and the FM SDK API):

* NVIDIA publishes one VFIO device per NVIDIA GPU PCI function (vendor ``0x10de``, class ``0x03xx``) with the gate
  ``PassthroughSupport``, named ``gpu-vfio-<index>``, ``<index>`` its position in the node's NVIDIA GPU functions
  in PCI address order; a GPU with MIG devices has none;
* its ``uuid`` attribute is the name-based (SHA-1, version 5) UUID of the PCI address in the DNS namespace;
* a GPU is offered as ``gpu-<minor>`` and as ``gpu-vfio-<index>`` (its sibling); once one is prepared the other is
  withdrawn from the pool until it is unprepared (:func:`withdrawn`); both may be allocated, to two claims, before
  either is prepared, so the later prepare is refused (:func:`sibling_conflicts`);
* the IOMMU group is the unit of isolation: every function of the group must be bound to a VFIO driver (or to no
  driver) before the group's ``/dev/vfio/<group>`` can be opened by a VM;
* a Fabric Manager partition is a set of GPUs (by physical/module ID) that may talk over NVLink; with
  ``FabricManagerPartitioning`` a claim's GPUs must be exactly one supported partition, activated at prepare.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

NVIDIA_VENDOR_ID = 0x10DE
"""PCI vendor ID of NVIDIA Corporation (the PCI-SIG vendor list; pci.ids)."""

DISPLAY_CLASS = 0x03
"""PCI base class "display controller" (``0x0300`` VGA, ``0x0302`` 3D controller): a GPU function."""

NVIDIA_DRIVER = "nvidia"
"""The kernel driver of a GPU NVML sees."""

VFIO_DRIVERS = ("nvgrace_gpu_vfio_pci", "vfio-pci", "vfio_pci")
"""Kernel drivers that make a function a VFIO device: the Grace-Hopper/Blackwell variant module
``nvgrace-gpu-vfio-pci`` (its driver name in sysfs ``nvgrace_gpu_vfio_pci``) and the generic ``vfio-pci``."""


@dataclass(frozen=True, slots=True)
class PciFunction:
    """One PCI function as sysfs shows it (``/sys/bus/pci/devices/<address>``).

    :param address: ``dddd:bb:dd.f`` lowercase (the sysfs directory name).
    :param vendor_id: ``vendor`` (e.g. ``0x10de``); ``device_id``: ``device``; ``class_code``: ``class`` (24 bits,
        ``0x030200`` for a 3D controller).
    :param driver: name of the bound driver (the ``driver`` link's target's last part), ``None`` when unbound.
    :param driver_override: ``driver_override`` content, ``None`` when empty (``(null)``).
    :param iommu_group: number of the ``iommu_group`` link's target, ``None`` without an IOMMU.
    :param numa_node: ``numa_node`` when ``>= 0``, else ``None``.
    :param sriov_numvfs: ``sriov_numvfs`` (0 when absent).
    :param bar_bytes: sum of the sizes of the memory BARs in ``resource`` (bytes): the addressable memory.
    :param vfio_cdev: the ``vfio-dev/vfio<N>`` entry (``"vfio3"``) when bound to a VFIO driver with the
        kernel's VFIO device cdev (iommufd), else ``None``.
    :param pcie_root: ``pci<domain>:<bus>`` of the root complex, from the device link's target, or ``None``.
    """

    address: str
    vendor_id: int
    device_id: int
    class_code: int
    driver: str | None = None
    driver_override: str | None = None
    iommu_group: int | None = None
    numa_node: int | None = None
    sriov_numvfs: int = 0
    bar_bytes: int = 0
    vfio_cdev: str | None = None
    pcie_root: str | None = None

    @property
    def is_nvidia_gpu(self) -> bool:
        """An NVIDIA display-class function (what NVIDIA's go-nvlib ``nvpci`` lists as a GPU)."""
        return self.vendor_id == NVIDIA_VENDOR_ID and (self.class_code >> 16) == DISPLAY_CLASS

    @property
    def on_vfio(self) -> bool:
        """Bound to one of :data:`VFIO_DRIVERS`."""
        return self.driver in VFIO_DRIVERS


@dataclass(frozen=True, slots=True)
class IommuGroup:
    """An IOMMU group (``/sys/kernel/iommu_groups/<number>/devices``).

    :param number: the group number (``/dev/vfio/<number>``).
    :param functions: every function of the group, by address, sorted.
    """

    number: int
    functions: tuple[PciFunction, ...]


def normalize_pci_address(address: str) -> str:
    """A PCI address as sysfs names the function (``dddd:bb:dd.f`` lowercase): NVML's and NVIDIA's checkpoint's
    8-digit domain (``00000000:18:00.0``) shortened to 4 digits where it fits."""
    text = address.strip().lower()
    domain, sep, rest = text.partition(":")
    if sep and len(domain) == 8 and domain.startswith("0000"):
        return f"{domain[4:]}:{rest}"
    return text


_PCIE_ROOT = re.compile(r"^pci[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}$")


def pcie_root_of(link_target: str) -> str | None:
    """``pci<domain>:<bus>`` (lowercase) of a PCI function from its sysfs ``bus/pci/devices/<address>`` link target
    (``../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0``: the element after ``devices`` is the root complex;
    Kubernetes ``k8s.io/dynamic-resource-allocation/deviceattribute`` ``GetPCIeRootAttributeByPCIBusID``), or ``None``
    when the target names none."""
    parts = [p for p in link_target.split("/") if p and p not in (".", "..")]
    for i, part in enumerate(parts[:-1]):
        if part == "devices" and _PCIE_ROOT.match(parts[i + 1]):
            return parts[i + 1].lower()
    return None


def vfio_device_name(index: int) -> str:
    """``gpu-vfio-<index>`` (NVIDIA's ``deviceinfo.go``)."""
    return f"gpu-vfio-{index}"


def vfio_uuid(address: str) -> str:
    """The ``uuid`` attribute of a VFIO device: ``uuid5(NAMESPACE_DNS, <PCI address>)`` (NVIDIA's ``nvlib.go``).

    :param address: ``dddd:bb:dd.f`` as sysfs names it.
    """
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, address))


@dataclass(frozen=True, slots=True)
class VfioDevice:
    """One ``gpu-vfio-<index>`` device: a GPU's PCI function offered for passthrough.

    :param index: position among the node's NVIDIA GPU functions in PCI address order.
    :param function: its PCI function as sysfs showed it at discovery.
    :param product_name: the GPU's NVML name when it was on ``nvidia`` at discovery, else the PCI device name.
    :param parent_minor: NVML minor (``gpu-<minor>``, its sibling) when the GPU is on ``nvidia`` or known from a
        claim's undo record; ``None`` when not known.
    :param parent_uuid: the GPU's NVML UUID (``GPU-...``) when known, else ``None``.
    :param iommufd: the host has ``/dev/iommu`` (``iommuFDEnabled``).
    :param module_id: NVML ``nvmlDeviceGetModuleId`` of the GPU (``gpuModuleID``; Fabric Manager's physical ID),
        ``None`` when unknown.
    :param partitions: Fabric Manager partition ID per partition size containing this GPU (``partition<size>``).
    """

    index: int
    function: PciFunction
    product_name: str
    parent_minor: int | None = None
    parent_uuid: str | None = None
    iommufd: bool = False
    module_id: int | None = None
    partitions: dict[int, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``gpu-vfio-<index>``."""
        return vfio_device_name(self.index)

    @property
    def uuid(self) -> str:
        """:func:`vfio_uuid` of the function's address."""
        return vfio_uuid(self.function.address)

    @property
    def sibling(self) -> str | None:
        """``gpu-<minor>`` of the same GPU, ``None`` when the minor is not known."""
        return None if self.parent_minor is None else f"gpu-{self.parent_minor}"


@dataclass(frozen=True, slots=True)
class FabricPartition:
    """One Fabric Manager partition (``fmFabricPartitionInfo_t``).

    :param partition_id: ``partitionId``.
    :param module_ids: the ``physicalId`` of each GPU in it (NVML's module ID of the GPU), sorted.
    :param active: ``isActive``.
    :param pci_bus_ids: ``pciBusId`` of each GPU as Fabric Manager reports it, in ``module_ids`` order.
    """

    partition_id: int
    module_ids: tuple[int, ...]
    active: bool = False
    pci_bus_ids: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Number of GPUs."""
        return len(self.module_ids)


class NvmlGpu(Protocol):
    """What :func:`vfio_devices` reads of an NVML GPU (a :class:`dradriver.domain.devices.GpuDevice`)."""

    @property
    def minor(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def product_name(self) -> str: ...
    @property
    def pci_bus_id(self) -> str: ...
    @property
    def mig_enabled(self) -> bool: ...


def pci_product_name(function: PciFunction) -> str:
    """The ``productName`` of a VFIO device whose GPU NVML does not see (bound to a VFIO driver, or to no driver):
    ``NVIDIA PCI device 0x<device ID>`` (NVIDIA takes the PCI database's name, which this driver does not ship)."""
    return f"NVIDIA PCI device {function.device_id:#06x}"


def vfio_devices(
    functions: Iterable[PciFunction],
    gpus: Iterable[NvmlGpu],
    *,
    iommufd: bool,
    module_ids: Mapping[str, int] | None = None,
    partitions: Mapping[str, Mapping[int, int]] | None = None,
    known_parents: Mapping[str, tuple[int, str]] | None = None,
) -> tuple[VfioDevice, ...]:
    """The node's ``gpu-vfio-<index>`` devices (the gate ``PassthroughSupport``), in PCI address order.

    Every NVIDIA GPU function (:attr:`PciFunction.is_nvidia_gpu`) takes an index, its position among them in
    address order, so names do not shift when a GPU enters MIG mode; then

    * a function whose address is an NVML GPU's ``pci_bus_id`` is that GPU's sibling (``parent_minor``,
      ``parent_uuid``, ``product_name`` from NVML); a GPU in MIG mode has no VFIO device (NVIDIA's
      ``cmd/gpu-kubelet-plugin/nvlib.go`` skips a parent with MIG devices: its hardware is published as MIG
      devices);
    * any other function (already on a VFIO driver, so NVML does not list it) keeps what ``known_parents`` says
      of it (address -> ``(minor, GPU UUID)``, e.g. from the undo record of the claim that bound it) and is named
      by :func:`pci_product_name`.

    :param functions: PCI functions as sysfs lists them (any order; non-GPU functions are ignored).
    :param gpus: the NVML GPUs (``dradriver.domain.devices.GpuDevice``).
    :param iommufd: the host has ``/dev/iommu`` (the ``iommuFDEnabled`` attribute).
    :param module_ids: PCI address -> NVML module ID (``gpuModuleID``), with ``FabricManagerPartitioning``.
    :param partitions: PCI address -> {partition size: Fabric Manager partition ID} (``partition<size>``).
    :returns: the devices, ``index`` ascending.
    """
    by_address = {gpu.pci_bus_id.lower(): gpu for gpu in gpus}
    nvidia = sorted((f for f in functions if f.is_nvidia_gpu), key=lambda f: f.address)
    out: list[VfioDevice] = []
    for index, function in enumerate(nvidia):
        gpu = by_address.get(function.address)
        if gpu is not None and gpu.mig_enabled:
            continue
        if gpu is not None:
            minor: int | None = gpu.minor
            parent_uuid: str | None = gpu.uuid
            product = gpu.product_name
        else:
            minor, parent_uuid = (known_parents or {}).get(function.address, (None, None))
            product = pci_product_name(function)
        out.append(VfioDevice(
            index=index, function=function, product_name=product, parent_minor=minor, parent_uuid=parent_uuid,
            iommufd=iommufd, module_id=(module_ids or {}).get(function.address),
            partitions=dict((partitions or {}).get(function.address, {}))))
    return tuple(out)


def withdrawn(vfio: Iterable[VfioDevice], held: Collection[str]) -> frozenset[str]:
    """The device names left out of the pool because their sibling is held: ``gpu-<minor>`` of every held
    ``gpu-vfio-<index>`` and ``gpu-vfio-<index>`` of every held ``gpu-<minor>`` (NVIDIA's
    ``cmd/gpu-kubelet-plugin/device_state.go`` withdraws the sibling while one is prepared).

    :param held: DRA device names that completed claims hold (the runner's prepared devices).
    """
    out: set[str] = set()
    for device in vfio:
        if device.sibling is None:
            continue
        if device.name in held:
            out.add(device.sibling)
        if device.sibling in held:
            out.add(device.name)
    return frozenset(out)


def sibling_conflicts(vfio: Iterable[VfioDevice], held: Collection[str],
                      devices: Sequence[str]) -> list[tuple[str, str]]:
    """The guard at prepare: ``(device, sibling)`` for each of a claim's ``devices`` whose sibling is held by another
    prepared claim or is among ``devices`` too (each such pair once, in ``devices`` order); empty when the claim may
    be prepared.

    The scheduler can allocate a GPU and its VFIO sibling to two claims before either is prepared: both are
    published until one is held, and nothing in the pool ties them (the counter layout that could,
    :mod:`dradriver.domain.partitions`, is used only with ``DynamicMIG``, which ``PassthroughSupport`` excludes).
    NVIDIA's driver has the same window. The second prepare must then fail (the kubelet retries; the claim is
    rescheduled once the first one is gone), which this finds.

    :param held: DRA device names completed claims hold, without the claim being prepared.
    :param devices: the claim's devices (DRA names).
    """
    sibling_of: dict[str, str] = {}
    for device in vfio:
        if device.sibling is not None:
            sibling_of[device.name] = device.sibling
            sibling_of[device.sibling] = device.name
    asked = set(devices)
    out: list[tuple[str, str]] = []
    seen: set[frozenset[str]] = set()
    for name in dict.fromkeys(devices):
        sibling = sibling_of.get(name)
        if sibling is None or frozenset((name, sibling)) in seen:
            continue
        if sibling in held or sibling in asked:
            seen.add(frozenset((name, sibling)))
            out.append((name, sibling))
    return out


def passed_through(vfio: Iterable[VfioDevice], held: Collection[str]) -> tuple[VfioDevice, ...]:
    """The VFIO devices whose GPU is given to a VM now: held by a claim, or found on a VFIO driver at discovery.
    Their GPUs are not the host's: NVML must not poll them, health reports them ``Unknown``."""
    return tuple(d for d in vfio if d.name in held or d.function.on_vfio)
