"""VFIO passthrough on a node where ``nvidia-persistenced`` runs (as the GPU Operator's driver container starts it):
the daemon holds ``/dev/nvidia<minor>`` of every GPU open, so a GPU is taken from ``nvidia`` only after its
persistence mode is turned off (``nvidia-smi -i <address> -pm 0``, which asks the daemon), and persistence is turned
on again after the GPU is back. The real plugin over gRPC on a sandbox node with the daemon stand-in
(:mod:`dradriver.sandbox.standins.nvidia_persistenced`) and the PCI bus stand-in; preparer-level cases with the
driver root's ``nvidia-smi`` stand-in."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from dradriver.domain.claims import ClaimError, ClaimRef
from dradriver.domain.ports import UndoRecord
from dradriver.host import persistenced
from dradriver.host.nvidiasmi import find_nvidia_smi
from dradriver.nvml import mock
from dradriver.preparers.vfio import PERSISTENCE_DISABLED, VfioPreparer
from dradriver.sandbox.node import SandboxNode
from tests import factories
from tests.passthrough.test_plugin_passthrough import GATES, GPU0, ROOT, claim_for, driver_of, plugin_env
from tests.passthrough.test_vfio_preparer import REF, _device, _on_nvidia, _prepare
from tests.plugin.conftest import running, wait_for

GPU1 = "0000:2a:00.0"


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile="dgx-h100", pci_tree=True, persistenced=True) as n:
        assert n.api is not None
        n.api.create(factories.DEVICE_CLASS)
        yield n


@pytest.fixture
def plain_node() -> Iterator[SandboxNode]:
    with SandboxNode(profile="dgx-h100", pci_tree=True) as n:
        assert n.api is not None
        n.api.create(factories.DEVICE_CLASS)
        yield n


def daemon_holds(node: SandboxNode, minor: int) -> bool:
    """The daemon stand-in holds ``dev/nvidia<minor>`` open."""
    assert node.persistence_daemon is not None
    return node.persistence_daemon.pid in {h.pid for h in node.pci_host().holders(minor)}


def vfio_facts(plugin: Any, ref: ClaimRef) -> dict[str, Any]:
    """The ``data`` of the claim's stored ``vfio`` undo record."""
    record = plugin.state.get(ref.uid)
    assert record is not None
    payload = record.payload.decode() if isinstance(record.payload, bytes) else record.payload
    [facts] = [r["data"] for r in json.loads(payload)["undo"] if r["kind"] == "vfio"]
    assert isinstance(facts, dict)
    return facts


def test_the_daemon_stand_in_holds_every_gpu_and_its_socket_says_it_runs(node: SandboxNode) -> None:
    assert persistenced.daemon_running(node.driver_root)
    assert all(daemon_holds(node, minor) for minor in range(8))
    [holder] = [h for h in node.pci_host().holders(0) if node.persistence_daemon
                and h.pid == node.persistence_daemon.pid]
    assert holder.comm == "nvidia-persiste"  # what fuser names on a real node
    node.stop_persistenced()
    assert not persistenced.socket_path(node.driver_root).exists()  # removed at exit


def test_a_regular_file_at_the_socket_path_is_no_daemon(plain_node: SandboxNode) -> None:
    """A driver tree copied without the daemon (the sandbox lays out an empty file there) does not count."""
    assert persistenced.socket_path(plain_node.driver_root).is_file()
    assert not persistenced.daemon_running(plain_node.driver_root)


def test_with_nvidia_persistenced_running_a_vfio_claim_prepares_and_the_daemon_holds_the_gpu_again_after(
        node: SandboxNode) -> None:
    """Without persistence turned off the claim is refused "in use by nvidia-persiste"; with it the daemon lets go
    of that GPU only, and takes it again once the GPU is back on nvidia."""
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            ref = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert driver_of(node) == "vfio-pci"
            assert vfio_facts(plugin, ref)["persistence"] == PERSISTENCE_DISABLED
            assert not daemon_holds(node, 0)
            assert all(daemon_holds(node, minor) for minor in range(1, 8))
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
            assert daemon_holds(node, 0)

    asyncio.run(body())


def test_without_the_daemon_no_persistence_mode_is_set_and_the_record_has_no_persistence_fact(
        plain_node: SandboxNode) -> None:
    node = plain_node

    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            ref = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert "persistence" not in vfio_facts(plugin, ref)
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
        # nvidia-smi -pm without the daemon sets the legacy mode through NVML, which the mock writes through
        assert "persistenceMode" not in node.nvml_control.read_text()

    asyncio.run(body())


def test_a_gpu_another_process_holds_is_still_refused_naming_it_and_persistence_is_turned_on_again(
        node: SandboxNode) -> None:
    with open(node.root / "dev" / "nvidia0") as held:
        proc = subprocess.Popen(["sleep", "60"], stdin=held)
    (node.root / "proc" / str(proc.pid)).symlink_to(f"/proc/{proc.pid}")
    try:
        async def body() -> None:
            async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
                vm = claim_for(node, "vm", "gpu-vfio-0")
                error = (await kubelet.prepare([vm]))[vm.uid].error
                assert "default/vm" in error and f"sleep (pid {proc.pid})" in error
                assert "nvidia-persiste" not in error
                assert driver_of(node) == "nvidia"
                assert daemon_holds(node, 0)

        asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()


