"""MPS end to end: the kubelet plugin (real gRPC), the API emulator (real HTTP), the sandbox's Deployment
controller and container runner, the nvidia-cuda-mps-control stand-in, tmpfs mounts and NVML compute mode."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from dradriver.app import start_plugin
from dradriver.app.gpu import GpuPlugin
from dradriver.domain import mps
from dradriver.domain.claims import ClaimRef
from dradriver.domain.devices import MigDevice
from dradriver.nvml import discovery, settings
from dradriver.nvml.session import NvmlSession
from dradriver.sandbox import scheduler
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode
from dradriver.sandbox.standins.nvidia_cuda_mps_control import STATE_FILE
from tests.cdi import helpers as cdi_checks
from tests.factories import DEVICE_CLASS
from tests.plugin.conftest import claim_object, ref_of, running, wait_for

ROOT = Path(__file__).resolve().parents[2]
CONFIG_AT = "status.allocation.devices.config[0].opaque.parameters"


def mps_claim(sandbox: SandboxNode, name: str, mps_config: dict[str, Any] | None = None,
              count: int = 1) -> tuple[ClaimRef, dict[str, Any]]:
    """Create a claim of ``count`` GPUs with ``sharing: {strategy: MPS, mpsConfig}`` and allocate it here."""
    assert sandbox.api is not None
    obj = claim_object(name, count=count)
    sharing: dict[str, Any] = {"strategy": "MPS"}
    if mps_config is not None:
        sharing["mpsConfig"] = mps_config
    obj["spec"]["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing}}}]
    sandbox.api.create(obj)
    [claim] = scheduler.allocate(sandbox.api, [("default", name)], node_name=sandbox.node_name)
    return ref_of(claim), claim


def _uuids(plugin: GpuPlugin, claim: dict[str, Any]) -> list[str]:
    names = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    return sorted(g.uuid for g in plugin.inventory.gpus if g.name in names)


def _modes(plugin: GpuPlugin, uuids: list[str]) -> set[str]:
    assert plugin.session is not None
    return {settings.compute_mode(plugin.session, u).name for u in uuids}


def _left(sandbox: SandboxNode, daemon_id: str) -> dict[str, Any]:
    """What of a daemon is left on the node and in the API."""
    assert sandbox.api is not None
    directory = sandbox.mps_config().mps_root / daemon_id
    return {
        "deployments": [d["metadata"]["name"] for d in sandbox.api.objects("Deployment")],
        "pods": [p["metadata"]["name"] for p in sandbox.api.objects("Pod")],
        "directory": directory.exists(),
        "mounted": sandbox.mounts.is_mounted(directory / mps.SHM_DIR),
    }


NOTHING = {"deployments": [], "pods": [], "directory": False, "mounted": False}


@pytest.fixture(params=["system mount", "mount stand-ins"])
def mps_node(request: pytest.FixtureRequest) -> Iterator[SandboxNode]:
    """A sandbox node whose plugin mounts tmpfs with the system's mount(8) where permitted, or the stand-ins."""
    with SandboxNode(profile="dgx-h100", mount_standins=request.param == "mount stand-ins") as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        yield node


