"""The node's clique ID from NVML fabric info (mock NVML profiles), NVIDIA's strict and legacy rules, and what the
plugin does with them at start; plus the plugin's flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dradriver import config as config_module
from dradriver.app.computedomain import run_compute_domain_plugin, start_compute_domain_plugin
from dradriver.domain.claims import ClaimRef
from dradriver.domain.computedomains import NODE_CLIQUE_LABEL
from dradriver.domain.devices import FabricInfo
from dradriver.domain.featuregates import CRASH_ON_NVLINK_FABRIC_ERRORS
from dradriver.errors import FlagError
from dradriver.nvml import fabric, mock
from dradriver.preparers.mps import Backoff
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    GB200_CLIQUE,
    cd_config,
    seed_claim,
    seed_domain,
    wait_for,
    write_imex_proc,
)

UUID = "abc9829a-d4c8-491c-8da5-ad28fb34876b"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def node_clique_label(api: ApiServerEmulator, node: str = "gpu-node-1") -> str | None:
    obj = api.get("Node", node)
    assert obj is not None
    return ((obj.get("metadata") or {}).get("labels") or {}).get(NODE_CLIQUE_LABEL)


def _gpu(index: int, state: int = 3, status: int = 0, cluster: str = UUID, clique: int = 2) -> fabric.GpuFabric:
    return fabric.GpuFabric(index, f"GPU-{index}", FabricInfo(cluster, clique, state, status))


def test_strict_rules() -> None:
    assert fabric.clique_id([_gpu(0), _gpu(1)]) == GB200_CLIQUE
    assert fabric.clique_id([]) == ""
    assert fabric.clique_id([fabric.GpuFabric(0, "GPU-0", None)]) == ""  # NVML: fabric info not supported
    assert fabric.clique_id([_gpu(0, state=0)]) == ""  # state NOT_SUPPORTED
    assert fabric.clique_id([_gpu(0, cluster="00000000-0000-0000-0000-000000000000", clique=0)]) == ""
    with pytest.raises(fabric.FabricPendingError, match=r"GPU 1 \(GPU-1\): NVLink fabric registration state is "
                                                        r"IN_PROGRESS, not COMPLETED"):
        fabric.clique_id([_gpu(0), _gpu(1, state=2)])
    with pytest.raises(fabric.FabricPendingError, match=r"GPU 0 \(GPU-0\): .*NOT_STARTED.*; GPU 1 \(GPU-1\): .*"
                                                        r"IN_PROGRESS"):
        fabric.clique_id([_gpu(0, state=1), _gpu(1, state=2, cluster="00000000-0000-0000-0000-000000000000")])
    with pytest.raises(fabric.FabricError, match=r"disagree on the NVLink clique: GPU 0 \(GPU-0\): .*\.2; GPU 1 "
                                                 r"\(GPU-1\): .*\.3"):
        fabric.clique_id([_gpu(0), _gpu(1, clique=3)])
    with pytest.raises(fabric.FabricError, match="no clique"):
        fabric.clique_id([_gpu(0), fabric.GpuFabric(1, "GPU-1", None)])


def test_a_failed_registration_is_a_fault_that_has_no_say_in_the_clique() -> None:
    for strict in (True, False):
        node = fabric.assess_node([_gpu(0), _gpu(1, status=999), _gpu(2)], strict=strict)
        assert node.clique_id == GB200_CLIQUE and not node.healthy and node.reason == "registration-failed"
        assert node.message == "GPU 1 (GPU-1): NVLink fabric registration failed (status: NVML error 999)"
        assert fabric.assess_node([_gpu(0, status=999)], strict=strict).clique_id == ""


def test_an_unhealthy_fabric_keeps_its_clique_and_is_a_fault() -> None:
    sick = fabric.GpuFabric(1, "GPU-1", FabricInfo(UUID, 2, 3, 0, health_mask=0x19A, health_summary=2))
    node = fabric.assess_node([_gpu(0), sick])
    assert node.clique_id == GB200_CLIQUE and node.reason == "unhealthy"
    assert node.message == ("GPU 1 (GPU-1): NVLink fabric health summary UNHEALTHY (health mask 0x19a: route "
                            "unhealthy)")
    assert fabric.assess_node([_gpu(0), _gpu(1)]).healthy


def test_legacy_rules_skip_gpus_that_are_not_fabric_attached() -> None:
    assert fabric.clique_id([_gpu(0, state=2)], strict=False) == ""
    assert fabric.clique_id([_gpu(0, status=999)], strict=False) == ""
    with pytest.raises(fabric.FabricError, match="disagree"):
        fabric.clique_id([_gpu(0), _gpu(1, clique=3)], strict=False)
    # GPU 1 still registering while GPU 0 is registered: a passing disagreement, waited out as in strict mode
    with pytest.raises(fabric.FabricPendingError, match=r"GPU 1 \(GPU-1\): .*IN_PROGRESS"):
        fabric.clique_id([_gpu(0), _gpu(1, state=2)], strict=False)


def _profile(tmp_path: Path, gpus: tuple[int, ...] = (2,), **fabric_fields: Any) -> str:
    """The GB200 node profile with the fabric fields of ``gpus`` changed."""
    profile = mock.load_profile("gb200-nvl72-node")
    for gpu in gpus:
        profile["gpus"][gpu]["fabric"].update(fabric_fields)
    path = tmp_path / "gb200-changed.json"
    path.write_text(json.dumps(profile))
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _probe(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=5)
        return int(reply.status)


def _nvml(node: SandboxNode, *commands: str) -> None:
    """Change the node's NVML state as the fabric manager would (the mock's control file, read at every call)."""
    with node.nvml_control.open("a") as control:
        control.writelines(f"{command}\n" for command in commands)


def _events(node: SandboxNode, reason: str) -> list[dict[str, Any]]:
    assert node.api is not None
    return [e for e in node.api.objects("Event") if e.get("reason") == reason]


FAST = Backoff(initial_s=0.05, max_s=0.2, jitter=0.0)


def test_plugin_waits_not_ready_for_fabric_registration_then_starts_by_itself(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # GPU 2 of a GB200 tray is still registering with the fabric manager (NVML: no cluster UUID, no clique yet)
    with SandboxNode(profile=_profile(tmp_path, state=2)) as node:
        write_imex_proc(node)
        port = _free_port()
        config = cd_config(node, healthcheck_port=port, gpu_clique_label_enabled=True)
        registration = config.registration_socket

        async def body() -> None:
            starting = asyncio.create_task(start_compute_domain_plugin(config, fabric_wait=FAST))
            await wait_for(lambda: registration.exists() and bool(_events(node, "FabricRegistrationPending")))
            await asyncio.sleep(0.5)  # several reads with the back-off
            assert not starting.done()
            assert await _probe(port, "readiness") == NOT_SERVING
            assert await _probe(port, "liveness") == SERVING  # the startupProbe passes: no restart meanwhile
            [event] = _events(node, "FabricRegistrationPending")  # one Event while the state stays the same
            assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "Node"
            assert "GPU 2 (GPU-" in event["message"] and "IN_PROGRESS" in event["message"]
            waits = [m for m in (r.getMessage() for r in caplog.records) if "waiting for NVLink fabric" in m]
            assert len(waits) >= 3 and all("IN_PROGRESS" in m for m in waits)
            assert node.api is not None and not node.api.objects("ResourceSlice")
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                connection = await kubelet.wait_for_plugin(config.driver_name, timeout=10)
                # Unprepares are served during the wait (from the claim state), prepares refused with the reason
                ref = ClaimRef(namespace="default", name="early", uid="5f0c3f5e-0000-4000-8000-000000000001")
                assert await asyncio.wait_for(connection.unprepare([ref]), 10) == {ref.uid: ""}
                assert node.api is not None
                waiting = seed_claim(node.api, "waiting", seed_domain(node.api))
                error = (await asyncio.wait_for(connection.prepare([waiting]), 10))[waiting.uid].error
                assert waiting.uid in error and "waiting for NVLink fabric registration (GPU 2 (GPU-" in error, error
            _nvml(node, "set 2 fabric.state 1")  # back to NOT_STARTED: a new state, a new Event
            await wait_for(lambda: len(_events(node, "FabricRegistrationPending")) == 2)
            _nvml(node, "set 2 fabric.state 3")  # the fabric manager is done: the plugin goes on by itself
            plugin = await asyncio.wait_for(starting, timeout=30)
            try:
                assert plugin.clique_id == GB200_CLIQUE and node_clique_label(node.api) == GB200_CLIQUE
                await wait_for(lambda: plugin.publisher.in_sync, timeout=30)
                assert await _probe(port, "readiness") == SERVING
                slices = node.api.objects("ResourceSlice")
                assert slices and all("taints" not in d for s in slices for d in s["spec"]["devices"])
            finally:
                await plugin.stop()
            assert not registration.exists()

        with caplog.at_level(logging.INFO, logger="dradriver.app.computedomain"):
            asyncio.run(body())


ZERO_CLUSTER = "00000000-0000-0000-0000-000000000000"


def test_an_h100_node_registering_with_a_zero_cluster_uuid_waits_then_starts_in_no_clique(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An HGX H100 node's fabric manager registers the GPUs with the all-zero cluster UUID (NVSwitch, no
    multi-node NVLink): while it is IN_PROGRESS the plugin waits, not ready, as for a GB200 tray still
    registering; once COMPLETED the zero UUID means no clique, and the plugin starts by itself without a clique
    label (NVIDIA's plugin exits 1 and crash-loops meanwhile, NVIDIA's #1264)."""
    profile = mock.load_profile("dgx-h100")
    for gpu in profile["gpus"]:
        gpu["fabric"] = {"clusterUuid": ZERO_CLUSTER, "cliqueId": 0, "state": 2, "status": 0}
    path = tmp_path / "dgx-h100-registering.json"
    path.write_text(json.dumps(profile))
    with SandboxNode(profile=str(path)) as node:
        write_imex_proc(node)
        port = _free_port()
        config = cd_config(node, healthcheck_port=port, gpu_clique_label_enabled=True)
        assert node.api is not None
        api = node.api

        async def body() -> None:
            starting = asyncio.create_task(start_compute_domain_plugin(config, fabric_wait=FAST))
            await wait_for(lambda: bool(_events(node, "FabricRegistrationPending")))
            assert not starting.done()
            assert await _probe(port, "readiness") == NOT_SERVING
            assert await _probe(port, "liveness") == SERVING
            [event] = _events(node, "FabricRegistrationPending")
            assert "GPU 0 (GPU-" in event["message"] and "IN_PROGRESS" in event["message"]
            assert not api.objects("ResourceSlice") and node_clique_label(api) is None
            _nvml(node, *(f"set {g} fabric.state 3" for g in range(8)))  # registered, with the zero cluster UUID
            plugin = await asyncio.wait_for(starting, timeout=30)
            try:
                assert plugin.clique_id == "" and plugin.node_fabric.healthy
                await wait_for(lambda: plugin.publisher.in_sync, timeout=30)
                assert await _probe(port, "readiness") == SERVING
                assert node_clique_label(api) is None  # in no clique: no nvidia.com/gpu.clique label
                assert api.objects("ResourceSlice")
            finally:
                await plugin.stop()
            waits = [m for m in (r.getMessage() for r in caplog.records) if "waiting for NVLink fabric" in m]
            assert waits and "GPU 7 (GPU-" in waits[0] and all("IN_PROGRESS" in m for m in waits)

        with caplog.at_level(logging.INFO, logger="dradriver.app.computedomain"):
            asyncio.run(body())


