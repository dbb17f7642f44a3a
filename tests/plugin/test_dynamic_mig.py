"""Dynamic MIG end to end (``DynamicMIG`` gate): the real plugin over gRPC, the mock NVML with its MIG state file,
the API emulator over HTTP. Instances are created at prepare at exactly the allocated placement and destroyed at
unprepare; every partial state converges."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pynvml
import pytest

from dradriver.domain import featuregates as fg
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.migplacements import MigPlacement
from dradriver.host.claimstate import ClaimPhase
from dradriver.nvml import mock
from dradriver.sandbox.node import SandboxNode
from tests import factories
from tests.cdi import helpers as cdi_checks
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for

GATES = fg.parse_feature_gates("DynamicMIG=true")
ONE_G = "gpu-{m}-mig-1g10gb-19-{s}"  # H100 1g.10gb, GI profile ID 19 (gpu-facts.md 2.6)
THREE_G = "gpu-{m}-mig-3g40gb-9-{s}"


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(mock.library_path()), mode=ctypes.RTLD_GLOBAL)
    lib.mocknvml_control.argtypes = [ctypes.c_char_p]
    return lib


def control(command: str) -> None:
    assert _lib().mocknvml_control(command.encode()) == 0, command


def state_lines(node: SandboxNode, kind: str) -> list[list[str]]:
    return [line.split() for line in node.mig_state_path.read_text().splitlines() if line.startswith(kind + " ")]


def mig_mode(node: SandboxNode, gpu: int) -> tuple[int, int]:
    for parts in state_lines(node, "gpu"):
        if int(parts[1]) == gpu:
            return int(parts[2]), int(parts[3])
    raise AssertionError(f"GPU {gpu} not in the state file")


def claim_for(node: SandboxNode, name: str, device: str) -> Any:
    assert node.api is not None
    claim = node.api.create(claim_object(name))
    return ref_of(set_allocation(node, claim, [result(device)]))


def test_prepare_creates_the_allocated_placement_and_unprepare_destroys_it(mig_node: SandboxNode) -> None:
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            device = ONE_G.format(m=0, s=3)
            entry = plugin.registry.get(device) if plugin.registry else None
            assert isinstance(entry, MigPlacement) and entry.placement_start == 3
            assert plugin.registry is not None and plugin.registry.get("gpu-0") is not None  # Hopper: full GPU too
            ref = claim_for(mig_node, "one-g", device)
            answer = await kubelet.prepare([ref])
            assert answer[ref.uid].error == ""
            assert mig_mode(mig_node, 0) == (1, 1)
            [gi] = state_lines(mig_node, "gi")
            assert gi[1:] == ["0", "7", "19", "3", "1"]  # GPU 0, GI 7, profile 19, placement 3:1
            [ci] = state_lines(mig_node, "ci")
            mig_uuid = ci[8]
            # the undo record (concrete identity) is in the claim state
            record = plugin.state.get(ref.uid)
            assert record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED
            [undo] = [u for u in json.loads(record.payload)["undo"] if u["kind"] == "dynamic-mig"]
            assert undo["target"] == device
            assert undo["data"]["giId"] == 7 and undo["data"]["ciId"] == 0 and undo["data"]["migUUID"] == mig_uuid
            # CDI spec: parent node + GI and CI capability nodes, minors from the capability files
            spec = cdi_checks.validate(GPU_DRIVER.cdi.spec_path(mig_node.cdi_root, ref.uid).read_bytes())
            [cdi_dev] = spec["devices"]
            nodes = {n["path"]: n for n in cdi_dev["containerEdits"]["deviceNodes"]}
            caps = mig_node.root / "proc" / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig" / "gi7"
            gi_minor = int((caps / "access").read_text().split()[1])
            ci_minor = int((caps / "ci0" / "access").read_text().split()[1])
            assert (gi_minor, ci_minor) == (3 + 9 * 7, 4 + 9 * 7)
            assert set(nodes) == {"/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
                                  f"/dev/nvidia-caps/nvidia-cap{ci_minor}"}
            assert nodes[f"/dev/nvidia-caps/nvidia-cap{gi_minor}"]["major"] == 511
            # the device registry learned about the instance (health and publisher are its subscribers)
            await wait_for(lambda: [m.uuid for m in plugin.inventory.migs] == [mig_uuid])
            assert plugin.registry.get(device) is entry or isinstance(plugin.registry.get(device), MigPlacement)
            # KEP-4817: the identity is published in the claim's status.devices[].data
            def published() -> list[Any]:
                assert mig_node.api is not None
                stored = mig_node.api.get("ResourceClaim", "one-g", "default")
                return list((stored or {}).get("status", {}).get("devices") or [])

            await wait_for(lambda: bool(published()))
            [status] = published()
            assert (status["driver"], status["pool"], status["device"]) == ("gpu.nvidia.com", "gpu-node-1", device)
            assert status["data"] == {"uuid": mig_uuid, "parentUUID": entry.parent.uuid, "gpuInstanceId": 7,
                                      "computeInstanceId": 0, "profile": "1g.10gb",
                                      "placement": {"start": 3, "size": 1}}
            assert status["conditions"][0]["type"] == "Ready"
            stored = mig_node.api.get("ResourceClaim", "one-g", "default") if mig_node.api else None
            kubernetes_validate.validate(stored, "1.34", strict=True)
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            await wait_for(lambda: not published())
            assert state_lines(mig_node, "gi") == [] and state_lines(mig_node, "ci") == []
            assert mig_mode(mig_node, 0) == (0, 0)  # Hopper: MIG mode off with the last instance
            assert not caps.exists()
            await wait_for(lambda: plugin.inventory.migs == ())

    asyncio.run(body())


def test_two_placements_share_a_gpu_and_mig_mode_stays_until_the_last(mig_node: SandboxNode) -> None:
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (_plugin, kubelet):
            a = claim_for(mig_node, "a", ONE_G.format(m=1, s=0))
            b = claim_for(mig_node, "b", THREE_G.format(m=1, s=4))
            answer = await kubelet.prepare([a, b])
            assert answer[a.uid].error == "" and answer[b.uid].error == ""
            assert sorted((g[3], g[4]) for g in state_lines(mig_node, "gi")) == [("19", "0"), ("9", "4")]
            assert await kubelet.unprepare([a]) == {a.uid: ""}
            assert mig_mode(mig_node, 1) == (1, 1)
            assert await kubelet.unprepare([b]) == {b.uid: ""}
            assert mig_mode(mig_node, 1) == (0, 0)

    asyncio.run(body())


def test_compute_instance_failure_leaves_nothing(mig_node: SandboxNode) -> None:
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            control("fail * nvmlGpuInstanceCreateComputeInstance 23 1")
            ref = claim_for(mig_node, "ci-fails", ONE_G.format(m=2, s=1))
            answer = await kubelet.prepare([ref])
            assert "claim default/ci-fails" in answer[ref.uid].error
            assert "create compute instance in GI 7" in answer[ref.uid].error
            assert state_lines(mig_node, "gi") == [] and mig_mode(mig_node, 2) == (0, 0)
            assert plugin.state.get(ref.uid) is None
            answer = await kubelet.prepare([ref])  # the kubelet's retry succeeds
            assert answer[ref.uid].error == ""
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


def test_gi_created_ci_failed_and_gi_undestroyable_is_kept_and_converges(mig_node: SandboxNode) -> None:
    """NVIDIA #1452: a GI without CI must stay findable. The record of the bare GI is kept with the claim."""
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            control("fail * nvmlGpuInstanceCreateComputeInstance 23 1")
            control("fail * nvmlGpuInstanceDestroy 999 2")  # take-back and the runner's undo both fail
            ref = claim_for(mig_node, "bare-gi", ONE_G.format(m=3, s=5))
            answer = await kubelet.prepare([ref])
            assert "destroying that GPU instance failed too" in answer[ref.uid].error
            record = plugin.state.get(ref.uid)
            assert record is not None and record.phase is ClaimPhase.PREPARE_STARTED
            [undo] = [u for u in json.loads(record.payload)["undo"] if u["kind"] == "dynamic-mig"]
            assert undo["data"]["ciId"] is None and undo["data"]["placementStart"] == 5
            assert len(state_lines(mig_node, "gi")) == 1 and state_lines(mig_node, "ci") == []
            answer = await kubelet.prepare([ref])  # retry: stale record undone (GI destroyed), then created anew
            assert answer[ref.uid].error == ""
            assert len(state_lines(mig_node, "gi")) == 1 and len(state_lines(mig_node, "ci")) == 1
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert state_lines(mig_node, "gi") == []

    asyncio.run(body())


