"""Consumable GPU shares: ``--consumable-shares`` parsing, NVIDIA's request policies in published ResourceSlices
(validated against the official schema and the API's policy rules), and the MPS limits derived from
``consumedCapacity``."""

from __future__ import annotations

import pytest

from dradriver.domain.devices import DriverVersions, NodeInventory
from dradriver.domain.pools import build_resource_slices
from dradriver.domain.resourceslices import limit_violations
from dradriver.domain.shares import (
    MEMORY,
    SHARES,
    UNLIMITED,
    ShareLimits,
    ShareMode,
    ShareModeError,
    parse_share_mode,
    request_policies,
    share_limits,
)
from tests.domain.slice_validation import assert_valid_slice, quantity_value
from tests.factories import gpu_device, mig_device

MIB = 1 << 20
GIB = 1 << 30
H200_BYTES = 150754820096  # 143771 MiB (gpu-facts.md 1.2)
VERSIONS = DriverVersions(driver="570.148.08", cuda_driver=12080, nvml="12.570.148.08")


@pytest.mark.parametrize(("text", "mode"), [
    ("disabled", ShareMode()),
    ("", ShareMode()),
    ("memory", ShareMode(MEMORY)),
    (" unlimited ", ShareMode(UNLIMITED)),
    ("4", ShareMode(SHARES, 4)),
])
def test_modes_parse(text: str, mode: ShareMode) -> None:
    assert parse_share_mode(text) == mode


@pytest.mark.parametrize(("text", "message"), [
    ("0", "must be a positive integer"),
    ("-3", "must be a positive integer"),
    ("half", "'disabled', 'memory', 'unlimited' or a positive integer"),
])
def test_bad_modes_are_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ShareModeError, match=message) as info:
        parse_share_mode(text)
    assert "--consumable-shares" in str(info.value)


def test_a_mode_needs_the_gate() -> None:
    with pytest.raises(ShareModeError, match="ConsumableShares"):
        parse_share_mode("memory", gate_enabled=False)
    assert parse_share_mode("disabled", gate_enabled=False) == ShareMode()


def test_policies_follow_nvidias_table() -> None:
    odd = 40 * GIB + 12345  # rounded down to a whole MiB
    memory = 40 * GIB
    assert request_policies(ShareMode(MEMORY), odd) == {
        "memory": {"value": memory, "default": memory, "min": MIB, "max": memory, "step": MIB}}
    assert request_policies(ShareMode(UNLIMITED), odd) == {
        "memory": {"value": memory, "default": 0, "min": 0, "max": memory, "step": MIB}}
    assert request_policies(ShareMode(SHARES, 4), odd) == {
        "memory": {"value": memory, "default": 0, "min": 0, "max": memory, "step": MIB},
        "shares": {"value": 4, "default": 1, "min": 1, "max": 4, "step": 1}}
    assert request_policies(ShareMode(), odd) == {}


@pytest.mark.parametrize("mode", [ShareMode(MEMORY), ShareMode(UNLIMITED), ShareMode(SHARES, 8)])
def test_published_slices_are_valid_and_multi_allocatable(mode: ShareMode) -> None:
    gpu0 = gpu_device(0, memory_bytes=H200_BYTES, pci_bus_id="0000:07:00.0")
    gpu1 = gpu_device(1, mig=True, memory_bytes=H200_BYTES, pci_bus_id="0000:08:00.0")
    mig = mig_device(gpu1, 0, gi_id=1, placement_size=1)
    inventory = NodeInventory(versions=VERSIONS, gpus=(gpu0, gpu1), migs=(mig,))
    (slice_,) = build_resource_slices(inventory, "node-a", shares=mode)
    assert_valid_slice(slice_)
    devices = {d["name"]: d for d in slice_["spec"]["devices"]}
    assert set(devices) == {"gpu-0", mig.name}
    for device in devices.values():
        assert device["allowMultipleAllocations"] is True
        policy = device["capacity"]["memory"]["requestPolicy"]
        assert quantity_value(policy["validRange"]["step"]) == MIB
    memory = devices["gpu-0"]["capacity"]["memory"]
    assert memory["value"] == "143771Mi"
    assert quantity_value(memory["requestPolicy"]["default"]) == (143771 * MIB if mode.kind == MEMORY else 0)
    if mode.kind == SHARES:
        assert devices["gpu-0"]["capacity"]["shares"] == {
            "value": "8", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "8", "step": "1"}}}
    else:
        assert "shares" not in devices["gpu-0"]["capacity"]


def test_disabled_publishes_no_policy() -> None:
    inventory = NodeInventory(versions=VERSIONS, gpus=(gpu_device(0, memory_bytes=H200_BYTES),))
    (slice_,) = build_resource_slices(inventory, "node-a", shares=ShareMode())
    (device,) = slice_["spec"]["devices"]
    assert "allowMultipleAllocations" not in device
    assert device["capacity"]["memory"] == {"value": "143771Mi"}


def test_policy_rules_the_schema_cannot_state_are_checked() -> None:
    inventory = NodeInventory(versions=VERSIONS, gpus=(gpu_device(0, memory_bytes=H200_BYTES),))
    (slice_,) = build_resource_slices(inventory, "node-a", shares=ShareMode(MEMORY))
    device = slice_["spec"]["devices"][0]
    del device["allowMultipleAllocations"]
    assert limit_violations(slice_) == ["device gpu-0: capacity memory: requestPolicy without "
                                        "allowMultipleAllocations"]
    device["allowMultipleAllocations"] = True
    device["capacity"]["memory"]["requestPolicy"]["default"] = "1025Ki"
    assert limit_violations(slice_) == ["device gpu-0: capacity memory: default not on the validRange step grid"]
    device["capacity"]["memory"]["requestPolicy"] = {"default": "3Gi", "validValues": ["1Gi", "2Gi"]}
    assert limit_violations(slice_) == ["device gpu-0: capacity memory: default is not one of validValues"]


def test_limits_from_memory_shares() -> None:
    total = 143771 * MIB
    limits = share_limits(ShareMode(MEMORY), {"memory": 10 * GIB}, H200_BYTES)
    assert limits == ShareLimits(thread_percentage=8, pinned_memory_mib=10240)
    assert limits.env() == ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=8", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"]
    # the whole device (memory mode's default): no limit at all
    assert share_limits(ShareMode(MEMORY), {"memory": total}, H200_BYTES) == ShareLimits()


def test_limits_from_integer_shares() -> None:
    assert share_limits(ShareMode(SHARES, 4), {"shares": 1}, H200_BYTES) == ShareLimits(25, None)
    assert share_limits(ShareMode(SHARES, 3), {"shares": 2, "memory": 20 * GIB}, H200_BYTES) == \
        ShareLimits(67, 20480)
    assert share_limits(ShareMode(SHARES, 4), {"shares": 4}, H200_BYTES) == ShareLimits()
    with pytest.raises(ValueError, match=r"outside 1\.\.4"):
        share_limits(ShareMode(SHARES, 4), {"shares": 5}, H200_BYTES)


def test_unlimited_share_without_memory_has_no_limits() -> None:
    assert share_limits(ShareMode(UNLIMITED), {"memory": 0}, H200_BYTES) == ShareLimits()
    with pytest.raises(ValueError, match="exceeds"):
        share_limits(ShareMode(UNLIMITED), {"memory": H200_BYTES + MIB}, H200_BYTES)


def test_limits_round_trip_through_json() -> None:
    limits = ShareLimits(8, 10240)
    assert ShareLimits.from_json(limits.to_json()) == limits
    with pytest.raises(ValueError):
        ShareLimits.from_json({"threads": 0})
