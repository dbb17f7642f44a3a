"""``nvidia-cdi-hook``: the image's copy in the plugin directory, the check of the path specs name, the stand-in.

The real GPU plugin on a sandbox node (mock NVML, driver files laid out so claim specs carry hooks), prepared over
the kubelet's gRPC socket, its readiness asked over the gRPC health port, Events read from the API emulator. The
hooks of a prepared claim's spec are then run as a runtime runs them (``argv`` = the hook's ``args``, the OCI
state on stdin), by the stand-in and, where present, by NVIDIA's own ``nvidia-ctk``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dradriver.config import PluginConfig
from dradriver.domain.identity import GPU_DRIVER
from dradriver.host import cdihook
from dradriver.sandbox import scheduler, standins
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.standins import nvidia_cdi_hook
from tests.cdi import helpers as cdi_checks
from tests.computedomain.test_plugin_fabric import NOT_SERVING, SERVING, _events, _probe
from tests.factories import DEVICE_CLASS
from tests.plugin.conftest import claim_object, ref_of, running

PROFILE = "dgx-h100"
NVIDIA_CTK = Path(__file__).resolve().parents[3] / "shared" / "peers" / "bin" / "nvidia-ctk"  # NVIDIA's, in CI
EVENT = "NvidiaCdiHookMissing"


def _claim(node: SandboxNode, name: str) -> Any:
    assert node.api is not None
    node.api.create(claim_object(name))
    [claim] = scheduler.allocate(node.api, [("default", name)], node_name=node.node_name)
    return ref_of(claim)


def _spec(node: SandboxNode, uid: str) -> dict[str, Any]:
    return cdi_checks.validate(GPU_DRIVER.cdi.spec_path(node.cdi_root, uid).read_bytes())


def _run_hook(hook: dict[str, Any], bundle: Path, *, binary: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run one spec hook as runc does: ``hook.path`` with ``hook.args`` as argv, the OCI state on stdin."""
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": 1, "bundle": str(bundle)})
    path = str(binary or hook["path"])
    return subprocess.run([path, *hook["args"][1:]], executable=path, input=state, capture_output=True, text=True,
                          timeout=30, env={**os.environ, **dict(e.split("=", 1) for e in hook.get("env", []))})


def _bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}))
    return bundle


def test_the_images_hook_is_copied_to_the_plugin_dir_and_named_by_prepared_specs(tmp_path: Path) -> None:
    """NVIDIA_CDI_HOOK_PATH empty (NVIDIA's default): the image's hook becomes ``<plugin dir>/nvidia-cdi-hook``
    (0755, same bytes), every hook of a prepared claim's spec names that host path, and the spec's hooks run
    through it as a runtime runs them (create-symlinks makes the driver's links in the container's root)."""
    with SandboxNode(profile=PROFILE) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        config = node.config(nvidia_cdi_hook_path="")
        copy = config.plugin_dir / "nvidia-cdi-hook"

        async def body() -> dict[str, Any]:
            async with running(config) as (_plugin, kubelet):
                ref = _claim(node, "gpu")
                answer = await kubelet.prepare([ref])
                assert answer[ref.uid].error == ""
                return _spec(node, ref.uid)

        spec = asyncio.run(body())
        assert copy.stat().st_mode & 0o777 == 0o755
        assert copy.read_bytes() == node.image_cdi_hook.read_bytes()
        hooks = spec["containerEdits"]["hooks"]
        assert [h["args"][1] for h in hooks] == [
            "create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification"]
        assert {h["path"] for h in hooks} == {str(copy)}
        assert all(h["args"][0] == "nvidia-cdi-hook" for h in hooks)
        bundle = _bundle(tmp_path)
        for hook in hooks:
            done = _run_hook(hook, bundle)
            assert done.returncode == 0, (hook["args"], done.stderr)
        assert (bundle / "rootfs/usr/lib/x86_64-linux-gnu/libcuda.so").readlink() == Path("libcuda.so.1")


def test_the_copy_is_replaced_atomically_and_left_alone_when_identical(tmp_path: Path) -> None:
    image = standins.install("nvidia_cdi_hook", tmp_path / "image" / "nvidia-cdi-hook")
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    copy = cdihook.install(image, plugin_dir)
    inode = copy.stat().st_ino
    assert cdihook.install(image, plugin_dir) == copy and copy.stat().st_ino == inode  # identical: not rewritten
    image.write_text(image.read_text() + "# a newer image\n")
    cdihook.install(image, plugin_dir)
    assert copy.stat().st_ino != inode and copy.read_bytes() == image.read_bytes()  # renamed into place
    assert copy.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["nvidia-cdi-hook"]  # no temporary file left
    with pytest.raises(cdihook.CdiHookError, match=r"cannot copy the image's nvidia-cdi-hook .*missing.* to "):
        cdihook.install(tmp_path / "missing", plugin_dir)


