"""Switching in without draining: NVIDIA's ``gpu-kubelet-plugin`` prepares claims and stops; dradriver, started on the
same plugin directory and CDI root, adopts them from NVIDIA's ``checkpoint.json`` (an Event per claim, the
``dradriver_adopted_claims_total`` metric, one log line with the counts), holds their devices, and its unprepare
undoes what NVIDIA set up and removes NVIDIA's specs. The tests that run NVIDIA's binary are skipped, with the
reason, where it or its mock NVML is absent."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain import featuregates as fg
from dradriver.domain.claims import ClaimRef
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.nvcheckpoint import (
    Checkpoint,
    CheckpointEntry,
    CheckpointState,
    ConfigState,
    DeviceGroup,
    KubeletDevice,
    MigConcrete,
    PreparedDevice,
    encode,
)
from dradriver.domain.passthrough import vfio_uuid
from dradriver.host.claimstate import ClaimState
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint, write_checkpoint
from dradriver.kubeletplugin.adoption import GpuAdoption, adopt_nvidia_claims
from dradriver.kubeletplugin.payload import encode_payload
from dradriver.nvml import mock, settings
from dradriver.sandbox.node import SandboxNode
from tests import factories
from tests.configs.test_plugin import allocate
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation
from tests.plugin.test_dynamic_mig import _create_out_of_band as create_out_of_band
from tests.plugin.test_dynamic_mig import _lib as load_mock_nvml
from tests.plugin.test_dynamic_mig import state_lines
from tests.plugin.test_timeslicing import GATE_ON, session_of, time_slicing
from tests.rollback.peers import (
    claim,
    dradriver_process,
    kubelet_for,
    needs_nvidia,
    nvidia_process,
    prepared_by_nvidia,
    switched_node,
    use_this_boot,
)

PROFILES = Path(__file__).resolve().parents[2] / "dradriver" / "nvml" / "profiles"
NVIDIA_GATES = "--feature-gates=TimeSlicingSettings=true"


def _spec_files(cdi_root: Path, uid: str) -> list[str]:
    return sorted(p.name for p in cdi_root.iterdir() if uid in p.name)


def on_one_node(node: SandboxNode, path: Path) -> None:
    """Give NVIDIA's checkpoint at ``path`` the GPU UUIDs of ``node``'s mock NVML (by device name ``gpu-<index>``),
    re-encoded with its checksums. In the sandbox the two plugins run on two mock NVML libraries that name one GPU
    index differently; on a node both read the same GPU's UUID. Only ``gpu.info.uuid`` changes."""
    profile = json.loads((PROFILES / f"{node.profile}.json").read_text())
    uuids = [g["uuid"] for g in profile["gpus"]]
    stored = read_checkpoint(path)
    assert stored is not None

    def same_gpu(device: PreparedDevice) -> PreparedDevice:
        if device.kind != "gpu" or device.device is None:
            return device
        return dataclasses.replace(device, uuid=uuids[int(device.device.device_name.removeprefix("gpu-"))])

    claims = {uid: dataclasses.replace(e, groups=tuple(dataclasses.replace(g, devices=tuple(map(same_gpu, g.devices)))
                                                       for g in e.groups))
              for uid, e in stored.claims.items()}
    write_checkpoint(path, encode(Checkpoint(claims, stored.node_boot_id)))


def _events(node: SandboxNode, reason: str) -> list[str]:
    assert node.api is not None
    return [e["message"] for e in node.api.objects("Event") if e.get("reason") == reason]


@needs_nvidia
@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_an_admin_access_claim_and_its_workload_claim_nvidias_binary_prepared_on_one_gpu_are_held_after_the_switch(
        sandbox: SandboxNode, tmp_path: Path) -> None:
    """NVIDIA's own plugin prepares an admin-access claim and a workload claim on gpu-3 (it exempts admin access
    from its overlap check); dradriver starts on its checkpoint and serves: both adopted, gpu-3 refused to a third
    claim while the workload claim holds it, given once that is unprepared."""
    config, cdi_root, plugin_dir = switched_node(sandbox)
    assert sandbox.api is not None
    admin = ref_of(set_allocation(sandbox, sandbox.api.create(claim_object("admin")),
                                  [result("gpu-3", pool=sandbox.node_name, admin=True)]))
    workload = claim(sandbox, "workload", "gpu-3")
    asyncio.run(prepared_by_nvidia(sandbox, tmp_path, [admin, workload]))
    on_one_node(sandbox, plugin_dir / CHECKPOINT_FILE)
    log = tmp_path / "dradriver.log"

    async def with_dradriver() -> None:
        with dradriver_process(sandbox, log) as proc:
            async with kubelet_for(Path(config.kubelet_registrar_directory_path), proc, log) as kubelet:
                third = claim(sandbox, "third", "gpu-3")
                refused = (await kubelet.prepare([third]))[third.uid].error
                assert f"already prepared for claim / (uid {workload.uid})" in refused, refused
                assert await kubelet.unprepare([workload]) == {workload.uid: ""}
                assert (await kubelet.prepare([third]))[third.uid].error == ""
                assert await kubelet.unprepare([third, admin]) == {third.uid: "", admin.uid: ""}
                assert [p.name for p in cdi_root.iterdir() if "claim_" in p.name] == []

    asyncio.run(with_dradriver())
    assert "2 claim(s) adopted, 0 half-prepared to roll back, 0 dropped" in log.read_text()
    assert _events(sandbox, "ClaimNotAdopted") == []


