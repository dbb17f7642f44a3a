"""Error translation and retries of the client boundary, against the emulator over HTTP."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import kubernetes
import pytest

from dradriver.errors import DradriverError
from dradriver.kube import errors
from dradriver.kube.client import KubeClient, RetryPolicy, open_client
from dradriver.kube.nodes import get_node
from dradriver.sandbox.apiserver import ApiServerEmulator

from .conftest import NODE


def test_not_found_is_typed_and_chains_the_client_error(client: KubeClient) -> None:
    with pytest.raises(errors.KubeNotFoundError) as info:
        get_node(client, "missing")
    err = info.value
    assert isinstance(err, DradriverError)
    assert isinstance(err.__cause__, kubernetes.client.ApiException)
    assert (err.status, err.reason) == (404, "NotFound")
    assert str(err) == 'GET nodes missing: HTTP 404 NotFound: nodes "missing" not found'


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_errors_are_retried(client: KubeClient, api: ApiServerEmulator, status: int) -> None:
    api.clear_requests()
    api.fail_next(2, status=status, path=f"/api/v1/nodes/{NODE}")
    assert get_node(client, NODE).name == NODE
    assert api.count("get", "nodes", name=NODE) == 3


def test_retries_are_bounded(client: KubeClient, api: ApiServerEmulator) -> None:
    api.clear_requests()
    api.fail_next(10, status=500, path=f"/api/v1/nodes/{NODE}")
    with pytest.raises(errors.KubeServerError) as info:
        get_node(client, NODE)
    assert info.value.retryable
    assert api.count("get", "nodes") == client.retry.attempts


def test_conflict_is_not_retried(client: KubeClient, api: ApiServerEmulator) -> None:
    api.clear_requests()
    api.fail_next(1, status=409, path=f"/api/v1/nodes/{NODE}")
    with pytest.raises(errors.KubeConflictError):
        get_node(client, NODE)
    assert api.count("get", "nodes") == 1


def test_retry_after_is_honoured_within_the_cap(kubeconfig: str, api: ApiServerEmulator) -> None:
    delays: list[float] = []
    policy = RetryPolicy(attempts=3, initial_delay_s=0.01, max_delay_s=2.0, jitter=0.0)
    with open_client(kubeconfig, retry=policy) as kube:
        kube._sleep = delays.append  # record instead of sleeping
        api.fail_next(2, status=429, path=f"/api/v1/nodes/{NODE}", retry_after=7)
        get_node(kube, NODE)
    assert delays == [2.0, 2.0]


def test_backoff_grows_exponentially() -> None:
    policy = RetryPolicy(initial_delay_s=0.1, max_delay_s=1.0, multiplier=2.0, jitter=0.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.8, 1.0]


def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ApiServerEmulator() as api:
        config = api.kubeconfig()
    config["clusters"][0]["cluster"]["server"] = f"http://127.0.0.1:{port}"
    path = tmp_path / "kubeconfig"
    path.write_text(str(config).replace("'", '"'), encoding="utf-8")
    retry = RetryPolicy(attempts=2, initial_delay_s=0.0, jitter=0.0)
    with open_client(str(path), connect_timeout_s=1.0, retry=retry) as kube, \
            pytest.raises(errors.KubeUnavailableError) as info:
        get_node(kube, NODE)
    assert info.value.status is None and info.value.retryable


def test_bad_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(errors.KubeAPIError, match=r"load kubeconfig .*missing"):
        open_client(str(tmp_path / "missing"))


def test_long_messages_are_truncated() -> None:
    err = errors.error_from_response("GET x", 500, '{"kind": "Status", "reason": "InternalError", "message": "'
                                     + "y" * 5000 + '"}')
    assert isinstance(err, errors.KubeServerError)
    assert len(err.message) == errors.MAX_MESSAGE_CHARS and err.message.endswith("...")


def test_non_status_bodies_are_not_echoed() -> None:
    err = errors.error_from_response("GET x", 502, "<html>secret proxy page</html>")
    assert "secret" not in str(err) and "not a Status" in str(err)


def test_body_refused_by_the_client_model(client: KubeClient) -> None:
    body = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e"}, "notAField": 1}
    with pytest.raises(errors.KubeRequestInvalidError):
        client.call("POST events", client.core.create_namespaced_event, "default", body)


def _add_nodes(client: KubeClient, names: list[str]) -> None:
    for name in names:
        client.call(f"POST nodes {name}", client.core.create_node,
                    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"pool": "x"}}})


def test_list_items_fetches_page_by_page_as_consumed(client: KubeClient, api: ApiServerEmulator) -> None:
    names = [f"node-{i:02d}" for i in range(7)]
    _add_nodes(client, names)
    api.clear_requests()
    items = client.list_items("LIST nodes pool=x", client.core.list_node, page_size=3, label_selector="pool=x")
    assert api.count("list", "nodes") == 0  # nothing is sent before the first item is wanted
    first = [next(items)["metadata"]["name"] for _ in range(3)]
    assert first == names[:3] and api.count("list", "nodes") == 1
    rest = [o["metadata"]["name"] for o in items]
    assert rest == names[3:] and api.count("list", "nodes") == 3  # 3 + 3 + 1
    queries = [r.query for r in api.requests if r.verb == "list"]
    assert all("limit=3" in q for q in queries) and "continue=" not in queries[0] and "continue=" in queries[1]


def test_list_items_reports_a_list_that_expired_between_pages(client: KubeClient, api: ApiServerEmulator) -> None:
    _add_nodes(client, [f"node-{i}" for i in range(4)])
    items = client.list_items("LIST nodes", client.core.list_node, page_size=2)
    assert [next(items)["metadata"]["name"] for _ in range(2)] == ["node-0", "node-1"]
    api.fail_next(1, status=410, path="/api/v1/nodes")
    with pytest.raises(errors.KubeGoneError) as info:
        list(items)
    assert info.value.status == 410 and "expired between pages; list again" in str(info.value)
    api.fail_next(1, status=410, path="/api/v1/nodes")
    with pytest.raises(errors.KubeGoneError) as first_page:  # on the first page: the server's own answer
        list(client.list_items("LIST nodes", client.core.list_node, page_size=2))
    assert "between pages" not in str(first_page.value)


def test_a_call_with_a_time_limit_ends_by_it_when_the_server_hangs(client: KubeClient, api: ApiServerEmulator) -> None:
    """``timeout_s`` bounds the whole call: a hung GET raises KubeTimeoutError (not retried: the time is spent)
    at the limit, not after the client's 10 s read timeout times its retries."""
    api.clear_requests()
    api.hang_next(1, seconds=3, method="GET", path=f"/api/v1/nodes/{NODE}")
    began = time.monotonic()
    with pytest.raises(errors.KubeTimeoutError) as info:
        client.call(f"GET nodes {NODE}", client.raw("GET", f"/api/v1/nodes/{NODE}"), timeout_s=0.5)
    assert 0.45 <= time.monotonic() - began < 2.0
    assert info.value.reason == "Timeout" and not info.value.retryable
    assert "within 0.50 s" in str(info.value)
    assert api.count("get", "nodes", name=NODE) <= 1  # no second try started after the limit
    # within the limit, the same call answers
    assert client.call(f"GET nodes {NODE}", client.raw("GET", f"/api/v1/nodes/{NODE}"),
                       timeout_s=5.0)["metadata"]["name"] == NODE


def test_a_retry_that_would_start_after_the_time_limit_is_not_tried(kubeconfig: str, api: ApiServerEmulator) -> None:
    delays: list[float] = []
    policy = RetryPolicy(attempts=5, initial_delay_s=1.0, max_delay_s=1.0, jitter=0.0)
    with open_client(kubeconfig, retry=policy) as kube:
        kube._sleep = delays.append
        api.clear_requests()
        api.fail_next(3, status=503, path=f"/api/v1/nodes/{NODE}")
        with pytest.raises(errors.KubeTimeoutError, match="the next retry would start later"):
            kube.call(f"GET nodes {NODE}", kube.raw("GET", f"/api/v1/nodes/{NODE}"), timeout_s=0.5)
    assert delays == [] and api.count("get", "nodes", name=NODE) == 1
