"""``dradriver inspect`` with the plugin's publication options (``--feature-gates``/``FEATURE_GATES``,
``--consumable-shares``, ``--kubernetes-version``) prints exactly the ResourceSlices the real plugin publishes with
them: the plugin runs in the sandbox (mock NVML, the API emulator over HTTP), inspect on the same node, and the
slices' specs are compared."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.cli import main
from dradriver.config import PluginConfig
from dradriver.domain import featuregates as fg
from dradriver.domain import nodeallocatable as na
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.profiles import h200_node
from tests import factories
from tests.plugin.conftest import running, wait_for

EMULATOR_VERSION = "1.34"
"""What the API emulator answers on ``GET /version`` (the plugin's slice layout follows it)."""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DRADRIVER_MOCK_PROFILE", "DRADRIVER_NVML_LIBRARY", "NODE_NAME", "SYSFS_ROOT", "FEATURE_GATES",
                 "CONSUMABLE_SHARES", *(na.env_name(*key) for key in na.FLAG_KEYS)):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SandboxNode]:
    """One MIG-capable H200 (MIG off) whose mock NVML keeps MIG state, as dynamic MIG needs."""
    with SandboxNode(profile=h200_node(tmp_path, gpus=1), mig_state=True) as sandbox:
        assert sandbox.api is not None
        sandbox.api.create(factories.DEVICE_CLASS)
        yield sandbox


