"""A hung API server: NodePrepareResources answers within its deadline, and unprepare never waits on GETs."""

from __future__ import annotations

import asyncio
import time

import pytest

from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation


def _claim_path(name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}"


@pytest.mark.slow
def test_hung_claim_get_is_a_per_claim_error_within_the_deadline(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None
    hung = ref_of(set_allocation(sandbox, api.create(claim_object("hung")), [result("gpu-0")]))
    fine = ref_of(set_allocation(sandbox, api.create(claim_object("fine")), [result("gpu-1")]))

    async def body() -> None:
        async with running(sandbox.config(prepare_deadline_seconds=3)) as (plugin, kubelet):
            api.hang_next(1, seconds=8, method="GET", path=_claim_path("hung"))
            answer = await kubelet.prepare([hung, fine])
            assert answer[fine.uid].error == ""
            error = answer[hung.uid].error
            assert "default/hung" in error and "did not answer the ResourceClaim GET within" in error
            assert set(plugin.state.claims()) == {fine.uid}  # nothing half-prepared for the hung claim
            assert len(sandbox.cdi_specs()) == 1

    asyncio.run(body())


@pytest.mark.slow
def test_a_one_claim_prepare_whose_get_hangs_answers_within_its_deadline(sandbox: SandboxNode) -> None:
    """The one-claim path GETs in the DRA server's own thread, with the fetch budget as the GET's time limit: a hung
    API server makes it the claim's error in time, and the kubelet's retry (the server answering again) prepares."""
    api = sandbox.api
    assert api is not None
    hung = ref_of(set_allocation(sandbox, api.create(claim_object("hung")), [result("gpu-0")]))

    async def body() -> None:
        async with running(sandbox.config(prepare_deadline_seconds=3)) as (plugin, kubelet):
            api.hang_next(1, seconds=8, method="GET", path=_claim_path("hung"))
            began = time.monotonic()
            answer = await kubelet.prepare([hung])
            assert time.monotonic() - began < 3.0  # the budget is 3 s - its 0.75 s margin
            error = answer[hung.uid].error
            assert "default/hung" in error and "did not answer the ResourceClaim GET within 2.2 s" in error
            assert plugin.state.claims() == {} and sandbox.cdi_specs() == []
            assert (await kubelet.prepare([hung]))[hung.uid].error == ""

    asyncio.run(body())


@pytest.mark.slow
def test_unprepare_is_not_queued_behind_hung_claim_gets(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None
    done = ref_of(set_allocation(sandbox, api.create(claim_object("done")), [result("gpu-0")]))
    refs = [ref_of(set_allocation(sandbox, api.create(claim_object(f"h{i}")), [result("gpu-1", admin=True)]))
            for i in range(50)]

    async def body() -> None:
        # the GETs hang 6 s of a 20 s deadline: the 14 s left hold the prepare of 50 claims on a loaded machine
        async with running(sandbox.config(prepare_deadline_seconds=20)) as (plugin, kubelet):
            assert (await kubelet.prepare([done]))[done.uid].error == ""
            api.hang_next(50, seconds=6, method="GET", path=_claim_path(""))
            batch = asyncio.create_task(kubelet.prepare(refs))
            await asyncio.sleep(0.5)  # the 50 GETs are in flight and hang
            assert await kubelet.unprepare([done]) == {done.uid: ""}
            answered = [r for r in api.requests if r.method == "GET" and "/resourceclaims/h" in r.path]
            assert answered == [] and not batch.done()  # unprepared while every GET of the batch still hangs
            answers = await batch  # within its deadline: GETs that answered in time are prepared, others are errors
            prepared = {uid for uid, a in answers.items() if a.error == ""}
            late = {uid for uid, a in answers.items() if "did not answer the ResourceClaim GET" in a.error}
            others = {uid: a.error for uid, a in answers.items() if uid not in prepared | late}
            assert not others and set(answers) == {r.uid for r in refs} and not prepared & late
            assert set(plugin.state.claims()) == prepared

    asyncio.run(body())