def test_mps_claim_is_prepared_through_a_ready_control_daemon_and_unprepared(mps_node: SandboxNode) -> None:
    sandbox = mps_node
    sandbox.run_workloads()

    async def body() -> None:
        async with running(sandbox.mps_config()) as (plugin, kubelet):
            ref, claim = mps_claim(sandbox, "mps", {"defaultActiveThreadPercentage": 30,
                                                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                                                    "defaultPerDevicePinnedMemoryLimit": {"1": "5Gi"},
                                                    "multiUser": True}, count=2)
            uuids = _uuids(plugin, claim)
            answer = (await kubelet.prepare([ref]))[ref.uid]
            assert answer.error == ""
            daemon_id = mps.control_daemon_id(ref.uid, uuids)
            assert sandbox.api is not None
            deployment = sandbox.api.get("Deployment", f"mps-control-daemon-{daemon_id}", SANDBOX_NAMESPACE)
            assert deployment is not None and deployment["status"]["readyReplicas"] == 1
            kubernetes_validate.validate({k: v for k, v in deployment.items() if k != "status"}, "1.34", strict=True)
            [pod] = sandbox.api.objects("Pod", SANDBOX_NAMESPACE)
            assert pod["spec"]["nodeName"] == sandbox.node_name and pod["status"]["containerStatuses"][0]["ready"]
            # the daemon really runs, with the claim's devices and limits
            directory = plugin.config.mps_root / daemon_id
            state = json.loads((directory / mps.PIPE_DIR / STATE_FILE).read_text())
            assert state["visibleDevices"] == uuids and state["multiUser"] is True  # -M: H100s are cc 9.0
            assert state["defaultActiveThreadPercentage"] == 30.0
            assert state["defaultPinnedMemLimits"] == {uuids[0]: "10240M", uuids[1]: "5120M"}
            assert (directory / mps.LOG_DIR / mps.STARTUP_LOG).read_text().strip() == mps.STARTUP_MARKER
            assert sandbox.mounts.is_mounted(directory / mps.SHM_DIR)
            assert _modes(plugin, uuids) == {"EXCLUSIVE_PROCESS"}
            assert plugin.mps_daemons is not None and plugin.mps_daemons.wait_s[daemon_id] > 0
            # the workload's CDI edits
            spec = cdi_checks.validate(sandbox.cdi_specs()[0].read_bytes())
            for device in spec["devices"]:
                edits = device["containerEdits"]
                assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
                assert {(m["hostPath"], m["containerPath"]) for m in edits["mounts"]} >= {
                    (f"{directory}/shm", "/dev/shm"), (f"{directory}/pipe", "/tmp/nvidia-mps")}
            # prepared twice: the stored answer, no second daemon
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert len(sandbox.api.objects("Deployment")) == 1

            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert _left(sandbox, daemon_id) == NOTHING
            assert _modes(plugin, uuids) == {"DEFAULT"}
            assert sandbox.cdi_specs() == []

    asyncio.run(body())


def test_a_daemon_that_never_gets_ready_fails_the_claim_and_leaves_nothing(sandbox: SandboxNode) -> None:
    sandbox.run_workloads()
    tool = sandbox.driver_root / "usr" / "bin" / "nvidia-cuda-mps-control"
    tool.write_text("#!/bin/sh\necho 'nvidia-cuda-mps-control: cannot open /dev/nvidiactl' >&2\nexit 1\n")

    async def body() -> None:
        async with running(sandbox.mps_config(prepare_deadline_seconds=2)) as (plugin, kubelet):
            ref, claim = mps_claim(sandbox, "broken")
            uuids = _uuids(plugin, claim)
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert f"{ref.namespace}/{ref.name}" in error and f"{CONFIG_AT}.sharing" in error
            assert "not ready within" in error and "mps-control-daemon-" in error
            await wait_for(lambda: _left(sandbox, mps.control_daemon_id(ref.uid, uuids)) == NOTHING)
            assert _modes(plugin, uuids) == {"DEFAULT"}
            assert sandbox.cdi_specs() == [] and plugin.state.get(ref.uid) is None

    asyncio.run(body())


def test_daemons_no_stored_claim_knows_are_swept_at_start(sandbox: SandboxNode) -> None:
    """A crash between starting a daemon and storing its undo record leaves a daemon only its directory names."""
    sandbox.run_workloads()

    async def body() -> None:
        config = sandbox.mps_config()
        plugin = await start_plugin(config)
        try:
            assert plugin.mps_daemons is not None
            gpu = plugin.inventory.gpus[0].uuid
            leftover = mps.ControlDaemon(mps.control_daemon_id("lost-claim", [gpu]), "lost-claim", (gpu,), (gpu,))
            await asyncio.to_thread(plugin.mps_daemons.start, leftover)
            assert _left(sandbox, leftover.daemon_id)["directory"]
        finally:
            await plugin.stop()
        plugin = await start_plugin(config)
        try:
            assert f"mps:{leftover.daemon_id}" in plugin.recovery.swept
            await wait_for(lambda: _left(sandbox, leftover.daemon_id) == NOTHING)
            assert _modes(plugin, [gpu]) == {"DEFAULT"}
        finally:
            await plugin.stop()

    asyncio.run(body())


def _plugin_env(sandbox: SandboxNode) -> dict[str, str]:
    from dradriver.sandbox.cluster import plugin_environment

    config = sandbox.mps_config()
    env = dict(os.environ)
    env.update(plugin_environment(config))
    env["FEATURE_GATES"] = config.feature_gates.render()
    env.update(LOG_LEVEL="warning", PYTHONPATH=str(ROOT))
    return env


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the plugin process mounts tmpfs for real (its mount helper is not a "
                                               "flag); the in-process tests cover the stand-in path")
