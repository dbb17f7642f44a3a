"""Every manifest of ``deploy/examples/`` does what its header says in ``dradriver sandbox``: applied with kubectl
(strict validation against the emulator's OpenAPI) to a sandbox node of the profile and plugin settings it needs,
its claims are allocated, the real plugin prepares them and every Pod reaches ``Running``. The ComputeDomain job
spans two GB200 nodes and needs the compute-domain controller and plugin, which the one-node sandbox does not run:
it runs in the multi-node sandbox (one rack of two nodes, each with its compute-domain and GPU plugin, the
controller, the IMEX daemons; ``docs/get-started/sandbox.md``), and ``dradriver allocate`` checks its placement too
(one worker per node, each with channel 0, its node's IMEX daemon claim and four GPUs)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.app import start_plugin
from dradriver.config import PluginConfig
from dradriver.domain import computedomains as cd
from dradriver.sandbox.cluster import ClusterEmulator
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.multinode import MultiNodeCluster
from dradriver.sandbox.node import SandboxNode

from .helpers import REPO, kubectl

EXAMPLES = REPO / "deploy" / "examples"


@dataclass(frozen=True)
class Case:
    """An example and the node it needs: mock NVML profile, how the plugin is configured, MPS daemons or not."""

    file: str
    profile: str = "dgx-h100"
    gates: str = ""
    setup: str = "plain"  # plain | mps | shares | pci (the node's PCI bus emulated: VFIO passthrough)


CASES = [
    Case("gpu-40gi.yaml"),
    Case("shared-claim.yaml"),
    Case("device-plugin-pod.yaml"),
    Case("time-slicing.yaml", gates="TimeSlicingSettings=true"),
    Case("mps-claim.yaml", setup="mps"),
    Case("consumable-shares.yaml", setup="shares"),
    Case("mig-claim.yaml", profile="dgx-a100"),
    Case("dynamic-mig.yaml", profile="dgx-h200", gates="DynamicMIG=true"),
    Case("admin-access.yaml"),
    Case("vfio-passthrough.yaml", gates="PassthroughSupport=true", setup="pci"),
]


def _config(sandbox: SandboxNode, case: Case) -> PluginConfig:
    from dradriver.domain.featuregates import parse_feature_gates

    if case.setup == "mps":
        config = sandbox.mps_config(log_level="warning")
    elif case.setup == "shares":
        config = sandbox.shares_config("memory", log_level="warning")
    else:
        config = sandbox.config(log_level="warning")
    if case.gates:
        config = sandbox.config(log_level="warning", feature_gates=config.feature_gates.with_gates(
            **parse_feature_gates(case.gates).explicit))
    return config


def _phases(sandbox: SandboxNode, pods: list[tuple[str, str]]) -> dict[str, str]:
    assert sandbox.api is not None
    return {f"{ns}/{name}": str(((sandbox.api.get("Pod", name, ns) or {}).get("status") or {}).get("phase", ""))
            for ns, name in pods}


def test_every_example_is_checked() -> None:
    assert {c.file for c in CASES} | {"compute-domain-job.yaml"} == {p.name for p in EXAMPLES.glob("*.yaml")}


@pytest.mark.parametrize("case", CASES, ids=[c.file.removesuffix(".yaml") for c in CASES])
def test_example_runs_in_the_sandbox(case: Case) -> None:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / case.file).read_text()) if d]
    pods = [(d["metadata"].get("namespace", "default"), d["metadata"]["name"]) for d in docs if d["kind"] == "Pod"]
    assert pods
    lines: list[str] = []
    with SandboxNode(profile=case.profile, pci_tree=case.setup == "pci") as sandbox:
        assert sandbox.api is not None
        if case.setup in ("mps", "shares"):
            sandbox.run_workloads()
        cluster = ClusterEmulator(sandbox, say=lines.append)
        cluster.apply_device_classes()

        async def body() -> dict[str, str]:
            plugin = await start_plugin(_config(sandbox, case))
            try:
                async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                    cluster._kubelet = kubelet
                    loop = asyncio.get_running_loop()
                    while not sandbox.api.objects("ResourceSlice"):  # type: ignore[union-attr]
                        await asyncio.sleep(0.05)
                    await asyncio.to_thread(kubectl, str(sandbox.kubeconfig), "apply", "-f",
                                            str(EXAMPLES / case.file))
                    deadline = loop.time() + 60
                    while set(_phases(sandbox, pods).values()) != {"Running"} and loop.time() < deadline:
                        await cluster.reconcile()
                        await asyncio.sleep(0.05)
                    return _phases(sandbox, pods)
            finally:
                await plugin.stop()

        phases = asyncio.run(body())
    assert set(phases.values()) == {"Running"}, (phases, lines)


def test_compute_domain_job_allocates_one_worker_per_node(tmp_path: Path) -> None:
    inputs = [str(REPO / "deploy" / "kustomize" / "base" / "deviceclasses.yaml")]
    for node in ("gb-a", "gb-b"):
        for driver in ("gpu.nvidia.com", "compute-domain.nvidia.com"):
            out = subprocess.run([sys.executable, "-m", "dradriver", "inspect", "--mock-profile", "gb200-nvl72-node",
                                  "--node-name", node, "--driver", driver], capture_output=True, text=True,
                                 check=True).stdout
            path = tmp_path / f"{node}-{driver}.yaml"
            path.write_text(out)
            inputs.append(str(path))
    proc = subprocess.run([sys.executable, "-m", "dradriver", "allocate", *inputs,
                           str(EXAMPLES / "compute-domain-job.yaml"), "-o", "json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    items: list[dict[str, Any]] = json.loads(proc.stdout)["items"]
    nodes = {o["metadata"]["name"]: o["spec"]["nodeName"] for o in items if o["kind"] == "Pod"}
    assert nodes == {"nvbandwidth-worker-0": "gb-a", "nvbandwidth-worker-1": "gb-b"}
    devices = {(r["pool"], r["device"]) for o in items if o["kind"] == "ResourceClaim"
               for r in o["status"]["allocation"]["devices"]["results"]}
    for node in ("gb-a", "gb-b"):
        assert {(node, "channel-0"), (node, "daemon-0")} | {(node, f"gpu-{i}") for i in range(4)} <= devices


@pytest.mark.slow
def test_compute_domain_job_runs_one_worker_per_node_with_its_channel_and_four_gpus() -> None:
    example = EXAMPLES / "compute-domain-job.yaml"
    workers = [d["metadata"]["name"] for d in yaml.safe_load_all(example.read_text()) if d and d["kind"] == "Pod"]
    with MultiNodeCluster((2,), time_scale=0.1, interval_s=0.05) as cluster:
        cluster.install_compute_domains()
        cluster.start_plugins(timeout_s=120)
        cluster.start_gpu_plugins(timeout_s=120)
        cluster.start_controller()
        cluster.wait_for("every node's GPUs published", lambda: {
            s["spec"]["nodeName"] for s in cluster.api.objects("ResourceSlice")
            if s["spec"]["driver"] == "gpu.nvidia.com" and s["spec"].get("devices")} == set(cluster.nodes),
            timeout_s=60)
        kubectl(cluster.kubeconfig, "apply", "-f", str(example))
        for worker in workers:
            cluster.wait_for(f"{worker} running", lambda worker=worker: cluster.pod_running(worker), timeout_s=120)
        cluster.wait_for("the domain Ready", lambda: ((cluster.api.get(cd.COMPUTE_DOMAIN_KIND, "nvbandwidth-domain",
                                                                       "default") or {}).get("status") or {})
                         .get("status") == cd.STATUS_READY, timeout_s=120)
        placed = {}
        for worker in workers:
            node = cluster.pod_node(worker)
            assert node is not None
            placed[worker] = node.name
            paths = node.pod_devices[f"default/{worker}"].device_paths()
            assert "/dev/nvidia-caps-imex-channels/channel0" in paths, paths
            assert sorted(p for p in paths if p.removeprefix("/dev/nvidia").isdigit()) == [
                f"/dev/nvidia{i}" for i in range(4)], paths
        assert sorted(placed.values()) == sorted(cluster.nodes)  # one worker per node (each takes its four GPUs)
