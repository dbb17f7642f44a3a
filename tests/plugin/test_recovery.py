"""Crash safety and start-up recovery of the kubelet plugin: SIGKILL mid-prepare, damaged state, reboot."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.app import start_plugin
from dradriver.config import IMAGE_CDI_HOOK_ENV
from dradriver.domain.claims import ClaimRef
from dradriver.domain.identity import GPU_DRIVER
from dradriver.host.claimstate import ClaimPhase, ClaimStateVersionError, ProblemKind
from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _claims(sandbox: SandboxNode, count: int, prefix: str = "c") -> list[ClaimRef]:
    assert sandbox.api is not None
    refs = []
    for i in range(count):
        claim = sandbox.api.create(claim_object(f"{prefix}{i}"))
        refs.append(ref_of(set_allocation(sandbox, claim, [result(f"gpu-{i % 8}")])))
    return refs


def _plugin_env(sandbox: SandboxNode) -> dict[str, str]:
    config = sandbox.config()
    env = dict(os.environ)
    env.update(
        NODE_NAME=config.node_name,
        KUBECONFIG=config.kubeconfig,
        CDI_ROOT=str(config.cdi_root),
        KUBELET_REGISTRAR_DIRECTORY_PATH=str(config.kubelet_registrar_directory_path),
        KUBELET_PLUGINS_DIRECTORY_PATH=str(config.kubelet_plugins_directory_path),
        KUBELET_DEVICE_PLUGINS_DIRECTORY_PATH=str(config.kubelet_device_plugins_directory_path),
        DEV_ROOT=str(config.dev_root),
        SYSFS_ROOT=str(config.sysfs_root),
        PROC_ROOT=str(config.proc_root),
        DRADRIVER_MOCK_PROFILE=config.mock_profile,
        LOG_LEVEL="warning",
    )
    env[IMAGE_CDI_HOOK_ENV] = str(sandbox.image_cdi_hook)  # the image's nvidia-cdi-hook: the sandbox's stand-in
    return env


async def _start_plugin_process(sandbox: SandboxNode) -> asyncio.subprocess.Process:
    """``dradriver gpu-kubelet-plugin`` as its own process (so it can be SIGKILLed), configured by env."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dradriver", "gpu-kubelet-plugin", env=_plugin_env(sandbox), cwd=str(ROOT),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


@contextlib.asynccontextmanager
async def _plugin_process(sandbox: SandboxNode) -> AsyncIterator[tuple[asyncio.subprocess.Process, Any]]:
    """The plugin as its own process, registered through the kubelet emulator; killed on exit if still alive."""
    proc = await _start_plugin_process(sandbox)
    try:
        async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
            yield proc, await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def _sigkill_during(proc: asyncio.subprocess.Process, call: Any, delay_s: float) -> None:
    """Start ``call``, SIGKILL the plugin after ``delay_s`` seconds, and let the call end however it ends."""
    task = asyncio.create_task(call)
    await asyncio.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    try:
        await task
    except KubeletError:
        pass  # the connection died with the process


