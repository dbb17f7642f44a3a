"""Helpers for tests that run discovery against the C mock ``libnvidia-ml.so.1`` (built by the setup command).

* :func:`make_sysfs` builds a sysfs fixture tree with ``bus/pci/devices/<bdf>`` links for a profile's GPUs;
* :func:`expected_pcie_root` is the root complex that tree reports for a bus ID.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dradriver.nvml import mock

BRAND_STRINGS = {2: "Tesla", 14: "Nvidia"}
"""go-nvlib brand strings for the codes the bundled profiles use (``gpu-facts.md`` 1.1)."""
ARCH_STRINGS = {6: "Turing", 7: "Ampere", 8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell", 13: "Rubin"}
"""go-nvlib architecture strings (``gpu-facts.md`` 1.1; Rubin: go-nvlib v0.12.0, NVIDIA go-nvlib PR #105)."""
ADDRESSING_MODE_STRINGS = {0: "None", 1: "HMM", 2: "ATS"}
"""``nvmlDeviceAddressingModeType_t`` (nvml.h) -> the ``addressingMode`` value NVIDIA's driver publishes
(``gpu-facts.md`` 6.1: ``HMM`` on an A100, ``None`` on an A30)."""


def dra_bus_id(nvml_bus_id: str) -> str:
    """``00000000:07:00.0`` -> ``0000:07:00.0`` (``gpu-facts.md`` 6.2), written independently of the code."""
    domain, rest = nvml_bus_id.lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def expected_pcie_root(dra_bdf: str) -> str:
    """Root complex the fixture tree puts above ``dra_bdf``: same domain, bus ``bus - 1`` (0 stays 0)."""
    domain, bus, _ = dra_bdf.split(":", 2)
    return f"pci{domain}:{max(int(bus, 16) - 1, 0):02x}"


def make_sysfs(root: Path, profile: dict[str, Any], numa: dict[str, int] | None = None) -> Path:
    """Create ``<root>/bus/pci/devices/<bdf>`` links for every GPU of ``profile``, like the kernel does:
    ``../../../devices/pci<dom>:<rootbus>/<dom>:<rootbus>:00.0/<bdf>``; ``numa`` maps bdf -> ``numa_node``
    file content. Default: the GPU's NVML ``numaNode`` (on x86 hosts the kernel and NVML agree), ``-1`` (the
    kernel's "no node") when the profile has none."""
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True, exist_ok=True)
    for gpu in mock.resolved_gpus(profile):
        bdf = dra_bus_id(gpu["pciBusId"])
        rc = expected_pcie_root(bdf)  # pci0000:06
        bridge = f"{rc[3:]}:00.0"
        target_dir = root / "devices" / rc / bridge / bdf
        target_dir.mkdir(parents=True, exist_ok=True)
        (target_dir / "numa_node").write_text(f"{(numa or {}).get(bdf, gpu.get('numaNode', -1))}\n")
        link = devices / bdf
        if not link.is_symlink():
            link.symlink_to(f"../../../devices/{rc}/{bridge}/{bdf}")
    return root


def mig_layout(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (GI, CI) of a resolved GPU as flat dicts with the GI profile merged in."""
    profiles = {p["id"]: p for p in gpu.get("gpuInstanceProfiles", [])}
    out = []
    for gi in gpu.get("gpuInstances", []):
        prof = profiles[gi["profileId"]]
        ci_profiles = {c["id"]: c for c in prof.get("computeInstanceProfiles", [])}
        for ci in gi.get("computeInstances", []):
            out.append({"gi": gi, "ci": ci, "profile": prof, "ci_profile": ci_profiles[ci["profileId"]]})
    return out
