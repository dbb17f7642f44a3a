"""Time-slicing end to end: NodePrepareResources over real gRPC with a GpuConfig carrying ``TimeSlicing``, the
settings read back through NVML (the plugin's own mock NVML session), the driver root's ``nvidia-smi`` run with
NVIDIA's ``LD_PRELOAD`` rule (``nvidia-dra-driver-updates.md`` 2a; ``nvidia-dra-driver.md`` 3.1, 4.2, 4.3)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dradriver.app import GpuPlugin
from dradriver.domain.featuregates import FeatureGates
from dradriver.domain.identity import GPU_DRIVER
from dradriver.kubeletplugin.payload import read_payload
from dradriver.nvml import settings
from dradriver.nvml.session import NvmlSession
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.profiles import h200_node
from tests.configs.helpers import entry, params
from tests.configs.test_plugin import allocate
from tests.factories import DEVICE_CLASS
from tests.plugin.conftest import ref_of, result, running, wait_for
from tests.plugin.test_shares import allocate as allocate_shares
from tests.plugin.test_shares import share_claim

GATE_ON = FeatureGates({"TimeSlicingSettings": True})
PARAMS_AT = "status.allocation.devices.config[0].opaque.parameters"


def time_slicing(interval: str | None = None) -> dict[str, Any]:
    sharing: dict[str, Any] = {"strategy": "TimeSlicing"}
    if interval is not None:
        sharing["timeSlicingConfig"] = {"interval": interval}
    return entry(params(sharing=sharing))


def uuid_of(plugin: GpuPlugin, device: str) -> str:
    assert plugin.registry is not None
    entry_ = plugin.registry.get(device)
    uuid = getattr(entry_, "uuid", None)
    assert isinstance(uuid, str)
    return uuid


def session_of(plugin: GpuPlugin) -> NvmlSession:
    assert plugin.session is not None
    return plugin.session


def test_time_slice_set_on_prepare_and_reset_on_unprepare(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            nvml = session_of(plugin)
            gpu0, gpu1 = uuid_of(plugin, "gpu-0"), uuid_of(plugin, "gpu-1")
            # an operator left GPU 0 in EXCLUSIVE_PROCESS: time-slicing needs DEFAULT, unprepare puts it back
            settings.set_compute_mode(nvml, gpu0, settings.ComputeMode.EXCLUSIVE_PROCESS)
            claim = allocate(sandbox, "ts", [result("gpu-0"), result("gpu-1")], [time_slicing("Long")])
            ref = ref_of(claim)
            answer = (await kubelet.prepare([ref]))[ref.uid]
            assert answer.error == ""
            assert sorted(d.device_name for d in answer.devices) == ["gpu-0", "gpu-1"]
            for uuid in (gpu0, gpu1):
                assert settings.compute_mode(nvml, uuid) is settings.ComputeMode.DEFAULT
                assert settings.compute_timeslice(nvml, uuid) == 3
            assert settings.compute_timeslice(nvml, uuid_of(plugin, "gpu-2")) == 0
            stored = [r for r in read_payload(plugin_payload(plugin, ref.uid)).undo if r.kind == "timeslicing"]
            assert [(r.target, r.data["timeslice"]) for r in stored] == [("gpu-0,gpu-1", 3)]
            assert {g["uuid"]: g["computeMode"] for g in stored[0].data["gpus"]} == {gpu0: 3, gpu1: 0}
            # no CDI edits beyond the devices' own
            spec = GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid).read_text()
            assert "CUDA_MPS" not in spec

            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert settings.compute_timeslice(nvml, gpu0) == settings.compute_timeslice(nvml, gpu1) == 0
            assert settings.compute_mode(nvml, gpu0) is settings.ComputeMode.EXCLUSIVE_PROCESS
            assert settings.compute_mode(nvml, gpu1) is settings.ComputeMode.DEFAULT

    asyncio.run(body())


def plugin_payload(plugin: GpuPlugin, uid: str) -> str:
    assert plugin.runner is not None
    record = plugin.runner.state.get(uid)
    assert record is not None
    payload = record.payload
    return payload.decode() if isinstance(payload, bytes) else payload


def test_omitted_interval_is_default_and_empty_config_too(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            nvml = session_of(plugin)
            gpu3 = uuid_of(plugin, "gpu-3")
            settings.set_compute_mode(nvml, gpu3, settings.ComputeMode.PROHIBITED)
            bare = allocate(sandbox, "bare", [result("gpu-3")], [time_slicing()])
            empty = allocate(sandbox, "empty", [result("gpu-4")], [
                entry(params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}))])
            answers = await kubelet.prepare([ref_of(bare), ref_of(empty)])
            assert [a.error for a in answers.values()] == ["", ""]
            assert settings.compute_mode(nvml, gpu3) is settings.ComputeMode.DEFAULT
            assert settings.compute_timeslice(nvml, gpu3) == 0

    asyncio.run(body())


def test_gpu_shared_by_two_claims_keeps_its_setting_until_the_last_leaves(tmp_path: Path) -> None:
    """Two consumable shares of one GPU, both time-sliced (shares of a device have equal configs): the first
    unprepare keeps the setting the other claim still uses, the last resets it. (Admin-access claims, which also
    overlap, never change the device: their sharing configs are refused, ``tests/plugin/test_admin_access.py``.)"""
    sliced = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
              "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}}}

    async def body(node: SandboxNode) -> None:
        config = node.shares_config()
        config = dataclasses.replace(config, feature_gates=config.feature_gates.with_gates(TimeSlicingSettings=True))
        async with running(config) as (plugin, kubelet):
            await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
            claims = allocate_shares(node, share_claim("first", config=sliced), share_claim("second", config=sliced))
            assert {c["status"]["allocation"]["devices"]["results"][0]["device"] for c in claims} == {"gpu-0"}
            first, second = (ref_of(c) for c in claims)
            nvml, gpu0 = session_of(plugin), uuid_of(plugin, "gpu-0")
            assert (await kubelet.prepare([first]))[first.uid].error == ""
            assert (await kubelet.prepare([second]))[second.uid].error == ""
            assert settings.compute_timeslice(nvml, gpu0) == 2
            assert (await kubelet.unprepare([second]))[second.uid] == ""
            assert settings.compute_timeslice(nvml, gpu0) == 2  # the remaining claim still time-slices it
            assert (await kubelet.unprepare([first]))[first.uid] == ""
            assert settings.compute_timeslice(nvml, gpu0) == 0

    with SandboxNode(profile=h200_node(tmp_path, gpus=2)) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        asyncio.run(body(node))


def test_failure_on_a_later_gpu_undoes_the_earlier_ones(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            nvml = session_of(plugin)
            first_uuid, second_uuid = sorted((uuid_of(plugin, "gpu-6"), uuid_of(plugin, "gpu-7")))
            index = next(i for i in range(8) if uuid_of(plugin, f"gpu-{i}") == second_uuid)
            settings.set_compute_mode(nvml, first_uuid, settings.ComputeMode.PROHIBITED)
            with sandbox.nvml_control.open("a") as control:  # the later GPU (UUID order) refuses non-root
                control.write(f"set {index} noPermission 1\n")
            claim = allocate(sandbox, "half", [result("gpu-6"), result("gpu-7")], [time_slicing("Medium")])
            ref = ref_of(claim)
            answer = (await kubelet.prepare([ref]))[ref.uid]
            assert answer.error.startswith(f"claim {ref}: {PARAMS_AT}.sharing.timeSlicingConfig: setting time-slice "
                                           f"interval Medium on device 'gpu-{index}' ({second_uuid}) failed: ")
            assert "Insufficient Permissions" in answer.error
            # the first GPU was changed, then undone: compute mode back, time-slice Default
            assert settings.compute_mode(nvml, first_uuid) is settings.ComputeMode.PROHIBITED
            assert settings.compute_timeslice(nvml, first_uuid) == 0
            assert settings.compute_timeslice(nvml, second_uuid) == 0
            assert plugin.runner is not None and plugin.runner.state.get(ref.uid) is None
            assert not GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid).exists()

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_time_slicing_on_mig_devices_is_a_no_op(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            assert plugin.registry is not None
            mig = plugin.inventory.migs[0]
            parent = next(g for g in plugin.inventory.gpus if g.uuid == mig.parent.uuid)
            claim = allocate(sandbox, "mig", [result(mig.name)], [
                entry(params("MigDeviceConfig", sharing={"strategy": "TimeSlicing"}))])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert sandbox.nvml_control.read_text().count("computeTimeslice") == 0
            assert settings.compute_timeslice(session_of(plugin), parent.uuid) == 0
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""

    asyncio.run(body())


def test_driver_root_without_nvidia_smi_fails_the_claim_cleanly() -> None:
    async def body() -> None:
        with SandboxNode(profile="dgx-h100", driver_files=False) as node:
            assert node.api is not None
            node.api.create(DEVICE_CLASS)
            async with running(node.config(feature_gates=GATE_ON)) as (plugin, kubelet):
                ref = ref_of(allocate(node, "nosmi", [result("gpu-0")], [time_slicing("Short")]))
                answer = (await kubelet.prepare([ref]))[ref.uid]
                assert answer.error.startswith(f"claim {ref}: {PARAMS_AT}.sharing: time-slicing needs nvidia-smi "
                                               "from the driver root: no executable nvidia-smi under the driver root")
                assert settings.compute_mode(session_of(plugin), uuid_of(plugin, "gpu-0")) \
                    is settings.ComputeMode.DEFAULT
                assert plugin.runner is not None and plugin.runner.state.get(ref.uid) is None

    asyncio.run(body())


def test_nvidia_refusals_are_per_claim_errors_with_field_paths(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            cases = {
                "with-mps-config": ({"strategy": "TimeSlicing", "mpsConfig": {}}, ".sharing.mpsConfig",
                                    "cannot use MpsConfig with the 'TimeSlicing' strategy"),
                "bad-interval": ({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}},
                                 ".sharing.timeSlicingConfig.interval",
                                 "unknown time-slice interval: Forever, supported time-slice intervals: Default, "
                                 "Short, Medium, Long"),
                "unknown": ({"strategy": "Fabric"}, ".sharing.strategy",
                            "unknown GPU sharing strategy: Fabric, supported GPU sharing strategies: TimeSlicing, MPS"),
                "mps-gate-off": ({"strategy": "MPS"}, ".sharing.strategy",
                                 '"MPS" is selected as the GPU sharing strategy, but the "MPSSupport" feature gate '
                                 "is not enabled"),
            }
            refs = {name: ref_of(allocate(sandbox, name, [result(f"gpu-{i}")], [entry(params(sharing=sharing))]))
                    for i, (name, (sharing, _, _)) in enumerate(cases.items())}
            answers = await kubelet.prepare(list(refs.values()))
            for name, (_, field, problem) in cases.items():
                ref = refs[name]
                assert answers[ref.uid].error.startswith(f"claim {ref}: {PARAMS_AT}{field}: {problem}"), name
                assert plugin.runner is not None and plugin.runner.state.get(ref.uid) is None
            assert "computeTimeslice" not in sandbox.nvml_control.read_text()

    asyncio.run(body())


HUNG_TOOL = """#!/bin/sh
# nvidia-smi that applies the command, then hangs on a time-slice change (a plugin killed while it waits)
"$(dirname "$0")/nvidia-smi.real" "$@"
rc=$?
case "$*" in *--set-timeslice*) echo $$ > "{marker}"; sleep 60;; esac
exit $rc
"""


@pytest.mark.slow
def test_plugin_killed_in_the_middle_of_time_slicing_is_undone_at_start(sandbox: SandboxNode) -> None:
    """SIGKILL while ``nvidia-smi`` runs for the first GPU: the write-ahead record stored with the STARTED claim
    makes the next start reset the GPU, although the apply never returned its record."""
    import os
    import signal
    import sys

    from dradriver.nvml.session import open_session
    from dradriver.sandbox.kubelet import KubeletEmulator
    from tests.plugin.test_recovery import ROOT, _plugin_env

    marker = sandbox.root / "hung.pid"
    real = sandbox.nvidia_smi.with_name("nvidia-smi.real")
    sandbox.nvidia_smi.rename(real)
    sandbox.nvidia_smi.write_text(HUNG_TOOL.replace("{marker}", str(marker)))
    sandbox.nvidia_smi.chmod(0o755)
    nvml = open_session(mock_profile=sandbox.profile)

    async def body() -> None:
        env = _plugin_env(sandbox)
        env.update(FEATURE_GATES="TimeSlicingSettings=true", DRIVER_ROOT_CTR_PATH=str(sandbox.driver_root))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "dradriver", "gpu-kubelet-plugin", env=env,
                                                    cwd=str(ROOT), stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        try:
            async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=30)
                ref = ref_of(allocate(sandbox, "killed", [result("gpu-0"), result("gpu-1")], [time_slicing("Long")]))
                task = asyncio.create_task(connection.prepare([ref]))
                await wait_for(lambda: marker.exists() or task.done(), 60)
                assert not task.done(), task.result()
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if marker.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(marker.read_text().strip()), signal.SIGKILL)
        sandbox.nvidia_smi.unlink()
        real.rename(sandbox.nvidia_smi)
        uuids = sorted(str(pynvml_uuid(nvml, i)) for i in range(2))
        assert [settings.compute_timeslice(nvml, u) for u in uuids] == [3, 0]  # the first GPU was changed
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, _connection):
            assert plugin.runner is not None and plugin.runner.state.get(ref.uid) is None
            assert [settings.compute_timeslice(nvml, u) for u in uuids] == [0, 0]

    try:
        asyncio.run(body())
    finally:
        nvml.close()


def pynvml_uuid(session: NvmlSession, index: int) -> str:
    import pynvml

    value = pynvml.nvmlDeviceGetUUID(session.device(index))
    return value.decode() if isinstance(value, bytes) else value
