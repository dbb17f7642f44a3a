"""The ResourceSlice publisher against the API server emulator, through the official client over HTTP."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import kubernetes_validate
import pytest

from dradriver.domain.resourceslices import ResourceSliceError
from dradriver.kube import errors
from dradriver.kube.client import KubeClient
from dradriver.kube.resourceslices import PublishResult, SlicePublisher, decode_index, encode_index, index_length
from dradriver.sandbox.apiserver import ApiServerEmulator
from tests.factories import wait_until

from .conftest import DRIVER, NODE

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _device(name: str, product: str = "NVIDIA A100-SXM4-40GB") -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": product},
                       "driverVersion": {"version": "550.127.8"}},
        "capacity": {"memory": {"value": "40Gi"}},
    }


def desired(*groups: Sequence[str], product: str = "NVIDIA A100-SXM4-40GB") -> list[dict[str, Any]]:
    """Desired slices as the builder hands them over: complete specs, no names."""
    return [{
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {},
        "spec": {"driver": DRIVER, "nodeName": NODE,
                 "pool": {"name": NODE, "generation": 0, "resourceSliceCount": len(groups)},
                 "devices": [_device(n, product) for n in group]},
    } for group in groups]


def ours(api: ApiServerEmulator) -> list[dict[str, Any]]:
    return [s for s in api.objects("ResourceSlice")
            if s["spec"]["nodeName"] == NODE and s["spec"]["driver"] == DRIVER and s["spec"]["pool"]["name"] == NODE]


def writes(api: ApiServerEmulator) -> int:
    return sum(api.count(v, "resourceslices") for v in ("create", "update", "delete", "patch"))


@pytest.fixture
def publisher(client: KubeClient) -> SlicePublisher:
    return SlicePublisher(client, driver=DRIVER, node_name=NODE, resync_delay_s=0.05, coalesce_s=0.0,
                          backoff_initial_s=0.01, backoff_max_s=0.1, watch_timeout_s=5)


@contextmanager
def running(pub: SlicePublisher) -> Iterator[None]:
    thread = threading.Thread(target=asyncio.run, args=(pub.run(),), daemon=True)
    thread.start()
    try:
        yield
    finally:
        pub.stop()
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_index_prefix_round_trip() -> None:
    assert index_length(1) == 5 and index_length(0x100000) == 5 and index_length(0x100001) == 6
    assert encode_index(10, 5) == "0000a"
    assert decode_index("0000a-gpu.nvidia.com-node-a-x2b4c", 5) == 10
    assert decode_index("node-a-gpu.nvidia.com-x2b4c", 5) == -1
    assert decode_index("zzzzz-gpu", 5) == -1


def test_first_publish_creates_slices_owned_by_the_node(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    api.clear_requests()
    result = publisher.publish(desired(["gpu-0", "gpu-1"], ["gpu-2"]))
    assert (result.created, result.updated, result.deleted, result.generation) == (2, 0, 0, 1)
    node = api.get("Node", NODE)
    assert node is not None
    slices = ours(api)
    assert sorted(s["metadata"]["name"] for s in slices) == sorted(result.slices)
    for index, s in enumerate(sorted(slices, key=lambda s: s["metadata"]["name"])):
        assert s["metadata"]["name"].startswith(f"{index:05x}-{DRIVER}-{NODE}-")
        assert s["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node["metadata"]["uid"], "controller": True}]
        assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 2}
        kubernetes_validate.validate(s, "1.34", strict=True)
    assert [s["spec"]["devices"][0]["name"] for s in sorted(slices, key=lambda s: s["metadata"]["name"])] == [
        "gpu-0", "gpu-2"]
    assert api.count("get", "nodes") == 1 and api.count("list", "resourceslices") == 1
    assert api.count("create", "resourceslices") == 2


def test_identical_republish_writes_nothing(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    first = publisher.publish(desired(["gpu-0"], ["gpu-1"]))
    api.clear_requests()
    again = publisher.publish(desired(["gpu-0"], ["gpu-1"]))
    assert not again.wrote and again.slices == first.slices and again.generation == first.generation
    assert writes(api) == 0
    assert api.count("get", "nodes") == 0  # the Node UID is looked up once


def test_one_changed_slice_is_updated_in_place(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    first = publisher.publish(desired(["gpu-0"], ["gpu-1"]))
    api.clear_requests()
    second = publisher.publish(desired(["gpu-0"], ["gpu-1", "gpu-2"]))
    # One update is atomic, so the Go helper keeps the generation (kubelet-dra-protocol.md §4.7).
    assert (second.updated, second.created, second.deleted, second.generation) == (1, 0, 0, first.generation)
    assert api.count("update", "resourceslices") == 1 and writes(api) == 1


def test_change_in_two_slices_bumps_generation_on_all(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    first = publisher.publish(desired(["gpu-0"], ["gpu-1"], ["gpu-2"]))
    api.clear_requests()
    changed = desired(["gpu-0"], ["gpu-1"], ["gpu-2"])
    for s in changed[:2]:
        s["spec"]["devices"][0]["attributes"]["productName"] = {"string": "NVIDIA H100 80GB HBM3"}
    second = publisher.publish(changed)
    assert second.generation == first.generation + 1
    assert second.updated == 3 and writes(api) == 3  # the unchanged slice too, to carry the new generation
    assert {s["spec"]["pool"]["generation"] for s in ours(api)} == {first.generation + 1}
    for s in ours(api):
        kubernetes_validate.validate(s, "1.34", strict=True)


def test_added_and_removed_slices(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    first = publisher.publish(desired(["gpu-0"]))
    grown = publisher.publish(desired(["gpu-0"], ["gpu-1"]))
    assert (grown.created, grown.updated, grown.generation) == (1, 1, first.generation + 1)
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in ours(api)} == {2}
    shrunk = publisher.publish(desired(["gpu-0"]))
    assert (shrunk.deleted, shrunk.updated, shrunk.created) == (1, 1, 0)
    assert [s["spec"]["pool"]["resourceSliceCount"] for s in ours(api)] == [1]
    gone = publisher.publish([])
    assert gone.deleted == 1 and ours(api) == []


def test_other_nodes_drivers_and_pools_are_untouched(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    def foreign(name: str, node: str, driver: str, pool: str) -> dict[str, Any]:
        return api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                           "metadata": {"name": name},
                           "spec": {"driver": driver, "nodeName": node, "devices": [_device("gpu-0")],
                                    "pool": {"name": pool, "generation": 7, "resourceSliceCount": 1}}})

    others = [foreign("00000-other-node", "node-b", DRIVER, "node-b"),
              foreign("00000-other-driver", NODE, "dra.example.com", NODE),
              foreign("00000-other-pool", NODE, DRIVER, "shared-pool")]
    publisher.publish(desired(["gpu-0"]))
    publisher.publish(desired(["gpu-1"], ["gpu-2"]))
    publisher.publish([])
    for before in others:
        after = api.get("ResourceSlice", before["metadata"]["name"])
        assert after == before


def test_server_errors_are_retried(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    api.clear_requests()
    api.fail_next(2, status=500, method="POST", path=SLICES)
    api.fail_next(1, status=429, method="GET", path=SLICES, retry_after=0)
    result = publisher.publish(desired(["gpu-0"]))
    assert result.created == 1 and len(ours(api)) == 1
    assert api.count("create", "resourceslices", code=500) == 2
    assert api.count("list", "resourceslices", code=429) == 1


def test_conflict_fails_the_sync_and_the_next_one_converges(publisher: SlicePublisher,
                                                            api: ApiServerEmulator) -> None:
    publisher.publish(desired(["gpu-0"]))
    (mine,) = ours(api)
    stale_rv = mine["metadata"]["resourceVersion"]
    mine["metadata"]["labels"] = {"touched-by": "someone-else"}
    api.update(mine)  # someone else writes between our LIST and our PUT
    api.fail_next(1, status=409, method="PUT", path=SLICES)
    with pytest.raises(errors.KubeConflictError):
        publisher.publish(desired(["gpu-0", "gpu-1"]))
    result = publisher.publish(desired(["gpu-0", "gpu-1"]))
    assert result.updated == 1
    (after,) = ours(api)
    assert after["metadata"]["resourceVersion"] != stale_rv
    assert [d["name"] for d in after["spec"]["devices"]] == ["gpu-0", "gpu-1"]


def test_invalid_desired_state_is_refused_before_any_call(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    api.clear_requests()
    with pytest.raises(ResourceSliceError, match="device name 'gpu-0' appears twice"):
        publisher.publish(desired(["gpu-0"], ["gpu-0"]))
    wrong = desired(["gpu-0"])
    wrong[0]["spec"]["nodeName"] = "node-b"
    with pytest.raises(ResourceSliceError, match=r"spec\.nodeName is 'node-b'"):
        publisher.publish(wrong)
    assert api.requests == []


def test_run_publishes_and_repairs_deletions(publisher: SlicePublisher, api: ApiServerEmulator,
                                             client: KubeClient) -> None:
    results: list[PublishResult] = []
    publisher.on_publish = results.append
    with running(publisher):
        publisher.update(desired(["gpu-0"], ["gpu-1"]))
        wait_until(lambda: len(ours(api)) == 2, what="first publish")
        victim = ours(api)[0]["metadata"]["name"]
        api.delete("ResourceSlice", victim)
        wait_until(lambda: len(ours(api)) == 2 and victim not in {s["metadata"]["name"] for s in ours(api)},
                   what="a deleted slice to be re-created")
        # The kubelet wipes a node's slices when it starts (DeleteCollection by node name).
        client.resource.delete_collection_resource_slice(field_selector=f"spec.nodeName={NODE}")
        wait_until(lambda: len(ours(api)) == 2, what="the wiped pool to be re-published")
    generations = {s["spec"]["pool"]["generation"] for s in ours(api)}
    assert len(generations) == 1
    assert sum(r.created for r in results) == 5


def test_run_coalesces_a_burst_into_one_publish(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    results: list[PublishResult] = []
    publisher.on_publish = results.append
    publisher.watch = False
    for n in range(1, 6):
        publisher.update(desired(*[[f"gpu-{i}"] for i in range(n)]))
    api.clear_requests()
    with running(publisher):
        wait_until(lambda: bool(results), what="the publish")
    assert len(results) == 1 and results[0].created == 5
    assert api.count("create", "resourceslices") == 5 and api.count("list", "resourceslices") == 1


def test_run_backs_off_reports_and_recovers(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    failures: list[Exception] = []
    publisher.on_error = failures.append
    publisher.watch = False
    attempts = publisher.client.retry.attempts
    api.fail_next(attempts + 1, status=503, method="GET", path=SLICES)  # first sync fails after its retries
    with running(publisher):
        publisher.update(desired(["gpu-0"]))
        wait_until(lambda: len(ours(api)) == 1, what="publish after the API recovers")
    assert len(failures) == 1 and isinstance(failures[0], errors.KubeServerError)
    assert publisher.failures == 1


def test_run_reports_invalid_state_without_retrying(publisher: SlicePublisher, api: ApiServerEmulator) -> None:
    failures: list[Exception] = []
    publisher.on_error = failures.append
    publisher.watch = False
    with running(publisher):
        publisher.update(desired(["gpu-0"], ["gpu-0"]))
        wait_until(lambda: bool(failures), what="the validation error")
        publisher.update(desired(["gpu-0"]))
        wait_until(lambda: len(ours(api)) == 1, what="the valid state")
    assert len(failures) == 1 and isinstance(failures[0], ResourceSliceError)
