"""Documents users hand the simulator that are not what it reads, each refused with what to use instead.

Two families reach ``dradriver allocate``/``explain`` from older set-ups:

* a **mig-parted config** (NVIDIA/mig-parted's ``config.yaml``: ``version: v1`` and ``mig-configs:``, no
  ``apiVersion``/``kind``): not a Kubernetes object at all. With a DRA driver the MIG layout is no longer a
  node-wide config applied before the pods come: static MIG devices are published as they are found, and with
  the ``DynamicMIG`` gate the placement a claim gets is created at prepare.
* **classic DRA** kinds of NVIDIA's first DRA driver (API group ``gpu.resource.nvidia.com/v1alpha1``:
  ``GpuClaimParameters``, ``MigDeviceClaimParameters``, ``ComputeInstanceClaimParameters``,
  ``DeviceClassParameters``, and ``nas.gpu.resource.nvidia.com`` ``NodeAllocationState``, NVIDIA/k8s-dra-driver
  before v25.3): parameters of classic DRA, which Kubernetes removed in 1.31 (KEP-3063 withdrawn in favour of
  structured parameters, KEP-4381). The ``resource.k8s.io/v1alpha2`` kinds of classic DRA are refused by
  :mod:`.conversion`.

Each refusal is one sentence: what the document is, then what to write instead.
"""

from __future__ import annotations

from typing import Any

from dradriver.allocator.conversion import as_mapping

CLASSIC_NVIDIA_GROUPS = ("gpu.resource.nvidia.com", "nas.gpu.resource.nvidia.com")
"""API groups of NVIDIA's classic-DRA driver (its parameter CRDs and per-node allocation state)."""

CLASSIC_NVIDIA_REPLACEMENTS = {
    "GpuClaimParameters": "a ResourceClaim of DeviceClass gpu.nvidia.com, with the sharing settings in an "
    "opaque GpuConfig (spec.devices.config[].opaque, driver gpu.nvidia.com)",
    "MigDeviceClaimParameters": "a ResourceClaim of DeviceClass mig.nvidia.com selecting the profile "
    "(device.attributes['gpu.nvidia.com'].profile == '1g.10gb'), sharing settings in an opaque MigDeviceConfig",
    "ComputeInstanceClaimParameters": "a ResourceClaim of DeviceClass mig.nvidia.com selecting the profile; "
    "compute instances inside one GPU instance are not allocated separately any more",
    "DeviceClassParameters": "a DeviceClass (resource.k8s.io/v1) with CEL selectors; NVIDIA's chart installs "
    "gpu.nvidia.com, mig.nvidia.com and the ComputeDomain classes",
    "GpuClassParameters": "a DeviceClass (resource.k8s.io/v1) with CEL selectors",
    "NodeAllocationState": "nothing: ResourceSlices published by the kubelet plugin replace the per-node "
    "allocation state (dradriver inspect prints them)",
}
"""NVIDIA's classic-DRA kinds and what replaces each with a structured-parameters driver."""

MIG_PARTED = (
    "a mig-parted config (NVIDIA/mig-parted), not a Kubernetes object: with dradriver, MIG devices are not laid "
    "out by a node-wide config before pods come; existing MIG devices are published as devices of DeviceClass "
    "mig.nvidia.com, and with the DynamicMIG feature gate the plugin creates the placement each claim is "
    "allocated at prepare: write a ResourceClaim selecting the profile (see docs/user-guide/mig.md)"
)


def refusal(obj: dict[str, Any]) -> str | None:
    """Why ``obj`` is refused (one sentence naming what to use instead), or ``None`` if it is not one of the
    documents this module knows.

    :param obj: one parsed YAML/JSON document (a mapping).
    """
    if "kind" not in obj and "apiVersion" not in obj and "mig-configs" in obj:
        return f"version {obj.get('version', '<none>')}: {MIG_PARTED}"
    group = str(obj.get("apiVersion", "")).partition("/")[0]
    if group not in CLASSIC_NVIDIA_GROUPS:
        return None
    kind = str(obj.get("kind") or "<no kind>")
    meta = as_mapping(obj.get("metadata"))
    name = str(meta.get("name", "<unnamed>"))
    if meta.get("namespace"):
        name = f"{meta['namespace']}/{name}"
    instead = CLASSIC_NVIDIA_REPLACEMENTS.get(kind, "a resource.k8s.io/v1 ResourceClaim and DeviceClass")
    return (f"{obj.get('apiVersion')} {kind} {name}: NVIDIA's classic-DRA parameters (classic DRA was removed "
            f"in Kubernetes 1.31): use {instead}")
