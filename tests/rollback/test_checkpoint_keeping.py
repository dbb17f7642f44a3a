"""dradriver's GPU plugin keeps NVIDIA's ``checkpoint.json`` true (:mod:`dradriver.kubeletplugin.rollback`): a claim
is named before its Prepare is answered and gone before its Unprepare is, with its whole status; concurrent calls
share rewrites; a restart keeps it, a damaged one is set aside and rebuilt; ``--nvidia-checkpoint=false`` turns it
off."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dradriver.domain import mps
from dradriver.domain.nvcheckpoint import (
    Checkpoint,
    CheckpointEntry,
    CheckpointState,
    DeviceGroup,
    KubeletDevice,
    MigConcrete,
    PreparedDevice,
    encode,
)
from dradriver.host.claimstate import ClaimPhase, ClaimRecord, ClaimState, HeldDevice
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint, write_checkpoint
from dradriver.kubeletplugin.adoption import ForeignClaims, converge
from dradriver.kubeletplugin.payload import encode_payload
from dradriver.kubeletplugin.rollback import RollbackCheckpoint
from dradriver.sandbox.node import SandboxNode
from tests.configs.test_plugin import allocate
from tests.factories import DEVICE_CLASS
from tests.mps.test_plugin import mps_claim
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation
from tests.plugin.test_dynamic_mig import GATES as DYNAMIC_MIG
from tests.plugin.test_dynamic_mig import ONE_G
from tests.plugin.test_timeslicing import GATE_ON, time_slicing

UID = "0b9f1c0e-5f1a-4c4e-9d65-1c2f3a4b5c6d"


def _checkpoint(node: SandboxNode) -> Path:
    return Path(node.config().kubelet_plugins_directory_path) / "gpu.nvidia.com" / CHECKPOINT_FILE


def _boot_id(node: SandboxNode) -> str:
    return (node.root / "proc" / "sys" / "kernel" / "random" / "boot_id").read_text().strip()


def test_a_claim_is_in_the_checkpoint_before_its_prepare_is_answered_and_gone_before_its_unprepare(
        sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None

    async def body() -> None:
        async with running(sandbox.config()) as (_plugin, kubelet):
            stored = set_allocation(sandbox, api.create(claim_object("a")), [result("gpu-3")])
            stored["status"]["reservedFor"] = [{"resource": "pods", "name": "pod-a", "uid": "1234"}]
            ref = ref_of(api.update(stored, subresource="status"))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            kept = read_checkpoint(_checkpoint(sandbox))
            assert kept is not None and kept.node_boot_id == _boot_id(sandbox)
            entry = kept.claims[ref.uid]
            assert entry.state is CheckpointState.PREPARE_COMPLETED
            assert entry.status["reservedFor"] == [{"resource": "pods", "name": "pod-a", "uid": "1234"}]
            assert entry.status["allocation"]["devices"]["results"][0]["device"] == "gpu-3"
            (device,) = entry.devices
            assert device.kind == "gpu" and device.uuid.startswith("GPU-") and device.device is not None
            assert device.device.cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-3",)
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            after = read_checkpoint(_checkpoint(sandbox))
            assert after is not None and ref.uid not in after.claims

    asyncio.run(body())


def test_concurrent_prepares_share_checkpoint_rewrites(sandbox: SandboxNode) -> None:
    """Eight one-claim Prepare calls at once: every claim is named when its answer comes, with fewer rewrites than
    claims when calls overlap (group commit), never more than one per claim."""
    api = sandbox.api
    assert api is not None

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            refs = [ref_of(set_allocation(sandbox, api.create(claim_object(f"c{i}")), [result(f"gpu-{i}")]))
                    for i in range(8)]
            checkpoint = plugin.runner.checkpoint
            assert checkpoint is not None
            before = checkpoint.writes
            answers = await asyncio.gather(*(kubelet.prepare([r]) for r in refs))
            assert all(a[r.uid].error == "" for a, r in zip(answers, refs, strict=True))
            kept = read_checkpoint(_checkpoint(sandbox))
            assert kept is not None and set(kept.claims) == {r.uid for r in refs}
            assert 1 <= checkpoint.writes - before <= len(refs)

    asyncio.run(body())


def test_a_prepare_and_an_unprepare_rewrite_the_checkpoint_once_per_call(sandbox: SandboxNode) -> None:
    """One rewrite per Prepare call and one per Unprepare call, whatever the claims of the call: a claim is named
    once its completion is in the claim state (a PREPARE_STARTED claim is in no checkpoint, so there is nothing to
    write before it), and the rewrite before the answer covers every claim of the call."""
    api = sandbox.api
    assert api is not None

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            checkpoint = plugin.runner.checkpoint
            assert checkpoint is not None
            one = ref_of(set_allocation(sandbox, api.create(claim_object("one")), [result("gpu-0")]))
            batch = [ref_of(set_allocation(sandbox, api.create(claim_object(f"b{i}")), [result(f"gpu-{i + 1}")]))
                     for i in range(3)]
            for refs in ([one], batch):
                before = checkpoint.writes
                assert all(a.error == "" for a in (await kubelet.prepare(refs)).values())
                assert checkpoint.writes - before == 1
                kept = read_checkpoint(_checkpoint(sandbox))
                assert kept is not None and {r.uid for r in refs} <= set(kept.claims)
            for refs in ([one], batch):
                before = checkpoint.writes
                assert await kubelet.unprepare(refs) == {r.uid: "" for r in refs}
                assert checkpoint.writes - before == 1
            kept = read_checkpoint(_checkpoint(sandbox))
            assert kept is not None and kept.claims == {}

    asyncio.run(body())


def test_a_restart_keeps_the_checkpoint_and_a_damaged_one_is_rebuilt(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None
    path = _checkpoint(sandbox)

    async def body() -> None:
        async with running(sandbox.config()) as (_plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("a")), [result("gpu-1")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        first = read_checkpoint(path)
        assert first is not None and set(first.claims) == {ref.uid}
        async with running(sandbox.config()):
            again = read_checkpoint(path)
            assert again == first  # the status seen at prepare is kept across the restart
        path.write_bytes(path.read_bytes().replace(b"gpu-1", b"gpu-2"))  # damaged: its checksums fail
        async with running(sandbox.config()):
            rebuilt = read_checkpoint(path)
            assert rebuilt is not None and set(rebuilt.claims) == {ref.uid}
            results = rebuilt.claims[ref.uid].status["allocation"]["devices"]["results"]
            assert [r["device"] for r in results] == ["gpu-1"]  # rebuilt from the claim state, not the damage
            assert [p.name for p in path.parent.glob(f"{CHECKPOINT_FILE}.corrupt-*")]

    asyncio.run(body())


def test_the_checkpoint_can_be_turned_off(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None

    async def body() -> None:
        async with running(sandbox.config(nvidia_checkpoint=False)) as (plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("a")), [result("gpu-1")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert plugin.runner.checkpoint is None
        assert not _checkpoint(sandbox).exists()

    asyncio.run(body())


def test_a_time_sliced_claim_says_so_in_its_config_state(sandbox: SandboxNode) -> None:
    """dradriver's time-slice is NVIDIA's ``timeSliceApplied``: NVIDIA's unprepare then resets it, as dradriver's
    would."""

    async def body() -> None:
        async with running(sandbox.config(feature_gates=GATE_ON)) as (_plugin, kubelet):
            ref = ref_of(allocate(sandbox, "ts", [result("gpu-0")], [time_slicing("Long")]))
            plain = ref_of(allocate(sandbox, "plain", [result("gpu-1")], []))
            answers = await kubelet.prepare([ref, plain])
            assert all(not a.error for a in answers.values()), answers
            kept = read_checkpoint(_checkpoint(sandbox))
            assert kept is not None
            assert [g.config_state.time_slice_applied for g in kept.claims[ref.uid].groups] == [True]
            assert [g.config_state.time_slice_applied for g in kept.claims[plain.uid].groups] == [False]
            assert kept.claims[ref.uid].status["allocation"]["devices"]["config"][0]["opaque"]["parameters"][
                "sharing"]["strategy"] == "TimeSlicing"

    asyncio.run(body())


def test_a_dynamic_mig_device_is_named_by_the_instances_it_created() -> None:
    """A MIG device the claim created is NVIDIA's ``mig.concrete`` with its GPU and compute instance IDs (what
    NVIDIA's unprepare destroys)."""
    with SandboxNode(profile="dgx-h100", mig_state=True) as mig_node:  # the mock keeps MIG state
        api = mig_node.api
        assert api is not None
        api.create(DEVICE_CLASS)
        asyncio.run(_prepare_dynamic(mig_node))


