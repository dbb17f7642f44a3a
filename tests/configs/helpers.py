"""Devices and claims for the opaque-config tests (built by hand; no NVML)."""

from __future__ import annotations

from typing import Any

from dradriver.domain.claims import Claim, ClaimRef, claim_from_object
from dradriver.domain.devices import GpuDevice, MigDevice
from tests.factories import gpu_device, mig_device

DRIVER = "gpu.nvidia.com"
POOL = "node-a"
API = "resource.nvidia.com/v1beta1"
REF = ClaimRef("team-a", "train", "0f6c7c44-9d0a-4c59-a3d6-7a6e1f1f2a01")


def gpu(minor: int, *, cc: tuple[int, int] = (9, 0), mig: bool = False) -> GpuDevice:
    """An H100-like GPU with NVML minor ``minor``."""
    return gpu_device(
        minor, uuid=f"GPU-{minor:08d}-aaaa-bbbb-cccc-000000000000", product_name="NVIDIA H100 80GB HBM3",
        architecture="Hopper", cuda_compute_capability=cc, memory_bytes=80 * 2**30,
        pci_bus_id=f"0000:{0x10 + minor:02x}:00.0", mig_capable=True, mig_enabled=mig,
    )


def mig(parent: GpuDevice, start: int) -> MigDevice:
    """A ``1g.10gb`` MIG device (GI profile 19) at placement ``start`` of ``parent``."""
    return mig_device(
        parent, start, gi_id=9 + start, uuid=f"MIG-{parent.minor:04d}{start:04d}-aaaa-bbbb-cccc-000000000000",
        profile="1g.10gb", memory_bytes=9856 * 2**20, multiprocessors=16, decoders=1, jpeg_engines=1,
    )


GPU0, GPU1, GPU2 = gpu(0), gpu(1), gpu(2)
OLD_GPU = gpu(3, cc=(6, 1))
MIG_PARENT = gpu(4, mig=True)
MIG_A, MIG_B = mig(MIG_PARENT, 0), mig(MIG_PARENT, 1)
DEVICES: dict[str, GpuDevice | MigDevice] = {d.name: d for d in (GPU0, GPU1, GPU2, OLD_GPU, MIG_A, MIG_B)}


def params(kind: str = "GpuConfig", **fields: Any) -> dict[str, Any]:
    """An ``opaque.parameters`` object of NVIDIA's API group."""
    return {"apiVersion": API, "kind": kind, **fields}


def entry(parameters: Any, *, requests: list[str] | None = None, source: str = "FromClaim",
          driver: str = DRIVER) -> dict[str, Any]:
    """One ``status.allocation.devices.config[]`` entry."""
    out: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        out["requests"] = requests
    return out


def claim_object(results: list[tuple[str, str]], configs: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``resource.k8s.io/v1`` ResourceClaim allocated on this node: ``results`` are (request, device) pairs,
    ``configs`` the ``status.allocation.devices.config[]`` list in API order."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": REF.name, "namespace": REF.namespace, "uid": REF.uid},
        "status": {"allocation": {"devices": {
            "results": [{"request": r, "driver": DRIVER, "pool": POOL, "device": d} for r, d in results],
            "config": configs,
        }}},
    }


def claim(results: list[tuple[str, str]], configs: list[dict[str, Any]]) -> Claim:
    """The claim reduced by the real ``claim_from_object`` (class configs first, other drivers' dropped)."""
    return claim_from_object(claim_object(results, configs), REF, driver=DRIVER, pool=POOL)
