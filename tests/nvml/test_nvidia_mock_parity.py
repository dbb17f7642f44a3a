"""NVIDIA's own mock NVML (k8s-test-infra ``pkg/gpu/mocknvml``) through ``dradriver inspect``, one profile each.

An NVML implementation that is not ours: every GPU its profile declares is published, with the identity the
profile gives it (UUID, name, architecture, compute capability, memory, PCI bus ID, driver and CUDA versions).
Runs where NVIDIA's build sits beside the checkout (``../shared/peers/mocknvml``: ``libnvidia-ml.so.1`` and
``configs/mock-nvml-config-<profile>.yaml``); a profile whose file is not there is skipped by name (``vr200``,
NVIDIA's Rubin profile, is not in that build yet), so it runs as soon as the file appears.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.domain.versions import normalize_version
from tests.domain.slice_validation import assert_valid_slice, quantity_value

REPO = Path(__file__).resolve().parents[2]
PEER = REPO.parent / "shared" / "peers" / "mocknvml"
PROFILES = ["a100", "b200", "gb200", "gb300", "h100", "l40s", "t4", "vr200"]
ARCHITECTURES = {"turing": "Turing", "ampere": "Ampere", "ada_lovelace": "Ada Lovelace", "hopper": "Hopper",
                 "blackwell": "Blackwell", "rubin": "Rubin"}
"""NVIDIA's mock's ``architecture`` words -> go-nvlib ``GetArchitectureAsString`` (Rubin: go-nvlib v0.12.0)."""


def declared_gpus(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The profile's GPUs with ``device_defaults`` under each one's own keys (a shallow merge, as the mock does)."""
    defaults = config["device_defaults"]
    return [{**defaults, **device} for device in config["devices"]]


def inspect_with_nvidia_mock(config: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "MOCK_NVML_CONFIG": str(config), "PYTHONPATH": str(REPO)}
    for name in ("DRADRIVER_MOCK_PROFILE", "DRADRIVER_NVML_LIBRARY", "NODE_NAME", "SYSFS_ROOT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "dradriver", "inspect", "--nvml-library", str(PEER / "libnvidia-ml.so.1"),
         "--node-name", "peer-node", "-o", "json"],
        env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    slices: list[dict[str, Any]] = json.loads(proc.stdout)
    return slices


@pytest.mark.parametrize("profile", PROFILES)
def test_nvidia_mock_profile_is_published_as_it_declares(profile: str) -> None:
    config_path = PEER / "configs" / f"mock-nvml-config-{profile}.yaml"
    if not (PEER / "libnvidia-ml.so.1").is_file() or not config_path.is_file():
        pytest.skip(f"NVIDIA's mock NVML profile {profile!r} is not in {PEER}")
    config = yaml.safe_load(config_path.read_text())
    slices = inspect_with_nvidia_mock(config_path)
    for s in slices:
        assert_valid_slice(s)
    devices = {d["attributes"]["uuid"]["string"]: d for s in slices for d in s["spec"]["devices"]}
    gpus = declared_gpus(config)
    assert sorted(devices) == sorted(g["uuid"] for g in gpus)
    system = config["system"]
    for gpu in gpus:
        device = devices[gpu["uuid"]]
        attributes = device["attributes"]
        assert device["name"] == f"gpu-{gpu['minor_number']}"
        assert attributes["productName"] == {"string": gpu["name"]}
        assert attributes["architecture"] == {"string": ARCHITECTURES[gpu["architecture"]]}
        cc = gpu["compute_capability"]
        assert attributes["cudaComputeCapability"] == {"version": f"{cc['major']}.{cc['minor']}.0"}
        assert attributes["resource.kubernetes.io/pciBusID"] == {"string": gpu["pci"]["bus_id"].lower()}
        assert attributes["driverVersion"] == {"version": normalize_version(system["driver_version"])}
        assert attributes["cudaDriverVersion"] == {
            "version": f"{system['cuda_version_major']}.{system['cuda_version_minor']}.0"}
        assert quantity_value(device["capacity"]["memory"]["value"]) == gpu["memory"]["total_bytes"]
