"""The compute-domain kubelet plugin end to end: the real plugin over gRPC (kubelet emulator), the API emulator over
HTTP with seeded ComputeDomains and ComputeDomainCliques, the mock NVML with the GB200 NVL72 node profile."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dradriver.sandbox.node import SandboxNode
from tests.cdi.helpers import validate
from tests.computedomain.cdplugin_helpers import (
    CHANNEL_MAJOR,
    DRIVER,
    GB200_CLIQUE,
    cd_config,
    node_label,
    running,
    seed_claim,
    seed_clique,
    seed_domain,
    spec_path,
    write_imex_proc,
)

KIND = "k8s.compute-domain.nvidia.com/claim"


@pytest.fixture
def node() -> Any:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def test_single_channel_claim_waits_for_ready_daemon_and_gets_channel_0(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-0", uid)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            assert plugin.clique_id == GB200_CLIQUE
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
            (device,) = got.devices
            assert device.device_name == "channel-0" and device.pool_name == node.node_name
            assert device.cdi_device_ids == (f"{KIND}={ref.uid}-channel-0",)
            spec = validate(spec_path(node, ref.uid).read_bytes())
            assert [d["name"] for d in spec["devices"]] == [f"{ref.uid}-channel-0"]
            (node_entry,) = spec["devices"][0]["containerEdits"]["deviceNodes"]
            assert node_entry["path"] == "/dev/nvidia-caps-imex-channels/channel0"
            assert node_entry["type"] == "c" and node_entry["major"] == CHANNEL_MAJOR
            assert node_label(api) == uid
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            assert node_label(api) is None
            assert not spec_path(node, ref.uid).exists()

    asyncio.run(body())
