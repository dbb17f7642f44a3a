"""Dynamic MIG ResourceSlice builds on an 8-GPU H200 node (mock profile ``dgx-h200``, every placement published:
8 x (25 placements + the full GPU) = 208 devices, 8 counter sets), Kubernetes 1.35 split layout.

Variants of scenario ``slices_h200_dynamic_mig``:

* ``full_rebuild``: every GPU built from its placements (an empty :class:`PartitionCache`, what the first publish
  and a restart cost);
* ``republish_instance_created``: the cache holds the previous build and an instance was created or destroyed on
  one GPU (its ``GpuDevice`` is replaced, MIG mode flips): no published device changes, every GPU is reused;
* ``republish_one_gpu_rebuilt``: as above and one published attribute of that GPU changed, so one GPU is rebuilt
  and seven are reused;
* ``legacy``: the same node without the ``DynamicMIG`` gate (8 full GPUs), for scale.

Figures: bytes per publish (the JSON of every slice, what goes over the wire before HTTP framing) and slice count.
Run: ``python -m pytest bench/bench_partitions.py --benchmark-only``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from dradriver.domain import partitions
from dradriver.domain.devices import NodeInventory
from dradriver.domain.pools import build
from dradriver.nvml import discovery
from dradriver.nvml.session import open_session

SCENARIO = "slices_h200_dynamic_mig"
VERSION = (1, 35)


@pytest.fixture(scope="module")
def inventory(tmp_path_factory: pytest.TempPathFactory) -> NodeInventory:
    session = open_session(mock_profile="dgx-h200")
    try:
        return discovery.discover(session, sysfs_root=tmp_path_factory.mktemp("no-sysfs") / "sys", dynamic_mig=True)
    finally:
        session.close()


def _changed(inv: NodeInventory, round_: int, *, attribute: bool) -> NodeInventory:
    """``inv`` after one GPU changed (alternating between two states): GPU 3 in MIG mode or not (an instance
    created or destroyed), or with ``attribute`` its ``pcieRoot`` changed too (anything published changes)."""
    gpus = list(inv.gpus)
    gpus[3] = dataclasses.replace(gpus[3], mig_enabled=bool(round_ % 2))
    if attribute:
        gpus[3] = dataclasses.replace(gpus[3], pcie_root=f"pci0000:{round_ % 2:02x}")
    placements = tuple(dataclasses.replace(p, parent=gpus[3]) if p.parent.uuid == gpus[3].uuid else p
                       for p in inv.placements)
    return dataclasses.replace(inv, gpus=tuple(gpus), placements=placements)


def _figures(slices: list[dict[str, Any]]) -> dict[str, tuple[float, str, float]]:
    size = len(json.dumps(slices, separators=(",", ":")))
    return {"bytes per publish": (float(size), "", 0.0), "slices per publish": (float(len(slices)), "", 0.0)}


def test_full_rebuild(benchmark: Any, inventory: NodeInventory) -> None:
    benchmark.extra_info.update(scenario=SCENARIO, variant="full_rebuild")
    result = benchmark(lambda: build(inventory, "node-a", server_version=VERSION,
                                     cache=partitions.PartitionCache()))
    assert sum(len(s["spec"].get("devices", ())) for s in result.slices) == 208
    benchmark.extra_info["figures"] = _figures(result.slices)


@pytest.mark.parametrize("attribute", [False, True], ids=["instance_created", "one_gpu_rebuilt"])
def test_republish_one_changed(benchmark: Any, inventory: NodeInventory, attribute: bool) -> None:
    variant = "republish_one_gpu_rebuilt" if attribute else "republish_instance_created"
    benchmark.extra_info.update(scenario=SCENARIO, variant=variant)
    cache = partitions.PartitionCache()
    variants = [_changed(inventory, 0, attribute=attribute), _changed(inventory, 1, attribute=attribute)]
    build(variants[0], "node-a", server_version=VERSION, cache=cache)
    state = {"round": 0}

    def republish() -> Any:
        state["round"] += 1
        return build(variants[state["round"] % 2], "node-a", server_version=VERSION, cache=cache)

    result = benchmark(republish)
    assert cache.misses == 8 + (state["round"] if attribute else 0)
    assert sum(len(s["spec"].get("devices", ())) for s in result.slices) == 208


def test_legacy(benchmark: Any, inventory: NodeInventory) -> None:
    benchmark.extra_info.update(scenario=SCENARIO, variant="legacy")
    plain = dataclasses.replace(inventory, placements=())
    result = benchmark(lambda: build(plain, "node-a", server_version=VERSION))
    benchmark.extra_info["figures"] = {f"legacy {k}": v for k, v in _figures(result.slices).items()}
