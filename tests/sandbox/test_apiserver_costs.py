"""The API emulator's injected costs (``dradriver/sandbox/apiserver/flowcontrol.py``): per-request latency for reads,
writes and watch events, and API Priority and Fairness answered with 429 and ``Retry-After``. Every time assertion
is a lower bound (a latency is the least a request can take), never an upper one."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from dradriver.kube.client import KubeClient, RetryPolicy, open_client
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.apiserver.flowcontrol import (
    FLOW_CONTROL_ENV,
    LATENCY_ENV,
    Admission,
    FairQueues,
    FlowControlSettings,
    Latency,
    SettingsError,
    flow_control_from_env,
    latency_from_env,
    parse_flow_control,
    parse_latency,
)


def _configmap(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v"}}


def _official(api: ApiServerEmulator, tmp_path: Path) -> kubernetes.client.CoreV1Api:
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=api.kubeconfig_path(tmp_path), client_configuration=config)
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    emulator = ApiServerEmulator(latency=Latency()).start()
    try:
        yield emulator
    finally:
        emulator.stop()


def _timed(fn: object, *args: object, **kwargs: object) -> float:
    started = time.monotonic()
    fn(*args, **kwargs)  # type: ignore[operator]
    return time.monotonic() - started


def test_a_write_latency_makes_every_write_take_at_least_that_long(api: ApiServerEmulator, tmp_path: Path) -> None:
    core = _official(api, tmp_path)
    core.create_namespaced_config_map("default", _configmap("warm"))  # the connection is open before the clock
    api.latency = Latency(write_s=0.05)
    assert _timed(core.create_namespaced_config_map, "default", _configmap("one")) >= 0.05
    assert _timed(core.patch_namespaced_config_map, "one", "default", {"data": {"k": "w"}}) >= 0.05
    assert _timed(core.delete_namespaced_config_map, "one", "default") >= 0.05


def test_a_read_latency_makes_every_get_and_list_take_at_least_that_long(api: ApiServerEmulator,
                                                                          tmp_path: Path) -> None:
    core = _official(api, tmp_path)
    core.create_namespaced_config_map("default", _configmap("one"))
    api.latency = Latency(read_s=0.08)
    assert _timed(core.read_namespaced_config_map, "one", "default") >= 0.08
    assert _timed(core.list_namespaced_config_map, "default") >= 0.08


def test_a_watch_event_is_delivered_no_sooner_than_the_watch_latency_after_its_change(api: ApiServerEmulator,
                                                                                     tmp_path: Path) -> None:
    core = _official(api, tmp_path)
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    api.latency = Latency(watch_s=0.3)
    arrived: list[tuple[str, float]] = []

    def watch() -> None:
        w = kubernetes.watch.Watch()
        for event in w.stream(core.list_namespaced_config_map, "default", resource_version=rv, timeout_seconds=10):
            arrived.append((event["object"].metadata.name, time.monotonic()))
            w.stop()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    time.sleep(0.1)  # the watch is open (its events are not delayed before this point either way)
    stored = time.monotonic()
    api.create(_configmap("seen"))
    thread.join(15)
    assert [name for name, _ in arrived] == ["seen"]
    assert arrived[0][1] - stored >= 0.3


def _hold_the_only_seat(api: ApiServerEmulator, tmp_path: Path, seconds: float) -> threading.Thread:
    """A write that holds the one seat for ``seconds`` (its latency), from another client."""
    api.latency = Latency(write_s=seconds)
    core = _official(api, tmp_path)
    thread = threading.Thread(target=core.create_namespaced_config_map, args=("default", _configmap("slow")),
                              daemon=True)
    thread.start()
    flow = api._state.flow_control
    assert flow is not None
    deadline = time.monotonic() + 10
    while flow.busy < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert flow.busy == 1
    return thread


def test_past_the_seats_and_the_queue_a_request_is_answered_429_with_retry_after(api: ApiServerEmulator,
                                                                                tmp_path: Path) -> None:
    api.limit(FlowControlSettings(seats=1, queue_length=0, retry_after_s=1))
    holder = _hold_the_only_seat(api, tmp_path, 1.0)
    with pytest.raises(urllib.error.HTTPError) as caught:  # a bare HTTP client: nothing retries for it
        urllib.request.urlopen(f"{api.url}/api/v1/namespaces/default", timeout=10)
    assert caught.value.code == 429 and caught.value.headers["Retry-After"] == "1"
    status = json.loads(caught.value.read())
    assert (status["reason"], status["details"]["retryAfterSeconds"]) == ("TooManyRequests", 1)
    holder.join(10)
    assert api.rejected == 1 and api.count(code=429) == 1


def test_the_official_client_retries_a_429_after_its_retry_after(api: ApiServerEmulator, tmp_path: Path) -> None:
    api.limit(FlowControlSettings(seats=1, queue_length=0, retry_after_s=1))
    core = _official(api, tmp_path)
    core.read_namespace("default")  # the connection is open before the clock
    holder = _hold_the_only_seat(api, tmp_path, 0.5)
    started = time.monotonic()
    assert core.read_namespace("default").metadata.name == "default"  # urllib3's default Retry honours it
    assert time.monotonic() - started >= 1.0
    holder.join(10)
    codes = [r.code for r in api.requests if r.resource == "namespaces"]
    assert codes[0] == 200 and codes[-1] == 200 and set(codes[1:-1]) == {429}  # 429s (one unless the machine
    # stalled past the seat's 0.5 s), each retried


def test_a_request_that_finds_the_seats_taken_waits_in_its_flow_queue_and_is_served(api: ApiServerEmulator,
                                                                                   tmp_path: Path) -> None:
    api.limit(FlowControlSettings(seats=1, queue_length=5))
    holder = _hold_the_only_seat(api, tmp_path, 0.4)
    assert _official(api, tmp_path).read_namespace("default").metadata.name == "default"
    holder.join(10)
    assert api.rejected == 0 and api.count(code=429) == 0
    served = [r.resource for r in api.requests]
    assert served.index("configmaps") < served.index("namespaces")  # it was served after the seat was handed on


def test_our_kube_client_retries_a_429_after_its_retry_after(api: ApiServerEmulator, tmp_path: Path) -> None:
    api.limit(FlowControlSettings(seats=1, queue_length=0, retry_after_s=1))
    client: KubeClient = open_client(api.kubeconfig_path(tmp_path), user_agent="ours",
                                     retry=RetryPolicy(attempts=5, initial_delay_s=0.01, max_delay_s=5.0))
    try:
        client.call("GET /version", kubernetes.client.VersionApi(client.api_client).get_code)  # connection open
        holder = _hold_the_only_seat(api, tmp_path, 0.5)
        started = time.monotonic()
        node = client.call("GET namespaces/default", client.core.read_namespace, "default")
        waited = time.monotonic() - started
        holder.join(10)
    finally:
        client.close()
    assert node["metadata"]["name"] == "default"
    codes = [r.code for r in api.requests if r.user_agent == "ours" and r.resource == "namespaces"]
    assert codes[-1] == 200 and set(codes[:-1]) == {429}
    assert waited >= 1.0  # the Retry-After, not the policy's 10 ms first delay


def test_fair_queues_hand_freed_seats_to_the_waiting_flows_in_turn() -> None:
    queues = FairQueues(FlowControlSettings(seats=1, queue_length=2))
    assert queues.admit("a")[0] == Admission.RUN
    verdicts = [queues.admit(flow) for flow in ("a", "a", "b")]
    assert [v for v, _ in verdicts] == [Admission.QUEUED] * 3
    assert queues.admit("a")[0] == Admission.REJECTED  # flow a has 2 waiting: its queue is full
    assert queues.admit("b")[0] == Admission.QUEUED  # b's queue is not
    order = []
    while (waiter := queues.release()) is not None:
        order.append(waiter.flow)
    assert order == ["a", "b", "a", "b"]  # round robin, not first come first served
    assert queues.busy == 0 and queues.rejected == 1


def test_a_queued_request_that_waits_too_long_is_rejected_unless_a_seat_reached_it() -> None:
    queues = FairQueues(FlowControlSettings(seats=1, queue_length=5))
    queues.admit("a")
    _, late = queues.admit("b")
    _, served = queues.admit("c")
    assert late is not None and served is not None
    assert queues.expire(late) is True and queues.waiting == 1
    assert queues.release() is served and queues.expire(served) is False
    assert queues.rejected == 1


def test_the_emulator_adds_nothing_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LATENCY_ENV, raising=False)
    monkeypatch.delenv(FLOW_CONTROL_ENV, raising=False)
    emulator = ApiServerEmulator()
    assert emulator.latency.off and emulator._state.flow_control is None


def test_the_sandbox_environment_sets_latency_and_flow_control(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LATENCY_ENV, "read=10ms, write=0.03s,watch=5ms")
    monkeypatch.setenv(FLOW_CONTROL_ENV, "seats=3,queue=7,wait=2s")
    emulator = ApiServerEmulator()
    assert emulator.latency == Latency(read_s=0.01, write_s=0.03, watch_s=0.005)
    flow = emulator._state.flow_control
    assert flow is not None and flow.settings == FlowControlSettings(seats=3, queue_length=7, queue_wait_s=2.0)
    assert latency_from_env({}) == Latency() and flow_control_from_env({}) is None


@pytest.mark.parametrize(("parse", "text", "words"), [
    (parse_latency, "write=fast", "write='fast' is not a duration"),
    (parse_latency, "delete=1ms", "'delete=1ms' is not one of read=..., write=..., watch=..."),
    (parse_flow_control, "seats=0", "seats must be at least 1"),
    (parse_flow_control, "queue=x", "invalid literal"),
])
def test_a_setting_that_cannot_be_read_is_an_error_naming_it(parse: object, text: str, words: str) -> None:
    with pytest.raises(SettingsError, match=words) as caught:
        parse(text)  # type: ignore[operator]
    assert "DRADRIVER_APISERVER_" in str(caught.value)


def test_dradriver_sandbox_flags_set_the_emulators_latency_and_flow_control(monkeypatch: pytest.MonkeyPatch) -> None:
    from dradriver.commands.sandbox import api_cost_error

    monkeypatch.setenv(LATENCY_ENV, "")  # restored after the test, whatever the flags write
    monkeypatch.setenv(FLOW_CONTROL_ENV, "")
    args = argparse.Namespace(api_latency="write=30ms", api_flow_control="seats=4")
    assert api_cost_error(args) == ""
    emulator = ApiServerEmulator()  # as SandboxNode builds it
    assert emulator.latency == Latency(write_s=0.03)
    assert emulator._state.flow_control is not None and emulator._state.flow_control.settings.seats == 4


def test_dradriver_sandbox_refuses_an_unreadable_api_latency_up_front() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "sandbox", "--api-latency", "write=soon"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("dradriver sandbox: error: --api-latency: write='soon' is not a duration "
                                   "(e.g. 30ms, 1.5s)")
