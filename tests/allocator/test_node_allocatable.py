"""KEP-5517 in the simulator: a Pod's CPU/memory requests plus its devices' published overhead against its Node's
``status.allocatable``; ``explain`` shows the sums and refuses a node that cannot hold them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from dradriver.allocator.resources import InputError
from dradriver.allocator.simulation import explain, load, simulate
from dradriver.domain import nodeallocatable as na
from dradriver.domain.devices import DriverVersions, NodeInventory
from dradriver.domain.pools import build_resource_slices
from tests.allocator.test_consumable import classes
from tests.factories import gpu_device

VERSIONS = DriverVersions(driver="570.148.08", cuda_driver=12080, nvml="12.570.148.08")
OVERHEAD = na.parse_overhead({("gpu", "memory", "pod"): "2Gi", ("gpu", "memory", "container"): "1Gi",
                              ("gpu", "cpu", "pod"): "500m"}, gate_enabled=True)


def slices(overhead: na.NodeAllocatableOverhead = OVERHEAD) -> str:
    inventory = NodeInventory(versions=VERSIONS, gpus=tuple(
        gpu_device(i, pci_bus_id=f"0000:{7 + i:02x}:00.0") for i in range(2)))
    built = build_resource_slices(inventory, "node-a", generate_name=False)
    na.apply_overhead(built, overhead)
    for i, s in enumerate(built):
        s["metadata"]["name"] = f"node-a-gpu.nvidia.com-{i}"
    return yaml.safe_dump_all(built)


def node(cpu: str = "4", memory: str = "16Gi") -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
                           "status": {"allocatable": {"cpu": cpu, "memory": memory, "pods": "110"}}})


TEMPLATE = yaml.safe_dump({
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
    "metadata": {"name": "one-gpu", "namespace": "default"},
    "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}},
})


def pod(name: str, memory: str, containers: int) -> str:
    obj: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}], "containers": [
            {"name": f"c{i}", "image": "cuda", "resources": {
                "requests": {"memory": memory if i == 0 else "0", "cpu": "1"}, "claims": [{"name": "gpu"}]}}
            for i in range(containers)]},
    }
    return yaml.safe_dump(obj)


def test_a_pod_that_fits_only_without_its_devices_overhead_is_not_scheduled() -> None:
    # big: 10Gi requests + 2Gi perPod + 2 containers x 1Gi = 14Gi of 16Gi; small: 1Gi + 2Gi + 1Gi = 4Gi > 2Gi left
    texts = [classes(), slices(), node(), TEMPLATE, pod("big", "10Gi", 2), pod("small", "1Gi", 1)]
    outcome = simulate(load(texts))
    assert outcome.pod_nodes == {"default/big": "node-a"}
    [failure] = outcome.failures
    assert "Insufficient memory: the pod needs 4Gi (requests 1Gi + DRA device overhead 3Gi), 2Gi of 16Gi " \
           "allocatable is left (14Gi taken by other pods) on node node-a" in failure
    text, code = explain(load(texts))
    assert code == 1
    assert "memory: requests 10Gi + DRA device overhead 4Gi = 14Gi of 16Gi allocatable (0 taken by other pods)" in text
    assert "cpu: requests 2 + DRA device overhead 500m = 2500m of 4 allocatable" in text
    assert ("device node-a/gpu-0: cpu 500m (perPod 500m); memory 4Gi (perPod 2Gi + perContainer 1Gi x 2 "
            "container(s))") in text
    # the same pods without the overhead both fit
    assert simulate(load([classes(), slices(na.NodeAllocatableOverhead()), node(), TEMPLATE,
                          pod("big", "10Gi", 2), pod("small", "1Gi", 1)])).failures == []


def test_a_node_without_allocatable_is_not_checked() -> None:
    texts = [classes(), slices(), TEMPLATE, pod("big", "100Gi", 2)]
    assert simulate(load(texts)).failures == []


def test_a_malformed_overhead_in_a_slice_is_an_input_error_naming_the_device() -> None:
    bad = yaml.safe_load_all(slices())
    docs = list(bad)
    docs[0]["spec"]["devices"][0][na.FIELD] = {"memory": {"overhead": {"perPod": "-1Gi"}}}
    with pytest.raises(InputError, match=r"devices\[0\]\.nodeAllocatableResources\[memory\]\.overhead\.perPod"):
        load([classes(), yaml.safe_dump_all(docs)])
