"""Taints from the health service in the published ResourceSlice: HealthMonitor -> ResourceSlice builder ->
SlicePublisher -> the API server emulator over real HTTP; slices validated with kubernetes-validate."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.pools import build_resource_slices
from dradriver.health.monitor import TaintMap
from dradriver.kube.client import open_client
from dradriver.kube.resourceslices import SlicePublisher
from dradriver.sandbox.apiserver import ApiServerEmulator

from ..domain.slice_validation import assert_valid_slice
from .conftest import MockNode, Services, TaintLog

pytestmark = pytest.mark.timeout(30)


def _devices(api: ApiServerEmulator) -> dict[str, dict[str, Any]]:
    slices = [s for s in api.objects("ResourceSlice") if s["spec"]["driver"] == GPU_DRIVER.driver_name]
    for obj in slices:
        assert_valid_slice(obj)
    return {d["name"]: d for s in slices for d in s["spec"]["devices"]}


def test_xid_79_taint_is_published_and_removed(
    mock_node: Any, services: Services, tmp_path: Path
) -> None:
    node: MockNode = mock_node("dgx-a100")
    with ApiServerEmulator() as api:
        api.add_node("node-a")
        client = open_client(api.kubeconfig_path(tmp_path))
        publisher = SlicePublisher(client, driver=GPU_DRIVER.driver_name, node_name="node-a")
        publisher.publish(build_resource_slices(node.inventory, "node-a"))
        published = threading.Event()
        failures: list[BaseException] = []
        log = TaintLog()

        def publish(taints: TaintMap) -> None:  # the wiring the kubelet plugin uses, synchronously
            log(taints)
            try:
                publisher.publish(build_resource_slices(node.inventory, "node-a", taints=taints))
            except BaseException as exc:
                failures.append(exc)
            published.set()

        service = services(node, publish)
        service.start()
        node.xid(2, 79)
        log.wait_for(bool, "a taint update")
        assert published.wait(10) and not failures
        devices = _devices(api)
        assert devices["gpu-2"]["taints"][0]["key"] == "gpu.nvidia.com/xid"
        assert devices["gpu-2"]["taints"][0]["value"] == "79"
        assert devices["gpu-2"]["taints"][0]["effect"] == "NoSchedule"
        assert [name for name, d in devices.items() if d.get("taints")] == ["gpu-2"]
        assert set(devices) == {d.name for d in node.inventory.allocatable()}

        published.clear()
        service.poll_now()
        log.wait_for(lambda t: t == {}, "the taint to be removed")
        assert published.wait(10) and not failures
        assert not any(d.get("taints") for d in _devices(api).values())
        client.close()
