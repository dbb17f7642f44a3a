"""The compute-domain plugin's aborted prepares, host-managed IMEX, and a SIGKILL in the middle of a channel
prepare followed by a restart."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dradriver.app.computedomain import start_compute_domain_plugin
from dradriver.domain.featuregates import HOST_MANAGED_IMEX_DAEMON
from dradriver.host.claimstate import ClaimPhase, ClaimRecord
from dradriver.kubeletplugin.payload import read_payload
from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError
from dradriver.sandbox.node import SandboxNode
from tests.cdi.helpers import validate
from tests.computedomain.cdplugin_helpers import (
    DRIVER,
    DRIVER_NAMESPACE,
    cd_config,
    node_label,
    plugin_env,
    prepare_until_labelled,
    running,
    seed_claim,
    seed_clique,
    seed_domain,
    spec_path,
    write_imex_proc,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def node() -> Any:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def test_unprepare_during_the_wait_aborts_the_prepare_and_a_late_prepare_is_stale(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            pending = asyncio.create_task(conn.prepare([ref]))
            while node_label(api) != uid:
                await asyncio.sleep(0.02)
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            got = (await pending)[ref.uid]
            assert "unprepared while this prepare was in flight" in got.error
            assert node_label(api) is None  # the waiting attempts' label went with the unprepare
            late = (await conn.prepare([ref]))[ref.uid]
            assert "stale prepare" in late.error and "PrepareAborted" in late.error
            _assert_aborted_mark(plugin.state.get(ref.uid))
            assert not spec_path(node, ref.uid).exists()
            # unpreparing an aborted claim again is a no-op that keeps the mark (NVIDIA's)
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            _assert_aborted_mark(plugin.state.get(ref.uid))
            assert plugin.runner.forget_expired_aborts() == []  # within the TTL
            plugin.runner.clock = lambda: time.time() + 91.0  # the 90 s have passed
            assert plugin.runner.forget_expired_aborts() == [ref.uid]  # the periodic cleanup's step
            assert plugin.state.get(ref.uid) is None
            seed_clique(api, uid, node.node_name, "Ready")
            assert (await conn.prepare([ref]))[ref.uid].ok

    asyncio.run(body())


def _assert_aborted_mark(record: ClaimRecord | None) -> None:
    assert record is not None and record.phase is ClaimPhase.PREPARE_STARTED and record.devices == ()
    stored = read_payload(record.payload)
    assert stored.aborted_at is not None and abs(time.time() - stored.aborted_at) < 90 and stored.undo == ()


def test_aborted_mark_refuses_only_the_same_allocation(node: SandboxNode) -> None:
    """NVIDIA refuses a PrepareAborted claim only when its status is the one checkpointed: a claim whose allocation
    changed (here its opaque config) is prepared within the TTL."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            pending = asyncio.create_task(conn.prepare([ref]))
            while node_label(api) != uid:
                await asyncio.sleep(0.02)
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            await pending
            seed_clique(api, uid, node.node_name, "Ready")
            assert "stale prepare" in (await conn.prepare([ref]))[ref.uid].error
            claim = api.get("ResourceClaim", ref.name, ref.namespace)
            assert claim is not None
            claim["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"] = "All"
            api.update(claim, subresource="status")
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
            record = plugin.state.get(ref.uid)
            assert record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED
            assert (await conn.unprepare([ref]))[ref.uid] == ""

    asyncio.run(body())


