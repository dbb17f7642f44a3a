"""KEP-5517 node-allocatable overhead published by the real plugin: the ``NodeAllocatableResources`` gate, the
``--node-allocatable-*`` flags and their environment twins, each device's ``nodeAllocatableResources`` in the
ResourceSlices the API emulator stores (validated against Kubernetes 1.37's schema and the field's own rules)."""

from __future__ import annotations

import argparse
import asyncio

import kubernetes_validate
import pytest

from dradriver import config
from dradriver.domain import featuregates as fg
from dradriver.domain import nodeallocatable as na
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import running, wait_for

GATE_ON = fg.parse_feature_gates("NodeAllocatableResources=true")


def parse(environ: dict[str, str], *argv: str) -> config.PluginConfig:
    parser = argparse.ArgumentParser()
    config.add_flags(parser, config.PLUGIN_FLAGS, environ={"NODE_NAME": "node-a", **environ})
    return config.config_from_args(parser.parse_args(list(argv)))


def test_overhead_flags_and_variables_build_the_published_field_per_device_class() -> None:
    cfg = parse({"FEATURE_GATES": "NodeAllocatableResources=true",
                 "NODE_ALLOCATABLE_GPU_MEMORY_OVERHEAD_PER_POD": "256Mi",
                 "NODE_ALLOCATABLE_GPU_CPU_OVERHEAD_PER_POD": "0"},  # zero: left out
                "--node-allocatable-gpu-memory-overhead-per-container", "64Mi",
                "--node-allocatable-mig-cpu-overhead-per-pod", "500m")
    overhead = cfg.node_allocatable_overhead
    assert overhead.field_for("gpu") == {"memory": {"overhead": {"perPod": "256Mi", "perContainer": "64Mi"}}}
    assert overhead.field_for("mig") == {"cpu": {"overhead": {"perPod": "500m"}}}
    assert parse({}).node_allocatable_overhead.field_for("gpu") is None  # the default publishes nothing


def test_nvidia_s_vfio_overhead_flags_apply_to_vfio_devices_only() -> None:
    """NVIDIA's PR #1329 has a third class, ``vfio``: its flags put the overhead on the VFIO passthrough devices
    (``type=vfio``), not on GPUs or MIG devices, and their help says so."""
    cfg = parse({"FEATURE_GATES": "NodeAllocatableResources=true",
                 "NODE_ALLOCATABLE_VFIO_CPU_OVERHEAD_PER_CONTAINER": "10m"},
                "--node-allocatable-vfio-memory-overhead-per-pod", "1Gi")
    overhead = cfg.node_allocatable_overhead
    assert overhead.field_for("vfio") == {"memory": {"overhead": {"perPod": "1Gi"}},
                                          "cpu": {"overhead": {"perContainer": "10m"}}}
    assert overhead.field_for("gpu") is None and overhead.field_for("mig") is None
    slices = [{"spec": {"devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}},
                                    {"name": "gpu-1-mig-1g.10gb-19-0", "attributes": {"type": {"string": "mig"}}},
                                    {"name": "gpu-vfio-2", "attributes": {"type": {"string": "vfio"}}}]}}]
    na.apply_overhead(slices, overhead)
    assert [d["name"] for d in slices[0]["spec"]["devices"] if na.FIELD in d] == ["gpu-vfio-2"]
    help_text = {f.option: f.help for f in config.PLUGIN_FLAGS}
    for resource in na.RESOURCES:
        for per in ("pod", "container"):
            flag = na.flag_name("vfio", resource, per)
            assert "VFIO passthrough device" in help_text[flag], flag
            assert "does not publish" not in help_text[flag], flag


def test_a_zero_overhead_with_the_gate_off_is_refused_as_nvidia_refuses_it() -> None:
    """NVIDIA counts every non-empty value as set (``0`` too) and refuses it with the gate off; an empty value is
    unset."""
    with pytest.raises(config.FlagError, match=r"--node-allocatable-gpu-cpu-overhead-per-pod .* is set but the "
                                               r"NodeAllocatableResources feature gate is off"):
        parse({"NODE_ALLOCATABLE_GPU_CPU_OVERHEAD_PER_POD": "0"})
    assert not parse({"NODE_ALLOCATABLE_GPU_CPU_OVERHEAD_PER_POD": ""}).node_allocatable_overhead


