"""``dradriver.domain.fmpartitions``: partition<N> per GPU, the exact-match rule and its error, deactivation rules.

The table is the HGX H100 8-GPU default layout (the Fabric Manager User Guide's shared NVSwitch table; also
koordinator-sh/koordinator ``H100PartitionTables``): 0 = all eight, 1 = 1-4, 2 = 5-8, 3-6 = the pairs 1+3, 2+4,
5+7, 6+8, 7-14 = singles."""

from __future__ import annotations

import dataclasses

import pytest

from dradriver.domain.claims import ClaimError, ClaimRef
from dradriver.domain.devices import DriverVersions, NodeInventory
from dradriver.domain.fmpartitions import (
    claim_module_ids,
    held_by_others,
    match_partition,
    nearest_partitions,
    orphan_partitions,
    partition_ids_by_module,
    with_partitions,
)
from dradriver.domain.passthrough import FabricPartition, PciFunction, VfioDevice
from tests.factories import gpu_device, mig_device

PAIRS = [(1, 3), (2, 4), (5, 7), (6, 8)]
TABLE = [FabricPartition(0, tuple(range(1, 9))), FabricPartition(1, (1, 2, 3, 4)), FabricPartition(2, (5, 6, 7, 8)),
         *(FabricPartition(3 + i, pair) for i, pair in enumerate(PAIRS)),
         *(FabricPartition(6 + m, (m,)) for m in range(1, 9))]
REF = ClaimRef("ns", "train", "uid-1")


def test_each_module_gets_the_partition_of_each_size_containing_it() -> None:
    by_module = partition_ids_by_module(TABLE)
    assert by_module[1] == {8: 0, 4: 1, 2: 3, 1: 7}
    assert by_module[8] == {8: 0, 4: 2, 2: 6, 1: 14}


def test_inventory_gpus_and_mig_parents_get_partitions_by_module_id() -> None:
    g0 = gpu_device(0, module_id=3)
    g1 = gpu_device(1, module_id=None)
    g2 = gpu_device(2, module_id=6, mig=True)
    inv = NodeInventory(DriverVersions("580.105.08", 13000), (g0, g1, g2), migs=(mig_device(g2),))
    out = with_partitions(inv, TABLE)
    assert [g.partitions for g in out.gpus] == [{8: 0, 4: 1, 2: 3, 1: 9}, {}, {8: 0, 4: 2, 2: 6, 1: 12}]
    assert out.migs[0].parent.partitions == {8: 0, 4: 2, 2: 6, 1: 12}
    assert inv.gpus[0].partitions == {}  # pure: the input is unchanged


@pytest.mark.parametrize(("modules", "want"), [((1, 2, 3, 4), 1), ((3, 1), 3), ((8,), 14), (tuple(range(1, 9)), 0)])
def test_a_claims_module_ids_must_equal_one_partition(modules: tuple[int, ...], want: int) -> None:
    gpus = {f"gpu-{m}": m for m in modules}
    assert match_partition(REF, gpus, TABLE).partition_id == want


def test_no_exact_partition_names_claim_gpus_and_nearest_partitions() -> None:
    with pytest.raises(ClaimError) as err:
        match_partition(REF, {"gpu-0": 1, "gpu-1": 2}, TABLE)
    text = str(err.value)
    assert text.startswith("claim ns/train (uid uid-1): Fabric Manager partitioning: GPUs gpu-0 (module 1), "
                           "gpu-1 (module 2) (module IDs {1, 2}) are no supported partition")
    assert "smallest partitions containing them: 1 {1, 2, 3, 4}" in text
    assert "largest partitions within them: 7 {1}, 8 {2}" in text
    supersets, subsets = nearest_partitions({1, 2, 3, 5, 6}, TABLE)
    assert [p.partition_id for p in supersets] == [0]
    assert [p.partition_id for p in subsets] == [3]


def test_a_gpu_without_module_id_or_an_empty_claim_is_refused() -> None:
    with pytest.raises(ClaimError, match=r"GPU\(s\) gpu-1 have no module ID.*gpu-1 \(module unknown\)"):
        match_partition(REF, {"gpu-0": 1, "gpu-1": None}, TABLE)
    with pytest.raises(ClaimError, match="has no GPU"):
        match_partition(REF, {}, TABLE)


def test_claim_module_ids_counts_full_gpus_and_vfio_devices_not_migs() -> None:
    g = gpu_device(0, module_id=5)
    vfio = VfioDevice(0, PciFunction("0000:18:00.0", 0x10DE, 0x2330, 0x030200), "H100", module_id=7)
    assert claim_module_ids([g, vfio, mig_device(gpu_device(1, mig=True))]) == {"gpu-0": 5, "gpu-vfio-0": 7}
    assert dataclasses.replace(g, module_id=None).module_id is None


def test_deactivation_waits_while_another_claim_holds_a_gpu_and_sweep_spares_held_partitions() -> None:
    assert held_by_others((1, 3), [(5, 7), (3,)])
    assert not held_by_others((1, 3), [(5, 7)])
    assert orphan_partitions([3, 5, 9], known=[5]) == [3, 9]
    assert orphan_partitions([5], known=[5]) == []
