"""Every ResourceSlice of one node's pool: the one entry that picks the layout.

Without dynamic MIG placements the devices are cut into slices of at most 128 (64 with taints or counters) by
:mod:`dradriver.domain.resourceslices`, which also makes each device's entry; with placements (the ``DynamicMIG``
gate) :mod:`dradriver.domain.partitions` lays the pool out with counter sets and abstract MIG devices.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from dradriver.domain import partitions
from dradriver.domain import resourceslices as rs
from dradriver.domain.devices import NodeInventory
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.partitions import PartitionCache
from dradriver.domain.shares import ShareMode


def build(
    inventory: NodeInventory,
    node_name: str,
    *,
    generation: int = 1,
    taints: Mapping[str, Sequence[rs.Taint]] | None = None,
    generate_name: bool = True,
    driver: str = GPU_DRIVER.driver_name,
    server_version: tuple[int, int] = (1, 34),
    cache: PartitionCache | None = None,
    shares: ShareMode | None = None,
    advertised: Collection[str] | None = None,
    held: Collection[str] = (),
    fabric_partitions: bool = False,
) -> rs.SliceBuild:
    """Build every ResourceSlice of ``node_name``'s pool.

    With dynamic MIG (``inventory.placements`` not empty, the ``DynamicMIG`` gate) the pool is built by
    :func:`dradriver.domain.partitions.build` (counter sets, abstract MIG devices, layout by
    ``server_version``, ``(major, minor)`` of the API server; ``cache`` reuses unchanged GPUs).

    :param generation: ``spec.pool.generation`` (the publisher bumps it when the pool changes).
    :param taints: optional device name -> taints (see :func:`device_entries`); any taint lowers the
        per-slice device limit to 64 for the whole pool so the split stays uniform.
    :param generate_name: set ``metadata.generateName`` to ``<node>-<driver>-``.
    :param shares: the ``--consumable-shares`` mode (see :func:`device_entries`).
    :param advertised: the device types published (see :func:`device_entries`); with dynamic MIG the counter
        sets stay published whatever is left out.
    :param held: devices completed claims hold; each one's VFIO/GPU sibling is left out (see
        :func:`device_entries`; dynamic MIG and ``PassthroughSupport`` are exclusive, so that layout has none).
    :param fabric_partitions: ``FabricManagerPartitioning``: ``gpuModuleID`` and ``partition<size>`` attributes.
    :returns: the slices in order (at least one, possibly with no devices, so the pool always exists)
        and the warnings issued.
    :raises dradriver.domain.resourceslices.ResourceSliceError: duplicate device names or too many taints on one device.
    """
    if inventory.placements:
        return partitions.build(inventory, node_name, server_version=server_version, generation=generation,
                                taints=taints, generate_name=generate_name, driver=driver, cache=cache,
                                advertised=advertised, fabric_partitions=fabric_partitions)
    warnings: list[str] = []
    devices = rs.device_entries(inventory, taints=taints, warnings=warnings, shares=shares, advertised=advertised,
                                held=held, fabric_partitions=fabric_partitions)
    small = rs.needs_small_slices(devices)
    size = rs.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS if small else rs.MAX_DEVICES_PER_SLICE
    chunks = [devices[i : i + size] for i in range(0, len(devices), size)] or [[]]
    slices: list[dict[str, Any]] = []
    for chunk in chunks:
        metadata: dict[str, Any] = {}
        if generate_name:
            metadata["generateName"] = f"{node_name}-{driver}-"
        slices.append(
            {
                "apiVersion": rs.API_VERSION,
                "kind": rs.KIND,
                "metadata": metadata,
                "spec": {
                    "driver": driver,
                    "nodeName": node_name,
                    "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
                    "devices": chunk,
                },
            }
        )
    return rs.SliceBuild(slices, warnings)


def build_resource_slices(
    inventory: NodeInventory,
    node_name: str,
    *,
    generation: int = 1,
    taints: Mapping[str, Sequence[rs.Taint]] | None = None,
    generate_name: bool = True,
    driver: str = GPU_DRIVER.driver_name,
    server_version: tuple[int, int] = (1, 34),
    cache: PartitionCache | None = None,
    shares: ShareMode | None = None,
    advertised: Collection[str] | None = None,
    held: Collection[str] = (),
    fabric_partitions: bool = False,
) -> list[dict[str, Any]]:
    """:func:`build` without the warnings (they are logged): the list of ResourceSlice dicts."""
    result = build(inventory, node_name, generation=generation, taints=taints, generate_name=generate_name,
                   driver=driver, server_version=server_version, cache=cache, shares=shares, advertised=advertised,
                   held=held, fabric_partitions=fabric_partitions)
    return result.slices
