"""dradriver's compute-domain plugin keeps NVIDIA's ``compute-domain.nvidia.com/checkpoint.json`` true
(:mod:`dradriver.kubeletplugin.rollback` with :data:`~dradriver.domain.nvcheckpoint.CD_CLAIM`): channel and daemon
claims named before their Prepare is answered and gone before their Unprepare is, an aborted prepare named
``PrepareAborted`` with ``abortedAt`` for its TTL, and all of it true after a SIGKILL.

NVIDIA's ``compute-domain-kubelet-plugin`` binary is not available to these tests, so the layout is checked byte
for byte against NVIDIA's source as documented (``cmd/compute-domain-kubelet-plugin/checkpoint*.go``,
``prepared.go``: ``PreparedDevice{Channel *…  `json:"channel"`; Daemon *… `json:"daemon"`}``, each
``{info: {id}, device}``; ``DeviceConfigState{Type, ComputeDomain}`` without JSON tags; ``PreparedClaimV2`` adds
``abortedAt`` omitempty); the checksum recipe is the GPU plugin's, checked against NVIDIA's GPU binary."""

from __future__ import annotations

import asyncio
import calendar
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.domain.claims import ClaimRef
from dradriver.domain.computedomains import LABEL_COMPUTE_DOMAIN
from dradriver.domain.nvcheckpoint import (
    CD_CLAIM,
    Checkpoint,
    CheckpointEntry,
    CheckpointState,
    ConfigState,
    DeviceGroup,
    KubeletDevice,
    PreparedDevice,
    checksum,
    decode,
    encode,
)
from dradriver.host.claimstate import ClaimPhase
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint
from dradriver.kubeletplugin.rollback import rfc3339
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    CHANNEL_MAJOR,
    DRIVER,
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
UID = "7d1c2b3a-0000-4000-8000-00000000c0de"
CD_UID = "5e0c7a52-1111-4222-8333-444455556666"
STATUS = {"allocation": {"devices": {"results": [
    {"request": "channel", "driver": DRIVER, "pool": "node-a", "device": "channel-0"}]}}}


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def _checkpoint_path(node: SandboxNode) -> Path:
    return Path(cd_config(node).kubelet_plugins_directory_path) / DRIVER / CHECKPOINT_FILE


def _read(node: SandboxNode) -> Checkpoint:
    kept = read_checkpoint(_checkpoint_path(node), CD_CLAIM)
    assert kept is not None
    return kept


def _channel(uid: str = UID) -> PreparedDevice:
    return PreparedDevice("channel", KubeletDevice(("channel",), "node-a", "channel-0",
                                                   (f"k8s.compute-domain.nvidia.com/claim={uid}-channel-0",)), id=0)


