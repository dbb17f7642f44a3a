"""Stale claims are cleaned up: the kubelet never sends Unprepare for a claim whose ResourceClaim is gone."""

from __future__ import annotations

import asyncio

import pytest

from dradriver.domain.identity import GPU_DRIVER
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation


@pytest.mark.slow
def test_gone_and_replaced_claims_are_unprepared_after_the_grace_period(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None
    names = ("deleted", "recreated", "kept", "deallocated")
    refs = {n: ref_of(set_allocation(sandbox, api.create(claim_object(n)), [result(f"gpu-{i}")]))
            for i, n in enumerate(names)}

    async def body() -> None:
        async with running(sandbox.config(stale_claim_grace_seconds=100)) as (plugin, kubelet):
            answers = await kubelet.prepare(list(refs.values()))
            assert all(a.error == "" for a in answers.values())
            reconciler = plugin.reconciler
            assert reconciler is not None
            now = [1000.0]
            reconciler.clock = lambda: now[0]
            api.delete("ResourceClaim", "deleted", "default")  # pod force-deleted, claim gone
            api.delete("ResourceClaim", "recreated", "default")
            api.create(claim_object("recreated"))  # same name, new UID
            stored = api.get("ResourceClaim", "deallocated", "default")
            assert stored is not None
            stored["status"] = {}
            api.update(stored, subresource="status")  # no longer allocated
            # the API server answers errors: nothing is decided
            api.fail_next(1000, status=500, method="GET", path="/apis/resource.k8s.io/v1/namespaces/default")
            assert await reconciler.run_once() == []
            assert reconciler.skipped_rounds >= 1 and len(plugin.state.claims()) == 4
            api.clear_faults()
            assert await reconciler.run_once() == []  # stale, but not for the grace period yet
            now[0] += 101
            cleaned = await reconciler.run_once()
            assert sorted(c.ref.name for c in cleaned) == ["deallocated", "deleted", "recreated"]
            assert all(c.error == "" for c in cleaned)
            assert set(plugin.state.claims()) == {refs["kept"].uid}
            assert [p.name for p in sandbox.cdi_specs()] == [GPU_DRIVER.cdi.spec_name(refs["kept"].uid)]
            reasons = {c.ref.name: c.reason for c in cleaned}
            assert reasons["deleted"].startswith("gone") and reasons["recreated"].startswith("replaced")
            events = [e for e in api.objects("events", namespace="default") if e["reason"] == "StaleClaimUnprepared"]
            assert len(events) == 3 and any("default/deleted" in e["message"] for e in events)
            assert plugin.metrics is not None
            samples = {(s.labels["reason"], s.value) for m in plugin.metrics.stale_claims.collect()
                       for s in m.samples if s.name.endswith("_total")}
            assert samples == {("gone", 1.0), ("replaced", 1.0), ("unallocated", 1.0)}
            # the kubelet's own unprepare of a cleaned claim later still succeeds (unknown claims succeed)
            assert await kubelet.unprepare([refs["deleted"]]) == {refs["deleted"].uid: ""}

    asyncio.run(body())
