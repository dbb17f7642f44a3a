"""Helpers for end-to-end kubelet-plugin tests: claims, allocations, the running plugin (``sandbox``: root conftest)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from dradriver.app import GpuPlugin, start_plugin
from dradriver.config import PluginConfig
from dradriver.domain.claims import ClaimRef
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SandboxNode
from tests import factories

SEED_SELECTOR = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"


def claim_object(name: str, *, selector: str | None = None, namespace: str = "default",
                 device_class: str = "gpu.nvidia.com", count: int = 1) -> dict[str, Any]:
    """A ResourceClaim asking for ``count`` devices of ``device_class`` (optionally with a CEL selector)."""
    exactly: dict[str, Any] = {"deviceClassName": device_class, "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def ref_of(claim: dict[str, Any]) -> ClaimRef:
    """The kubelet's reference to a stored claim."""
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def set_allocation(sandbox: SandboxNode, claim: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``status.allocation`` with explicit results, as a scheduler would."""
    assert sandbox.api is not None
    stored = sandbox.api.get("ResourceClaim", claim["metadata"]["name"], claim["metadata"]["namespace"])
    assert stored is not None
    stored.setdefault("status", {})["allocation"] = {"devices": {"results": results}}
    return sandbox.api.update(stored, subresource="status")


def result(device: str, *, pool: str = "gpu-node-1", driver: str = "gpu.nvidia.com", request: str = "gpu",
           admin: bool = False) -> dict[str, Any]:
    """One ``status.allocation.devices.results[]`` entry."""
    out: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if admin:
        out["adminAccess"] = True
    return out


@contextlib.asynccontextmanager
async def running(config: PluginConfig) -> AsyncIterator[tuple[GpuPlugin, PluginConnection]]:
    """Start the plugin, register it through the kubelet emulator, stop both afterwards."""
    plugin = await start_plugin(config)
    try:
        await wait_for(lambda: plugin.publisher.last_result is not None)
        async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
            connection = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=10)
            yield plugin, connection
    finally:
        await plugin.stop()


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    """Poll ``predicate()`` until true or fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
def mig_node() -> Iterator[SandboxNode]:
    """A DGX H100 sandbox (MIG off everywhere) whose mock NVML keeps MIG state and capability files."""
    with SandboxNode(profile="dgx-h100", mig_state=True) as node:
        assert node.api is not None
        node.api.create(factories.DEVICE_CLASS)
        yield node