def test_compute_domain_checkpoint_has_nvidias_layout_byte_for_byte() -> None:
    completed = CheckpointEntry(CheckpointState.PREPARE_COMPLETED, STATUS,
                                (DeviceGroup((_channel(),), ConfigState(type="channel", compute_domain=CD_UID)),),
                                name="wl", namespace="default")
    aborted = CheckpointEntry(CheckpointState.PREPARE_ABORTED, STATUS, name="wl-2", namespace="default",
                              aborted_at="2026-12-04T22:30:00Z")
    other = "8" + UID[1:]
    data = encode(Checkpoint({UID: completed, other: aborted}, "boot-1"), CD_CLAIM)
    status = ('{"allocation":{"devices":{"results":[{"request":"channel","driver":"compute-domain.nvidia.com",'
              '"pool":"node-a","device":"channel-0"}]}}}')
    groups = ('[{"devices":[{"channel":{"info":{"id":0},"device":{"Requests":["channel"],"PoolName":"node-a",'
              f'"DeviceName":"channel-0","CDIDeviceIDs":["k8s.compute-domain.nvidia.com/claim={UID}-channel-0"]}}}},'
              f'"daemon":null}}],"configState":{{"Type":"channel","ComputeDomain":"{CD_UID}"}}}}]')
    v2_claims = (f'{{"{UID}":{{"checkpointState":"PrepareCompleted","status":{status},"preparedDevices":{groups},'
                 f'"name":"wl","namespace":"default"}},"{other}":{{"checkpointState":"PrepareAborted",'
                 f'"status":{status},"name":"wl-2","namespace":"default","abortedAt":"2026-12-04T22:30:00Z"}}}}')
    v1 = f'{{"preparedClaims":{{"{UID}":{{"status":{status},"preparedDevices":{groups}}}}}}}'  # completed only
    v2_body = f',"preparedClaims":{v2_claims},"nodeBootID":"boot-1"}}'
    v2_sum = checksum(('{"checksum":0' + v2_body).encode())
    v1_sum = checksum(('{"checksum":0,"v1":' + v1 + "}").encode())
    assert data.decode() == f'{{"checksum":{v1_sum},"v1":{v1},"v2":{{"checksum":{v2_sum}{v2_body}}}'
    assert decode(data, CD_CLAIM) == Checkpoint({UID: completed, other: aborted}, "boot-1")
    daemon = PreparedDevice("daemon", KubeletDevice(("daemon",), "node-a", "daemon-0", ("k8s.x/claim=y",)), id=0)
    entry = CheckpointEntry(CheckpointState.PREPARE_COMPLETED, STATUS,
                            (DeviceGroup((daemon,), ConfigState(type="daemon", compute_domain=CD_UID)),))
    raw = json.loads(encode(Checkpoint({UID: entry}), CD_CLAIM))["v2"]["preparedClaims"][UID]
    assert raw["preparedDevices"][0]["devices"] == [{"channel": None, "daemon": {"info": {"id": 0}, "device": {
        "Requests": ["daemon"], "PoolName": "node-a", "DeviceName": "daemon-0", "CDIDeviceIDs": ["k8s.x/claim=y"]}}}]
    assert rfc3339(1796423400.7) == "2026-12-04T22:30:00Z"  # whole seconds: metav1.Time and time.Time alike


