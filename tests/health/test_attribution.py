"""Who a device's series are attributed to: the device set follows the device registry (a dynamic MIG device
created after the collectors started carries its claim, and its pod in ``dradriver exporter``), and a device
several pods use has one series per pod, as dcgm-exporter writes them; in both naming modes.

The kubelet plugin runs for real (gRPC through the kubelet emulator, the API emulator over HTTP, the mock NVML
with its MIG state file shared with the exporter process); PodResources is real gRPC on a Unix socket."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dradriver.commands.exporter import holder_lookup
from dradriver.domain import featuregates as fg
from dradriver.health.dcgm import exposition
from dradriver.health.metrics import exporter_registry
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.podresources import PodResourcesServer
from dradriver.server.podresources import encode_response
from tests.plugin.conftest import (
    claim_object,
    mig_node,  # noqa: F401 (fixture: a DGX H100 sandbox with MIG state)
    ref_of,
    result,
    running,
    set_allocation,
    wait_for,
)

from .conftest import MockNode, Services

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
GATES = fg.parse_feature_gates("DynamicMIG=true")
PLACEMENT = "gpu-0-mig-1g10gb-19-3"  # H100 1g.10gb (GI profile 19) at memory slice 3
MODES = pytest.mark.parametrize("dcgm", [False, True], ids=["dradriver-names", "dcgm-names"])
DRIVER = "gpu.nvidia.com"


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _scrape(registry: CollectorRegistry, dcgm: bool) -> dict[str, Any]:
    return _families((exposition(registry) if dcgm else generate_latest(registry)).decode())


def _memory_series(families: dict[str, Any], dcgm: bool, device: str) -> list[dict[str, str]]:
    """Label sets of the framebuffer-used series of DRA device ``device`` (a MIG device reports memory only)."""
    if dcgm:
        return [s.labels for s in families.get("DCGM_FI_DEV_FB_USED", _Empty).samples
                if s.labels.get("dra_device_name") == device]
    return [s.labels for s in families.get("dradriver_gpu_memory_used_bytes", _Empty).samples
            if s.labels["device"] == device]


class _Empty:
    samples: list[Any] = []


def _holders(dcgm: bool, labels: dict[str, str]) -> tuple[str, str, str, str]:
    """(pod, container, claim namespace, claim) of one series."""
    if dcgm:
        return (labels.get("pod", ""), labels.get("container", ""), labels["dra_claim_namespace"],
                labels["dra_claim_name"])
    return labels.get("pod", ""), labels.get("container", ""), labels["namespace"], labels["claim"]


def _claim(node: SandboxNode, name: str, device: str) -> Any:
    """A claim in ``default`` allocated ``device`` of this node, as the kubelet references it."""
    assert node.api is not None
    return ref_of(set_allocation(node, node.api.create(claim_object(name)), [result(device, pool=node.node_name)]))


@MODES
def test_a_dynamic_mig_device_created_after_start_carries_its_claim(
        mig_node: SandboxNode, dcgm: bool) -> None:  # noqa: F811 (the imported fixture)
    async def body() -> None:
        config = mig_node.config(feature_gates=GATES, dcgm_compatible=dcgm)
        async with running(config) as (plugin, kubelet):
            assert plugin.metrics is not None and not plugin.inventory.migs
            assert _memory_series(_scrape(plugin.metrics.registry, dcgm), dcgm, PLACEMENT) == []
            ref = _claim(mig_node, "one-g", PLACEMENT)
            answer = await kubelet.prepare([ref])
            assert answer[ref.uid].error == ""
            await wait_for(lambda: [m.name for m in plugin.inventory.migs] == [PLACEMENT])
            [mig] = plugin.inventory.migs
            registry = plugin.metrics.registry
            await wait_for(lambda: _memory_series(_scrape(registry, dcgm), dcgm, PLACEMENT), timeout=20)
            [series] = _memory_series(_scrape(registry, dcgm), dcgm, PLACEMENT)
            assert _holders(dcgm, series)[2:] == ("default", "one-g")
            if dcgm:
                assert (series["dra_mig_device_uuid"], series["GPU_I_ID"]) == (mig.uuid, str(mig.gi_id))
            else:
                assert series["uuid"] == mig.uuid
                families = _scrape(registry, dcgm)
                [health] = [s for s in families["dradriver_device_health"].samples
                            if s.labels["device"] == PLACEMENT and s.labels["state"] == "healthy"]
                assert (health.value, health.labels["claim"], health.labels["uuid"]) == (1.0, "one-g", mig.uuid)

    asyncio.run(body())


@MODES
def test_a_device_two_claims_hold_has_a_series_per_claim_in_the_plugin(sandbox: SandboxNode, dcgm: bool) -> None:
    async def body() -> list[dict[str, str]]:
        assert sandbox.api is not None
        async with running(sandbox.config(dcgm_compatible=dcgm)) as (plugin, kubelet):
            owner = set_allocation(sandbox, sandbox.api.create(claim_object("owner")), [result("gpu-2")])
            monitor = set_allocation(sandbox, sandbox.api.create(claim_object("monitor")),
                                     [result("gpu-2", admin=True)])  # admin access shares the device
            answer = await kubelet.prepare([ref_of(owner), ref_of(monitor)])
            assert [a.error for a in answer.values()] == ["", ""]
            assert plugin.metrics is not None
            return _memory_series(_scrape(plugin.metrics.registry, dcgm), dcgm, "gpu-2")

    series = asyncio.run(body())
    assert sorted(_holders(dcgm, labels) for labels in series) == [("", "", "default", "monitor"),
                                                                    ("", "", "default", "owner")]
    assert not any("pod" in labels for labels in series)  # the plugin knows claims, not pods


def _two_pods(device: str, pool: str) -> Any:
    """Two pods (one container each) using ``device`` through one shared claim."""
    return encode_response([
        (pod, "team-a", "cuda", "shared-gpu", "team-a", [(DRIVER, pool, device)]) for pod in ("trainer-0", "trainer-1")
    ])


@MODES
def test_a_device_two_pods_use_has_a_series_per_pod(mock_node: Any, services: Services, short_dir: Path,
                                                     dcgm: bool) -> None:
    node: MockNode = mock_node("dgx-a100")
    service = services(node)
    service.start()
    sock = short_dir / "kubelet.sock"
    with PodResourcesServer(sock, lambda: _two_pods("gpu-3", "node-a")):
        registry = exporter_registry(service, node="node-a", dcgm_compatible=dcgm, process_metrics=False,
                                     holders=holder_lookup(str(sock), "node-a", logging.getLogger("test")))
        families = _scrape(registry, dcgm)
    if dcgm:
        temps = [s.labels for s in families["DCGM_FI_DEV_GPU_TEMP"].samples if s.labels.get("dra_device_name")]
    else:
        temps = [s.labels for s in families["dradriver_gpu_temperature_celsius"].samples if s.labels["claim"]]
    assert sorted(_holders(dcgm, labels) for labels in temps) == [
        ("trainer-0", "cuda", "team-a", "shared-gpu"), ("trainer-1", "cuda", "team-a", "shared-gpu")]
    if not dcgm:  # health and Xid series too: every device series carries the same attribution
        assert sorted(s.labels["pod"] for s in families["dradriver_gpu_last_xid"].samples
                      if s.labels["device"] == "gpu-3") == ["trainer-0", "trainer-1"]
    idle = [s for s in families["DCGM_FI_DEV_GPU_TEMP" if dcgm else "dradriver_gpu_temperature_celsius"].samples
            if s.labels.get("UUID", s.labels.get("uuid")) == node.gpu_uuid(4)]
    assert len(idle) == 1  # a device nobody uses: one series


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return str(answer.read().decode())


@MODES
def test_the_exporter_attributes_a_dynamic_mig_device_to_every_pod_using_it(
        mig_node: SandboxNode, short_dir: Path, dcgm: bool) -> None:  # noqa: F811 (the imported fixture)
    sock = short_dir / "kubelet.sock"
    port = _free_port()
    served = PodResourcesServer(sock, lambda: _two_pods(PLACEMENT, mig_node.node_name)).start()
    command = [sys.executable, "-m", "dradriver", "exporter", "--mock-profile", "dgx-h100", "--node-name",
               mig_node.node_name, "--http-endpoint", f"127.0.0.1:{port}", "--poll-interval", "0.2",
               "--pod-resources-socket", str(sock), *(["--dcgm-compatible"] if dcgm else [])]
    # the exporter shares the sandbox's mock NVML state file (environment), as two processes share a node
    proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/metrics"

    async def body() -> list[dict[str, str]]:
        def serving() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                return bool(_get(url))
            except OSError:
                return False

        await wait_for(serving, timeout=30)
        assert _memory_series(_families(_get(url)), dcgm, PLACEMENT) == []
        async with running(mig_node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = _claim(mig_node, "shared-gpu", PLACEMENT)
            answer = await kubelet.prepare([ref])
            assert answer[ref.uid].error == ""
            await wait_for(lambda: _memory_series(_families(_get(url)), dcgm, PLACEMENT), timeout=20)
            return _memory_series(_families(_get(url)), dcgm, PLACEMENT)

    try:
        series = asyncio.run(body())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        served.stop()
    assert sorted(_holders(dcgm, labels) for labels in series) == [
        ("trainer-0", "cuda", "team-a", "shared-gpu"), ("trainer-1", "cuda", "team-a", "shared-gpu")]


def test_exporter_refuses_a_pod_resources_socket_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "pod-resources" / "kubelet.sock"
    not_a_socket = tmp_path / "kubelet.sock"
    not_a_socket.write_text("")
    for path, why in ((missing, "No such file or directory"), (not_a_socket, "not a Unix socket")):
        done = subprocess.run([sys.executable, "-m", "dradriver", "exporter", "--mock-profile", "l4-inference",
                               "--http-endpoint", "127.0.0.1:0", "--pod-resources-socket", str(path)],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"--pod-resources-socket {path}: {why}" in done.stderr and "Traceback" not in done.stderr


def test_exporter_without_a_node_name_attributes_the_pool_the_kubelet_lists(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    sock = short_dir / "kubelet.sock"
    log = logging.getLogger("test.exporter")
    with PodResourcesServer(sock, lambda: _two_pods("gpu-0", "sandbox-node")):
        # no --node-name: the kubelet lists only its own node's pods, whatever the pool is called
        found = holder_lookup(str(sock), None, log)()
        assert {d: sorted(h.pod for h in held) for d, held in found.items()} == {"gpu-0": ["trainer-0", "trainer-1"]}
        assert {h.pool for h in found["gpu-0"]} == {"sandbox-node"}
        # a --node-name that is not the pool (the hostname next to the sandbox): nothing matches, and it says so
        wrong = holder_lookup(str(sock), "build-host", log)
        with caplog.at_level(logging.WARNING, logger="test.exporter"):
            assert wrong() == {} and wrong() == {}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said  # once per change, not at every scrape
    assert "pool(s) sandbox-node, none of node 'build-host'" in said[0] and "--node-name" in said[0]


def test_the_exporter_keeps_a_gpu_that_falls_off_the_bus_while_following_mig_changes(mock_node: Any) -> None:
    from dradriver.commands.exporter import DeviceFollower
    from dradriver.domain.registry import DeviceRegistry

    node: MockNode = mock_node("dgx-a100")
    devices: DeviceRegistry[Any] = DeviceRegistry(node.inventory, lambda inv: {d.name: d for d in inv.allocatable()})
    follower = DeviceFollower(node.session, devices, sysfs_root=Path("/nonexistent"), interval_s=3600,
                              log=logging.getLogger("test"))
    assert follower.refresh() is False  # nothing changed: the snapshot (and the poller) stay
    lost = node.inventory.gpus[0]  # a MIG-mode GPU with MIG devices
    assert any(m.parent.uuid == lost.uuid for m in node.inventory.migs)
    node.set_lost(0, True)
    try:
        assert follower.refresh() is False  # the lost GPU and its MIG devices stay (their health series too)
    finally:
        node.set_lost(0, False)
    assert devices.snapshot is node.inventory
