"""The shape rules of a device's ``nodeAllocatableResources`` (KEP-5517) that the OpenAPI schema does not check."""

from __future__ import annotations

from typing import Any

import pytest

from dradriver.domain import nodeallocatable as na
from dradriver.domain.devices import DriverVersions, NodeInventory
from dradriver.domain.nodeallocatable import apply_overhead, parse_overhead
from dradriver.domain.pools import build_resource_slices
from tests.factories import gpu_device, vfio_for


def test_a_published_overhead_field_has_no_problems() -> None:
    assert na.field_problems({"memory": {"overhead": {"perPod": "1Gi", "perContainer": "64Mi"}},
                              "cpu": {"overhead": {"perPod": "500m"}}}) == []
    assert na.field_problems({"cpu": {"mapping": {"deviceMultiplier": "2"}}}) == []


@pytest.mark.parametrize(("value", "problem"), [
    ([], "must be an object"),
    ({"memory": {}}, "memory]: at least one of mapping, overhead must be set"),
    ({"memory": {"overhead": {}}}, "overhead: at least one of perPod, perContainer must be set"),
    ({"memory": {"overhead": {"perPod": "-1Gi"}}}, "perPod: '-1Gi' must not be negative"),
    ({"memory": {"overhead": {"perPod": "x"}}}, "perPod: 'x' is not a quantity"),
    ({"memory": {"overhead": {"perPod": "1Gi", "perNode": "1"}}}, "overhead.perNode: unknown field"),
    ({"cpu": {"mapping": {"capacityKey": "gpu.nvidia.com/cores"}}}, "capacityMultiplier must be set with capacityKey"),
    ({"cpu": {"mapping": {"deviceMultiplier": "1", "capacityKey": "k", "capacityMultiplier": "1"}}},
     "exactly one of deviceMultiplier, capacityKey must be set"),
])
def test_a_malformed_field_is_named(value: Any, problem: str) -> None:
    problems = na.field_problems(value)
    assert any(problem in p for p in problems), problems


def test_vfio_overhead_lands_on_the_published_vfio_devices() -> None:
    gpus = (gpu_device(0),)
    inventory = NodeInventory(versions=DriverVersions(driver="570.148.08", cuda_driver=12080), gpus=gpus,
                              vfio=vfio_for(*gpus))
    slices = build_resource_slices(inventory, "n")
    overhead = parse_overhead({("vfio", "memory", "pod"): "1Gi"}, gate_enabled=True)
    apply_overhead(slices, overhead)
    by_name = {d["name"]: d for d in slices[0]["spec"]["devices"]}
    assert by_name["gpu-vfio-0"]["nodeAllocatableResources"] == {"memory": {"overhead": {"perPod": "1Gi"}}}
    assert "nodeAllocatableResources" not in by_name["gpu-0"]
