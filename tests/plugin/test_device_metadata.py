"""KEP-5304 device metadata (``DeviceMetadata`` gate) end to end: the real GPU plugin over gRPC prepares a claim, the
test reads the claim's CDI spec, follows its metadata mount to the file on the host and checks what a container
would read there; unprepare, restarts and a SIGKILL between the file and the spec leave nothing behind."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain import devicemetadata as dm
from dradriver.domain.featuregates import FeatureGates
from dradriver.domain.identity import GPU_DRIVER
from dradriver.host.devicemetadata import SUBDIR
from dradriver.nvml import mock
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.profiles import h200_node
from tests.cdi.helpers import read_mounted_metadata, validate
from tests.configs.helpers import entry, params
from tests.configs.test_plugin import allocate
from tests.factories import DEVICE_CLASS
from tests.mps.test_plugin import mps_claim
from tests.nvml.mockenv import make_sysfs
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for
from tests.plugin.test_recovery import ROOT, _plugin_env
from tests.plugin.test_shares import allocate as allocate_shares
from tests.plugin.test_shares import share_claim

GATE_ON = FeatureGates({"DeviceMetadata": True})
DRIVER = GPU_DRIVER.driver_name


def _spec(sandbox: SandboxNode, uid: str) -> dict[str, Any]:
    return validate(GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, uid).read_bytes())


def _metadata_dir(sandbox: SandboxNode) -> Path:
    return sandbox.config().plugin_dir / SUBDIR


def _only_device_of(stream: list[dict[str, Any]]) -> dict[str, Any]:
    """Checks the stream (v1beta1 then v1alpha1, the same content) and returns its one request's one device."""
    assert [o["apiVersion"] for o in stream] == list(dm.API_VERSIONS)
    assert all(o["kind"] == "DeviceMetadata" for o in stream)
    first, second = stream
    assert {k: v for k, v in first.items() if k != "apiVersion"} == {k: v for k, v in second.items()
                                                                     if k != "apiVersion"}
    [request] = first["requests"]
    [device] = request["devices"]
    return device


def test_full_gpu_claim_gets_its_attributes_in_a_mounted_metadata_file(sandbox: SandboxNode) -> None:
    make_sysfs(sandbox.config().sysfs_root, mock.load_profile(sandbox.profile))  # PCIe roots and NUMA nodes

    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("train")), [result("gpu-3")])
            ref = ref_of(claim)
            answer = (await kubelet.prepare([ref]))[ref.uid]
            assert answer.error == ""
            assert answer.devices[0].cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-3",)
            mounts = dm.spec_mounts(_spec(sandbox, ref.uid))
            [mount] = mounts[f"{ref.uid}-gpu-3"]
            assert mount["containerPath"] == ("/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train/gpu/"
                                              "gpu.nvidia.com-metadata.json")
            stream = read_mounted_metadata(mount)
            doc = stream[0]
            assert doc["metadata"] == {"name": "train", "namespace": "default", "uid": ref.uid, "generation": 1}
            assert "podClaimName" not in doc and doc["requests"][0]["name"] == "gpu"
            device = _only_device_of(stream)
            gpu = plugin.inventory.gpus[3]
            assert (device["driver"], device["pool"], device["name"]) == (DRIVER, sandbox.node_name, "gpu-3")
            attrs = device["attributes"]
            published = next(d for s in sandbox.api.objects("ResourceSlice") for d in s["spec"]["devices"]
                             if d["name"] == "gpu-3")
            assert {k: v for k, v in attrs.items() if k in published["attributes"]} == published["attributes"]
            assert attrs["uuid"] == {"string": gpu.uuid}
            assert attrs["productName"] == {"string": gpu.product_name}
            assert attrs["memory"] == {"int": gpu.memory_bytes}
            assert attrs["resource.kubernetes.io/pciBusID"] == {"string": gpu.pci_bus_id}
            assert attrs["resource.kubernetes.io/pcieRoot"] == {"string": gpu.pcie_root}
            assert attrs["resource.kubernetes.io/numaNode"] == {"int": gpu.numa_node}
            assert len(attrs) <= dm.MAX_ATTRIBUTES
            host_file = Path(mount["hostPath"])
            assert host_file.is_relative_to(_metadata_dir(sandbox))
            assert oct(host_file.stat().st_mode & 0o777) == oct(0o644)

            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert not host_file.exists() and list(_metadata_dir(sandbox).iterdir()) == []

    asyncio.run(body())


