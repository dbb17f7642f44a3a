"""The sandbox driver root's ``nvidia-smi`` stand-in, run with NVIDIA's ``LD_PRELOAD`` rule
(:mod:`dradriver.host.nvidiasmi`), with results read back through NVML in this process."""

from __future__ import annotations

import ctypes.util
import subprocess
from collections.abc import Iterator

import pynvml
import pytest

from dradriver.host.nvidiasmi import NvidiaSmi, NvidiaSmiError, find_nvidia_smi
from dradriver.nvml import settings
from dradriver.nvml.session import NvmlSession, open_session
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.nvidia_smi import NO_DEVICES, NO_LIBRARY


@pytest.fixture
def node() -> Iterator[tuple[SandboxNode, NvmlSession, NvidiaSmi]]:
    with SandboxNode(profile="dgx-h100") as sandbox:
        session = open_session(mock_profile=sandbox.profile)
        try:
            yield sandbox, session, find_nvidia_smi(sandbox.driver_root)
        finally:
            session.close()


def _uuid(session: NvmlSession, index: int) -> str:
    value = pynvml.nvmlDeviceGetUUID(session.device(index))
    return value.decode() if isinstance(value, bytes) else value


def test_driver_root_tools_are_found_where_nvidia_looks(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    sandbox, _, smi = node
    assert smi.binary == sandbox.nvidia_smi
    assert smi.library == sandbox.driver_root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    assert smi.environment({"LD_PRELOAD": "/x.so"})["LD_PRELOAD"] == f"{smi.library}:/x.so"
    assert smi.run(["--version"]).splitlines()[0] == "NVIDIA-SMI version  : 580.105.08"


def test_list_gpus_prints_every_gpu_with_its_uuid(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    _, session, smi = node
    lines = smi.run(["-L"]).splitlines()
    assert len(lines) == session.device_count() == 8
    assert lines[3] == f"GPU 3: NVIDIA H100 80GB HBM3 (UUID: {_uuid(session, 3)})"


def test_compute_mode_and_timeslice_land_in_nvml(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    _, session, smi = node
    uuid = _uuid(session, 2)
    out = smi.run(["-i", uuid, "-c", "EXCLUSIVE_PROCESS"])
    assert out.splitlines()[-1] == "All done."
    assert settings.compute_mode(session, uuid) is settings.ComputeMode.EXCLUSIVE_PROCESS
    smi.run(["-i", uuid, "-c", "0"])
    assert settings.compute_mode(session, uuid) is settings.ComputeMode.DEFAULT
    smi.set_timeslice(uuid, 3)
    assert settings.compute_timeslice(session, uuid) == 3
    assert settings.compute_timeslice(session, _uuid(session, 1)) == 0
    assert "LONG (3)" in smi.run(["compute-policy", "-i", uuid, "-l"])


def test_bad_uuid_fails_like_the_real_tool(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    _, _, smi = node
    for args in (["-i", "GPU-00000000-0000-0000-0000-000000000000", "-c", "DEFAULT"],
                 ["compute-policy", "-i", "GPU-00000000-0000-0000-0000-000000000000", "--set-timeslice", "1"],
                 ["-i", "12", "-c", "DEFAULT"]):
        with pytest.raises(NvidiaSmiError) as info:
            smi.run(args)
        assert info.value.returncode == 6
        assert info.value.output == NO_DEVICES


def test_bad_values_are_usage_errors(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    _, session, smi = node
    for args in (["-c", "7"], ["compute-policy", "-i", "0", "--set-timeslice", "4"], ["--bogus"]):
        with pytest.raises(NvidiaSmiError) as info:
            smi.run(args)
        assert info.value.returncode == 2
    with pytest.raises(ValueError):
        smi.set_timeslice(_uuid(session, 0), 5)


def test_lost_gpu_and_missing_permission(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    sandbox, session, smi = node
    lost, denied = _uuid(session, 4), _uuid(session, 5)
    with sandbox.nvml_control.open("a") as control:
        control.write("lost 4 1\nset 5 noPermission 1\n")
    with pytest.raises(NvidiaSmiError) as info:
        smi.run(["-i", lost, "-c", "DEFAULT"])
    assert info.value.returncode == 15
    assert "GPU is lost" in info.value.output
    with pytest.raises(NvidiaSmiError) as info:
        smi.set_timeslice(denied, 1)
    assert info.value.returncode == 4
    with pytest.raises(NvidiaSmiError) as info:
        smi.run(["-i", denied, "-c", "EXCLUSIVE_PROCESS"])
    assert info.value.returncode == 4
    assert info.value.output.endswith("Insufficient Permissions\nTerminating early due to previous errors.")
    assert settings.compute_mode(session, denied) is settings.ComputeMode.DEFAULT


def test_without_ld_preload_the_tool_finds_no_library(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    sandbox, _, _ = node
    done = subprocess.run([str(sandbox.nvidia_smi), "-L"], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=60, check=False)
    if done.returncode == 0:  # a real driver on this machine answers instead
        assert ctypes.util.find_library("nvidia-ml")
        return
    assert done.returncode == 12
    assert done.stdout.strip() == NO_LIBRARY


def _persistence(session: NvmlSession, index: int) -> int:
    return int(pynvml.nvmlDeviceGetPersistenceMode(session.device(index)))


def test_persistence_mode_without_the_daemon_sets_the_legacy_mode_in_nvml(
        node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    """No nvidia-persistenced listening (the sandbox driver tree's socket path is a plain file): ``-pm`` goes
    through nvmlDeviceSetPersistenceMode, with the real tool's lines."""
    _, session, smi = node
    bus = pynvml.nvmlDeviceGetPciInfo(session.device(2)).busId
    bus = bus.decode() if isinstance(bus, bytes) else bus
    assert smi.run(["-i", "2", "-pm", "0"]).splitlines() == [f"Disabled persistence mode for GPU {bus}.", "All done."]
    assert _persistence(session, 2) == pynvml.NVML_FEATURE_DISABLED
    assert _persistence(session, 3) == pynvml.NVML_FEATURE_ENABLED
    assert smi.run(["-i", "2", "-pm", "DISABLED"]).splitlines()[0] == (
        f"Persistence mode is already Disabled for GPU {bus}.")
    assert smi.set_persistence_mode(bus, True).splitlines() == [f"Enabled Legacy persistence mode for GPU {bus}.",
                                                                "All done."]
    assert _persistence(session, 2) == pynvml.NVML_FEATURE_ENABLED


def test_persistence_mode_errors_are_the_real_tools(node: tuple[SandboxNode, NvmlSession, NvidiaSmi]) -> None:
    sandbox, session, smi = node
    for args in (["-pm", "2"], ["-pm", "ON"], ["-i", "0", "-pm", "0", "-c", "0"], ["-pm"]):
        with pytest.raises(NvidiaSmiError) as info:
            smi.run(args)
        assert info.value.returncode == 2, args
    with pytest.raises(NvidiaSmiError) as info:
        smi.run(["-i", "12", "-pm", "0"])
    assert (info.value.returncode, info.value.output) == (6, NO_DEVICES)
    with sandbox.nvml_control.open("a") as control:
        control.write("set 5 noPermission 1\n")
    with pytest.raises(NvidiaSmiError) as info:
        smi.run(["-i", "5", "-pm", "0"])
    assert info.value.returncode == 4
    assert info.value.output.startswith("Unable to set persistence mode for GPU ")
    assert info.value.output.endswith(": Insufficient Permissions")
    assert _persistence(session, 5) == pynvml.NVML_FEATURE_ENABLED


def test_persistence_mode_with_the_daemon_asks_it_to_release_and_reopen_the_gpu() -> None:
    """nvidia-persistenced listening on the driver root's socket: ``-pm 0`` makes it close that GPU's device file,
    ``-pm 1`` open it again (its legacy NVML mode untouched), and a GPU it holds already is "already Enabled"."""
    with SandboxNode(profile="dgx-h100", pci_tree=True, persistenced=True) as sandbox:
        session = open_session(mock_profile=sandbox.profile)
        try:
            smi = find_nvidia_smi(sandbox.driver_root)
            daemon = sandbox.persistence_daemon
            assert daemon is not None

            def held(minor: int) -> bool:
                return daemon.pid in {h.pid for h in sandbox.pci_host().holders(minor)}

            assert held(0) and held(1)
            assert smi.set_persistence_mode("0000:18:00.0", False).splitlines() == [
                "Disabled persistence mode for GPU 00000000:18:00.0.", "All done."]
            assert not held(0) and held(1)
            assert smi.set_persistence_mode("0000:18:00.0", True).splitlines()[0] == (
                "Enabled persistence mode for GPU 00000000:18:00.0.")
            assert held(0)
            assert smi.set_persistence_mode("0000:18:00.0", True).splitlines()[0] == (
                "Persistence mode is already Enabled for GPU 00000000:18:00.0.")
            assert "persistenceMode" not in sandbox.nvml_control.read_text()
        finally:
            session.close()
