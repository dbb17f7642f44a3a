"""The API emulator through kubectl as an operator uses it: ``kubectl apply`` validates against the served
OpenAPI (no ``--validate=false``), unknown fields are refused with kube-apiserver's strict decoding error, and
``kubectl get`` prints the server's columns for ResourceSlices, ResourceClaims, Pods and Events."""

from __future__ import annotations

import copy
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.apiserver.openapi import unknown_fields

from .helpers import REPO, kubectl, published_slices

EXAMPLE = REPO / "deploy" / "examples" / "gpu-40gi.yaml"
TABLE_ACCEPT = ("application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,"
                "application/json")
CLAIM_SPEC = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[ApiServerEmulator, str]]:
    with ApiServerEmulator() as emulator:
        emulator.start()
        yield emulator, emulator.kubeconfig_path(tmp_path)


def _get(api: ApiServerEmulator, path: str, accept: str = "application/json") -> Any:
    request = urllib.request.Request(api.url + path, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def test_openapi_v3_names_every_group_version_and_its_write_parameters(api: tuple[ApiServerEmulator, str]) -> None:
    emulator, _ = api
    root = _get(emulator, "/openapi/v3")
    assert {"api/v1", "apis/resource.k8s.io/v1", "apis/events.k8s.io/v1"} <= set(root["paths"])
    doc = _get(emulator, root["paths"]["apis/resource.k8s.io/v1"]["serverRelativeURL"])
    assert doc["openapi"].startswith("3.")
    patch = doc["paths"]["/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "resource.k8s.io", "version": "v1",
                                                        "kind": "ResourceClaim"}
    assert {"name": "fieldValidation", "in": "query"}.items() <= next(
        p for p in patch["parameters"] if p["name"] == "fieldValidation").items()
    claim = doc["components"]["schemas"]["io.k8s.api.resource.v1.ResourceClaim"]
    assert claim["x-kubernetes-group-version-kind"][0]["kind"] == "ResourceClaim"
    v2 = _get(emulator, "/openapi/v2")
    assert v2["swagger"] == "2.0" and "io.k8s.api.resource.v1.ResourceSlice" in v2["definitions"]
    assert all("#/components/" not in json.dumps(d) for d in v2["definitions"].values())


def test_kubectl_apply_validates_without_validate_false(api: tuple[ApiServerEmulator, str]) -> None:
    emulator, kubeconfig = api
    out = kubectl(kubeconfig, "apply", "-f", str(EXAMPLE)).stdout
    assert "resourceclaimtemplate.resource.k8s.io/big-gpu created" in out and "pod/dra-gpu-pod created" in out
    assert any("fieldValidation=Strict" in r.query for r in emulator.requests if r.verb == "create")
    again = kubectl(kubeconfig, "apply", "-f", str(EXAMPLE)).stdout
    assert "unchanged" in again
    explained = kubectl(kubeconfig, "explain", "resourceclaim.spec.devices.requests.exactly").stdout
    assert "FIELD: exactly <ExactDeviceRequest>" in explained and "deviceClassName" in explained


def test_unknown_field_is_refused_in_kube_apiservers_words(api: tuple[ApiServerEmulator, str]) -> None:
    _, kubeconfig = api
    template = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["kind"] == "ResourceClaimTemplate")
    bad = copy.deepcopy(template)
    bad["spec"]["spec"]["devices"]["requests"][0]["exactly"]["countt"] = 2
    proc = kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(bad), ok=False)
    assert proc.returncode != 0
    assert ('ResourceClaimTemplate in version "v1" cannot be handled as a ResourceClaimTemplate: strict decoding '
            'error: unknown field "spec.spec.devices.requests[0].exactly.countt"') in proc.stderr
    warned = kubectl(kubeconfig, "apply", "--validate=warn", "-f", "-", stdin=yaml.safe_dump(bad))
    assert 'unknown field "spec.spec.devices.requests[0].exactly.countt"' in warned.stderr


def test_unknown_fields_walks_lists_maps_and_patch_directives() -> None:
    ref = {"$ref": "#/components/schemas/io.k8s.api.core.v1.Pod"}
    pod = {"metadata": {"labels": {"any": "thing"}, "nmae": "x"},
           "spec": {"containers": [{"name": "a", "image": "i"}, {"name": "b", "imgae": "i"}]}}
    assert unknown_fields(pod, ref) == ["metadata.nmae", "spec.containers[1].imgae"]
    assert unknown_fields({"spec": {"$setElementOrder/containers": [{"name": "a"}]}}, ref, patch=True) == []


def _table(out: str) -> list[dict[str, str]]:
    header, *lines = out.splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return [dict(zip(names, (line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)),
                     strict=True)) for line in lines]


