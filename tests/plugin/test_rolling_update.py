"""Rolling update: two plugin pods on one node for a moment share claim state safely."""

from __future__ import annotations

import asyncio

from dradriver.app import start_plugin
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, set_allocation, wait_for


def test_two_instances_register_side_by_side_and_share_claim_state(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        old = await start_plugin(sandbox.config(pod_uid="0f1e2d3c-old"))
        new = None
        try:
            await wait_for(lambda: old.publisher.last_result is not None)
            new = await start_plugin(sandbox.config(pod_uid="9a8b7c6d-new"))
            assert old.servers.dra_socket != new.servers.dra_socket
            assert old.servers.registration_socket != new.servers.registration_socket
            async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                await kubelet.wait_for_plugin("gpu.nvidia.com")
                await wait_for(lambda: len(kubelet.instances("gpu.nvidia.com")) == 2)
                by_endpoint = {c.endpoint: c for c in kubelet.instances("gpu.nvidia.com")}
                via_old = by_endpoint[str(old.servers.dra_socket)]
                via_new = by_endpoint[str(new.servers.dra_socket)]
                a = set_allocation(sandbox, sandbox.api.create(claim_object("a")), [result("gpu-0")])
                b = set_allocation(sandbox, sandbox.api.create(claim_object("b")), [result("gpu-0")])
                # Prepared by the old pod, visible to the new one: the same device is refused for another claim.
                assert (await via_old.prepare([ref_of(a)]))[ref_of(a).uid].error == ""
                err = (await via_new.prepare([ref_of(b)]))[ref_of(b).uid].error
                assert "already prepared" in err and "default/a" in err
                # Concurrent batches through both instances on disjoint devices all land.
                claims = [set_allocation(sandbox, sandbox.api.create(claim_object(f"c{i}")), [result(f"gpu-{i}")])
                          for i in range(1, 7)]
                refs = [ref_of(c) for c in claims]
                first, second = await asyncio.gather(via_old.prepare(refs[:3]), via_new.prepare(refs[3:]))
                assert all(r.error == "" for r in [*first.values(), *second.values()])
                # The old pod goes away; the new one unprepares what the old one prepared.
                await old.stop()
                assert await via_new.unprepare([ref_of(a), *refs]) == {r.uid: "" for r in [ref_of(a), *refs]}
                assert sandbox.cdi_specs() == []
                assert len(new.state) == 0
        finally:
            await old.stop()
            if new is not None:
                await new.stop()

    asyncio.run(body())
