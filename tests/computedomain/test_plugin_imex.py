"""The compute-domain plugin and the node's IMEX daemon: a driver-managed start refused beside a running host
``nvidia-imex.service`` (seen in the driver root the plugin mounts), and a waiting workload prepare that reports
the daemon's whole failure."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.app.computedomain import start_compute_domain_plugin
from dradriver.errors import FlagError
from dradriver.host import imexchannels
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    DRIVER_NAMESPACE,
    GB200_CLIQUE,
    cd_config,
    running,
    seed_claim,
    seed_clique,
    seed_domain,
    write_imex_proc,
)

UNIT = "nvidia-imex.service"


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def _host_service(root: Path, *, active: bool, enabled: bool) -> None:
    """What systemd leaves in the host's root for an enabled and/or running ``nvidia-imex.service``."""
    if active:
        units = root / "run" / "systemd" / "units"
        units.mkdir(parents=True, exist_ok=True)
        os.symlink("5f1c0a0e9d8b4c3fa2e1d0c9b8a7f6e5", units / f"invocation:{UNIT}")
    if enabled:
        wants = root / "etc" / "systemd" / "system" / "multi-user.target.wants"
        wants.mkdir(parents=True, exist_ok=True)
        os.symlink(f"/usr/lib/systemd/system/{UNIT}", wants / UNIT)


def test_driver_managed_start_is_refused_beside_a_running_host_imex_service(node: SandboxNode) -> None:
    _host_service(node.driver_root, active=True, enabled=True)
    config = cd_config(node)
    with pytest.raises(FlagError) as info:
        asyncio.run(start_compute_domain_plugin(config))
    text = str(info.value)
    assert f"the host runs {UNIT} (systemd: /run/systemd/units/invocation:{UNIT}" in text
    assert f"systemctl disable --now {UNIT}" in text
    assert "IMEX_MODE=hostManaged" in text and "HostManagedIMEXDaemon=true" in text
    assert not config.plugin_dir.exists() and not list(config.cdi_root.iterdir())  # refused before touching the host


def test_an_enabled_but_stopped_host_imex_service_is_a_warning(node: SandboxNode,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    _host_service(node.driver_root, active=False, enabled=True)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, _conn):
            assert plugin.clique_id

    with caplog.at_level(logging.WARNING, logger="dradriver.app.computedomain"):
        asyncio.run(body())
    assert any(f"{UNIT} is enabled on the host (/etc/systemd/system/multi-user.target.wants/{UNIT})" in r.message
               for r in caplog.records)


def test_a_waiting_prepare_reports_the_daemons_whole_failure(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)
    directory = imexchannels.domain_dir(cd_config(node).plugin_dir, uid)
    directory.mkdir(parents=True)
    cause = ("cannot start an IMEX session: the fabric-imex-mgmt capability /dev/nvidia-caps/nvidia-cap1 is in use "
             "by another IMEX daemon (pid 1234); one nvidia-imex runs per node")
    reason = (f"nvidia-imex (pid 77) exited with status 1 after 0.2 s (5 failure(s) in a row; next start in 16 s): "
              f"{cause}")
    assert len(reason) > 200  # the record used to keep 200 characters: the cause ended mid-word
    # As compute-domain-daemon run writes it when its nvidia-imex exits.
    assert not imexchannels.record_readiness(directory, node_name=node.node_name, pod_uid="pod-1", pod_ip="10.0.0.1",
                                             ready=False, detail=reason)

    async def body() -> None:
        async with running(cd_config(node, prepare_deadline_seconds=1)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert not got.ok and reason in got.error

    asyncio.run(body())


def test_without_a_readiness_record_the_prepare_error_carries_the_entrys_failure_condition(node: SandboxNode) -> None:
    """A daemon that writes no readiness record (NVIDIA's image, or another host's view): the clique entry's
    condition, which the daemon writes and the controller copies into the domain's status, is in the error."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    clique = api.get("ComputeDomainClique", f"{uid}.{GB200_CLIQUE}", DRIVER_NAMESPACE)
    assert clique is not None
    message = ("nvidia-imex (pid 9) exited with status 1 after 0.1 s (3 failure(s) in a row; next start in 4 s): "
               "cannot start an IMEX session: the fabric-imex-mgmt capability /dev/nvidia-caps/nvidia-cap1 is in "
               "use by another IMEX daemon (pid 1234); one nvidia-imex runs per node")
    clique["daemons"][0]["conditions"] = [{"type": "IMEXDaemonRunning", "status": "False", "reason": "IMEXDaemonFailed",
                                           "message": message, "lastTransitionTime": "2026-12-04T21:00:00Z"}]
    api.update(clique)
    ref = seed_claim(api, "wl-0", uid)

    async def body() -> None:
        async with running(cd_config(node, prepare_deadline_seconds=1)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert not got.ok and f"is not Ready; IMEXDaemonFailed: {message}" in got.error

    asyncio.run(body())
