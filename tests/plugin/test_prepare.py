"""NodePrepareResources / NodeUnprepareResources end to end.

The real plugin (``dradriver.app.start_plugin``) runs against the mock ``libnvidia-ml.so.1``, the API
emulator over HTTP and the kubelet emulator over the plugin's Unix sockets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading

import kubernetes_validate
import pytest

from dradriver.app import start_plugin
from dradriver.domain.identity import GPU_DRIVER
from dradriver.sandbox import scheduler
from dradriver.sandbox.node import SandboxNode
from tests.cdi import helpers as cdi_checks
from tests.plugin.conftest import SEED_SELECTOR, claim_object, ref_of, result, running, set_allocation, wait_for


def test_seed_claim_is_prepared_with_a_valid_cdi_spec(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            assert kubelet.service == "v1.DRAPlugin"
            await wait_for(lambda: bool(sandbox.api and sandbox.api.objects("ResourceSlice")))
            for obj in sandbox.api.objects("ResourceSlice"):
                kubernetes_validate.validate(obj, "1.34", strict=True)
            sandbox.api.create(claim_object("big-gpu", selector=SEED_SELECTOR))
            [claim] = scheduler.allocate(sandbox.api, [("default", "big-gpu")], node_name=sandbox.node_name)
            [alloc] = claim["status"]["allocation"]["devices"]["results"]
            ref = ref_of(claim)
            answer = await kubelet.prepare([ref])
            res = answer[ref.uid]
            assert res.error == ""
            [device] = res.devices
            assert device.device_name == alloc["device"]
            assert device.pool_name == sandbox.node_name
            assert device.request_names == ("gpu",)
            assert device.cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={ref.uid}-{alloc['device']}",)
            path = GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
            spec = cdi_checks.validate(path.read_bytes())
            assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
            minor = int(alloc["device"].removeprefix("gpu-"))
            [cdi_dev] = spec["devices"]
            paths = [n["path"] for n in cdi_dev["containerEdits"]["deviceNodes"]]
            assert f"/dev/nvidia{minor}" in paths
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert not path.exists()
            assert len(plugin.state) == 0

    asyncio.run(body())


def test_two_pods_sharing_one_claim_prepare_it_once(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            sandbox.api.create(claim_object("shared-gpu"))
            [claim] = scheduler.allocate(sandbox.api, [("default", "shared-gpu")], node_name=sandbox.node_name)
            ref = ref_of(claim)
            first, second = await asyncio.gather(kubelet.prepare([ref]), kubelet.prepare([ref]))
            assert first[ref.uid].error == "" and first == second
            assert plugin.runner.preparations == 1
            assert len(sandbox.cdi_specs()) == 1

    asyncio.run(body())


def test_two_claims_on_two_gpus_in_one_batch(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_, kubelet):
            a = sandbox.api.create(claim_object("a"))
            b = sandbox.api.create(claim_object("b"))
            a = set_allocation(sandbox, a, [result("gpu-0")])
            b = set_allocation(sandbox, b, [result("gpu-1")])
            answer = await kubelet.prepare([ref_of(a), ref_of(b)])
            assert [r.error for r in answer.values()] == ["", ""]
            assert {r.devices[0].device_name for r in answer.values()} == {"gpu-0", "gpu-1"}
            assert len(sandbox.cdi_specs()) == 2

    asyncio.run(body())


def test_device_held_by_another_claim_is_a_per_claim_error(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_, kubelet):
            a = set_allocation(sandbox, sandbox.api.create(claim_object("a")), [result("gpu-2")])
            b = set_allocation(sandbox, sandbox.api.create(claim_object("b")), [result("gpu-2")])
            c = set_allocation(sandbox, sandbox.api.create(claim_object("c")), [result("gpu-2", admin=True)])
            assert (await kubelet.prepare([ref_of(a)]))[a["metadata"]["uid"]].error == ""
            answer = await kubelet.prepare([ref_of(b), ref_of(c)])
            error = answer[b["metadata"]["uid"]].error
            assert "default/b" in error and "gpu-2" in error and "default/a" in error
            assert answer[c["metadata"]["uid"]].error == ""  # admin access may share the device
            assert len(sandbox.cdi_specs()) == 2

    asyncio.run(body())


def test_results_of_other_drivers_are_ignored(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_, kubelet):
            claim = sandbox.api.create(claim_object("multi"))
            claim = set_allocation(
                sandbox,
                claim,
                [result("gpu-3"), result("nic-0", driver="net.example.com", request="nic"),
                 result("gpu-4", pool="other-node")],
            )
            answer = (await kubelet.prepare([ref_of(claim)]))[claim["metadata"]["uid"]]
            assert answer.error == ""
            assert [d.device_name for d in answer.devices] == ["gpu-3"]

    asyncio.run(body())


def test_bad_claims_get_their_own_errors_and_the_batch_succeeds(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_, kubelet):
            good = set_allocation(sandbox, sandbox.api.create(claim_object("good")), [result("gpu-5")])
            pending = sandbox.api.create(claim_object("pending"))
            unknown = set_allocation(sandbox, sandbox.api.create(claim_object("unknown-dev")), [result("gpu-99")])
            replaced = ref_of(sandbox.api.create(claim_object("replaced")))
            replaced = type(replaced)(replaced.namespace, replaced.name, "00000000-0000-0000-0000-000000000000")
            missing = type(replaced)("default", "never-created", "11111111-1111-1111-1111-111111111111")
            refs = [ref_of(good), ref_of(pending), ref_of(unknown), replaced, missing]
            answer = await kubelet.prepare(refs)
            assert answer[ref_of(good).uid].error == ""
            assert "default/pending" in answer[ref_of(pending).uid].error
            assert "status.allocation" in answer[ref_of(pending).uid].error
            err = answer[ref_of(unknown).uid].error
            assert "default/unknown-dev" in err and "gpu-99" in err and "results[0]" in err
            assert "metadata.uid" in answer[replaced.uid].error
            assert "not found" in answer[missing.uid].error.lower()
            assert len(sandbox.cdi_specs()) == 1

    asyncio.run(body())


def test_unprepare_after_the_claim_was_deleted_and_unknown_claims(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("gone")), [result("gpu-6")])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            sandbox.api.delete("ResourceClaim", "gone", "default")
            stranger = type(ref)("default", "stranger", "22222222-2222-2222-2222-222222222222")
            assert await kubelet.unprepare([ref, stranger]) == {ref.uid: "", stranger.uid: ""}
            assert sandbox.cdi_specs() == []
            assert len(plugin.state) == 0

    asyncio.run(body())


@pytest.mark.slow
def test_prepare_restart_unprepare_and_vanished_spec_rewritten(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        claim = set_allocation(sandbox, sandbox.api.create(claim_object("durable")), [result("gpu-7")])
        ref = ref_of(claim)
        async with running(sandbox.config()) as (_, kubelet):
            first = await kubelet.prepare([ref])
        assert len(sandbox.cdi_specs()) == 1
        sandbox.cdi_specs()[0].unlink()  # someone cleaned /var/run/cdi
        async with running(sandbox.config()) as (plugin, kubelet):
            assert len(plugin.state) == 1
            again = await kubelet.prepare([ref])
            assert again == first
            assert plugin.runner.preparations == 0  # answered from the stored state
            assert len(sandbox.cdi_specs()) == 1  # rewritten
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
        assert sandbox.cdi_specs() == []

    asyncio.run(body())


def test_slow_prepare_finishing_after_unprepare_does_not_revive_the_claim(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        claim = set_allocation(sandbox, sandbox.api.create(claim_object("slow")), [result("gpu-1")])
        ref = ref_of(claim)
        plugin = await start_plugin(sandbox.config())
        try:
            original = plugin.runner.fetch_claim
            fetched = threading.Event()
            release = threading.Event()

            def slow_fetch(r, timeout_s):  # type: ignore[no-untyped-def]
                out = original(r, timeout_s)
                fetched.set()
                assert release.wait(10)
                return out

            plugin.runner.fetch_claim = slow_fetch
            prepare = asyncio.create_task(asyncio.to_thread(plugin.runner.prepare_claims, [ref]))
            assert await asyncio.to_thread(fetched.wait, 10)
            assert await asyncio.to_thread(plugin.runner.unprepare_claims, [ref]) == {ref.uid: ""}
            release.set()
            answer = await prepare
            assert "unprepared while this prepare was in flight" in answer[ref.uid].error
            assert len(plugin.state) == 0
            assert sandbox.cdi_specs() == []
        finally:
            await plugin.stop()

    asyncio.run(body())


def test_v1beta1_service_prepares_too(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_, kubelet):
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("beta")), [result("gpu-0")])
            ref = ref_of(claim)
            answer = await kubelet.prepare([ref], service="v1beta1.DRAPlugin")
            assert answer[ref.uid].error == ""
            assert await kubelet.unprepare([ref], service="v1beta1.DRAPlugin") == {ref.uid: ""}

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_mig_device_claim_gets_capability_nodes(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, kubelet):
            mig = next(d for d in plugin.inventory.allocatable() if d.name.startswith("gpu-0-mig-"))
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("mig")), [result(mig.name)])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            spec = cdi_checks.validate(GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid).read_bytes())
            paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
            assert "/dev/nvidia0" in paths
            assert sum(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in paths) == 2

    asyncio.run(body())


def test_many_one_claim_prepares_at_once_share_the_api_connections(sandbox: SandboxNode,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet prepares many pods at once: each one-claim call GETs from its own DRA server thread. The client's
    connection pool is sized for every thread that may GET at once, so no connection is opened, used once and
    thrown away (urllib3's "Connection pool is full" warning), whatever the node's CPU count."""
    assert sandbox.api is not None
    api = sandbox.api
    refs = [ref_of(set_allocation(sandbox, api.create(claim_object(f"burst-{i}")), [result("gpu-0", admin=True)]))
            for i in range(32)]

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            caplog.set_level(logging.WARNING, logger="urllib3")
            # every GET answers after 0.5 s, so all 32 are in flight together
            api.hang_next(len(refs), seconds=0.5, method="GET",
                          path="/apis/resource.k8s.io/v1/namespaces/default/resourceclaims")
            answers = await asyncio.gather(*(kubelet.prepare([ref]) for ref in refs))
            assert all(answer[ref.uid].error == "" for answer, ref in zip(answers, refs, strict=True))
            assert len(plugin.state) == len(refs)
            assert not [r for r in caplog.records if "Connection pool is full" in r.getMessage()]

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["vr200-node"], indirect=True)
def test_a_claim_for_a_rubin_gpu_is_prepared_on_its_minor(sandbox: SandboxNode) -> None:
    """Vera Rubin tray: NVML index 1 is minor 3 (``gpu-3``, ``/dev/nvidia3``), selected by architecture and PCI bus."""
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_, kubelet):
            selector = ("device.attributes['gpu.nvidia.com'].architecture == 'Rubin' && "
                        "device.attributes['resource.kubernetes.io'].pciBusID == '0002:c1:00.0'")
            sandbox.api.create(claim_object("rubin", selector=selector))
            [claim] = scheduler.allocate(sandbox.api, [("default", "rubin")], node_name=sandbox.node_name)
            [alloc] = claim["status"]["allocation"]["devices"]["results"]
            assert alloc["device"] == "gpu-3"
            ref = ref_of(claim)
            answer = await kubelet.prepare([ref])
            assert answer[ref.uid].error == ""
            spec = cdi_checks.validate(GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid).read_bytes())
            [cdi_dev] = spec["devices"]
            paths = [n["path"] for n in cdi_dev["containerEdits"]["deviceNodes"]]
            assert "/dev/nvidia3" in paths and "/dev/nvidia1" not in paths
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())
