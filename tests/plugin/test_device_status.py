"""KEP-4817 device status for every prepared device: the real plugin over gRPC, the API emulator over HTTP. A full
GPU, a static MIG device, an MPS-shared GPU, a time-sliced GPU and (in ``tests/computedomain``) an IMEX channel and
daemon get their concrete identity in ``ResourceClaim.status.devices[].data``, written off the prepare's path,
retried after an API failure, written by the next start when the plugin died before its write, removed at
unprepare."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from dradriver.domain.claims import ClaimRef
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.preparers.shares import daemon_id
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode
from dradriver.sandbox.profiles import h200_node
from tests.configs.helpers import entry as config_entry
from tests.configs.helpers import params
from tests.configs.test_plugin import allocate as allocate_with_config
from tests.factories import DEVICE_CLASS
from tests.mps.test_plugin import mps_claim
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for
from tests.plugin.test_recovery import ROOT, _plugin_env
from tests.plugin.test_shares import allocate, share_claim


def published(node: SandboxNode, name: str) -> list[dict[str, Any]]:
    """The claim's ``status.devices`` as stored in the API emulator."""
    assert node.api is not None
    stored = node.api.get("ResourceClaim", name, "default")
    return list((stored or {}).get("status", {}).get("devices") or [])


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)  # GPU 0 holds static MIG devices
def test_full_gpu_and_static_mig_device_publish_their_identity_and_unprepare_removes_it(
        sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            assert sandbox.api is not None
            gpu = next(d for d in plugin.inventory.allocatable() if isinstance(d, GpuDevice))
            mig = next(d for d in plugin.inventory.allocatable() if isinstance(d, MigDevice))
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("two")),
                                   [result(gpu.name), result(mig.name)])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            await wait_for(lambda: len(published(sandbox, "two")) == 2)
            entries = {e["device"]: e for e in published(sandbox, "two")}
            assert entries[gpu.name]["data"] == {"uuid": gpu.uuid, "pciBusID": gpu.pci_bus_id}
            assert entries[mig.name]["data"] == {
                "uuid": mig.uuid, "parentUUID": mig.parent.uuid, "gpuInstanceId": mig.gi_id,
                "computeInstanceId": mig.ci_id, "profile": mig.profile,
                "placement": {"start": mig.placement_start, "size": mig.placement_size}}
            for entry in entries.values():
                assert (entry["driver"], entry["pool"]) == ("gpu.nvidia.com", sandbox.node_name)
                assert [(c["type"], c["status"]) for c in entry["conditions"]] == [("Ready", "True")]
            kubernetes_validate.validate(sandbox.api.get("ResourceClaim", "two", "default"), "1.34", strict=True)
            assert plugin.status_writer is not None and plugin.status_writer.flush()
            writes = plugin.status_writer.writes
            assert writes == 1  # both devices in one write
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            await wait_for(lambda: not published(sandbox, "two"))

    asyncio.run(body())


def test_a_failing_api_server_neither_fails_nor_delays_the_prepare_and_the_write_is_retried(
        sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            assert sandbox.api is not None and plugin.status_writer is not None
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("flaky")), [result("gpu-1")])
            ref = ref_of(claim)
            status_path = re.compile(r"/resourceclaims/flaky/status$")
            sandbox.api.fail_next(3, status=503, method="PUT", path=status_path)
            answer = (await kubelet.prepare([ref]))[ref.uid]
            assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-1"]
            await wait_for(lambda: bool(published(sandbox, "flaky")))
            gpu = plugin.registry.get("gpu-1") if plugin.registry else None
            assert isinstance(gpu, GpuDevice)
            assert published(sandbox, "flaky")[0]["data"] == {"uuid": gpu.uuid, "pciBusID": gpu.pci_bus_id}
            assert plugin.status_writer.writes == 4  # three refused, the fourth written
            # an unprepare whose write fails is retried the same way
            sandbox.api.fail_next(2, status=500, method="PUT", path=status_path)
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            await wait_for(lambda: not published(sandbox, "flaky"))

    asyncio.run(body())