@needs_nvidia
@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_claims_nvidia_prepared_are_adopted_held_and_unprepared_by_dradriver(sandbox: SandboxNode,
                                                                             tmp_path: Path) -> None:
    config, cdi_root, plugin_dir = switched_node(sandbox)

    refs = [claim(sandbox, f"full-{i}", f"gpu-{i}") for i in (2, 3)]
    refs.append(ref_of(allocate(sandbox, "sliced", [result("gpu-4", pool=sandbox.node_name)], [time_slicing("Long")])))
    asyncio.run(prepared_by_nvidia(sandbox, tmp_path, refs, NVIDIA_GATES))
    written = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
    assert written is not None
    assert {u: e.state for u, e in written.claims.items()} == {r.uid: CheckpointState.PREPARE_COMPLETED for r in refs}
    assert [g.config_state.time_slice_applied for g in written.claims[refs[2].uid].groups] == [True]
    # The GPU setting NVIDIA made: in the sandbox each plugin has its own mock NVML, so it is put on dradriver's
    # (one GPU, one setting, on a real node), through the mock's control file as its nvidia-smi stand-in does.
    on_one_node(sandbox, plugin_dir / CHECKPOINT_FILE)
    with sandbox.nvml_control.open("a") as control:
        control.write("set 4 computeTimeslice 3\n")
    log = tmp_path / "dradriver.log"

    async def with_dradriver() -> None:
        with dradriver_process(sandbox, log, feature_gates=GATE_ON) as proc:
            async with kubelet_for(Path(config.kubelet_registrar_directory_path), proc, log) as kubelet:
                other = claim(sandbox, "other", "gpu-3")
                refused = (await kubelet.prepare([other]))[other.uid].error
                assert f"already prepared for claim / (uid {refs[1].uid})" in refused, refused
                # the kubelet's Prepare after the switch is answered from what was adopted: nothing re-applied
                again = await kubelet.prepare(refs)
                assert [a.error for a in again.values()] == ["", "", ""]
                assert [d.device_name for r in refs for d in again[r.uid].devices] == ["gpu-2", "gpu-3", "gpu-4"]
                assert sandbox.nvml_control.read_text().count("computeTimeslice") == 1
                assert await kubelet.unprepare(refs) == {r.uid: "" for r in refs}
                for ref in refs:
                    assert _spec_files(cdi_root, ref.uid) == []
                assert sandbox.nvml_control.read_text().splitlines()[-1] == "set 4 computeTimeslice 0"
                after = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
                assert after is not None and not after.claims

    asyncio.run(with_dradriver())
    text = log.read_text()
    assert "3 claim(s) adopted, 0 half-prepared to roll back, 0 dropped" in text
    assert sorted(m.split("claim ")[1].split(" ")[0] for m in _events(sandbox, "ClaimAdopted")) == sorted(
        r.uid for r in refs)
    assert _events(sandbox, "ClaimStateCorrupt") == []


@needs_nvidia
@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_a_damaged_nvidia_checkpoint_is_not_guessed_at_and_its_claims_are_kept_from_their_specs(
        sandbox: SandboxNode, tmp_path: Path) -> None:
    use_this_boot(sandbox)
    config = sandbox.config()
    cdi_root = Path(config.cdi_root)
    path = Path(config.kubelet_plugins_directory_path) / GPU_DRIVER.driver_name / CHECKPOINT_FILE

    ref = claim(sandbox, "by-nvidia", "gpu-3")
    asyncio.run(prepared_by_nvidia(sandbox, tmp_path, [ref]))
    data = bytearray(path.read_bytes())
    at = data.index(b'"PrepareCompleted"') - 1  # one byte of the claim's entry (its state stays readable)
    data[at + 2:at + 3] = b"p"  # "PrepareCompleted" -> "prepareCompleted": the V2 checksum no longer verifies
    path.write_bytes(bytes(data))
    log = tmp_path / "dradriver.log"

    async def with_dradriver() -> None:
        with dradriver_process(sandbox, log) as proc:
            async with kubelet_for(Path(config.kubelet_registrar_directory_path), proc, log) as kubelet:
                other = claim(sandbox, "other", "gpu-3")
                assert f"already prepared for claim / (uid {ref.uid})" in (await kubelet.prepare([other]))[
                    other.uid].error
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}
                assert _spec_files(cdi_root, ref.uid) == []

    asyncio.run(with_dradriver())
    unusable = _events(sandbox, "NvidiaCheckpointUnusable")
    assert len(unusable) == 1 and "checksum" in unusable[0], unusable
    assert len(_events(sandbox, "ClaimStateCorrupt")) == 1
    assert _events(sandbox, "ClaimAdopted") == []


