"""``dradriver sandbox``'s control plane as ``kubectl`` sees it: a pod whose claim cannot be allocated is
reported once per change of its reason (line, ``PodScheduled=False`` condition, ``FailedScheduling`` Event in
kube-scheduler's words), and once devices appear it is scheduled (``Scheduled`` Event, condition True)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import yaml

from dradriver.sandbox.cluster import UNSCHEDULABLE_MESSAGE, ClusterEmulator, claim_generate_name
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode

from .helpers import REPO, kubectl, published_slices

EXAMPLE = [d for d in yaml.safe_load_all((REPO / "deploy" / "examples" / "gpu-40gi.yaml").read_text()) if d]


def _passes(cluster: ClusterEmulator, n: int) -> None:
    async def body() -> None:
        async with KubeletEmulator(cluster.sandbox.config().kubelet_registrar_directory_path) as kubelet:
            cluster._kubelet = kubelet
            for _ in range(n):
                await cluster.reconcile()

    asyncio.run(body())


def _events(sandbox: SandboxNode, reason: str) -> list[dict[str, Any]]:
    assert sandbox.api is not None
    return [e for e in sandbox.api.objects("Event") if e.get("reason") == reason]


def _condition(sandbox: SandboxNode, name: str) -> dict[str, Any]:
    assert sandbox.api is not None
    pod = sandbox.api.get("Pod", name, "default")
    assert pod is not None
    return next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")


def _claim_name(sandbox: SandboxNode, pod_name: str) -> str:
    """The name the resourceclaim controller generated for the pod's one template claim (its status says it)."""
    assert sandbox.api is not None
    pod = sandbox.api.get("Pod", pod_name, "default")
    assert pod is not None
    [status] = pod["status"]["resourceClaimStatuses"]
    return str(status["resourceClaimName"])


def test_generated_claim_names_follow_the_resourceclaim_controller() -> None:
    assert claim_generate_name("dra-gpu-pod", "gpu") == "dra-gpu-pod-gpu-"
    long_pod = "p" * 60
    base = claim_generate_name(long_pod, "gpu")  # 65 > 57: both cut in proportion, 60*57//65 and 3*57//65
    assert base == "p" * 52 + "-" + "gp" and len(base) + 5 <= 63


def test_pending_pod_is_reported_once_per_change(sandbox: SandboxNode, capsys: pytest.CaptureFixture[str]) -> None:
    assert sandbox.api is not None
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)
    for obj in EXAMPLE:
        sandbox.api.create(copy.deepcopy(obj))
    _passes(cluster, 12)  # no ResourceSlice yet: nothing can be allocated
    pending = [line for line in lines if "pending" in line]
    assert len(pending) == 1, lines
    claim_name = _claim_name(sandbox, "dra-gpu-pod")
    assert f"scheduler: pod default/dra-gpu-pod pending: cannot allocate claim default/{claim_name}" in pending[0]
    [event] = _events(sandbox, "FailedScheduling")
    assert event["type"] == "Warning" and event["message"] == UNSCHEDULABLE_MESSAGE
    assert event["source"]["component"] == "default-scheduler"
    assert event["involvedObject"]["name"] == "dra-gpu-pod"
    condition = _condition(sandbox, "dra-gpu-pod")
    assert (condition["status"], condition["reason"], condition["message"]) == ("False", "Unschedulable",
                                                                                 UNSCHEDULABLE_MESSAGE)
    [row] = kubectl(str(sandbox.kubeconfig), "get", "pods", "--no-headers").stdout.splitlines()
    assert row.split()[:3] == ["dra-gpu-pod", "0/1", "Unschedulable"]

    for s in published_slices(capsys, "dgx-h100", sandbox.node_name):  # the plugin published its devices
        sandbox.api.create(s)
    _passes(cluster, 5)
    assert len([line for line in lines if "pending" in line]) == 1, lines
    assert any(line.startswith("scheduler: pod default/dra-gpu-pod -> node") for line in lines), lines
    [scheduled] = _events(sandbox, "Scheduled")
    assert scheduled["message"] == f"Successfully assigned default/dra-gpu-pod to {sandbox.node_name}"
    assert _condition(sandbox, "dra-gpu-pod")["status"] == "True"
    claim = sandbox.api.get("ResourceClaim", claim_name, "default")
    assert claim is not None and claim["status"]["allocation"]["devices"]["results"]
    assert len(_events(sandbox, "FailedScheduling")) == 1


