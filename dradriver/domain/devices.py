"""Devices found on a node: full GPUs, MIG devices, the NVLink fabric clique, and their DRA names.

Facts (NVIDIA's ``cmd/gpu-kubelet-plugin/deviceinfo.go``, ``mig.go``; NVIDIA's MIG User Guide):

* a full GPU is named ``gpu-<minor>``, with ``<minor>`` the NVML minor number (``/dev/nvidia<minor>``),
  not the enumeration index, so names do not shift when another GPU disappears;
* a MIG device is named ``gpu-<parent minor>-mig-<canonical profile>-<GI profile ID>-<placement start>``,
  where the canonical profile drops dots, lowercases, maps other characters to ``-`` (``1g.10gb+me`` ->
  ``1g10gb-me``);
* a GPU in MIG mode publishes its MIG devices and not itself;
* with ``PassthroughSupport`` every NVIDIA GPU function is also a ``gpu-vfio-<index>`` device
  (:mod:`dradriver.domain.passthrough`), the sibling of its ``gpu-<minor>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from dradriver.domain.passthrough import VfioDevice

MIB = 1024 * 1024


class DeviceType(str, Enum):
    """Value of the ``type`` attribute (NVIDIA's ``cmd/gpu-kubelet-plugin/deviceinfo.go``, ``mig.go``)."""

    GPU = "gpu"
    MIG = "mig"
    VFIO = "vfio"

    @classmethod
    def of(cls, device: object) -> DeviceType:
        """The published ``type`` of a registry entry: ``gpu`` for a full GPU; ``vfio`` for a
        :class:`~dradriver.domain.passthrough.VfioDevice`; ``mig`` for an existing MIG device and a dynamic-MIG
        placement."""
        if isinstance(device, GpuDevice):
            return cls.GPU
        return cls.VFIO if isinstance(device, VfioDevice) else cls.MIG


@dataclass(frozen=True, slots=True)
class DriverVersions:
    """Versions reported by the NVIDIA driver on this node.

    :param driver: ``nvmlSystemGetDriverVersion``, verbatim (e.g. ``"570.124.06"``).
    :param cuda_driver: ``nvmlSystemGetCudaDriverVersion_v2``, encoded ``1000*major + 10*minor`` (12080).
    :param nvml: ``nvmlSystemGetNVMLVersion``, verbatim.
    """

    driver: str
    cuda_driver: int
    nvml: str = ""

    @property
    def cuda_driver_text(self) -> str:
        """``"<major>.<minor>"`` as NVIDIA's driver derives it: ``v // 1000`` and ``(v % 1000) // 10``."""
        return f"{self.cuda_driver // 1000}.{(self.cuda_driver % 1000) // 10}"


@dataclass(frozen=True, slots=True)
class Clique:
    """The NVLink fabric clique a GPU belongs to (``nvmlDeviceGetGpuFabricInfo``).

    :param cluster_uuid: lowercase 8-4-4-4-12 text of ``clusterUuid``.
    :param clique_id: ``cliqueId`` (uint32).
    """

    cluster_uuid: str
    clique_id: int

    @property
    def id(self) -> str:
        """``<clusterUUID>.<cliqueId>``, the value of the ``nvidia.com/gpu.clique`` node label."""
        return f"{self.cluster_uuid}.{self.clique_id}"


FABRIC_STATE_NOT_SUPPORTED, FABRIC_STATE_NOT_STARTED, FABRIC_STATE_IN_PROGRESS, FABRIC_STATE_COMPLETED = 0, 1, 2, 3
"""``nvmlGpuFabricState_t`` values (nvml.h ``NVML_GPU_FABRIC_STATE_*``)."""
FABRIC_STATE_NAMES = {FABRIC_STATE_NOT_SUPPORTED: "NOT_SUPPORTED", FABRIC_STATE_NOT_STARTED: "NOT_STARTED",
                      FABRIC_STATE_IN_PROGRESS: "IN_PROGRESS", FABRIC_STATE_COMPLETED: "COMPLETED"}
FABRIC_HEALTH_UNHEALTHY = 2
"""``nvmlGpuFabricInfo_v3_t.healthSummary`` value ``NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY`` (nvml.h: 0 not
supported, 1 healthy, 2 unhealthy, 3 limited capacity)."""
FABRIC_REGISTRATION_FAILED = "registration-failed"
""":attr:`FabricFault.reason` of a GPU whose registration completed with an error status."""
FABRIC_UNHEALTHY = "unhealthy"
""":attr:`FabricFault.reason` of a GPU whose fabric health summary is UNHEALTHY."""

_HEALTH_MASK_FIELDS = (
    # (shift, width, {value: what it means when it is a problem}): nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*
    (0, 2, {1: "degraded bandwidth"}),
    (2, 2, {1: "route recovery in progress"}),
    (4, 2, {1: "route unhealthy"}),
    (6, 2, {1: "access-timeout recovery in progress"}),
    (8, 4, {2: "incorrect configuration: bad system GUID", 3: "incorrect configuration: bad chassis serial number",
            4: "incorrect configuration: no partition", 5: "incorrect configuration: insufficient NVLinks"}),
)


def describe_health_mask(mask: int) -> list[str]:
    """The problems a fabric ``healthMask`` reports (nvml.h ``NVML_GPU_FABRIC_HEALTH_MASK_*`` fields: degraded
    bandwidth, route recovery, route unhealthy, access-timeout recovery, incorrect configuration), in that order;
    empty when every field says "not supported" or "fine" (0xAA, 0x1AA on a healthy GB200/GB300)."""
    found: list[str] = []
    for shift, width, problems in _HEALTH_MASK_FIELDS:
        value = (mask >> shift) & ((1 << width) - 1)
        if value in problems:
            found.append(problems[value])
    return found


@dataclass(frozen=True, slots=True)
class FabricFault:
    """Why a GPU's NVLink fabric is not usable.

    :param reason: :data:`FABRIC_REGISTRATION_FAILED` or :data:`FABRIC_UNHEALTHY` (a DRA taint value).
    :param message: one line for people, without the GPU's name.
    """

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class FabricInfo:
    """GPU fabric state (``nvmlGpuFabricInfo`` v1-v3).

    :param state: 0 not supported, 1 not started, 2 in progress, 3 completed.
    :param health_summary: 0 not supported, 1 healthy, 2 unhealthy, 3 limited capacity.
    """

    cluster_uuid: str
    clique_id: int
    state: int
    status: int = 0
    health_mask: int = 0
    health_summary: int = 0

    @property
    def clique(self) -> Clique | None:
        """The clique, or ``None`` when the GPU is in no multi-node fabric (zero UUID, not supported)."""
        if self.state == 0 or set(self.cluster_uuid.replace("-", "")) <= {"0"}:
            return None
        return Clique(self.cluster_uuid, self.clique_id)

    @property
    def registering(self) -> bool:
        """The fabric manager has not finished registering the GPU (state NOT_STARTED or IN_PROGRESS): a passing
        state at boot, or until the fabric manager runs (NVIDIA's #1264)."""
        return self.state in (FABRIC_STATE_NOT_STARTED, FABRIC_STATE_IN_PROGRESS)

    @property
    def fault(self) -> FabricFault | None:
        """Why the GPU's fabric is not usable, or ``None``: registration completed with a status other than
        ``NVML_SUCCESS`` (registration failed), or health summary UNHEALTHY (``nvidia-smi -q``: Fabric / Health /
        Summary; NVIDIA's #626). A GPU still registering, or without fabric support, has no fault."""
        if self.state != FABRIC_STATE_COMPLETED:
            return None
        if self.status != 0:
            return FabricFault(FABRIC_REGISTRATION_FAILED,
                               f"NVLink fabric registration failed (status: NVML error {self.status})")
        if self.health_summary == FABRIC_HEALTH_UNHEALTHY:
            problems = ", ".join(describe_health_mask(self.health_mask))
            return FabricFault(FABRIC_UNHEALTHY, f"NVLink fabric health summary UNHEALTHY (health mask "
                                                 f"{self.health_mask:#x}{': ' + problems if problems else ''})")
        return None


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One physical GPU as NVML reports it.

    :param index: NVML enumeration index (unstable across reboots; never used in names).
    :param minor: NVML minor number; ``/dev/nvidia<minor>``.
    :param memory_bytes: framebuffer total in bytes (``nvmlDeviceGetMemoryInfo`` ``total``), or
        ``None`` when NVML reports NOT_SUPPORTED.
    :param pci_bus_id: normalised ``dddd:bb:dd.f`` lowercase (NVIDIA's ``cmd/gpu-kubelet-plugin/deviceinfo.go``).
    :param pcie_root: ``pci<domain>:<bus>`` from sysfs, or ``None`` when it cannot be resolved.
    :param numa_node: NUMA node of the PCI device (sysfs ``numa_node``, NVML only when sysfs has no entry), or
        ``None`` when unknown or negative.
    :param addressing_mode: ``nvmlDeviceGetAddressingMode`` as NVIDIA's driver publishes it (``"HMM"``,
        ``"ATS"``, ``"None"``), or ``None`` when NVML does not support the query.
    :param cuda_compute_capability: ``(major, minor)``.
    :param module_id: ``nvmlDeviceGetModuleId`` (the ``gpuModuleID`` attribute, Fabric Manager's physical ID),
        ``None`` when not read (gate ``FabricManagerPartitioning`` off) or not supported.
    :param partitions: Fabric Manager partition size -> ID of the partition of that size holding this GPU
        (the ``partition<size>`` attributes); empty without ``FabricManagerPartitioning``.
    """

    index: int
    minor: int
    uuid: str
    product_name: str
    brand: str
    architecture: str
    cuda_compute_capability: tuple[int, int]
    memory_bytes: int | None
    pci_bus_id: str
    pcie_root: str | None = None
    numa_node: int | None = None
    serial: str | None = None
    mig_capable: bool = False
    mig_enabled: bool = False
    fabric: FabricInfo | None = None
    addressing_mode: str | None = None
    vgpu_guest: bool = False
    """``nvmlDeviceGetVirtualizationMode`` is ``NVML_GPU_VIRTUALIZATION_MODE_VGPU`` (a vGPU inside a VM)."""
    module_id: int | None = None
    """``nvmlDeviceGetModuleId`` (``gpuModuleID``; Fabric Manager's ``physicalId`` of the GPU), ``None`` when NVML
    reports NOT_SUPPORTED."""
    partitions: dict[int, int] = field(default_factory=dict, hash=False)
    """Fabric Manager partition ID per partition size containing this GPU (``partition<size>``); empty unless
    filled from Fabric Manager (:func:`dradriver.domain.fmpartitions.with_partitions`). Left out of the hash (a
    dict), so a GpuDevice stays hashable."""

    @property
    def name(self) -> str:
        """DRA device name ``gpu-<minor>``."""
        return f"gpu-{self.minor}"


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One existing MIG device (a compute instance inside a GPU instance).

    :param profile: profile name as NVIDIA tools print it, e.g. ``"1g.10gb"`` or ``"1g.10gb+me"``.
    :param gi_profile_id: GPU-instance profile ID (``nvmlGpuInstanceProfileInfo_t.id``).
    :param ci_profile_id: compute-instance profile ID.
    :param gi_id: GPU instance ID on the parent; ``ci_id``: compute instance ID inside the GI.
    :param placement_start: first memory slice; ``placement_size``: number of memory slices.
    :param memory_bytes: ``memorySizeMB * 2**20`` from the GI profile info.
    """

    parent: GpuDevice
    uuid: str
    profile: str
    gi_profile_id: int
    ci_profile_id: int
    gi_id: int
    ci_id: int
    placement_start: int
    placement_size: int
    memory_bytes: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int

    @property
    def name(self) -> str:
        """DRA device name ``gpu-<parent minor>-mig-<canonical profile>-<GI profile ID>-<placement start>``."""
        return (
            f"gpu-{self.parent.minor}-mig-{canonical_profile(self.profile)}-"
            f"{self.gi_profile_id}-{self.placement_start}"
        )


@dataclass(frozen=True, slots=True)
class DiscoveryFailure:
    """A GPU left out of the inventory, with the reason (logged and shown by ``dradriver inspect``)."""

    index: int
    reason: str
    uuid: str | None = None


_PLACEMENT_NAME = re.compile(r"^gpu-(\d+)-mig-(.+)-(\d+)-(\d+)$")


@dataclass(frozen=True, slots=True)
class PlacementName:
    """The parts of a MIG device name.

    :param parent_minor: NVML minor number of the parent GPU (``/dev/nvidia<minor>``).
    :param profile: the canonical profile (``1g10gb-me``), not the NVML profile name.
    :param gi_profile_id: GPU-instance profile ID (``nvmlGpuInstanceProfileInfo_t.id``).
    :param start: first memory slice of the placement.
    """

    parent_minor: int
    profile: str
    gi_profile_id: int
    start: int


def format_placement_device_name(parent_minor: int, profile: str, gi_profile_id: int, start: int) -> str:
    """``gpu-<parent minor>-mig-<canonical profile>-<GI profile ID>-<start>``.

    :param profile: a profile name as NVML prints it (``1g.18gb``, ``1g.10gb+me``) or already canonical.
    :raises ValueError: a negative number or a profile with nothing left after canonicalisation.
    """
    if parent_minor < 0 or gi_profile_id < 0 or start < 0:
        raise ValueError(f"MIG placement numbers must be >= 0: minor {parent_minor}, GI profile "
                         f"{gi_profile_id}, start {start}")
    canonical = canonical_profile(profile)
    if not canonical:
        raise ValueError(f"MIG profile {profile!r} has no characters usable in a device name")
    return f"gpu-{parent_minor}-mig-{canonical}-{gi_profile_id}-{start}"


def parse_placement_device_name(name: str) -> PlacementName | None:
    """The parts of a MIG device name, or ``None`` when ``name`` is not one (``gpu-0``, ``channel-3``).

    Greedy like NVIDIA's regex: the last two ``-<digits>`` groups are the GI profile ID and the start.
    """
    match = _PLACEMENT_NAME.match(name)
    if match is None:
        return None
    minor, profile, gi_profile_id, start = match.groups()
    return PlacementName(int(minor), profile, int(gi_profile_id), int(start))


@dataclass(frozen=True, slots=True)
class MigPlacement:
    """One abstract dynamic-MIG device: a GPU-instance profile at one placement of a GPU, no instance yet.

    Values come from ``nvmlDeviceGetGpuInstanceProfileInfoV`` (the GI profile), the compute-instance profile with
    as many slices as the GI (``nvmlGpuInstanceGetComputeInstanceProfileInfoV``, engine profile 0) and
    ``nvmlDeviceGetGpuInstancePossiblePlacements_v2``.

    :param parent: the GPU the instance would be created on.
    :param profile: profile name as NVIDIA tools print it (``1g.18gb``, ``1g.18gb+me``, ``7g.141gb``).
    :param gi_profile_index: the ``NVML_GPU_INSTANCE_PROFILE_*`` index passed to ``GetGpuInstanceProfileInfo``.
    :param gi_profile_id: ``nvmlGpuInstanceProfileInfo_t.id``.
    :param ci_profile_index: the ``NVML_COMPUTE_INSTANCE_PROFILE_*`` index of the full-GI compute instance.
    :param placement_start: first memory slice; ``placement_size``: memory slices it takes.
    :param memory_bytes: ``memorySizeMB * 2**20``.
    :param slice_count: compute slices (the ``<n>g`` of the profile).
    """

    parent: GpuDevice
    profile: str
    gi_profile_index: int
    gi_profile_id: int
    ci_profile_index: int
    placement_start: int
    placement_size: int
    memory_bytes: int
    slice_count: int = 0
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0

    @property
    def name(self) -> str:
        """DRA device name (:func:`format_placement_device_name`)."""
        return format_placement_device_name(self.parent.minor, self.profile, self.gi_profile_id,
                                            self.placement_start)

    @property
    def memory_slices(self) -> range:
        """The memory slices it takes: ``placement_start .. placement_start + placement_size - 1``."""
        return range(self.placement_start, self.placement_start + self.placement_size)

    def overlaps(self, other: MigPlacement) -> bool:
        """True when both are on the same GPU and share a memory slice (at most one of them can exist)."""
        return (self.parent.uuid == other.parent.uuid and self.placement_start < other.placement_start
                + other.placement_size and other.placement_start < self.placement_start + self.placement_size)


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """Everything discovery found on one node.

    ``gpus`` holds every GPU that answered its core queries, MIG-mode ones included; use
    :meth:`allocatable` for what is published.
    """

    versions: DriverVersions
    gpus: tuple[GpuDevice, ...]
    migs: tuple[MigDevice, ...] = ()
    failures: tuple[DiscoveryFailure, ...] = ()
    clique: Clique | None = None
    warnings: tuple[str, ...] = ()
    """Node-level discovery problems that left nothing out on their own (clique disagreement, MIG mode
    without MIG devices); shown by ``dradriver inspect``."""
    placements: tuple[MigPlacement, ...] = ()
    """Dynamic MIG (``DynamicMIG`` gate on): the abstract devices of every dynamic-MIG-capable GPU, one per
    (GPU-instance profile, placement), whether or not an instance exists (:mod:`dradriver.domain.migplacements`;
    published by :mod:`dradriver.domain.partitions`); empty with the gate off."""
    vfio: tuple[VfioDevice, ...] = ()
    """``PassthroughSupport``: the ``gpu-vfio-<index>`` devices (:func:`dradriver.domain.passthrough.vfio_devices`),
    index ascending; empty with the gate off. Published next to :meth:`allocatable` (a GPU and its VFIO sibling
    both, until one is prepared: :func:`dradriver.domain.passthrough.withdrawn`)."""

    def allocatable(self) -> list[GpuDevice | MigDevice]:
        """GPUs and MIG devices to publish, sorted by PCI bus ID then name (VFIO devices: :attr:`vfio`).

        A GPU in MIG mode contributes its MIG devices and not itself (publishing both would let the same
        hardware be allocated twice).
        """
        out: list[GpuDevice | MigDevice] = []
        for gpu in sorted(self.gpus, key=lambda g: (g.pci_bus_id, g.minor)):
            if gpu.mig_enabled:
                migs = [m for m in self.migs if m.parent.uuid == gpu.uuid]
                out.extend(sorted(migs, key=lambda m: m.name))
            else:
                out.append(gpu)
        return out

    def find(self, name: str) -> GpuDevice | MigDevice | VfioDevice | None:
        """The allocatable or VFIO device named ``name``, or ``None``."""
        for dev in (*self.allocatable(), *self.vfio):
            if dev.name == name:
                return dev
        return None


_NON_NAME = re.compile(r"[^a-z0-9-]")


def canonical_profile(profile: str) -> str:
    """Canonical MIG profile for device names: ``1g.10gb`` -> ``1g10gb``, ``1g.10gb+me`` -> ``1g10gb-me``.

    Dots are removed, letters lowercased, any other character outside ``[a-z0-9-]`` becomes ``-``,
    and leading or trailing ``-`` are trimmed (NVIDIA ``mig.go`` ``ToCanonicalName``).
    """
    text = profile.replace(".", "").lower()
    return _NON_NAME.sub("-", text).strip("-")


@dataclass(frozen=True, slots=True)
class DeviceIndex:
    """Name -> device lookup built once from an inventory."""

    by_name: dict[str, GpuDevice | MigDevice | VfioDevice] = field(default_factory=dict)

    @classmethod
    def build(cls, inventory: NodeInventory) -> DeviceIndex:
        """Index the allocatable devices and the VFIO devices of ``inventory`` by DRA device name."""
        return cls({d.name: d for d in (*inventory.allocatable(), *inventory.vfio)})