async def _refused_then_served(node: SandboxNode, config: PluginConfig, restore: Any) -> None:
    """Prepare is refused per claim naming the hook and readiness is NOT_SERVING with an Event; after
    ``restore()`` the same plugin is ready and prepares (no restart)."""
    async with running(config) as (plugin, kubelet):
        port = plugin.servers.health_port
        assert port is not None
        ref = _claim(node, "gpu")
        answer = await kubelet.prepare([ref])
        error = answer[ref.uid].error
        assert f"claim {ref}: not prepared: nvidia-cdi-hook {config.cdi_hook_path}" in error
        assert "is missing" in error and "the kubelet retries" in error
        assert not GPU_DRIVER.cdi.spec_path(node.cdi_root, ref.uid).exists()  # nothing half prepared
        assert await _probe(port, "readiness") == NOT_SERVING
        for _ in range(100):
            if _events(node, EVENT):
                break
            await asyncio.sleep(0.05)
        [event] = _events(node, EVENT)
        assert event["type"] == "Warning" and config.cdi_hook_path in event["message"]
        assert event["involvedObject"]["kind"] == "Node"
        restore()
        assert await _probe(port, "readiness") == SERVING
        answer = await kubelet.prepare([ref])
        assert answer[ref.uid].error == ""
        assert {h["path"] for h in _spec(node, ref.uid)["containerEdits"]["hooks"]} == {config.cdi_hook_path}
        assert len(_events(node, EVENT)) == 1  # one Event per time it went missing


def test_without_the_images_hook_the_plugin_is_not_ready_refuses_prepares_and_serves_once_it_is_there() -> None:
    with SandboxNode(profile=PROFILE) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        node.image_cdi_hook.unlink()  # an image without the hook (dradriver's before this change)
        config = node.config(nvidia_cdi_hook_path="", healthcheck_port=0)

        asyncio.run(_refused_then_served(
            node, config, lambda: standins.install("nvidia_cdi_hook", node.image_cdi_hook)))
        assert (config.plugin_dir / "nvidia-cdi-hook").read_bytes() == node.image_cdi_hook.read_bytes()


def test_a_configured_hook_missing_on_the_host_keeps_the_plugin_not_ready_until_it_is_installed() -> None:
    """NVIDIA_CDI_HOOK_PATH=/usr/bin/nvidia-cdi-hook on a host install (driver root ``/``): the plugin sees the
    host's file under its driver root mount and checks it there."""
    with SandboxNode(profile=PROFILE) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        host_hook = node.driver_root / "usr" / "bin" / "nvidia-cdi-hook"
        host_hook.unlink()  # the container toolkit is not installed on this host
        config = node.config(nvidia_cdi_hook_path="/usr/bin/nvidia-cdi-hook", healthcheck_port=0)

        asyncio.run(_refused_then_served(node, config, lambda: standins.install("nvidia_cdi_hook", host_hook)))
        assert not (config.plugin_dir / "nvidia-cdi-hook").exists()  # a configured path: nothing copied


def test_specs_without_hooks_need_no_hook_binary() -> None:
    """The mock NVML without driver files: claim specs carry device nodes only, so a missing hook refuses
    nothing."""
    with SandboxNode(profile=PROFILE, driver_files=False) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        node.image_cdi_hook.unlink()
        config = node.config(nvidia_cdi_hook_path="", healthcheck_port=0)

        async def body() -> None:
            async with running(config) as (plugin, kubelet):
                assert plugin.servers.health_port is not None
                assert await _probe(plugin.servers.health_port, "readiness") == SERVING
                ref = _claim(node, "gpu")
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                assert "hooks" not in _spec(node, ref.uid)["containerEdits"]

        asyncio.run(body())
        assert not _events(node, EVENT)


def test_a_hook_path_no_mount_shows_is_logged_as_unchecked_and_refuses_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="dradriver.host.cdihook")
    plugin_dir, driver_root = tmp_path / "plugins" / "gpu.nvidia.com", tmp_path / "driver-root"
    where = {"plugin_dir": plugin_dir, "host_driver_root": Path("/run/nvidia/driver"),
             "container_driver_root": driver_root}
    assert cdihook.visible_path(str(plugin_dir / "nvidia-cdi-hook"), **where) == plugin_dir / "nvidia-cdi-hook"
    assert cdihook.visible_path("/run/nvidia/driver/usr/bin/nvidia-cdi-hook", **where) == \
        driver_root / "usr/bin/nvidia-cdi-hook"
    assert cdihook.visible_path("/usr/local/nvidia/toolkit/nvidia-cdi-hook", **where) is None
    hook = cdihook.CdiHook("/usr/local/nvidia/toolkit/nvidia-cdi-hook", None)
    assert hook.refusal() == ""
    assert any("/usr/local/nvidia/toolkit/nvidia-cdi-hook" in r.getMessage() and "does not check it" in r.getMessage()
               for r in caplog.records)


