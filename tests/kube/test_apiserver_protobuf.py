"""Kubernetes protobuf bodies on the API server emulator, over real HTTP, as client-go sends them.

Protobuf bodies are built from the generated messages (and once by hand, independent of them) and read back
as JSON through the official ``kubernetes`` client; objects created as JSON are read back as protobuf.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import kubernetes
import pytest
from google.protobuf.message import Message

from dradriver._proto import (
    k8s_core_v1_pb2,
    k8s_events_v1_pb2,
    k8s_meta_v1_pb2,
    k8s_resource_quantity_pb2,
    k8s_resource_v1_pb2,
    k8s_runtime_pb2,
)
from dradriver.sandbox.apiserver import ApiServerEmulator

from .conftest import NODE

PROTOBUF = "application/vnd.kubernetes.protobuf"
CLIENT_GO_ACCEPT = "application/vnd.kubernetes.protobuf,application/json"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def k8s(kubeconfig: str) -> Any:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.retries = False
    with kubernetes.client.ApiClient(cfg) as c:
        yield c


def request(
    api: ApiServerEmulator,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    content_type: str = PROTOBUF,
    accept: str = CLIENT_GO_ACCEPT,
) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
    try:
        headers = {"Accept": accept}
        if body:
            headers["Content-Type"] = content_type
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def envelope(api_version: str, kind: str, message: Message) -> bytes:
    unknown = k8s_runtime_pb2.Unknown(
        typeMeta=k8s_runtime_pb2.TypeMeta(apiVersion=api_version, kind=kind), raw=message.SerializeToString()
    )
    return b"k8s\x00" + unknown.SerializeToString()


def open_envelope(data: bytes, message: type[Message]) -> tuple[str, str, Any]:
    assert data[:4] == b"k8s\x00", data[:40]
    unknown = k8s_runtime_pb2.Unknown.FromString(data[4:])
    return unknown.typeMeta.apiVersion, unknown.typeMeta.kind, message.FromString(unknown.raw)


def quantity(text: str) -> k8s_resource_quantity_pb2.Quantity:
    return k8s_resource_quantity_pb2.Quantity(string=text)


def slice_message(name: str) -> k8s_resource_v1_pb2.ResourceSlice:
    R = k8s_resource_v1_pb2
    device = R.Device(
        name="gpu-0",
        attributes={
            "index": R.DeviceAttribute(int=0),  # zero values of Go pointer fields must survive
            "mig": R.DeviceAttribute(bool=False),
            "productName": R.DeviceAttribute(string="NVIDIA H100 80GB HBM3"),
            "driverVersion": R.DeviceAttribute(version="570.124.6"),
        },
        capacity={"memory": R.DeviceCapacity(value=quantity("80Gi"))},
    )
    return R.ResourceSlice(
        metadata=k8s_meta_v1_pb2.ObjectMeta(name=name, labels={"app": "dra"}),
        spec=R.ResourceSliceSpec(
            driver="gpu.nvidia.com",
            nodeName=NODE,
            pool=R.ResourcePool(name=NODE, generation=0, resourceSliceCount=1),
            devices=[device],
        ),
    )


def status_of(data: bytes) -> Any:
    api_version, kind, status = open_envelope(data, k8s_meta_v1_pb2.Status)
    assert (api_version, kind) == ("v1", "Status")
    return status


def test_resource_slice_created_as_protobuf_reads_back_as_json(api: ApiServerEmulator, k8s: Any) -> None:
    code, ctype, data = request(api, "POST", SLICES, envelope("resource.k8s.io/v1", "ResourceSlice",
                                                              slice_message("proto-slice")))
    assert code == 201, data
    assert ctype == PROTOBUF
    api_version, kind, created = open_envelope(data, k8s_resource_v1_pb2.ResourceSlice)
    assert (api_version, kind) == ("resource.k8s.io/v1", "ResourceSlice")
    assert created.metadata.uid and int(created.metadata.resourceVersion) > 0
    assert created.metadata.creationTimestamp.seconds > 1_700_000_000
    assert created.metadata.generation == 1

    read = kubernetes.client.ResourceV1Api(k8s).read_resource_slice("proto-slice")
    assert read.metadata.uid == created.metadata.uid
    assert read.metadata.labels == {"app": "dra"}
    assert read.spec.node_name == NODE and read.spec.pool.generation == 0
    (device,) = read.spec.devices
    assert device.attributes["index"].int == 0
    assert device.attributes["mig"].bool is False
    assert device.attributes["productName"].string == "NVIDIA H100 80GB HBM3"
    assert device.attributes["driverVersion"].version == "570.124.6"
    assert device.capacity["memory"].value == "80Gi"
    stored = api.get("ResourceSlice", "proto-slice")
    assert stored is not None
    assert "allNodes" not in stored["spec"]  # unset on the wire stays unset
    assert isinstance(stored["metadata"]["creationTimestamp"], str)


def test_resource_slice_created_as_json_reads_as_protobuf(api: ApiServerEmulator, k8s: Any) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "json-slice"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE,
                 "pool": {"name": NODE, "generation": 3, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-1"}},
                              "capacity": {"memory": {"value": "40Gi"}}}]},
    }
    kubernetes.client.ResourceV1Api(k8s).create_resource_slice(body)

    code, ctype, data = request(api, "GET", f"{SLICES}/json-slice")
    assert (code, ctype) == (200, PROTOBUF)
    _, kind, got = open_envelope(data, k8s_resource_v1_pb2.ResourceSlice)
    assert kind == "ResourceSlice"
    assert got.spec.pool.generation == 3 and got.spec.nodeName == NODE
    assert got.spec.devices[0].attributes["uuid"].string == "GPU-1"
    assert got.spec.devices[0].capacity["memory"].value.string == "40Gi"
    assert got.metadata.creationTimestamp.seconds > 1_700_000_000

    code, ctype, data = request(api, "GET", f"{SLICES}?fieldSelector=spec.nodeName%3D{NODE}")
    assert (code, ctype) == (200, PROTOBUF)
    api_version, kind, listed = open_envelope(data, k8s_resource_v1_pb2.ResourceSliceList)
    assert (api_version, kind) == ("resource.k8s.io/v1", "ResourceSliceList")
    assert [s.metadata.name for s in listed.items] == ["json-slice"]
    assert listed.metadata.resourceVersion == got.metadata.resourceVersion

    # update as protobuf: the spec change bumps generation; a stale resourceVersion is a protobuf 409 Status
    got.spec.pool.generation = 4
    code, _, data = request(api, "PUT", f"{SLICES}/json-slice",
                            envelope("resource.k8s.io/v1", "ResourceSlice", got))
    assert code == 200, data
    _, _, updated = open_envelope(data, k8s_resource_v1_pb2.ResourceSlice)
    assert updated.metadata.generation == 2 and updated.spec.pool.generation == 4
    code, ctype, data = request(api, "PUT", f"{SLICES}/json-slice",
                                envelope("resource.k8s.io/v1", "ResourceSlice", got))
    assert (code, ctype) == (409, PROTOBUF)
    status = status_of(data)
    assert (status.code, status.reason, status.status) == (409, "Conflict", "Failure")
    assert status.details.name == "json-slice" and status.details.kind == "resourceslices"
    assert kubernetes.client.ResourceV1Api(k8s).read_resource_slice("json-slice").spec.pool.generation == 4

    code, ctype, data = request(api, "DELETE", f"{SLICES}/json-slice")
    assert (code, ctype) == (200, PROTOBUF)
    assert open_envelope(data, k8s_resource_v1_pb2.ResourceSlice)[2].metadata.name == "json-slice"
    assert api.get("ResourceSlice", "json-slice") is None


def test_hand_encoded_resource_slice_uses_the_upstream_field_numbers(api: ApiServerEmulator) -> None:
    """Bytes built by hand from the upstream field numbers, independent of our .proto files."""

    def field(number: int, payload: bytes) -> bytes:  # length-delimited (wire type 2), lengths < 128
        return bytes([number << 3 | 2, len(payload)]) + payload

    def varint(number: int, value: int) -> bytes:
        return bytes([number << 3, value])

    meta = field(1, b"hand")  # ObjectMeta.name = 1
    pool = field(1, NODE.encode()) + varint(2, 7) + varint(3, 1)  # ResourcePool name, generation, count
    spec = field(1, b"gpu.nvidia.com") + field(2, pool) + field(3, NODE.encode())  # driver, pool, nodeName
    raw = field(1, meta) + field(2, spec)  # ResourceSlice.metadata = 1, spec = 2
    type_meta = field(1, b"resource.k8s.io/v1") + field(2, b"ResourceSlice")
    body = b"k8s\x00" + field(1, type_meta) + field(2, raw)  # Unknown.typeMeta = 1, raw = 2

    code, _, data = request(api, "POST", SLICES, body, accept="application/json")
    assert code == 201, data
    created = json.loads(data)
    assert created["spec"] == {"driver": "gpu.nvidia.com", "nodeName": NODE,
                               "pool": {"name": NODE, "generation": 7, "resourceSliceCount": 1}}
    assert created["metadata"]["name"] == "hand"


def test_core_and_events_v1_events_created_as_protobuf(api: ApiServerEmulator, k8s: Any) -> None:
    C, M = k8s_core_v1_pb2, k8s_meta_v1_pb2
    core = C.Event(
        metadata=M.ObjectMeta(name="pod-a.1", namespace="default"),
        involvedObject=C.ObjectReference(kind="Pod", namespace="default", name="pod-a", uid="u-1"),
        reason="Prepared", message="claim prepared", type="Normal", count=1,
        source=C.EventSource(component="gpu.nvidia.com"),
        firstTimestamp=M.Time(seconds=1_750_000_000),
        lastTimestamp=M.Time(seconds=1_750_000_060),
        eventTime=M.MicroTime(seconds=1_750_000_000, nanos=123_456_000),
        reportingComponent="gpu.nvidia.com", reportingInstance=NODE,
    )
    code, ctype, data = request(api, "POST", "/api/v1/namespaces/default/events", envelope("v1", "Event", core))
    assert (code, ctype) == (201, PROTOBUF), data
    assert open_envelope(data, C.Event)[2].involvedObject.name == "pod-a"
    read = kubernetes.client.CoreV1Api(k8s).read_namespaced_event("pod-a.1", "default")
    assert (read.reason, read.type, read.count, read.involved_object.uid) == ("Prepared", "Normal", 1, "u-1")
    raw = api.get("Event", "pod-a.1", "default")
    assert raw is not None
    assert raw["firstTimestamp"] == "2025-06-15T15:06:40Z"
    assert raw["eventTime"] == "2025-06-15T15:06:40.123456Z"

    E = k8s_events_v1_pb2
    new = E.Event(
        metadata=M.ObjectMeta(name="node-a.2", namespace="default"),
        eventTime=M.MicroTime(seconds=1_750_000_000),
        reportingController="gpu.nvidia.com", reportingInstance=NODE,
        action="Publish", reason="SlicesPublished", note="2 devices", type="Normal",
        regarding=C.ObjectReference(kind="Node", name=NODE),
    )
    code, _, data = request(api, "POST", "/apis/events.k8s.io/v1/namespaces/default/events",
                            envelope("events.k8s.io/v1", "Event", new))
    assert code == 201, data
    got = kubernetes.client.EventsV1Api(k8s).read_namespaced_event("node-a.2", "default")
    assert (got.note, got.action, got.regarding.name) == ("2 devices", "Publish", NODE)
    assert got.event_time is not None and got.event_time.year == 2025


def test_node_get_as_protobuf(api: ApiServerEmulator) -> None:
    code, ctype, data = request(api, "GET", f"/api/v1/nodes/{NODE}")
    assert (code, ctype) == (200, PROTOBUF)
    api_version, kind, node = open_envelope(data, k8s_core_v1_pb2.Node)
    assert (api_version, kind) == ("v1", "Node")
    assert node.metadata.labels["kubernetes.io/hostname"] == NODE
    assert {k: v.string for k, v in node.status.allocatable.items()} == {"cpu": "64", "memory": "512Gi", "pods": "110"}
    assert node.status.capacity["memory"].string == "512Gi"
    (ready,) = node.status.conditions
    assert ready.type == "Ready" and ready.lastHeartbeatTime.seconds > 1_700_000_000


def test_protobuf_errors(api: ApiServerEmulator) -> None:
    cm = "/api/v1/namespaces/default/configmaps"
    # a kind without protobuf (like a CRD): 415 for a protobuf body, JSON fallback for client-go's Accept
    code, ctype, data = request(api, "POST", cm, envelope("v1", "ConfigMap", k8s_meta_v1_pb2.Status()))
    assert (code, ctype) == (415, "application/json")
    assert json.loads(data)["reason"] == "UnsupportedMediaType"
    api.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}})
    code, ctype, data = request(api, "GET", f"{cm}/c")
    assert (code, ctype) == (200, "application/json") and json.loads(data)["data"] == {"k": "v"}
    code, _, data = request(api, "GET", f"{cm}/c", accept=PROTOBUF)
    assert code == 406 and json.loads(data)["reason"] == "NotAcceptable"

    # errors on protobuf kinds are protobuf Status objects
    code, ctype, data = request(api, "GET", f"{SLICES}/missing")
    assert (code, ctype) == (404, PROTOBUF)
    status = status_of(data)
    assert (status.reason, status.message) == ("NotFound", 'resourceslices.resource.k8s.io "missing" not found')
    code, _, data = request(api, "POST", SLICES, b"\x0a\x00not-k8s")
    assert code == 400 and status_of(data).reason == "BadRequest"
    bad = slice_message("bad")
    bad.spec.pool.resourceSliceCount = 0
    code, _, data = request(api, "POST", SLICES, envelope("resource.k8s.io/v1", "ResourceSlice", bad))
    assert code == 422
    causes = {c.field for c in status_of(data).details.causes}
    assert "spec.pool.resourceSliceCount" in causes
    # a slice body on the events path is refused like a JSON body of another kind
    code, _, data = request(api, "POST", "/api/v1/namespaces/default/events",
                            envelope("resource.k8s.io/v1", "ResourceSlice", slice_message("x")))
    assert code == 400 and status_of(data).reason == "BadRequest"


def test_a_protobuf_delete_options_body_is_honoured_as_client_go_sends_it(api: ApiServerEmulator) -> None:
    """client-go's ``Delete`` of a built-in kind sends ``DeleteOptions`` as protobuf, enveloped with the resource's
    group version (``apps/v1`` / ``DeleteOptions``; bytes as NVIDIA's plugin sends them for its MPS control daemon's
    Deployment, with ``propagationPolicy: Foreground``): its preconditions and propagation policy are applied; a
    protobuf body on a custom resource is refused with 415, as for every other body."""
    M = k8s_meta_v1_pb2
    deployments = "/apis/apps/v1/namespaces/default/deployments"
    for name in ("a", "b"):
        api.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
                     "spec": {"selector": {"matchLabels": {"app": name}},
                              "template": {"metadata": {"labels": {"app": name}},
                                           "spec": {"containers": [{"name": "c", "image": "x"}]}}}})
    wrong_uid = envelope("apps/v1", "DeleteOptions", M.DeleteOptions(preconditions=M.Preconditions(uid="other")))
    code, _, data = request(api, "DELETE", f"{deployments}/a", wrong_uid, accept="application/json")
    assert code == 409 and "Precondition failed: UID in precondition: other" in json.loads(data)["message"]
    nvidias = b'k8s\x00\n\x18\n\x07apps/v1\x12\rDeleteOptions\x12\x0c"\nForeground\x1a\x00"\x00'
    code, _, data = request(api, "DELETE", f"{deployments}/a", nvidias, accept="application/json")
    assert code == 200, data
    assert api.get("Deployment", "a", "default") is None
    dry = envelope("apps/v1", "DeleteOptions", M.DeleteOptions(dryRun=["All"], propagationPolicy="Background"))
    code, _, data = request(api, "DELETE", f"{deployments}/b", dry, accept="application/json")
    assert code == 200 and api.get("Deployment", "b", "default") is not None
    code, _, data = request(api, "DELETE", f"{deployments}/b", envelope("apps/v1", "Deployment", M.Status()),
                            accept="application/json")
    assert code == 400 and "must be DeleteOptions, not apps/v1 Deployment" in json.loads(data)["message"]
    api.create({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
                "metadata": {"name": "cd", "namespace": "default"}, "spec": {"numNodes": 1}})
    code, _, data = request(api, "DELETE", "/apis/resource.nvidia.com/v1beta1/namespaces/default/computedomains/cd",
                            envelope("resource.nvidia.com/v1beta1", "DeleteOptions", M.DeleteOptions()),
                            accept="application/json")
    assert code == 415 and json.loads(data)["reason"] == "UnsupportedMediaType"