@needs_nvidia
@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_switching_back_and_forth_converges_on_what_the_last_driver_did(sandbox: SandboxNode,
                                                                       tmp_path: Path) -> None:
    """NVIDIA prepares A; dradriver adopts A and prepares B; NVIDIA unprepares A and prepares C; dradriver, back,
    forgets A (NVIDIA unprepared it: not brought back from dradriver's older claim state), adopts C, keeps B, and
    leaves nothing once B and C are unprepared."""
    use_this_boot(sandbox)
    config = sandbox.config()
    cdi_root = Path(config.cdi_root)
    path = Path(config.kubelet_plugins_directory_path) / GPU_DRIVER.driver_name / CHECKPOINT_FILE
    registrar = Path(config.kubelet_registrar_directory_path)
    a, b, c = (claim(sandbox, name, device) for name, device in (("a", "gpu-2"), ("b", "gpu-3"), ("c", "gpu-4")))

    async def nvidia(round_: int, prepare: list[ClaimRef], unprepare: list[ClaimRef]) -> None:
        work = tmp_path / f"nvidia-{round_}"
        work.mkdir()
        with nvidia_process(sandbox, work) as (proc, nv_registrar):
            async with kubelet_for(nv_registrar, proc, work / "nvidia.log") as kubelet:
                if unprepare:
                    assert await kubelet.unprepare(unprepare) == {r.uid: "" for r in unprepare}
                answers = await kubelet.prepare(prepare)
                assert [x.error for x in answers.values()] == [""] * len(prepare)
        on_one_node(sandbox, path)

    async def dradriver(log: Path, prepare: list[ClaimRef], held: list[ClaimRef], free: str) -> None:
        with dradriver_process(sandbox, log) as proc:
            async with kubelet_for(registrar, proc, log) as kubelet:
                if prepare:
                    assert [x.error for x in (await kubelet.prepare(prepare)).values()] == [""] * len(prepare)
                for ref in held:
                    device = {a.uid: "gpu-2", b.uid: "gpu-3", c.uid: "gpu-4"}[ref.uid]
                    other = claim(sandbox, f"other-{log.stem}-{device}", device)
                    assert ref.uid in (await kubelet.prepare([other]))[other.uid].error
                if free:
                    other = claim(sandbox, f"free-{log.stem}", free)
                    assert (await kubelet.prepare([other]))[other.uid].error == ""
                    assert await kubelet.unprepare([other]) == {other.uid: ""}
                if not prepare:
                    assert await kubelet.unprepare(held) == {r.uid: "" for r in held}

    asyncio.run(nvidia(1, [a], []))
    first = tmp_path / "dradriver-1.log"
    asyncio.run(dradriver(first, [b], [a, b], ""))
    asyncio.run(nvidia(2, [c], [a]))
    stored = read_checkpoint(path)
    assert stored is not None and set(stored.claims) == {b.uid, c.uid}
    second = tmp_path / "dradriver-2.log"
    asyncio.run(dradriver(second, [], [b, c], "gpu-2"))
    assert "1 claim(s) adopted, 0 half-prepared to roll back, 1 dropped" in second.read_text()
    assert [p.name for p in cdi_root.iterdir() if "claim_" in p.name] == []
    stored = read_checkpoint(path)
    assert stored is not None and not stored.claims
    assert "1 claim(s) adopted, 0 half-prepared to roll back, 0 dropped" in first.read_text()


def _nvidia_entry(node: SandboxNode, device: PreparedDevice, state: ConfigState | None = None) -> CheckpointEntry:
    return _nvidia_entry_on(node.node_name, device, state)


def _nvidia_entry_on(pool: str, device: PreparedDevice, state: ConfigState | None = None) -> CheckpointEntry:
    """A ``PrepareCompleted`` entry as NVIDIA's ``device_state.go`` writes it for one device (its ``status`` is the
    claim's allocation; one group with the group's ``configState``)."""
    assert device.device is not None
    results = [{"request": r, "driver": GPU_DRIVER.driver_name, "pool": pool,
                "device": device.device.device_name} for r in device.device.requests]
    return CheckpointEntry(CheckpointState.PREPARE_COMPLETED, {"allocation": {"devices": {"results": results}}},
                           (DeviceGroup((device,), state or ConfigState()),))


def _nvidia_spec(node: SandboxNode, uid: str, device: str) -> Path:
    """NVIDIA's claim spec ``k8s.gpu.nvidia.com-claim_<uid>.yaml`` naming ``<uid>-<device>`` (device nodes only)."""
    path = node.cdi_root / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"
    path.write_text(f"cdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices:\n- name: {uid}-{device}\n"
                    "  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n")
    return path


