"""The API emulator serves CustomResourceDefinitions: the bundled ComputeDomain CRDs register their types at
runtime; objects are pruned, defaulted and validated against the structural schema, ``spec`` is immutable
(``self == oldSelf``), the status subresource is honoured, and NVIDIA's own ComputeDomain manifests apply
unchanged -- through the official client over HTTP and through kubectl."""

from __future__ import annotations

import copy
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.apiserver.crds import bundled_crds
from tests.sandbox.helpers import kubectl

GROUP, VERSION = "resource.nvidia.com", "v1beta1"
REPO = Path(__file__).resolve().parents[2]
IMEX = REPO / "tests" / "sandbox" / "fixtures" / "imex"


def _peer_manifest(name: str) -> list[dict[str, Any]]:
    """NVIDIA's example manifest, kept unchanged next to these tests (fixtures/imex/README.md)."""
    return [d for d in yaml.safe_load_all((IMEX / name).read_text()) if d]


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator() as emulator:
        emulator.install_crds()
        yield emulator


@pytest.fixture
def custom(api: ApiServerEmulator) -> Iterator[kubernetes.client.CustomObjectsApi]:
    client = kubernetes.config.new_client_from_config_dict(api.kubeconfig())
    try:
        yield kubernetes.client.CustomObjectsApi(client)
    finally:
        client.close()


def _cd(name: str = "cd1", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ComputeDomain", "metadata": {"name": name},
            "spec": {"channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}, **spec}}


def _create(custom: kubernetes.client.CustomObjectsApi, obj: dict[str, Any], plural: str = "computedomains",
            namespace: str = "default") -> dict[str, Any]:
    out: dict[str, Any] = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, obj)
    return out


def _error(exc: pytest.ExceptionInfo[kubernetes.client.ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.value.body)
    return body


def test_the_crds_register_their_types_and_are_established(api: ApiServerEmulator) -> None:
    crd = api.get("CustomResourceDefinition", "computedomains.resource.nvidia.com")
    assert crd is not None
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert crd["status"]["acceptedNames"]["listKind"] == "ComputeDomainList"
    cd_type = api.resource_type("computedomains")
    clique_type = api.resource_type("computedomaincliques")
    assert cd_type.schema is not None and cd_type.status
    assert clique_type.schema is not None and not clique_type.status
    assert [c["metadata"]["name"] for c in bundled_crds()] == [
        "computedomains.resource.nvidia.com", "computedomaincliques.resource.nvidia.com"]


def test_discovery_lists_the_custom_resources(api: ApiServerEmulator) -> None:
    with urllib.request.urlopen(f"{api.url}/apis/{GROUP}/{VERSION}", timeout=30) as response:
        doc = json.load(response)
    names = {r["name"] for r in doc["resources"]}
    assert names == {"computedomains", "computedomains/status", "computedomaincliques"}


def test_a_compute_domain_gets_the_schema_defaults(custom: kubernetes.client.CustomObjectsApi) -> None:
    cd = _create(custom, _cd())
    assert cd["spec"] == {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": "cd1-channel"},
                                                     "allocationMode": "Single"}}
    assert "status" not in cd  # the status subresource: a create never writes status
    cd["status"] = {"nodes": [{"name": "n1", "ipAddress": "10.0.0.1", "cliqueID": "c.1", "index": 0}]}
    written = custom.replace_namespaced_custom_object_status(GROUP, VERSION, "default", "computedomains", "cd1", cd)
    assert written["status"] == {"status": "NotReady", "nodes": [
        {"name": "n1", "ipAddress": "10.0.0.1", "cliqueID": "c.1", "index": 0, "status": "NotReady"}]}


def test_spec_is_immutable(custom: kubernetes.client.CustomObjectsApi) -> None:
    cd = _create(custom, _cd(numNodes=2))
    cd["spec"]["numNodes"] = 3
    with pytest.raises(kubernetes.client.ApiException) as exc:
        custom.replace_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd1", cd)
    assert exc.value.status == 422
    body = _error(exc)
    assert body["message"] == ('ComputeDomain.resource.nvidia.com "cd1" is invalid: spec: Invalid value: "object": '
                               "A computeDomain.spec is immutable")
    assert body["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "spec",
                                          "message": 'Invalid value: "object": A computeDomain.spec is immutable'}]
    # metadata (a finalizer) still changes; the spec as stored is unchanged
    cd["spec"]["numNodes"] = 2
    cd["metadata"]["finalizers"] = ["resource.nvidia.com/computeDomain"]
    out = custom.replace_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd1", cd)
    assert out["metadata"]["finalizers"] == ["resource.nvidia.com/computeDomain"]
    assert out["spec"]["numNodes"] == 2


