"""Helpers for the compute-domain kubelet plugin tests: seeded ComputeDomains, cliques and claims in the API emulator,
the node's IMEX procfs files, and the running plugin behind the kubelet emulator (real gRPC)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dradriver.app.computedomain import ComputeDomainPlugin, start_compute_domain_plugin
from dradriver.config import PluginConfig
from dradriver.domain.claims import ClaimRef
from dradriver.domain.computedomains import API_GROUP_VERSION, LABEL_COMPUTE_DOMAIN
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SandboxNode

DRIVER = "compute-domain.nvidia.com"
DRIVER_NAMESPACE = "nvidia-dra-driver"
GB200_CLIQUE = "abc9829a-d4c8-491c-8da5-ad28fb34876b.2"
CHANNEL_MAJOR = 234  # the sandbox's /proc/devices
CAPS_MAJOR = 511


def write_imex_proc(node: SandboxNode, *, channels: int | None = 2048, fabric_minor: int | None = 7) -> None:
    """``proc/driver/nvidia/params`` (``ImexChannelCount``) and ``capabilities/fabric-imex-mgmt`` as a GB200 node
    has them; ``None`` leaves a file out."""
    nvidia = node.root / "proc" / "driver" / "nvidia"
    (nvidia / "capabilities").mkdir(parents=True, exist_ok=True)
    if channels is not None:
        (nvidia / "params").write_text(f"ResmanDebugLevel: 4294967295\nImexChannelCount: {channels}\n"
                                       "CreateImexChannel0: 0\n")
    if fabric_minor is not None:
        (nvidia / "capabilities" / "fabric-imex-mgmt").write_text(f"DeviceFileMinor: {fabric_minor}\n"
                                                                  "DeviceFileMode: 256\nDeviceFileModify: 1\n")


def cd_config(node: SandboxNode, **overrides: Any) -> PluginConfig:
    """The compute-domain plugin's configuration on ``node`` (driver namespace :data:`DRIVER_NAMESPACE`)."""
    return replace(node.config(driver_name=DRIVER, namespace=DRIVER_NAMESPACE), **overrides)


def seed_domain(api: ApiServerEmulator, name: str = "cd-1", namespace: str = "default", *,
                mode: str = "Single") -> str:
    """Create a ComputeDomain; returns its UID."""
    obj = api.create({"apiVersion": API_GROUP_VERSION, "kind": "ComputeDomain",
                      "metadata": {"name": name, "namespace": namespace},
                      "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"},
                                                          "allocationMode": mode}}})
    return str(obj["metadata"]["uid"])


def seed_clique(api: ApiServerEmulator, cd_uid: str, node_name: str, status: str, *,
                clique: str = GB200_CLIQUE) -> None:
    """Create or update the ComputeDomainClique ``<cdUID>.<cliqueID>`` with ``node_name``'s entry in ``status``."""
    name = f"{cd_uid}.{clique}"
    entry = {"nodeName": node_name, "ipAddress": "10.0.0.1", "cliqueID": clique, "index": 0, "status": status}
    stored = api.get("ComputeDomainClique", name, DRIVER_NAMESPACE)
    if stored is None:
        api.create({"apiVersion": API_GROUP_VERSION, "kind": "ComputeDomainClique",
                    "metadata": {"name": name, "namespace": DRIVER_NAMESPACE,
                                 "labels": {LABEL_COMPUTE_DOMAIN: cd_uid}},
                    "daemons": [entry]})
        return
    stored["daemons"] = [entry]
    api.update(stored)