def test_mps_daemon_and_dynamic_mig_device_nvidia_prepared_are_undone_by_dradriver_unprepare() -> None:
    """NVIDIA's mock NVML has no MIG and its plugin's MPS daemon needs a cluster, so this checkpoint is built with
    the codec in NVIDIA's layout (``mig.concrete`` of a dynamic MIG device; ``configState.mpsControlDaemonID``
    with its Deployment ``mps-control-daemon-<id>`` and ``<plugin dir>/mps/<id>/{pipe,shm,log}``; the GPU in
    EXCLUSIVE_PROCESS), as NVIDIA's ``device_state.go`` and ``sharing.go`` leave them. dradriver adopts both claims
    without touching the instance or the daemon (with ``DynamicMIG`` on, so ``MPSSupport`` is off: NVIDIA's plugin
    could have run either way before the switch), then its unprepare destroys the instance, deletes the Deployment
    and the directories and puts the compute mode back."""
    gates = fg.parse_feature_gates("DynamicMIG=true")  # exclusive with MPSSupport: MPS daemons are undone anyway
    with SandboxNode(profile="dgx-h100", mig_state=True) as node:
        assert node.api is not None
        node.api.create(factories.DEVICE_CLASS)
        config = node.mps_config(feature_gates=gates)
        mig_name, mig_uid, mps_uid = "gpu-0-mig-1g10gb-19-3", str(uuid.uuid4()), str(uuid.uuid4())
        mock.activate("dgx-h100")  # the sandbox's own NVML, as the plugin loads it
        load_mock_nvml()  # pynvml below finds it by its soname
        create_out_of_band(0, 19, 3, 1)  # what NVIDIA's dynamic MIG prepare created for the claim
        [gi] = state_lines(node, "gi")
        [ci] = state_lines(node, "ci")
        profile = json.loads((PROFILES / "dgx-h100.json").read_text())
        gpu0, gpu1 = profile["gpus"][0]["uuid"], profile["gpus"][1]["uuid"]
        mig = PreparedDevice("mig", KubeletDevice(("gpu",), node.node_name, mig_name,
                                                  (f"k8s.gpu.nvidia.com/claim={mig_uid}-{mig_name}",)),
                             mig=MigConcrete(0, int(gi[2]), 0, ci[8], gpu0))
        daemon = f"{mps_uid}-abcde"
        gpu = PreparedDevice("gpu", KubeletDevice(("gpu",), node.node_name, "gpu-1",
                                                  (f"k8s.gpu.nvidia.com/claim={mps_uid}-gpu-1",)), uuid=gpu1)
        plugin_dir = Path(config.kubelet_plugins_directory_path) / GPU_DRIVER.driver_name
        plugin_dir.mkdir(parents=True, exist_ok=True)
        write_checkpoint(plugin_dir / CHECKPOINT_FILE, encode(Checkpoint({
            mig_uid: _nvidia_entry(node, mig),
            mps_uid: _nvidia_entry(node, gpu, ConfigState(mps_control_daemon_id=daemon))}, "")))
        specs = [_nvidia_spec(node, mig_uid, mig_name), _nvidia_spec(node, mps_uid, "gpu-1")]
        for sub in ("pipe", "shm", "log"):
            (config.mps_root / daemon / sub).mkdir(parents=True)
        node.api.create({"apiVersion": "apps/v1", "kind": "Deployment",
                         "metadata": {"name": f"mps-control-daemon-{daemon}", "namespace": config.namespace},
                         "spec": {"replicas": 1, "selector": {"matchLabels": {"app": daemon}},
                                  "template": {"metadata": {"labels": {"app": daemon}},
                                               "spec": {"containers": [{"name": "mps", "image": "x"}]}}}})
        with node.nvml_control.open("a") as control:
            control.write("set 1 computeMode 3\n")  # EXCLUSIVE_PROCESS, as NVIDIA's MPS prepare sets it

        def deployments() -> list[str]:
            assert node.api is not None
            return [d["metadata"]["name"] for d in node.api.objects("Deployment")]

        async def body() -> None:
            async with running(config) as (plugin, kubelet):
                assert plugin.recovery is not None and plugin.recovery.adopted == ()
                assert len(state_lines(node, "gi")) == 1 and deployments() == [f"mps-control-daemon-{daemon}"]
                assert settings.compute_mode(session_of(plugin), gpu1) is settings.ComputeMode.EXCLUSIVE_PROCESS
                assert plugin.metrics is not None and plugin.metrics.registry.get_sample_value(
                    "dradriver_adopted_claims_total", {"driver": "gpu.nvidia.com", "source": "nvidia-checkpoint"}) == 2
                other = claim(node, "other", mig_name)
                assert mig_uid in (await kubelet.prepare([other]))[other.uid].error
                refs = [ClaimRef("default", "nvidia-mig", mig_uid), ClaimRef("default", "nvidia-mps", mps_uid)]
                assert await kubelet.unprepare(refs) == {mig_uid: "", mps_uid: ""}
                assert state_lines(node, "gi") == [] and state_lines(node, "ci") == []
                assert deployments() == [] and not (config.mps_root / daemon).exists()
                assert settings.compute_mode(session_of(plugin), gpu1) is settings.ComputeMode.DEFAULT
                assert not any(p.exists() for p in specs)

        asyncio.run(body())
        assert _events(node, "ClaimAdopted") and len(_events(node, "ClaimAdopted")) == 2


