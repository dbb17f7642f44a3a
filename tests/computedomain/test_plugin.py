"""The compute-domain kubelet plugin end to end: the real plugin over gRPC (kubelet emulator), the API emulator over
HTTP with seeded ComputeDomains and ComputeDomainCliques, the mock NVML with the GB200 NVL72 node profile."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dradriver.domain.computedomains import LABEL_COMPUTE_DOMAIN
from dradriver.domain.imex import READINESS_FILE, READINESS_MAX_AGE_S, DaemonRecord
from dradriver.host import imexchannels
from dradriver.sandbox.node import SandboxNode
from tests.cdi.helpers import validate
from tests.computedomain.cdplugin_helpers import (
    CHANNEL_MAJOR,
    DRIVER,
    DRIVER_NAMESPACE,
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


def test_all_channel_claim_gets_every_channel_through_the_compiled_generator(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api, mode="All")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-all", uid, mode="All")
    other = seed_claim(api, "wl-other", uid)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
            (device,) = got.devices  # only the allocated device is answered
            assert device.device_name == "channel-0"
            # one CDI device holds every channel's node, as NVIDIA's (its claim device <claimUID>-channel-0)
            assert device.cdi_device_ids == (f"{KIND}={ref.uid}-channel-0",)
            data = spec_path(node, ref.uid).read_bytes()
            spec = validate(data, fully_specified=True)
            assert [d["name"] for d in spec["devices"]] == [f"{ref.uid}-channel-0"]
            nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
            assert len(nodes) == 2048
            assert {n["major"] for n in nodes} == {CHANNEL_MAJOR}
            assert [n.get("minor", 0) for n in nodes] == list(range(2048))
            assert nodes[2047]["path"] == "/dev/nvidia-caps-imex-channels/channel2047"
            assert all(n["fileMode"] == 0o666 and n["type"] == "c" for n in nodes)
            record = plugin.state.get(ref.uid)
            assert record is not None
            assert sorted(d.device for d in record.devices) == sorted(f"channel-{i}" for i in range(2048))
            # the channels are held: another claim of the domain on this node is refused, naming the holder
            refused = (await conn.prepare([other]))[other.uid]
            assert "already prepared for claim default/wl-all" in refused.error
            # answered again from the claim state, identically
            again = (await conn.prepare([ref]))[ref.uid]
            assert again.devices == got.devices and plugin.runner.preparations == 1
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            assert plugin.state.get(ref.uid) is None and not spec_path(node, ref.uid).exists()

    asyncio.run(body())


def test_all_channel_claim_spec_is_kept_across_a_restart_and_rewritten_when_gone(node: SandboxNode) -> None:
    """The one-device spec of an All claim matches its stored CDI ID: a restart keeps the file as it is, and a
    prepare after ``/var/run/cdi`` was cleaned rewrites it with the same single device."""
    api = node.api
    assert api is not None
    uid = seed_domain(api, mode="All")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-all", uid, mode="All")

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
        path = spec_path(node, ref.uid)
        before = path.read_bytes()
        mtime = path.stat().st_mtime_ns
        async with running(cd_config(node)) as (plugin, conn):
            assert path.stat().st_mtime_ns == mtime and path.read_bytes() == before  # not rewritten
            path.unlink()
            again = (await conn.prepare([ref]))[ref.uid]
            assert again.ok and again.devices == got.devices and plugin.runner.preparations == 0
            assert path.read_bytes() == before
            assert (await conn.unprepare([ref]))[ref.uid] == ""

    asyncio.run(body())


def test_an_all_claim_prepared_by_an_older_build_keeps_its_2048_device_spec(node: SandboxNode) -> None:
    """Upgrade: a claim prepared when an All claim was one CDI device per channel (2048 CDI IDs stored) keeps its
    spec and its answer after a restart: the spec matches the stored CDI IDs, so nothing is rewritten."""
    from dataclasses import replace

    from dradriver.domain import cdi

    api = node.api
    assert api is not None
    uid = seed_domain(api, mode="All")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-old", uid, mode="All")
    path = spec_path(node, ref.uid)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            assert (await conn.prepare([ref]))[ref.uid].ok
            record = plugin.state.get(ref.uid)
            assert record is not None
            old_ids = tuple(f"{KIND}={ref.uid}-channel-{i}" for i in range(2048))
            devices = [replace(d, cdi_device_ids=old_ids) if d.device == "channel-0" else d for d in record.devices]
            plugin.state.prepare_completed(ref.uid, devices=devices)
            path.write_bytes(cdi.render_imex_channel_spec(CHANNEL_MAJOR, range(2048), kind=KIND,
                                                          name_prefix=f"{ref.uid}-channel-"))
        before = path.read_bytes()
        async with running(cd_config(node)) as (plugin, conn):
            assert ref.uid not in plugin.recovery.rebuilt_specs and path.read_bytes() == before
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok and len(got.devices[0].cdi_device_ids) == 2048 and plugin.runner.preparations == 0
            assert path.read_bytes() == before
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            assert not path.exists()

    asyncio.run(body())


def test_channel_count_comes_from_driver_params_with_a_default(node: SandboxNode) -> None:
    from dradriver.host.imexchannels import read_channel_count

    write_imex_proc(node, channels=16)
    assert read_channel_count(node.root / "proc")[0] == 16
    (node.root / "proc" / "driver" / "nvidia" / "params").unlink()
    count, reason = read_channel_count(node.root / "proc")
    assert count == 2048 and "unreadable" in reason and "default 2048" in reason
    write_imex_proc(node, channels=16)
    api = node.api
    assert api is not None
    uid = seed_domain(api, mode="All")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-16", uid, mode="All")

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
            assert got.devices[0].cdi_device_ids == (f"{KIND}={ref.uid}-channel-0",)
            (device,) = validate(spec_path(node, ref.uid).read_bytes())["devices"]
            assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
                f"/dev/nvidia-caps-imex-channels/channel{i}" for i in range(16)]

    asyncio.run(body())


def test_readiness_is_waited_for_while_other_claims_prepare(node: SandboxNode) -> None:
    """The channel claim waits (label set, daemon NotReady); meanwhile the domain's daemon claim prepares (the wait
    holds no lock); the entry turns Ready during the wait and the channel claim succeeds in the same call."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)
    daemon = seed_claim(api, "daemon", uid, namespace="nvidia-dra-driver", kind="daemon")

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            pending = asyncio.create_task(conn.prepare([ref]))
            while node_label(api) != uid:  # the prepare labelled the node and is now waiting
                await asyncio.sleep(0.02)
            assert not pending.done()
            got_daemon = (await conn.prepare([daemon]))[daemon.uid]
            assert got_daemon.ok, got_daemon.error
            assert not pending.done()
            seed_clique(api, uid, node.node_name, "Ready")
            got = (await pending)[ref.uid]
            assert got.ok, got.error
            assert spec_path(node, ref.uid).exists()

    asyncio.run(body())