def test_stop_while_waiting_for_fabric_registration_leaves_nothing_running(tmp_path: Path) -> None:
    with SandboxNode(profile=_profile(tmp_path, state=2)) as node:
        write_imex_proc(node)
        config = cd_config(node)  # legacy mode too: GPU 2 registering makes the GPUs disagree, for now
        config = replace(config, feature_gates=config.feature_gates.with_gates(
            **{CRASH_ON_NVLINK_FABRIC_ERRORS: False}))

        async def body() -> None:
            stop = asyncio.Event()
            running = asyncio.create_task(run_compute_domain_plugin(config, stop))
            await wait_for(lambda: config.registration_socket.exists())
            stop.set()
            await asyncio.wait_for(running, timeout=10)
            assert not config.registration_socket.exists() and not config.dra_socket.exists()

        asyncio.run(body())


def test_faulty_fabric_taints_the_compute_domain_devices_and_is_reported(tmp_path: Path) -> None:
    # every GPU's registration failed (state COMPLETED, status NVML_ERROR_UNKNOWN): NVIDIA's plugin exits
    with SandboxNode(profile="gb200-nvl72-fabric-failed") as node:
        write_imex_proc(node)
        api = node.api
        assert api is not None

        def taints() -> list[list[dict[str, str]]]:
            return [d.get("taints", []) for s in api.objects("ResourceSlice") for d in s["spec"]["devices"]]

        async def body() -> None:
            plugin = await start_compute_domain_plugin(cd_config(node, gpu_clique_label_enabled=True))
            try:
                await wait_for(lambda: plugin.publisher.in_sync, timeout=30)
                assert plugin.clique_id == "" and plugin.node_fabric.reason == "registration-failed"
                failed = {"key": "compute-domain.nvidia.com/fabric-unhealthy", "value": "registration-failed",
                          "effect": "NoSchedule"}
                assert taints() and all(t == [failed] for t in taints())  # channel-0 and daemon-0
                [event] = _events(node, "FabricUnhealthy")
                assert "GPU 0 (GPU-" in event["message"] and "NVML error 999" in event["message"]
                # the fabric manager registers the GPUs after all: healthy, in the clique, untainted
                _nvml(node, *(f"set {g} fabric.status 0" for g in range(4)))
                await asyncio.to_thread(plugin.check_fabric)
                assert plugin.clique_id == GB200_CLIQUE
                await wait_for(lambda: plugin.publisher.in_sync and all(t == [] for t in taints()), timeout=30)
                assert [e["type"] for e in _events(node, "FabricHealthy")] == ["Normal"]
                assert node_clique_label(api) == GB200_CLIQUE
                # then GPU 1's fabric turns UNHEALTHY (route unhealthy): the clique stays, the devices are tainted
                _nvml(node, "set 1 fabric.healthSummary 2", "set 1 fabric.healthMask 410")
                await asyncio.to_thread(plugin.check_fabric)
                assert plugin.clique_id == GB200_CLIQUE and node_clique_label(api) == GB200_CLIQUE
                await wait_for(lambda: plugin.publisher.in_sync and all(
                    [t["value"] for t in ts] == ["unhealthy"] for ts in taints()), timeout=30)
                [_, event] = _events(node, "FabricUnhealthy")
                assert "GPU 1 (GPU-" in event["message"] and "route unhealthy" in event["message"]
            finally:
                await plugin.stop()

        asyncio.run(body())


