"""Fabric Manager partitions (gate ``FabricManagerPartitioning``): which partition a claim's GPUs form, what each GPU
publishes, and when a partition may be deactivated. Pure rules over :class:`~dradriver.domain.passthrough.
FabricPartition` records (read by :mod:`dradriver.host.fabricmanager`).

Facts (kubernetes-sigs/dra-driver-nvidia-gpu ``pkg/fabricmanager/``, ``cmd/gpu-kubelet-plugin/device_state.go``,
``deviceinfo.go``; NVIDIA Fabric Manager User Guide, "Shared NVSwitch Virtualization Model"; ``nv_fm_types.h``):

* FM names a GPU by its ``physicalId``, the GPU's module ID (NVML ``nvmlDeviceGetModuleId``);
* each GPU publishes ``gpuModuleID`` and, per partition size ``N`` with a partition containing it,
  ``partition<N>`` = that partition's ID, so users group GPUs with ``matchAttribute: gpu.nvidia.com/partition<N>``;
* at prepare the set of module IDs of the claim's GPUs (full GPUs and VFIO devices' parents) must equal one
  supported partition exactly; that partition is activated, and deactivated at unprepare;
* two active partitions never share a GPU (FM answers ``FM_ST_IN_USE``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from dradriver.domain.claims import ClaimError, ClaimRef
from dradriver.domain.devices import GpuDevice, NodeInventory
from dradriver.domain.passthrough import FabricPartition, VfioDevice


def partition_ids_by_module(partitions: Iterable[FabricPartition]) -> dict[int, dict[int, int]]:
    """Per GPU module ID, ``{size: partition ID}`` of the partitions containing it (``partition<size>``). Where a
    table has two partitions of one size holding the same GPU, the lower ID is kept (deterministic)."""
    out: dict[int, dict[int, int]] = {}
    for p in sorted(partitions, key=lambda p: p.partition_id):
        for module in p.module_ids:
            out.setdefault(module, {}).setdefault(p.size, p.partition_id)
    return out


def with_partitions(inventory: NodeInventory, partitions: Iterable[FabricPartition]) -> NodeInventory:
    """The inventory with each GPU's :attr:`~dradriver.domain.devices.GpuDevice.partitions` filled from the FM
    partition list (by its module ID; a GPU without one, or in no partition, gets ``{}``). MIG devices keep their
    parents' new values. Pure: the FM list is read by the caller (gate ``FabricManagerPartitioning`` on)."""
    by_module = partition_ids_by_module(partitions)
    gpus = {g.uuid: dataclasses.replace(g, partitions=dict(by_module.get(g.module_id, {}))
                                        if g.module_id is not None else {}) for g in inventory.gpus}
    migs = tuple(dataclasses.replace(m, parent=gpus.get(m.parent.uuid, m.parent)) for m in inventory.migs)
    return dataclasses.replace(inventory, gpus=tuple(gpus[g.uuid] for g in inventory.gpus), migs=migs)


def _ids(modules: Iterable[int]) -> str:
    return "{" + ", ".join(str(m) for m in sorted(modules)) + "}"


def _describe(partitions: Sequence[FabricPartition]) -> str:
    return ", ".join(f"{p.partition_id} {_ids(p.module_ids)}" for p in partitions)


def nearest_partitions(modules: Iterable[int], partitions: Iterable[FabricPartition]
                       ) -> tuple[list[FabricPartition], list[FabricPartition]]:
    """(smallest supersets, largest subsets) of ``modules`` among ``partitions``, each by partition ID; a proper
    subset only (an exact match is neither)."""
    want = frozenset(modules)
    parts = list(partitions)
    supersets = [p for p in parts if want < frozenset(p.module_ids)]
    subsets = [p for p in parts if frozenset(p.module_ids) < want]
    smallest = min((p.size for p in supersets), default=0)
    largest = max((p.size for p in subsets), default=0)
    return (sorted((p for p in supersets if p.size == smallest), key=lambda p: p.partition_id),
            sorted((p for p in subsets if p.size == largest), key=lambda p: p.partition_id))


def match_partition(ref: ClaimRef | str, gpus: Mapping[str, int | None],
                    partitions: Iterable[FabricPartition]) -> FabricPartition:
    """The supported partition whose GPUs are exactly the claim's.

    :param gpus: the claim's GPUs, DRA device name -> module ID (``None``: NVML has none).
    :raises ClaimError: no GPU, a GPU without a module ID, or no partition equal to the set; the message names
        the claim, each GPU with its module ID and the nearest partitions (smallest supersets, largest subsets).
    """
    parts = list(partitions)
    shown = ", ".join(f"{name} (module {module if module is not None else 'unknown'})"
                      for name, module in sorted(gpus.items()))
    if not gpus:
        raise ClaimError(ref, "Fabric Manager partitioning: the claim has no GPU")
    unknown = sorted(name for name, module in gpus.items() if module is None)
    if unknown:
        raise ClaimError(ref, f"Fabric Manager partitioning: GPU(s) {', '.join(unknown)} have no module ID "
                              f"(NVML nvmlDeviceGetModuleId not supported); claim GPUs: {shown}")
    modules = frozenset(m for m in gpus.values() if m is not None)
    if len(modules) != len(gpus):
        raise ClaimError(ref, f"Fabric Manager partitioning: two GPUs report the same module ID: {shown}")
    for p in sorted(parts, key=lambda p: p.partition_id):
        if frozenset(p.module_ids) == modules:
            return p
    supersets, subsets = nearest_partitions(modules, parts)
    near = []
    if supersets:
        near.append(f"smallest partitions containing them: {_describe(supersets)}")
    if subsets:
        near.append(f"largest partitions within them: {_describe(subsets)}")
    raise ClaimError(ref, f"Fabric Manager partitioning: GPUs {shown} (module IDs {_ids(modules)}) are no "
                          f"supported partition; {'; '.join(near) if near else 'no partition holds any of them'} "
                          f"(allocate with matchAttribute gpu.nvidia.com/partition<N>)")


def claim_module_ids(devices: Iterable[object]) -> dict[str, int | None]:
    """DRA device name -> module ID of each full GPU and VFIO device among a claim's registry entries (other
    kinds, MIG devices, are ignored: FM partitions hold whole GPUs)."""
    return {d.name: d.module_id for d in devices if isinstance(d, GpuDevice | VfioDevice)}


def held_by_others(partition_modules: Iterable[int], others: Iterable[Iterable[int]]) -> bool:
    """Another prepared claim still holds a GPU of the partition: ``others`` are the module IDs each other
    claim's partition record holds. Such a partition is not deactivated at unprepare."""
    mine = frozenset(partition_modules)
    return any(mine & frozenset(o) for o in others)


def orphan_partitions(active: Iterable[int], known: Iterable[int]) -> list[int]:
    """Active partition IDs no stored record knows (a crash between activating and storing the record): what the
    start-up sweep deactivates, sorted. A partition a record holds is never one."""
    held = set(known)
    return sorted(set(active) - held)