def test_sigkill_while_waiting_for_the_daemon_is_undone_at_the_next_start(
        sandbox: SandboxNode, mock_session: Callable[[str], NvmlSession]) -> None:
    """SIGKILL the plugin process while it waits for the daemon's Deployment: the claim is left half-prepared
    (recorded PREPARE_STARTED, daemon started, no undo record yet); the next start converges."""
    if not sandbox.real_mounts:
        pytest.skip("a tmpfs mount is not permitted here")
    sandbox.run_workloads(time_scale=1.0)  # the real 1 s probe period: a window to kill in

    async def body() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "gpu-kubelet-plugin", env=_plugin_env(sandbox), cwd=str(ROOT),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                connection: PluginConnection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=30)
                await wait_for(lambda: bool(sandbox.api and sandbox.api.objects("ResourceSlice")), timeout=30)
                ref, claim = mps_claim(sandbox, "killed")
                call = asyncio.create_task(connection.prepare([ref]))
                assert sandbox.api is not None
                await wait_for(lambda: bool(sandbox.api and sandbox.api.objects("Deployment")), timeout=30)
                proc.send_signal(signal.SIGKILL)
                # NVML settings are node state (the mock shares them between processes): the killed plugin's
                # EXCLUSIVE_PROCESS is still set
                [device] = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
                session = mock_session(sandbox.profile)
                uuid = next(g.uuid for g in discovery.discover(session).gpus if g.name == device)
                assert settings.compute_mode(session, uuid) is settings.ComputeMode.EXCLUSIVE_PROCESS
                await proc.wait()
                with pytest.raises(Exception):  # noqa: B017 - the call dies with the plugin, however it ends
                    await call
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        plugin = await start_plugin(sandbox.mps_config())
        try:
            assert ref.uid in plugin.recovery.rolled_back
            assert any(s.startswith(f"mps:{ref.uid}-") for s in plugin.recovery.swept)
            await wait_for(lambda: not sandbox.api.objects("Pod") if sandbox.api else False, timeout=30)
            assert not (plugin.config.mps_root).exists() or not any(plugin.config.mps_root.iterdir())
            assert not sandbox.api.objects("Deployment")
            assert _modes(plugin, [uuid]) == {"DEFAULT"}
        finally:
            await plugin.stop()

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_mps_on_mig_devices_serves_their_uuids_and_leaves_compute_mode_alone(sandbox: SandboxNode) -> None:
    """A MigDeviceConfig with MPS: one daemon for the claim's MIG devices; their parent GPU's compute mode is not
    touched (only full GPUs of the group get EXCLUSIVE_PROCESS)."""
    from tests.configs.helpers import entry, params
    from tests.configs.test_plugin import allocate
    from tests.plugin.conftest import result

    sandbox.run_workloads()

    async def body() -> None:
        async with running(sandbox.mps_config()) as (plugin, kubelet):
            migs = [d for d in plugin.inventory.allocatable() if d.name.startswith("gpu-0-mig-")][:2]
            claim = allocate(sandbox, "mig-mps", [result(m.name) for m in migs], [
                entry(params("MigDeviceConfig", sharing={"strategy": "MPS",
                                                         "mpsConfig": {"defaultActiveThreadPercentage": 20}}))])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            uuids = sorted(m.uuid for m in migs)
            daemon_id = mps.control_daemon_id(ref.uid, uuids)
            state = json.loads((plugin.config.mps_root / daemon_id / mps.PIPE_DIR / STATE_FILE).read_text())
            assert state["visibleDevices"] == uuids and state["defaultActiveThreadPercentage"] == 20.0
            assert isinstance(migs[0], MigDevice)
            parent = migs[0].parent.uuid
            assert _modes(plugin, [parent]) == {"DEFAULT"}
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert _left(sandbox, daemon_id) == NOTHING

    asyncio.run(body())


