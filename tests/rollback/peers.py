"""Both drivers' plugins as processes on one sandbox node, driven over the kubelet's gRPC wire, for the tests that
hand a node from one to the other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.claims import ClaimRef
from dradriver.sandbox.cluster import plugin_environment
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.nvidiapeer import nvidia_side, peer_missing, peer_paths
from tests.plugin.conftest import claim_object, ref_of, result, set_allocation

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.nvidia.com"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
NVIDIA_A100 = "mock-nvml-config-a100.yaml"
"""NVIDIA's mock node matching dradriver's ``dgx-a100`` profile (8 A100 GPUs; dradriver's has MIG on two)."""

needs_nvidia = pytest.mark.skipif(bool(peer_missing()), reason=peer_missing() or "NVIDIA's plugin can run")


def claim(node: SandboxNode, name: str, device: str, **status: Any) -> ClaimRef:
    """A claim allocated ``device`` of this node (extra ``status`` fields such as ``reservedFor`` kept)."""
    assert node.api is not None
    ref = ref_of(set_allocation(node, node.api.create(claim_object(name)), [result(device, pool=node.node_name)]))
    if status:
        stored = node.api.get("ResourceClaim", ref.name, ref.namespace)
        assert stored is not None
        stored["status"].update(status)
        node.api.update(stored, subresource="status")
    return ref


@contextlib.contextmanager
def process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A plugin process logging to ``log``; killed on exit if still running."""
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def dradriver_process(node: SandboxNode, log: Path, **config: Any) -> contextlib.AbstractContextManager[
        subprocess.Popen[bytes]]:
    """dradriver's ``gpu-kubelet-plugin`` as its own process on ``node``'s directories (so it can be SIGKILLed)."""
    env = dict(os.environ)
    env.update(plugin_environment(node.config(log_level="info", **config)))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return process([sys.executable, "-m", "dradriver", "gpu-kubelet-plugin"], env, log)


@contextlib.contextmanager
def nvidia_process(node: SandboxNode, work: Path, profile: str = NVIDIA_A100, *args: str,
                   registrar: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """NVIDIA's ``gpu-kubelet-plugin`` on ``node``'s plugin directory and CDI root, with flags ``args`` added, in
    the registrar directory ``registrar`` (default: its own, so a kubelet emulator of its own finds it); yields
    it and its registrar."""
    config = node.config()
    plugin, mock_nvml = peer_paths()
    assert plugin is not None and mock_nvml is not None, peer_missing()
    side = nvidia_side(node, plugin, mock_nvml, work, cdi_root=Path(config.cdi_root),
                       plugins_dir=Path(config.kubelet_plugins_directory_path), profile=profile,
                       extra_args=args, registrar=registrar)
    try:
        with process(side.argv, side.env, work / "nvidia.log") as proc:
            yield proc, side.registrar
    finally:
        if registrar is None and not side.registrar.is_relative_to(work):  # a short one under /tmp (socket path)
            shutil.rmtree(side.registrar, ignore_errors=True)


@contextlib.asynccontextmanager
async def kubelet_for(registrar: Path, proc: subprocess.Popen[bytes], log: Path) -> AsyncIterator[Any]:
    """The kubelet's connection to the plugin registered in ``registrar`` (fails with the plugin's log if it
    exits first)."""
    async with KubeletEmulator(registrar) as kubelet:
        waiter = asyncio.ensure_future(kubelet.wait_for_plugin(DRIVER, timeout=60))
        while not waiter.done():
            if proc.poll() is not None:
                waiter.cancel()
                raise AssertionError(f"plugin exited {proc.returncode} before registering: "
                                     f"{log.read_text(errors='replace')[-3000:]}")
            await asyncio.sleep(0.05)
        yield waiter.result()


def stop(proc: subprocess.Popen[bytes], how: str) -> None:
    """Stop a plugin gracefully (SIGTERM, as the kubelet's pod deletion does) or by SIGKILL."""
    proc.send_signal(signal.SIGTERM if how == "graceful" else signal.SIGKILL)
    proc.wait(30)


def switched_node(node: SandboxNode) -> tuple[Any, Path, Path]:
    """Ready ``node`` for a switch between the drivers (:func:`use_this_boot`); its config, CDI root and
    ``gpu.nvidia.com`` plugin directory (where both keep ``checkpoint.json``)."""
    use_this_boot(node)
    config = node.config()
    return config, Path(config.cdi_root), Path(config.kubelet_plugins_directory_path) / DRIVER


def use_this_boot(node: SandboxNode) -> None:
    """Give the sandbox node this host's boot ID: NVIDIA's plugin reads the host's own and drops a checkpoint of
    another boot."""
    node.set_boot_id(BOOT_ID.read_text().strip())


async def prepared_by_nvidia(node: SandboxNode, work: Path, refs: list[ClaimRef], *args: str) -> None:
    """NVIDIA's plugin (flags ``args`` added) prepares ``refs`` without an error, then stops."""
    with nvidia_process(node, work, NVIDIA_A100, *args) as (proc, registrar):
        async with kubelet_for(registrar, proc, work / "nvidia.log") as kubelet:
            answers = await kubelet.prepare(refs)
            assert [a.error for a in answers.values()] == [""] * len(refs), answers