def specs(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slices' specs in the order of their first device or counter set (names differ: generateName)."""
    return sorted((s["spec"] for s in slices),
                  key=lambda spec: json.dumps([*(d["name"] for d in spec.get("devices", [])),
                                               *(c["name"] for c in spec.get("sharedCounters", []))]))


def published(node: SandboxNode, config: PluginConfig) -> list[dict[str, Any]]:
    """The ResourceSlices the real plugin publishes to the API emulator with ``config``."""
    async def body() -> list[dict[str, Any]]:
        async with running(config):
            assert node.api is not None
            api = node.api
            await wait_for(lambda: bool(api.objects("ResourceSlice")))
            return list(api.objects("ResourceSlice"))
    return asyncio.run(body())


def inspected(capsys: pytest.CaptureFixture[str], node: SandboxNode, *args: str) -> list[dict[str, Any]]:
    rc = main(["inspect", "--mock-profile", node.profile, "--node-name", node.node_name, "--sysfs-root",
               str(node.root / "sys"), "--kubernetes-version", EMULATOR_VERSION, "-o", "json", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    slices: list[dict[str, Any]] = json.loads(out)
    return slices


def test_inspect_with_dynamic_mig_gate_prints_the_placements_and_counter_sets_the_plugin_publishes(
        capsys: pytest.CaptureFixture[str], node: SandboxNode) -> None:
    plugin = published(node, node.config(feature_gates=fg.parse_feature_gates("DynamicMIG=true")))
    printed = inspected(capsys, node, "--feature-gates", "DynamicMIG=true")
    assert specs(printed) == specs(plugin)
    [spec] = specs(printed)  # 1.34: the combined layout, one slice per GPU
    assert spec["sharedCounters"] and len(spec["devices"]) > 1
    assert any("-mig-" in d["name"] and d.get("consumesCounters") for d in spec["devices"])
    without = inspected(capsys, node)  # without the gate: the full GPU only, as before
    assert [d["name"] for s in without for d in s["spec"]["devices"]] == ["gpu-0"]


def test_inspect_reads_feature_gates_from_the_environment_twin(
        capsys: pytest.CaptureFixture[str], node: SandboxNode, monkeypatch: pytest.MonkeyPatch) -> None:
    by_flag = inspected(capsys, node, "--feature-gates", "DynamicMIG=true")
    monkeypatch.setenv("FEATURE_GATES", "DynamicMIG=true")
    assert inspected(capsys, node) == by_flag


def test_inspect_with_consumable_shares_prints_the_shareable_devices_the_plugin_publishes(
        capsys: pytest.CaptureFixture[str], node: SandboxNode, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = published(node, node.shares_config("memory"))
    monkeypatch.setenv("FEATURE_GATES", "ConsumableShares=true")
    printed = inspected(capsys, node, "--consumable-shares", "memory")
    assert specs(printed) == specs(plugin)
    [device] = printed[0]["spec"]["devices"]
    assert device["allowMultipleAllocations"] is True
    assert "requestPolicy" in device["capacity"]["memory"]


def test_inspect_prints_the_split_layout_for_newer_api_servers_by_default(
        capsys: pytest.CaptureFixture[str], node: SandboxNode) -> None:
    rc = main(["inspect", "--mock-profile", node.profile, "--node-name", node.node_name, "--sysfs-root",
               str(node.root / "sys"), "--feature-gates", "DynamicMIG=true", "-o", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    slices = json.loads(out)
    assert len(slices) == 2  # 1.35: the counter set alone, then the devices that consume it
    assert [bool(s["spec"].get("sharedCounters")) for s in slices] == [True, False]


def test_inspect_with_node_allocatable_overhead_prints_the_field_the_plugin_publishes(
        capsys: pytest.CaptureFixture[str], node: SandboxNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """KEP-5517: the plugin's ``--node-allocatable-*`` flags (and environment twins) give inspect's devices the
    ``nodeAllocatableResources`` the plugin publishes, and the YAML header names the overhead."""
    gates = "NodeAllocatableResources=true"
    overhead = na.parse_overhead({("gpu", "memory", "pod"): "2Gi", ("gpu", "cpu", "container"): "100m"},
                                 gate_enabled=True)
    plugin = published(node, node.config(feature_gates=fg.parse_feature_gates(gates),
                                         node_allocatable_overhead=overhead))
    monkeypatch.setenv("NODE_ALLOCATABLE_GPU_CPU_OVERHEAD_PER_CONTAINER", "100m")
    printed = inspected(capsys, node, "--feature-gates", gates, "--node-allocatable-gpu-memory-overhead-per-pod",
                        "2Gi")
    assert specs(printed) == specs(plugin)
    [device] = printed[0]["spec"]["devices"]
    assert device[na.FIELD] == {"memory": {"overhead": {"perPod": "2Gi"}},
                                "cpu": {"overhead": {"perContainer": "100m"}}}
    rc = main(["inspect", "--mock-profile", node.profile, "--node-name", node.node_name, "--feature-gates", gates])
    out, _ = capsys.readouterr()
    assert rc == 0 and "# node-allocatable overhead (KEP-5517): gpu cpu perContainer=100m\n" in out  # YAML
    monkeypatch.delenv("NODE_ALLOCATABLE_GPU_CPU_OVERHEAD_PER_CONTAINER")
    rc = main(["inspect", "--mock-profile", node.profile, "--node-allocatable-mig-cpu-overhead-per-pod", "1"])
    _, err = capsys.readouterr()  # refused as the plugin refuses it: the gate is off
    assert rc == 2 and "--node-allocatable-mig-cpu-overhead-per-pod" in err and "NodeAllocatableResources" in err


def test_inspect_refuses_what_the_plugin_refuses(capsys: pytest.CaptureFixture[str], node: SandboxNode) -> None:
    rc = main(["inspect", "--mock-profile", node.profile, "--consumable-shares", "memory"])
    _, err = capsys.readouterr()
    assert rc == 2 and "ConsumableShares" in err and "Traceback" not in err
    rc = main(["inspect", "--mock-profile", node.profile, "--feature-gates", "NoSuchGate=true"])
    _, err = capsys.readouterr()
    assert rc == 2 and "NoSuchGate" in err
    rc = main(["inspect", "--mock-profile", node.profile, "--driver", "compute-domain.nvidia.com", "--imex-mode",
               "hostManaged"])
    _, err = capsys.readouterr()
    assert rc == 2 and "HostManagedIMEXDaemon" in err
    with pytest.raises(SystemExit):
        main(["inspect", "--mock-profile", node.profile, "--kubernetes-version", "latest"])
    assert "--kubernetes-version" in capsys.readouterr().err



@pytest.mark.parametrize("profile", ["gb200-nvl72-node", "gb200-nvl72-fabric-failed"])
def test_inspect_for_the_compute_domain_driver_prints_what_its_plugin_publishes(
        capsys: pytest.CaptureFixture[str], profile: str) -> None:
    """Channel and daemon devices, tainted while the fabric is faulty: what the compute-domain plugin publishes."""
    from dradriver.app.computedomain import start_compute_domain_plugin
    from tests.computedomain.cdplugin_helpers import cd_config, write_imex_proc

    with SandboxNode(profile=profile) as sandbox:
        write_imex_proc(sandbox)
        api = sandbox.api
        assert api is not None

        async def body() -> list[dict[str, Any]]:
            plugin = await start_compute_domain_plugin(cd_config(sandbox))
            try:
                await wait_for(lambda: plugin.publisher.in_sync, timeout=30)
                return list(api.objects("ResourceSlice"))
            finally:
                await plugin.stop()

        published_slices = asyncio.run(body())
        printed = inspected(capsys, sandbox, "--driver", "compute-domain.nvidia.com")
    assert specs(printed) == specs(published_slices)
    devices = printed[0]["spec"]["devices"]
    assert [d["name"] for d in devices] == ["channel-0", "daemon-0"]
    assert bool(devices[0].get("taints")) == (profile == "gb200-nvl72-fabric-failed")


def test_inspect_for_a_pre_warmed_plugin_with_binding_conditions_prints_every_channel_it_publishes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--imex-mode preWarmed`` (channel isolation implied) and ``--binding-conditions``: every channel of the
    node's ``ImexChannelCount``, each with KEP-5007's conditions, and the daemon device: what the plugin publishes."""
    from dradriver.app.computedomain import start_compute_domain_plugin
    from dradriver.domain import computedomains as cd
    from tests.computedomain.cdplugin_helpers import cd_config, write_imex_proc

    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox, channels=16)
        api = sandbox.api
        assert api is not None
        config = cd_config(sandbox, imex_mode="preWarmed", imex_isolation="channel", gpu_clique_label_enabled=True,
                           binding_conditions=True)

        async def body() -> list[dict[str, Any]]:
            plugin = await start_compute_domain_plugin(config)
            try:
                await wait_for(lambda: plugin.publisher.in_sync, timeout=30)
                return list(api.objects("ResourceSlice"))
            finally:
                await plugin.stop()

        published_slices = asyncio.run(body())
        printed = inspected(capsys, sandbox, "--driver", "compute-domain.nvidia.com", "--imex-mode", "preWarmed",
                            "--binding-conditions", "--proc-root", str(config.proc_root))
        assert specs(printed) == specs(published_slices)
        devices = printed[0]["spec"]["devices"]
        assert [d["name"] for d in devices] == [*(f"channel-{n}" for n in range(16)), "daemon-0"]
        assert devices[3]["bindingConditions"] == [cd.BINDING_CONDITION] and devices[3]["bindsToNode"] is True
        assert "bindingConditions" not in devices[-1]
        rc = main(["inspect", "--mock-profile", sandbox.profile, "--driver", "compute-domain.nvidia.com",
                   "--imex-isolation", "channel"])
        _, err = capsys.readouterr()
        assert rc == 2 and "IMEX_ISOLATION" in err and "hostManaged" in err  # refused as the plugin refuses it