def test_template_claim_with_two_requests_gets_one_file_per_request(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config(feature_gates=GATE_ON)) as (_plugin, kubelet):
            obj = claim_object("pod-0-gpus-x7k2p")
            obj["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpus"}
            claim = set_allocation(sandbox, sandbox.api.create(obj),
                                   [result("gpu-0", request="big/high-memory"),
                                    result("gpu-1", request="big/high-memory"), result("gpu-2", request="small")])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            mounts = dm.spec_mounts(_spec(sandbox, ref.uid))
            assert sorted(mounts) == [f"{ref.uid}-gpu-0", f"{ref.uid}-gpu-2"]  # the first device of each request
            [big] = mounts[f"{ref.uid}-gpu-0"]
            base = "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus"
            assert big["containerPath"] == f"{base}/big/gpu.nvidia.com-metadata.json"
            doc = read_mounted_metadata(big)[0]
            assert doc["podClaimName"] == "gpus"
            [request] = doc["requests"]
            assert request["name"] == "big/high-memory"  # the full reference inside, the base name in the path
            assert [d["name"] for d in request["devices"]] == ["gpu-0", "gpu-1"]
            [small] = mounts[f"{ref.uid}-gpu-2"]
            assert small["containerPath"] == f"{base}/small/gpu.nvidia.com-metadata.json"

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_static_mig_device_metadata_has_profile_and_placement(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            mig = next(d for d in plugin.inventory.allocatable() if d.name.startswith("gpu-0-mig-"))
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("mig")), [result(mig.name)])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [mount] = dm.spec_mounts(_spec(sandbox, ref.uid))[f"{ref.uid}-{mig.name}"]
            attrs = _only_device_of(read_mounted_metadata(mount))["attributes"]
            assert attrs["uuid"] == {"string": mig.uuid}
            assert attrs["parentUUID"] == {"string": mig.parent.uuid}
            assert attrs["profile"] == {"string": mig.profile}
            assert attrs["memory"] == {"int": mig.memory_bytes}
            assert (attrs["placementStart"], attrs["placementSize"]) == (
                {"int": mig.placement_start}, {"int": mig.placement_size})

    asyncio.run(body())


def test_time_sliced_gpu_carries_its_metadata_beside_the_sharing_edits(sandbox: SandboxNode) -> None:
    gates = GATE_ON.with_gates(TimeSlicingSettings=True)

    async def body() -> None:
        async with running(sandbox.config(feature_gates=gates)) as (plugin, kubelet):
            claim = allocate(sandbox, "ts", [result("gpu-5")],
                             [entry(params(sharing={"strategy": "TimeSlicing",
                                                    "timeSlicingConfig": {"interval": "Short"}}))])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [mount] = dm.spec_mounts(_spec(sandbox, ref.uid))[f"{ref.uid}-gpu-5"]
            device = _only_device_of(read_mounted_metadata(mount))
            assert device["attributes"]["uuid"] == {"string": plugin.inventory.gpus[5].uuid}

    asyncio.run(body())


def test_mps_shared_gpu_carries_its_metadata_beside_the_mps_edits(sandbox: SandboxNode) -> None:
    sandbox.run_workloads()  # the MPS control daemon's Deployment runs
    config = sandbox.mps_config()
    config = replace(config, feature_gates=config.feature_gates.with_gates(DeviceMetadata=True))

    async def body() -> None:
        async with running(config) as (plugin, kubelet):
            ref, claim = mps_claim(sandbox, "mps-md")
            [name] = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [device_spec] = [d for d in _spec(sandbox, ref.uid)["devices"] if d["name"] == f"{ref.uid}-{name}"]
            edits = device_spec["containerEdits"]
            assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]  # the MPS edits are kept
            assert {m["containerPath"] for m in edits["mounts"]} >= {"/tmp/nvidia-mps", "/dev/shm"}
            [mount] = dm.spec_mounts(_spec(sandbox, ref.uid))[f"{ref.uid}-{name}"]
            assert mount["containerPath"] == ("/var/run/kubernetes.io/dra-device-attributes/resourceclaims/mps-md/gpu/"
                                              f"{DRIVER}-metadata.json")
            device = _only_device_of(read_mounted_metadata(mount))
            gpu = plugin.inventory.find(name)
            assert device["name"] == name and device["attributes"]["uuid"] == {"string": gpu.uuid}
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert list(_metadata_dir(sandbox).iterdir()) == []

    asyncio.run(body())


def test_gate_off_writes_no_metadata_and_mounts_nothing(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_plugin, kubelet):
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("plain")), [result("gpu-1")])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert dm.spec_mounts(_spec(sandbox, ref.uid)) == {}
            assert not _metadata_dir(sandbox).exists()

    asyncio.run(body())