def test_a_half_prepared_claim_whose_daemon_could_not_be_stopped_is_undone_from_its_record(
        sandbox: SandboxNode) -> None:
    """The CDI spec cannot be written after the daemon started, and stopping the daemon then fails too (the API
    refuses the DELETE): the claim stays PREPARE_STARTED with the daemon's undo record, and the next start undoes
    it from that record."""
    from dradriver.domain.identity import GPU_DRIVER
    from dradriver.host.claimstate import ClaimPhase
    from dradriver.kubeletplugin.payload import read_payload

    sandbox.run_workloads()
    config = sandbox.mps_config()

    async def body() -> None:
        assert sandbox.api is not None
        async with running(config) as (plugin, kubelet):
            ref, claim = mps_claim(sandbox, "stuck")
            uuids = _uuids(plugin, claim)
            blocker = GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid)
            blocker.mkdir()  # the spec's rename target is a directory: the write fails
            sandbox.api.fail_next(20, status=500, method="DELETE", path=re.compile("/deployments/"))
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert ref.uid in error and "cannot write CDI spec" in error
            record = plugin.state.get(ref.uid)
            assert record is not None and record.phase is ClaimPhase.PREPARE_STARTED
            assert "mps" in [r.kind for r in read_payload(record.payload).undo]
            assert _modes(plugin, uuids) == {"EXCLUSIVE_PROCESS"}
            sandbox.api.clear_faults()
            blocker.rmdir()
        plugin = await start_plugin(config)
        try:
            assert ref.uid in plugin.recovery.rolled_back
            await wait_for(lambda: _left(sandbox, mps.control_daemon_id(ref.uid, uuids)) == NOTHING)
            assert _modes(plugin, uuids) == {"DEFAULT"} and plugin.state.get(ref.uid) is None
        finally:
            await plugin.stop()

    asyncio.run(body())


def test_the_mps_example_is_prepared_with_its_limits(sandbox: SandboxNode) -> None:
    """``deploy/examples/mps-claim.yaml`` as a user applies it: template -> claim -> allocation -> ready daemon."""
    import yaml

    from dradriver.sandbox.cluster import create_claim_from_template

    sandbox.run_workloads()
    template, pod = [d for d in yaml.safe_load_all((ROOT / "deploy" / "examples" / "mps-claim.yaml").read_text())
                     if d]

    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.mps_config()) as (plugin, kubelet):
            sandbox.api.create(template)
            pod_obj = sandbox.api.create(pod)
            claim = create_claim_from_template(sandbox.api, pod_obj, pod_obj["spec"]["resourceClaims"][0])
            [claim] = scheduler.allocate(sandbox.api, [("default", claim["metadata"]["name"])],
                                         node_name=sandbox.node_name)
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [uuid] = _uuids(plugin, claim)
            state = json.loads((plugin.config.mps_root / mps.control_daemon_id(ref.uid, [uuid]) / mps.PIPE_DIR /
                                STATE_FILE).read_text())
            assert state["defaultActiveThreadPercentage"] == 50.0
            assert state["defaultPinnedMemLimits"] == {uuid: "20480M"}
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""

    asyncio.run(body())


def test_unprepare_retries_a_refused_delete_and_takes_a_vanished_deployment_as_deleted(sandbox: SandboxNode) -> None:
    sandbox.run_workloads()

    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.mps_config()) as (plugin, kubelet):
            refs = []
            for name in ("refused", "vanished"):
                ref, _ = mps_claim(sandbox, name)
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                refs.append(ref)
            refused, vanished = refs
            # the API refuses the DELETE (after the client's retries): the claim stays prepared, the kubelet retries
            sandbox.api.fail_next(5, status=503, method="DELETE", path=re.compile("/deployments/mps-control-daemon-"
                                                                                    + refused.uid))
            error = (await kubelet.unprepare([refused]))[refused.uid]
            assert "MPS control daemon" in error and "DELETE deployments" in error
            assert plugin.state.get(refused.uid) is not None
            assert (await kubelet.unprepare([refused]))[refused.uid] == ""
            # someone deleted the other claim's Deployment: NotFound is a finished delete
            [deployment] = sandbox.api.objects("Deployment")
            sandbox.api.delete("Deployment", deployment["metadata"]["name"], SANDBOX_NAMESPACE)
            assert (await kubelet.unprepare([vanished]))[vanished.uid] == ""
            await wait_for(lambda: not sandbox.api.objects("Pod") if sandbox.api else False)
            assert not any(plugin.config.mps_root.iterdir())
            assert len(plugin.state) == 0

    asyncio.run(body())
