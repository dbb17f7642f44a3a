"""The device-plugin guard at plugin start: no GPUs published next to the NVIDIA device plugin."""

from __future__ import annotations

import asyncio
import socket

from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import running, wait_for


def _fake_device_plugin(sandbox: SandboxNode) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sandbox.root / "device-plugins" / "nvidia-gpu.sock"))
    sock.listen(1)
    return sock


def _published_devices(sandbox: SandboxNode) -> list[str]:
    assert sandbox.api is not None
    return [d["name"] for s in sandbox.api.objects("ResourceSlice") for d in s["spec"].get("devices") or []]


def test_device_plugin_socket_means_no_gpus_and_an_event(sandbox: SandboxNode) -> None:
    sock = _fake_device_plugin(sandbox)

    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (plugin, _):
            assert plugin.guard_verdict.refuse
            await wait_for(lambda: bool(sandbox.api and sandbox.api.objects("ResourceSlice")))
            assert _published_devices(sandbox) == []  # an empty pool, not a missing one
        events = [e for e in sandbox.api.objects("Event") if e.get("reason") == "DevicePluginDetected"]
        assert events and "nvidia-gpu.sock" in events[0]["message"]

    try:
        asyncio.run(body())
    finally:
        sock.close()


def test_override_publishes_gpus_despite_the_device_plugin(sandbox: SandboxNode) -> None:
    sock = _fake_device_plugin(sandbox)

    async def body() -> None:
        async with running(sandbox.config(ignore_device_plugin=True)) as (plugin, _):
            assert not plugin.guard_verdict.refuse
            await wait_for(lambda: len(_published_devices(sandbox)) == 8)

    try:
        asyncio.run(body())
    finally:
        sock.close()


def test_node_allocatable_nvidia_gpu_refuses() -> None:
    with SandboxNode(profile="dgx-h100", node_allocatable={"cpu": "8", "nvidia.com/gpu": "8"}) as sandbox:

        async def body() -> None:
            async with running(sandbox.config()) as (plugin, _):
                assert plugin.guard_verdict.refuse
                assert "nvidia.com/gpu=8" in plugin.guard_verdict.reason

        asyncio.run(body())
