"""NVIDIA's example VFIO manifests (``tests/sandbox/fixtures/vfio/``, kept unchanged; their README names the source)
applied with kubectl to a sandbox node whose PCI tree holds the profile's GPUs on ``nvidia`` (the PCI bus stand-in
serving it, the mock NVML listing only the GPUs bound to ``nvidia``).

The real plugin runs with ``PassthroughSupport`` and publishes its pool; the sandbox's resourceclaim controller,
scheduler and kubelet (:class:`dradriver.sandbox.cluster.ClusterEmulator` with the kubelet emulator) create and
allocate the Pods' claims over ``vfio.gpu.nvidia.com`` (``type == 'vfio'``) and have the plugin prepare them over
gRPC: the GPU ends up on ``vfio-pci``, the claim's CDI spec gives ``/dev/vfio/<group>`` (and ``/dev/vfio/vfio``
with the config's ``enableAPIDevice``); the Pod deleted, the GPU is back on ``nvidia``.

``gpu-test-vfio-config.yaml`` as published puts its Pod in ``gpu-test-vfiopci`` and its ResourceClaimTemplate in
``gpu-test-vfio``: the Pod never gets its claim (``FailedResourceClaimCreation``, the template not found in the
Pod's namespace); with only the Pod's namespace corrected it is allocated and prepared."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.app import start_plugin
from dradriver.domain import featuregates as fg
from dradriver.sandbox.cluster import ClusterEmulator
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.sandbox.helpers import REPO, kubectl

PROFILE = "dgx-h100"
GATES = fg.parse_feature_gates("PassthroughSupport=true")
VFIO = REPO / "tests" / "sandbox" / "fixtures" / "vfio"
PLAIN = VFIO / "gpu-test-vfiopci.yaml"
CONFIG = VFIO / "gpu-test-vfio-config.yaml"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile=PROFILE, pci_tree=True) as sandbox:
        assert sandbox.api is not None
        ClusterEmulator(sandbox, say=lambda _line: None).apply_device_classes()
        yield sandbox


def _apply(sandbox: SandboxNode, path: Path, text: str | None = None) -> None:
    if text is None:
        kubectl(str(sandbox.kubeconfig), "apply", "-f", str(path))
    else:
        kubectl(str(sandbox.kubeconfig), "apply", "-f", "-", stdin=text)


def _run(sandbox: SandboxNode, steps: list[tuple[Callable[[], None], Callable[[], Any]]]) -> list[str]:
    """Start the plugin (``PassthroughSupport``) and the sandbox's cluster; for each ``(action, until)`` run the
    action, then reconcile until ``until()`` holds (60 s at most); the cluster's lines."""
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)

    async def body() -> None:
        plugin = await start_plugin(sandbox.config(log_level="warning", feature_gates=GATES))
        try:
            async with KubeletEmulator(sandbox.config().kubelet_registrar_directory_path) as kubelet:
                cluster._kubelet = kubelet
                loop = asyncio.get_running_loop()
                while not any(d["name"].startswith("gpu-vfio-") for d in _devices(sandbox)):
                    await asyncio.sleep(0.05)
                for action, until in steps:
                    await asyncio.to_thread(action)
                    deadline = loop.time() + 60
                    while not until() and loop.time() < deadline:
                        await cluster.reconcile()
                        await asyncio.sleep(0.05)
                    assert until(), lines
        finally:
            await plugin.stop()

    asyncio.run(body())
    return lines


def _devices(sandbox: SandboxNode) -> list[dict[str, Any]]:
    assert sandbox.api is not None
    return [d for s in sandbox.api.objects("ResourceSlice") for d in s["spec"].get("devices", [])]


def _claims(sandbox: SandboxNode, namespace: str) -> list[dict[str, Any]]:
    assert sandbox.api is not None
    return [c for c in sandbox.api.objects("ResourceClaim") if c["metadata"]["namespace"] == namespace]


def _running(sandbox: SandboxNode, namespace: str, name: str) -> bool:
    assert sandbox.api is not None
    pod = sandbox.api.get("Pod", name, namespace) or {}
    return bool((pod.get("status") or {}).get("phase") == "Running")


def _gone(sandbox: SandboxNode, namespace: str) -> bool:
    return not _claims(sandbox, namespace)


def _delete(sandbox: SandboxNode, namespace: str, name: str) -> Callable[[], None]:
    return lambda: kubectl(str(sandbox.kubeconfig), "delete", "pod", "-n", namespace, name, "--wait=false")