async def _prepare_dynamic(mig_node: SandboxNode) -> None:
    api = mig_node.api
    assert api is not None
    async with running(mig_node.config(feature_gates=DYNAMIC_MIG)) as (_plugin, kubelet):
        device = ONE_G.format(m=0, s=3)
        ref = ref_of(set_allocation(mig_node, api.create(claim_object("one-g")), [result(device)]))
        assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        kept = read_checkpoint(_checkpoint(mig_node))
        assert kept is not None
        (prepared,) = kept.claims[ref.uid].devices
        assert prepared.kind == "mig" and prepared.mig is not None
        assert (prepared.mig.parent_minor, prepared.mig.gi_id, prepared.mig.ci_id) == (0, 7, 0)
        assert prepared.mig.mig_uuid.startswith("MIG-") and prepared.mig.parent_uuid.startswith("GPU-")


def test_a_prepare_is_not_acknowledged_until_the_checkpoint_names_it(sandbox: SandboxNode) -> None:
    """When the checkpoint cannot be written the kubelet gets an error (the claim state already holds the claim);
    its retry is answered from the claim state and writes the checkpoint then. The same for an unprepare."""
    api = sandbox.api
    assert api is not None
    path = _checkpoint(sandbox)

    async def body() -> None:
        async with running(sandbox.config()) as (_plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("a")), [result("gpu-5")]))
            path.unlink()
            path.mkdir()  # the rename over it fails
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert f"claim {ref.uid}: cannot write NVIDIA's checkpoint {path}" in error
            path.rmdir()
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            kept = read_checkpoint(path)
            assert kept is not None and ref.uid in kept.claims
            path.unlink()
            path.mkdir()
            assert "cannot write NVIDIA's checkpoint" in (await kubelet.unprepare([ref]))[ref.uid]
            path.rmdir()
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            after = read_checkpoint(path)
            assert after is not None and ref.uid not in after.claims

    asyncio.run(body())


