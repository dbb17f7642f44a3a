"""Fabric Manager partitions end to end (gate ``FabricManagerPartitioning``): the real plugin over gRPC with the mock
``libnvfm.so.1`` talking to the Fabric Manager stand-in. GPUs publish ``gpuModuleID`` and ``partition<N>``; a
claim's GPUs that form one partition activate it at prepare and deactivate it at unprepare; a claim whose GPUs
form none is refused naming the nearest partitions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from dradriver.domain import featuregates as fg
from dradriver.domain.claims import ClaimRef
from dradriver.sandbox.node import SandboxNode
from tests.fabricmanager.nodes import active_partitions, fm_node
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation

GATES = fg.parse_feature_gates("FabricManagerPartitioning=true")


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with fm_node() as n:
        yield n


def claim_for(node: SandboxNode, name: str, *devices: str) -> ClaimRef:
    assert node.api is not None
    claim = node.api.create(claim_object(name, count=len(devices)))
    return ref_of(set_allocation(node, claim, [result(d) for d in devices]))


def attributes(node: SandboxNode, device: str) -> dict[str, Any]:
    assert node.api is not None
    [found] = [d for s in node.api.objects("ResourceSlice") for d in s["spec"]["devices"] if d["name"] == device]
    return {k: next(iter(v.values())) for k, v in found["attributes"].items()}


def test_two_gpus_of_one_partition_activate_it_at_prepare_and_deactivate_it_at_unprepare(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            gpu0, gpu2 = attributes(node, "gpu-0"), attributes(node, "gpu-2")
            assert (gpu0["gpuModuleID"], gpu2["gpuModuleID"]) == (1, 3)
            assert gpu0["partition2"] == gpu2["partition2"] == 3  # modules 1 and 3 pair in the HGX table
            ref = claim_for(node, "pair", "gpu-0", "gpu-2")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            assert active_partitions(node) == {3}
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert active_partitions(node) == set()

    asyncio.run(body())


def test_a_claim_whose_gpus_form_no_partition_is_refused_naming_the_nearest(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(node, "odd", "gpu-0", "gpu-1", "gpu-2")
            error = (await kubelet.prepare([ref]))[ref.uid].error
            assert "default/odd" in error and "gpu-1 (module 2)" in error
            assert "smallest partitions containing them: 1 {1, 2, 3, 4}" in error
            assert active_partitions(node) == set()
            single = claim_for(node, "single", "gpu-7")
            assert (await kubelet.prepare([single]))[single.uid].error == ""  # the plugin serves on
            assert active_partitions(node) == {14}
            assert await kubelet.unprepare([single]) == {single.uid: ""}

    asyncio.run(body())


def test_the_gate_turned_off_deactivates_the_partition_of_a_claim_prepared_while_it_was_on(node: SandboxNode) -> None:
    async def body() -> None:
        async with running(node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(node, "pair", "gpu-0", "gpu-2")
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        assert active_partitions(node) == {3}
        async with running(node.config()) as (_plugin, kubelet):
            assert "partition2" not in attributes(node, "gpu-0")
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert active_partitions(node) == set()

    asyncio.run(body())


def test_vfio_devices_of_one_partition_activate_it_and_are_passed_through() -> None:
    gates = fg.parse_feature_gates("FabricManagerPartitioning=true,PassthroughSupport=true")
    with fm_node(pci_tree=True) as node:
        async def body() -> None:
            async with running(node.config(feature_gates=gates)) as (_plugin, kubelet):
                assert attributes(node, "gpu-vfio-2")["partition2"] == 3
                ref = claim_for(node, "vm", "gpu-vfio-0", "gpu-vfio-2")
                assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                assert active_partitions(node) == {3}
                assert node.pci_host().function("0000:3a:00.0").driver == "vfio-pci"
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}
                assert active_partitions(node) == set()
                assert node.pci_host().function("0000:3a:00.0").driver == "nvidia"

        asyncio.run(body())
