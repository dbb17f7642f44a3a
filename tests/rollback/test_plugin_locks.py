"""NVIDIA's plugin locks (:mod:`dradriver.host.pluginlocks`) as dradriver's plugins take them: another process (as
NVIDIA's plugin, overlapping on the node during a switch) holding ``pu.lock`` or ``cp.lock`` delays a prepare, the
start-up adoption or a checkpoint write until it releases; held past the bound, the claims get an error naming the
lock and the plugin serves on; a SIGKILLed holder releases it (flock)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.nvcheckpoint import (
    Checkpoint,
    CheckpointEntry,
    CheckpointState,
    DeviceGroup,
    KubeletDevice,
    PreparedDevice,
    encode,
)
from dradriver.host import pluginlocks
from dradriver.host.claimstate import ClaimPhase
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE, read_checkpoint
from dradriver.host.pluginlocks import PluginLocks, PluginLockTimeout
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import cd_config, seed_claim, seed_domain, write_imex_proc
from tests.computedomain.cdplugin_helpers import running as running_cd
from tests.plugin.conftest import running, wait_for
from tests.rollback.peers import claim, kubelet_for, needs_nvidia, nvidia_process, switched_node

HOLDER = Path(__file__).with_name("lockholder.py")


class Holder:
    """The lock-holding process of ``tests/rollback/lockholder.py``."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def release(self) -> None:
        """Let it do its writes, release and exit."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        assert self.proc.wait(30) == 0

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@contextlib.contextmanager
def holding(lock: Path, *moves: Path) -> Iterator[Holder]:
    """Another process holding ``lock`` (returns once it holds it); ``moves``: SRC, DST, ... renamed at release."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(HOLDER), str(lock), *map(str, moves)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        yield Holder(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def plugin_dir(node: SandboxNode) -> Path:
    return node.config().plugin_dir


def waits_on(caplog: pytest.LogCaptureFixture, lock: Path) -> bool:
    """Whether dradriver logged that it waits for ``lock``."""
    return any(r.name == pluginlocks.__name__ and f"lock {lock} is held" in r.getMessage() for r in caplog.records)


def test_a_held_lock_times_out_naming_the_file_the_wait_and_the_holders_pid(tmp_path: Path) -> None:
    lock = tmp_path / "pu.lock"
    with holding(lock) as holder:
        with pytest.raises(PluginLockTimeout) as caught, pluginlocks.held(lock, 0.2):
            pass
        assert caught.value.holders == (holder.proc.pid,)
        assert str(lock) in str(caught.value) and f"by PID {holder.proc.pid}" in str(caught.value)
        assert caught.value.waited_s >= 0.2 and isinstance(caught.value, OSError)
        holder.release()
    with pluginlocks.held(lock, 0.2):
        assert pluginlocks.lock_holders(lock) == (os.getpid(),)


def test_a_prepare_waits_for_a_pu_lock_another_process_holds_and_succeeds_once_it_is_released(
        sandbox: SandboxNode, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=pluginlocks.__name__)
    lock = PluginLocks(plugin_dir(sandbox)).prepare_path

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            ref = claim(sandbox, "waits", "gpu-0")
            with holding(lock) as holder:
                answer = asyncio.create_task(kubelet.prepare([ref]))
                await wait_for(lambda: waits_on(caplog, lock))
                assert not answer.done() and plugin.state is not None and plugin.state.get(ref.uid) is None
                await asyncio.to_thread(holder.release)
                assert (await answer)[ref.uid].error == ""
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