def test_vanished_spec_is_rewritten_with_its_metadata_mount(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        claim = set_allocation(sandbox, sandbox.api.create(claim_object("kept")), [result("gpu-6")])
        ref = ref_of(claim)
        async with running(sandbox.config(feature_gates=GATE_ON)) as (_plugin, kubelet):
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            before = dm.spec_mounts(_spec(sandbox, ref.uid))
        GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, ref.uid).unlink()  # someone cleaned /var/run/cdi
        async with running(sandbox.config(feature_gates=GATE_ON)) as (_plugin, kubelet):
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert dm.spec_mounts(_spec(sandbox, ref.uid)) == before
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert list(_metadata_dir(sandbox).iterdir()) == []

    asyncio.run(body())


# The plugin process with a real SIGKILL at the moment the claim's CDI spec is about to be written (its device
# metadata files exist by then): what the next start finds is a half-prepared claim and files no spec names.
_KILL_AT_SPEC_WRITE = """
import os, signal, sys
from dradriver.host import cdifiles
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
cdifiles.write_claim_spec = die
from dradriver.cli import main
sys.exit(main(["gpu-kubelet-plugin"]))
"""


def test_sigkill_between_metadata_file_and_spec_leaves_nothing_after_restart(sandbox: SandboxNode) -> None:
    assert sandbox.api is not None
    claim = set_allocation(sandbox, sandbox.api.create(claim_object("doomed")), [result("gpu-2")])
    ref = ref_of(claim)
    env = _plugin_env(sandbox)
    env.update(FEATURE_GATES="DeviceMetadata=true", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                           env.get("PYTHONPATH")])))

    async def body() -> None:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _KILL_AT_SPEC_WRITE, env=env,
                                                    cwd=str(ROOT))
        try:
            async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin(DRIVER, timeout=30)
                with_error = asyncio.create_task(connection.prepare([ref]))
                await asyncio.wait_for(proc.wait(), 30)
                assert proc.returncode == -9
                with_error.cancel()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        written = list(_metadata_dir(sandbox).glob(f"{ref.uid}/*/*-metadata.json"))
        assert len(written) == 1  # the file was written, then the process died before the spec
        assert sandbox.cdi_specs() == []
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            assert ref.uid in plugin.recovery.rolled_back
            assert list(_metadata_dir(sandbox).iterdir()) == []
            # the kubelet's retry prepares it afresh
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            await wait_for(lambda: len(list(_metadata_dir(sandbox).iterdir())) == 1)

    asyncio.run(body())


def test_dynamic_mig_device_metadata_has_the_created_instance_uuid(mig_node: SandboxNode) -> None:
    async def body() -> None:
        assert mig_node.api is not None
        gates = GATE_ON.with_gates(DynamicMIG=True)
        async with running(mig_node.config(feature_gates=gates)) as (_plugin, kubelet):
            device = "gpu-0-mig-1g10gb-19-3"
            claim = set_allocation(mig_node, mig_node.api.create(claim_object("one-g")), [result(device)])
            ref = ref_of(claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            [ci] = [line.split() for line in mig_node.mig_state_path.read_text().splitlines()
                    if line.startswith("ci ")]
            [mount] = dm.spec_mounts(_spec(mig_node, ref.uid))[f"{ref.uid}-{device}"]
            attrs = _only_device_of(read_mounted_metadata(mount))["attributes"]
            assert attrs["uuid"] == {"string": ci[8]}  # known only once the instance exists
            assert attrs["profile"] == {"string": "1g.10gb"}
            assert (attrs["placementStart"], attrs["placementSize"]) == ({"int": 3}, {"int": 1})
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert list(_metadata_dir(mig_node).iterdir()) == []

    asyncio.run(body())


def test_each_mps_share_of_one_gpu_gets_its_own_metadata_file(tmp_path: Path) -> None:
    with SandboxNode(profile=h200_node(tmp_path, gpus=2)) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        node.run_workloads()
        config = node.shares_config()
        config = replace(config, feature_gates=config.feature_gates.with_gates(DeviceMetadata=True))

        async def body() -> None:
            async with running(config) as (plugin, kubelet):
                await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
                claims = allocate_shares(node, share_claim("share-a"), share_claim("share-b"))
                for claim in claims:
                    ref = ref_of(claim)
                    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                    spec = _spec(node, ref.uid)
                    env = spec["devices"][0]["containerEdits"]["env"]
                    assert any(e.startswith("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=") for e in env)  # the share's edits
                    [mount] = dm.spec_mounts(spec)[f"{ref.uid}-gpu-0"]
                    doc = read_mounted_metadata(mount)[0]
                    assert doc["metadata"]["name"] == claim["metadata"]["name"]
                    [device] = doc["requests"][0]["devices"]
                    assert device["attributes"]["uuid"] == {"string": plugin.inventory.gpus[0].uuid}
                assert len(list(_metadata_dir(node).iterdir())) == 2
                for claim in claims:
                    ref = ref_of(claim)
                    assert (await kubelet.unprepare([ref]))[ref.uid] == ""
                assert list(_metadata_dir(node).iterdir()) == []

        asyncio.run(body())
