"""The sandbox's stand-ins behave as the real programs: nvidia-cuda-mps-control, mount/umount (tmpfs)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.host.mounts import MountCommands, MountError
from dradriver.sandbox import standins
from dradriver.sandbox.standins.nvidia_cuda_mps_control import STATE_FILE


@pytest.fixture
def mps_dirs(short_dir: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    tool = standins.install("nvidia_cuda_mps_control", short_dir / "bin" / "nvidia-cuda-mps-control")
    pipe, logs = short_dir / "pipe", short_dir / "log"
    pipe.mkdir()
    logs.mkdir()
    env = {"PATH": f"{tool.parent}:/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
           "CUDA_MPS_LOG_DIRECTORY": str(logs), "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    yield pipe, env
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=env, text=True, capture_output=True,
                   timeout=10, check=False)


def _control(env: dict[str, str], stdin: str | None = None, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvidia-cuda-mps-control", *args], input=stdin, env=env, text=True, capture_output=True,
                          timeout=10, check=False)


def test_mps_control_daemonises_takes_commands_and_quits(mps_dirs: tuple[Path, dict[str, str]]) -> None:
    pipe, env = mps_dirs
    assert _control(env, None, "-d", "-M").returncode == 0
    assert {"control", "control_lock"} <= {p.name for p in pipe.iterdir()}
    again = _control(env, None, "-d")
    assert again.returncode == 1 and "already running" in again.stderr
    done = _control(env, "set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit 1 512M\n"
                         "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit GPU-b\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["25.0", "25.0", "512M"]
    state = json.loads((pipe / STATE_FILE).read_text())
    assert state["multiUser"] is True and state["visibleDevices"] == ["GPU-a", "GPU-b"]
    assert state["defaultPinnedMemLimits"] == {"GPU-b": "512M"}
    bad = _control(env, "set_default_device_pinned_mem_limit GPU-z 1M\nfrobnicate\n")
    assert bad.returncode == 1 and "Invalid device GPU-z" in bad.stdout and "Invalid command" in bad.stdout
    log = (Path(env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log").read_text()
    assert "Starting control daemon" in log and "set_default_active_thread_percentage 25" in log
    assert _control(env, "quit\n").returncode == 0
    assert not (pipe / "control").exists()
    gone = _control(env, "get_server_list\n")
    assert gone.returncode == 1 and "Cannot find MPS control daemon" in gone.stderr


def test_mps_control_needs_its_directories(short_dir: Path) -> None:
    tool = standins.install("nvidia_cuda_mps_control", short_dir / "nvidia-cuda-mps-control")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(short_dir / "missing"), "CUDA_MPS_LOG_DIRECTORY": str(short_dir)}
    done = subprocess.run([str(tool), "-d"], env=env, text=True, capture_output=True, timeout=10, check=False)
    assert done.returncode == 1 and "Cannot access directory" in done.stderr


@pytest.fixture
def fake_mounts(tmp_path: Path) -> MountCommands:
    bin_dir = tmp_path / "bin"
    standins.install("mount", bin_dir / "mount")
    standins.install("mount", bin_dir / "umount")
    return MountCommands(str(bin_dir / "mount"), str(bin_dir / "umount"), bin_dir / "mountinfo")


def test_mount_standin_fails_as_util_linux_does(fake_mounts: MountCommands, tmp_path: Path) -> None:
    target = tmp_path / "shm dir"
    with pytest.raises(MountError, match="mount point does not exist"):
        fake_mounts.mount_tmpfs(target, "rw,size=64k")
    target.mkdir()
    fake_mounts.mount_tmpfs(target, "rw,nosuid,nodev,noexec,relatime,size=64k")
    assert fake_mounts.is_mounted(target)
    line = fake_mounts.mountinfo.read_text().split()
    assert line[4] == str(target).replace(" ", "\\040") and line[-3:] == ["tmpfs", "tmpfs", "rw,size=64k"]
    fake_mounts.mount_tmpfs(target, "rw,size=64k")  # mounted already: nothing to do
    twice = subprocess.run([fake_mounts.mount, "-t", "tmpfs", "tmpfs", str(target)], capture_output=True, text=True,
                           check=False)
    assert twice.returncode == 32 and "already mounted" in twice.stderr
    fake_mounts.unmount(target)
    assert not fake_mounts.is_mounted(target)
    fake_mounts.unmount(target)  # idempotent
    direct = subprocess.run([fake_mounts.umount, str(target)], capture_output=True, text=True, check=False)
    assert direct.returncode == 32 and "not mounted" in direct.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="real tmpfs mounts need root; the stand-in test above covers the path")
def test_real_mount_helper_mounts_and_unmounts_tmpfs(tmp_path: Path) -> None:
    target = tmp_path / "shm"
    target.mkdir()
    real = MountCommands()
    try:
        real.mount_tmpfs(target, "rw,nosuid,nodev,noexec,relatime,size=64k")
    except MountError as exc:  # root without CAP_SYS_ADMIN (an unprivileged container)
        pytest.skip(f"mount not permitted here: {exc}")
    try:
        assert real.is_mounted(target)
        assert os.stat(target).st_dev != os.stat(tmp_path).st_dev
    finally:
        real.unmount(target)
    assert not real.is_mounted(target)