def test_a_claim_nvidia_left_half_prepared_is_rolled_back_as_nvidia_would(sandbox: SandboxNode) -> None:
    """``PrepareStarted`` with a time-slice applied: dradriver's start resets the time-slice, deletes NVIDIA's spec and
    keeps no record of the claim (NVIDIA's plugin, at its next prepare of the claim, undoes and starts over)."""
    config = sandbox.config(feature_gates=GATE_ON)
    uid = str(uuid.uuid4())
    gpu = PreparedDevice("gpu", KubeletDevice(("gpu",), sandbox.node_name, "gpu-2",
                                              (f"k8s.gpu.nvidia.com/claim={uid}-gpu-2",)),
                         uuid=json.loads((PROFILES / f"{sandbox.profile}.json").read_text())["gpus"][2]["uuid"])
    entry = dataclasses.replace(_nvidia_entry(sandbox, gpu, ConfigState(time_slice_applied=True)),
                                state=CheckpointState.PREPARE_STARTED)
    plugin_dir = Path(config.kubelet_plugins_directory_path) / GPU_DRIVER.driver_name
    plugin_dir.mkdir(parents=True, exist_ok=True)
    write_checkpoint(plugin_dir / CHECKPOINT_FILE, encode(Checkpoint({uid: entry}, "")))
    spec = _nvidia_spec(sandbox, uid, "gpu-2")
    with sandbox.nvml_control.open("a") as control:
        control.write("set 2 computeTimeslice 2\n")  # what NVIDIA applied before it stopped

    async def body() -> None:
        async with running(config) as (plugin, _kubelet):
            assert plugin.recovery is not None and plugin.recovery.rolled_back == (uid,)
            assert plugin.state is not None and plugin.state.get(uid) is None
            assert not spec.exists()
            assert settings.compute_timeslice(session_of(plugin), gpu.uuid) == 0
            assert plugin.metrics is not None
            assert plugin.metrics.registry.get_sample_value(
                "dradriver_adopted_claims_total", {"driver": "gpu.nvidia.com", "source": "nvidia-checkpoint"}) == 0

    asyncio.run(body())


def test_an_adopted_vfio_device_gets_a_vfio_undo_record_from_its_vfio_info(caplog: pytest.LogCaptureFixture) -> None:
    """NVIDIA's ``vfio.info`` (``uuid``, ``pciBusID``) becomes the VFIO preparer's record (its unprepare gives the
    GPU back to ``nvidia``), pinned to the VFIO UUID; an entry without ``pciBusID`` is held without undo, warned."""
    address = "0000:2a:00.0"
    kubelet = KubeletDevice(("gpu",), "node-a", "gpu-vfio-1", ("k8s.gpu.nvidia.com/claim=u-gpu-vfio-1",))
    device = PreparedDevice("vfio", kubelet, uuid=vfio_uuid(address), pci_bus_id="00000000:2A:00.0")
    adopted = GpuAdoption("node-a", lambda _name: None).claim(_nvidia_entry_on("node-a", device))
    [record] = adopted.undo
    assert (record.kind, record.target, record.data["address"], record.data["originalDriver"]) == (
        "vfio", "gpu-vfio-1", address, "nvidia")
    assert adopted.pins == {"gpu-vfio-1": vfio_uuid(address)}
    bare = PreparedDevice("vfio", kubelet, uuid="GPU-1")
    with caplog.at_level("WARNING"):
        held = GpuAdoption("node-a", lambda _name: None).claim(_nvidia_entry_on("node-a", bare))
    assert [h.device for h in held.held] == ["gpu-vfio-1"] and held.undo == () and "pciBusID" in caplog.text


def test_a_static_mig_device_nvidia_prepared_is_held_refused_and_unprepared_without_destroying_its_instance() -> None:
    """NVIDIA's mock NVML publishes no MIG device (its config has no GPU instances: ``MIG mode enabled but no
    configured MIG devices``), so the entry is built with the codec in NVIDIA's layout: ``mig.concrete`` of a MIG
    device that existed before the claim (``dgx-a100``'s ``gpu-0``, GI 9 / CI 0). dradriver holds it (another claim
    is refused it), and its unprepare removes NVIDIA's spec and leaves the GPU and compute instance as they were
    (static MIG: the administrator made it, neither driver destroys it); the device can then be prepared again."""
    name, gi_id = "gpu-0-mig-1g5gb-19-2", 9
    with SandboxNode(profile="dgx-a100", mig_state=True) as node:
        assert node.api is not None
        node.api.create(factories.DEVICE_CLASS)
        config = node.config()
        profile = json.loads((PROFILES / "dgx-a100.json").read_text())
        gpu0 = profile["gpus"][0]
        [mig_uuid] = [c["uuid"] for gi in gpu0["gpuInstances"] if gi["id"] == gi_id for c in gi["computeInstances"]]
        uid = str(uuid.uuid4())
        device = PreparedDevice("mig", KubeletDevice(("gpu",), node.node_name, name,
                                                     (f"k8s.gpu.nvidia.com/claim={uid}-{name}",)),
                                mig=MigConcrete(0, gi_id, 0, mig_uuid, gpu0["uuid"]))
        plugin_dir = Path(config.kubelet_plugins_directory_path) / GPU_DRIVER.driver_name
        plugin_dir.mkdir(parents=True, exist_ok=True)
        write_checkpoint(plugin_dir / CHECKPOINT_FILE, encode(Checkpoint({uid: _nvidia_entry(node, device)}, "")))
        spec = _nvidia_spec(node, uid, name)

        async def body() -> None:
            async with running(config) as (plugin, kubelet):
                assert plugin.metrics is not None and plugin.metrics.registry.get_sample_value(
                    "dradriver_adopted_claims_total", {"driver": "gpu.nvidia.com", "source": "nvidia-checkpoint"}) == 1
                instances = state_lines(node, "gi"), state_lines(node, "ci")
                assert [int(gi[2]) for gi in instances[0] if gi[1] == "0"].count(gi_id) == 1, instances
                other = claim(node, "other", name)
                refused = (await kubelet.prepare([other]))[other.uid].error
                assert f"already prepared for claim / (uid {uid})" in refused, refused
                assert await kubelet.unprepare([ClaimRef("default", "by-nvidia", uid)]) == {uid: ""}
                assert not spec.exists()
                assert (state_lines(node, "gi"), state_lines(node, "ci")) == instances
                assert plugin.state is not None and plugin.state.get(uid) is None
                kept = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
                assert kept is not None and not kept.claims
                again = await kubelet.prepare([other])
                assert again[other.uid].error == "" and [d.device_name for d in again[other.uid].devices] == [name]
                assert await kubelet.unprepare([other]) == {other.uid: ""}
                assert (state_lines(node, "gi"), state_lines(node, "ci")) == instances

        asyncio.run(body())
        assert len(_events(node, "ClaimAdopted")) == 1


