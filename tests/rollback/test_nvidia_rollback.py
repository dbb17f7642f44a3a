"""Rolling back to NVIDIA's driver: dradriver prepares claims and stops (gracefully, or SIGKILLed); NVIDIA's own
``gpu-kubelet-plugin`` starts on the same plugin directory and CDI root, accepts the checkpoint dradriver kept
(it exits 1 on a checksum it cannot verify), refuses the held devices to other claims, and unprepares every claim,
leaving no CDI spec behind. Skipped, with the reason, where NVIDIA's binary or its mock NVML is absent."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from dradriver.domain import mps
from dradriver.domain.claims import ClaimRef
from dradriver.domain.nvcheckpoint import CheckpointState
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode
from tests.configs.test_plugin import allocate
from tests.plugin.conftest import ref_of, result
from tests.plugin.test_timeslicing import GATE_ON, entry, params, time_slicing
from tests.rollback.peers import (
    NVIDIA_A100,
    claim,
    dradriver_process,
    kubelet_for,
    needs_nvidia,
    nvidia_process,
    prepared_by_nvidia,
    stop,
    switched_node,
    use_this_boot,
)

pytestmark = needs_nvidia


def _spec_files(cdi_root: Path, uid: str) -> list[str]:
    return sorted(p.name for p in cdi_root.iterdir() if uid in p.name)


async def _static_mig_device(node: SandboxNode) -> str:
    """A MIG device of ``gpu-0`` from the node's published ResourceSlice (waits for it)."""
    assert node.api is not None
    for _ in range(600):
        names = [d["name"] for s in node.api.objects("ResourceSlice") if s["spec"].get("nodeName") == node.node_name
                 for d in s["spec"].get("devices", ())]
        found = [n for n in names if n.startswith("gpu-0-mig-")]
        if found:
            return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no static MIG device of gpu-0 published")


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
@pytest.mark.parametrize("how", ["graceful", "sigkill"])
def test_nvidia_plugin_takes_over_the_claims_dradriver_prepared(sandbox: SandboxNode, tmp_path: Path,
                                                                 how: str) -> None:
    config, cdi_root, plugin_dir = switched_node(sandbox)
    full = [claim(sandbox, f"full-{i}", f"gpu-{i}") for i in (2, 3)]
    sliced = ref_of(allocate(sandbox, "sliced", [result("gpu-4", pool=sandbox.node_name)], [time_slicing("Long")]))
    log = tmp_path / "dradriver.log"

    async def with_dradriver() -> list[ClaimRef]:
        with dradriver_process(sandbox, log, feature_gates=GATE_ON) as proc:
            async with kubelet_for(Path(config.kubelet_registrar_directory_path), proc, log) as kubelet:
                refs = [*full, claim(sandbox, "mig", await _static_mig_device(sandbox)), sliced]
                answers = await kubelet.prepare(refs)
                assert all(a.error == "" for a in answers.values()), answers
                stop(proc, how)
        return refs

    refs = asyncio.run(with_dradriver())
    kept = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
    assert kept is not None
    assert {uid: e.state for uid, e in kept.claims.items()} == {r.uid: CheckpointState.PREPARE_COMPLETED
                                                                for r in refs}
    assert [d.kind for r in refs for d in kept.claims[r.uid].devices] == ["gpu", "gpu", "mig", "gpu"]
    assert kept.claims[sliced.uid].groups[0].config_state.time_slice_applied
    mig = kept.claims[refs[2].uid].devices[0].mig
    assert mig is not None and mig.mig_uuid.startswith("MIG-")

    async def with_nvidia() -> None:
        with nvidia_process(sandbox, tmp_path) as (proc, registrar):
            async with kubelet_for(registrar, proc, tmp_path / "nvidia.log") as kubelet:
                other = claim(sandbox, "other", "gpu-2")
                refused = (await kubelet.prepare([other]))[other.uid].error
                assert f"already allocated to different claim {refs[0].uid}" in refused
                # a free device is prepared as usual beside dradriver's entries (no entry lacks its allocation)
                free = claim(sandbox, "free", "gpu-5")
                assert (await kubelet.prepare([free]))[free.uid].error == ""
                assert await kubelet.unprepare([*refs, free]) == {r.uid: "" for r in [*refs, free]}
                assert proc.poll() is None
            for ref in refs:
                assert _spec_files(cdi_root, ref.uid) == []
            after = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
            assert after is not None and not after.claims

    asyncio.run(with_nvidia())


