"""Consumable GPU shares end to end: the real plugin with ``--consumable-shares`` on an H200 node (mock NVML),
ResourceSlices published to the API emulator over HTTP, claims allocated by the scheduler emulator (shareID,
consumedCapacity), prepared through the kubelet emulator over gRPC, each shared GPU's MPS control daemon run as
a Deployment whose Pod the sandbox runs as a local process against the ``nvidia-cuda-mps-control`` stand-in."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from dradriver.domain.identity import GPU_DRIVER
from dradriver.kubeletplugin.payload import held_devices
from dradriver.nvml import settings as nvml_settings
from dradriver.preparers.shares import daemon_id
from dradriver.sandbox import scheduler
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode
from dradriver.sandbox.profiles import h200_node
from dradriver.sandbox.standins.nvidia_cuda_mps_control import STATE_FILE
from tests.cdi import helpers as cdi_checks
from tests.factories import DEVICE_CLASS
from tests.plugin.conftest import ref_of, running, wait_for


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SandboxNode]:
    with SandboxNode(profile=h200_node(tmp_path, gpus=2)) as sandbox:
        assert sandbox.api is not None
        sandbox.api.create(DEVICE_CLASS)
        sandbox.run_workloads()
        yield sandbox


def share_claim(name: str, memory: str | None = "10Gi", *, config: dict[str, Any] | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config is not None:
        devices["config"] = [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": config}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": devices}}


def allocate(node: SandboxNode, *claims: dict[str, Any]) -> list[dict[str, Any]]:
    assert node.api is not None
    out = []
    for claim in claims:
        node.api.create(claim)
        out += scheduler.allocate(node.api, [("default", claim["metadata"]["name"])], node_name=node.node_name)
    return out


def daemons(node: SandboxNode) -> list[str]:
    assert node.api is not None
    return sorted(d["metadata"]["name"] for d in node.api.objects("Deployment")
                  if d["metadata"].get("namespace") == SANDBOX_NAMESPACE)


def spec_env(node: SandboxNode, uid: str) -> tuple[list[str], list[dict[str, Any]]]:
    spec = cdi_checks.validate(GPU_DRIVER.cdi.spec_path(node.cdi_root, uid).read_bytes())
    [device] = spec["devices"]
    edits = device["containerEdits"]
    return list(edits.get("env", [])), list(edits.get("mounts", []))


def test_four_10gi_shares_of_one_h200_run_under_one_mps_daemon_with_their_own_limits(node: SandboxNode) -> None:
    async def body() -> None:
        assert node.api is not None
        async with running(node.shares_config()) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            for obj in node.api.objects("ResourceSlice"):
                kubernetes_validate.validate(obj, "1.35", strict=True)
                assert all(d["allowMultipleAllocations"] for d in obj["spec"]["devices"])
            claims = allocate(node, *(share_claim(f"share-{i}") for i in range(4)))
            refs = [ref_of(c) for c in claims]
            results = [c["status"]["allocation"]["devices"]["results"][0] for c in claims]
            assert {r["device"] for r in results} == {"gpu-0"}
            gpu = plugin.inventory.find("gpu-0")
            assert gpu is not None
            for ref, alloc in zip(refs, results, strict=True):
                answer = (await kubelet.prepare([ref]))[ref.uid]
                assert answer.error == ""
                [device] = answer.devices
                assert device.device_name == "gpu-0" and device.share_id == alloc["shareID"]
            assert daemons(node) == [f"mps-control-daemon-{daemon_id(gpu.uuid)}"]
            directory = node.shares_config().plugin_dir / "mps-shares" / daemon_id(gpu.uuid)
            for ref in refs:
                env, mounts = spec_env(node, ref.uid)
                assert env[-3:] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=8",
                                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"]
                assert {(m["hostPath"], m["containerPath"]) for m in mounts} == {
                    (str(directory / "shm"), "/dev/shm"), (str(directory / "pipe"), "/tmp/nvidia-mps")}
            assert plugin.session is not None
            assert nvml_settings.compute_mode(plugin.session, gpu.uuid) is nvml_settings.ComputeMode.EXCLUSIVE_PROCESS
            state = json.loads((directory / "pipe" / STATE_FILE).read_text())
            assert state["visibleDevices"] in (gpu.uuid, [gpu.uuid]) and state["multiUser"] is True
            # A prepare answered from the claim state carries the same shareID.
            again = (await kubelet.prepare([refs[0]]))[refs[0].uid]
            assert again.devices[0].share_id == results[0]["shareID"]
            for ref in refs[:3]:
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}
                assert daemons(node), "the daemon must outlive single shares"
            assert await kubelet.unprepare([refs[3]]) == {refs[3].uid: ""}
            assert daemons(node) == [] and not directory.exists()
            assert nvml_settings.compute_mode(plugin.session, gpu.uuid) is nvml_settings.ComputeMode.DEFAULT
            assert len(plugin.state) == 0 and node.cdi_specs() == []

    asyncio.run(body())


def test_the_daemon_survives_a_plugin_restart_and_goes_with_the_last_share(node: SandboxNode) -> None:
    async def body() -> None:
        config = node.shares_config()
        async with running(config) as (_plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            refs = [ref_of(c) for c in allocate(node, share_claim("a"), share_claim("b", "20Gi"))]
            for ref in refs:
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [name] = daemons(node)
        # Restarted: the ownership comes back from the claim state; the daemon was never stopped. A CDI spec lost
        # meanwhile (/var/run/cdi cleaned) is rebuilt from the stored share record, limits included.
        assert daemons(node) == [name]
        GPU_DRIVER.cdi.spec_path(node.cdi_root, refs[1].uid).unlink()
        async with running(config) as (plugin, kubelet):
            assert plugin.recovery.swept == ()
            assert plugin.recovery.rebuilt_specs == (refs[1].uid,)
            assert await kubelet.unprepare([refs[0]]) == {refs[0].uid: ""}
            assert daemons(node) == [name]
            env, _ = spec_env(node, refs[1].uid)
            assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in env
            assert await kubelet.unprepare([refs[1]]) == {refs[1].uid: ""}
            assert daemons(node) == []

    asyncio.run(body())


def test_a_half_prepared_share_rolled_back_at_start_keeps_the_daemon_of_the_others(node: SandboxNode) -> None:
    async def body() -> None:
        config = node.shares_config()
        async with running(config) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            refs = [ref_of(c) for c in allocate(node, share_claim("done"), share_claim("crashed"))]
            for ref in refs:
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [name] = daemons(node)
            # A crash in the middle of the second claim's prepare: its record is back to PREPARE_STARTED (undo
            # records stored, nothing acknowledged), as the runner leaves it before the CDI spec is written.
            record = plugin.state.get(refs[1].uid)
            assert record is not None
            plugin.state.prepare_started(refs[1].uid, namespace="default", name="crashed",
                                         devices=held_devices(record), payload=record.payload)
        async with running(config) as (plugin, kubelet):
            assert plugin.recovery.rolled_back == (refs[1].uid,)
            assert daemons(node) == [name], "rolling back one share must not stop the daemon of the others"
            again = (await kubelet.prepare([refs[0]]))[refs[0].uid]
            assert again.error == "" and again.devices[0].share_id
            assert await kubelet.unprepare([refs[0]]) == {refs[0].uid: ""}
            assert daemons(node) == []

    asyncio.run(body())


def test_a_daemon_no_claim_names_is_swept_at_start(node: SandboxNode) -> None:
    async def body() -> None:
        config = node.shares_config()
        async with running(config) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            [ref] = [ref_of(c) for c in allocate(node, share_claim("lost"))]
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            plugin.state.remove(ref.uid)  # the claim state lost the share (the unprepare was never seen)
        async with running(config) as (plugin, _kubelet):
            [swept] = [s for s in plugin.recovery.swept if s.startswith("gpu-share:")]
            assert "MPS control daemon share-" in swept
            assert daemons(node) == []

    asyncio.run(body())


def test_refusals_name_the_claim_and_field(node: SandboxNode) -> None:
    async def body() -> None:
        assert node.api is not None
        config = node.shares_config()
        config = dataclasses.replace(config, feature_gates=config.feature_gates.with_gates(MPSSupport=True))
        async with running(config) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            mps = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
            [claim] = allocate(node, share_claim("with-mps", config=mps))
            ref = ref_of(claim)
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert f"claim default/with-mps (uid {ref.uid})" in error
            assert "status.allocation.devices.config[0].opaque.parameters.sharing.strategy" in error
            assert "MPS sharing is not supported when consumable shares is enabled" in error
            # An allocation without a share (made before consumable shares were on) is refused, not half-shared.
            node.api.create(share_claim("old", None))
            stored = node.api.get("ResourceClaim", "old", "default")
            assert stored is not None
            stored["status"] = {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": node.node_name, "device": "gpu-1"}]}}}
            old = ref_of(node.api.update(stored, subresource="status"))
            error = (await kubelet.prepare([old]))[old.uid].error
            assert "status.allocation.devices.results[0].shareID: missing" in error
            assert daemons(node) == [] and len(plugin.state) == 0

    asyncio.run(body())


def test_a_daemon_that_cannot_start_fails_only_its_claim_and_leaves_nothing(node: SandboxNode) -> None:
    async def body() -> None:
        assert node.api is not None
        config = node.shares_config()
        async with running(config) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            refs = [ref_of(c) for c in allocate(node, share_claim("first"), share_claim("second"))]
            node.api.fail_next(status=403, method="POST",
                               path=f"/apis/apps/v1/namespaces/{SANDBOX_NAMESPACE}/deployments")
            error = (await kubelet.prepare([refs[0]]))[refs[0].uid].error
            assert f"claim default/first (uid {refs[0].uid})" in error and "mps-control-daemon-share-" in error
            assert daemons(node) == [] and not list((config.plugin_dir / "mps-shares").glob("share-*"))
            assert len(plugin.state) == 0 and node.cdi_specs() == []
            # The kubelet's retry, and the next share, work: nothing of the failed start is left in the way.
            for ref in refs:
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert len(daemons(node)) == 1
            assert await kubelet.unprepare(refs) == {ref.uid: "" for ref in refs}
            assert daemons(node) == []

    asyncio.run(body())


def test_shares_of_one_gpu_must_have_equal_configs_and_time_sliced_shares_get_no_daemon(node: SandboxNode) -> None:
    async def body() -> None:
        config = node.shares_config()
        config = dataclasses.replace(config, feature_gates=config.feature_gates.with_gates(TimeSlicingSettings=True))
        sliced = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                  "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}}}
        async with running(config) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            first, plain = allocate(node, share_claim("sliced", config=sliced), share_claim("plain"))
            assert {c["status"]["allocation"]["devices"]["results"][0]["device"] for c in (first, plain)} == {"gpu-0"}
            ref, other = ref_of(first), ref_of(plain)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            gpu = plugin.inventory.find("gpu-0")
            assert gpu is not None and plugin.session is not None
            assert nvml_settings.compute_timeslice(plugin.session, gpu.uuid) == 2
            assert daemons(node) == []
            env, mounts = spec_env(node, ref.uid)
            assert not [e for e in env if e.startswith("CUDA_MPS_")]
            assert all(m["containerPath"] not in ("/tmp/nvidia-mps", "/dev/shm") for m in mounts)
            error = (await kubelet.prepare([other]))[other.uid].error
            assert f"claim default/plain (uid {other.uid})" in error
            assert f"device 'gpu-0' is already prepared for claim(s) {ref.uid} with a different opaque config" in error
            assert daemons(node) == [] and plugin.state.get(other.uid) is None
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert nvml_settings.compute_timeslice(plugin.session, gpu.uuid) == 0
            # With the time-sliced share gone, the plain share's retry gets the GPU and its MPS daemon.
            assert (await kubelet.prepare([other]))[other.uid].error == ""
            assert len(daemons(node)) == 1
            assert await kubelet.unprepare([other]) == {other.uid: ""}

    asyncio.run(body())


def test_a_batch_of_shares_prepared_together_after_a_restart(node: SandboxNode) -> None:
    async def body() -> None:
        config = node.shares_config()
        async with running(config) as (_plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            first = [ref_of(c) for c in allocate(node, share_claim("early"))]
            assert (await kubelet.prepare(first))[first[0].uid].error == ""
        refs = [ref_of(c) for c in allocate(node, *(share_claim(f"batch-{i}") for i in range(3)))]
        # The first call after the restart is a batch whose applies run concurrently in worker threads.
        async with running(config) as (_plugin, kubelet):
            answer = await kubelet.prepare(refs)
            assert {uid: r.error for uid, r in answer.items()} == {r.uid: "" for r in refs}
            assert len(daemons(node)) == 1
            assert await kubelet.unprepare([*first, *refs]) == {r.uid: "" for r in [*first, *refs]}
            assert daemons(node) == []

    asyncio.run(body())


def test_restarted_without_consumable_shares_the_share_is_kept_until_unprepared(node: SandboxNode) -> None:
    async def body() -> None:
        assert node.api is not None
        async with running(node.shares_config()) as (_plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            [share] = [ref_of(c) for c in allocate(node, share_claim("kept"))]
            assert (await kubelet.prepare([share]))[share.uid].error == ""
        # The operator turned consumable shares off; the scheduler now hands gpu-0 out whole.
        node.api.create(share_claim("whole", None))
        stored = node.api.get("ResourceClaim", "whole", "default")
        assert stored is not None
        stored["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": node.node_name, "device": "gpu-0"}]}}}
        whole = ref_of(node.api.update(stored, subresource="status"))
        async with running(node.mps_config(consumable_shares=node.config().consumable_shares)) as (_plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            assert not any(d.get("allowMultipleAllocations") for s in node.api.objects("ResourceSlice")
                           for d in s["spec"]["devices"])
            error = (await kubelet.prepare([whole]))[whole.uid].error
            assert f"device 'gpu-0' is already prepared for consumable shares of claim(s) {share.uid}" in error
            assert len(daemons(node)) == 1
            # The share is still undone by the share preparer (its daemon goes), then the GPU is free.
            assert await kubelet.unprepare([share]) == {share.uid: ""}
            assert daemons(node) == []
            assert (await kubelet.prepare([whole]))[whole.uid].error == ""
            assert await kubelet.unprepare([whole]) == {whole.uid: ""}

    asyncio.run(body())


def test_mps_shares_of_two_gpus_in_one_claim_are_refused_with_the_reason(node: SandboxNode) -> None:
    """A container talks to one MPS control daemon (one ``CUDA_MPS_PIPE_DIRECTORY``, one pipe mount at
    ``/tmp/nvidia-mps``): a claim whose request got shares of two GPUs would get two daemons and two pipe mounts at
    the same container path. It is refused before anything starts; one share per claim works as before."""
    async def body() -> None:
        assert node.api is not None
        async with running(node.shares_config()) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            node.api.create(share_claim("two-gpus"))
            stored = node.api.get("ResourceClaim", "two-gpus", "default")
            assert stored is not None
            stored["status"] = {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": node.node_name, "device": device,
                 "shareID": share, "consumedCapacity": {"memory": "10Gi"}}
                for device, share in (("gpu-0", "5b3c1d2e-0000-4000-8000-000000000001"),
                                      ("gpu-1", "5b3c1d2e-0000-4000-8000-000000000002"))]}}}
            ref = ref_of(node.api.update(stored, subresource="status"))
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert f"claim default/two-gpus (uid {ref.uid})" in error
            assert ('status.allocation.devices.results[0] (request "gpu", device "gpu-0") and results[1] (request '
                    '"gpu", device "gpu-1"): MPS shares of 2 devices in one claim') in error, error
            assert "a container talks to one MPS control daemon" in error
            assert daemons(node) == [] and len(plugin.state) == 0 and node.cdi_specs() == []
            [one] = allocate(node, share_claim("one-gpu"))
            single = ref_of(one)
            assert (await kubelet.prepare([single]))[single.uid].error == ""
            assert len(daemons(node)) == 1
            assert await kubelet.unprepare([single]) == {single.uid: ""}

    asyncio.run(body())