def test_unprepare_of_a_device_in_use_fails_until_its_processes_exit(mig_node: SandboxNode) -> None:
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            ref = claim_for(mig_node, "busy", ONE_G.format(m=4, s=0))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [gi] = state_lines(mig_node, "gi")
            control(f"procs 4 {gi[2]} 0 1")
            errors = await kubelet.unprepare([ref])
            assert "in use by 1 process(es)" in errors[ref.uid] and "retries the unprepare" in errors[ref.uid]
            assert plugin.state.get(ref.uid) is not None and len(state_lines(mig_node, "gi")) == 1
            control(f"procs 4 {gi[2]} 0 0")
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert state_lines(mig_node, "gi") == []

    asyncio.run(body())


def test_mig_mode_change_that_needs_a_reset_is_a_clear_claim_error(mig_node: SandboxNode) -> None:
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            control("procs 5 1")  # a process on the full GPU: MIG mode can only become pending
            ref = claim_for(mig_node, "pending", ONE_G.format(m=5, s=0))
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert error.startswith(f"claim default/pending (uid {ref.uid}): device {ONE_G.format(m=5, s=0)!r}: ")
            assert "cannot enable MIG mode now" in error and "needs the GPU idle or reset" in error
            assert plugin.state.get(ref.uid) is None and state_lines(mig_node, "gi") == []
            assert mig_mode(mig_node, 5) == (0, 0)  # the pending change was withdrawn

    asyncio.run(body())