def _uuid(node: SandboxNode, index: int) -> str:
    return str(json.loads((PROFILES / f"{node.profile}.json").read_text())["gpus"][index]["uuid"])


def _gpu(node: SandboxNode, uid: str, index: int) -> PreparedDevice:
    name = f"gpu-{index}"
    return PreparedDevice("gpu", KubeletDevice(("gpu",), node.node_name, name,
                                               (f"k8s.gpu.nvidia.com/claim={uid}-{name}",)), uuid=_uuid(node, index))


def _write_nvidia_checkpoint(config: Any, claims: dict[str, CheckpointEntry], keep: bool = False) -> Path:
    """NVIDIA's checkpoint in the GPU plugin directory naming ``claims`` (``keep``: added to the file's entries,
    as NVIDIA, started on a node dradriver left, rewrites the file it reads)."""
    plugin_dir = Path(config.kubelet_plugins_directory_path) / GPU_DRIVER.driver_name
    plugin_dir.mkdir(parents=True, exist_ok=True)
    path = plugin_dir / CHECKPOINT_FILE
    stored = read_checkpoint(path) if keep else None
    write_checkpoint(path, encode(Checkpoint({**(stored.claims if stored else {}), **claims},
                                             stored.node_boot_id if stored else "")))
    return path


def test_an_admin_access_claim_and_a_workload_claim_nvidia_prepared_on_one_gpu_are_adopted_and_served(
        sandbox: SandboxNode) -> None:
    """NVIDIA lets an admin-access claim share a GPU with the claim that uses it (its overlap check exempts
    ``adminAccess`` results). dradriver adopts both, the admin claim's device as admin access: the plugin starts
    and serves, the GPU is refused to a third claim while the workload claim holds it and given once that is
    unprepared."""
    config = sandbox.config()
    admin, workload = str(uuid.uuid4()), str(uuid.uuid4())
    admin_entry = _nvidia_entry(sandbox, _gpu(sandbox, admin, 2))
    admin_entry = dataclasses.replace(admin_entry, status={"allocation": {"devices": {"results": [
        result("gpu-2", pool=sandbox.node_name, admin=True)]}}})
    _write_nvidia_checkpoint(config, {admin: admin_entry, workload: _nvidia_entry(sandbox, _gpu(sandbox, workload, 2))})
    specs = [_nvidia_spec(sandbox, admin, "gpu-2"), _nvidia_spec(sandbox, workload, "gpu-2")]

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.state is not None
            held = {uid: [(h.device, h.admin_access) for h in r.devices] for uid, r in plugin.state.claims().items()}
            assert held == {admin: [("gpu-2", True)], workload: [("gpu-2", False)]}
            third = claim(sandbox, "third", "gpu-2")
            assert workload in (await kubelet.prepare([third]))[third.uid].error
            assert await kubelet.unprepare([ClaimRef("default", "w", workload)]) == {workload: ""}
            assert (await kubelet.prepare([third]))[third.uid].error == ""
            assert await kubelet.unprepare([third, ClaimRef("default", "a", admin)]) == {third.uid: "", admin: ""}
            assert not any(p.exists() for p in specs)

    asyncio.run(body())
    assert len(_events(sandbox, "ClaimAdopted")) == 2