def test_readiness_timeout_is_a_clear_error(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)

    async def body() -> None:
        async with running(cd_config(node, prepare_deadline_seconds=2)) as (plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert "IMEX daemon of ComputeDomain default/cd-1 on node gpu-node-1 is not Ready yet" in got.error
            assert f"ComputeDomainClique nvidia-dra-driver/{uid}.{GB200_CLIQUE}: status NotReady" in got.error
            assert "still not ready after" in got.error
            assert plugin.state.get(ref.uid) is None and not spec_path(node, ref.uid).exists()
            assert node_label(api) == uid  # kept for the daemon pod, as NVIDIA's plugin keeps it
            assert (await conn.unprepare([ref]))[ref.uid] == ""  # the pod is gone before its claim was ever ready
            assert node_label(api) is None

    asyncio.run(body())


def _daemon_pod(api: Any, uid: str, node_name: str, ip: str, *, ready: bool, deleting: bool = False) -> None:
    suffix = ip.rsplit(".", 1)[-1] + ("-old" if deleting else "")
    meta: dict[str, Any] = {"name": f"computedomain-daemon-{uid[:8]}-{node_name}-{suffix}",
                            "namespace": "nvidia-dra-driver", "labels": {LABEL_COMPUTE_DOMAIN: uid}}
    if deleting:
        meta["finalizers"] = ["example.com/hold"]
    api.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"nodeName": node_name, "containers": [{"name": "compute-domain-daemon", "image": "x"}]},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})
    if deleting:
        api.delete("Pod", meta["name"], "nvidia-dra-driver")