def _record(uid: str, device: str) -> ClaimRecord:
    return ClaimRecord(uid, ClaimPhase.PREPARE_COMPLETED, "ns", "c", (HeldDevice(("gpu",), "node-a", device, ()),), b"")


def test_at_start_entries_another_plugin_wrote_are_kept_and_another_boots_are_dropped(tmp_path: Path) -> None:
    """The claims NVIDIA's plugin prepared (or began to) before the switch stay in the file until unprepared; a
    checkpoint of another boot is dropped, as NVIDIA drops it; dradriver's own claims are named either way."""
    path = tmp_path / CHECKPOINT_FILE
    ours, theirs, started = "a" * 8 + UID[8:], "b" * 8 + UID[8:], "c" * 8 + UID[8:]

    def entry(state: CheckpointState, device: str) -> CheckpointEntry:
        return CheckpointEntry(state, {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device}]}}})

    def keeper(boot: str) -> RollbackCheckpoint:
        return RollbackCheckpoint(path, boot_id=boot, driver="gpu.nvidia.com", describe=lambda _name: None)

    write_checkpoint(path, encode(Checkpoint({theirs: entry(CheckpointState.PREPARE_COMPLETED, "gpu-1"),
                                              started: entry(CheckpointState.PREPARE_STARTED, "gpu-2")}, "boot-1")))
    keeper("boot-1").load({ours: _record(ours, "gpu-0")})
    kept = read_checkpoint(path)
    assert kept is not None
    assert {u: e.state for u, e in kept.claims.items()} == {ours: CheckpointState.PREPARE_COMPLETED,
                                                            theirs: CheckpointState.PREPARE_COMPLETED,
                                                            started: CheckpointState.PREPARE_STARTED}
    keeper("boot-2").load({ours: _record(ours, "gpu-0")})
    again = read_checkpoint(path)
    assert again is not None and set(again.claims) == {ours} and again.node_boot_id == "boot-2"