def test_a_merge_patch_of_the_spec_is_refused_too(custom: kubernetes.client.CustomObjectsApi) -> None:
    _create(custom, _cd())
    with pytest.raises(kubernetes.client.ApiException) as exc:
        custom.patch_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd1",
                                              {"spec": {"channel": {"allocationMode": "All"}}})
    assert exc.value.status == 422
    assert "A computeDomain.spec is immutable" in _error(exc)["message"]


def test_unknown_fields_are_pruned_with_a_warning(api: ApiServerEmulator,
                                                  custom: kubernetes.client.CustomObjectsApi) -> None:
    obj = _cd()
    obj["spec"]["colour"] = "blue"
    obj["spec"]["channel"]["resourceClaimTemplate"]["namespace"] = "elsewhere"
    obj["extra"] = {"a": 1}
    cd = _create(custom, obj)
    assert "colour" not in cd["spec"] and "extra" not in cd
    assert cd["spec"]["channel"]["resourceClaimTemplate"] == {"name": "cd1-channel"}
    stored = api.get("ComputeDomain", "cd1", "default")
    assert stored is not None and "colour" not in stored["spec"]


def test_strict_field_validation_refuses_unknown_fields(api: ApiServerEmulator) -> None:
    client = kubernetes.config.new_client_from_config_dict(api.kubeconfig())
    try:
        obj = _cd()
        obj["spec"]["colour"] = "blue"
        with pytest.raises(kubernetes.client.ApiException) as exc:
            kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
                GROUP, VERSION, "default", "computedomains", obj, field_validation="Strict")
    finally:
        client.close()
    assert exc.value.status == 400
    assert 'strict decoding error: unknown field "spec.colour"' in _error(exc)["message"]


def test_schema_violations_are_422_naming_each_field(custom: kubernetes.client.CustomObjectsApi) -> None:
    bad = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ComputeDomain", "metadata": {"name": "bad"},
           "spec": {"numNodes": -1, "channel": {"allocationMode": "Some"}}}
    with pytest.raises(kubernetes.client.ApiException) as exc:
        _create(custom, bad)
    assert exc.value.status == 422
    causes = {(c["field"], c["message"]) for c in _error(exc)["details"]["causes"]}
    assert causes == {
        ("spec.channel.resourceClaimTemplate", "Required value"),
        ("spec.channel.allocationMode", 'Unsupported value: "Some": supported values: "All", "Single"'),
        ("spec.numNodes", "Invalid value: -1: spec.numNodes in body should be greater than or equal to 0"),
    }
    wrong_type = _cd("typed", numNodes="two")
    with pytest.raises(kubernetes.client.ApiException) as exc:
        _create(custom, wrong_type)
    assert _error(exc)["details"]["causes"] == [{
        "reason": "FieldValueTypeInvalid", "field": "spec.numNodes",
        "message": 'Invalid value: "string": spec.numNodes in body must be of type integer: "string"'}]


def test_status_is_a_subresource(custom: kubernetes.client.CustomObjectsApi) -> None:
    cd = _create(custom, _cd())
    cd["status"] = {"status": "Ready"}
    out = custom.replace_namespaced_custom_object(GROUP, VERSION, "default", "computedomains", "cd1", cd)
    assert "status" not in out  # the main resource ignores status
    out["status"] = {"status": "Ready", "nodes": []}
    out["spec"]["numNodes"] = 7  # the status subresource ignores spec (no immutability error either)
    out["metadata"]["resourceVersion"] = cd["metadata"]["resourceVersion"]
    written = custom.replace_namespaced_custom_object_status(GROUP, VERSION, "default", "computedomains", "cd1", out)
    assert written["status"] == {"status": "Ready", "nodes": []} and written["spec"]["numNodes"] == 0
    written["status"] = {"status": "Maybe"}
    with pytest.raises(kubernetes.client.ApiException) as exc:
        custom.replace_namespaced_custom_object_status(GROUP, VERSION, "default", "computedomains", "cd1", written)
    assert exc.value.status == 422
    assert _error(exc)["details"]["causes"][0]["field"] == "status.status"


def test_list_map_keys_are_unique(custom: kubernetes.client.CustomObjectsApi) -> None:
    entry = {"nodeName": "n1", "ipAddress": "10.0.0.1", "cliqueID": "c.1", "index": 0}
    clique = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ComputeDomainClique", "metadata": {"name": "uid.c.1"},
              "daemons": [entry, {**entry, "ipAddress": "10.0.0.2", "index": 1}]}
    with pytest.raises(kubernetes.client.ApiException) as exc:
        _create(custom, clique, "computedomaincliques")
    assert _error(exc)["details"]["causes"] == [{"reason": "FieldValueDuplicate", "field": "daemons[1]",
                                                 "message": 'Duplicate value: {"nodeName": "n1"}'}]
    clique["daemons"] = [entry]
    out = _create(custom, clique, "computedomaincliques")
    assert out["daemons"] == [{**entry, "status": "NotReady"}]
    out["daemons"][0]["status"] = "Ready"  # no status subresource: daemons are written on the object
    written = custom.replace_namespaced_custom_object(GROUP, VERSION, "default", "computedomaincliques", "uid.c.1",
                                                      out)
    assert written["daemons"][0]["status"] == "Ready"