def test_a_claim_nvidia_prepared_on_a_device_dradriver_holds_is_not_adopted_and_the_plugin_serves(
        sandbox: SandboxNode) -> None:
    """An entry of NVIDIA's whose device a claim of dradriver's holds (two drivers each think they own gpu-2): the
    start is not stopped by it. The claim is not adopted, a ClaimNotAdopted Warning Event names both claims, its
    entry stays in the checkpoint for NVIDIA's plugin, dradriver's claim keeps the GPU, and other claims are
    prepared."""
    config = sandbox.config()
    ours = claim(sandbox, "ours", "gpu-2")

    async def prepare_ours() -> None:
        async with running(config) as (_plugin, kubelet):
            assert (await kubelet.prepare([ours]))[ours.uid].error == ""

    asyncio.run(prepare_ours())
    theirs = str(uuid.uuid4())
    path = _write_nvidia_checkpoint(config, {theirs: _nvidia_entry(sandbox, _gpu(sandbox, theirs, 2))}, keep=True)
    _nvidia_spec(sandbox, theirs, "gpu-2")

    async def restarted() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.state is not None
            record = plugin.state.get(ours.uid)
            assert record is not None and [h.device for h in record.devices] == ["gpu-2"]
            other = claim(sandbox, "other", "gpu-3")
            assert (await kubelet.prepare([other]))[other.uid].error == ""
            kept = read_checkpoint(path)
            assert kept is not None and {ours.uid, theirs, other.uid} <= set(kept.claims)

    asyncio.run(restarted())
    (event,) = _events(sandbox, "ClaimNotAdopted")
    assert theirs in event and ours.uid in event, event


def test_a_claim_nvidia_prepared_again_under_the_same_uid_is_held_as_nvidias_newer_entry_says(
        sandbox: SandboxNode, tmp_path: Path) -> None:
    """dradriver prepares X on gpu-2 and stops; NVIDIA unprepares X, whose claim is then allocated gpu-3 and
    prepared again by NVIDIA under the same UID. dradriver, back, holds gpu-3 for X as NVIDIA's entry says
    (its older record forgotten, nothing undone): gpu-2 is free, gpu-3 refused, and the unprepare leaves nothing."""
    config = sandbox.config()
    x = claim(sandbox, "x", "gpu-2")

    async def prepare_x() -> None:
        async with running(config) as (_plugin, kubelet):
            assert (await kubelet.prepare([x]))[x.uid].error == ""

    asyncio.run(prepare_x())
    for spec in sandbox.cdi_root.iterdir():  # NVIDIA's unprepare of X
        if x.uid in spec.name:
            spec.unlink()
    path = _write_nvidia_checkpoint(config, {x.uid: _nvidia_entry(sandbox, _gpu(sandbox, x.uid, 3))}, keep=True)
    spec = _nvidia_spec(sandbox, x.uid, "gpu-3")

    async def restarted() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.state is not None
            record = plugin.state.get(x.uid)
            assert record is not None and [h.device for h in record.devices] == ["gpu-3"]
            free, held = claim(sandbox, "on-2", "gpu-2"), claim(sandbox, "on-3", "gpu-3")
            answers = await kubelet.prepare([free, held])
            assert answers[free.uid].error == "" and x.uid in answers[held.uid].error
            assert await kubelet.unprepare([free, x]) == {free.uid: "", x.uid: ""}
            assert not spec.exists() and _spec_files(sandbox.cdi_root, x.uid) == []
            kept = read_checkpoint(path)
            assert kept is not None and kept.claims == {}

    asyncio.run(restarted())
    assert len(_events(sandbox, "ClaimAdopted")) == 1


def test_a_claim_nvidia_began_to_prepare_in_its_own_shape_is_rolled_back_and_leaves_the_checkpoint(
        sandbox: SandboxNode) -> None:
    """NVIDIA writes ``PrepareStarted`` with the claim's ``status``, ``name`` and ``namespace`` only, before it
    applies anything (``device_state.go`` Prepare). Its allocation says what NVIDIA may have set up: the claim's
    time-slicing config for gpu-2, which NVIDIA set before it stopped. dradriver's start resets that time-slice,
    deletes NVIDIA's spec, keeps no record of the claim, and drops the entry from the checkpoint (dradriver rolled it
    back, so NVIDIA, back on the node, has nothing to roll back)."""
    config = sandbox.config(feature_gates=GATE_ON)
    uid = str(uuid.uuid4())
    status = {"allocation": {"devices": {"results": [result("gpu-2", pool=sandbox.node_name)],
                                         "config": [time_slicing("Long")]}}}
    path = _write_nvidia_checkpoint(config, {uid: CheckpointEntry(CheckpointState.PREPARE_STARTED, status,
                                                                   name="half", namespace="default")})
    spec = _nvidia_spec(sandbox, uid, "gpu-2")
    with sandbox.nvml_control.open("a") as control:
        control.write("set 2 computeTimeslice 3\n")  # what NVIDIA applied before it stopped

    async def body() -> None:
        async with running(config) as (plugin, _kubelet):
            assert plugin.recovery is not None and plugin.recovery.rolled_back == (uid,)
            assert plugin.state is not None and plugin.state.get(uid) is None
            assert not spec.exists()
            assert settings.compute_timeslice(session_of(plugin), _uuid(sandbox, 2)) == 0
            kept = read_checkpoint(path)
            assert kept is not None and kept.claims == {}

    asyncio.run(body())


