"""The API server emulator, driven by the official ``kubernetes`` client over HTTP."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes
import pytest

from dradriver.sandbox.apiserver import ApiServerEmulator, ApiStatusError

from .conftest import NODE


@pytest.fixture
def k8s(kubeconfig: str) -> Any:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.retries = False
    with kubernetes.client.ApiClient(cfg) as c:
        yield c


def _slice(node: str = NODE, driver: str = "gpu.nvidia.com", name: str = "", devices: int = 1) -> dict[str, Any]:
    meta = {"name": name} if name else {"generateName": f"{node}-{driver}-"}
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta,
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": f"gpu-{i}"} for i in range(devices)]},
    }


def _status(exc: kubernetes.client.ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body or "{}")
    return body


def test_discovery_and_version(k8s: Any) -> None:
    assert kubernetes.client.VersionApi(k8s).get_code().minor == "34"
    groups = {g.name for g in kubernetes.client.ApisApi(k8s).get_api_versions().groups}
    assert {"resource.k8s.io", "events.k8s.io"} <= groups
    resources = kubernetes.client.ResourceV1Api(k8s).get_api_resources()
    names = {r.name for r in resources.resources}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status", "deviceclasses",
            "resourceclaimtemplates"} <= names
    assert kubernetes.client.CoreApi(k8s).get_api_versions().versions == ["v1"]


def test_server_assigns_metadata_and_generate_name(k8s: Any) -> None:
    res: Any = kubernetes.client.ResourceV1Api(k8s)
    created = res.create_resource_slice(_slice())
    meta = created.metadata
    assert re.fullmatch(rf"{NODE}-gpu\.nvidia\.com-[bcdfghjklmnpqrstvwxz2456789]{{5}}", meta.name)
    assert meta.uid and meta.resource_version and meta.creation_timestamp and meta.generation == 1
    again = res.create_resource_slice(_slice())
    assert again.metadata.name != meta.name
    assert int(again.metadata.resource_version) > int(meta.resource_version)


def test_update_with_stale_resource_version_conflicts(k8s: Any) -> None:
    res: Any = kubernetes.client.ResourceV1Api(k8s)
    created = k8s.sanitize_for_serialization(res.create_resource_slice(_slice(name="s1")))
    fresh = json.loads(json.dumps(created))
    fresh["spec"]["devices"].append({"name": "gpu-9"})
    updated = res.replace_resource_slice("s1", fresh)
    assert updated.metadata.generation == 2
    stale = json.loads(json.dumps(created))
    stale["spec"]["devices"] = []
    with pytest.raises(kubernetes.client.ApiException) as info:
        res.replace_resource_slice("s1", stale)
    status = _status(info.value)
    assert info.value.status == 409
    assert status["reason"] == "Conflict" and status["kind"] == "Status"
    assert status["message"].startswith('Operation cannot be fulfilled on resourceslices.resource.k8s.io "s1"')


def test_create_twice_is_already_exists_and_missing_is_not_found(k8s: Any) -> None:
    res: Any = kubernetes.client.ResourceV1Api(k8s)
    res.create_resource_slice(_slice(name="s1"))
    with pytest.raises(kubernetes.client.ApiException) as info:
        res.create_resource_slice(_slice(name="s1"))
    assert info.value.status == 409 and _status(info.value)["reason"] == "AlreadyExists"
    with pytest.raises(kubernetes.client.ApiException) as info:
        res.read_namespaced_resource_claim("nope", "default")
    status = _status(info.value)
    assert (info.value.status, status["reason"]) == (404, "NotFound")
    assert status["message"] == 'resourceclaims.resource.k8s.io "nope" not found'
    assert status["details"] == {"name": "nope", "group": "resource.k8s.io", "kind": "resourceclaims"}


def test_invalid_slice_is_422_naming_the_field(k8s: Any) -> None:
    body = _slice(name="bad")
    body["spec"]["devices"] = [{"name": "gpu-0", "attributes": {"driverVersion": {"version": "550.127.08"}}}]
    with pytest.raises(kubernetes.client.ApiException) as info:
        res: Any = kubernetes.client.ResourceV1Api(k8s)
        res.create_resource_slice(body)
    status = _status(info.value)
    assert info.value.status == 422 and status["reason"] == "Invalid"
    assert status["details"]["causes"][0]["field"] == "spec.devices[0].attributes[driverVersion].version"


def test_a_pod_naming_an_undeclared_claim_is_422_in_the_api_servers_words(k8s: Any) -> None:
    """``kubectl apply`` of a Pod whose container names a claim the Pod does not declare is refused, as by
    kube-apiserver's ``validateResourceClaimNames``."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
                    "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "gpux"}]}}]}}
    with pytest.raises(kubernetes.client.ApiException) as info:
        kubernetes.client.CoreV1Api(k8s).create_namespaced_pod("default", pod)
    status = _status(info.value)
    assert info.value.status == 422 and status["reason"] == "Invalid"
    assert status["message"] == ('Pod "p" is invalid: spec.containers[0].resources.claims[0]: Not found: "gpux": '
                                 "must be one of the names in pod.spec.resourceClaims: gpu")
    assert status["details"]["causes"] == [{"reason": "FieldValueNotFound",
                                            "field": "spec.containers[0].resources.claims[0]",
                                            "message": 'Not found: "gpux": must be one of the names in '
                                                       "pod.spec.resourceClaims: gpu"}]


