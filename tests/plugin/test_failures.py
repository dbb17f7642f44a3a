"""Failures inside a prepare batch stay with their claim: every UID is answered, nothing is left half-done."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dradriver.domain import cdi
from dradriver.host import cdifiles
from dradriver.host.claimstate import ClaimPhase
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation


def test_unexpected_error_for_one_claim_does_not_fail_the_batch(sandbox: SandboxNode,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            refs = [ref_of(set_allocation(sandbox, sandbox.api.create(claim_object(f"c{i}")), [result(f"gpu-{i}")]))
                    for i in range(3)]
            original = plugin.runner._plan

            def flaky(claim: Any) -> Any:
                if claim.ref.name == "c1":
                    raise RuntimeError("boom")
                return original(claim)

            monkeypatch.setattr(plugin.runner, "_plan", flaky)
            answer = await kubelet.prepare(refs)
            assert answer[refs[0].uid].error == "" and answer[refs[2].uid].error == ""
            assert "internal error (RuntimeError: boom)" in answer[refs[1].uid].error
            assert "default/c1" in answer[refs[1].uid].error
            assert set(plugin.state.claims()) == {refs[0].uid, refs[2].uid}

    asyncio.run(body())


def test_spec_write_and_rollback_failures_are_answered_per_claim(sandbox: SandboxNode,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            refs = [ref_of(set_allocation(sandbox, sandbox.api.create(claim_object(f"w{i}")), [result(f"gpu-{i}")]))
                    for i in range(4)]
            write, delete = cdifiles.write_claim_spec, cdifiles.delete_claim_spec

            def failing_write(kind: Any, root: Any, uid: str, *args: Any, **kwargs: Any) -> Any:
                if uid in (refs[1].uid, refs[2].uid):
                    raise cdi.CdiSpecError(f"claim {uid}: cannot write CDI spec: disk full")
                return write(kind, root, uid, *args, **kwargs)

            def failing_delete(kind: Any, root: Any, uid: str, **kwargs: Any) -> bool:
                if uid == refs[1].uid:
                    raise cdi.CdiSpecError(f"claim {uid}: cannot delete CDI spec: I/O error")
                return delete(kind, root, uid, **kwargs)

            monkeypatch.setattr(cdifiles, "write_claim_spec", failing_write)
            monkeypatch.setattr(cdifiles, "delete_claim_spec", failing_delete)
            answer = await kubelet.prepare(refs)
            assert set(answer) == {r.uid for r in refs}
            assert answer[refs[0].uid].error == "" and answer[refs[3].uid].error == ""
            assert "disk full" in answer[refs[1].uid].error and "disk full" in answer[refs[2].uid].error
            claims = plugin.state.claims()
            # Both rolled back; w1's spec deletion failed (logged) but its record still went: no claim is left
            # half-prepared, and a leftover spec would be removed at the next start or by an unprepare.
            assert set(claims) == {refs[0].uid, refs[3].uid}
            assert all(r.phase is ClaimPhase.PREPARE_COMPLETED for r in claims.values())
            monkeypatch.undo()
            retry = await kubelet.prepare([refs[1]])
            assert retry[refs[1].uid].error == ""
            assert plugin.state.claims()[refs[1].uid].phase is ClaimPhase.PREPARE_COMPLETED

    asyncio.run(body())