def test_a_claim_unprepared_before_its_status_was_written_costs_no_write(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            assert sandbox.api is not None and plugin.status_writer is not None
            writer = plugin.status_writer
            brief = ref_of(set_allocation(sandbox, sandbox.api.create(claim_object("brief")), [result("gpu-2")]))
            kept = ref_of(set_allocation(sandbox, sandbox.api.create(claim_object("kept")), [result("gpu-3")]))
            # "brief" is unprepared within the writer's settle time: its write is dropped, none is sent
            assert (await kubelet.prepare([brief, kept])) and writer.settle_s >= 0.5
            assert (await kubelet.unprepare([brief]))[brief.uid] == ""
            assert writer.flush()
            assert writer.writes == 1 and published(sandbox, "brief") == []
            assert [e["device"] for e in published(sandbox, "kept")] == ["gpu-3"]

    asyncio.run(body())


def test_an_mps_shared_gpu_publishes_its_control_daemon(sandbox: SandboxNode) -> None:
    sandbox.run_workloads()

    async def body() -> None:
        async with running(sandbox.mps_config()) as (plugin, kubelet):
            ref, claim = mps_claim(sandbox, "mps")
            [device] = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            await wait_for(lambda: bool(published(sandbox, "mps")))
            [entry] = published(sandbox, "mps")
            gpu = plugin.registry.get(device) if plugin.registry else None
            assert isinstance(gpu, GpuDevice) and sandbox.api is not None
            [deployment] = sandbox.api.objects("Deployment", SANDBOX_NAMESPACE)
            assert entry["data"] == {"uuid": gpu.uuid, "pciBusID": gpu.pci_bus_id, "mpsControlDaemon": {
                "namespace": SANDBOX_NAMESPACE, "name": deployment["metadata"]["name"]}}
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            await wait_for(lambda: not published(sandbox, "mps"))

    asyncio.run(body())


def test_a_time_sliced_gpu_publishes_its_identity(sandbox: SandboxNode) -> None:
    gates = sandbox.config().feature_gates.with_gates(TimeSlicingSettings=True)

    async def body() -> None:
        async with running(sandbox.config(feature_gates=gates)) as (plugin, kubelet):
            claim = allocate_with_config(sandbox, "ts", [result("gpu-5")],
                                         [config_entry(params(sharing={"strategy": "TimeSlicing",
                                                                "timeSlicingConfig": {"interval": "Short"}}))])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            await wait_for(lambda: bool(published(sandbox, "ts")))
            gpu = plugin.registry.get("gpu-5") if plugin.registry else None
            assert isinstance(gpu, GpuDevice) and sandbox.api is not None
            [entry] = published(sandbox, "ts")
            assert (entry["device"], entry["data"]) == ("gpu-5", {"uuid": gpu.uuid, "pciBusID": gpu.pci_bus_id})
            assert "shareID" not in entry  # time-slicing shares the GPU, not a share of its capacity
            kubernetes_validate.validate(sandbox.api.get("ResourceClaim", "ts", "default"), "1.34", strict=True)
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            await wait_for(lambda: not published(sandbox, "ts"))

    asyncio.run(body())


def test_consumable_shares_of_one_gpu_each_publish_an_entry_under_their_share_id(tmp_path: Path) -> None:
    with SandboxNode(profile=h200_node(tmp_path, gpus=1)) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        node.run_workloads()

        async def body() -> None:
            assert node.api is not None
            async with running(node.shares_config()) as (plugin, kubelet):
                await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
                claims = allocate(node, share_claim("share-a"), share_claim("share-b"))
                for claim in claims:
                    ref = ref_of(claim)
                    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                gpu = plugin.inventory.find("gpu-0")
                assert isinstance(gpu, GpuDevice)
                for claim in claims:
                    name = claim["metadata"]["name"]
                    [alloc] = claim["status"]["allocation"]["devices"]["results"]
                    await wait_for(lambda n=name: bool(published(node, n)))
                    [entry] = published(node, name)
                    assert (entry["device"], entry["shareID"]) == ("gpu-0", alloc["shareID"])
                    assert entry["data"] == {"uuid": gpu.uuid, "pciBusID": gpu.pci_bus_id, "mpsControlDaemon": {
                        "namespace": SANDBOX_NAMESPACE, "name": f"mps-control-daemon-{daemon_id(gpu.uuid)}"}}
                    kubernetes_validate.validate(node.api.get("ResourceClaim", name, "default"), "1.35", strict=True)

        asyncio.run(body())


# The plugin process, SIGKILLed at the moment its device status writer would send its first write (the prepare was
# answered, the writer's settle time had not passed): the write it had pending dies with it.
_KILL_AT_STATUS_WRITE = """
import os, signal, sys
from dradriver.kube import claims
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
claims.publish_device_status = die
from dradriver.cli import main
sys.exit(main([sys.argv[1]]))
"""


async def prepare_then_die_before_the_status_write(command: str, env: dict[str, str], registrar: Path, driver: str,
                                                   ref: ClaimRef) -> None:
    """Run the plugin ``command`` (``gpu-kubelet-plugin``, ``compute-domain-kubelet-plugin``) as its own process
    with ``env``, prepare ``ref`` through the kubelet emulator (answered without error), and see the process killed
    by the SIGKILL its device status writer sends itself instead of the write."""
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _KILL_AT_STATUS_WRITE, command, env=env,
                                                cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with KubeletEmulator(registrar) as kubelet:
            connection = await kubelet.wait_for_plugin(driver, timeout=30)
            answer = (await connection.prepare([ref]))[ref.uid]
            while "not read yet" in answer.error:  # registered before its driver part was read: the kubelet retries
                await asyncio.sleep(0.05)
                answer = (await connection.prepare([ref]))[ref.uid]
            assert answer.error == "" and answer.devices
            await asyncio.wait_for(proc.wait(), 30)
            assert proc.returncode == -9
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_a_claim_whose_status_write_died_with_the_plugin_gets_its_entries_at_the_next_start(
        sandbox: SandboxNode) -> None:
    assert sandbox.api is not None
    ref = ref_of(set_allocation(sandbox, sandbox.api.create(claim_object("survivor")), [result("gpu-2")]))
    config = sandbox.config()
    asyncio.run(prepare_then_die_before_the_status_write("gpu-kubelet-plugin", _plugin_env(sandbox),
                                                         config.kubelet_registrar_directory_path,
                                                         "gpu.nvidia.com", ref))
    assert published(sandbox, "survivor") == []  # prepared, and its write lost

    async def restart() -> str:
        async with running(config) as (plugin, _kubelet):
            assert plugin.status_writer is not None
            await wait_for(lambda: bool(published(sandbox, "survivor")))
            gpu = plugin.registry.get("gpu-2") if plugin.registry else None
            assert isinstance(gpu, GpuDevice)
            [entry] = published(sandbox, "survivor")
            assert entry["device"] == "gpu-2"
            assert entry["data"] == {"uuid": gpu.uuid, "pciBusID": gpu.pci_bus_id}
            assert plugin.status_writer.flush()
        stored = sandbox.api.get("ResourceClaim", "survivor", "default") if sandbox.api else None
        assert stored is not None
        return str(stored["metadata"]["resourceVersion"])

    written = asyncio.run(restart())
    assert asyncio.run(restart()) == written  # a claim whose entries are in place is read, not written again