def test_an_mps_claim_names_its_control_daemon_for_nvidias_unprepare(sandbox: SandboxNode) -> None:
    """dradriver's MPS control daemon has NVIDIA's ID, Deployment name and layout: the claim's group carries it as
    ``mpsControlDaemonID``, so NVIDIA's unprepare stops it; a device of the claim without sharing is its own group."""
    sandbox.run_workloads()

    async def body() -> None:
        async with running(sandbox.mps_config()) as (plugin, kubelet):
            ref, stored = mps_claim(sandbox, "mps", count=2)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            names = sorted(r["device"] for r in stored["status"]["allocation"]["devices"]["results"])
            uuids = sorted(g.uuid for g in plugin.inventory.gpus if g.name in names)
            kept = read_checkpoint(_checkpoint(sandbox))
            assert kept is not None
            (group,) = kept.claims[ref.uid].groups
            assert group.config_state.mps_control_daemon_id == mps.control_daemon_id(ref.uid, uuids)
            assert sorted(d.device.device_name for d in group.devices if d.device) == names

    asyncio.run(body())


def test_an_entry_rebuilt_at_start_names_a_consumable_shares_share_id_and_is_taken_as_dradrivers_own(
        tmp_path: Path) -> None:
    """A claim holding a consumable share whose entry is rebuilt from the claim state (the file was lost) names
    its ``ShareID`` as the entry written at its prepare did; at the next start that entry is recognised as the one
    dradriver wrote (the switching rule, :func:`~dradriver.kubeletplugin.adoption.converge`, does not take it for
    a claim NVIDIA prepared again)."""
    path = tmp_path / CHECKPOINT_FILE
    uid = "d" * 8 + UID[8:]
    share = "2f2b1c1e-7d6f-4c55-9a57-5a4e0c1d2b3a"
    record = ClaimRecord(uid, ClaimPhase.PREPARE_COMPLETED, "ns", "c",
                         (HeldDevice(("gpu",), "node-a", "gpu-0", (f"k8s.gpu.nvidia.com/claim={uid}-gpu-0",),
                                     admin_access=True),),  # the store's "not exclusive" flag, as read back
                         encode_payload("spec", [], shares={"gpu-0": share}).encode())
    keeper = RollbackCheckpoint(path, boot_id="boot-1", driver="gpu.nvidia.com", describe=lambda _name: None)
    keeper.load({uid: record})
    kept = read_checkpoint(path)
    assert kept is not None
    (device,) = kept.claims[uid].devices
    assert device.device is not None and device.device.share_id == share
    results = kept.claims[uid].status["allocation"]["devices"]["results"]
    assert results == [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0",
                        "shareID": share}]
    foreign = ForeignClaims({}, frozenset(kept.claims), True, dict(kept.claims))
    state = ClaimState.open(tmp_path / "claims.state", lock_path=tmp_path / "lock", boot_id_path=_boot(tmp_path))
    try:
        state.prepare_started(uid, namespace="ns", name="c", devices=record.devices, payload=record.payload)
        state.prepare_completed(uid)
        with state.locked():
            converged = converge(state, foreign, spec_of=lambda _u: tmp_path / "spec", own_groups=keeper.groups_of)
        assert converged.replaced == () and converged.dropped == () and state.get(uid) is not None
    finally:
        state.close()


