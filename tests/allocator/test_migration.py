"""The migration path from the device plugin: older API versions, workloads, extended resources, CEL wording."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.allocator.naming import ALPHANUMS, claim_generate_name, generated_name
from dradriver.allocator.resources import InputError
from dradriver.allocator.simulation import explain, load, simulate
from dradriver.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture(*names: str) -> list[str]:
    return [(FIXTURES / f"{n}.yaml").read_text() for n in ("deviceclasses", *names)]


def docs(*objects: dict[str, Any]) -> str:
    return yaml.safe_dump_all(list(objects))


def device_names(outcome: Any) -> dict[str, list[str]]:
    return {
        c["metadata"]["name"]: [r["device"] for r in c["status"]["allocation"]["devices"]["results"]]
        for c in outcome.claims
    }


# NVIDIA's quickstart (gpu-test1) in resource.k8s.io/v1beta1: request fields at the request's top level.
QUICKSTART_V1BETA1 = """
apiVersion: v1
kind: Namespace
metadata:
  name: gpu-test1
---
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaimTemplate
metadata:
  namespace: gpu-test1
  name: single-gpu
spec:
  spec:
    devices:
      requests:
      - name: gpu
        deviceClassName: gpu.nvidia.com
---
apiVersion: v1
kind: Pod
metadata:
  namespace: gpu-test1
  name: pod1