def _args(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config_module.add_flags(parser, config_module.COMPUTE_DOMAIN_PLUGIN_FLAGS, environ=environ or {})
    return parser.parse_args(argv)


def test_flags_and_env_twins() -> None:
    cfg = config_module.compute_domain_config_from_args(_args(["--node-name", "n1"], {
        "GPU_CLIQUE_LABEL_ENABLED": "true", "IMEX_HOST_SOCKET_PATH": "/run/imex.sock", "NAMESPACE": "nvidia"}))
    assert cfg.driver_name == "compute-domain.nvidia.com"
    assert cfg.gpu_clique_label_enabled and cfg.imex_host_socket_path == "/run/imex.sock"
    assert cfg.imex_mode == "driverManaged" and cfg.imex_isolation == "domain" and cfg.namespace == "nvidia"
    assert cfg.plugin_dir.name == "compute-domain.nvidia.com"
    with pytest.raises(FlagError) as refused:
        config_module.compute_domain_config_from_args(_args(["--node-name", "n1", "--imex-isolation", "channel"]))
    assert str(refused.value) == config_module.CHANNEL_NEEDS_HOST_MANAGED
    assert "a second domain would need a second IMEX daemon on the same node" in str(refused.value)
    with pytest.raises(FlagError, match="needs the feature gate HostManagedIMEXDaemon"):
        config_module.compute_domain_config_from_args(_args(["--node-name", "n1", "--imex-mode", "hostManaged"]))
    host = config_module.compute_domain_config_from_args(_args(
        ["--node-name", "n1", "--imex-mode", "hostManaged", "--feature-gates", "HostManagedIMEXDaemon=true"]))
    assert host.imex_mode == "hostManaged"
    isolated = config_module.compute_domain_config_from_args(_args(
        ["--node-name", "n1", "--feature-gates", "HostManagedIMEXDaemon=true"],
        {"IMEX_MODE": "hostManaged", "IMEX_ISOLATION": "channel"}))
    assert (isolated.imex_mode, isolated.imex_isolation) == ("hostManaged", "channel")
    with pytest.raises(FlagError, match="ComputeDomainCliques"):
        config_module.compute_domain_config_from_args(_args(["--node-name", "n1", "--feature-gates",
                                                             "ComputeDomainCliques=false"]))
    options = {f.option for f in config_module.COMPUTE_DOMAIN_PLUGIN_FLAGS}
    assert "--consumable-shares" not in options and "--healthcheck-port" in options