def _create_out_of_band(gpu: int, profile_id: int, start: int, size: int, ci: bool = True) -> None:
    """What another NVML client (nvidia-smi mig -cgi, mig-parted) does, through the same mock."""
    pynvml.nvmlInit()
    try:
        dev = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        pynvml.nvmlDeviceSetMigMode(dev, 1)
        where = pynvml.c_nvmlGpuInstancePlacement_t()
        where.start, where.size = start, size
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile_id, ctypes.byref(where))
        if ci:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0 if size == 1 else 2, 0)
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    finally:
        pynvml.nvmlShutdown()


def test_out_of_band_instances_on_the_allocated_placement(mig_node: SandboxNode) -> None:
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (_plugin, kubelet):
            # an idle bare GI of the allocated profile exactly there: reused
            _create_out_of_band(6, 19, 2, 1, ci=False)
            ref = claim_for(mig_node, "reuse", ONE_G.format(m=6, s=2))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert len(state_lines(mig_node, "gi")) == 1 and len(state_lines(mig_node, "ci")) == 1
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            # an idle 3g overlapping a 1g placement: destroyed, then ours created
            _create_out_of_band(6, 9, 4, 4)
            ref2 = claim_for(mig_node, "overlap", ONE_G.format(m=6, s=5))
            assert (await kubelet.prepare([ref2]))[ref2.uid].error == ""
            assert [(g[3], g[4]) for g in state_lines(mig_node, "gi")] == [("19", "5")]
            assert await kubelet.unprepare([ref2]) == {ref2.uid: ""}
            # one in use: the claim fails with the reason, the instance is left alone
            _create_out_of_band(6, 9, 0, 4)
            [gi] = state_lines(mig_node, "gi")
            control(f"procs 6 {gi[2]} 0 1")
            ref3 = claim_for(mig_node, "busy", ONE_G.format(m=6, s=1))
            error = (await kubelet.prepare([ref3]))[ref3.uid].error
            assert "created outside this driver and in use by 1 process(es)" in error
            assert len(state_lines(mig_node, "gi")) == 1

    asyncio.run(body())


def test_start_up_destroys_unowned_instances_but_not_on_a_busy_gpu(mig_node: SandboxNode) -> None:
    async def body() -> None:
        # before the plugin starts: strays on GPU 0 (idle) and GPU 1 (a process runs there)
        _create_out_of_band(0, 19, 0, 1)
        _create_out_of_band(1, 19, 6, 1)
        pynvml.nvmlInit()
        try:
            control("procs 1 7 0 1")
        finally:
            pynvml.nvmlShutdown()
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, _kubelet):
            assert [g[1] for g in state_lines(mig_node, "gi")] == ["1"]
            assert mig_mode(mig_node, 0) == (0, 0)
            assert any(s.startswith("dynamic-mig:") for s in plugin.recovery.swept)

    asyncio.run(body())