def _boot(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("boot-1\n")
    return path


def test_a_mig_claim_whose_device_is_not_known_at_this_start_is_not_taken_for_one_nvidia_prepared_again(
        tmp_path: Path) -> None:
    """dradriver's entry of a static MIG claim names the MIG instance as discovered at its prepare. At a start
    where that device is not known (the driver away: nothing discovered), dradriver's entry of the record cannot
    name the instance, and the switching rule does not take the difference for NVIDIA's prepare again: the record
    stays. An entry naming another device for the claim is NVIDIA's newer one: the record is replaced."""
    uid = "e" * 8 + UID[8:]
    name = "gpu-0-mig-1g10gb-19-0"
    record = ClaimRecord(uid, ClaimPhase.PREPARE_COMPLETED, "ns", "c",
                         (HeldDevice(("gpu",), "node-a", name, (f"k8s.gpu.nvidia.com/claim={uid}-{name}",)),),
                         encode_payload("spec", []).encode())
    mig = PreparedDevice("mig", KubeletDevice(("gpu",), "node-a", name, (f"k8s.gpu.nvidia.com/claim={uid}-{name}",)),
                         mig=MigConcrete(0, 7, 0, "MIG-1", "GPU-0"))
    keeper = RollbackCheckpoint(tmp_path / CHECKPOINT_FILE, boot_id="boot-1", driver="gpu.nvidia.com",
                                describe=lambda _name: None)

    def converged(device: PreparedDevice) -> tuple[str, ...]:
        entry = CheckpointEntry(CheckpointState.PREPARE_COMPLETED, {}, (DeviceGroup((device,)),))
        state = ClaimState.open(tmp_path / f"{device.kind}{id(device)}.state", lock_path=tmp_path / "lock",
                                boot_id_path=_boot(tmp_path))
        try:
            state.prepare_started(uid, namespace="ns", name="c", devices=record.devices, payload=record.payload)
            state.prepare_completed(uid)
            with state.locked():
                return converge(state, ForeignClaims({}, frozenset({uid}), True, {uid: entry}),
                                spec_of=lambda _u: tmp_path / "spec", own_groups=keeper.groups_of).replaced
        finally:
            state.close()

    assert converged(mig) == ()
    other = "gpu-1-mig-1g10gb-19-0"
    assert converged(PreparedDevice("mig", KubeletDevice(("gpu",), "node-a", other, (
        f"k8s.gpu.nvidia.com/claim={uid}-{other}",)), mig=MigConcrete(1, 7, 0, "MIG-2", "GPU-1"))) == (uid,)


def test_a_claim_unprepared_just_before_a_sigkill_that_left_the_checkpoint_unwritten_is_not_adopted_at_start(
        sandbox: SandboxNode) -> None:
    """A SIGKILL between the unprepare's claim-state commit and the checkpoint's rewrite leaves an entry for a claim
    dradriver no longer holds, in a file dradriver wrote last: the next start must not take it for NVIDIA's claim
    (which would hold the GPU until the kubelet's retry). The file and its mark are put back as they were before the
    unprepare's rewrite, which is what the killed plugin left."""
    api = sandbox.api
    assert api is not None
    path = _checkpoint(sandbox)
    mark = path.with_name(f".{path.name}.dradriver-written")

    async def body() -> None:
        async with running(sandbox.config()) as (_plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("a")), [result("gpu-1")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            before, before_mark = path.read_bytes(), mark.read_bytes()
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
        path.write_bytes(before)
        mark.write_bytes(before_mark)
        async with running(sandbox.config()) as (plugin, kubelet):
            assert ref.uid not in plugin.state.claims()
            kept = read_checkpoint(path)
            assert kept is not None and ref.uid not in kept.claims
            other = ref_of(set_allocation(sandbox, api.create(claim_object("b")), [result("gpu-1")]))
            assert (await kubelet.prepare([other]))[other.uid].error == ""  # gpu-1 is free

    asyncio.run(body())
