"""Server-side apply in the API emulator, through the official client over HTTP: field managers own the items
of a ComputeDomainClique's ``daemons`` list map without conflicts, re-applies remove what a manager dropped,
co-owned items survive, conflicts answer 409 with ``FieldManagerConflict`` causes, ``force`` takes fields
over, Update writes take ownership, the status subresource and apply-create work, and ``managedFields`` is in
the API server's FieldsV1 encoding."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from dradriver.sandbox.apiserver import ApiServerEmulator

GROUP, VERSION, NS = "resource.nvidia.com", "v1beta1", "nvidia-dra-driver"
APPLY = "application/apply-patch+yaml"
CLIQUE = "uid-1.clique-a"


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator() as emulator:
        emulator.install_crds()
        yield emulator


@pytest.fixture
def client(api: ApiServerEmulator) -> Iterator[kubernetes.client.ApiClient]:
    c = kubernetes.config.new_client_from_config_dict(api.kubeconfig())
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def custom(client: kubernetes.client.ApiClient, api: ApiServerEmulator) -> Iterator[kubernetes.client.CustomObjectsApi]:
    yield kubernetes.client.CustomObjectsApi(client)
    for obj in api.objects("ComputeDomainClique", namespace=NS):
        api.delete("ComputeDomainClique", obj["metadata"]["name"], NS)
    for obj in api.objects("ComputeDomain", namespace=NS):
        api.delete("ComputeDomain", obj["metadata"]["name"], NS)


def _daemon(node: str, **fields: Any) -> dict[str, Any]:
    return {"nodeName": node, "ipAddress": fields.pop("ip", "10.0.0.1"), "cliqueID": "clique-a", **fields}


def _apply(custom: kubernetes.client.CustomObjectsApi, manager: str, body: dict[str, Any], *,
           force: bool = False, plural: str = "computedomaincliques", name: str = CLIQUE,
           status: bool = False) -> dict[str, Any]:
    doc = {"apiVersion": f"{GROUP}/{VERSION}", "metadata": {"name": name, "namespace": NS}, **body}
    doc.setdefault("kind", "ComputeDomainClique" if plural == "computedomaincliques" else "ComputeDomain")
    method = custom.patch_namespaced_custom_object_status if status else custom.patch_namespaced_custom_object
    out: dict[str, Any] = method(GROUP, VERSION, NS, plural, name, doc, field_manager=manager, force=force,
                                 _content_type=APPLY)
    return out


def _get(custom: kubernetes.client.CustomObjectsApi, name: str = CLIQUE,
         plural: str = "computedomaincliques") -> dict[str, Any]:
    out: dict[str, Any] = custom.get_namespaced_custom_object(GROUP, VERSION, NS, plural, name)
    return out


def _entries(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["manager"]: e for e in obj["metadata"].get("managedFields", [])}


def _by_node(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["nodeName"]: d for d in obj.get("daemons", [])}


def _send(client: kubernetes.client.ApiClient, method: str, path: str, body: Any, content_type: str, *,
          manager: str) -> int:
    """One request with a raw body through the official client's ``ApiClient``; returns the HTTP status."""
    request = client.param_serialize(method=method, resource_path=path, query_params=[("fieldManager", manager)],
                                     header_params={"Content-Type": content_type, "Accept": "application/json"},
                                     body=body)
    response = client.call_api(*request)
    response.read()
    return int(response.status)