def test_missing_template_is_the_resourceclaim_controllers_warning(sandbox: SandboxNode) -> None:
    assert sandbox.api is not None
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)
    pod = copy.deepcopy(next(d for d in EXAMPLE if d["kind"] == "Pod"))
    sandbox.api.create(pod)
    _passes(cluster, 6)
    assert len([line for line in lines if "pending" in line]) == 1, lines
    [event] = _events(sandbox, "FailedResourceClaimCreation")
    assert "ResourceClaimTemplate big-gpu not found" in event["message"]
    assert event["source"]["component"] == "resourceclaim-controller"
    assert len(_events(sandbox, "FailedScheduling")) == 1


def test_plugin_environment_round_trips_through_the_plugins_flags(sandbox: SandboxNode) -> None:
    from dataclasses import replace

    from dradriver import config
    from dradriver.domain.featuregates import parse_feature_gates
    from dradriver.sandbox.cluster import plugin_environment

    gates = parse_feature_gates("TimeSlicingSettings=false,ContextualLogging=true,", where="test")
    env = plugin_environment(replace(sandbox.config(), feature_gates=gates))
    assert sorted(env["FEATURE_GATES"].split(",")) == ["ContextualLogging=true", "TimeSlicingSettings=false"]
    import argparse

    parser = argparse.ArgumentParser()
    config.add_flags(parser, environ=env)
    loaded = config.config_from_args(parser.parse_args([]))
    assert loaded.feature_gates.explicit == {"TimeSlicingSettings": False, "ContextualLogging": True}
    assert loaded.node_name == sandbox.node_name and loaded.cdi_root == sandbox.config().cdi_root


def test_the_emulated_kubelet_serves_pod_resources(sandbox: SandboxNode, capsys: pytest.CaptureFixture[str]) -> None:
    from dradriver.domain.claims import ClaimRef
    from dradriver.sandbox.cluster import pod_resources_socket
    from dradriver.server.podresources import list_holders

    assert sandbox.api is not None
    cluster = ClusterEmulator(sandbox, say=lambda _line: None)
    for s in published_slices(capsys, "dgx-h100", sandbox.node_name):
        sandbox.api.create(s)
    for obj in EXAMPLE:
        sandbox.api.create(copy.deepcopy(obj))
    _passes(cluster, 2)
    claim_name = _claim_name(sandbox, "dra-gpu-pod")
    claim = sandbox.api.get("ResourceClaim", claim_name, "default")
    assert claim is not None
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    assert not list(cluster.pod_resources().pod_resources)  # nothing prepared, nothing running yet
    # what the kubelet does once the plugin prepared the claim (prepare itself is covered with a real plugin)
    cluster.prepared[claim["metadata"]["uid"]] = ClaimRef("default", claim_name, claim["metadata"]["uid"])
    pod = sandbox.api.get("Pod", "dra-gpu-pod", "default")
    assert pod is not None
    cluster._mark_running(pod)

    async def body() -> dict[str, Any]:
        stop = asyncio.Event()
        task = asyncio.create_task(cluster.run(stop, interval_s=0.05))
        try:
            for _ in range(200):
                if pod_resources_socket(sandbox).exists():
                    break
                await asyncio.sleep(0.05)
            return await asyncio.to_thread(list_holders, str(pod_resources_socket(sandbox)),
                                           driver="gpu.nvidia.com", pool=sandbox.node_name)
        finally:
            stop.set()
            await task

    found = asyncio.run(body())
    assert set(found) == {device}
    [holder] = found[device]
    assert (holder.pod, holder.namespace, holder.container, holder.claim_name) == (
        "dra-gpu-pod", "default", "cuda", claim_name)
