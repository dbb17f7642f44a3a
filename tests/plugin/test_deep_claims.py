"""Deeply nested ResourceClaims, served over real HTTP by the API emulator, prepared in a batch with a normal claim.

The emulator stores objects as dicts and encodes them with ``json.dumps``, which stops near Python's recursion
limit, so the deep bodies are sent as raw responses (:meth:`ApiServerEmulator.respond_next`) built from the stored
claim: the client receives exactly what a real API server would send for such an object.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dradriver.kube.jsonbody import MAX_DEPTH
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
PLACEHOLDER = '"@@deep@@"'


def _nested(depth: int) -> str:
    """A JSON object ``depth`` levels deep: ``{"f:a":{"f:a":...{}...}}``."""
    return '{"f:a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def _body(stored: dict[str, Any], deep: str, *, where: str) -> bytes:
    """The stored claim as JSON with ``deep`` spliced in at ``where`` (``managedFields`` or ``parameters``)."""
    obj = json.loads(json.dumps(stored))
    if where == "managedFields":
        obj["metadata"]["managedFields"] = [{"manager": "kubectl", "operation": "Update", "apiVersion": "v1",
                                             "fieldsType": "FieldsV1", "fieldsV1": "@@deep@@"}]
    else:
        obj["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "opaque": {
            "driver": "gpu.nvidia.com", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "@@deep@@"}}}}}]
    text = json.dumps(obj)
    assert text.count(PLACEHOLDER) == 1
    return text.replace(PLACEHOLDER, deep).encode()


def _prepare_with_deep_claim(sandbox: SandboxNode, depth: int, *, where: str) -> tuple[str, str]:
    """Prepare ``[normal, deep]`` in one batch; returns their errors (``""`` = prepared)."""
    async def body() -> tuple[str, str]:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            normal = set_allocation(sandbox, sandbox.api.create(claim_object("normal")), [result("gpu-0")])
            deep = set_allocation(sandbox, sandbox.api.create(claim_object("deep")), [result("gpu-1")])
            sandbox.api.respond_next(_body(deep, _nested(depth), where=where), 10, method="GET",
                                     path=f"{CLAIMS}/deep")
            refs = [ref_of(normal), ref_of(deep)]
            answer = await kubelet.prepare(refs)
            assert set(answer) == {r.uid for r in refs}
            if not answer[refs[0].uid].error:
                assert refs[0].uid in plugin.state.claims()
            assert (refs[1].uid in plugin.state.claims()) == (not answer[refs[1].uid].error)
            return answer[refs[0].uid].error, answer[refs[1].uid].error

    return asyncio.run(body())


def test_claim_too_deep_to_decode_gets_its_own_error(sandbox: SandboxNode) -> None:
    normal, deep = _prepare_with_deep_claim(sandbox, MAX_DEPTH + 5_000, where="managedFields")
    assert normal == ""
    assert "claim default/deep" in deep
    assert "cannot read the ResourceClaim" in deep and f"nested deeper than {MAX_DEPTH} levels" in deep


def test_managed_fields_deeper_than_the_recursion_limit_do_not_matter(sandbox: SandboxNode) -> None:
    """Decoding does not depend on Python's recursion limit: 3,000 levels of ``managedFields`` are decoded
    and ignored, and the claim is prepared."""
    normal, deep = _prepare_with_deep_claim(sandbox, 3_000, where="managedFields")
    assert (normal, deep) == ("", "")


def test_deep_opaque_parameters_are_a_config_error_naming_the_field(sandbox: SandboxNode) -> None:
    normal, deep = _prepare_with_deep_claim(sandbox, 3_000, where="parameters")
    assert normal == ""
    assert "claim default/deep" in deep
    assert ("status.allocation.devices.config[0].opaque.parameters.sharing.timeSlicingConfig.interval: must be a "
            "string, got an object") in deep


def test_any_exception_while_fetching_stays_with_its_claim(sandbox: SandboxNode, monkeypatch: Any) -> None:
    """Whatever a claim's GET or reduction raises, RecursionError included, is that claim's answer."""
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            refs = [ref_of(set_allocation(sandbox, sandbox.api.create(claim_object(name)), [result(f"gpu-{i}")]))
                    for i, name in enumerate(("first", "recursing", "third"))]
            original = plugin.runner.fetch_claim

            def fetch(ref: Any, timeout_s: float) -> Any:
                if ref.name == "recursing":
                    raise RecursionError("maximum recursion depth exceeded")
                return original(ref, timeout_s)

            monkeypatch.setattr(plugin.runner, "fetch_claim", fetch)
            answer = await kubelet.prepare(refs)
            assert answer[refs[0].uid].error == "" and answer[refs[2].uid].error == ""
            assert "claim default/recursing" in answer[refs[1].uid].error
            assert "RecursionError" in answer[refs[1].uid].error
            assert set(plugin.state.claims()) == {refs[0].uid, refs[2].uid}

    asyncio.run(body())