def test_field_and_label_selectors(k8s: Any, api: ApiServerEmulator) -> None:
    res: Any = kubernetes.client.ResourceV1Api(k8s)
    res.create_resource_slice(_slice(NODE, name="a"))
    res.create_resource_slice(_slice("node-b", name="b"))
    res.create_resource_slice(_slice(NODE, driver="other.example.com", name="c"))
    names = [s.metadata.name for s in res.list_resource_slice(
        field_selector=f"spec.nodeName={NODE},spec.driver=gpu.nvidia.com").items]
    assert names == ["a"]
    assert [s.metadata.name for s in res.list_resource_slice(field_selector="spec.driver!=gpu.nvidia.com").items] == [
        "c"]
    with pytest.raises(kubernetes.client.ApiException) as info:
        res.list_resource_slice(field_selector="spec.pool.name=x")
    assert info.value.status == 400
    core: Any = kubernetes.client.CoreV1Api(k8s)
    for name, labels in (("p1", {"app": "x", "tier": "gpu"}), ("p2", {"app": "y"})):
        core.create_namespaced_pod("default", {"apiVersion": "v1", "kind": "Pod",
                                               "metadata": {"name": name, "labels": labels},
                                               "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    assert [p.metadata.name for p in core.list_namespaced_pod("default", label_selector="app in (x,z),tier").items] == [
        "p1"]
    assert [p.metadata.name for p in core.list_namespaced_pod("default", label_selector="!tier").items] == ["p2"]


def test_watch_resumes_from_resource_version(k8s: Any) -> None:
    res: Any = kubernetes.client.ResourceV1Api(k8s)
    res.create_resource_slice(_slice(name="old"))
    listed = res.list_resource_slice()
    rv = listed.metadata.resource_version
    res.create_resource_slice(_slice(name="new"))
    res.delete_resource_slice("old")
    res.create_resource_slice(_slice("node-b", name="elsewhere"))
    seen = []
    watch = kubernetes.watch.Watch()
    for event in watch.stream(res.list_resource_slice, resource_version=rv, field_selector=f"spec.nodeName={NODE}",
                              timeout_seconds=30):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 2:
            watch.stop()
    assert seen == [("ADDED", "new"), ("DELETED", "old")]


def test_status_subresource_and_main_resource_are_separate(k8s: Any, api: ApiServerEmulator) -> None:
    res: Any = kubernetes.client.ResourceV1Api(k8s)
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
             "status": {"allocation": {"devices": {"results": []}}}}
    created = res.create_namespaced_resource_claim("default", claim)
    assert created.status is None or created.status.allocation is None  # create drops status
    body = k8s.sanitize_for_serialization(created)
    body["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}]}}}
    res.replace_namespaced_resource_claim_status("c", "default", body)
    stored = api.get("ResourceClaim", "c", "default")
    assert stored is not None
    assert stored["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    assert stored["metadata"]["generation"] == 1
    body = k8s.sanitize_for_serialization(res.read_namespaced_resource_claim("c", "default"))
    body["spec"]["devices"]["requests"][0]["name"] = "other"
    with pytest.raises(kubernetes.client.ApiException) as info:
        res.replace_namespaced_resource_claim("c", "default", body)
    assert info.value.status == 422


def test_delete_preconditions_finalizers_and_owner_cascade(k8s: Any, api: ApiServerEmulator) -> None:
    res: Any = kubernetes.client.ResourceV1Api(k8s)
    node = api.get("Node", NODE)
    assert node is not None
    owned = _slice(name="owned")
    owned["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": NODE,
                                             "uid": node["metadata"]["uid"], "controller": True}]
    created = res.create_resource_slice(owned)
    with pytest.raises(kubernetes.client.ApiException) as info:
        res.delete_resource_slice("owned", body={"preconditions": {"uid": created.metadata.uid,
                                                                    "resourceVersion": "1"}})
    assert info.value.status == 409 and "Precondition failed" in _status(info.value)["message"]
    held = _slice(name="held")
    held["metadata"]["finalizers"] = ["example.com/hold"]
    res.create_resource_slice(held)
    res.delete_resource_slice("held")
    assert api.get("ResourceSlice", "held")["metadata"]["deletionTimestamp"]  # type: ignore[index]
    body = k8s.sanitize_for_serialization(res.read_resource_slice("held"))
    body["metadata"]["finalizers"] = []
    res.replace_resource_slice("held", body)
    assert api.get("ResourceSlice", "held") is None
    kubernetes.client.CoreV1Api(k8s).delete_node(NODE)
    assert api.get("ResourceSlice", "owned") is None  # garbage-collected with its owner


def test_fault_injection_and_request_counts(k8s: Any, api: ApiServerEmulator) -> None:
    core: Any = kubernetes.client.CoreV1Api(k8s)
    api.clear_requests()
    api.fail_next(1, status=429, path=f"/api/v1/nodes/{NODE}", retry_after=3)
    with pytest.raises(kubernetes.client.ApiException) as info:
        core.read_node(NODE)
    assert info.value.status == 429 and dict(info.value.headers or {})["Retry-After"] == "3"
    assert core.read_node(NODE).metadata.name == NODE
    assert api.count("get", "nodes") == 2
    assert api.count("get", "nodes", code=429) == 1
    with pytest.raises(ApiStatusError):
        api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})