def test_gate_off_leaves_out_of_band_instances_alone(mig_node: SandboxNode) -> None:
    async def body() -> None:
        _create_out_of_band(2, 19, 0, 1)
        async with running(mig_node.config()) as (plugin, _kubelet):
            assert len(state_lines(mig_node, "gi")) == 1
            assert plugin.registry is not None
            assert not any(isinstance(d, MigPlacement) for d in plugin.registry.devices.values())

    asyncio.run(body())


def test_capability_paths_are_the_sandbox_proc_root(mig_node: SandboxNode) -> None:
    assert os.environ[mock.PROC_ROOT_ENV] == str(mig_node.root / "proc")
    assert Path(os.environ[mock.STATE_ENV]) == mig_node.mig_state_path


ROOT = Path(__file__).resolve().parents[2]


def _child_env(node: SandboxNode, control_file: Path) -> dict[str, str]:
    config = node.config()
    env = dict(os.environ)  # carries the sandbox's mock MIG state file and proc root
    env.update(
        NODE_NAME=config.node_name, KUBECONFIG=config.kubeconfig, CDI_ROOT=str(config.cdi_root),
        KUBELET_REGISTRAR_DIRECTORY_PATH=str(config.kubelet_registrar_directory_path),
        KUBELET_PLUGINS_DIRECTORY_PATH=str(config.kubelet_plugins_directory_path),
        KUBELET_DEVICE_PLUGINS_DIRECTORY_PATH=str(config.kubelet_device_plugins_directory_path),
        DEV_ROOT=str(config.dev_root), SYSFS_ROOT=str(config.sysfs_root), PROC_ROOT=str(config.proc_root),
        DRADRIVER_MOCK_PROFILE=config.mock_profile, FEATURE_GATES="DynamicMIG=true", LOG_LEVEL="warning",
        **{mock.CONTROL_ENV: str(control_file)},
    )
    return env


KILL_POINTS = [
    pytest.param("fail * nvmlDeviceSetMigMode killafter", 0, 0, id="after-mig-mode-on", marks=pytest.mark.slow),
    pytest.param("fail * nvmlDeviceCreateGpuInstanceWithPlacement kill", 0, 0, id="before-gi",
                 marks=pytest.mark.slow),
    pytest.param("fail * nvmlDeviceCreateGpuInstanceWithPlacement killafter", 1, 0, id="after-gi"),
    pytest.param("fail * nvmlGpuInstanceCreateComputeInstance killafter", 1, 1, id="after-ci"),
    pytest.param("fail * nvmlComputeInstanceGetInfo_v2 kill", 1, 1, id="before-ci-info", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("fault", "gis", "cis"), KILL_POINTS)
def test_sigkill_between_nvml_calls_converges_at_restart(mig_node: SandboxNode, fault: str, gis: int,
                                                         cis: int) -> None:
    """The plugin process is SIGKILLed inside prepare, between two NVML calls (the mock raises SIGKILL at that
    call); the next start rolls the claim back, destroys the instance no record owns (found by placement), turns
    MIG mode off, and the kubelet's retry then prepares the claim."""
    from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError

    # The child's own control file: the node's (nvml-control) is replayed by this test process too, and the
    # fault would kill it.
    control_file = mig_node.root / "child-nvml-control"
    control_file.write_text(fault + "\n")
    device = ONE_G.format(m=7, s=4)

    async def body() -> None:
        ref = claim_for(mig_node, "killed", device)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "gpu-kubelet-plugin", env=_child_env(mig_node, control_file),
            cwd=str(ROOT), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with KubeletEmulator(mig_node.config().kubelet_registrar_directory_path) as kubelet:
                child = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=30)
                with pytest.raises(KubeletError):
                    await child.prepare([ref])
            assert await proc.wait() == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert len(state_lines(mig_node, "gi")) == gis and len(state_lines(mig_node, "ci")) == cis
        assert mig_mode(mig_node, 7) == (1, 1)
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            assert state_lines(mig_node, "gi") == [] and mig_mode(mig_node, 7) == (0, 0)
            assert plugin.state.get(ref.uid) is None
            assert (ref.uid in plugin.recovery.rolled_back) and (bool(gis) == bool(plugin.recovery.swept))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert len(state_lines(mig_node, "ci")) == 1
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