def test_nvidias_example_compute_domains_are_accepted_unchanged(custom: kubernetes.client.CustomObjectsApi) -> None:
    for manifest in ("channel-injection.yaml", "channel-injection-all.yaml"):
        for doc in _peer_manifest(manifest):
            if doc["kind"] != "ComputeDomain":
                continue
            sent = copy.deepcopy(doc)
            out = _create(custom, doc)
            assert out["spec"]["numNodes"] == sent["spec"]["numNodes"]
            assert out["spec"]["channel"]["resourceClaimTemplate"] == sent["spec"]["channel"]["resourceClaimTemplate"]
            assert out["spec"]["channel"]["allocationMode"] == sent["spec"]["channel"].get("allocationMode", "Single")


def test_kubectl_applies_the_crds_and_nvidias_manifest(tmp_path: Path) -> None:
    with ApiServerEmulator() as api:
        config = api.kubeconfig_path(tmp_path)
        for name in ("resource.nvidia.com_computedomains.yaml", "resource.nvidia.com_computedomaincliques.yaml"):
            kubectl(config, "apply", "-f", str(REPO / "deploy" / "kustomize" / "base" / "crds" / name))
        cds = [d for d in _peer_manifest("channel-injection.yaml") if d["kind"] == "ComputeDomain"]
        kubectl(config, "apply", "-f", "-", stdin=yaml.safe_dump_all(cds))
        out = json.loads(kubectl(config, "get", "computedomains", "-o", "json").stdout)
        assert [i["spec"]["channel"]["allocationMode"] for i in out["items"]] == ["Single"]
        bad = copy.deepcopy(cds[0])
        bad["spec"]["numNodes"] = 5
        proc = kubectl(config, "apply", "-f", "-", stdin=yaml.safe_dump(bad), ok=False)
        assert proc.returncode != 0 and "A computeDomain.spec is immutable" in proc.stderr


def test_deleting_a_crd_deletes_its_objects_and_falls_back(api: ApiServerEmulator,
                                                           custom: kubernetes.client.CustomObjectsApi) -> None:
    _create(custom, _cd())
    api.delete("CustomResourceDefinition", "computedomains.resource.nvidia.com")
    assert api.objects("ComputeDomain") == []
    rt = api.resource_type("computedomains")
    assert rt.schema is None and rt.custom  # served again without a schema, as before any CRD
    kept = _create(custom, {**_cd("loose"), "spec": {"anything": True}})
    assert kept["spec"] == {"anything": True}


def test_a_new_crd_serves_a_new_type(api: ApiServerEmulator) -> None:
    crd = copy.deepcopy(bundled_crds()[1])
    crd["metadata"]["name"] = "widgets.example.com"
    crd["spec"]["group"] = "example.com"
    crd["spec"]["names"] = {"kind": "Widget", "plural": "widgets", "singular": "widget", "shortNames": ["wd"]}
    crd["spec"]["scope"] = "Cluster"
    api.install_crds([crd])
    rt = api.resource_type("wd")
    assert (rt.group, rt.plural, rt.namespaced) == ("example.com", "widgets", False)
    client = kubernetes.config.new_client_from_config_dict(api.kubeconfig())
    try:
        made = kubernetes.client.CustomObjectsApi(client).create_cluster_custom_object(
            "example.com", "v1beta1", "widgets", {"apiVersion": "example.com/v1beta1", "kind": "Widget",
                                                  "metadata": {"name": "w"}, "daemons": []})
    finally:
        client.close()
    assert made["metadata"]["name"] == "w" and "namespace" not in made["metadata"]
    api.delete("CustomResourceDefinition", "widgets.example.com")
    with pytest.raises(KeyError):
        api.resource_type("widgets")


def test_a_crd_with_a_rule_the_emulator_cannot_evaluate_is_refused(api: ApiServerEmulator) -> None:
    crd = copy.deepcopy(bundled_crds()[0])
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["x-kubernetes-validations"] = [{"rule": "self.numNodes < 100"}]
    client = kubernetes.config.new_client_from_config_dict(api.kubeconfig())
    try:
        crd["metadata"]["resourceVersion"] = api.get("CustomResourceDefinition", crd["metadata"]["name"])[
            "metadata"]["resourceVersion"]
        with pytest.raises(kubernetes.client.ApiException) as exc:
            kubernetes.client.ApiextensionsV1Api(client).replace_custom_resource_definition(crd["metadata"]["name"],
                                                                                            crd)
    finally:
        client.close()
    assert exc.value.status == 422
    assert "only the CEL rule 'self == oldSelf'" in _error(exc)["message"]
