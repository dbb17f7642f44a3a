"""Fetching ResourceClaims through the official client and reducing them to this node's allocation."""

from __future__ import annotations

from typing import Any

import pytest

from dradriver.domain.claims import AllocationResult, ClaimError, ClaimRef, claim_from_object
from dradriver.kube import errors
from dradriver.kube.claims import fetch_claim, get_resource_claim
from dradriver.kube.client import KubeClient
from dradriver.sandbox.apiserver import ApiServerEmulator

from .conftest import DRIVER, NODE

OTHER = "net.example.com"


def _claim(name: str, results: list[dict[str, Any]] | None,
           config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {
                "expression": "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"}}]}},
            {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}},
        ]}},
    }
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": results, "config": config or []}}}
    return obj


def _ref(api: ApiServerEmulator, name: str) -> ClaimRef:
    stored = api.get("ResourceClaim", name, "default")
    assert stored is not None
    return ClaimRef("default", name, stored["metadata"]["uid"])


def test_allocated_claim_for_two_drivers_keeps_ours(client: KubeClient, api: ApiServerEmulator) -> None:
    api.create(_claim("two-drivers", [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"},
        {"request": "nic", "driver": OTHER, "pool": NODE, "device": "eth1"},
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1", "adminAccess": True},
    ], config=[
        {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"kind": "B"}}},
        {"source": "FromClaim", "opaque": {"driver": OTHER, "parameters": {}}},
        {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {"kind": "A"}}},
    ]))
    claim = fetch_claim(client, _ref(api, "two-drivers"), driver=DRIVER, pool=NODE)
    assert claim.results == (
        AllocationResult("gpu", DRIVER, NODE, "gpu-0"),
        AllocationResult("gpu", DRIVER, NODE, "gpu-1", admin_access=True),
    )
    assert [c["opaque"]["parameters"]["kind"] for c in claim.configs] == ["A", "B"]  # type: ignore[index]


def test_raw_get_returns_the_api_json(client: KubeClient, api: ApiServerEmulator) -> None:
    api.create(_claim("raw", [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]))
    obj = get_resource_claim(client, "default", "raw")
    assert obj["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    assert obj["kind"] == "ResourceClaim"


def test_missing_claim_is_a_claim_error(client: KubeClient) -> None:
    ref = ClaimRef("default", "gone", "1234")
    with pytest.raises(ClaimError, match=r"claim default/gone \(uid 1234\): ResourceClaim not found") as info:
        fetch_claim(client, ref, driver=DRIVER, pool=NODE)
    assert isinstance(info.value.__cause__, errors.KubeNotFoundError)


def test_uid_mismatch_names_both_uids(client: KubeClient, api: ApiServerEmulator) -> None:
    api.create(_claim("replaced", [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]))
    real = _ref(api, "replaced").uid
    with pytest.raises(ClaimError, match=f"metadata.uid is '{real}', kubelet asked for 'old-uid'"):
        fetch_claim(client, ClaimRef("default", "replaced", "old-uid"), driver=DRIVER, pool=NODE)


def test_unallocated_claim(client: KubeClient, api: ApiServerEmulator) -> None:
    api.create(_claim("pending", None))
    with pytest.raises(ClaimError, match=r"status\.allocation is empty: claim is not allocated"):
        fetch_claim(client, _ref(api, "pending"), driver=DRIVER, pool=NODE)


def test_claim_allocated_on_another_node(client: KubeClient, api: ApiServerEmulator) -> None:
    api.create(_claim("elsewhere", [{"request": "gpu", "driver": DRIVER, "pool": "node-b", "device": "gpu-0"}]))
    with pytest.raises(ClaimError, match="only in pool\\(s\\) node-b, none in this node's pool 'node-a'"):
        fetch_claim(client, _ref(api, "elsewhere"), driver=DRIVER, pool=NODE)


def test_claim_without_our_driver(client: KubeClient, api: ApiServerEmulator) -> None:
    api.create(_claim("nic-only", [{"request": "nic", "driver": OTHER, "pool": NODE, "device": "eth1"}]))
    with pytest.raises(ClaimError, match=r"has no device of driver gpu\.nvidia\.com"):
        fetch_claim(client, _ref(api, "nic-only"), driver=DRIVER, pool=NODE)


def test_transient_api_failure_is_retried(client: KubeClient, api: ApiServerEmulator) -> None:
    api.create(_claim("flaky", [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]))
    api.fail_next(2, status=500, path="/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/flaky")
    assert fetch_claim(client, _ref(api, "flaky"), driver=DRIVER, pool=NODE).results[0].device == "gpu-0"


@pytest.mark.parametrize(("status", "field"), [
    ({"allocation": {"devices": {"results": [{"driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}}},
     "status.allocation.devices.results[0].request is missing"),
    ({"allocation": {"devices": {"results": ["gpu-0"]}}},
     "status.allocation.devices.results[0]: must be an object, got string"),
    ({"allocation": {"devices": {"results": {}}}}, "status.allocation.devices.results: must be a list, got object"),
    ({"allocation": {}}, "status.allocation is empty"),
])
def test_malformed_allocation_names_the_field(status: dict[str, Any], field: str) -> None:
    ref = ClaimRef("ns", "c", "u")
    with pytest.raises(ClaimError, match=field.replace("[", r"\[").replace("]", r"\]")):
        claim_from_object({"metadata": {"uid": "u"}, "status": status}, ref, driver=DRIVER, pool=NODE)
