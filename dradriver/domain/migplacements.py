"""Dynamic MIG placements: the abstract devices a MIG-capable GPU offers before any instance exists, and their names.

Facts (``nvidia-dra-driver-updates.md`` 2b, ``gpu-facts.md`` MIG profile tables):

* one abstract device per (GPU-instance profile, placement) of a GPU, named
  ``gpu-<parent minor>-mig-<canonical profile>-<GI profile ID>-<placement start>`` exactly as NVIDIA names them
  (the same form as an existing MIG device's name, :class:`~dradriver.domain.devices.MigDevice`); NVIDIA parses
  them with ``^gpu-(\\d+)-mig-(.+)-(\\d+)-(\\d+)$``;
* ``<canonical profile>`` is the profile name with dots removed, lowercased, other characters outside
  ``[a-z0-9-]`` mapped to ``-`` and trimmed (``1g.10gb+me`` -> ``1g10gb-me``,
  :func:`~dradriver.domain.devices.canonical_profile`);
* ``<GI profile ID>`` is ``nvmlGpuInstanceProfileInfo_t.id`` (what ``nvidia-smi mig -lgip`` prints: 19, 20, 15, 14,
  9, 5, 0 ...), not the ``NVML_GPU_INSTANCE_PROFILE_*`` index; ``<placement start>`` is the first memory slice
  of ``nvmlGpuInstancePlacement_t``.

Pure: no I/O. The device preparer (:mod:`dradriver.preparers.dynamicmig`) creates exactly the placement of the
allocated device; the ResourceSlice builder publishes :class:`MigPlacement` entries as abstract devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dradriver.domain.devices import GpuDevice, MigDevice, NodeInventory, canonical_profile

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


#: Architectures (``GpuDevice.architecture``) older than Hopper: a MIG mode change needs a GPU reset there, so
#: such a GPU is dynamic only when MIG mode is already on (``dradriver.nvml.discovery.is_dynamic_mig_capable``),
#: never offers its full GPU beside its placements, and is never turned out of MIG mode
#: (``nvidia-dra-driver-updates.md`` 2b, NVIDIA PR #1018).
PRE_HOPPER = frozenset({"Kepler", "Maxwell", "Pascal", "Volta", "Turing", "Ampere", "Ada Lovelace"})


def toggles_mig_without_reset(gpu: GpuDevice) -> bool:
    """Whether MIG mode can be switched on ``gpu`` without a GPU reset: Hopper and newer.

    NVIDIA's driver compares NVML's architecture code, ``GetArchitecture() >= DEVICE_ARCH_HOPPER`` (9), unsigned
    (kubernetes-sigs/dra-driver-nvidia-gpu ``isDynamicMIGCapable``, PR #1018). Every code at or above 9 counts:
    Blackwell (10), Rubin (13), NVML's own ``NVML_DEVICE_ARCH_UNKNOWN`` (0xFFFFFFFF, "presumably something newer"
    in nvml.h) and a code newer than this driver's table; discovery publishes the last two as ``Unknown``. So
    only the named pre-Hopper architectures (:data:`PRE_HOPPER`, codes 2-8) answer False.
    """
    return gpu.architecture not in PRE_HOPPER


def offers_full_gpu(gpu: GpuDevice) -> bool:
    """Whether a dynamic-MIG GPU is also offered whole: when it :func:`toggles_mig_without_reset`."""
    return toggles_mig_without_reset(gpu)


def dynamic_allocatable(inventory: NodeInventory) -> list[GpuDevice | MigDevice | MigPlacement]:
    """What the GPU plugin publishes and prepares with the ``DynamicMIG`` gate on, in PCI bus ID order.

    A GPU with placements in ``inventory.placements`` contributes itself (Hopper and newer) and its placements
    sorted by name, never its existing MIG devices (they are instances of placements); any other GPU
    contributes what :meth:`NodeInventory.allocatable` gives (the full GPU, or its static MIG devices).
    """
    by_parent: dict[str, list[MigPlacement]] = {}
    for placement in inventory.placements:
        by_parent.setdefault(placement.parent.uuid, []).append(placement)
    static = {d.name: d for d in inventory.allocatable()}
    out: list[GpuDevice | MigDevice | MigPlacement] = []
    for gpu in sorted(inventory.gpus, key=lambda g: (g.pci_bus_id, g.minor)):
        placements = by_parent.get(gpu.uuid)
        if placements is None:
            if gpu.mig_enabled:
                out.extend(d for d in static.values() if isinstance(d, MigDevice) and d.parent.uuid == gpu.uuid)
            else:
                out.append(gpu)
            continue
        if offers_full_gpu(gpu):
            out.append(gpu)
        out.extend(sorted(placements, key=lambda p: p.name))
    return out


def dynamic_index(inventory: NodeInventory) -> dict[str, GpuDevice | MigDevice | MigPlacement]:
    """DRA device name -> registry entry for :func:`dynamic_allocatable` (the device registry's index)."""
    return {d.name: d for d in dynamic_allocatable(inventory)}


def instance_of(inventory: NodeInventory, placement: MigPlacement) -> MigDevice | None:
    """The existing MIG device at exactly ``placement`` (same GPU, GI profile and start), or ``None``."""
    for mig in inventory.migs:
        if (mig.parent.uuid == placement.parent.uuid and mig.gi_profile_id == placement.gi_profile_id
                and mig.placement_start == placement.placement_start):
            return mig
    return None


def published_devices(inventory: NodeInventory) -> list[GpuDevice | MigDevice | MigPlacement]:
    """The devices a GPU plugin publishes for ``inventory``: :func:`dynamic_allocatable` when it has placements
    (the ``DynamicMIG`` gate), else :meth:`NodeInventory.allocatable` (health tracking follows the same list)."""
    if inventory.placements:
        return dynamic_allocatable(inventory)
    return list(inventory.allocatable())


def instance_ids(inventory: NodeInventory) -> dict[str, tuple[str, int, int, str]]:
    """Placement device name -> ``(parent UUID, GI id, CI id, MIG UUID)`` of the instance that exists on it now
    (dynamic MIG), for attributing MIG-scoped events (Xids carry GI and CI ids) to the published device."""
    out: dict[str, tuple[str, int, int, str]] = {}
    for placement in inventory.placements:
        mig = instance_of(inventory, placement)
        if mig is not None:
            out[placement.name] = (mig.parent.uuid, mig.gi_id, mig.ci_id, mig.uuid)
    return out
