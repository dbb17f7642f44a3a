"""VFIO passthrough end to end (gate ``PassthroughSupport``): the real plugin over gRPC on a sandbox node whose PCI
tree the PCI bus stand-in serves and whose mock NVML lists only the GPUs bound to ``nvidia``; the API emulator over
HTTP. A ``gpu-vfio-<index>`` claim takes its GPU from ``nvidia`` and gives it back; the sibling ``gpu-<minor>`` is
withdrawn from the pool meanwhile; refusals are per claim and leave the plugin serving."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain import featuregates as fg
from dradriver.domain.claims import ClaimRef
from dradriver.errors import DradriverError
from dradriver.sandbox.node import FIRST_IOMMU_GROUP, SandboxNode
from tests import factories
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for

GATES = fg.parse_feature_gates("PassthroughSupport=true")
GPU0 = "0000:18:00.0"


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile="dgx-h100", pci_tree=True) as n:
        assert n.api is not None
        n.api.create(factories.DEVICE_CLASS)
        yield n


def claim_for(node: SandboxNode, name: str, *devices: str) -> ClaimRef:
    assert node.api is not None
    claim = node.api.create(claim_object(name))
    return ref_of(set_allocation(node, claim, [result(d) for d in devices]))


def published(node: SandboxNode) -> dict[str, dict[str, Any]]:
    """Device name -> its attributes, over the node's ResourceSlices."""
    assert node.api is not None
    return {d["name"]: {k: next(iter(v.values())) for k, v in d.get("attributes", {}).items()}
            for s in node.api.objects("ResourceSlice") for d in s["spec"].get("devices", [])}


def driver_of(node: SandboxNode, address: str = GPU0) -> str | None:
    return node.pci_host().function(address).driver


def spec_of(node: SandboxNode, ref: ClaimRef) -> dict[str, Any]:
    [path] = [p for p in node.cdi_specs() if ref.uid in p.name]
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def test_vfio_devices_are_published_beside_the_gpus_and_a_prepare_swaps_the_gpu_and_back(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
            pool = published(node)
            assert {f"gpu-{i}" for i in range(8)} | {f"gpu-vfio-{i}" for i in range(8)} <= set(pool)
            assert pool["gpu-vfio-0"]["type"] == "vfio"
            uuid0 = pool["gpu-0"]["uuid"]
            ref = claim_for(node, "vm", "gpu-vfio-0")
            answer = await kubelet.prepare([ref])
            assert answer[ref.uid].error == ""
            assert driver_of(node) == "vfio-pci"
            spec = spec_of(node, ref)
            [device] = spec["devices"]
            assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [f"/dev/vfio/{FIRST_IOMMU_GROUP}"]
            assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]  # once per claim
            await wait_for(lambda: "gpu-0" not in published(node), 20)
            assert "gpu-vfio-0" in published(node) and "gpu-1" in published(node)
            await wait_for(lambda: all(g.minor != 0 for g in plugin.inventory.gpus), 20)  # NVML no longer lists it
            assert plugin.inventory.vfio[0].sibling == "gpu-0"  # known from its record
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
            await wait_for(lambda: "gpu-0" in published(node), 20)
            assert published(node)["gpu-0"]["uuid"] == uuid0

    asyncio.run(body())


def test_a_claim_whose_device_is_the_sibling_of_a_held_one_is_refused_naming_both(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            gpu = claim_for(node, "pod", "gpu-1")
            vm = claim_for(node, "vm", "gpu-vfio-1")  # allocated before either was prepared: the race
            assert (await kubelet.prepare([gpu]))[gpu.uid].error == ""
            error = (await kubelet.prepare([vm]))[vm.uid].error
            assert "'gpu-vfio-1'" in error and "'gpu-1'" in error and "default/pod" in error
            assert driver_of(node, "0000:2a:00.0") == "nvidia"
            both = claim_for(node, "both", "gpu-2", "gpu-vfio-2")
            assert "cannot hold both" in (await kubelet.prepare([both]))[both.uid].error
            assert await kubelet.unprepare([gpu]) == {gpu.uid: ""}
            assert (await kubelet.prepare([vm]))[vm.uid].error == ""
            assert await kubelet.unprepare([vm]) == {vm.uid: ""}

    asyncio.run(body())


def test_the_gate_turned_off_unprepares_a_vfio_claim_prepared_while_it_was_on(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(node, "vm", "gpu-vfio-0")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        assert driver_of(node) == "vfio-pci"
        async with running(node.config()) as (plugin, kubelet):
            assert not any(n.startswith("gpu-vfio-") for n in published(node))
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert driver_of(node) == "nvidia"
            await wait_for(lambda: any(g.minor == 0 for g in plugin.inventory.gpus), 20)

    asyncio.run(body())


def test_a_start_without_iommu_groups_is_a_loud_error_naming_the_path(node: SandboxNode) -> None:
    groups = node.root / "sys" / "kernel" / "iommu_groups"
    for group in groups.iterdir():
        for link in (group / "devices").iterdir():
            link.unlink()
        (group / "devices").rmdir()
        group.rmdir()

    async def body() -> None:
        with pytest.raises(DradriverError, match=str(groups)):
            async with running(node.config(feature_gates=GATES)):
                pass

    asyncio.run(body())


def test_a_start_without_the_host_root_is_a_loud_error_naming_it(node: SandboxNode) -> None:
    async def body() -> None:
        with pytest.raises(DradriverError, match="--host-root /nonexistent"):
            async with running(node.config(feature_gates=GATES, host_root=Path("/nonexistent"))):
                pass

    asyncio.run(body())