class Prepared:
    """What a prepared VFIO claim gave: its device, the GPU's address and IOMMU group, the CDI spec's nodes."""

    def __init__(self, sandbox: SandboxNode, namespace: str) -> None:
        (claim,) = _claims(sandbox, namespace)
        allocation = claim["status"]["allocation"]["devices"]
        (result,) = allocation["results"]
        self.allocation = allocation
        self.device = result["device"]
        assert (result["driver"], result["pool"], result["request"]) == ("gpu.nvidia.com", sandbox.node_name, "gpu")
        (entry,) = [d for d in _devices(sandbox) if d["name"] == self.device]
        self.address = entry["attributes"][PCI_BUS_ID]["string"]
        function = sandbox.pci_host().function(self.address)
        self.driver = function.driver
        self.group = function.iommu_group
        (spec_path,) = [p for p in sandbox.cdi_specs() if claim["metadata"]["uid"] in p.name]
        spec = json.loads(spec_path.read_text())
        self.env = spec.get("containerEdits", {}).get("env", [])
        self.nodes = [n["path"] for n in spec.get("containerEdits", {}).get("deviceNodes", [])] + [
            n["path"] for d in spec["devices"] for n in d.get("containerEdits", {}).get("deviceNodes", [])]


def test_nvidias_vfiopci_example_gets_its_gpu_on_vfio_pci_and_gives_it_back(node: SandboxNode) -> None:
    seen: list[Prepared] = []

    def record() -> None:
        seen.append(Prepared(node, "gpu-test-vfio"))

    _run(node, [(lambda: _apply(node, PLAIN), lambda: _running(node, "gpu-test-vfio", "pod1")),
                (record, lambda: True),
                (_delete(node, "gpu-test-vfio", "pod1"), lambda: _gone(node, "gpu-test-vfio"))])
    (prepared,) = seen
    assert prepared.device.startswith("gpu-vfio-")
    assert prepared.driver == "vfio-pci"
    assert prepared.nodes == [f"/dev/vfio/{prepared.group}"]  # LegacyOnly, no API device: the defaults
    assert prepared.env == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert node.pci_host().function(prepared.address).driver == "nvidia"  # given back once the pod is gone


def test_nvidias_vfio_config_example_as_published_never_gets_its_claim(node: SandboxNode) -> None:
    reason = "FailedResourceClaimCreation"

    def events() -> list[dict[str, Any]]:
        assert node.api is not None
        return [e for e in node.api.objects("Event") if e.get("reason") == reason]

    _run(node, [(lambda: _apply(node, CONFIG), events)])
    (event,) = events()
    assert event["involvedObject"]["name"] == "pod1-full-vfioconfig"
    assert event["involvedObject"]["namespace"] == "gpu-test-vfiopci"
    assert event["message"] == ("pod gpu-test-vfiopci/pod1-full-vfioconfig: ResourceClaimTemplate "
                                "single-gpu-full-vfioconfig not found")
    assert _claims(node, "gpu-test-vfiopci") == [] and _claims(node, "gpu-test-vfio") == []
    assert node.api is not None
    assert node.api.get("ResourceClaimTemplate", "single-gpu-full-vfioconfig", "gpu-test-vfio") is not None
    pod = node.api.get("Pod", "pod1-full-vfioconfig", "gpu-test-vfiopci")
    assert pod is not None and not pod["spec"].get("nodeName")
    assert {node.pci_host().function(f.address).driver for f in node.pci_host().gpus()} == {"nvidia"}


def test_nvidias_vfio_config_example_with_the_pods_namespace_corrected_is_prepared_with_the_api_device(
        node: SandboxNode) -> None:
    text = CONFIG.read_text()
    assert text.count("namespace: gpu-test-vfiopci") == 1
    seen: list[Prepared] = []
    _run(node, [(lambda: _apply(node, CONFIG, text.replace("namespace: gpu-test-vfiopci", "namespace: gpu-test-vfio")),
                 lambda: _running(node, "gpu-test-vfio", "pod1-full-vfioconfig")),
                (lambda: seen.append(Prepared(node, "gpu-test-vfio")), lambda: True)])
    (prepared,) = seen
    assert prepared.device.startswith("gpu-vfio-") and prepared.driver == "vfio-pci"
    assert sorted(prepared.nodes) == sorted([f"/dev/vfio/{prepared.group}", "/dev/vfio/vfio"])
    assert prepared.env == ["NVIDIA_VISIBLE_DEVICES=void"]
    (config,) = prepared.allocation["config"]
    template = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "ResourceClaimTemplate")
    assert config["source"] == "FromClaim" and config["requests"] == ["gpu"]
    assert config["opaque"] == template["spec"]["spec"]["devices"]["config"][0]["opaque"]