def test_a_ready_daemon_pod_makes_the_member_ready_before_the_controller_copies_it(node: SandboxNode) -> None:
    """Issue 14: the entry's status is the controller's copy of the daemon pod's Ready condition; while it lags, the
    prepare reads the pod itself (same rule), sparing the joining node the controller's second round trip. Only the
    pod with the entry's IP counts, and not one being deleted."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")  # a member (ipAddress 10.0.0.1, index 0), status not copied
    _daemon_pod(api, uid, node.node_name, "10.0.0.9", ready=True)  # another incarnation's IP: not this entry's
    _daemon_pod(api, uid, node.node_name, "10.0.0.1", ready=True, deleting=True)  # terminating: not ready
    _daemon_pod(api, uid, "gpu-node-2", "10.0.0.1", ready=True)  # another node's pod: not ours
    ref = seed_claim(api, "wl-0", uid)

    async def body() -> None:
        async with running(cd_config(node, prepare_deadline_seconds=2)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert "status NotReady, and its daemon pod (10.0.0.1) is not Ready" in got.error
            _daemon_pod(api, uid, node.node_name, "10.0.0.1", ready=True)
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error
            assert spec_path(node, ref.uid).exists()
        clique = api.get("ComputeDomainClique", f"{uid}.{GB200_CLIQUE}", "nvidia-dra-driver")
        assert clique is not None and clique["daemons"][0]["status"] == "NotReady"  # the plugin wrote nothing

    asyncio.run(body())


def test_missing_domain_wrong_namespace_and_bad_config_are_per_claim_errors(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    elsewhere = seed_domain(api, name="cd-x", namespace="team-b")
    missing = seed_claim(api, "missing", "8b0d5b51-0000-4000-8000-000000000000")
    wrong_ns = seed_claim(api, "wrong-ns", elsewhere)
    bad = seed_claim(api, "bad-mode", elsewhere, mode="Some")
    no_id = seed_claim(api, "no-id", "", config={"apiVersion": "resource.nvidia.com/v1beta1",
                                                  "kind": "ComputeDomainChannelConfig"})

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            got = {}
            for ref in (missing, wrong_ns, bad, no_id):  # one at a time: each would hold channel-0 while it runs
                got.update(await conn.prepare([ref]))
            assert "claim default/missing" in got[missing.uid].error
            assert "status.allocation.devices.config[0].opaque.parameters.domainID: no ComputeDomain has UID " \
                   "'8b0d5b51-0000-4000-8000-000000000000'" in got[missing.uid].error
            assert "ComputeDomain team-b/cd-x" in got[wrong_ns.uid].error
            assert "is not in the claim's namespace 'default'" in got[wrong_ns.uid].error
            assert "allocationMode: 'Some' is not one of 'Single', 'All'" in got[bad.uid].error
            assert "domainID: required" in got[no_id.uid].error
            assert node_label(api) is None

    asyncio.run(body())


def test_node_labelled_for_another_domain_refuses_the_claim(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-0", uid)
    stored = api.get("Node", node.node_name)
    assert stored is not None
    stored["metadata"].setdefault("labels", {})["resource.nvidia.com/computeDomain"] = "other-domain-uid"
    api.update(stored)

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert "is labelled resource.nvidia.com/computeDomain=other-domain-uid" in got.error
            assert "a node serves one ComputeDomain at a time" in got.error
            assert node_label(api) == "other-domain-uid"

    asyncio.run(body())


def test_unprepare_leaves_a_label_that_names_another_domain(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-0", uid)

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            assert (await conn.prepare([ref]))[ref.uid].ok
            stored = api.get("Node", node.node_name)
            assert stored is not None
            stored["metadata"]["labels"]["resource.nvidia.com/computeDomain"] = "someone-else"
            api.update(stored)
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            assert node_label(api) == "someone-else"

    asyncio.run(body())


def test_node_in_no_clique_prepares_without_edits() -> None:
    with SandboxNode(profile="dgx-h100") as node:
        write_imex_proc(node, fabric_minor=None)
        api = node.api
        assert api is not None
        uid = seed_domain(api)
        ref = seed_claim(api, "wl-0", uid)
        daemon = seed_claim(api, "daemon", uid, namespace="nvidia-dra-driver", kind="daemon")

        async def body() -> None:
            async with running(cd_config(node)) as (plugin, conn):
                assert plugin.clique_id == ""
                got = await conn.prepare([ref, daemon])
                assert got[ref.uid].ok, got[ref.uid].error
                (device,) = got[ref.uid].devices
                assert device.device_name == "channel-0" and device.cdi_device_ids == ()
                assert not spec_path(node, ref.uid).exists()  # no edits, no spec (NVIDIA)
                assert node_label(api) == uid
                assert got[daemon.uid].ok, got[daemon.uid].error
                spec = validate(spec_path(node, daemon.uid).read_bytes())
                edits = spec["devices"][0]["containerEdits"]
                assert "CLIQUE_ID=" in edits["env"] and "deviceNodes" not in edits  # no fabric-imex-mgmt
                assert (await conn.unprepare([ref]))[ref.uid] == ""  # answered again after a restart
                assert node_label(api) is None

        asyncio.run(body())


def test_daemon_claim_gets_domain_dir_env_mount_and_fabric_capability(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api, name="cd-9", namespace="team-a")
    daemon = seed_claim(api, "daemon", uid, namespace="nvidia-dra-driver", kind="daemon")
    for name in ("nvidia-imex", "nvidia-imex-ctl"):  # the driver's IMEX binaries (empty files, as the tree's others)
        (node.driver_root / "usr" / "bin" / name).touch(mode=0o755)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            base = node.cdi_root / "k8s.compute-domain.nvidia.com-device_base.json"
            base_spec = validate(base.read_bytes())
            assert base_spec["kind"] == "k8s.compute-domain.nvidia.com/device"
            assert [d["name"] for d in base_spec["devices"]] == ["all"]
            all_edits = base_spec["devices"][0]["containerEdits"]
            paths = {n["path"] for n in all_edits["deviceNodes"]}
            assert {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia3", "/dev/nvidia-caps/nvidia-cap7"} <= paths
            assert "NVIDIA_VISIBLE_DEVICES=void" in (all_edits.get("env") or []) + \
                (base_spec.get("containerEdits", {}).get("env") or [])
            mounted = json.dumps(base_spec)
            assert "nvidia-imex-ctl" in mounted and "/nvidia-imex\"" in mounted
            got = (await conn.prepare([daemon]))[daemon.uid]
            assert got.ok, got.error
            (device,) = got.devices
            assert device.device_name == "daemon-0"
            assert device.cdi_device_ids == ("k8s.compute-domain.nvidia.com/device=all",
                                             f"{KIND}={daemon.uid}-daemon-0")
            domain_dir = plugin.config.plugin_dir / "domains" / uid
            template = (domain_dir / "imexd.cfg.tmpl").read_text()
            assert "IMEX_WAIT_FOR_QUORUM=RECOVERY" in template and "SERVER_PORT=50000" in template
            spec = validate(spec_path(node, daemon.uid).read_bytes(), fully_specified=True)
            edits = spec["devices"][0]["containerEdits"]
            assert sorted(edits["env"]) == sorted([f"CLIQUE_ID={GB200_CLIQUE}", f"COMPUTE_DOMAIN_UUID={uid}",
                                                   "COMPUTE_DOMAIN_NAME=cd-9", "COMPUTE_DOMAIN_NAMESPACE=team-a"])
            assert edits["mounts"] == [{"hostPath": str(domain_dir), "containerPath": "/imexd",
                                        "options": ["rw", "nosuid", "nodev", "bind"]}]
            (cap,) = edits["deviceNodes"]
            assert cap["path"] == "/dev/nvidia-caps/nvidia-cap7" and cap["major"] == 511 and cap["minor"] == 7
            assert (await conn.unprepare([daemon]))[daemon.uid] == ""
            assert domain_dir.is_dir()  # kept until the domain is gone
            api.delete("ComputeDomain", "cd-9", "team-a")
            from dradriver.kubeletplugin.imexdomains import remove_vanished_domain_dirs
            assert remove_vanished_domain_dirs(plugin.client, plugin.config, plugin.runner) == [uid]
            assert not domain_dir.exists()
        assert (node.cdi_root / "k8s.compute-domain.nvidia.com-device_base.json").exists()  # outlives the plugin

    asyncio.run(body())


def test_published_slice_and_clique_label(node: SandboxNode) -> None:
    api = node.api
    assert api is not None

    async def body() -> None:
        async with running(cd_config(node, gpu_clique_label_enabled=True)) as (_plugin, _conn):
            slices = [s for s in api.objects("ResourceSlice") if s["spec"]["driver"] == DRIVER]
            (published,) = slices
            assert published["spec"]["pool"]["name"] == node.node_name
            assert [(d["name"], d["attributes"]) for d in published["spec"]["devices"]] == [
                ("channel-0", {"type": {"string": "channel"}, "id": {"int": 0}}),
                ("daemon-0", {"type": {"string": "daemon"}, "id": {"int": 0}})]
            assert all("capacity" not in d for d in published["spec"]["devices"])
            labels = api.get("Node", node.node_name)["metadata"]["labels"]  # type: ignore[index]
            assert labels["nvidia.com/gpu.clique"] == GB200_CLIQUE
        labels = api.get("Node", node.node_name)["metadata"].get("labels") or {}  # type: ignore[index]
        assert "nvidia.com/gpu.clique" not in labels

    asyncio.run(body())


def test_periodic_refresh_follows_a_clique_change_and_keeps_the_last_on_error(node: SandboxNode) -> None:
    api = node.api
    assert api is not None

    def control(*lines: str) -> None:
        with open(node.nvml_control, "a", encoding="utf-8") as fh:
            fh.write("".join(f"{line}\n" for line in lines))

    def clique_label() -> str | None:
        stored = api.get("Node", node.node_name)  # type: ignore[union-attr]
        assert stored is not None
        return (stored["metadata"].get("labels") or {}).get("nvidia.com/gpu.clique")

    async def body() -> None:
        async with running(cd_config(node, gpu_clique_label_enabled=True)) as (plugin, _conn):
            control(*(f"set {gpu} fabric.cliqueId 5" for gpu in range(4)))
            await asyncio.to_thread(plugin.refresh)
            moved = GB200_CLIQUE.rsplit(".", 1)[0] + ".5"
            assert plugin.clique_id == moved and clique_label() == moved
            control("set 1 fabric.state 2")  # registration in progress again: an error, the last clique stays
            await asyncio.to_thread(plugin.refresh)
            assert plugin.clique_id == moved and clique_label() == moved

    asyncio.run(body())


def test_request_metrics_are_served_on_the_http_endpoint(node: SandboxNode) -> None:
    """The chart gives the compute-domains container ``HTTP_ENDPOINT=:8081``: NVIDIA's request metrics with
    ``driver="compute-domain.nvidia.com"``, after a prepare and an unprepare."""
    import socket
    import urllib.request

    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-metrics", uid)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def body() -> None:
        async with running(cd_config(node, http_endpoint=f"127.0.0.1:{port}")) as (_plugin, conn):
            assert (await conn.prepare([ref]))[ref.uid].ok
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
            for operation in ("prepare", "unprepare"):
                line = (f'nvidia_dra_requests_total{{driver="compute-domain.nvidia.com",'
                        f'operation="{operation}"}} 1.0')
                assert line in text, text[:2000]

    asyncio.run(body())


_LIVENESS: list[int] = []  # liveness locks the tests' daemons hold (closed after each test)


@pytest.fixture(autouse=True)
def _drop_liveness_locks() -> Iterator[None]:
    yield
    while _LIVENESS:
        os.close(_LIVENESS.pop())


def _record(node: SandboxNode, uid: str, *, ready: bool, age_s: float = 0.0, node_name: str = "",
            alive: bool = True) -> None:
    """This node's daemon's readiness record, as ``compute-domain-daemon check`` writes it; with ``alive`` its
    daemon holds the liveness lock as ``compute-domain-daemon run`` does."""
    directory = imexchannels.domain_dir(cd_config(node).plugin_dir, uid)
    directory.mkdir(parents=True, exist_ok=True)
    imexchannels.write_readiness(directory, DaemonRecord(node_name or node.node_name, "pod-uid-1", "10.0.0.1", ready,
                                                         time.time() - age_s, "READY" if ready else "not ready"))
    if alive and not imexchannels.daemon_alive(directory):
        _LIVENESS.append(imexchannels.hold_daemon_lock(directory))


def _membership_reads(api: Any) -> list[str]:
    return [f"{r.verb} {r.resource}" for r in api.requests
            if r.resource in ("computedomaincliques", "pods") and r.verb in ("get", "list")]


def test_the_daemons_readiness_record_answers_without_the_api_and_ends_the_wait(node: SandboxNode) -> None:
    """Issue 14: a current record in the domain directory is read before the API. While it says not ready the
    claim waits without reading the clique or the pods (its retries read nothing from the API at all: the domain
    and the label were found by the first attempt); when it turns ready the same call succeeds, though the API's
    entry still says NotReady (the controller's copy lags)."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)
    _record(node, uid, ready=False)

    async def body() -> None:
        async with running(cd_config(node, prepare_deadline_seconds=30)) as (_plugin, conn):
            api.clear_requests()
            pending = asyncio.create_task(conn.prepare([ref]))
            while node_label(api) != uid:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.8)  # several retries (0.1, 0.2, 0.4 s pauses)
            assert not pending.done()
            first = len(api.requests)
            await asyncio.sleep(0.8)
            claim_reads = [f"{r.verb} {r.resource}" for r in api.requests[first:]
                           if r.resource in ("computedomains", "nodes", "computedomaincliques", "pods")]
            assert claim_reads == []  # the plugin's other loops (slices, leases) may talk; the claim's retries not
            _record(node, uid, ready=True)
            got = (await pending)[ref.uid]
            assert got.ok, got.error
            assert _membership_reads(api) == []  # neither the clique nor the pods were read
            assert spec_path(node, ref.uid).exists()
        clique = api.get("ComputeDomainClique", f"{uid}.{GB200_CLIQUE}", DRIVER_NAMESPACE)
        assert clique is not None and clique["daemons"][0]["status"] == "NotReady"

    asyncio.run(body())


