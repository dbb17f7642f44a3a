"""KEP-4817 device status of the compute-domain plugin: a prepared IMEX channel's and IMEX daemon's ComputeDomain
and clique are published in ``ResourceClaim.status.devices[].data`` (the API emulator over HTTP, the plugin over
gRPC), also when the plugin died before its write."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes_validate
import pytest

from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    DRIVER,
    DRIVER_NAMESPACE,
    GB200_CLIQUE,
    cd_config,
    plugin_env,
    running,
    seed_claim,
    seed_clique,
    seed_domain,
    wait_for,
    write_imex_proc,
)
from tests.plugin.test_device_status import prepare_then_die_before_the_status_write


@pytest.fixture
def node() -> Any:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def status_devices(node: SandboxNode, name: str, namespace: str = "default") -> list[dict[str, Any]]:
    """The claim's ``status.devices`` as stored in the API emulator."""
    assert node.api is not None
    stored = node.api.get("ResourceClaim", name, namespace)
    return list((stored or {}).get("status", {}).get("devices") or [])


def test_a_prepared_channel_publishes_its_compute_domain_and_unprepare_removes_it(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api, "cd-status")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-status", uid)

    def published() -> list[dict[str, Any]]:
        return status_devices(node, "wl-status")

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            assert (await conn.prepare([ref]))[ref.uid].ok
            await wait_for(lambda: bool(published()))
            [entry] = published()
            assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, node.node_name, "channel-0")
            assert entry["data"] == {"computeDomain": {"namespace": "default", "name": "cd-status", "uid": uid},
                                     "clique": GB200_CLIQUE, "channels": [0]}
            kubernetes_validate.validate(api.get("ResourceClaim", "wl-status", "default"), "1.34", strict=True)
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            await wait_for(lambda: not published())

    asyncio.run(body())


def test_a_prepared_imex_daemon_publishes_its_compute_domain_and_unprepare_removes_it(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api, "cd-daemon")
    seed_clique(api, uid, node.node_name, "NotReady")  # the daemon claim does not wait for its own readiness
    ref = seed_claim(api, "daemon", uid, namespace=DRIVER_NAMESPACE, kind="daemon")

    def published() -> list[dict[str, Any]]:
        return status_devices(node, "daemon", DRIVER_NAMESPACE)

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
            await wait_for(lambda: bool(published()))
            [entry] = published()
            assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, node.node_name, "daemon-0")
            assert entry["data"] == {"computeDomain": {"namespace": "default", "name": "cd-daemon", "uid": uid},
                                     "clique": GB200_CLIQUE}
            assert [(c["type"], c["status"]) for c in entry["conditions"]] == [("Ready", "True")]
            kubernetes_validate.validate(api.get("ResourceClaim", "daemon", DRIVER_NAMESPACE), "1.34", strict=True)
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            await wait_for(lambda: not published())

    asyncio.run(body())


def test_a_channel_whose_status_write_died_with_the_plugin_gets_its_entry_at_the_next_start(
        node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api, "cd-restart")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-restart", uid)
    config = cd_config(node)
    asyncio.run(prepare_then_die_before_the_status_write(
        "compute-domain-kubelet-plugin", plugin_env(node), config.kubelet_registrar_directory_path, DRIVER, ref))
    assert status_devices(node, "wl-restart") == []  # prepared, and its write lost

    async def restart() -> None:
        async with running(config) as (_plugin, _conn):
            await wait_for(lambda: bool(status_devices(node, "wl-restart")))
            [entry] = status_devices(node, "wl-restart")
            assert entry["device"] == "channel-0"
            assert entry["data"] == {"computeDomain": {"namespace": "default", "name": "cd-restart", "uid": uid},
                                     "clique": GB200_CLIQUE, "channels": [0]}

    asyncio.run(restart())
