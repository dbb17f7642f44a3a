"""The sandbox scheduler serves device-plugin-style Pods (``nvidia.com/gpu: 1``) through DRA (KEP-5004).

Against the API emulator with the DeviceClasses ``deploy/`` ships and the example Pod ``deploy/examples/
device-plugin-pod.yaml``; ``dradriver demo`` (step 5, ``tests/commands/test_demo.py``) runs the same path
through the real kubelet plugin.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.allocator.allocation import AllocationError
from dradriver.sandbox import scheduler
from dradriver.sandbox.apiserver import ApiServerEmulator

ROOT = Path(__file__).resolve().parents[2]
H100_SLICE = ROOT / "tests" / "allocator" / "fixtures" / "h100.yaml"


def _objects(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator() as emulator:
        for obj in _objects(ROOT / "deploy" / "kustomize" / "base" / "deviceclasses.yaml"):
            emulator.create(obj)
        for obj in _objects(H100_SLICE):
            emulator.create(obj)
        yield emulator


def _pod(api: ApiServerEmulator, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    [pod] = _objects(ROOT / "deploy" / "examples" / "device-plugin-pod.yaml")
    if limits is not None:
        pod["spec"]["containers"][0]["resources"]["limits"] = limits
    return api.create(pod)


def test_the_scheduler_generates_allocates_and_records_the_claim(api: ApiServerEmulator) -> None:
    api.add_node("h100-node")
    pod = _pod(api)
    claim = scheduler.schedule_extended(api, pod, node_name="h100-node")
    assert claim is not None
    meta = claim["metadata"]
    assert meta["name"].startswith("cuda-vectoradd-extended-resources-")
    assert meta["generateName"] == "cuda-vectoradd-extended-resources-"
    assert meta["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "cuda-vectoradd",
                                        "uid": pod["metadata"]["uid"], "controller": True,
                                        "blockOwnerDeletion": True}]
    assert claim["spec"]["devices"]["requests"] == [
        {"name": "container-0-request-0",
         "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1}}
    ]
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "cuda-vectoradd",
                                               "uid": pod["metadata"]["uid"]}]
    stored = api.get("Pod", "cuda-vectoradd", "default")
    assert stored is not None
    assert stored["status"]["extendedResourceClaimStatus"] == {
        "requestMappings": [{"containerName": "cuda-vectoradd", "resourceName": "nvidia.com/gpu",
                             "requestName": "container-0-request-0"}],
        "resourceClaimName": meta["name"],
    }
    # A second scheduling pass finds the claim through the Pod's status: no second claim.
    again = scheduler.schedule_extended(api, stored, node_name="h100-node")
    assert again is not None and again["metadata"]["name"] == meta["name"]
    assert len(api.objects("ResourceClaim")) == 1


def test_a_node_whose_device_plugin_offers_the_resource_keeps_it(api: ApiServerEmulator) -> None:
    api.add_node("h100-node", allocatable={"cpu": "64", "nvidia.com/gpu": "4"})
    assert scheduler.schedule_extended(api, _pod(api), node_name="h100-node") is None
    assert api.objects("ResourceClaim") == []


def test_without_the_mapping_the_pod_cannot_be_scheduled_and_says_why(api: ApiServerEmulator) -> None:
    api.add_node("h100-node")
    gpu_class = api.get("DeviceClass", "gpu.nvidia.com")
    assert gpu_class is not None
    del gpu_class["spec"]["extendedResourceName"]
    api.update(gpu_class)
    with pytest.raises(AllocationError) as info:
        scheduler.schedule_extended(api, _pod(api), node_name="h100-node")
    assert str(info.value).startswith(
        "cannot schedule pod default/cuda-vectoradd: container 'cuda-vectoradd' asks for nvidia.com/gpu: 1, and "
        "nothing serves it: no DeviceClass has spec.extendedResourceName nvidia.com/gpu"
    )
    assert api.objects("ResourceClaim") == []


def test_the_implicit_class_name_works_without_the_mapping(api: ApiServerEmulator) -> None:
    api.add_node("h100-node")
    pod = _pod(api, {"deviceclass.resource.kubernetes.io/gpu.nvidia.com": 2})
    claim = scheduler.schedule_extended(api, pod, node_name="h100-node")
    assert claim is not None
    assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["gpu-0", "gpu-1"]


def test_the_sandbox_cluster_binds_a_device_plugin_style_pod_once() -> None:
    """``dradriver sandbox``'s control plane: claim generated, allocated, Pod bound; a later pass reuses it."""
    from dradriver.sandbox.cluster import ClusterEmulator
    from dradriver.sandbox.node import SandboxNode

    messages: list[str] = []
    with SandboxNode(profile="dgx-h100") as node:
        api = node.api
        assert api is not None
        cluster = ClusterEmulator(node, say=messages.append)
        cluster.apply_device_classes()
        for obj in _objects(H100_SLICE):
            obj["spec"]["nodeName"] = node.node_name
            api.create(obj)
        pod = _pod(api)
        claims = cluster._pod_claims(pod)
        assert claims is not None
        [claim] = claims
        assert claim["metadata"]["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
        bound = api.get("Pod", "cuda-vectoradd", "default")
        assert bound is not None and bound["spec"]["nodeName"] == node.node_name
        assert bound["status"]["extendedResourceClaimStatus"]["resourceClaimName"] == claim["metadata"]["name"]
        assert messages == [
            f"scheduler: pod default/cuda-vectoradd (extended resources) -> node {node.node_name}, claim "
            f"{claim['metadata']['name']}, devices gpu-0"
        ]
        again = cluster._pod_claims(bound)
        assert again is not None and [c["metadata"]["name"] for c in again] == [claim["metadata"]["name"]]
        assert len(messages) == 1 and len(api.objects("ResourceClaim")) == 1


def test_the_sandbox_cluster_serves_claims_and_extended_resources_of_one_pod() -> None:
    from dradriver.sandbox.cluster import ClusterEmulator
    from dradriver.sandbox.node import SandboxNode

    with SandboxNode(profile="dgx-h100") as node:
        api = node.api
        assert api is not None
        cluster = ClusterEmulator(node, say=lambda _: None)
        cluster.apply_device_classes()
        for obj in _objects(H100_SLICE):
            obj["spec"]["nodeName"] = node.node_name
            api.create(obj)
        api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": "mine", "namespace": "default"},
                    "spec": {"devices": {"requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}})
        [pod] = _objects(ROOT / "deploy" / "examples" / "device-plugin-pod.yaml")
        pod["spec"]["resourceClaims"] = [{"name": "mine", "resourceClaimName": "mine"}]
        claims = cluster._pod_claims(api.create(pod))
        assert claims is not None
        assert [c["metadata"]["name"].split("-extended-resources-")[0] for c in claims] == ["mine", "cuda-vectoradd"]
        assert {c["status"]["allocation"]["devices"]["results"][0]["device"] for c in claims} == {"gpu-0", "gpu-1"}
