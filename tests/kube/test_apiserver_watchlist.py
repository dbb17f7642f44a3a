"""Watch-list (KEP-3157) on the API server emulator: initial events, the closing bookmark, then live events."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlencode

import kubernetes
import pytest

from dradriver.sandbox.apiserver import ApiServerEmulator

from .conftest import NODE

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
WATCH_LIST = {"watch": "1", "sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan",
              "allowWatchBookmarks": "true"}


@pytest.fixture
def k8s(kubeconfig: str) -> Any:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.retries = False
    with kubernetes.client.ApiClient(cfg) as c:
        yield c


def _slice(name: str, node: str = NODE) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": [{"name": "gpu-0"}]},
    }


def _get(api: ApiServerEmulator, params: dict[str, str]) -> tuple[int, list[dict[str, Any]] | dict[str, Any]]:
    """A watch with a short timeout, read to its end: (status, events) or (status, Status object)."""
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
    try:
        conn.request("GET", f"{SLICES}?{urlencode(params)}", headers={"Accept": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        return resp.status, json.loads(data)
    return resp.status, [json.loads(line) for line in data.splitlines() if line.strip()]


def test_initial_events_bookmark_then_live_events(api: ApiServerEmulator, k8s: Any) -> None:
    api.create(_slice("slice-a"))
    api.create(_slice("slice-b"))
    api.create(_slice("other", node="node-b"))
    rv_after_seed = api.get("ResourceSlice", "other")["metadata"]["resourceVersion"]  # type: ignore[index]
    resource = kubernetes.client.ResourceV1Api(k8s)
    seen: list[tuple[str, str]] = []
    bookmark: dict[str, Any] = {}
    watch = kubernetes.watch.Watch()
    for event in watch.stream(resource.list_resource_slice, field_selector=f"spec.nodeName={NODE}",
                              send_initial_events=True, resource_version_match="NotOlderThan",
                              allow_watch_bookmarks=True, timeout_seconds=10):
        if event["type"] == "BOOKMARK":
            bookmark = event["raw_object"]
            api.create(_slice("slice-c"))  # a live change after the initial state
            api.create(_slice("ignored", node="node-b"))
            continue
        seen.append((event["type"], event["object"].metadata.name))
        if event["object"].metadata.name == "slice-c":
            watch.stop()
    assert seen == [("ADDED", "slice-a"), ("ADDED", "slice-b"), ("ADDED", "slice-c")]
    assert bookmark == {
        "kind": "ResourceSlice",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"resourceVersion": rv_after_seed, "annotations": {"k8s.io/initial-events-end": "true"}},
    }
    assert api.count("watch", "resourceslices") == 1


def test_watch_list_from_a_resource_version_sends_the_current_state(api: ApiServerEmulator) -> None:
    first = api.create(_slice("slice-a"))
    api.delete("ResourceSlice", "slice-a")
    api.create(_slice("slice-b"))
    current = api.get("ResourceSlice", "slice-b")["metadata"]["resourceVersion"]  # type: ignore[index]
    code, events = _get(api, {**WATCH_LIST, "resourceVersion": first["metadata"]["resourceVersion"],
                              "timeoutSeconds": "1"})
    assert code == 200 and isinstance(events, list)
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in events] == [
        ("ADDED", "slice-b"), ("BOOKMARK", None)]  # not the replayed history: the state now
    assert events[1]["object"]["metadata"]["resourceVersion"] == current
    code, status = _get(api, {**WATCH_LIST, "resourceVersion": str(int(current) + 100)})
    assert code == 504 and isinstance(status, dict) and status["reason"] == "Timeout"


def test_without_bookmarks_the_initial_events_come_alone(api: ApiServerEmulator) -> None:
    api.create(_slice("slice-a"))
    params = {k: v for k, v in WATCH_LIST.items() if k != "allowWatchBookmarks"}
    code, events = _get(api, {**params, "timeoutSeconds": "1"})
    assert code == 200 and isinstance(events, list)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "slice-a")]
    # sendInitialEvents=false: NotOlderThan without the initial state
    code, events = _get(api, {**WATCH_LIST, "sendInitialEvents": "false", "timeoutSeconds": "1"})
    assert (code, events) == (200, [])


@pytest.mark.parametrize(
    ("params", "messages"),
    [
        ({"sendInitialEvents": "true"},
         ["resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan"]),
        ({"resourceVersionMatch": "NotOlderThan"},
         ["resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents "
          "is provided"]),
        ({"sendInitialEvents": "true", "resourceVersionMatch": "Exact"},
         ["resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
          'resourceVersionMatch: Unsupported value: "Exact": supported values: "NotOlderThan"']),
    ],
)
def test_invalid_watch_list_options(api: ApiServerEmulator, params: dict[str, str], messages: list[str]) -> None:
    code, status = _get(api, {"watch": "1", "allowWatchBookmarks": "true", **params})
    assert code == 422 and isinstance(status, dict)
    assert status["reason"] == "Invalid"
    assert status["details"]["kind"] == "ListOptions" and status["details"]["group"] == "meta.k8s.io"
    assert status["message"] == 'ListOptions.meta.k8s.io "" is invalid: ' + ", ".join(messages)
    assert {c["field"] for c in status["details"]["causes"]} == {"resourceVersionMatch"}
    assert api.count("watch", "resourceslices", code=422) == 1
    assert api.count("watch", "resourceslices", code=200) == 0