spec:
  containers:
  - name: ctr
    image: ubuntu:22.04
    resources:
      claims:
      - name: gpu
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: single-gpu
"""


def test_v1beta1_quickstart_template_is_converted_like_the_api_server_does() -> None:
    outcome = simulate(load([*fixture("h100"), QUICKSTART_V1BETA1]))
    assert not outcome.failures
    (claim,) = outcome.claims
    assert claim["apiVersion"] == "resource.k8s.io/v1"
    assert claim["spec"]["devices"]["requests"] == [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
    assert claim["metadata"]["name"].startswith("pod1-gpu-")
    assert device_names(outcome) == {claim["metadata"]["name"]: ["gpu-0"]}
    (pod,) = outcome.pods
    assert pod["spec"]["nodeName"] == "h100-node"
    assert pod["status"]["resourceClaimStatuses"] == [{"name": "gpu", "resourceClaimName": claim["metadata"]["name"]}]


def test_v1beta1_first_available_and_v1beta2_exactly_and_v1beta1_basic_slices() -> None:
    v1beta1 = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"name": "fallback", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
            {"name": "big", "deviceClassName": "gpu.nvidia.com", "count": 8},
            {"name": "one", "deviceClassName": "gpu.nvidia.com"},
        ]}]}},
    }
    v1beta2 = {
        "apiVersion": "resource.k8s.io/v1beta2",
        "kind": "ResourceClaim",
        "metadata": {"name": "two", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                                       "count": 2}}]}},
    }
    # The same slice in v1beta1: every device's fields wrapped in "basic".
    v1_slice = yaml.safe_load((FIXTURES / "h100.yaml").read_text().split("\n---\n")[0])
    old_slice = copy.deepcopy(v1_slice)
    old_slice["apiVersion"] = "resource.k8s.io/v1beta1"
    old_slice["spec"]["devices"] = [
        {"name": d["name"], "basic": {k: v for k, v in d.items() if k != "name"}} for d in v1_slice["spec"]["devices"]
    ]
    outcome = simulate(load([fixture()[0], docs(old_slice, v1beta1, v1beta2)]))
    assert not outcome.failures
    assert device_names(outcome) == {"fallback": ["gpu-0"], "two": ["gpu-1", "gpu-2"]}
    fallback = outcome.claims[0]["status"]["allocation"]["devices"]["results"]
    assert fallback[0]["request"] == "gpu/one"


def test_v1beta1_request_with_first_available_and_a_class_is_refused() -> None:
    bad = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"name": "both", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com",
                                           "firstAvailable": [{"name": "a", "deviceClassName": "gpu.nvidia.com"}]}]}},
    }
    with pytest.raises(InputError, match=r"claims\.yaml: .*ResourceClaim default/both: spec\.devices\.requests\[0\]: "
                                         r"firstAvailable cannot be combined with deviceClassName"):
        load([docs(bad)], ["claims.yaml"])


def test_v1_claim_in_the_v1beta1_shape_says_what_to_change() -> None:
    text = QUICKSTART_V1BETA1.replace("resource.k8s.io/v1beta1", "resource.k8s.io/v1")
    with pytest.raises(InputError) as info:
        load([*fixture("h100"), text], ["deviceclasses.yaml", "h100.yaml", "quickstart.yaml"])
    assert str(info.value) == (
        "quickstart.yaml: resource.k8s.io/v1 ResourceClaimTemplate gpu-test1/single-gpu: "
        "spec.spec.devices.requests[0].deviceClassName: not a field of resource.k8s.io/v1 (this is the "
        "resource.k8s.io/v1beta1 shape); move the request's fields under exactly, or set apiVersion: "
        "resource.k8s.io/v1beta1"
    )


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (
            {"apiVersion": "resource.k8s.io/v1alpha2", "kind": "ResourceClaim",
             "metadata": {"name": "old", "namespace": "default"}, "spec": {"resourceClassName": "gpu.nvidia.com"}},
            "resource.k8s.io/v1alpha2 ResourceClaim default/old: classic DRA",
        ),
        (
            {"apiVersion": "resource.k8s.io/v1alpha2", "kind": "ResourceClass", "metadata": {"name": "gpu"},
             "driverName": "gpu.resource.nvidia.com"},
            "resource.k8s.io/v1alpha2 ResourceClass gpu: classic DRA",
        ),
        (
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "mixed", "namespace": "default"},
             "spec": {"resourceClassName": "gpu", "parametersRef": {"kind": "ConfigMap", "name": "p"}}},
            "resource.k8s.io/v1 ResourceClaim default/mixed: spec.resourceClassName: classic DRA",
        ),
    ],
)
def test_classic_dra_is_refused_with_the_reason(obj: dict[str, Any], reason: str, capsys: Any) -> None:
    with pytest.raises(InputError) as info:
        load([*fixture("h100"), docs(obj)])
    assert reason in str(info.value)
    assert "removed in Kubernetes 1.31" in str(info.value)
    sys.stdin = io.StringIO(docs(obj))
    try:
        assert main(["allocate"]) == 2
    finally:
        sys.stdin = sys.__stdin__
    assert "removed in Kubernetes 1.31" in capsys.readouterr().err


def test_v1alpha3_claims_are_refused() -> None:
    obj = {"apiVersion": "resource.k8s.io/v1alpha3", "kind": "ResourceClaim",
           "metadata": {"name": "a3", "namespace": "default"},
           "spec": {"devices": {"requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}]}}}
    with pytest.raises(InputError, match=r"v1alpha3 ResourceClaim was last served by Kubernetes 1\.32"):
        load([docs(obj)])


# ------------------------------------------------------------------------------------------------ workloads

GPU_TEMPLATE = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaimTemplate",
    "metadata": {"name": "one-gpu", "namespace": "default"},
    "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}},
}


def pod_template(**extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app": "train"}},
        "spec": {
            "containers": [{"name": "trainer", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            **extra,
        },
    }


def deployment(replicas: int) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "train", "namespace": "default"},
            "spec": {"replicas": replicas, "template": pod_template()}}


def test_a_four_replica_deployment_fits_four_gpus_and_a_fifth_does_not() -> None:
    outcome = simulate(load([*fixture("h100"), docs(GPU_TEMPLATE, deployment(4))]))
    assert not outcome.failures
    assert len(outcome.pods) == 4
    replica_set = outcome.pods[0]["metadata"]["ownerReferences"][0]["name"]
    assert replica_set.startswith("train-")
    for pod in outcome.pods:
        name = pod["metadata"]["name"]
        assert name.startswith(replica_set + "-") and len(name) == len(replica_set) + 6
        assert set(name[-5:]) <= set(ALPHANUMS)
        assert pod["metadata"]["labels"]["pod-template-hash"] == replica_set.removeprefix("train-")
        (status,) = pod["status"]["resourceClaimStatuses"]
        assert status["resourceClaimName"].startswith(f"{name}-gpu-")
    assert sorted(d for devices in device_names(outcome).values() for d in devices) == [
        "gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    text, code = explain(load([*fixture("h100"), docs(GPU_TEMPLATE, deployment(5))]))
    assert code == 1
    assert f"note: Deployment default/train: 5 replica(s) of ReplicaSet {replica_set}" in text
    assert text.count(": scheduled on node h100-node") == 4
    assert text.count(": PENDING: claim(s)") == 1
    assert "already allocated to default/" in text


def test_statefulset_job_and_mpijob_pods_are_named_like_their_controllers() -> None:
    statefulset = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "db"},
                   "spec": {"replicas": 2, "ordinals": {"start": 3}, "template": pod_template()}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "bench"},
           "spec": {"parallelism": 3, "completions": 2, "completionMode": "Indexed", "template": pod_template()}}
    mpijob = {
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": "allreduce"},
        "spec": {"mpiReplicaSpecs": {
            "Launcher": {"replicas": 1, "template": {"spec": {"containers": [{"name": "l", "image": "mpi"}]}}},
            "Worker": {"replicas": 2, "template": pod_template()},
        }},
    }
    inputs = load([*fixture("h100"), docs(GPU_TEMPLATE, statefulset, job, mpijob)])
    names = [p["metadata"]["name"] for p in inputs.pods]
    assert names[:2] == ["db-3", "db-4"]
    assert names[2].startswith("bench-0-") and names[3].startswith("bench-1-") and len(names[2]) == len("bench-0-") + 5
    assert names[4:6] == ["allreduce-worker-0", "allreduce-worker-1"]
    assert names[6].startswith("allreduce-launcher-")
    assert len(names) == 7
    outcome = simulate(inputs)
    # Six GPU pods on four GPUs: the last two GPU pods in input order do not fit.
    assert len(outcome.failures) == 2
    assert "allreduce-worker-0" in outcome.failures[0] and "allreduce-worker-1" in outcome.failures[1]
    assert "default/allreduce-launcher-" in " ".join(outcome.pod_nodes)


def test_suspended_job_runs_no_pods_and_bad_replicas_are_named() -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "later"},
           "spec": {"suspend": True, "template": pod_template()}}
    inputs = load([*fixture("h100"), docs(GPU_TEMPLATE, job)])
    assert inputs.pods == [] and inputs.notes == ["Job default/later: suspended (spec.suspend), no Pods run"]
    bad = deployment(4)
    bad["spec"]["replicas"] = "four"
    with pytest.raises(InputError, match=r"Deployment default/train: spec\.replicas: must be a non-negative integer"):
        load([docs(GPU_TEMPLATE, bad)])


def test_claim_names_follow_the_resourceclaim_controller() -> None:
    assert claim_generate_name("pod1", "gpu") == "pod1-gpu-"
    pod, entry = "p" * 50, "c" * 20  # 72 characters with hyphens: both parts are cut in proportion
    assert claim_generate_name(pod, entry) == "p" * (50 * 57 // 72) + "-" + "c" * (20 * 57 // 72)
    assert len(generated_name("x" * 70, "seed")) == 63


def test_every_object_is_used_or_named_and_empty_input_is_an_error(tmp_path: Path, capsys: Any) -> None:
    extra = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings", "namespace": "default"}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent"}, "spec": {}},
    ]
    gpu = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "gpu", "namespace": "default"},
           "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}}
    inputs = load([*fixture("h100"), docs(*extra, gpu)], ["classes.yaml", "h100.yaml", "extra.yaml"])
    assert inputs.warnings == [
        "extra.yaml: ignored v1 ConfigMap default/settings: a kind the simulator does not read",
        "extra.yaml: ignored apps/v1 DaemonSet agent: one Pod per node: write a Pod with spec.nodeName for the node "
        "you ask about",
    ]
    path = tmp_path / "extra.yaml"
    path.write_text(docs(*extra, gpu))
    assert main(["allocate", str(FIXTURES / "deviceclasses.yaml"), str(FIXTURES / "h100.yaml"), str(path)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {path}: ignored v1 ConfigMap default/settings" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("\n---\n# nothing\n")
    for command in ("allocate", "explain"):
        assert main([command, str(empty)]) == 2
        assert capsys.readouterr().err == f"dradriver {command}: no Kubernetes objects in {empty} (empty input)\n"


def test_nothing_to_allocate_is_an_error_naming_the_files_and_what_was_read(tmp_path: Path, capsys: Any) -> None:
    """Slices and classes alone (or objects the simulator does not use) leave nothing to explain or allocate:
    one line and status 2, never a blank answer with status 0."""
    unused = tmp_path / "unused.yaml"
    unused.write_text(docs({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}}))
    files = [str(FIXTURES / "deviceclasses.yaml"), str(FIXTURES / "h100.yaml"), str(unused)]
    for command in ("allocate", "explain"):
        for output in ([], ["-o", "json"]):
            assert main([command, *output, *files]) == 2
            out, err = capsys.readouterr()
            assert out == ""
            assert err.splitlines()[-1] == (
                f"dradriver {command}: nothing to allocate in {', '.join(files)}: no ResourceClaim, "
                "ResourceClaimTemplate, Pod or workload (read: 3 DeviceClass, 1 ResourceSlice, 1 ConfigMap)")
    with pytest.raises(InputError, match=r"no ResourceClaim.*\(read: 1 Deployment\); Deployment default/idle: 0 "):
        load([docs({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "idle"},
                    "spec": {"replicas": 0, "template": {"spec": {"containers": [{"name": "c", "image": "x"}]}}}})])


def test_yaml_error_names_the_file_and_line(tmp_path: Path, capsys: Any) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: v1\nkind: Pod\nmetadata:\n  name: [x\n")
    assert main(["explain", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dradriver explain: {broken}:5:1: invalid YAML: ")


# ------------------------------------------------------------------------------------------ extended resources

def gpu_class(name: str = "gpu.nvidia.com", *, extended: str | None = "nvidia.com/gpu",
              created: str | None = None) -> dict[str, Any]:
    obj = yaml.safe_load(fixture()[0].split("\n---\n")[0])
    obj["metadata"]["name"] = name
    if extended:
        obj["spec"]["extendedResourceName"] = extended
    if created:
        obj["metadata"]["creationTimestamp"] = created
    return obj


def device_plugin_pod(resource: str = "nvidia.com/gpu", count: int = 2, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "cuda-vectoradd", "namespace": "default", "uid": "0b1c0d2e-1111-2222-3333-444455556666"},
        "spec": {
            "initContainers": [{"name": "fetch", "image": "busybox"}],
            "containers": [
                {"name": "sidecar", "image": "busybox"},
                {"name": "cuda", "image": "cuda", "resources": {"limits": {resource: count, "cpu": "1",
                                                                            "memory": "1Gi"}}},
            ],
            **spec,
        },
    }


def test_device_plugin_style_pod_gets_the_claim_the_scheduler_generates() -> None:
    mig = yaml.safe_load(fixture()[0].split("\n---\n")[1])
    text = docs(gpu_class(), mig, device_plugin_pod())
    outcome = simulate(load([(FIXTURES / "h100.yaml").read_text(), text]))
    assert not outcome.failures
    (claim,) = outcome.claims
    meta = claim["metadata"]
    assert meta["name"].startswith("cuda-vectoradd-extended-resources-") and len(meta["name"]) == 39
    assert meta["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "cuda-vectoradd",
                                        "uid": "0b1c0d2e-1111-2222-3333-444455556666", "controller": True,
                                        "blockOwnerDeletion": True}]
    # Container index 2 (init container first); nvidia.com/gpu is third of cpu, memory, nvidia.com/gpu.
    assert claim["spec"]["devices"]["requests"] == [
        {"name": "container-2-request-2",
         "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 2}}
    ]
    assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["gpu-0", "gpu-1"]
    (pod,) = outcome.pods
    assert pod["spec"]["nodeName"] == "h100-node"
    assert pod["status"]["extendedResourceClaimStatus"] == {
        "requestMappings": [
            {"containerName": "cuda", "resourceName": "nvidia.com/gpu", "requestName": "container-2-request-2"}
        ],
        "resourceClaimName": meta["name"],
    }
    report, code = explain(load([(FIXTURES / "h100.yaml").read_text(), text]))
    assert code == 0
    assert (f"claim default/{meta['name']} (generated by the scheduler for the extended resources of pod "
            "cuda-vectoradd): allocated on node h100-node") in report
    assert ("  request 'container-2-request-2' is container 'cuda' asking for nvidia.com/gpu: 2 "
            "(DeviceClass gpu.nvidia.com maps nvidia.com/gpu)") in report
    assert (f"  status.extendedResourceClaimStatus: claim {meta['name']}; container 'cuda' nvidia.com/gpu -> "
            "request container-2-request-2") in report


def test_implicit_device_class_name_and_the_newest_class_wins() -> None:
    pod = device_plugin_pod("deviceclass.resource.kubernetes.io/gpu.nvidia.com", 1)
    outcome = simulate(load([*fixture("h100"), docs(pod)]))
    assert not outcome.failures
    assert outcome.claims[0]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    older = gpu_class("a-old.nvidia.com", created="2026-01-01T00:00:00Z")
    newer = gpu_class("z-new.nvidia.com", created="2026-06-01T00:00:00Z")
    outcome = simulate(load([(FIXTURES / "h100.yaml").read_text(), docs(older, newer, device_plugin_pod())]))
    assert outcome.claims[0]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "z-new.nvidia.com"


def test_explain_says_why_a_device_plugin_style_pod_is_pending(capsys: Any) -> None:
    text = docs(device_plugin_pod())
    report, code = explain(load([*fixture("h100"), text]))
    assert code == 1
    assert report.splitlines()[-2:] == [
        "pod default/cuda-vectoradd: PENDING",
        "  container 'cuda' asks for nvidia.com/gpu: 2, and nothing serves it: no DeviceClass has "
        "spec.extendedResourceName nvidia.com/gpu (nor is it an implicit deviceclass.resource.kubernetes.io/<class> "
        "name of one) and no Node offers it in status.allocatable (a device plugin); dradriver's gpu.nvidia.com "
        "DeviceClass in deploy/ maps nvidia.com/gpu (spec.extendedResourceName: nvidia.com/gpu)",
    ]
    sys.stdin = io.StringIO("\n---\n".join([*fixture("h100"), text]))
    try:
        assert main(["allocate"]) == 1
    finally:
        sys.stdin = sys.__stdin__
    assert capsys.readouterr().err.startswith("cannot schedule pod default/cuda-vectoradd: container 'cuda' asks")


def test_a_node_with_the_device_plugin_serves_the_resource_itself() -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "old-node"},
            "status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "64"}}}
    pinned = device_plugin_pod(nodeName="old-node")
    inputs = load([*fixture("h100"), docs(gpu_class(), node, pinned)])
    assert inputs.claims == []
    report, code = explain(inputs)
    assert code == 0
    assert "pod default/cuda-vectoradd: asks for no devices through DRA" in report
    assert "  nvidia.com/gpu is served by a device plugin on node(s) old-node (Node status.allocatable)" in report


def test_fractional_extended_resource_is_refused_with_the_field() -> None:
    with pytest.raises(InputError, match=r"Pod default/cuda-vectoradd: spec\.containers\[1\]\.resources\."
                                         r"limits\[nvidia\.com/gpu\]: an extended resource must be a whole number"):
        load([*fixture("h100"), docs(gpu_class(), device_plugin_pod(count="500m"))])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ CEL in the user's terms

def selector_claim(expression: str) -> str:
    return docs({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": expression}}]}}]}},
    })


def test_old_index_attribute_names_the_attribute_and_the_devices() -> None:
    expression = "device.attributes['gpu.nvidia.com'].index == 0 || device.attributes['gpu.nvidia.com'].index == 1"
    report, code = explain(load([*fixture("h100"), selector_claim(expression)]))
    assert code == 1
    assert "no matching overload" not in report and "CELEvalError" not in report
    assert ("gpu-0  rejected by request selector #1: error: the selector reads attribute gpu.nvidia.com/index, "
            "which this device does not publish (older NVIDIA driver releases published index; select a GPU by "
            "uuid, resource.kubernetes.io/pciBusID or the device name instead)") in report
    assert ("  request selector #1 reads attribute gpu.nvidia.com/index, which 4 device(s) do not publish: "
            "h100-node/gpu-0, h100-node/gpu-1, h100-node/gpu-2, h100-node/gpu-3") in report


def test_a_typo_suggests_the_published_name() -> None:
    expression = "device.attributes['gpu.nvidia.com'].productname.startsWith('NVIDIA H100')"
    report, _ = explain(load([*fixture("h100"), selector_claim(expression)]))
    assert ("the selector reads attribute gpu.nvidia.com/productname, which this device does not publish "
            "(did you mean gpu.nvidia.com/productName?)") in report


def test_explain_a_device_plugin_style_pod_that_asks_for_more_gpus_than_a_node_has() -> None:
    report, code = explain(load([(FIXTURES / "h100.yaml").read_text(), docs(gpu_class(), device_plugin_pod(count=8))]))
    assert code == 1
    lines = report.splitlines()
    head = next(line for line in lines if line.startswith("claim default/cuda-vectoradd-extended-resources-"))
    assert head.endswith(
        "(generated by the scheduler for the extended resources of pod cuda-vectoradd): CANNOT ALLOCATE"
    )
    assert ("  request 'container-2-request-2' is container 'cuda' asking for nvidia.com/gpu: 8 "
            "(DeviceClass gpu.nvidia.com maps nvidia.com/gpu)") in lines
    assert any("request 'container-2-request-2' needs 8 devices, 4 of 4 devices on node h100-node qualify" in line
               for line in lines)
    assert lines[-1].startswith("pod default/cuda-vectoradd: PENDING: claim(s) default/cuda-vectoradd-extended-")


def test_a_workload_whose_pods_are_in_the_input_is_not_expanded_again() -> None:
    """``kubectl get deploy,rs,pods -o yaml``: the Deployment, its ReplicaSet and its Pods, each counted once."""
    first = load([*fixture("h100"), docs(GPU_TEMPLATE, deployment(2))])
    replica_set_name = first.pods[0]["metadata"]["ownerReferences"][0]["name"]
    replica_set = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                   "metadata": {"name": replica_set_name, "namespace": "default",
                                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "train",
                                                     "uid": "d", "controller": True}]},
                   "spec": {"replicas": 2, "template": pod_template()}}
    inputs = load([*fixture("h100"), docs(GPU_TEMPLATE, deployment(2), replica_set, *first.pods)])
    assert [p["metadata"]["name"] for p in inputs.pods] == [p["metadata"]["name"] for p in first.pods]
    assert inputs.notes == [
        "Deployment default/train: not expanded, the objects it controls are in the input (ownerReferences)",
        f"ReplicaSet default/{replica_set_name}: not expanded, the objects it controls are in the input "
        "(ownerReferences)",
    ]


def test_cli_allocate_prints_the_generated_claim_and_the_pod_with_its_status(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text(docs(gpu_class(), device_plugin_pod(count=1)))
    assert main(["allocate", str(FIXTURES / "h100.yaml"), str(path)]) == 0
    claim, pod = yaml.safe_load_all(capsys.readouterr().out)
    assert claim["kind"] == "ResourceClaim" and pod["kind"] == "Pod"
    assert pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"] == claim["metadata"]["name"]
    assert pod["spec"]["nodeName"] == "h100-node"


MIG_PARTED_CONFIG = """\
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
"""


def test_a_mig_parted_config_is_refused_as_not_a_kubernetes_object(tmp_path: Path, capsys: Any) -> None:
    """NVIDIA/mig-parted's config is no Kubernetes object: refused naming the file and what to write instead,
    never passed over as a kind the simulator does not read."""
    config = tmp_path / "config.yaml"
    config.write_text(MIG_PARTED_CONFIG)
    with pytest.raises(InputError) as info:
        load([*fixture("a100-mig"), MIG_PARTED_CONFIG], ["classes.yaml", "a100-mig.yaml", str(config)])
    message = str(info.value)
    assert message.startswith(f"{config}: version v1: a mig-parted config (NVIDIA/mig-parted), not a Kubernetes "
                              "object")
    assert "DynamicMIG" in message and "docs/user-guide/mig.md" in message
    assert main(["explain", str(FIXTURES / "deviceclasses.yaml"), str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a mig-parted config" in err and "does not read" not in err


@pytest.mark.parametrize(
    ("kind", "instead"),
    [
        ("GpuClaimParameters", "opaque GpuConfig"),
        ("MigDeviceClaimParameters", "DeviceClass mig.nvidia.com"),
        ("ComputeInstanceClaimParameters", "DeviceClass mig.nvidia.com"),
        ("DeviceClassParameters", "a DeviceClass (resource.k8s.io/v1)"),
    ],
)
def test_nvidia_classic_dra_parameters_are_refused_with_the_replacement(kind: str, instead: str) -> None:
    obj = {"apiVersion": "gpu.resource.nvidia.com/v1alpha1", "kind": kind,
           "metadata": {"name": "params", "namespace": "default"}, "spec": {"count": 1}}
    gpu = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "gpu", "namespace": "default"},
           "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}}
    with pytest.raises(InputError) as info:
        load([*fixture("h100"), docs(obj, gpu)], ["classes.yaml", "h100.yaml", "old.yaml"])
    assert str(info.value).startswith(
        f"old.yaml: gpu.resource.nvidia.com/v1alpha1 {kind} default/params: NVIDIA's classic-DRA parameters "
        "(classic DRA was removed in Kubernetes 1.31): use ")
    assert instead in str(info.value)
    state = {"apiVersion": "nas.gpu.resource.nvidia.com/v1alpha1", "kind": "NodeAllocationState",
             "metadata": {"name": "node-a", "namespace": "nvidia"}}
    with pytest.raises(InputError, match=r"NodeAllocationState nvidia/node-a: NVIDIA's classic-DRA .*ResourceSlices"):
        load([*fixture("h100"), docs(state, gpu)])