def test_a_pu_lock_held_past_its_timeout_fails_the_claims_of_the_chunk_naming_the_lock_and_the_plugin_serves_on(
        sandbox: SandboxNode, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = PluginLocks(plugin_dir(sandbox)).prepare_path

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            monkeypatch.setattr(pluginlocks, "TIMEOUT_S", 0.3)
            first, second = claim(sandbox, "first", "gpu-0"), claim(sandbox, "second", "gpu-1")
            with holding(lock) as holder:
                answers = await kubelet.prepare([first, second])
                for ref in (first, second):
                    error = answers[ref.uid].error
                    assert f"claim {ref}" in error and str(lock) in error and f"PID {holder.proc.pid}" in error, error
                assert plugin.state is not None and len(plugin.state) == 0
                held = await kubelet.unprepare([first])
                assert str(lock) in held[first.uid], held
                await asyncio.to_thread(holder.release)
            again = await kubelet.prepare([first, second])
            assert [again[r.uid].error for r in (first, second)] == ["", ""]
            assert await kubelet.unprepare([first, second]) == {first.uid: "", second.uid: ""}

    asyncio.run(body())


def test_a_sigkilled_holder_of_pu_lock_releases_it_and_the_waiting_prepare_succeeds(
        sandbox: SandboxNode, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=pluginlocks.__name__)
    lock = PluginLocks(plugin_dir(sandbox)).prepare_path

    async def body() -> None:
        async with running(sandbox.config()) as (_plugin, kubelet):
            ref = claim(sandbox, "killed", "gpu-0")
            with holding(lock) as holder:
                answer = asyncio.create_task(kubelet.prepare([ref]))
                await wait_for(lambda: waits_on(caplog, lock))
                holder.kill()
                assert (await answer)[ref.uid].error == ""
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


def test_a_held_pu_lock_delays_adoption_and_the_checkpoint_entry_its_holder_writes_before_releasing_is_adopted(
        sandbox: SandboxNode, caplog: pytest.LogCaptureFixture) -> None:
    """Emulates NVIDIA's prepare in flight when dradriver starts: it holds ``pu.lock`` and writes its checkpoint
    entry and CDI spec just before releasing; dradriver's adoption reads the checkpoint only after that."""
    caplog.set_level(logging.INFO, logger=pluginlocks.__name__)
    config = sandbox.config()
    directory = plugin_dir(sandbox)
    directory.mkdir(parents=True, exist_ok=True)
    uid, name = str(uuid.uuid4()), "gpu-1"
    device = PreparedDevice("gpu", KubeletDevice(("gpu",), sandbox.node_name, name,
                                                 (f"k8s.gpu.nvidia.com/claim={uid}-{name}",)))
    results = [{"request": "gpu", "driver": GPU_DRIVER.driver_name, "pool": sandbox.node_name, "device": name}]
    entry = CheckpointEntry(CheckpointState.PREPARE_COMPLETED, {"allocation": {"devices": {"results": results}}},
                            (DeviceGroup((device,)),))
    staged_checkpoint = directory / ".staged-checkpoint"
    staged_checkpoint.write_bytes(encode(Checkpoint({uid: entry}, "")))
    spec = sandbox.cdi_root / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"
    staged_spec = sandbox.cdi_root / ".staged-spec"
    staged_spec.write_text(f"cdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices:\n- name: {uid}-{name}\n"
                           "  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia1\n")
    lock = PluginLocks(directory).prepare_path

    async def body() -> None:
        with holding(lock, staged_checkpoint, directory / CHECKPOINT_FILE, staged_spec, spec) as holder:
            started = asyncio.create_task(plugin_started())
            await wait_for(lambda: waits_on(caplog, lock), timeout=60)
            assert not started.done()
            await asyncio.to_thread(holder.release)
            await started

    async def plugin_started() -> None:
        async with running(config) as (plugin, _kubelet):
            assert plugin.state is not None
            record = plugin.state.get(uid)
            assert record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED
            assert [d.device for d in record.devices] == [name]
            kept = read_checkpoint(directory / CHECKPOINT_FILE)
            assert kept is not None and uid in kept.claims

    asyncio.run(body())


def test_a_held_cp_lock_delays_the_checkpoint_write_and_the_file_stays_whole(
        sandbox: SandboxNode, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=pluginlocks.__name__)
    directory = plugin_dir(sandbox)
    lock = PluginLocks(directory).checkpoint_path
    path = directory / CHECKPOINT_FILE

    async def body() -> None:
        async with running(sandbox.config()) as (_plugin, kubelet):
            ref = claim(sandbox, "checkpointed", "gpu-0")
            before = path.read_bytes()
            with holding(lock) as holder:
                answer = asyncio.create_task(kubelet.prepare([ref]))
                await wait_for(lambda: waits_on(caplog, lock))
                assert not answer.done() and path.read_bytes() == before
                await asyncio.to_thread(holder.release)
                assert (await answer)[ref.uid].error == ""
            kept = read_checkpoint(path)  # verifies both checksums
            assert kept is not None and ref.uid in kept.claims
            assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name]
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}

    asyncio.run(body())


def test_the_compute_domain_plugin_takes_pu_lock_of_its_own_plugin_dir_around_prepare_and_unprepare(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with SandboxNode(profile="gb200-nvl72-node") as node:
        write_imex_proc(node)
        api = node.api
        assert api is not None
        ref = seed_claim(api, "wl-0", seed_domain(api))
        config = cd_config(node)
        lock = PluginLocks(config.plugin_dir).prepare_path
        assert lock.parent.name == "compute-domain.nvidia.com"

        async def body() -> None:
            async with running_cd(config) as (_plugin, conn):
                monkeypatch.setattr(pluginlocks, "TIMEOUT_S", 0.3)
                with holding(lock) as holder:
                    refused = (await conn.prepare([ref]))[ref.uid].error
                    assert f"lock {lock} still held by PID {holder.proc.pid}" in refused, refused
                    assert str(lock) in (await conn.unprepare([ref]))[ref.uid]
                    await asyncio.to_thread(holder.release)
                assert (await conn.unprepare([ref]))[ref.uid] == ""

        asyncio.run(body())


@needs_nvidia
@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_nvidias_plugin_on_the_same_plugin_dir_waits_for_the_pu_lock_and_cp_lock_dradriver_holds(
        sandbox: SandboxNode, tmp_path: Path) -> None:
    """NVIDIA's own ``gpu-kubelet-plugin`` and dradriver's lock helper on one plugin directory: while dradriver holds
    ``pu.lock`` (as its runner does around a chunk) or ``cp.lock`` (around a checkpoint write), NVIDIA's prepare does
    not answer; once released it prepares and names the claim in its checkpoint. The same files, the same lock."""
    _config, _cdi_root, directory = switched_node(sandbox)
    locks = PluginLocks(directory)
    first, second = claim(sandbox, "under-pu", "gpu-2"), claim(sandbox, "under-cp", "gpu-3")

    async def body() -> None:
        with nvidia_process(sandbox, tmp_path) as (proc, registrar):
            async with kubelet_for(registrar, proc, tmp_path / "nvidia.log") as kubelet:
                for lock, ref in ((locks.prepare, first), (locks.checkpoint, second)):
                    with lock():
                        answer = asyncio.create_task(kubelet.prepare([ref]))
                        await asyncio.sleep(1.0)  # NVIDIA's prepare would have answered (its bound is 10 s)
                        assert not answer.done()
                    assert (await answer)[ref.uid].error == ""
                    written = read_checkpoint(directory / CHECKPOINT_FILE)
                    assert written is not None and ref.uid in written.claims
                assert await kubelet.unprepare([first, second]) == {first.uid: "", second.uid: ""}

    asyncio.run(body())