@pytest.mark.parametrize(("environ", "message"), [
    ({"NODE_ALLOCATABLE_MIG_MEMORY_OVERHEAD_PER_POD": "1Gi"},
     r"--node-allocatable-mig-memory-overhead-per-pod \(env NODE_ALLOCATABLE_MIG_MEMORY_OVERHEAD_PER_POD\) is set "
     r"but the NodeAllocatableResources feature gate is off"),
    ({"NODE_ALLOCATABLE_VFIO_MEMORY_OVERHEAD_PER_POD": "1Gi"},
     r"--node-allocatable-vfio-memory-overhead-per-pod .* is set but the NodeAllocatableResources feature gate"),
    ({"FEATURE_GATES": "NodeAllocatableResources=true", "NODE_ALLOCATABLE_GPU_CPU_OVERHEAD_PER_CONTAINER": "-1"},
     r"--node-allocatable-gpu-cpu-overhead-per-container .* is negative"),
    ({"FEATURE_GATES": "NodeAllocatableResources=true", "NODE_ALLOCATABLE_GPU_MEMORY_OVERHEAD_PER_POD": "lots"},
     r"--node-allocatable-gpu-memory-overhead-per-pod .*'lots' is not a Kubernetes quantity"),
])
def test_a_bad_overhead_value_is_refused_at_start_naming_the_flag(environ: dict[str, str], message: str) -> None:
    with pytest.raises(config.FlagError, match=message):
        parse(environ)


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)  # full GPUs and static MIG devices
def test_every_gpu_and_mig_device_publishes_its_class_overhead(sandbox: SandboxNode) -> None:
    overhead = na.parse_overhead({("gpu", "memory", "pod"): "2Gi", ("gpu", "cpu", "container"): "100m",
                                  ("mig", "memory", "pod"): "512Mi"}, gate_enabled=True)

    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config(feature_gates=GATE_ON, node_allocatable_overhead=overhead)):
            await wait_for(lambda: bool(sandbox.api and sandbox.api.objects("ResourceSlice")))
            kinds: set[str] = set()
            for obj in sandbox.api.objects("ResourceSlice"):
                kubernetes_validate.validate(obj, "1.37", strict=True)
                for device in obj["spec"]["devices"]:
                    kind = device["attributes"]["type"]["string"]
                    kinds.add(kind)
                    assert na.field_problems(device[na.FIELD]) == []
                    assert device[na.FIELD] == ({
                        "memory": {"overhead": {"perPod": "2Gi"}}, "cpu": {"overhead": {"perContainer": "100m"}}}
                        if kind == "gpu" else {"memory": {"overhead": {"perPod": "512Mi"}}})
            assert kinds == {"gpu", "mig"}

    asyncio.run(body())


def test_without_overhead_no_device_carries_the_field(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config(feature_gates=GATE_ON)):
            await wait_for(lambda: bool(sandbox.api and sandbox.api.objects("ResourceSlice")))
            devices = [d for obj in sandbox.api.objects("ResourceSlice") for d in obj["spec"]["devices"]]
            assert devices and not any(na.FIELD in d for d in devices)

    asyncio.run(body())


def test_the_overhead_round_trips_through_the_plugin_environment() -> None:
    """The sandbox (and the bench) start the plugin from a config turned back into its environment by flag dest."""
    from dradriver.sandbox.cluster import plugin_environment

    overhead = na.parse_overhead({("mig", "memory", "container"): "96Mi", ("gpu", "cpu", "pod"): "1"},
                                 gate_enabled=True)
    cfg = config.PluginConfig(node_name="node-a", feature_gates=GATE_ON, node_allocatable_overhead=overhead)
    env = plugin_environment(cfg)
    assert env["NODE_ALLOCATABLE_MIG_MEMORY_OVERHEAD_PER_CONTAINER"] == "96Mi"
    assert parse(env).node_allocatable_overhead == overhead
