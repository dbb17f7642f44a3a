"""Fixtures: an API server emulator over real HTTP and the official client pointed at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.kube.client import KubeClient, RetryPolicy, open_client
from dradriver.sandbox.apiserver import ApiServerEmulator

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
#: Fast retries so fault-injection tests stay quick; the policy shape is what is under test.
FAST_RETRY = RetryPolicy(attempts=4, initial_delay_s=0.01, max_delay_s=0.05, jitter=0.0)


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator(schema_version="1.34") as server:
        server.add_node(NODE, allocatable={"cpu": "64", "memory": "512Gi", "pods": "110"})
        yield server


@pytest.fixture
def kubeconfig(api: ApiServerEmulator, tmp_path: Path) -> str:
    return api.kubeconfig_path(tmp_path)


@pytest.fixture
def client(kubeconfig: str) -> Iterator[KubeClient]:
    with open_client(kubeconfig, connect_timeout_s=2.0, read_timeout_s=10.0, retry=FAST_RETRY) as kube:
        yield kube