def test_compute_domain_plugin_names_channel_and_daemon_claims_until_unprepared(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    cd_uid = seed_domain(api)
    seed_clique(api, cd_uid, node.node_name, "Ready")
    channel = seed_claim(api, "wl-0", cd_uid, pool=node.node_name)
    daemon = seed_claim(api, "daemon-0", cd_uid, kind="daemon", pool=node.node_name)

    async def body() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            got = await conn.prepare([channel, daemon])
            assert got[channel.uid].ok and got[daemon.uid].ok, got
            kept = _read(node)
            assert kept.node_boot_id
            entry = kept.claims[channel.uid]
            assert entry.state is CheckpointState.PREPARE_COMPLETED
            assert (entry.name, entry.namespace) == ("wl-0", "default")
            assert entry.status["allocation"]["devices"]["results"][0]["device"] == "channel-0"
            (group,) = entry.groups
            assert group.config_state == ConfigState(type="channel", compute_domain=cd_uid)
            (device,) = group.devices
            assert device.kind == "channel" and device.id == 0 and device.device is not None
            assert device.device.cdi_device_ids == (f"k8s.compute-domain.nvidia.com/claim={channel.uid}-channel-0",)
            (group,) = kept.claims[daemon.uid].groups
            assert group.config_state == ConfigState(type="daemon", compute_domain=cd_uid)
            assert [(d.kind, d.id) for d in group.devices] == [("daemon", 0)]
            assert (await conn.unprepare([channel]))[channel.uid] == ""
            assert node_label(api) is None
            assert set(_read(node).claims) == {daemon.uid}
            assert (await conn.unprepare([daemon]))[daemon.uid] == ""
            assert _read(node).claims == {}

    asyncio.run(body())


def _waiting_claim(node: SandboxNode) -> tuple[Any, str, ClaimRef]:
    """A channel claim whose prepare waits (this node's IMEX daemon NotReady): the API, its ComputeDomain UID,
    the claim."""
    api = node.api
    assert api is not None
    cd_uid = seed_domain(api)
    seed_clique(api, cd_uid, node.node_name, "NotReady")
    return api, cd_uid, seed_claim(api, "wl-0", cd_uid, pool=node.node_name)


async def _abort_prepare(conn: Any, api: Any, ref: ClaimRef, cd_uid: str) -> str:
    """Unprepare ``ref`` while its prepare waits; the prepare's error."""
    pending = await prepare_until_labelled(conn, api, ref, cd_uid)
    assert (await conn.unprepare([ref]))[ref.uid] == ""
    return str((await pending)[ref.uid].error)


def test_an_aborted_prepare_is_named_prepare_aborted_for_its_ttl(node: SandboxNode) -> None:
    api, cd_uid, ref = _waiting_claim(node)

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            assert "unprepared while this prepare was in flight" in await _abort_prepare(conn, api, ref, cd_uid)
            entry = _read(node).claims[ref.uid]
            assert entry.state is CheckpointState.PREPARE_ABORTED and entry.groups == ()
            assert entry.aborted_at is not None and (entry.name, entry.namespace) == ("wl-0", "default")
            assert abs(calendar.timegm(time.strptime(entry.aborted_at, "%Y-%m-%dT%H:%M:%SZ")) - time.time()) < 60
            claim = api.get("ResourceClaim", ref.name, ref.namespace)
            assert claim is not None
            # the status NVIDIA compares at prepare ("stale prepare" when identical)
            assert entry.status["allocation"] == claim["status"]["allocation"]
            assert (await conn.unprepare([ref]))[ref.uid] == ""  # a no-op on an aborted claim: still named
            assert _read(node).claims[ref.uid].state is CheckpointState.PREPARE_ABORTED
            plugin.runner.clock = lambda: time.time() + 91.0
            assert plugin.runner.forget_expired_aborts() == [ref.uid]
            assert _read(node).claims == {}

    asyncio.run(body())


def test_compute_domain_checkpoint_is_true_after_a_sigkill(node: SandboxNode) -> None:
    """The plugin process is SIGKILLed right after answering a Prepare: the file on disk verifies (NVIDIA's
    checksums) and names the prepared channel claim."""
    api = node.api
    assert api is not None
    cd_uid = seed_domain(api)
    seed_clique(api, cd_uid, node.node_name, "Ready")
    prepared = seed_claim(api, "wl-0", cd_uid, pool=node.node_name)
    config = cd_config(node)

    async def prepare_then_kill() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "compute-domain-kubelet-plugin", env=plugin_env(node),
            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                conn = await kubelet.wait_for_plugin(DRIVER, timeout=30)
                deadline = time.monotonic() + 30
                while not (got := (await conn.prepare([prepared]))[prepared.uid]).ok:  # the kubelet retries
                    assert "not read yet" in got.error and time.monotonic() < deadline, got.error
                    await asyncio.sleep(0.1)
                proc.send_signal(signal.SIGKILL)
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    asyncio.run(prepare_then_kill())
    kept = _read(node)  # verifies both checksums as NVIDIA does
    assert set(kept.claims) == {prepared.uid}
    entry = kept.claims[prepared.uid]
    assert entry.state is CheckpointState.PREPARE_COMPLETED and entry.groups[0].config_state.type == "channel"


def _nvidia_spec(node: SandboxNode, uid: str, device: str, edits: dict[str, Any]) -> Path:
    """The CDI spec NVIDIA's plugin wrote for claim ``uid`` (``k8s.compute-domain.nvidia.com-claim_<uid>.yaml``,
    YAML as NVIDIA writes it)."""
    path = spec_path(node, uid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"cdiVersion": "0.5.0", "kind": "k8s.compute-domain.nvidia.com/claim",
                                    "devices": [{"name": f"{uid}-{device}", "containerEdits": edits}]}))
    return path


def _nvidia_entry(api: Any, ref: ClaimRef, state: CheckpointState, kind: str = "", cd_uid: str = "",
                  aborted_at: str | None = None) -> CheckpointEntry:
    claim = api.get("ResourceClaim", ref.name, ref.namespace)
    groups: tuple[DeviceGroup, ...] = ()
    if kind:
        device = f"{kind}-0"
        groups = (DeviceGroup((PreparedDevice(kind, KubeletDevice(
            (kind,), "gpu-node-1", device, (f"k8s.compute-domain.nvidia.com/claim={ref.uid}-{device}",)), id=0),),
            ConfigState(type=kind, compute_domain=cd_uid)),)
    return CheckpointEntry(state, claim["status"], groups, name=ref.name, namespace=ref.namespace,
                           aborted_at=aborted_at)


