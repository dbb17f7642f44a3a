"""Start-up with the sockets served first (issue 17): registration and the DRA socket exist before the plugin's
parts, claims sent meanwhile wait for readiness and are then prepared, and a failed start answers them with the
failure (real gRPC through the kubelet emulator, API emulator over HTTP)."""

from __future__ import annotations

import asyncio

import pytest

from dradriver.app import run_plugin, start_plugin
from dradriver.errors import DradriverError
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from dradriver.server import deferred
from tests.plugin.conftest import claim_object, ref_of, result, set_allocation, wait_for


def test_claims_sent_before_readiness_wait_and_are_prepared(sandbox: SandboxNode) -> None:
    assert sandbox.api is not None
    claim = set_allocation(sandbox, sandbox.api.create(claim_object("early")), [result("gpu-0")])
    ref = ref_of(claim)
    config = sandbox.config()

    async def body() -> None:
        early = await deferred.start_early(config)
        assert config.registration_socket.exists() and config.dra_socket.exists()
        async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
            connection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)  # registered already
            assert not early.readiness.attached and not early.readiness.ready()
            assert await connection.prepare([]) == {}  # an empty request needs no part of the plugin
            pending = asyncio.ensure_future(connection.prepare([ref]))
            await asyncio.sleep(0.2)
            assert not pending.done()  # waits for the parts, is not refused
            plugin = await start_plugin(config, early=early)
            try:
                assert plugin.servers is early.servers
                answer = await asyncio.wait_for(pending, 30)
                assert not answer[ref.uid].error, answer[ref.uid].error
                assert [d.device_name for d in answer[ref.uid].devices] == ["gpu-0"]
                assert plugin.state.get(ref.uid) is not None
                await wait_for(lambda: plugin.publisher.last_result is not None)
                assert early.readiness.ready()
                assert await connection.unprepare([ref]) == {ref.uid: ""}
            finally:
                await plugin.stop()
        assert not config.registration_socket.exists()

    asyncio.run(body())


def test_a_failed_start_answers_waiting_claims_with_its_error(sandbox: SandboxNode) -> None:
    assert sandbox.api is not None
    ref = ref_of(set_allocation(sandbox, sandbox.api.create(claim_object("doomed")), [result("gpu-1")]))
    # the CDI root is a regular file: the start fails after the sockets were served
    blocker = sandbox.root / "not-a-directory"
    blocker.write_text("")
    config = sandbox.config(cdi_root=blocker)

    async def body() -> None:
        early = await deferred.start_early(config)
        async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
            connection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)
            pending = asyncio.ensure_future(connection.prepare([ref]))
            await asyncio.sleep(0.1)
            try:
                await run_plugin(config, asyncio.Event(), early=early)
            except (DradriverError, OSError) as exc:
                failure = str(exc)
            else:
                raise AssertionError("the start should fail without the Node")
            answer = await asyncio.wait_for(pending, 30)
            assert "the plugin failed to start" in answer[ref.uid].error
            assert failure in answer[ref.uid].error
        assert not config.registration_socket.exists() and not config.dra_socket.exists()

    asyncio.run(body())


def test_an_unprepare_waits_for_the_start_at_most_the_kubelets_deadline(sandbox: SandboxNode,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An unprepare sent while the plugin's parts are still starting waits for them, but no longer than the kubelet
    waits for its answer (45 s; shortened here): then it is the claim's error and the DRA server's thread is free."""
    monkeypatch.setattr(deferred, "KUBELET_CALL_TIMEOUT_S", 0.3)
    assert sandbox.api is not None
    config = sandbox.config()
    ref = ref_of(set_allocation(sandbox, sandbox.api.create(claim_object("late")), [result("gpu-0")]))

    async def body() -> None:
        early = await deferred.start_early(config)
        try:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)
                answer = await asyncio.wait_for(connection.unprepare([ref]), 10)
                assert "default/late" in answer[ref.uid] and "still starting after 0.3 s" in answer[ref.uid]
        finally:
            await early.servers.stop()

    asyncio.run(body())
