"""``--kube-api-qps``/``--kube-api-burst``: client-go's token bucket in front of every API request."""

from __future__ import annotations

from pathlib import Path

import pytest

from dradriver.kube import client as kube_client
from dradriver.kube import ratelimit
from dradriver.sandbox.apiserver import ApiServerEmulator


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_burst_goes_at_once_then_one_token_per_interval() -> None:
    clock = FakeClock()
    bucket = ratelimit.TokenBucket(5.0, 3, clock=clock, sleep=clock.sleep)
    waits = [bucket.wait() for _ in range(5)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3] == pytest.approx(0.2) and waits[4] == pytest.approx(0.2)
    clock.now += 10.0  # idle: the bucket refills to its burst, no more
    assert [bucket.wait() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.wait() == pytest.approx(0.2)


def test_reservations_queue_in_order() -> None:
    clock = FakeClock()
    bucket = ratelimit.TokenBucket(2.0, 1, clock=clock, sleep=clock.sleep)
    assert [bucket.reserve() for _ in range(4)] == pytest.approx([0.0, 0.5, 1.0, 1.5])


def test_client_go_rules() -> None:
    assert ratelimit.rate_limiter(-1, 10) is None
    default = ratelimit.rate_limiter(0, 0)
    assert default is not None and (default.qps, default.burst) == (5.0, 10)
    custom = ratelimit.rate_limiter(50, 100)
    assert custom is not None and (custom.qps, custom.burst) == (50.0, 100)
    with pytest.raises(ValueError, match="burst -1"):
        ratelimit.rate_limiter(5, -1)
    with pytest.raises(ValueError):
        ratelimit.TokenBucket(0, 1)


def test_every_request_of_the_client_waits_for_the_limiter(tmp_path: Path) -> None:
    clock = FakeClock()
    bucket = ratelimit.TokenBucket(4.0, 2, clock=clock, sleep=clock.sleep)
    with ApiServerEmulator() as api:
        api.add_node("node-a")
        path = api.kubeconfig_path(str(tmp_path))
        with kube_client.open_client(path, rate_limit=bucket) as client:
            for _ in range(4):
                node = client.call("GET node", client.core.read_node, "node-a")
                assert node["metadata"]["name"] == "node-a"
    assert clock.slept == pytest.approx([0.25, 0.25])
    assert api.count("get", "nodes", name="node-a") == 4


def test_a_wait_past_the_callers_time_limit_is_refused_and_gives_its_token_back() -> None:
    clock = FakeClock()
    bucket = ratelimit.TokenBucket(2.0, 1, clock=clock, sleep=clock.sleep)
    assert bucket.wait(timeout_s=0.1) == 0.0  # the burst's token
    with pytest.raises(ratelimit.RateLimitTimeout, match=r"0\.50 s, longer than the 0\.10 s left"):
        bucket.wait(timeout_s=0.1)
    assert clock.slept == []  # nothing waited
    assert bucket.wait(timeout_s=1.0) == pytest.approx(0.5)  # the refused turn was handed back: next in line