def test_mig_scoped_xid_marks_the_placement_of_its_instance_only(mig_node: SandboxNode) -> None:
    """Health with dynamic MIG: events are registered on the parent GPU; an Xid carrying the GI/CI ids of the
    created instance makes exactly the placement device it was created for unhealthy."""
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            device = ONE_G.format(m=3, s=2)
            ref = claim_for(mig_node, "watched", device)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [gi] = state_lines(mig_node, "gi")
            await wait_for(lambda: len(plugin.inventory.migs) == 1)  # the registry told the health monitor
            assert plugin.health is not None
            names = {d.device_name for d in plugin.health.snapshot()}
            assert device in names and ONE_G.format(m=3, s=1) in names and "gpu-3" in names
            gpu3 = next(g for g in plugin.inventory.gpus if g.minor == 3)
            control(f"event {gpu3.index} 8 31 {gi[2]} 0")  # Xid 31 (MMU fault), scoped to GI/CI of the instance
            control(f"event {gpu3.index} 8 63 {gi[2]} 0")  # Xid 63 (row remap), same scope

            def unhealthy() -> set[str]:
                assert plugin.health is not None
                return {d.device_name for d in plugin.health.snapshot() if d.health == "Unhealthy"}

            await wait_for(lambda: bool(unhealthy()))
            assert unhealthy() == {device}
            mig_uuid = state_lines(mig_node, "ci")[0][8]
            assert plugin.health.xid_stats()[mig_uuid].last in (31, 63)

    asyncio.run(body())


def test_restart_keeps_prepared_instances_and_unprepares_them_later(mig_node: SandboxNode) -> None:
    async def body() -> None:
        device = ONE_G.format(m=2, s=6)
        async with running(mig_node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(mig_node, "kept", device)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            other = claim_for(mig_node, "overlap", THREE_G.format(m=2, s=4))  # overlaps the prepared 1g
            error = (await kubelet.prepare([other]))[other.uid].error
            assert f"prepared for device {device!r} of another claim" in error
        assert len(state_lines(mig_node, "gi")) == 1  # a clean stop destroys nothing
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            assert len(state_lines(mig_node, "gi")) == 1 and not plugin.recovery.swept  # owned: not swept
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""  # answered from the claim state
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert state_lines(mig_node, "gi") == [] and mig_mode(mig_node, 2) == (0, 0)

    asyncio.run(body())


def test_ampere_in_mig_mode_offers_placements_only_and_stays_in_mig_mode() -> None:
    with SandboxNode(profile="dgx-a100", mig_state=True) as node:
        assert node.api is not None
        node.api.create(factories.DEVICE_CLASS)

        async def body() -> None:
            async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
                assert plugin.registry is not None
                devices = plugin.registry.devices
                assert "gpu-0" not in devices and "gpu-2" in devices  # GPU 0 in MIG mode: placements only
                assert isinstance(devices.get("gpu-0-mig-1g5gb-19-0"), MigPlacement)
                assert not any(isinstance(d, MigPlacement) and d.parent.minor == 2 for d in devices.values())
                # the profile's instances on GPUs 0 and 1 belong to no claim: destroyed at start, MIG mode kept
                assert state_lines(node, "gi") == [] and mig_mode(node, 0) == (1, 1)
                ref = claim_for(node, "ampere", "gpu-0-mig-3g20gb-9-4")
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}
                assert state_lines(node, "gi") == [] and mig_mode(node, 0) == (1, 1)  # Ampere stays in MIG mode

        asyncio.run(body())


def test_unprepare_on_a_lost_gpu_succeeds(mig_node: SandboxNode) -> None:
    """A GPU that fell off the bus took its instances with it: the unprepare must not fail forever."""
    async def body() -> None:
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            ref = claim_for(mig_node, "lost", ONE_G.format(m=1, s=1))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            gpu1 = next(g for g in plugin.inventory.gpus if g.minor == 1)
            control(f"lost {gpu1.index} 1")
            try:
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}
                assert plugin.state.get(ref.uid) is None
            finally:
                control(f"lost {gpu1.index} 0")

    asyncio.run(body())
