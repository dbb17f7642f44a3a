"""Every field the plugin reads from a ResourceClaim is read with its JSON type: a wrong type is a claim error
naming the field path, never coerced (``"false"`` is not truthy ``adminAccess``)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from dradriver.domain.claims import ClaimError, ClaimRef, claim_from_object
from dradriver.kube.claims import fetch_claim
from dradriver.kube.client import KubeClient
from dradriver.sandbox.apiserver import ApiServerEmulator

from .conftest import DRIVER, NODE

REF = ClaimRef("ns", "c", "u")
RESULTS = "status.allocation.devices.results[0]"
CONFIG = "status.allocation.devices.config[0]"


def _result(**extra: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0", **extra}


def _config(**extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {}}}
    entry.update(extra)
    return entry


def _obj(results: Any = None, config: Any = None, **top: Any) -> dict[str, Any]:
    devices: dict[str, Any] = {"results": [_result()] if results is None else results}
    if config is not None:
        devices["config"] = config
    obj: dict[str, Any] = {"metadata": {"uid": "u"}, "status": {"allocation": {"devices": devices}}}
    obj.update(top)
    return obj


@pytest.mark.parametrize(("obj", "message"), [
    (_obj([_result(adminAccess="false")]), f"{RESULTS}.adminAccess: must be a boolean, got string"),
    (_obj([_result(adminAccess="true")]), f"{RESULTS}.adminAccess: must be a boolean, got string"),
    (_obj([_result(adminAccess=0)]), f"{RESULTS}.adminAccess: must be a boolean, got number"),
    (_obj([_result(adminAccess=1.0)]), f"{RESULTS}.adminAccess: must be a boolean, got number"),
    (_obj([_result(adminAccess=None)]), f"{RESULTS}.adminAccess: must be a boolean, got null"),
    (_obj([_result(adminAccess=[])]), f"{RESULTS}.adminAccess: must be a boolean, got array"),
    (_obj([_result(adminAccess={})]), f"{RESULTS}.adminAccess: must be a boolean, got object"),
    (_obj([_result(shareID=7)]), f"{RESULTS}.shareID: must be a string, got number"),
    (_obj([_result(shareID=True)]), f"{RESULTS}.shareID: must be a string, got boolean"),
    (_obj([_result(device=3)]), f"{RESULTS}.device is missing or not a string"),
    (_obj([_result(pool=True)]), f"{RESULTS}.pool is missing or not a string"),
    (_obj(config=[_config(source=1)]), f"{CONFIG}.source: must be a string, got number"),
    (_obj(config=[_config(opaque={"driver": 5, "parameters": {}})]),
     f"{CONFIG}.opaque.driver: must be a string, got number"),
    (_obj(config=[_config(opaque={"driver": None, "parameters": {}})]),
     f"{CONFIG}.opaque.driver: must be a string, got null"),
    (_obj(config=[_config(requests="gpu")]), f"{CONFIG}.requests: must be a list of request names, got string"),
    (_obj(config=[_config(requests=["gpu", 1])]), f"{CONFIG}.requests[1]: must be a string, got number"),
    (_obj(config={"a": 1}), "status.allocation.devices.config: must be a list, got object"),
    (_obj(results="gpu-0"), "status.allocation.devices.results: must be a list, got string"),
    ({"metadata": "u", "status": {}}, "metadata: must be an object, got string"),
    ({"metadata": {"uid": 42}, "status": {}}, "metadata.uid: must be a string, got number"),
    ({"metadata": {"uid": "u"}, "status": []}, "status: must be an object, got array"),
    ({"metadata": {"uid": "u"}, "status": {"allocation": "yes"}}, "status.allocation: must be an object, got string"),
    ({"metadata": {"uid": "u"}, "status": {"allocation": {"devices": True}}},
     "status.allocation.devices: must be an object, got boolean"),
])
def test_wrong_json_type_is_a_claim_error_naming_the_field(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(ClaimError, match=re.escape(f"claim {REF}: {message}")):
        claim_from_object(obj, REF, driver=DRIVER, pool=NODE)


def test_booleans_are_read_as_json_booleans() -> None:
    claim = claim_from_object(_obj([_result(adminAccess=True), _result(device="gpu-1", adminAccess=False),
                                    _result(device="gpu-2")]), REF, driver=DRIVER, pool=NODE)
    assert [r.admin_access for r in claim.results] == [True, False, False]


def test_string_admin_access_from_the_api_is_an_error(client: KubeClient, api: ApiServerEmulator) -> None:
    """Through the official client: ``"adminAccess": "false"`` as the API returned it is not truthy."""
    api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "stringly", "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
                "status": {"allocation": {"devices": {"results": [_result(adminAccess="false")]}}}})
    stored = api.get("ResourceClaim", "stringly", "default")
    assert stored is not None
    ref = ClaimRef("default", "stringly", stored["metadata"]["uid"])
    with pytest.raises(ClaimError, match=re.escape(f"claim {ref}: {RESULTS}.adminAccess: must be a boolean, got "
                                                   "string")):
        fetch_claim(client, ref, driver=DRIVER, pool=NODE)
