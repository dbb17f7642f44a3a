"""Driver files in claim specs end to end: the real plugin on a sandbox node, prepared over the kubelet socket.

The sandbox lays out the mock profile's driver version as a host install (``SandboxNode(driver_files=True)``,
the default) or leaves the driver root empty; the plugin discovers once at start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from dradriver.app import gpu as gpu_app
from dradriver.config import PLUGIN_FLAGS, add_flags, config_from_args
from dradriver.domain import cdi
from dradriver.domain.identity import GPU_DRIVER
from dradriver.errors import FlagError
from dradriver.host.driverfiles import DriverFilesError
from dradriver.nvml import mock
from dradriver.sandbox import scheduler
from dradriver.sandbox.node import SandboxNode, lay_out_driver_tree
from tests.cdi import helpers as cdi_checks
from tests.factories import DEVICE_CLASS
from tests.plugin.conftest import claim_object, ref_of, running

PROFILE = "dgx-h100"
LIBDIR = "/usr/lib/x86_64-linux-gnu"


def _version(profile: str = PROFILE) -> str:
    version: str = mock.load_profile(profile)["system"]["driverVersion"]
    return version


async def _prepare_one(node: SandboxNode, **overrides: Any) -> dict[str, Any]:
    """Start the plugin, prepare one GPU claim, return its validated spec, unprepare."""
    assert node.api is not None
    node.api.create(DEVICE_CLASS)
    async with running(node.config(**overrides)) as (_plugin, kubelet):
        node.api.create(claim_object("gpu"))
        [claim] = scheduler.allocate(node.api, [("default", "gpu")], node_name=node.node_name)
        ref = ref_of(claim)
        answer = await kubelet.prepare([ref])
        assert answer[ref.uid].error == ""
        spec = cdi_checks.validate(GPU_DRIVER.cdi.spec_path(node.cdi_root, ref.uid).read_bytes())
        assert await kubelet.unprepare([ref]) == {ref.uid: ""}
        return spec


def test_prepared_claim_carries_driver_mounts_and_hooks() -> None:
    version = _version()
    with SandboxNode(profile=PROFILE) as node:
        spec = asyncio.run(_prepare_one(node))
    common = spec["containerEdits"]
    mounts = {m["containerPath"]: m for m in common["mounts"]}
    for name in ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libnvidia-gpucomp",
                 "libnvidia-allocator", "libnvidia-cfg", "libnvidia-opencl", "libnvidia-encode", "libnvcuvid",
                 "libnvidia-opticalflow"):
        mount = mounts[f"{LIBDIR}/{name}.so.{version}"]
        assert mount["hostPath"] == mount["containerPath"]  # host driver root "/"
        assert mount["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    for binary in ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
                   "nvidia-cuda-mps-server"):
        assert f"/usr/bin/{binary}" in mounts
    assert mounts["/run/nvidia-persistenced/socket"]["options"][-1] == "noexec"
    assert f"/lib/firmware/nvidia/{version}/gsp_ga10x.bin" in mounts
    assert f"NVIDIA_CTK_LIBCUDA_DIR={LIBDIR}" in common["env"]
    hooks = common["hooks"]
    assert [h["args"][1] for h in hooks] == [
        "create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification"]
    assert {h["path"] for h in hooks} == {"/usr/bin/nvidia-cdi-hook"}
    assert all(h["hookName"] == "createContainer" and h["args"][0] == "nvidia-cdi-hook" for h in hooks)
    assert f"libcuda.so.1::{LIBDIR}/libcuda.so" in hooks[0]["args"]
    assert f"libnvidia-ml.so.{version}::{LIBDIR}/libnvidia-ml.so.1" in hooks[0]["args"]
    assert hooks[2]["args"][2:] == ["--folder", LIBDIR, "--folder", f"{LIBDIR}/vdpau"]


def test_driver_container_root_and_hook_path_flow_through_the_config() -> None:
    with SandboxNode(profile=PROFILE) as node:
        (node.driver_root / "dev").mkdir()  # a driver container: its device nodes live under the driver root
        spec = asyncio.run(_prepare_one(node, nvidia_driver_root=Path("/run/nvidia/driver"),
                                        nvidia_cdi_hook_path="/usr/local/nvidia/toolkit/nvidia-ctk"))
    common = spec["containerEdits"]
    assert all(m["hostPath"] == "/run/nvidia/driver" + m["containerPath"] for m in common["mounts"])
    assert all(n["hostPath"] == "/run/nvidia/driver" + n["path"] for n in common["deviceNodes"])
    assert all(n["hostPath"] == "/run/nvidia/driver" + n["path"] for d in spec["devices"]
               for n in d["containerEdits"]["deviceNodes"])
    assert all(h["path"] == "/usr/local/nvidia/toolkit/nvidia-ctk" and h["args"][:2] == ["nvidia-ctk", "hook"]
               for h in common["hooks"])


def test_driver_root_without_dev_keeps_device_nodes_on_the_host_dev() -> None:
    """GKE (``/home/kubernetes/bin/nvidia``) and Talos: driver files under the root, device nodes in ``/dev``."""
    with SandboxNode(profile=PROFILE) as node:
        assert not (node.driver_root / "dev").exists()
        spec = asyncio.run(_prepare_one(node, nvidia_driver_root=Path("/home/kubernetes/bin/nvidia")))
    common = spec["containerEdits"]
    assert all(m["hostPath"] == "/home/kubernetes/bin/nvidia" + m["containerPath"] for m in common["mounts"])
    nodes = common["deviceNodes"] + [n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert nodes and all("hostPath" not in n for n in nodes), nodes  # /dev/nvidia0 is the host's /dev/nvidia0


def test_mock_node_without_driver_files_still_prepares(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dradriver.app")
    with SandboxNode(profile=PROFILE, driver_files=False) as node:
        assert list(node.driver_root.iterdir()) == []
        spec = asyncio.run(_prepare_one(node))
    common = spec["containerEdits"]
    assert set(common) == {"env", "deviceNodes"} and common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert any("no files of NVIDIA driver" in r.getMessage() and "device nodes only" in r.getMessage()
               for r in caplog.records)


def test_real_driver_without_files_fails_at_start(tmp_path: Path) -> None:
    with SandboxNode(profile=PROFILE, driver_files=False) as node:
        config = node.config(mock_profile="")
        with pytest.raises(DriverFilesError, match=f"libcuda.so.{_version()} not found under driver root"):
            gpu_app.driver_edits(config, _version())
        # the same root with the driver laid out passes, and with the mock an empty root is no error
        lay_out_driver_tree(node.driver_root, _version())
        assert gpu_app.driver_edits(config, _version()).mounts
        assert gpu_app.driver_edits(node.config(container_driver_root=tmp_path), _version()) == cdi.ContainerEdits()


def test_sandbox_tree_for_aarch64(tmp_path: Path) -> None:
    lay_out_driver_tree(tmp_path, "580.173.02", arch="aarch64")
    assert (tmp_path / "usr/lib/aarch64-linux-gnu/libcuda.so.580.173.02").is_file()
    assert (tmp_path / "usr/lib/aarch64-linux-gnu/libcuda.so.1").readlink() == Path("libcuda.so.580.173.02")


def _parse(environ: dict[str, str]) -> Any:
    parser = argparse.ArgumentParser()
    add_flags(parser, PLUGIN_FLAGS, environ={"NODE_NAME": "n", **environ})
    return config_from_args(parser.parse_args([]))


def test_hook_path_flag() -> None:
    # Empty (NVIDIA's default): specs name the image's hook copied into the plugin directory.
    plugin_hook = "/var/lib/kubelet/plugins/gpu.nvidia.com/nvidia-cdi-hook"
    assert _parse({}).nvidia_cdi_hook_path == "" and _parse({}).cdi_hook_path == plugin_hook
    assert _parse({"NVIDIA_CDI_HOOK_PATH": ""}).cdi_hook_path == plugin_hook
    configured = _parse({"NVIDIA_CDI_HOOK_PATH": "/opt/x/nvidia-cdi-hook"})
    assert configured.nvidia_cdi_hook_path == configured.cdi_hook_path == "/opt/x/nvidia-cdi-hook"
    with pytest.raises(FlagError, match=r"NVIDIA_CDI_HOOK_PATH.*not an absolute path"):
        _parse({"NVIDIA_CDI_HOOK_PATH": "nvidia-cdi-hook"})
