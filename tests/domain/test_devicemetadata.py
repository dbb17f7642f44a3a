"""KEP-5304 ``DeviceMetadata`` documents (the Kubernetes docs' "Device metadata protocol" and schema example)."""

from __future__ import annotations

import json

import pytest

from dradriver.domain import devicemetadata as dm
from dradriver.domain.claims import AllocationResult, Claim, ClaimRef, claim_from_object

REF = ClaimRef("gpu-test1", "pod0-gpu-2kqrd", "c7e7b22e-239b-4498-b27c-7f1344481e14")


def test_stream_matches_the_documented_example_once_per_version_newest_first() -> None:
    claim = Claim(REF, (AllocationResult("gpu", "gpu.example.com", "worker-0", "gpu-0"),), pod_claim_name="gpu")
    device = dm.MetadataDevice("worker-0", "gpu-0", {"uuid": {"string": "gpu-18db0e85"}, "index": {"int": 0}})
    data = dm.encode(claim, dm.RequestMetadata("gpu", (device,)), "gpu.example.com")
    lines = data.decode().splitlines()
    assert [json.loads(line)["apiVersion"] for line in lines] == ["metadata.resource.k8s.io/v1beta1",
                                                                  "metadata.resource.k8s.io/v1alpha1"]
    assert json.loads(lines[0]) == {
        "kind": "DeviceMetadata",
        "apiVersion": "metadata.resource.k8s.io/v1beta1",
        "metadata": {"name": "pod0-gpu-2kqrd", "namespace": "gpu-test1",
                     "uid": "c7e7b22e-239b-4498-b27c-7f1344481e14", "generation": 1},
        "podClaimName": "gpu",
        "requests": [{"name": "gpu", "devices": [{"driver": "gpu.example.com", "pool": "worker-0", "name": "gpu-0",
                                                  "attributes": {"index": {"int": 0},
                                                                 "uuid": {"string": "gpu-18db0e85"}}}]}],
    }
    assert dm.decode(data) == [json.loads(line) for line in lines]
    older = dm.first_known(dm.decode(data), ("metadata.resource.k8s.io/v1alpha1",))  # a reader of v1alpha1 only
    assert older is not None and older["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"


def test_container_path_uses_the_base_request_and_the_pod_claim_name() -> None:
    direct = Claim(REF, ())
    assert dm.container_path(direct, "gpu/high-memory", "gpu.nvidia.com") == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/pod0-gpu-2kqrd/gpu/gpu.nvidia.com-metadata.json")
    template = Claim(REF, (), pod_claim_name="gpus")
    assert dm.container_path(template, "gpu", "gpu.nvidia.com") == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/gpu/gpu.nvidia.com-metadata.json")


def test_published_attributes_win_and_at_most_32_are_kept() -> None:
    published = {f"a{i}": {"int": i} for i in range(30)}
    merged = dm.merge_attributes(published, {"a0": {"int": 99}, "x": {"int": 1}}, {"y": {"int": 2}, "z": {"int": 3}})
    assert merged["a0"] == {"int": 0} and len(merged) == dm.MAX_ATTRIBUTES and "z" not in merged


def test_a_stream_that_is_not_json_objects_is_refused() -> None:
    with pytest.raises(dm.MetadataFormatError):
        dm.decode(b'{"kind": "DeviceMetadata"} [1]')
    with pytest.raises(dm.MetadataFormatError):
        dm.decode(b'{"kind": ')


def test_claim_keeps_its_pod_claim_name_annotation() -> None:
    obj = {"metadata": {"uid": REF.uid, "annotations": {"resource.kubernetes.io/pod-claim-name": "gpus"}},
           "status": {"allocation": {"devices": {"results": [
               {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n", "device": "gpu-0"}]}}}}
    assert claim_from_object(obj, REF, driver="gpu.nvidia.com", pool="n").pod_claim_name == "gpus"
    del obj["metadata"]["annotations"]
    assert claim_from_object(obj, REF, driver="gpu.nvidia.com", pool="n").pod_claim_name is None