@pytest.mark.slow
def test_aborted_mark_survives_a_sigkill_and_restart_until_its_ttl(node: SandboxNode) -> None:
    """PrepareAborted is in the claim state (NVIDIA's checkpoint): the plugin process is SIGKILLed right after the
    aborting unprepare; restarted, it refuses the claim's prepare as stale; restarted again 91 s later (its clock),
    the expired mark is deleted at start and the prepare succeeds."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)
    config = cd_config(node)

    async def abort_then_kill() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "compute-domain-kubelet-plugin", env=plugin_env(node),
            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                conn = await kubelet.wait_for_plugin(DRIVER, timeout=30)
                pending = await prepare_until_labelled(conn, api, ref, uid)
                assert (await conn.unprepare([ref]))[ref.uid] == ""
                proc.send_signal(signal.SIGKILL)
                try:
                    got = (await pending)[ref.uid]
                    assert "unprepared while this prepare was in flight" in got.error
                except KubeletError:
                    pass  # the kill came first
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    async def restart(clock: Any) -> None:
        seed_clique(api, uid, node.node_name, "Ready")
        async with running(config, clock=clock) as (plugin, conn):
            if clock is time.time:
                assert plugin.recovery.aborted_kept == (ref.uid,) and plugin.recovery.aborted_expired == ()
                refused = (await conn.prepare([ref]))[ref.uid]
                assert "stale prepare" in refused.error and "PrepareAborted" in refused.error
                _assert_aborted_mark(plugin.state.get(ref.uid))
            else:
                assert plugin.recovery.aborted_expired == (ref.uid,) and plugin.recovery.aborted_kept == ()
                assert plugin.state.get(ref.uid) is None
                got = (await conn.prepare([ref]))[ref.uid]
                assert got.ok, got.error
                assert (await conn.unprepare([ref]))[ref.uid] == ""

    asyncio.run(abort_then_kill())
    asyncio.run(restart(time.time))
    asyncio.run(restart(lambda: time.time() + 91.0))


IMEX_CTL = """#!/bin/sh
# Test fixture answering like `nvidia-imex-ctl -q --u=<socket>`: READY once the file 'ready' exists beside it.
here=$(dirname "$0")
[ "$1" = "-q" ] || { echo "unexpected arguments: $*"; exit 2; }
echo "$2" > "$here/asked"
if [ -f "$here/ready" ]; then echo READY; else echo "UNAVAILABLE"; fi
"""


def test_host_managed_mode_gives_the_allocated_channel_after_imex_ctl_says_ready(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    bin_dir = node.driver_root / "usr" / "bin"
    (bin_dir / "nvidia-imex-ctl").write_text(IMEX_CTL)
    (bin_dir / "nvidia-imex-ctl").chmod(0o755)
    uid = seed_domain(api)
    ref = seed_claim(api, "wl-3", uid, device="channel-3")
    daemon = seed_claim(api, "daemon", uid, namespace=DRIVER_NAMESPACE, kind="daemon")
    base = cd_config(node, prepare_deadline_seconds=2)
    config = replace(base, imex_mode="hostManaged", imex_host_socket_path="/run/imex/ctl.sock",
                     feature_gates=base.feature_gates.with_gates(**{HOST_MANAGED_IMEX_DAEMON: True}))

    async def body() -> None:
        async with running(config) as (_plugin, conn):
            (published,) = [s for s in api.objects("ResourceSlice") if s["spec"]["driver"] == DRIVER]
            assert [d["name"] for d in published["spec"]["devices"]] == ["channel-0"]  # no daemon-0
            waiting = (await conn.prepare([ref]))[ref.uid]
            assert "the host's IMEX daemon is not ready (nvidia-imex-ctl -q: UNAVAILABLE)" in waiting.error
            assert (bin_dir / "asked").read_text().strip() == "--u=/run/imex/ctl.sock"
            (bin_dir / "ready").touch()
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
            spec = validate(spec_path(node, ref.uid).read_bytes())
            (entry,) = spec["devices"]
            assert entry["name"] == f"{ref.uid}-channel-3"
            assert entry["containerEdits"]["deviceNodes"][0]["minor"] == 3
            assert node_label(api) is None  # no labels in host-managed mode
            refused = (await conn.prepare([daemon]))[daemon.uid]
            assert "device 'daemon-0' does not exist" in refused.error
            assert (await conn.unprepare([ref]))[ref.uid] == ""

    asyncio.run(body())


def test_a_daemon_claim_is_unprepared_after_a_restart_in_host_managed_mode(node: SandboxNode) -> None:
    """The IMEX mode changed with a daemon claim prepared: its unprepare follows the kind stored with it (the daemon
    preparer prepares nothing in host-managed mode, yet still undoes what it recorded)."""
    api = node.api
    assert api is not None
    daemon = seed_claim(api, "daemon", seed_domain(api), namespace=DRIVER_NAMESPACE, kind="daemon")
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


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_channel_prepare_then_restart(node: SandboxNode) -> None:
    """The plugin process is killed while a channel prepare is in progress (node labelled, waiting for the
    daemon); the restarted plugin has no half-prepared claim and no spec, and prepares the claim once the daemon is
    Ready. A second kill lands right after the claim-state write of a prepare (random point in the apply)."""
    api = node.api
    assert api is not None
    uid = seed_domain(api, mode="All")
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-all", uid, mode="All")
    config = cd_config(node)

    async def kill_while_waiting() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "compute-domain-kubelet-plugin", env=plugin_env(node),
            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                conn = await kubelet.wait_for_plugin(DRIVER, timeout=30)
                pending = await prepare_until_labelled(conn, api, ref, uid)
                proc.send_signal(signal.SIGKILL)
                with pytest.raises(KubeletError):
                    await pending
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    async def restart_and_prepare() -> None:
        plugin = await start_compute_domain_plugin(config)
        try:
            record = plugin.state.get(ref.uid)
            assert record is None or record.phase is not ClaimPhase.PREPARE_STARTED
            assert not spec_path(node, ref.uid).exists()
            seed_clique(api, uid, node.node_name, "Ready")
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                conn = await kubelet.wait_for_plugin(DRIVER, timeout=10)
                got = (await conn.prepare([ref]))[ref.uid]
                assert got.ok, got.error
                (device,) = validate(spec_path(node, ref.uid).read_bytes())["devices"]
                assert len(device["containerEdits"]["deviceNodes"]) == 2048
                stored = plugin.state.get(ref.uid)
                assert stored is not None and stored.phase is ClaimPhase.PREPARE_COMPLETED
                assert len(stored.devices) == 2048
                assert (await conn.unprepare([ref]))[ref.uid] == ""
                assert node_label(api) is None
        finally:
            await plugin.stop()

    asyncio.run(kill_while_waiting())
    asyncio.run(restart_and_prepare())


def test_a_prepare_waiting_in_the_old_instance_loses_to_the_unprepare_the_new_instance_answered(
        node: SandboxNode) -> None:
    """Rolling update (issue 32): two plugin instances on one node share the claim state. The old one's prepare waits
    for the domain's IMEX daemon (between attempts no claim record exists) when the kubelet's Unprepare of that claim
    is answered by the new one. Once the daemon is Ready the old one's next attempt must not complete: no
    PREPARE_COMPLETED record, no CDI spec, no node label, and the next claim for channel 0 is prepared."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)
    old_config, new_config = cd_config(node, pod_uid="old-pod"), cd_config(node, pod_uid="new-pod")

    async def body() -> None:
        old = await start_compute_domain_plugin(old_config)
        new = await start_compute_domain_plugin(new_config)
        try:
            async with KubeletEmulator(old_config.kubelet_registrar_directory_path) as kubelet:
                while len(kubelet.instances(DRIVER)) < 2:
                    await kubelet.wait_for_plugin(DRIVER, timeout=10)
                    await asyncio.sleep(0.05)
                by_socket = {c.endpoint: c for c in kubelet.instances(DRIVER)}
                old_conn, new_conn = by_socket[str(old_config.dra_socket)], by_socket[str(new_config.dra_socket)]
                pending = asyncio.create_task(old_conn.prepare([ref]))
                while node_label(api) != uid:  # the old instance's first attempt labelled the node and waits
                    await asyncio.sleep(0.02)
                assert old.state.get(ref.uid) is None  # between attempts: no record
                assert (await new_conn.unprepare([ref]))[ref.uid] == ""
                seed_clique(api, uid, node.node_name, "Ready")  # the old instance's next attempt would succeed
                got = (await pending)[ref.uid]
                assert "unprepared while this prepare was in flight" in got.error
                for plugin in (old, new):
                    plugin.state.refresh()
                    _assert_aborted_mark(plugin.state.get(ref.uid))  # left by the old one: PrepareAborted, as in one
                    assert plugin.state.holder(node.node_name, "channel-0") is None
                assert not spec_path(node, ref.uid).exists()
                assert node_label(api) is None
                late = (await new_conn.prepare([ref]))[ref.uid]
                assert "stale prepare" in late.error and "PrepareAborted" in late.error
                nxt = seed_claim(api, "wl-1", uid)
                answer = (await new_conn.prepare([nxt]))[nxt.uid]
                assert answer.ok, answer.error
                assert new.state.holder(node.node_name, "channel-0") == nxt.uid and spec_path(node, nxt.uid).exists()
                assert (await new_conn.unprepare([nxt]))[nxt.uid] == ""
        finally:
            await new.stop()
            await old.stop()

    asyncio.run(body())
