"""NVIDIA's example VFIO manifests (``tests/sandbox/fixtures/vfio/``, kept unchanged; their README names the source)
applied with kubectl to a sandbox node whose PCI tree holds the profile's GPUs on ``nvidia``.

The node's pool is what the plugin publishes with ``PassthroughSupport``: discovery over the mock NVML, the VFIO
devices from the node's PCI functions (:func:`dradriver.domain.passthrough.vfio_devices`), the ResourceSlices of
:func:`dradriver.domain.pools.build_resource_slices`. The sandbox's resourceclaim controller and scheduler
(:class:`dradriver.sandbox.cluster.ClusterEmulator`, no plugin registered) then create and allocate the Pods'
claims over ``vfio.gpu.nvidia.com`` (``type == 'vfio'``).

``gpu-test-vfio-config.yaml`` as published puts its Pod in ``gpu-test-vfiopci`` and its ResourceClaimTemplate in
``gpu-test-vfio``: the Pod never gets its claim (``FailedResourceClaimCreation``, the template not found in the
Pod's namespace); with only the Pod's namespace corrected its claim is allocated, the VfioDeviceConfig with it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.domain.passthrough import vfio_devices
from dradriver.domain.pools import build_resource_slices
from dradriver.nvml.discovery import discover
from dradriver.nvml.session import open_session
from dradriver.sandbox.cluster import ClusterEmulator
from dradriver.sandbox.kubelet import KubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.sandbox.helpers import REPO, kubectl

PROFILE = "dgx-h100"
VFIO = REPO / "tests" / "sandbox" / "fixtures" / "vfio"
PLAIN = VFIO / "gpu-test-vfiopci.yaml"
CONFIG = VFIO / "gpu-test-vfio-config.yaml"


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    """A sandbox node with its PCI tree and the pool the plugin publishes with ``PassthroughSupport``."""
    with SandboxNode(profile=PROFILE, pci_tree=True) as sandbox:
        assert sandbox.api is not None
        host = sandbox.pci_host()
        with open_session("", PROFILE) as session:
            inventory = discover(session, sysfs_root=sandbox.root / "sys")
        inventory = dataclasses.replace(inventory, vfio=vfio_devices(
            host.functions(), inventory.gpus, iommufd=host.iommufd_available()))
        assert len(inventory.vfio) == 8
        for resource_slice in build_resource_slices(inventory, sandbox.node_name):
            sandbox.api.create(resource_slice)
        ClusterEmulator(sandbox, say=lambda _line: None).apply_device_classes()
        yield sandbox


def _reconcile(sandbox: SandboxNode, until: Any, passes: int = 40) -> list[str]:
    """Run the cluster's reconcile passes (no plugin registered: claims are created and allocated, not prepared)
    until ``until()`` holds or ``passes`` are done; the cluster's lines."""
    lines: list[str] = []
    cluster = ClusterEmulator(sandbox, say=lines.append)

    async def body() -> None:
        async with KubeletEmulator(sandbox.root / "registry-none") as kubelet:
            cluster._kubelet = kubelet
            for _ in range(passes):
                await cluster.reconcile()
                if until():
                    return
                await asyncio.sleep(0.05)

    asyncio.run(body())
    return lines


def _claims(sandbox: SandboxNode, namespace: str) -> list[dict[str, Any]]:
    assert sandbox.api is not None
    return [c for c in sandbox.api.objects("ResourceClaim") if c["metadata"]["namespace"] == namespace]


def _allocated(sandbox: SandboxNode, namespace: str) -> list[dict[str, Any]]:
    return [c for c in _claims(sandbox, namespace) if (c.get("status") or {}).get("allocation")]


def _apply(sandbox: SandboxNode, path: Path, text: str | None = None) -> None:
    if text is None:
        kubectl(str(sandbox.kubeconfig), "apply", "-f", str(path))
    else:
        kubectl(str(sandbox.kubeconfig), "apply", "-f", "-", stdin=text)


def test_nvidias_vfiopci_example_gets_one_vfio_device(node: SandboxNode) -> None:
    _apply(node, PLAIN)
    _reconcile(node, lambda: _allocated(node, "gpu-test-vfio"))
    (claim,) = _allocated(node, "gpu-test-vfio")
    assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "gpu"
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["request"]) == ("gpu.nvidia.com", node.node_name, "gpu")
    assert result["device"].startswith("gpu-vfio-")
    assert node.api is not None
    pod = node.api.get("Pod", "pod1", "gpu-test-vfio")
    assert pod is not None and pod["spec"].get("nodeName") == node.node_name


def test_nvidias_vfio_config_example_as_published_never_gets_its_claim(node: SandboxNode) -> None:
    _apply(node, CONFIG)
    assert node.api is not None
    reason = "FailedResourceClaimCreation"

    def events() -> list[dict[str, Any]]:
        assert node.api is not None
        return [e for e in node.api.objects("Event") if e.get("reason") == reason]

    _reconcile(node, events)
    (event,) = events()
    assert event["involvedObject"]["name"] == "pod1-full-vfioconfig"
    assert event["involvedObject"]["namespace"] == "gpu-test-vfiopci"
    assert event["message"] == ("pod gpu-test-vfiopci/pod1-full-vfioconfig: ResourceClaimTemplate "
                                "single-gpu-full-vfioconfig not found")
    assert _claims(node, "gpu-test-vfiopci") == [] and _claims(node, "gpu-test-vfio") == []
    template = node.api.get("ResourceClaimTemplate", "single-gpu-full-vfioconfig", "gpu-test-vfio")
    assert template is not None  # the template is there, in the other namespace
    pod = node.api.get("Pod", "pod1-full-vfioconfig", "gpu-test-vfiopci")
    assert pod is not None and not pod["spec"].get("nodeName")


def test_nvidias_vfio_config_example_with_the_pods_namespace_corrected_is_allocated_with_its_config(
        node: SandboxNode) -> None:
    text = CONFIG.read_text()
    assert text.count("namespace: gpu-test-vfiopci") == 1
    _apply(node, CONFIG, text.replace("namespace: gpu-test-vfiopci", "namespace: gpu-test-vfio"))
    _reconcile(node, lambda: _allocated(node, "gpu-test-vfio"))
    (claim,) = _allocated(node, "gpu-test-vfio")
    allocation = claim["status"]["allocation"]["devices"]
    (result,) = allocation["results"]
    assert result["device"].startswith("gpu-vfio-") and result["driver"] == "gpu.nvidia.com"
    (config,) = allocation["config"]
    assert config["source"] == "FromClaim" and config["requests"] == ["gpu"]
    template = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "ResourceClaimTemplate")
    assert config["opaque"] == template["spec"]["spec"]["devices"]["config"][0]["opaque"]
    assert config["opaque"]["parameters"]["iommu"] == {"backendPolicy": "LegacyOnly", "enableAPIDevice": True}
