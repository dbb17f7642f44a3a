"""The compute-domain plugin restarted in another IMEX mode with claims prepared: their unprepare follows the kind
stored with each claim, never the mode (the daemon preparer is not registered for prepares in host-managed mode,
yet it still undoes what it recorded). Real gRPC, the API emulator over HTTP."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from dradriver.domain.featuregates import HOST_MANAGED_IMEX_DAEMON
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    DRIVER_NAMESPACE,
    cd_config,
    running,
    seed_claim,
    seed_domain,
    write_imex_proc,
)


@pytest.fixture
def node() -> Any:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def test_a_daemon_claim_is_unprepared_after_a_restart_in_host_managed_mode(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    daemon = seed_claim(api, "daemon", uid, namespace=DRIVER_NAMESPACE, kind="daemon")
    base = cd_config(node)
    host_managed = replace(base, imex_mode="hostManaged", imex_host_socket_path="/run/imex/ctl.sock",
                           feature_gates=base.feature_gates.with_gates(**{HOST_MANAGED_IMEX_DAEMON: True}))

    async def body() -> None:
        async with running(base) as (_plugin, conn):
            got = (await conn.prepare([daemon]))[daemon.uid]
            assert got.ok, got.error
        async with running(host_managed) as (plugin, conn):
            assert (await conn.unprepare([daemon]))[daemon.uid] == ""
            assert plugin.state.get(daemon.uid) is None

    asyncio.run(body())
