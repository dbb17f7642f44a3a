"""Two kubelet-plugin identities in one process, on one node, sharing no file, socket or lock."""

from __future__ import annotations

import asyncio
import os

import pytest

from dradriver.app import start_plugin
from dradriver.domain.cdi import CdiKind
from dradriver.domain.identity import GPU_DRIVER, DriverIdentity
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, set_allocation, wait_for

SECOND = DriverIdentity(driver_name="gpu.second.example.com", cdi=CdiKind("k8s.gpu.second.example.com"),
                        taint_domain="gpu.second.example.com", user_agent="dradriver/gpu.second.example.com",
                        state_file="second.state")


@pytest.mark.slow
def test_two_identities_run_side_by_side(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None

    async def body() -> None:
        config = sandbox.config()
        first = await start_plugin(config)
        second = await start_plugin(config, SECOND)
        try:
            await wait_for(lambda: first.publisher.last_result is not None and
                           second.publisher.last_result is not None)
            # no shared file, socket or lock
            paths = [(p.config.dra_socket, p.config.registration_socket, p.state.path, p.config.lock_path)
                     for p in (first, second)]
            assert not set(paths[0]) & set(paths[1]), paths
            assert second.state.path.name == "second.state"
            assert second.config.plugin_dir.name == SECOND.driver_name
            # each publishes its own pool under its own driver name
            drivers = sorted(s["spec"]["driver"] for s in api.objects("ResourceSlice"))
            assert drivers == sorted([GPU_DRIVER.driver_name, SECOND.driver_name])
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                one = await kubelet.wait_for_plugin(GPU_DRIVER.driver_name, timeout=10)
                two = await kubelet.wait_for_plugin(SECOND.driver_name, timeout=10)
                a = ref_of(set_allocation(sandbox, api.create(claim_object("a")), [result("gpu-0")]))
                b = ref_of(set_allocation(sandbox, api.create(claim_object("b")), [
                    result("gpu-0", driver=SECOND.driver_name)]))
                answer_a = (await one.prepare([a]))[a.uid]
                answer_b = (await two.prepare([b]))[b.uid]
                assert answer_a.error == "" and answer_b.error == ""
                assert answer_a.devices[0].cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={a.uid}-gpu-0",)
                assert answer_b.devices[0].cdi_device_ids == (f"k8s.gpu.second.example.com/claim={b.uid}-gpu-0",)
                # each plugin's claim state holds only its own claim; each spec has its own CDI kind
                assert set(first.state.claims()) == {a.uid} and set(second.state.claims()) == {b.uid}
                names = sorted(os.listdir(sandbox.cdi_root))
                assert names == sorted([f"k8s.gpu.nvidia.com-claim_{a.uid}.yaml",
                                        f"k8s.gpu.second.example.com-claim_{b.uid}.yaml"])
                # a claim of one driver is not the other's business
                foreign = (await two.prepare([a]))[a.uid].error
                assert f"has no device of driver {SECOND.driver_name}" in foreign
                assert await one.unprepare([a]) == {a.uid: ""}
                assert await two.unprepare([b]) == {b.uid: ""}
                assert os.listdir(sandbox.cdi_root) == []
        finally:
            await second.stop()
            await first.stop()

    asyncio.run(body())