def test_kubeconfig_is_loadable_yaml(kubeconfig: str, api: ApiServerEmulator) -> None:
    import yaml

    with open(kubeconfig, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    assert doc["clusters"][0]["cluster"]["server"] == api.url


def _pod(name: str, namespace: str = "default", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                            "labels": labels or {}},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


def test_list_in_chunks_with_limit_and_continue(k8s: Any) -> None:
    core: Any = kubernetes.client.CoreV1Api(k8s)
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default-a"}})
    # "default-a" sorts after "default" as a namespace but before it as a "namespace/name" string
    for ns, name in (("default", "p0"), ("default", "p1"), ("default-a", "p2"), ("default", "p3"), ("default", "p4")):
        core.create_namespaced_pod(ns, _pod(name, ns, {"app": "x" if name != "p3" else "y"}))
    whole = core.list_pod_for_all_namespaces()
    first = core.list_pod_for_all_namespaces(limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"]
    assert first.metadata.remaining_item_count == 3
    assert first.metadata.resource_version == whole.metadata.resource_version
    core.delete_namespaced_pod("p4", "default")  # gone before its page: not sent
    core.create_namespaced_pod("default", _pod("p5", labels={"app": "x"}))  # after the cursor: sent
    second = core.list_pod_for_all_namespaces(limit=2, _continue=first.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["p3", "p5"]
    assert second.metadata.resource_version == first.metadata.resource_version  # the first page's list RV
    third = core.list_pod_for_all_namespaces(limit=2, _continue=second.metadata._continue)
    assert [(p.metadata.namespace, p.metadata.name) for p in third.items] == [("default-a", "p2")]
    assert not third.metadata._continue and third.metadata.remaining_item_count is None
    selected = core.list_namespaced_pod("default", label_selector="app=x", limit=1)
    assert [p.metadata.name for p in selected.items] == ["p0"]
    assert selected.metadata._continue and selected.metadata.remaining_item_count is None  # a selector: no count
    rest = core.list_namespaced_pod("default", label_selector="app=x", limit=5, _continue=selected.metadata._continue)
    assert [p.metadata.name for p in rest.items] == ["p1", "p5"] and not rest.metadata._continue
    assert [p.metadata.name for p in core.list_namespaced_pod("default", limit=0).items] == ["p0", "p1", "p3", "p5"]
    for query, wanted in (({"limit": -1}, "greater than or equal to 0"), ({"_continue": "bm90LWEtdG9rZW4"},
                                                                         "continue key is not valid"),
                          ({"_continue": first.metadata._continue, "resource_version": "1"},
                           "not allowed when using continue")):
        with pytest.raises(kubernetes.client.ApiException) as info:
            core.list_namespaced_pod("default", **query)
        assert info.value.status == 400 and wanted in _status(info.value)["message"]


def test_a_client_that_hangs_up_on_a_watch_leaves_no_traceback(api: ApiServerEmulator,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    import socket
    import time

    for _ in range(3):  # a reset connection (SO_LINGER 0) under an open watch: the server's write fails
        sock = socket.create_connection(("127.0.0.1", api.port))
        sock.sendall(b"GET /api/v1/namespaces/default/pods?watch=true&timeoutSeconds=5 HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
    time.sleep(0.5)
    api.create(_pod("p"))  # wakes the watches: each writes to its dead connection
    time.sleep(0.5)
    assert "Traceback" not in capfd.readouterr().err