def test_a_claim_nvidia_prepared_is_held_by_dradriver_after_the_switch(sandbox: SandboxNode, tmp_path: Path) -> None:
    """Switching in (the other direction): NVIDIA's plugin prepares a claim and stops; dradriver, started on the same
    directories, recognises NVIDIA's ``.yaml`` spec as a claim spec of its kind, holds the claim's device (another
    claim is refused it) and its unprepare removes NVIDIA's spec (the claim is adopted from NVIDIA's checkpoint;
    ``test_nvidia_switchin.py`` checks the rest of the switch)."""
    use_this_boot(sandbox)
    config = sandbox.config()
    cdi_root = Path(config.cdi_root)

    ref = claim(sandbox, "by-nvidia", "gpu-3")
    asyncio.run(prepared_by_nvidia(sandbox, tmp_path, [ref]))
    assert _spec_files(cdi_root, ref.uid) == [f"k8s.gpu.nvidia.com-claim_{ref.uid}.yaml"]
    log = tmp_path / "dradriver.log"

    async def with_dradriver() -> None:
        with dradriver_process(sandbox, log) as proc:
            async with kubelet_for(Path(config.kubelet_registrar_directory_path), proc, log) as kubelet:
                other = claim(sandbox, "other", "gpu-3")
                refused = (await kubelet.prepare([other]))[other.uid].error
                assert f"already prepared for claim / (uid {ref.uid})" in refused
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}
                assert _spec_files(cdi_root, ref.uid) == []

    asyncio.run(with_dradriver())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_nvidia_plugin_stops_the_mps_control_daemon_dradriver_started_and_leaves_nothing(
        sandbox: SandboxNode, tmp_path: Path) -> None:
    """dradriver prepares an MPS-shared GPU (its control daemon Deployment ``mps-control-daemon-<id>`` runs in the
    sandbox, ``<plugin dir>/mps/<id>`` with its tmpfs ``shm``) and stops; NVIDIA's plugin (``MPSSupport`` on, the
    daemons' namespace) starts on the kept checkpoint and its unprepare stops the daemon: the Deployment and its
    Pod are deleted, the tmpfs unmounted, the directory removed, the spec gone, the checkpoint empty."""
    config, cdi_root, plugin_dir = switched_node(sandbox)
    sandbox.run_workloads()
    mps_config = sandbox.mps_config()
    gpu = "gpu-5"
    ref = ref_of(allocate(sandbox, "mps", [result(gpu, pool=sandbox.node_name)], [entry(params(sharing={
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}))]))
    log = tmp_path / "dradriver.log"
    assert sandbox.api is not None

    def deployments() -> list[str]:
        assert sandbox.api is not None
        return [d["metadata"]["name"] for d in sandbox.api.objects("Deployment", SANDBOX_NAMESPACE)]

    async def with_dradriver() -> str:
        with dradriver_process(sandbox, log, feature_gates=mps_config.feature_gates, namespace=SANDBOX_NAMESPACE,
                               image_name=mps_config.image_name,
                               nvidia_driver_root=mps_config.nvidia_driver_root) as proc:
            async with kubelet_for(Path(config.kubelet_registrar_directory_path), proc, log) as kubelet:
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                stop(proc, "graceful")
        kept = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
        assert kept is not None
        (group,) = kept.claims[ref.uid].groups
        return group.config_state.mps_control_daemon_id

    daemon = asyncio.run(with_dradriver())
    directory = mps_config.mps_root / daemon
    assert deployments() == [f"mps-control-daemon-{daemon}"]
    assert sandbox.mounts.is_mounted(directory / mps.SHM_DIR)
    assert _spec_files(cdi_root, ref.uid) == [f"k8s.gpu.nvidia.com-claim_{ref.uid}.yaml"]

    async def with_nvidia() -> None:
        with nvidia_process(sandbox, tmp_path, NVIDIA_A100, "--feature-gates=MPSSupport=true",
                            f"--namespace={SANDBOX_NAMESPACE}") as (proc, registrar):
            async with kubelet_for(registrar, proc, tmp_path / "nvidia.log") as kubelet:
                other = claim(sandbox, "other", gpu)
                assert f"already allocated to different claim {ref.uid}" in (await kubelet.prepare([other]))[
                    other.uid].error
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}, (tmp_path / "nvidia.log").read_text()[-3000:]
                assert proc.poll() is None

    asyncio.run(with_nvidia())
    assert deployments() == []
    # the daemon's Pod goes as on a node: its container is stopped (the runner's finalizer), then it is deleted
    for _ in range(600):
        if not sandbox.api.objects("Pod", SANDBOX_NAMESPACE):
            break
        time.sleep(0.05)
    assert [p["metadata"]["name"] for p in sandbox.api.objects("Pod", SANDBOX_NAMESPACE)] == []
    assert not sandbox.mounts.is_mounted(directory / mps.SHM_DIR)
    assert not directory.exists()
    assert _spec_files(cdi_root, ref.uid) == []
    after = read_checkpoint(plugin_dir / CHECKPOINT_FILE)
    assert after is not None and not after.claims