def test_a_plugin_sigkilled_right_after_persistence_went_off_leaves_the_gpu_on_nvidia_and_the_next_prepare_works(
        node: SandboxNode) -> None:
    """The daemon releases GPU 0 for ``pm 0`` and does not answer; the plugin is SIGKILLed then, before its first
    sysfs write. The GPU stays on nvidia without override (persistence stays off: nothing marks it), the next
    start prepares the claim (``already Disabled``, recorded as disabled), and its unprepare turns persistence on
    again."""
    from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError

    node.persistenced_faults.write_text(json.dumps([{"op": "pm0-unanswered", "address": GPU0, "count": 1}]))
    pci = node.pci_host()
    ref = claim_for(node, "vm", "gpu-vfio-0")

    async def body() -> None:
        env = plugin_env(node, DRIVER_ROOT_CTR_PATH=str(node.driver_root))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dradriver", "gpu-kubelet-plugin", env=env, cwd=str(ROOT),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with KubeletEmulator(node.config().kubelet_registrar_directory_path) as kubelet:
                child = await kubelet.wait_for_plugin("gpu.nvidia.com", timeout=30)
                call = asyncio.create_task(child.prepare([ref]))
                await wait_for(lambda: not daemon_holds(node, 0), 30)
                assert pci.function(GPU0).driver_override is None  # before the first write
                proc.kill()
                with pytest.raises(KubeletError):
                    await call
            assert await proc.wait() == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            function = pci.function(GPU0)
            assert (function.driver, function.driver_override) == ("nvidia", None)
            assert not daemon_holds(node, 0)  # persistence stayed off
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert driver_of(node) == "vfio-pci"
            assert vfio_facts(plugin, ref)["persistence"] == PERSISTENCE_DISABLED
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
            assert daemon_holds(node, 0)

    asyncio.run(body())


# -- the preparer --------------------------------------------------------------------------------------------

def _preparer(node: SandboxNode, *, running: bool = True) -> VfioPreparer:
    mock.activate(node.profile)  # the nvidia-smi stand-in finds the profile as the plugin's NVML session sets it
    return VfioPreparer(node.pci_host(), persistenced=lambda: running,
                        nvidia_smi=lambda: find_nvidia_smi(node.driver_root))


def test_a_failing_persistence_off_is_a_claim_error_naming_the_claim_device_and_output_and_nothing_changes(
        plain_node: SandboxNode) -> None:
    """``nvidia-smi -pm 0`` fails (an unprivileged caller: "Insufficient Permissions", exit 4): the claim's error
    names it and the GPU stays on nvidia without override."""
    node = plain_node
    preparer = _preparer(node)
    host = preparer.host
    node.nvml_control.write_text("set 0 noPermission 1\n")
    device = _device(host)
    with pytest.raises(ClaimError) as info:
        _prepare(preparer, device)
    message = str(info.value)
    assert REF.name in message and "'gpu-vfio-0'" in message and GPU0 in message
    assert "-pm 0" in message and "exit status 4" in message and "Insufficient Permissions" in message
    assert _on_nvidia(host)


def test_an_undo_whose_persistence_on_fails_warns_and_gives_the_gpu_back(
        node: SandboxNode, caplog: pytest.LogCaptureFixture) -> None:
    """The GPU back on nvidia is what the undo owes; a failing ``nvidia-smi -pm 1`` is a warning, not a retry."""
    preparer = _preparer(node)
    _plan, record = _prepare(preparer, _device(preparer.host))
    assert record.data["persistence"] == PERSISTENCE_DISABLED
    broken = VfioPreparer(preparer.host, persistenced=lambda: True,
                          nvidia_smi=lambda: find_nvidia_smi(node.root / "no-driver-root"))
    with caplog.at_level(logging.WARNING, logger="dradriver.preparers.vfio"):
        broken.undo(REF, record)
    assert _on_nvidia(preparer.host)
    assert "persistence mode could not be turned on again" in caplog.text and GPU0 in caplog.text
    assert not daemon_holds(node, 0)
    preparer.undo(REF, record)  # a later undo (idempotent) turns it on
    assert daemon_holds(node, 0)


def test_an_older_record_without_the_persistence_fact_turns_nothing_on(node: SandboxNode) -> None:
    preparer = _preparer(node)
    _plan, record = _prepare(preparer, _device(preparer.host))
    older = UndoRecord(record.kind, 1, record.target, {k: v for k, v in record.data.items() if k != "persistence"})
    preparer.undo(REF, older)
    assert _on_nvidia(preparer.host)
    assert not daemon_holds(node, 0)


def test_the_gate_turned_off_gives_back_a_gpu_prepared_with_the_daemon_and_turns_persistence_on_again(
        node: SandboxNode) -> None:
    """PassthroughSupport turned off with a VFIO claim prepared while nvidia-persistenced ran: the undo-only
    preparer of the plugin without the gate gives the GPU back to nvidia and the daemon holds it again."""
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert driver_of(node) == "vfio-pci" and not daemon_holds(node, 0)
        async with running(node.config()) as (_plugin, kubelet):
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
            await wait_for(lambda: daemon_holds(node, 0), 20)

    asyncio.run(body())