def _check_converged(sandbox: SandboxNode, state_uids: set[str]) -> None:
    """Every stored claim is completed with its spec; no spec without a claim."""
    spec_uids = {p.name.removeprefix("k8s.gpu.nvidia.com-claim_").removesuffix(".yaml") for p in sandbox.cdi_specs()}
    assert spec_uids == state_uids
    leftovers = [p for p in sandbox.cdi_root.iterdir() if not p.name.endswith(".yaml")]
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.parametrize("sandbox", ["synthetic-large"], indirect=True)
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sigkill_during_prepare_then_restart_converges(sandbox: SandboxNode, seed: int) -> None:
    """The plugin process is SIGKILLed at a random moment of a batch of 60 MIG-device claims.

    One warm-up claim is prepared first, so the kill lands in the batch's own work (API reads, claim-state
    records, CDI specs) rather than in the client's first-call set-up.
    """
    assert sandbox.api is not None
    rng = random.Random(seed)

    async def body() -> None:
        async with _plugin_process(sandbox) as (proc, connection):
            await wait_for(lambda: sum(len(s["spec"]["devices"]) for s in _slices(sandbox)) >= 61, 30)
            names = sorted(p["name"] for s in _slices(sandbox) for p in s["spec"]["devices"])
            refs = [ref_of(set_allocation(sandbox, sandbox.api.create(claim_object(f"k{seed}-{i}")),
                                          [result(name)]))  # type: ignore[union-attr]
                    for i, name in enumerate(names[:61])]
            warm, batch = refs[0], refs[1:]
            assert (await connection.prepare([warm]))[warm.uid].error == ""
            await _sigkill_during(proc, connection.prepare(batch), rng.uniform(0.0, 0.25))
        # Restart in process: recovery rolls back half-prepared claims and removes orphan specs.
        async with running(sandbox.config()) as (plugin, connection):
            state_uids = set(plugin.state.claims())
            _check_converged(sandbox, state_uids)
            assert warm.uid in state_uids  # acknowledged before the crash: never lost
            assert all(r.phase is ClaimPhase.PREPARE_COMPLETED for r in plugin.state.claims().values())
            # The kubelet retries: every claim ends up prepared exactly once, then everything is undone.
            answer = await connection.prepare(refs)
            assert all(r.error == "" for r in answer.values()), answer
            _check_converged(sandbox, {r.uid for r in refs})
            assert all(v == "" for v in (await connection.unprepare(refs)).values())
            assert sandbox.cdi_specs() == []
            assert len(plugin.state) == 0

    asyncio.run(body())


def _slices(sandbox: SandboxNode) -> list[dict[str, Any]]:
    assert sandbox.api is not None
    return sandbox.api.objects("ResourceSlice")


def _state_file(sandbox: SandboxNode) -> Path:
    return sandbox.config().plugin_dir / GPU_DRIVER.state_file


@pytest.mark.slow
def test_torn_state_tail_is_truncated_and_reported(sandbox: SandboxNode) -> None:
    refs = _claims(sandbox, 2)

    async def body() -> None:
        async with running(sandbox.config()) as (_, kubelet):
            assert all(r.error == "" for r in (await kubelet.prepare(refs)).values())
        path = _state_file(sandbox)
        path.write_bytes(path.read_bytes()[:-7])  # a crash cut the last record short
        async with running(sandbox.config()) as (plugin, _):
            kinds = {p.kind for p in plugin.state_problems}
            assert ProblemKind.TORN_TAIL in kinds
            # The last record was the second claim's PREPARE_COMPLETED; the claim is kept as started and
            # rolled back, and its spec removed: prepared state and files agree again.
            assert refs[0].uid in plugin.state.claims()
            assert refs[1].uid in plugin.recovery.rolled_back
            _check_converged(sandbox, set(plugin.state.claims()))

    asyncio.run(body())


@pytest.mark.slow
def test_corrupt_state_is_reported_and_claims_holding_devices_are_not_forgotten(sandbox: SandboxNode) -> None:
    assert sandbox.api is not None
    refs = _claims(sandbox, 3)

    async def body() -> None:
        async with running(sandbox.config()) as (_, kubelet):
            assert all(r.error == "" for r in (await kubelet.prepare(refs)).values())
        path = _state_file(sandbox)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # damage a record in the middle
        path.write_bytes(bytes(data))
        async with running(sandbox.config()) as (plugin, kubelet):
            assert any(p.damage for p in plugin.state_problems)
            assert list(path.parent.glob("claims.state.corrupt-*")), "damaged file kept aside"
            # Every claim whose spec exists is still known (read back or adopted from its CDI spec) ...
            specs = {p.name.removeprefix("k8s.gpu.nvidia.com-claim_").removesuffix(".yaml")
                     for p in sandbox.cdi_specs()}
            assert specs == {r.uid for r in refs}
            assert specs <= set(plugin.state.claims())
            # ... so its devices stay protected against a second claim.
            intruder = set_allocation(sandbox, sandbox.api.create(claim_object("intruder")), [result("gpu-1")])
            err = (await kubelet.prepare([ref_of(intruder)]))[intruder["metadata"]["uid"]].error
            assert "already prepared" in err
            # A repeated prepare of an adopted claim is answered from the claim itself (request names known).
            again = await kubelet.prepare(refs)
            assert all(r.error == "" and r.devices[0].request_names == ("gpu",) for r in again.values()), again
            assert await kubelet.unprepare(refs) == {r.uid: "" for r in refs}
            assert sandbox.cdi_specs() == []
        events = [e for e in sandbox.api.objects("Event") if e.get("reason") == "ClaimStateCorrupt"]
        assert events and "claim state" in events[0]["message"]

    asyncio.run(body())