def test_claims_nvidias_compute_domain_plugin_prepared_are_adopted_and_unprepared_clean(node: SandboxNode) -> None:
    """NVIDIA's checkpoint names a channel claim and a daemon claim (PrepareCompleted: held, answered as NVIDIA
    answered, unprepared with the spec and the node label), an aborted prepare (PrepareAborted 10 s ago: a prepare
    of the same allocation refused as stale) and a half-prepared claim (PrepareStarted: rolled back at start)."""
    api = node.api
    assert api is not None
    cd_uid = seed_domain(api)
    seed_clique(api, cd_uid, node.node_name, "Ready")
    other_uid = seed_domain(api, "cd-2")
    channel = seed_claim(api, "wl-0", cd_uid, pool=node.node_name)
    daemon = seed_claim(api, "daemon-0", cd_uid, kind="daemon", pool=node.node_name)
    aborted = seed_claim(api, "wl-a", cd_uid, pool=node.node_name)
    started = seed_claim(api, "wl-s", other_uid, device="channel-1", pool=node.node_name)
    obj = api.get("Node", node.node_name)
    assert obj is not None
    obj["metadata"].setdefault("labels", {})[LABEL_COMPUTE_DOMAIN] = cd_uid  # NVIDIA's prepare labelled the node
    api.update(obj)
    channel0 = {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": CHANNEL_MAJOR, "minor": 0}
    specs = [_nvidia_spec(node, channel.uid, "channel-0", {"deviceNodes": [channel0]}),
             _nvidia_spec(node, daemon.uid, "daemon-0", {"env": [
                 "CLIQUE_ID=c.1", f"COMPUTE_DOMAIN_UUID={cd_uid}", "COMPUTE_DOMAIN_NAME=cd-1",
                 "COMPUTE_DOMAIN_NAMESPACE=default"]})]
    path = _checkpoint_path(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    boot_id = (node.root / "proc" / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    path.write_bytes(encode(Checkpoint({
        channel.uid: _nvidia_entry(api, channel, CheckpointState.PREPARE_COMPLETED, "channel", cd_uid),
        daemon.uid: _nvidia_entry(api, daemon, CheckpointState.PREPARE_COMPLETED, "daemon", cd_uid),
        aborted.uid: _nvidia_entry(api, aborted, CheckpointState.PREPARE_ABORTED,
                                   aborted_at=rfc3339(time.time() - 10)),
        started.uid: _nvidia_entry(api, started, CheckpointState.PREPARE_STARTED),
    }, boot_id), CD_CLAIM))

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            for ref in (channel, daemon):
                record = plugin.state.get(ref.uid)
                assert record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED
            assert plugin.state.get(started.uid) is None  # rolled back at start
            adopted = {e["message"] for e in api.objects("Event") if e.get("reason") == "ClaimAdopted"}
            assert len(adopted) == 2 and any("default/wl-0" in m for m in adopted)
            metrics = plugin.runner.metrics
            assert metrics is not None
            assert metrics.registry.get_sample_value(
                "dradriver_adopted_claims_total",
                {"driver": "compute-domain.nvidia.com", "source": "nvidia-checkpoint"}) == 2
            got = (await conn.prepare([channel]))[channel.uid]  # answered from the adopted claim: nothing redone
            assert got.ok and [d.cdi_device_ids for d in got.devices] == [
                (f"k8s.compute-domain.nvidia.com/claim={channel.uid}-channel-0",)]
            assert plugin.runner.preparations == 0
            # /var/run/cdi cleaned: the kubelet's retry renders the specs again from the adopted records, with
            # what NVIDIA's injected (the channel node; the daemon's clique and ComputeDomain)
            for path in specs:
                path.unlink()
            again = await conn.prepare([channel, daemon])
            assert again[channel.uid].ok and again[daemon.uid].ok, again
            (rendered,) = yaml.safe_load(specs[0].read_text())["devices"]
            assert [n["path"] for n in rendered["containerEdits"]["deviceNodes"]] == [channel0["path"]]
            (rendered,) = yaml.safe_load(specs[1].read_text())["devices"]
            assert {"CLIQUE_ID=c.1", "COMPUTE_DOMAIN_NAME=cd-1"} <= set(rendered["containerEdits"]["env"])
            refused = (await conn.prepare([aborted]))[aborted.uid]
            assert "stale prepare" in refused.error and "PrepareAborted" in refused.error
            kept = _read(node)
            assert set(kept.claims) == {channel.uid, daemon.uid, aborted.uid}  # the started one is gone
            assert kept.claims[aborted.uid].state is CheckpointState.PREPARE_ABORTED
            assert node_label(api) == cd_uid
            assert await conn.unprepare([channel, daemon]) == {channel.uid: "", daemon.uid: ""}
            assert node_label(api) is None
            assert not any(p.exists() for p in specs)
            assert set(_read(node).claims) == {aborted.uid}

    asyncio.run(body())


def test_a_damaged_nvidia_compute_domain_checkpoint_is_not_guessed_at(node: SandboxNode) -> None:
    """One wrong byte (the checksum no longer verifies): nothing is adopted from it, a NvidiaCheckpointUnusable
    Event says why, the file is kept aside; the claim whose CDI spec NVIDIA wrote is kept from that spec as damage
    (a ClaimStateCorrupt Event, its channel held, named in the checkpoint written in place of the damaged one)
    until its unprepare, which leaves nothing."""
    api = node.api
    assert api is not None
    cd_uid = seed_domain(api)
    channel = seed_claim(api, "wl-0", cd_uid, pool=node.node_name)
    path = _checkpoint_path(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    good = encode(Checkpoint({channel.uid: _nvidia_entry(api, channel, CheckpointState.PREPARE_COMPLETED, "channel",
                                                         cd_uid)}), CD_CLAIM)
    path.write_bytes(good.replace(b'"id":0', b'"id":1'))
    spec = _nvidia_spec(node, channel.uid, "channel-0", {"deviceNodes": [
        {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": CHANNEL_MAJOR, "minor": 0}]})

    async def body() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            (event,) = [e for e in api.objects("Event") if e.get("reason") == "NvidiaCheckpointUnusable"]
            assert "checksum" in event["message"] and str(path) in event["message"]
            assert [e for e in api.objects("Event") if e.get("reason") == "ClaimAdopted"] == []
            (corrupt,) = [e for e in api.objects("Event") if e.get("reason") == "ClaimStateCorrupt"]
            assert "1 claim(s) adopted from their CDI specs" in corrupt["message"]
            record = plugin.state.get(channel.uid)
            assert record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED
            assert [h.device for h in record.devices] == ["channel-0"]
            assert set(_read(node).claims) == {channel.uid}
            assert [p.name for p in path.parent.iterdir() if p.name.startswith("checkpoint.json.corrupt-")]
            assert await conn.unprepare([channel]) == {channel.uid: ""}
            assert not spec.exists() and plugin.state.get(channel.uid) is None
            assert _read(node).claims == {}

    asyncio.run(body())


def test_an_aborted_mark_that_expired_while_the_plugin_was_down_leaves_the_checkpoint(node: SandboxNode) -> None:
    api, cd_uid, ref = _waiting_claim(node)

    async def abort() -> None:
        async with running(cd_config(node)) as (_plugin, conn):
            await _abort_prepare(conn, api, ref, cd_uid)
        assert _read(node).claims[ref.uid].state is CheckpointState.PREPARE_ABORTED

    async def restart_later() -> None:
        async with running(cd_config(node), clock=lambda: time.time() + 91.0) as (plugin, _conn):
            assert plugin.recovery.aborted_expired == (ref.uid,)
            assert _read(node).claims == {}

    asyncio.run(abort())
    asyncio.run(restart_later())


def _nvidia_channel_entry(api: Any, ref: ClaimRef, device: str, cd_uid: str,
                          state: CheckpointState = CheckpointState.PREPARE_COMPLETED) -> CheckpointEntry:
    """A channel claim's entry as NVIDIA's compute-domain plugin writes it for its allocated ``device``
    (``channel-<id>``; ``PrepareStarted``: status, name and namespace only, as NVIDIA writes it before preparing)."""
    claim = api.get("ResourceClaim", ref.name, ref.namespace)
    groups: tuple[DeviceGroup, ...] = ()
    if state is CheckpointState.PREPARE_COMPLETED:
        groups = (DeviceGroup((PreparedDevice("channel", KubeletDevice(
            ("channel",), "gpu-node-1", device, (f"k8s.compute-domain.nvidia.com/claim={ref.uid}-{device}",)),
            id=int(device.removeprefix("channel-"))),), ConfigState(type="channel", compute_domain=cd_uid)),)
    return CheckpointEntry(state, claim["status"], groups, name=ref.name, namespace=ref.namespace)


def _nvidia_round(node: SandboxNode, boot_id: str, *, unprepare: tuple[ClaimRef, ...] = (),
                  prepare: dict[str, CheckpointEntry] | None = None) -> None:
    """What NVIDIA's compute-domain plugin, started in dradriver's place, leaves after its kubelet unprepared
    ``unprepare`` (entry and spec gone) and prepared ``prepare`` (claim UID -> entry; a completed one with its
    spec): NVIDIA reads the file dradriver kept and rewrites it whole."""
    path = _checkpoint_path(node)
    claims = dict(_read(node).claims)
    for ref in unprepare:
        del claims[ref.uid]
        spec_path(node, ref.uid).unlink(missing_ok=True)
    for uid, entry in (prepare or {}).items():
        claims[uid] = entry
        if entry.state is CheckpointState.PREPARE_COMPLETED:
            device = entry.devices[0].device
            assert device is not None
            _nvidia_spec(node, uid, device.device_name, {"deviceNodes": []})
    path.write_bytes(encode(Checkpoint(claims, boot_id), CD_CLAIM))


def test_switching_back_and_forth_converges_on_what_the_last_compute_domain_driver_did(node: SandboxNode) -> None:
    """NVIDIA prepares A, B and C; dradriver adopts them; NVIDIA, back, unprepares A, leaves B as it is, and
    unprepares C, whose claim is then allocated channel-4 and prepared again under the same UID, and begins to
    prepare C's neighbour D; dradriver, back: A is forgotten (not brought back from its older claim state: no spec,
    no entry), B stays held as adopted, C holds what NVIDIA's newer entry says (channel-4, channel-3 free again),
    and D is rolled back; unpreparing B and C leaves no spec and an empty checkpoint."""
    api = node.api
    assert api is not None
    cd_uid = seed_domain(api)
    a, b, c, d = (seed_claim(api, f"wl-{n}", cd_uid, device=f"channel-{n}", pool=node.node_name)
                  for n in (1, 2, 3, 5))
    boot_id = (node.root / "proc" / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    path = _checkpoint_path(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode(Checkpoint({}, boot_id), CD_CLAIM))
    _nvidia_round(node, boot_id, prepare={r.uid: _nvidia_channel_entry(api, r, f"channel-{n}", cd_uid)
                                          for r, n in ((a, 1), (b, 2), (c, 3))})

    async def first() -> None:
        async with running(cd_config(node)) as (plugin, _conn):
            assert {u for u, r in plugin.state.claims().items() if r.phase is ClaimPhase.PREPARE_COMPLETED} == {
                a.uid, b.uid, c.uid}

    asyncio.run(first())
    claim_c = api.get("ResourceClaim", c.name, c.namespace)
    claim_c["status"]["allocation"]["devices"]["results"][0]["device"] = "channel-4"  # deallocated, allocated again
    api.update(claim_c, subresource="status")
    _nvidia_round(node, boot_id, unprepare=(a, c), prepare={
        c.uid: _nvidia_channel_entry(api, c, "channel-4", cd_uid),
        d.uid: _nvidia_channel_entry(api, d, "channel-5", cd_uid, CheckpointState.PREPARE_STARTED)})

    async def second() -> None:
        async with running(cd_config(node)) as (plugin, conn):
            assert plugin.state.get(a.uid) is None and not spec_path(node, a.uid).exists()
            assert plugin.state.get(d.uid) is None  # NVIDIA's half-prepared claim: rolled back
            record = plugin.state.get(c.uid)
            assert record is not None and [h.device for h in record.devices] == ["channel-4"]
            assert plugin.state.get(b.uid) is not None
            kept = _read(node)
            assert set(kept.claims) == {b.uid, c.uid}
            assert [dev.device.device_name for dev in kept.claims[c.uid].devices if dev.device] == ["channel-4"]
            assert not [u for u, r in plugin.state.claims().items() if "channel-3" in [h.device for h in r.devices]]
            assert await conn.unprepare([b, c]) == {b.uid: "", c.uid: ""}
            assert not spec_path(node, b.uid).exists() and not spec_path(node, c.uid).exists()
            assert _read(node).claims == {}

    asyncio.run(second())