@pytest.mark.parametrize("case", ["stale", "another node's", "unreadable", "killed daemon"])
def test_a_record_that_does_not_speak_for_the_daemon_leaves_the_answer_to_the_api(node: SandboxNode,
                                                                                   case: str) -> None:
    """A record older than READINESS_MAX_AGE_S (its daemon stopped probing), one naming another node, a torn one,
    or a young ``ready`` one whose daemon no longer holds its liveness lock (killed after its last probe) counts
    for nothing: the clique entry decides, and its NotReady is the claim's error."""
    api = node.api
    assert api is not None
    uid = seed_domain(api)
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = seed_claim(api, "wl-0", uid)
    if case == "stale":
        _record(node, uid, ready=True, age_s=READINESS_MAX_AGE_S + 5)
    elif case == "another node's":
        _record(node, uid, ready=True, node_name="gpu-node-2")
    elif case == "killed daemon":
        _record(node, uid, ready=True, alive=False)
    else:
        _record(node, uid, ready=True)
        path = imexchannels.domain_dir(cd_config(node).plugin_dir, uid) / READINESS_FILE
        path.write_bytes(path.read_bytes()[:20])

    async def body() -> None:
        async with running(cd_config(node, prepare_deadline_seconds=2)) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert f"ComputeDomainClique {DRIVER_NAMESPACE}/{uid}.{GB200_CLIQUE}: status NotReady" in got.error
            assert "get computedomaincliques" in _membership_reads(api)

    asyncio.run(body())