@pytest.mark.slow
def test_changed_boot_id_discards_prepared_state(sandbox: SandboxNode) -> None:
    refs = _claims(sandbox, 2)

    async def body() -> None:
        async with running(sandbox.config()) as (_, kubelet):
            assert all(r.error == "" for r in (await kubelet.prepare(refs)).values())
        sandbox.set_boot_id("5d1a8e2c-0000-4000-8000-000000000000")  # the node rebooted
        async with running(sandbox.config()) as (plugin, kubelet):
            assert ProblemKind.BOOT_ID_CHANGED in {p.kind for p in plugin.state_problems}
            assert len(plugin.state) == 0
            assert sandbox.cdi_specs() == []  # specs from before the reboot are removed
            answer = await kubelet.prepare(refs)  # the kubelet prepares again after a reboot
            assert all(r.error == "" for r in answer.values())

    asyncio.run(body())


def test_newer_state_format_is_refused_with_a_clear_message(sandbox: SandboxNode) -> None:
    refs = _claims(sandbox, 1)

    async def body() -> None:
        async with running(sandbox.config()) as (_, kubelet):
            await kubelet.prepare(refs)
        path = _state_file(sandbox)
        from dradriver._native import claimstore_py

        path.write_bytes(claimstore_py.encode_header("boot", version=99))
        with pytest.raises(ClaimStateVersionError, match="99"):
            await start_plugin(sandbox.config())

    asyncio.run(body())


def test_cdi_spec_without_a_claim_is_adopted_never_deleted(sandbox: SandboxNode) -> None:
    """A spec whose claim has no record means the claim state lost it: its devices stay protected."""
    stray = GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, "33333333-3333-3333-3333-333333333333")
    stray.write_text('{"cdiVersion": "0.5.0", "kind": "k8s.gpu.nvidia.com/claim", "devices": '
                     '[{"name": "33333333-3333-3333-3333-333333333333-gpu-1", "containerEdits": {}}]}')
    torn = sandbox.cdi_root / f".{stray.name}.tmp-0a1b2c"  # a write killed before its rename
    torn.write_text('{"cdiVersion": "0.5')
    assert sandbox.api is not None

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            assert plugin.recovery.adopted == ("33333333-3333-3333-3333-333333333333",)
            assert "no record of" in plugin.recovery.damage
            assert stray.exists() and not torn.exists()
            events = [e for e in sandbox.api.objects("events", namespace="default")
                      if e["reason"] == "ClaimStateCorrupt"]
            assert events and "adopted" in events[0]["message"]
            intruder = set_allocation(sandbox, sandbox.api.create(claim_object("intruder")), [result("gpu-1")])
            err = (await kubelet.prepare([ref_of(intruder)]))[intruder["metadata"]["uid"]].error
            assert "already prepared" in err  # gpu-1 is still held by the adopted claim

    asyncio.run(body())


def test_emptied_or_truncated_state_file_beside_specs_is_damage(sandbox: SandboxNode) -> None:
    """A zero-byte state file (or one cut in half, read as a torn tail) must not free the GPUs of running claims."""
    refs = _claims(sandbox, 3)

    async def body() -> None:
        async with running(sandbox.config()) as (_, kubelet):
            assert all(r.error == "" for r in (await kubelet.prepare(refs)).values())
        path = _state_file(sandbox)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # cut in half: the later claims' records are gone
        async with running(sandbox.config()) as (plugin, _):
            assert plugin.recovery.damage, "a cut-off file is not an unacknowledged torn write"
            assert set(plugin.state.claims()) == {r.uid for r in refs}  # read back, kept or adopted
            assert len(sandbox.cdi_specs()) == 3 and plugin.recovery.rolled_back == ()
        path.write_bytes(b"")  # emptied
        checkpoint = path.parent / "checkpoint.json"
        kept = checkpoint.read_bytes()
        checkpoint.unlink()  # without the NVIDIA-format checkpoint: the specs are all there is
        async with running(sandbox.config()) as (plugin, _):
            assert "no record of" in plugin.recovery.damage
            assert sorted(plugin.recovery.adopted) == sorted(r.uid for r in refs)
            assert len(sandbox.cdi_specs()) == 3
        path.write_bytes(b"")
        checkpoint.write_bytes(kept)  # with it, the claims come back from it whole (devices, requests, undo)
        async with running(sandbox.config()) as (plugin, _):
            assert plugin.recovery.damage == "" and set(plugin.state.claims()) == {r.uid for r in refs}
            assert all(d.request_names for r in plugin.state.claims().values() for d in r.devices)
            assert len(sandbox.cdi_specs()) == 3

    asyncio.run(body())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [4, 5])
