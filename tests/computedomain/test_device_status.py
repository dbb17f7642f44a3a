"""KEP-4817 device status of the compute-domain plugin: a prepared IMEX channel's ComputeDomain and clique are
published in ``ResourceClaim.status.devices[].data`` (the API emulator over HTTP, the plugin over gRPC)."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes_validate
import pytest

from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    DRIVER,
    GB200_CLIQUE,
    cd_config,
    running,
    seed_claim,
    seed_clique,
    seed_domain,
    wait_for,
    write_imex_proc,
)


@pytest.fixture
def node() -> Any:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def test_a_prepared_channel_publishes_its_compute_domain_and_unprepare_removes_it(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api, "cd-status")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-status", uid)

    def published() -> list[dict[str, Any]]:
        stored = api.get("ResourceClaim", "wl-status", "default")
        return list((stored or {}).get("status", {}).get("devices") or [])

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