def test_kubectl_get_prints_slice_and_claim_columns(api: tuple[ApiServerEmulator, str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    emulator, kubeconfig = api
    for s in published_slices(capsys, "dgx-a100", "gpu-node-1"):
        emulator.create(s)
    rows = _table(kubectl(kubeconfig, "get", "resourceslices").stdout)
    assert list(rows[0]) == ["NAME", "NODE", "DRIVER", "POOL", "DEVICES", "AGE"]
    [row] = rows
    assert row["NAME"].startswith("00000-gpu.nvidia.com-gpu-node-1-")
    assert (row["NODE"], row["DRIVER"], row["POOL"], row["DEVICES"]) == ("gpu-node-1", "gpu.nvidia.com",
                                                                        "gpu-node-1", "14")
    results = [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "gpu-node-1", "device": "gpu-3"}]
    emulator.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": "held", "namespace": "default"},
                     "spec": CLAIM_SPEC,
                     "status": {"allocation": {"devices": {"results": results}},
                                "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "u-1"}]}})
    emulator.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": "waiting", "namespace": "default"},
                     "spec": CLAIM_SPEC})
    claims = {r["NAME"]: r for r in _table(kubectl(kubeconfig, "get", "resourceclaims").stdout)}
    assert list(claims["held"]) == ["NAME", "STATE", "DEVICES", "RESERVED-FOR", "AGE"]
    assert (claims["held"]["STATE"], claims["held"]["DEVICES"], claims["held"]["RESERVED-FOR"]) == (
        "allocated,reserved", "gpu-3", "pods/trainer")
    assert (claims["waiting"]["STATE"], claims["waiting"]["DEVICES"]) == ("pending", "<none>")
    table = _get(emulator, "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/held", TABLE_ACCEPT)
    assert table["kind"] == "Table" and table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert kubectl(kubeconfig, "get", "resourceclaim", "held", "-o", "jsonpath={.status.reservedFor[0].name}"
                   ).stdout == "trainer"


def test_kubectl_get_pods_and_events_show_why_a_pod_waits(api: tuple[ApiServerEmulator, str]) -> None:
    emulator, kubeconfig = api
    pod = emulator.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "waits", "namespace": "default"},
                           "spec": {"containers": [{"name": "c", "image": "i"}]},
                           "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                                          "reason": "Unschedulable"}]}})
    emulator.create({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "waits.1", "namespace": "default"},
                     "involvedObject": {"kind": "Pod", "name": "waits", "namespace": "default",
                                        "uid": pod["metadata"]["uid"]},
                     "type": "Warning", "reason": "FailedScheduling", "message": "0/1 nodes are available",
                     "lastTimestamp": pod["metadata"]["creationTimestamp"]})
    [row] = _table(kubectl(kubeconfig, "get", "pods").stdout)
    assert (row["NAME"], row["READY"], row["STATUS"], row["RESTARTS"]) == ("waits", "0/1", "Unschedulable", "0")
    [event] = _table(kubectl(kubeconfig, "get", "events").stdout)
    assert (event["TYPE"], event["REASON"], event["OBJECT"], event["MESSAGE"]) == (
        "Warning", "FailedScheduling", "pod/waits", "0/1 nodes are available")
    described = kubectl(kubeconfig, "describe", "pod", "waits").stdout
    assert "FailedScheduling" in described and "0/1 nodes are available" in described


def test_bundled_schemas_are_what_the_generator_makes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_openapi", REPO / "tools" / "gen_openapi.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.generate() == module.OUTPUT.read_text(), "run python tools/gen_openapi.py"


def test_kubectl_apply_kustomize_base_validates_every_kind(api: tuple[ApiServerEmulator, str]) -> None:
    """``kubectl apply -k deploy/kustomize/base`` as on a cluster: every kind of the base (ServiceAccount, RBAC,
    ValidatingAdmissionPolicy, DaemonSet, CRDs, DeviceClasses) has its OpenAPI schema, so strict validation passes."""
    emulator, kubeconfig = api
    out = kubectl(kubeconfig, "apply", "-k", str(REPO / "deploy" / "kustomize" / "base")).stdout
    for created in ("serviceaccount/dradriver-kubelet-plugin", "clusterrole.rbac.authorization.k8s.io/",
                    "clusterrolebinding.rbac.authorization.k8s.io/", "validatingadmissionpolicy.admissionregistration",
                    "validatingadmissionpolicybinding.admissionregistration", "daemonset.apps/dradriver-kubelet-plugin",
                    "deviceclass.resource.k8s.io/gpu.nvidia.com"):
        assert created in out
    assert emulator.get("ClusterRole", "dradriver-kubelet-plugin") is not None


def test_version_is_the_release_of_the_served_schemas(api: tuple[ApiServerEmulator, str]) -> None:
    _, kubeconfig = api
    served = json.loads((REPO / "dradriver" / "sandbox" / "apiserver" / "openapi-schemas.json").read_text())
    major, minor, _ = served["kubernetesVersion"].split(".")
    server = json.loads(kubectl(kubeconfig, "version", "-o", "json").stdout)["serverVersion"]
    assert (server["major"], server["minor"]) == (major, minor)
    assert server["gitVersion"].startswith(f"v{served['kubernetesVersion']}")
