"""Spec-level CDI edits from the driver's files: mounts, root transform, hooks, env (``cdi.md`` 4.6-4.9)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain import cdi
from dradriver.host import driverfiles
from dradriver.host.devicenodes import DeviceNodeInfo
from dradriver.host.driverfiles import DriverFiles, discover_driver_files
from tests.cdi import helpers
from tests.cdi.conftest import CLAIM_UID, LETTER_UID, PROC_DEVICES, make_gpu, make_migs
from tests.driverfiles.trees import VERSION, X86, build, debian_aarch64, ubuntu_x86_64

RO = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
IPC = ["nosuid", "nodev", "rbind", "rprivate", "noexec"]


@pytest.fixture
def x86_files(tmp_path: Path) -> DriverFiles:
    return discover_driver_files(build(tmp_path / "driver-root", ubuntu_x86_64()), VERSION, kernel_release="k")


@pytest.fixture
def node_info(tmp_path: Path) -> DeviceNodeInfo:
    (tmp_path / "devices").write_text(PROC_DEVICES)
    (tmp_path / "dev").mkdir()
    return DeviceNodeInfo(dev_root=tmp_path / "dev", proc_devices=tmp_path / "devices",
                              mig_minors=tmp_path / "absent", capabilities_dir=tmp_path / "absent")


def _spec(uid: str, edits: cdi.ContainerEdits, info: DeviceNodeInfo, *, mig: bool = False) -> dict[str, Any]:
    gpu = make_gpu(0, mig=mig)
    devices = make_migs(gpu)[:2] if mig else [gpu]
    return helpers.validate(helpers.render_gpu_spec(uid, devices, node_info=info, common=edits), fully_specified=True)


def test_host_driver_at_root(x86_files: DriverFiles) -> None:
    edits = driverfiles.driver_edits(x86_files, host_root="/")
    mounts = {m.container_path: m for m in edits.mounts}
    lib = mounts[f"{X86}/libcuda.so.{VERSION}"]
    assert lib.host_path == lib.container_path and lib.options == tuple(RO) and lib.type == ""
    assert mounts["/usr/bin/nvidia-smi"].options == tuple(RO)
    assert mounts["/run/nvidia-persistenced/socket"].options == tuple(IPC)
    assert mounts["/tmp/nvidia-mps"].options == tuple(IPC)
    assert mounts[f"/usr/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"].options == tuple(RO)
    assert len(mounts) == len(edits.mounts) == x86_files.count()
    # sorted by path depth, then path (the toolkit's post-processing)
    keys = [(m.container_path.count("/"), m.container_path) for m in edits.mounts]
    assert keys == sorted(keys)
    assert edits.env == (f"NVIDIA_CTK_LIBCUDA_DIR={X86}",)
    assert edits.device_nodes == () and edits.additional_gids == ()


def test_driver_container_root_transform(x86_files: DriverFiles) -> None:
    edits = driverfiles.driver_edits(x86_files, host_root="/run/nvidia/driver/")
    for mount in edits.mounts:
        assert mount.host_path == "/run/nvidia/driver" + mount.container_path, mount
    # the hook binary is a host path of its own: not moved under the driver root
    assert {h.path for h in edits.hooks} == {"/usr/bin/nvidia-cdi-hook"}


def test_root_transform_uses_the_canonical_source(tmp_path: Path) -> None:
    root = build(tmp_path, {
        "/usr/lib64/libcuda.so.1.2": "", "/usr/lib64/libnvidia-ml.so.1.2": "",
        "/usr/local/bin/nvidia-smi": "-> /opt/nv/nvidia-smi", "/opt/nv/nvidia-smi": "",
    })
    edits = driverfiles.driver_edits(discover_driver_files(root, "1.2", kernel_release="k"), host_root="/host/drv")
    [smi] = [m for m in edits.mounts if m.container_path.endswith("nvidia-smi")]
    assert (smi.container_path, smi.host_path) == ("/usr/local/bin/nvidia-smi", "/host/drv/opt/nv/nvidia-smi")


def test_hooks_in_toolkit_order(x86_files: DriverFiles) -> None:
    hooks = driverfiles.driver_edits(x86_files).hooks
    assert [h.args[1] for h in hooks] == [
        "create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification"]
    for hook in hooks:
        assert hook.hook_name == "createContainer"
        assert hook.path == "/usr/bin/nvidia-cdi-hook" and hook.args[0] == "nvidia-cdi-hook"
        assert hook.env == ("NVIDIA_CTK_DEBUG=false",)
        assert hook.timeout is None
    symlinks, compat, ldcache, nodes = hooks
    assert symlinks.args[2:6] == ("--link", f"libcuda.so.1::{X86}/libcuda.so",
                                  "--link", f"libGLX_nvidia.so.{VERSION}::{X86}/libGLX_indirect.so.0")
    assert symlinks.args[2::2] == ("--link",) * len(x86_files.links)
    assert compat.args[2:] == (f"--host-driver-version={VERSION}",)
    assert ldcache.args[2:] == ("--folder", X86, "--folder", f"{X86}/vdpau")
    assert nodes.args == ("nvidia-cdi-hook", "disable-device-node-modification")


def test_hook_through_nvidia_ctk(x86_files: DriverFiles) -> None:
    hooks = driverfiles.driver_edits(x86_files, hook_path="/usr/local/nvidia/toolkit/nvidia-ctk").hooks
    assert all(h.args[:2] == ("nvidia-ctk", "hook") for h in hooks)
    assert [h.args[2] for h in hooks][-1] == "disable-device-node-modification"


def test_no_driver_files_means_no_edits() -> None:
    assert driverfiles.driver_edits(DriverFiles(version=VERSION, root="/driver-root")) == cdi.ContainerEdits()


def test_claim_spec_with_driver_edits_validates(x86_files: DriverFiles, node_info: DeviceNodeInfo) -> None:
    edits = driverfiles.driver_edits(x86_files, host_root="/run/nvidia/driver")
    for uid in (CLAIM_UID, LETTER_UID):
        spec = _spec(uid, edits, node_info)
        common = spec["containerEdits"]
        assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void", f"NVIDIA_CTK_LIBCUDA_DIR={X86}"]
        assert [n["path"] for n in common["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm",
                                                              "/dev/nvidia-uvm-tools"]
        assert len(common["mounts"]) == x86_files.count()
        assert [h["args"][1] for h in common["hooks"]] == [
            "create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification"]
        assert list(common["hooks"][0]) == ["hookName", "path", "args", "env"]
        assert list(common["mounts"][0]) == ["hostPath", "containerPath", "options"]
    # hooks and mounts without a type need no newer cdiVersion: a letter UID stays at the baseline
    assert _spec(LETTER_UID, edits, node_info)["cdiVersion"] == "0.3.0"
    assert _spec(CLAIM_UID, edits, node_info)["cdiVersion"] == "0.5.0"  # device name starts with a digit


def test_mig_claim_spec_with_aarch64_driver(tmp_path: Path, node_info: DeviceNodeInfo) -> None:
    root = build(tmp_path / "root", debian_aarch64())
    edits = driverfiles.driver_edits(discover_driver_files(root, VERSION, kernel_release="k"))
    spec = _spec(LETTER_UID, edits, node_info, mig=True)
    assert len(spec["devices"]) == 2
    paths = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
    assert "/usr/lib/aarch64-linux-gnu/libcuda.so.580.105.08" in paths
    assert "/var/run/nvidia-persistenced/socket" in paths


def test_claim_spec_file_carries_the_edits(x86_files: DriverFiles, node_info: DeviceNodeInfo,
                                           tmp_path: Path) -> None:
    edits = driverfiles.driver_edits(x86_files)
    cdi_root = tmp_path / "cdi"
    cdi_root.mkdir()
    path = helpers.write_gpu_spec(cdi_root, LETTER_UID, [make_gpu(3)], node_info=node_info, common=edits)
    spec = helpers.validate(path.read_bytes(), fully_specified=True)
    assert spec == json.loads(helpers.render_gpu_spec(LETTER_UID, [make_gpu(3)], node_info=node_info, common=edits))
    assert len(spec["containerEdits"]["hooks"]) == 4
