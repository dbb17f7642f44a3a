"""Events and Node reads through the official client."""

from __future__ import annotations

from dradriver.kube.client import KubeClient
from dradriver.kube.events import ObjectRef, create_event, node_ref
from dradriver.kube.nodes import get_node
from dradriver.sandbox.apiserver import ApiServerEmulator

from .conftest import NODE


def test_get_node_reads_uid_and_allocatable(client: KubeClient, api: ApiServerEmulator) -> None:
    node = get_node(client, NODE)
    stored = api.get("Node", NODE)
    assert stored is not None
    assert node.uid == stored["metadata"]["uid"]
    assert node.allocatable == {"cpu": "64", "memory": "512Gi", "pods": "110"}
    assert node.labels["kubernetes.io/hostname"] == NODE


def test_event_about_a_node(client: KubeClient, api: ApiServerEmulator) -> None:
    node = get_node(client, NODE)
    create_event(client, node_ref(NODE, node.uid), reason="ClaimStateCorrupt",
                 component="gpu.nvidia.com-kubelet-plugin",
                 message="claim state checksum mismatch; " + "x" * 2000, host=NODE)
    events = api.objects("events", namespace="default")
    assert len(events) == 1
    event = events[0]
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node.uid}
    assert (event["reason"], event["type"], event["count"]) == ("ClaimStateCorrupt", "Warning", 1)
    assert len(event["message"]) == 1024
    assert event["source"] == {"component": "gpu.nvidia.com-kubelet-plugin", "host": NODE}
    assert event["metadata"]["name"].startswith(f"{NODE}.")
    assert api.count("create", "events") == 1


def test_event_about_a_namespaced_object(client: KubeClient, api: ApiServerEmulator) -> None:
    create_event(client, ObjectRef("ResourceClaim", "c", "team-a", "uid-1", "resource.k8s.io/v1"),
                 reason="PrepareFailed", message="device gpu-3 is held by another claim", type_="Normal")
    (event,) = api.objects("events", namespace="team-a")
    assert event["involvedObject"]["namespace"] == "team-a" and event["type"] == "Normal"
