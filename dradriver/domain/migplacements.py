"""Dynamic MIG placements: which abstract devices a MIG-capable GPU offers before any instance exists, and how they
relate to existing instances. The device itself (:class:`~dradriver.domain.devices.MigPlacement`) and its name
(format and parse) belong to the device model, :mod:`dradriver.domain.devices`.

Facts (NVIDIA's dynamic MIG, ``cmd/gpu-kubelet-plugin/nvlib.go``, ``partitions.go``; the MIG profile tables of NVIDIA's
MIG User Guide, "Supported MIG Profiles"):

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
allocated device; the ResourceSlice builder publishes :class:`~dradriver.domain.devices.MigPlacement` entries as
abstract devices.
"""

from __future__ import annotations

from dradriver.domain.devices import GpuDevice, MigDevice, MigPlacement, NodeInventory

#: Architectures (``GpuDevice.architecture``) older than Hopper: a MIG mode change needs a GPU reset there, so
#: such a GPU is dynamic only when MIG mode is already on (``dradriver.nvml.discovery.is_dynamic_mig_capable``),
#: never offers its full GPU beside its placements, and is never turned out of MIG mode
#: (NVIDIA's dynamic MIG, ``cmd/gpu-kubelet-plugin/nvlib.go``, NVIDIA PR #1018).
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