def test_sigkill_during_unprepare_then_restart_converges(sandbox: SandboxNode, seed: int) -> None:
    """Killed while a batch of 8 claims is being unprepared: the kubelet's retry finishes the job."""
    refs = _claims(sandbox, 8, prefix=f"u{seed}-")
    rng = random.Random(seed)

    async def body() -> None:
        async with _plugin_process(sandbox) as (proc, connection):
            assert all(r.error == "" for r in (await connection.prepare(refs)).values())
            await _sigkill_during(proc, connection.unprepare(refs), rng.uniform(0.0, 0.03))
        async with running(sandbox.config()) as (plugin, connection):
            # Never a spec without a claim (a claim whose spec is already gone may remain until the retry).
            specs = {p.name.removeprefix("k8s.gpu.nvidia.com-claim_").removesuffix(".yaml")
                     for p in sandbox.cdi_specs()}
            assert specs <= set(plugin.state.claims())
            assert await connection.unprepare(refs) == {r.uid: "" for r in refs}
            assert sandbox.cdi_specs() == []
            assert len(plugin.state) == 0

    asyncio.run(body())


def test_renumbered_gpus_never_hand_a_claim_another_gpu(sandbox: SandboxNode, tmp_path: Path) -> None:
    """A driver reload swapped the minors of two GPUs: ``gpu-0`` is the other physical GPU now. At start the claim is
    refused and its spec withdrawn (its ``/dev/nvidia0`` is the other GPU), never rewritten for that GPU."""
    from tests.factories import write_profile

    refs = _claims(sandbox, 1)

    def swap(profile: dict[str, Any]) -> None:
        first, second = profile["gpus"][0], profile["gpus"][1]
        first["uuid"], second["uuid"] = second["uuid"], first["uuid"]

    swapped = write_profile(tmp_path, "dgx-h100", swap)

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            assert (await kubelet.prepare(refs))[refs[0].uid].error == ""
            pinned = plugin.inventory.find("gpu-0")
            assert pinned is not None
        spec = GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, refs[0].uid)
        assert spec.exists()
        async with running(sandbox.config(mock_profile=swapped)) as (plugin, kubelet):
            now = plugin.inventory.find("gpu-0")
            assert now is not None and now.uuid != pinned.uuid
            assert plugin.recovery.unusable == (refs[0].uid,)
            error = (await kubelet.prepare(refs))[refs[0].uid].error
            assert pinned.uuid in error and now.uuid in error and "'gpu-0'" in error
            assert not spec.exists()  # withdrawn, not rewritten for the other GPU
            assert await kubelet.unprepare(refs) == {refs[0].uid: ""}  # and it can still be unprepared

    asyncio.run(body())


def test_start_up_rebuilds_missing_and_invalid_specs_of_completed_claims(sandbox: SandboxNode) -> None:
    from tests.cdi.helpers import validate

    refs = _claims(sandbox, 2)

    async def body() -> None:
        async with running(sandbox.config()) as (_, kubelet):
            assert all(r.error == "" for r in (await kubelet.prepare(refs)).values())
        specs = [GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, r.uid) for r in refs]
        good = [p.read_bytes() for p in specs]
        specs[0].unlink()  # /var/run/cdi cleaned
        specs[1].write_bytes(good[1][:40])  # another writer left it cut short
        plugin = await start_plugin(sandbox.config())
        try:  # rebuilt at start, before the kubelet sends anything
            assert sorted(plugin.recovery.rebuilt_specs) == sorted(r.uid for r in refs)
            assert [p.read_bytes() for p in specs] == good
            for path in specs:
                validate(path.read_bytes())
        finally:
            await plugin.stop()

    asyncio.run(body())
