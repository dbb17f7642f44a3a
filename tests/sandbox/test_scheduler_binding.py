"""The sandbox scheduler's KEP-5007 binding conditions, as kube-scheduler's DynamicResources plugin implements them:
devices with binding conditions are selectable only with the gate, PreBind waits until every condition is True in
``status.devices``, fails on a failure condition, times out after ``bindingTimeout``, and Unreserve deallocates."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dradriver.allocator.allocation import AllocationError
from dradriver.domain.computedomains import BINDING_CONDITION, BINDING_FAILURE_CONDITION, plugin_resource_slices
from dradriver.sandbox import scheduler
from dradriver.sandbox.apiserver import ApiServerEmulator

DRIVER = "compute-domain.nvidia.com"
NODE = "node-a"
CLAIMS = [("default", "wl")]
POD = {"resource": "pods", "name": "wl-pod", "uid": "pod-uid-1"}


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    emulator = ApiServerEmulator()
    emulator.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    emulator.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                     "metadata": {"name": "channel.example.com"},
                     "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}})
    emulator.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": "wl", "namespace": "default"},
                     "spec": {"devices": {"requests": [{"name": "channel", "exactly": {
                         "deviceClassName": "channel.example.com", "selectors": [{"cel": {
                             "expression": f"device.attributes['{DRIVER}'].type == 'channel'"}}]}}]}}})
    yield emulator


def publish(api: ApiServerEmulator, *, binding_conditions: bool) -> None:
    for obj in plugin_resource_slices(NODE, DRIVER, daemon=True, binding_conditions=binding_conditions):
        api.create(obj)


def set_condition(api: ApiServerEmulator, type_: str, reason: str, message: str = "") -> None:
    claim = api.get("ResourceClaim", "wl", "default")
    assert claim is not None
    claim["status"]["devices"] = [{"driver": DRIVER, "pool": NODE, "device": "channel-0", "conditions": [
        {"type": type_, "status": "True", "reason": reason, "message": message,
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]
    api.update(claim, subresource="status")


def stored(api: ApiServerEmulator) -> dict[str, Any]:
    claim = api.get("ResourceClaim", "wl", "default")
    assert claim is not None
    return claim


def test_devices_with_binding_conditions_are_not_selectable_with_the_gate_off(api: ApiServerEmulator) -> None:
    publish(api, binding_conditions=True)
    with pytest.raises(AllocationError, match="binding conditions"):
        scheduler.allocate(api, CLAIMS, node_name=NODE)
    assert not (stored(api).get("status") or {}).get("allocation")


def test_with_the_gate_on_the_result_carries_the_conditions_and_the_allocation_is_pinned_and_stamped(
        api: ApiServerEmulator) -> None:
    publish(api, binding_conditions=True)
    [claim] = scheduler.allocate(api, CLAIMS, node_name=NODE, reserved_for=[POD], binding_conditions=True)
    allocation = claim["status"]["allocation"]
    [result] = allocation["devices"]["results"]
    assert result["device"] == "channel-0"
    assert result["bindingConditions"] == [BINDING_CONDITION]
    assert result["bindingFailureConditions"] == [BINDING_FAILURE_CONDITION]
    assert allocation["allocationTimestamp"].endswith("Z")
    assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [NODE]


def test_prebind_waits_until_every_binding_condition_is_true(api: ApiServerEmulator) -> None:
    publish(api, binding_conditions=True)
    scheduler.allocate(api, CLAIMS, node_name=NODE, reserved_for=[POD], binding_conditions=True)
    waiting = scheduler.prebind(api, CLAIMS)
    assert waiting.state == "waiting" and BINDING_CONDITION in waiting.message
    set_condition(api, "Ready", "Prepared")  # another condition does not count
    assert scheduler.prebind(api, CLAIMS).state == "waiting"
    set_condition(api, BINDING_CONDITION, "DomainReady")
    assert scheduler.prebind(api, CLAIMS).state == "ready"


def test_a_failure_condition_fails_prebind_and_unreserve_deallocates_the_claim(api: ApiServerEmulator) -> None:
    publish(api, binding_conditions=True)
    scheduler.allocate(api, CLAIMS, node_name=NODE, reserved_for=[POD], binding_conditions=True)
    set_condition(api, BINDING_FAILURE_CONDITION, "IMEXDaemonFailed", "nvidia-imex keeps exiting")
    outcome = scheduler.prebind(api, CLAIMS)
    assert outcome.state == "failed"
    assert "IMEXDaemonFailed" in outcome.message and "nvidia-imex keeps exiting" in outcome.message
    scheduler.unreserve(api, CLAIMS, POD)
    status = stored(api).get("status") or {}
    assert not status.get("allocation") and not status.get("reservedFor") and not status.get("devices")
    # the next attempt allocates anew
    [again] = scheduler.allocate(api, CLAIMS, node_name=NODE, reserved_for=[POD], binding_conditions=True)
    assert again["status"]["allocation"]["devices"]["results"][0]["device"] == "channel-0"


def test_prebind_times_out_after_the_binding_timeout_from_the_allocation(api: ApiServerEmulator) -> None:
    publish(api, binding_conditions=True)
    [claim] = scheduler.allocate(api, CLAIMS, node_name=NODE, reserved_for=[POD], binding_conditions=True)
    allocated_at = scheduler.unix_seconds(claim["status"]["allocation"]["allocationTimestamp"])
    assert allocated_at is not None
    assert scheduler.prebind(api, CLAIMS, timeout_s=5.0, now=allocated_at + 4.0).state == "waiting"
    outcome = scheduler.prebind(api, CLAIMS, timeout_s=5.0, now=allocated_at + 6.0)
    assert outcome.state == "timeout" and "bindingTimeout of 5 s" in outcome.message
    assert scheduler.prebind(api, CLAIMS, now=allocated_at + 6.0).state == "waiting"  # default: 600 s


def test_without_binding_conditions_prebind_is_ready_and_unreserve_keeps_the_allocation(
        api: ApiServerEmulator) -> None:
    publish(api, binding_conditions=False)
    [claim] = scheduler.allocate(api, CLAIMS, node_name=NODE, reserved_for=[POD], binding_conditions=True)
    assert "bindingConditions" not in claim["status"]["allocation"]["devices"]["results"][0]
    assert scheduler.prebind(api, CLAIMS).state == "ready"
    scheduler.unreserve(api, CLAIMS, POD)
    status = stored(api)["status"]
    assert status["allocation"] and not status.get("reservedFor")