def _status_of(exc: pytest.ExceptionInfo[kubernetes.client.ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.value.body)
    return body


def test_apply_creates_the_object_and_each_daemon_owns_only_its_item(custom: Any) -> None:
    # Apply-create answers 201, which the official client's custom-object patch returns as None.
    assert _apply(custom, "compute-domain-daemon/node-a", {"daemons": [_daemon("node-a", status="NotReady")]}) \
        is None
    assert _get(custom)["metadata"]["uid"]
    _apply(custom, "compute-domain-daemon/node-b", {"daemons": [_daemon("node-b", ip="10.0.0.2")]})
    obj = _get(custom)
    assert sorted(_by_node(obj)) == ["node-a", "node-b"]
    assert _by_node(obj)["node-b"]["status"] == "NotReady"  # the schema's default fills it, nobody owns it
    entries = _entries(obj)
    assert entries["compute-domain-daemon/node-a"]["fieldsV1"] == {"f:daemons": {'k:{"nodeName":"node-a"}': {
        ".": {}, "f:cliqueID": {}, "f:ipAddress": {}, "f:nodeName": {}, "f:status": {}}}}
    assert entries["compute-domain-daemon/node-b"]["fieldsV1"] == {"f:daemons": {'k:{"nodeName":"node-b"}': {
        ".": {}, "f:cliqueID": {}, "f:ipAddress": {}, "f:nodeName": {}}}}
    for entry in entries.values():
        assert entry["operation"] == "Apply" and entry["fieldsType"] == "FieldsV1"
        assert entry["apiVersion"] == f"{GROUP}/{VERSION}" and entry["time"].endswith("Z")
    # A status flip by one daemon touches nothing of the other's.
    _apply(custom, "compute-domain-daemon/node-a", {"daemons": [_daemon("node-a", status="Ready")]})
    obj = _get(custom)
    assert _by_node(obj)["node-a"]["status"] == "Ready" and _by_node(obj)["node-b"]["ipAddress"] == "10.0.0.2"


def test_reapply_removes_what_the_manager_dropped(custom: Any) -> None:
    _apply(custom, "d/a", {"daemons": [_daemon("node-a", status="Ready"), _daemon("node-x")]})
    _apply(custom, "d/a", {"daemons": [_daemon("node-a")]})
    obj = _get(custom)
    assert list(_by_node(obj)) == ["node-a"]
    assert _by_node(obj)["node-a"]["status"] == "NotReady"  # dropped, then defaulted again


def test_a_co_owned_item_stays_when_one_manager_drops_it(custom: Any) -> None:
    _apply(custom, "compute-domain-daemon/node-a", {"daemons": [_daemon("node-a")]})
    _apply(custom, "controller", {"daemons": [{"nodeName": "node-a", "index": 3, "ipAddress": "10.0.0.1",
                                                "cliqueID": "clique-a"}]})
    _apply(custom, "compute-domain-daemon/node-a", {"daemons": []})
    obj = _get(custom)
    item = _by_node(obj)["node-a"]
    assert item["index"] == 3 and item["ipAddress"] == "10.0.0.1"  # the controller still owns these
    assert "compute-domain-daemon/node-a" not in _entries(obj)
    _apply(custom, "controller", {"daemons": []})
    assert _get(custom).get("daemons", []) == []


def test_a_different_value_conflicts_and_force_takes_the_field(custom: Any) -> None:
    _apply(custom, "compute-domain-daemon/node-a", {"daemons": [_daemon("node-a")]})
    with pytest.raises(kubernetes.client.ApiException) as exc:
        _apply(custom, "intruder", {"daemons": [_daemon("node-a", ip="10.9.9.9")]})
    assert exc.value.status == 409
    status = _status_of(exc)
    assert status["reason"] == "Conflict"
    assert status["message"] == ('Apply failed with 1 conflict: conflict with "compute-domain-daemon/node-a" '
                                 f'using {GROUP}/{VERSION}: .daemons[nodeName="node-a"].ipAddress')
    assert status["details"]["causes"] == [{"reason": "FieldManagerConflict", "field":
                                            '.daemons[nodeName="node-a"].ipAddress',
                                            "message": f'conflict with "compute-domain-daemon/node-a" using '
                                                       f'{GROUP}/{VERSION}'}]
    assert _by_node(_get(custom))["node-a"]["ipAddress"] == "10.0.0.1"  # nothing written
    # The same value is shared ownership, no conflict.
    _apply(custom, "observer", {"daemons": [_daemon("node-a")]})
    _apply(custom, "intruder", {"daemons": [_daemon("node-a", ip="10.9.9.9")]}, force=True)
    obj = _get(custom)
    assert _by_node(obj)["node-a"]["ipAddress"] == "10.9.9.9"
    for loser in ("compute-domain-daemon/node-a", "observer"):
        assert "f:ipAddress" not in _entries(obj)[loser]["fieldsV1"]["f:daemons"]['k:{"nodeName":"node-a"}']


def test_two_conflicting_fields_are_listed_per_manager(custom: Any) -> None:
    _apply(custom, "a", {"daemons": [_daemon("node-a", index=1)]})
    with pytest.raises(kubernetes.client.ApiException) as exc:
        _apply(custom, "b", {"daemons": [_daemon("node-a", ip="10.1.1.1", index=2)]})
    status = _status_of(exc)
    assert status["message"] == (f'Apply failed with 2 conflicts: conflicts with "a" using {GROUP}/{VERSION}:\n'
                                 '- .daemons[nodeName="node-a"].index\n- .daemons[nodeName="node-a"].ipAddress')
    assert [c["field"] for c in status["details"]["causes"]] == ['.daemons[nodeName="node-a"].index',
                                                                 '.daemons[nodeName="node-a"].ipAddress']


def test_an_update_takes_ownership_and_a_removal_leaves_every_manager(custom: Any) -> None:
    _apply(custom, "compute-domain-daemon/node-a", {"daemons": [_daemon("node-a"), _daemon("node-c")]})
    # The controller's JSON patch (an Update) replaces node-a's address: it owns it now, with no conflict.
    _send(custom.api_client, "PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/computedomaincliques/{CLIQUE}",
          [{"op": "replace", "path": "/daemons/0/ipAddress", "value": "0.0.0.0"},
           {"op": "remove", "path": "/daemons/1"}], "application/json-patch+json", manager="controller")
    obj = _get(custom)
    assert _by_node(obj) == {"node-a": {**_daemon("node-a", ip="0.0.0.0"), "status": "NotReady"}}
    entries = _entries(obj)
    assert entries["controller"]["operation"] == "Update"
    assert entries["controller"]["fieldsV1"] == {"f:daemons": {'k:{"nodeName":"node-a"}': {"f:ipAddress": {}}}}
    assert entries["compute-domain-daemon/node-a"]["fieldsV1"] == {"f:daemons": {'k:{"nodeName":"node-a"}': {
        ".": {}, "f:cliqueID": {}, "f:nodeName": {}}}}
    # The daemon's next apply takes its address back (it applies a value the controller owns: force, as a
    # daemon that owns its entry does) and re-adds node-c.
    _apply(custom, "compute-domain-daemon/node-a", {"daemons": [_daemon("node-a"), _daemon("node-c")]}, force=True)
    obj = _get(custom)
    assert _by_node(obj)["node-a"]["ipAddress"] == "10.0.0.1" and "node-c" in _by_node(obj)
    assert "controller" not in _entries(obj)


def test_managed_fields_in_a_write_are_ignored_unless_reset(custom: Any) -> None:
    _apply(custom, "d/a", {"daemons": [_daemon("node-a")]})
    obj = _get(custom)
    obj["metadata"]["managedFields"] = [{"manager": "forged", "operation": "Apply", "fieldsType": "FieldsV1",
                                         "fieldsV1": {"f:daemons": {}}}]
    obj["daemons"][0]["ipAddress"] = "10.0.0.7"
    custom.replace_namespaced_custom_object(GROUP, VERSION, NS, "computedomaincliques", CLIQUE, obj)
    entries = _entries(_get(custom))
    assert "forged" not in entries and "d/a" in entries
    assert "OpenAPI-Generator" in entries  # the client's User-Agent up to its first "/"
    obj = _get(custom)
    obj["metadata"]["managedFields"] = [{}]
    custom.replace_namespaced_custom_object(GROUP, VERSION, NS, "computedomaincliques", CLIQUE, obj)
    assert "managedFields" not in _get(custom)["metadata"]


def test_status_subresource_apply_tracks_status_apart(custom: Any) -> None:
    cd = {"spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "cd-channel"}}}}
    _apply(custom, "user", cd, plural="computedomains", name="cd")
    _apply(custom, "controller", {"status": {"status": "NotReady", "nodes": []}}, plural="computedomains",
           name="cd", status=True)
    obj = _get(custom, "cd", "computedomains")
    assert obj["status"]["status"] == "NotReady"
    entries = _entries(obj)
    assert entries["controller"]["subresource"] == "status"
    assert entries["controller"]["fieldsV1"] == {"f:status": {"f:nodes": {}, "f:status": {}}}
    assert "subresource" not in entries["user"] and "f:status" not in entries["user"]["fieldsV1"]
    # A main-resource apply that names status changes nothing of it.
    _apply(custom, "user", {**cd, "status": {"status": "Ready"}}, plural="computedomains", name="cd")
    assert _get(custom, "cd", "computedomains")["status"]["status"] == "NotReady"


def test_resource_version_in_the_configuration_is_a_precondition(custom: Any) -> None:
    _apply(custom, "d/a", {"daemons": [_daemon("node-a")]})
    stale = _get(custom)["metadata"]["resourceVersion"]
    _apply(custom, "d/b", {"daemons": [_daemon("node-b")]})
    doc = {"metadata": {"resourceVersion": stale}, "daemons": [_daemon("node-a", status="Ready")]}
    with pytest.raises(kubernetes.client.ApiException) as exc:
        custom.patch_namespaced_custom_object(GROUP, VERSION, NS, "computedomaincliques", CLIQUE,
                                              {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ComputeDomainClique",
                                               **doc, "metadata": {"name": CLIQUE, **doc["metadata"]}},
                                              field_manager="d/a", _content_type=APPLY)
    assert exc.value.status == 409


def test_apply_needs_a_field_manager_and_force_needs_apply(custom: Any, client: Any) -> None:
    with pytest.raises(kubernetes.client.ApiException) as exc:
        custom.patch_namespaced_custom_object(GROUP, VERSION, NS, "computedomaincliques", CLIQUE,
                                              {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ComputeDomainClique",
                                               "metadata": {"name": CLIQUE}}, _content_type=APPLY)
    assert exc.value.status == 400
    assert "fieldManager: Required value: is required for apply patch" in _status_of(exc)["message"]
    _apply(custom, "d/a", {"daemons": [_daemon("node-a")]})
    with pytest.raises(kubernetes.client.ApiException) as exc:
        custom.patch_namespaced_custom_object(GROUP, VERSION, NS, "computedomaincliques", CLIQUE, {"daemons": []},
                                              force=True, _content_type="application/merge-patch+json")
    assert exc.value.status == 422


def test_yaml_body_and_sets_on_a_built_in_type(api: ApiServerEmulator, client: Any) -> None:
    """The Server-Side Apply documentation's ConfigMap example, its ``managedFields`` literally; finalizers a
    set (``v:`` elements), labels a granular map."""
    yaml_body = (b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: test-cm\n  namespace: default\n"
                 b"  labels:\n    test-label: test\ndata:\n  key: some value\n")
    path = "/api/v1/namespaces/default/configmaps/test-cm"
    assert _send(client, "PATCH", path, yaml_body.decode(), APPLY, manager="kubectl") == 201
    cm = api.get("ConfigMap", "test-cm", "default")
    (entry,) = cm["metadata"]["managedFields"]
    assert {k: entry[k] for k in ("manager", "operation", "apiVersion", "fieldsType", "fieldsV1")} == {
        "manager": "kubectl", "operation": "Apply", "apiVersion": "v1", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:labels": {"f:test-label": {}}}, "f:data": {"f:key": {}}}}
    core = kubernetes.client.CoreV1Api(client)
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "test-cm", "finalizers": ["x/y"],
                                                                  "labels": {"other": "1"}}}
    core.patch_namespaced_config_map("test-cm", "default", body, field_manager="second", _content_type=APPLY)
    cm = api.get("ConfigMap", "test-cm", "default")
    assert cm["metadata"]["labels"] == {"test-label": "test", "other": "1"} and cm["data"] == {"key": "some value"}
    second = next(e for e in cm["metadata"]["managedFields"] if e["manager"] == "second")
    assert second["fieldsV1"] == {"f:metadata": {"f:finalizers": {'v:"x/y"': {}}, "f:labels": {"f:other": {}}}}
    core.patch_namespaced_config_map("test-cm", "default", {**body, "metadata": {"name": "test-cm"}},
                                     field_manager="second", _content_type=APPLY)
    cm = api.get("ConfigMap", "test-cm", "default")
    assert "finalizers" not in cm["metadata"] and cm["metadata"]["labels"] == {"test-label": "test"}
    api.delete("ConfigMap", "test-cm", "default")


def test_owner_references_of_many_appliers_merge_by_uid(custom: Any) -> None:
    def ref(uid: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod", "name": f"pod-{uid}", "uid": uid}

    _apply(custom, "d/a", {"metadata": {"name": CLIQUE, "ownerReferences": [ref("a")]},
                           "daemons": [_daemon("node-a")]})
    _apply(custom, "d/b", {"metadata": {"name": CLIQUE, "ownerReferences": [ref("b")]},
                           "daemons": [_daemon("node-b")]})
    obj = _get(custom)
    assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == ["a", "b"]
    assert 'k:{"uid":"b"}' in _entries(obj)["d/b"]["fieldsV1"]["f:metadata"]["f:ownerReferences"]


def test_records_name_the_field_manager(api: ApiServerEmulator, custom: Any) -> None:
    before = len(api.requests)
    _apply(custom, "compute-domain-daemon/node-q", {"daemons": [_daemon("node-q")]})
    (record,) = [r for r in api.requests[before:] if r.verb == "patch"]
    assert record.field_manager == "compute-domain-daemon/node-q" and record.apply and record.code in (200, 201)


def test_a_no_op_apply_writes_nothing(api: ApiServerEmulator, custom: Any) -> None:
    _apply(custom, "d/a", {"daemons": [_daemon("node-a")]})
    first = _get(custom)
    again = _apply(custom, "d/a", {"daemons": [_daemon("node-a")]})
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert again["metadata"]["managedFields"] == first["metadata"]["managedFields"]
