"""Consumable capacity (KEP-5075) in the allocation simulator, over ResourceSlices our own builder publishes with
``--consumable-shares``: many allocations of one device, ``shareID``/``consumedCapacity``, request-policy rounding,
and ``explain`` naming the capacity and the device that ran out."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.allocator.allocation import AllocationError, Allocator
from dradriver.allocator.capacity import RequestPolicy, round_up
from dradriver.allocator.quantity import Quantity
from dradriver.allocator.simulation import explain, load, simulate
from dradriver.domain.devices import DriverVersions, NodeInventory
from dradriver.domain.pools import build_resource_slices
from dradriver.domain.shares import MEMORY, SHARES, UNLIMITED, ShareMode
from tests.factories import gpu_device

FIXTURES = Path(__file__).resolve().parent / "fixtures"
H200_BYTES = 150754820096  # 143771 MiB
VERSIONS = DriverVersions(driver="570.148.08", cuda_driver=12080, nvml="12.570.148.08")


def h200_slices(mode: ShareMode, gpus: int = 1) -> str:
    inventory = NodeInventory(versions=VERSIONS, gpus=tuple(
        gpu_device(i, memory_bytes=H200_BYTES, product_name="NVIDIA H200", pci_bus_id=f"0000:{7 + i:02x}:00.0")
        for i in range(gpus)))
    slices = build_resource_slices(inventory, "h200-node", shares=mode, generate_name=False)
    for i, s in enumerate(slices):
        s["metadata"]["name"] = f"h200-node-gpu.nvidia.com-{i}"
    return yaml.safe_dump_all(slices)


def classes() -> str:
    return (FIXTURES / "deviceclasses.yaml").read_text()


def share_claim(name: str, memory: str | None = None, *, shares: str | None = None, count: int = 1) -> str:
    body: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if count != 1:
        body["count"] = count
    requests = {k: v for k, v in (("memory", memory), ("shares", shares)) if v is not None}
    if requests:
        body["capacity"] = {"requests": requests}
    return yaml.safe_dump({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": body}]}},
    })


def allocated_results(outcome: Any) -> dict[str, list[dict[str, Any]]]:
    return {c["metadata"]["name"]: c["status"]["allocation"]["devices"]["results"] for c in outcome.claims}


def test_four_claims_of_10gi_share_one_h200() -> None:
    claims = [share_claim(f"share-{i}", "10Gi") for i in range(4)]
    outcome = simulate(load([classes(), h200_slices(ShareMode(MEMORY)), *claims]))
    assert outcome.failures == []
    results = allocated_results(outcome)
    share_ids = set()
    for name in (f"share-{i}" for i in range(4)):
        (result,) = results[name]
        assert (result["pool"], result["device"]) == ("h200-node", "gpu-0")
        assert result["consumedCapacity"] == {"memory": "10Gi"}
        uuid.UUID(result["shareID"])
        share_ids.add(result["shareID"])
    assert len(share_ids) == 4


def test_requests_are_rounded_up_by_the_policy() -> None:
    step = RequestPolicy(default=Quantity.parse("0"), minimum=Quantity.parse("1Gi"), maximum=Quantity.parse("8Gi"),
                         step=Quantity.parse("512Mi"))
    value = Quantity.parse("8Gi").value
    assert round_up(Quantity.parse("100Mi").value, value, step) == Quantity.parse("1Gi").value
    assert round_up(Quantity.parse("1100Mi").value, value, step) == Quantity.parse("1536Mi").value
    assert "maximum 8Gi" in str(round_up(Quantity.parse("9Gi").value, value, step))
    values = RequestPolicy(default=Quantity.parse("1Gi"),
                           valid_values=(Quantity.parse("1Gi"), Quantity.parse("4Gi")))
    assert round_up(Quantity.parse("2Gi").value, value, values) == Quantity.parse("4Gi").value
    assert "above every valid value" in str(round_up(Quantity.parse("5Gi").value, value, values))


def test_integer_shares_mode_consumes_defaults_and_runs_out_of_shares() -> None:
    claims = [share_claim("a", shares="2"), share_claim("b"), share_claim("c", "1500Mi"), share_claim("d")]
    outcome = simulate(load([classes(), h200_slices(ShareMode(SHARES, 4)), *claims]))
    results = allocated_results(outcome)
    assert results["a"][0]["consumedCapacity"] == {"memory": "0", "shares": "2"}
    assert results["b"][0]["consumedCapacity"] == {"memory": "0", "shares": "1"}
    assert results["c"][0]["consumedCapacity"] == {"memory": "1500Mi", "shares": "1"}
    assert "d" not in results
    (failure,) = outcome.failures
    assert "default/d" in failure and "out of consumable capacity" in failure


def test_memory_mode_without_a_request_takes_the_whole_gpu() -> None:
    outcome = simulate(load([classes(), h200_slices(ShareMode(MEMORY)), share_claim("whole"),
                             share_claim("late", "1Gi")]))
    results = allocated_results(outcome)
    assert results["whole"][0]["consumedCapacity"] == {"memory": "143771Mi"}
    assert "late" not in results


def test_explain_names_the_capacity_and_device_that_ran_out() -> None:
    claims = [share_claim(f"s{i:02}", "10Gi") for i in range(15)]  # 14 x 10Gi fit into 143771Mi
    texts = [classes(), h200_slices(ShareMode(MEMORY)), *claims]
    outcome = simulate(load(texts))
    assert len(allocated_results(outcome)) == 14
    text, code = explain(load(texts))
    assert code == 1
    block = text.split("claim default/s14: CANNOT ALLOCATE")[1]
    assert "consuming memory 10Gi" in block
    assert "gpu-0  rejected: capacity memory of device gpu-0 exhausted: needs 10Gi, 411Mi left" in block
    # the explanation of an allocated share does not count its own consumption
    assert "gpu-0  accepted -> allocated" in text.split("claim default/s00")[1].split("claim default/s01")[0]


def test_a_request_beyond_the_policy_is_refused_with_the_reason() -> None:
    text, code = explain(load([classes(), h200_slices(ShareMode(UNLIMITED)), share_claim("huge", "200Gi")]))
    assert code == 1
    assert "capacity memory: request 200Gi is above the request policy's maximum 143771Mi" in text


def test_allocated_shares_count_against_the_device() -> None:
    texts = [classes(), h200_slices(ShareMode(MEMORY)), share_claim("new", "100Gi")]
    inputs = load(texts)
    first = simulate(load([*texts[:2], share_claim("old", "50Gi")]))
    old = copy.deepcopy(first.claims[0])
    allocator = Allocator(inputs.slices, inputs.classes, inputs.nodes, load([yaml.safe_dump(old)]).claims)
    with pytest.raises(AllocationError, match="1 out of consumable capacity: capacity memory of device gpu-0 "
                                              "exhausted: needs 100Gi, 92571Mi left"):
        allocator.allocate(load([share_claim("new", "100Gi")]).claims, "h200-node")
    node, (allocation,) = allocator.allocate(load([share_claim("fits", "90Gi")]).claims, "h200-node")
    assert node == "h200-node" and allocation["devices"]["results"][0]["consumedCapacity"] == {"memory": "90Gi"}


def test_two_shares_of_one_claim_spread_over_gpus_and_capacity_is_a_minimum_on_whole_devices() -> None:
    outcome = simulate(load([classes(), h200_slices(ShareMode(MEMORY), gpus=2), share_claim("pair", "10Gi", count=2)]))
    (results,) = allocated_results(outcome).values()
    assert sorted(r["device"] for r in results) == ["gpu-0", "gpu-1"]
    text, code = explain(load([classes(), h200_slices(ShareMode()), share_claim("big", "200Gi")]))
    assert code == 1 and "capacity memory is 143771Mi, requested 200Gi" in text
    outcome = simulate(load([classes(), h200_slices(ShareMode()), share_claim("small", "10Gi")]))
    (results,) = allocated_results(outcome).values()
    assert "shareID" not in results[0] and "consumedCapacity" not in results[0]
