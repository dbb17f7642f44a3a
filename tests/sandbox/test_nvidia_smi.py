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