def test_a_hook_that_goes_away_is_noticed_at_the_next_look(tmp_path: Path) -> None:
    """Once found the hook is trusted for :data:`cdihook.RECHECK_S` seconds; the next look sees it gone, refuses
    and reports once; a copy removed from the plugin directory is copied again from the image."""
    now = [0.0]
    missing: list[str] = []
    host = standins.install("nvidia_cdi_hook", tmp_path / "host" / "nvidia-cdi-hook")
    hook = cdihook.CdiHook(str(host), host, on_missing=missing.append, clock=lambda: now[0])
    assert hook.refusal() == ""
    host.unlink()
    assert hook.refusal() == ""  # within RECHECK_S: not looked at again
    now[0] += cdihook.RECHECK_S
    assert "is missing or not executable" in hook.refusal() and len(missing) == 1
    assert hook.refusal() and len(missing) == 1  # reported once per disappearance
    image = standins.install("nvidia_cdi_hook", tmp_path / "image" / "nvidia-cdi-hook")
    (tmp_path / "plugin").mkdir()
    copied = cdihook.CdiHook(str(tmp_path / "plugin" / "nvidia-cdi-hook"), tmp_path / "plugin" / "nvidia-cdi-hook",
                             source=image, clock=lambda: now[0])
    assert copied.refusal() == ""
    (tmp_path / "plugin" / "nvidia-cdi-hook").unlink()
    now[0] += cdihook.RECHECK_S
    assert copied.refusal() == "" and (tmp_path / "plugin" / "nvidia-cdi-hook").is_file()


def test_the_stand_in_checks_flags_and_warns_on_unknown_subcommands_as_the_real_hook(tmp_path: Path) -> None:
    hook = standins.install("nvidia_cdi_hook", tmp_path / "nvidia-cdi-hook")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(hook), *args], input="", capture_output=True, text=True, timeout=30)

    unknown = run("a-future-hook", "--anything=1")
    assert unknown.returncode == 0 and "Unsupported CDI hook: a-future-hook" in unknown.stderr
    bad = run("update-ldcache", "--folders", "/usr/lib")
    assert bad.returncode == 1 and "flag provided but not defined: -folders" in bad.stderr
    assert run("enable-cuda-compat", "--host-driver-version=580.65.06").returncode == 0
    assert run("disable-device-node-modification").returncode == 0
    assert run("update-ldcache", "--folder").returncode == 1  # a value is missing
    no_state = run("create-symlinks", "--link", "a::/b")
    assert no_state.returncode == 1 and "container state" in no_state.stderr


@pytest.mark.skipif(not NVIDIA_CTK.is_file(), reason=f"NVIDIA's nvidia-ctk is not at {NVIDIA_CTK} (present in CI)")
def test_nvidia_ctk_accepts_every_hook_of_a_prepared_spec_and_the_stand_in_knows_its_flags(tmp_path: Path) -> None:
    """NVIDIA's own binary (``nvidia-ctk hook``, the toolkit's hooks) runs the hooks of dradriver's spec: each
    subcommand and flag is one it defines (``--help`` after the arguments exits 1 on an undefined flag), and
    create-symlinks run for real makes the links. The stand-in defines exactly the real hook's flags."""
    with SandboxNode(profile=PROFILE) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)

        async def body() -> list[dict[str, Any]]:
            async with running(node.config()) as (_plugin, kubelet):
                ref = _claim(node, "gpu")
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                hooks: list[dict[str, Any]] = _spec(node, ref.uid)["containerEdits"]["hooks"]
                return hooks

        hooks = asyncio.run(body())
    ctk = tmp_path / "nvidia-ctk"
    shutil.copyfile(NVIDIA_CTK, ctk)
    ctk.chmod(0o755)
    for hook in hooks:
        argv = ["hook", *hook["args"][1:], "--help"]
        done = subprocess.run([str(ctk), *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, (argv, done.stderr)
    bundle = _bundle(tmp_path)
    [links] = [h for h in hooks if h["args"][1] == "create-symlinks"]
    real = _run_hook({**links, "args": ["nvidia-ctk", "hook", *links["args"][1:]]}, bundle, binary=ctk)
    assert real.returncode == 0, real.stderr
    assert (bundle / "rootfs/usr/lib/x86_64-linux-gnu/libcuda.so").readlink() == Path("libcuda.so.1")
    for subcommand, flags in nvidia_cdi_hook.SUBCOMMANDS.items():
        text = subprocess.run([str(ctk), "hook", subcommand, "--help"], capture_output=True, text=True,
                              timeout=60).stdout
        options = text.split("OPTIONS:")[1].split("GLOBAL OPTIONS:")[0]
        real_flags = set(re.findall(r"^\s+--([a-z-]+)", options, flags=re.MULTILINE)) - {"help"}
        assert real_flags == set(flags), subcommand
