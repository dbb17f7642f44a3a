"""The node's clique ID from NVML fabric info (mock NVML profiles), NVIDIA's strict and legacy rules, and what the
plugin does with them at start; plus the plugin's flags."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dradriver import config as config_module
from dradriver.app.computedomain import start_compute_domain_plugin
from dradriver.domain.devices import FabricInfo
from dradriver.domain.featuregates import CRASH_ON_NVLINK_FABRIC_ERRORS
from dradriver.errors import FlagError
from dradriver.nvml import fabric, mock
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import GB200_CLIQUE, cd_config, write_imex_proc

UUID = "abc9829a-d4c8-491c-8da5-ad28fb34876b"


def _gpu(index: int, state: int = 3, status: int = 0, cluster: str = UUID, clique: int = 2) -> fabric.GpuFabric:
    return fabric.GpuFabric(index, f"GPU-{index}", FabricInfo(cluster, clique, state, status))


def test_strict_rules() -> None:
    assert fabric.clique_id([_gpu(0), _gpu(1)]) == GB200_CLIQUE
    assert fabric.clique_id([]) == ""
    assert fabric.clique_id([fabric.GpuFabric(0, "GPU-0", None)]) == ""  # NVML: fabric info not supported
    assert fabric.clique_id([_gpu(0, state=0)]) == ""  # state NOT_SUPPORTED
    assert fabric.clique_id([_gpu(0, cluster="00000000-0000-0000-0000-000000000000", clique=0)]) == ""
    with pytest.raises(fabric.FabricError, match=r"GPU 1 \(GPU-1\): NVLink fabric registration state is "
                                                 r"IN_PROGRESS, not COMPLETED"):
        fabric.clique_id([_gpu(0), _gpu(1, state=2)])
    with pytest.raises(fabric.FabricError, match="NOT_STARTED"):
        fabric.clique_id([_gpu(0, state=1)])
    with pytest.raises(fabric.FabricError, match=r"GPU 0 \(GPU-0\): NVLink fabric status is NVML error 999"):
        fabric.clique_id([_gpu(0, status=999)])
    with pytest.raises(fabric.FabricError, match=r"disagree on the NVLink clique: GPU 0 \(GPU-0\): .*\.2; GPU 1 "
                                                 r"\(GPU-1\): .*\.3"):
        fabric.clique_id([_gpu(0), _gpu(1, clique=3)])
    with pytest.raises(fabric.FabricError, match="no clique"):
        fabric.clique_id([_gpu(0), fabric.GpuFabric(1, "GPU-1", None)])


def test_legacy_rules_skip_gpus_that_are_not_fabric_attached() -> None:
    assert fabric.clique_id([_gpu(0, state=2)], strict=False) == ""
    assert fabric.clique_id([_gpu(0, status=999)], strict=False) == ""
    with pytest.raises(fabric.FabricError, match="disagree"):
        fabric.clique_id([_gpu(0), _gpu(1, clique=3)], strict=False)


def _profile(tmp_path: Path, **fabric_fields: Any) -> str:
    """The GB200 node profile with GPU 2's fabric fields changed."""
    profile = mock.load_profile("gb200-nvl72-node")
    profile["gpus"][2]["fabric"].update(fabric_fields)
    path = tmp_path / "gb200-changed.json"
    path.write_text(json.dumps(profile))
    return str(path)


@pytest.mark.parametrize("fields, message", [
    ({"state": 2}, "GPU 2 (GPU-"),
    ({"status": 999}, "NVLink fabric status is NVML error 999"),
])
def test_fabric_not_ready_at_start_stops_the_plugin_in_strict_mode(tmp_path: Path, fields: dict[str, int],
                                                                   message: str) -> None:
    with SandboxNode(profile=_profile(tmp_path, **fields)) as node:
        write_imex_proc(node)

        async def body() -> None:
            with pytest.raises(fabric.FabricError) as caught:
                await start_compute_domain_plugin(cd_config(node))
            assert message in str(caught.value)
            if "state" in fields:
                assert "IN_PROGRESS, not COMPLETED" in str(caught.value)
            assert not (node.root / "registry" / "compute-domain.nvidia.com-reg.sock").exists()

            legacy = cd_config(node)
            legacy = replace(legacy, feature_gates=legacy.feature_gates.with_gates(
                **{CRASH_ON_NVLINK_FABRIC_ERRORS: False}))
            # legacy mode: GPU 2 is simply not fabric-attached, so the node's GPUs disagree -> still an error
            with pytest.raises(fabric.FabricError, match="disagree"):
                await start_compute_domain_plugin(legacy)

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