def test_a_checkpoint_of_another_boot_adopts_nothing(tmp_path: Path) -> None:
    """NVIDIA's boot-ID rule on the adoption side: a checkpoint whose ``nodeBootID`` is another boot's names claims
    that did not survive the reboot, so none is adopted; the same file of this boot is."""
    boot = tmp_path / "boot_id"
    boot.write_text("this-boot\n")
    uid = str(uuid.uuid4())
    device = PreparedDevice("gpu", KubeletDevice(("gpu",), "node-a", "gpu-1",
                                                 (f"k8s.gpu.nvidia.com/claim={uid}-gpu-1",)), uuid="GPU-1")
    path = tmp_path / CHECKPOINT_FILE

    def adopt(boot_id: str) -> tuple[str, ...]:
        write_checkpoint(path, encode(Checkpoint({uid: _nvidia_entry_on("node-a", device)}, boot_id)))
        state = ClaimState.open(tmp_path / f"{boot_id}.state", lock_path=tmp_path / f"{boot_id}.lock",
                                boot_id_path=boot)
        try:
            report = adopt_nvidia_claims(state, path, boot_id="this-boot",
                                         adoption=GpuAdoption("node-a", lambda _name: None),
                                         encode_payload=encode_payload, spec_of=lambda u: tmp_path / f"{u}.yaml")
            assert set(state.claims()) == set(report.adopted)
            return report.adopted
        finally:
            state.close()

    assert adopt("another-boot") == ()
    assert adopt("this-boot") == (uid,)


def test_a_time_sliced_group_without_time_slice_applied_is_reset_at_unprepare_as_nvidias_legacy_entries_are() -> None:
    """NVIDIA writes ``timeSliceApplied`` only as ``true`` (a ``*bool``); its unprepare resets the time-slice of a
    group when the flag is true or absent (a checkpoint of a release before the flag). An entry without it whose
    claim's config time-slices the GPU gets the ``timeslicing`` undo record; one whose config does not, none."""
    gpu = factories.gpu_device(1)
    uid = str(uuid.uuid4())
    device = PreparedDevice("gpu", KubeletDevice(("gpu",), "node-a", "gpu-1",
                                                 (f"k8s.gpu.nvidia.com/claim={uid}-gpu-1",)), uuid=gpu.uuid)
    adoption = GpuAdoption("node-a", lambda name: gpu if name == "gpu-1" else None)
    plain = _nvidia_entry_on("node-a", device)
    legacy = dataclasses.replace(plain, status={"allocation": {"devices": {
        "results": [result("gpu-1", pool="node-a")], "config": [time_slicing("Long")]}}})
    kinds = [r.kind for r in adoption.claim(legacy).undo]
    assert kinds == ["gpu", "timeslicing"]
    (record,) = [r for r in adoption.claim(legacy).undo if r.kind == "timeslicing"]
    assert record.data == {"gpus": [{"uuid": gpu.uuid, "timesliceSet": True}]}
    assert [r.kind for r in adoption.claim(plain).undo] == ["gpu"]


def test_a_mig_device_without_mig_concrete_is_held_with_a_warning_naming_the_missing_instance(
        caplog: pytest.LogCaptureFixture) -> None:
    device = PreparedDevice("mig", KubeletDevice(("gpu",), "node-a", "gpu-0-mig-1g10gb-19-0",
                                                 ("k8s.gpu.nvidia.com/claim=u-gpu-0-mig-1g10gb-19-0",)))
    with caplog.at_level("WARNING"):
        adopted = GpuAdoption("node-a", lambda _name: None).claim(_nvidia_entry_on("node-a", device))
    assert [h.device for h in adopted.held] == ["gpu-0-mig-1g10gb-19-0"] and adopted.undo == ()
    assert "mig.concrete" in caplog.text and "vfio" not in caplog.text


def test_without_the_kept_checkpoint_a_claim_adopted_and_unprepared_is_not_adopted_again_at_the_next_start(
        sandbox: SandboxNode) -> None:
    """``--nvidia-checkpoint=false``: dradriver writes no checkpoint, so NVIDIA's file would name an adopted claim at
    every later start, also after dradriver unprepared it (adopted again, its spec rewritten, its GPU held by a claim
    nobody has). Once its claims are adopted the file is kept aside, and the next start holds nothing."""
    config = sandbox.config(nvidia_checkpoint=False)
    uid = str(uuid.uuid4())
    path = _write_nvidia_checkpoint(config, {uid: _nvidia_entry(sandbox, _gpu(sandbox, uid, 1))})
    spec = _nvidia_spec(sandbox, uid, "gpu-1")

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            assert plugin.state is not None and set(plugin.state.claims()) == {uid}
            assert not path.exists() and list(path.parent.glob(f"{CHECKPOINT_FILE}.adopted-*"))
            assert await kubelet.unprepare([ClaimRef("default", "by-nvidia", uid)]) == {uid: ""}
        async with running(config) as (plugin, kubelet):
            assert plugin.state is not None and plugin.state.claims() == {}
            other = claim(sandbox, "other", "gpu-1")
            assert (await kubelet.prepare([other]))[other.uid].error == ""
            assert await kubelet.unprepare([other]) == {other.uid: ""}

    asyncio.run(body())
    assert not spec.exists()