def seed_claim(api: ApiServerEmulator, name: str, cd_uid: str, *, namespace: str = "default", kind: str = "channel",
               mode: str | None = "Single", device: str = "", pool: str = "gpu-node-1",
               config: dict[str, Any] | None = None) -> ClaimRef:
    """An allocated claim for ``compute-domain.nvidia.com`` with its opaque config (as the controller's
    templates generate them); returns the kubelet's reference."""
    request = "channel" if kind == "channel" else "daemon"
    device = device or ("channel-0" if kind == "channel" else "daemon-0")
    if config is None:
        config = {"apiVersion": API_GROUP_VERSION, "domainID": cd_uid,
                  "kind": "ComputeDomainChannelConfig" if kind == "channel" else "ComputeDomainDaemonConfig"}
        if kind == "channel" and mode is not None:
            config["allocationMode"] = mode
    claim = api.create({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": request, "exactly": {
            "deviceClassName": f"compute-domain-{'default-channel' if kind == 'channel' else 'daemon'}.nvidia.com"}}]}},
    })
    claim.setdefault("status", {})["allocation"] = {"devices": {
        "results": [{"request": request, "driver": DRIVER, "pool": pool, "device": device}],
        "config": [{"source": "FromClaim", "requests": [request],
                    "opaque": {"driver": DRIVER, "parameters": config}}],
    }}
    stored = api.update(claim, subresource="status")
    meta = stored["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def node_label(api: ApiServerEmulator, node: str = "gpu-node-1") -> str | None:
    obj = api.get("Node", node)
    assert obj is not None
    return ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_COMPUTE_DOMAIN)


async def prepare_until_labelled(conn: Any, api: ApiServerEmulator, ref: Any, cd_uid: str,
                                 timeout: float = 30.0) -> asyncio.Task[Any]:
    """Send ``ref``'s prepare and wait until it has labelled the node for ``cd_uid`` (it is then waiting for the
    domain); the pending prepare. A prepare answered before the plugin process has read its driver part ("not read
    yet": the plugin registers first, so unprepares are served early) is sent again, as the kubelet retries."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = asyncio.create_task(conn.prepare([ref]))
    while node_label(api) != cd_uid:
        if pending.done():
            error = pending.result()[ref.uid].error
            assert "not read yet" in error, error
            pending = asyncio.create_task(conn.prepare([ref]))
        if loop.time() > deadline:
            raise AssertionError(f"the prepare of {ref} did not label the node in {timeout} s")
        await asyncio.sleep(0.02)
    return pending


def spec_path(node: SandboxNode, uid: str) -> Path:
    return node.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{uid}.yaml"


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(config: PluginConfig, *, clock: Callable[[], float] = time.time,
                  ) -> AsyncIterator[tuple[ComputeDomainPlugin, PluginConnection]]:
    """Start the plugin (``clock``: its wall clock for the aborted-prepare TTL), register it through the kubelet
    emulator, stop both afterwards."""
    plugin = await start_compute_domain_plugin(config, clock=clock)
    try:
        await wait_for(lambda: plugin.publisher.last_result is not None)
        async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
            connection = await kubelet.wait_for_plugin(DRIVER, timeout=10)
            yield plugin, connection
    finally:
        await plugin.stop()


def plugin_env(node: SandboxNode) -> dict[str, str]:
    """The environment of a ``compute-domain-kubelet-plugin`` process on ``node`` (its flags' variables)."""
    config = cd_config(node)
    env = dict(os.environ)
    env.update(
        NODE_NAME=config.node_name, KUBECONFIG=config.kubeconfig, CDI_ROOT=str(config.cdi_root),
        KUBELET_REGISTRAR_DIRECTORY_PATH=str(config.kubelet_registrar_directory_path),
        KUBELET_PLUGINS_DIRECTORY_PATH=str(config.kubelet_plugins_directory_path),
        DEV_ROOT=str(config.dev_root), SYSFS_ROOT=str(config.sysfs_root), PROC_ROOT=str(config.proc_root),
        DRIVER_ROOT_CTR_PATH=str(config.container_driver_root), DRADRIVER_MOCK_PROFILE=config.mock_profile,
        NAMESPACE=DRIVER_NAMESPACE, LOG_LEVEL="warning",
    )
    return env
