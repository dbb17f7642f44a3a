"""Read-only comparison of ``dradriver inspect`` with ``nvidia-smi`` on a real NVIDIA GPU node.

Runs only with ``DRADRIVER_GPU_TESTS=1`` (the device machine); it changes nothing on the GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.domain.resourceslices import quantity_bytes
from dradriver.domain.versions import normalize_version
from tests.domain.slice_validation import assert_valid_slice

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("DRADRIVER_GPU_TESTS") != "1", reason="needs DRADRIVER_GPU_TESTS=1 and a GPU"),
]

REPO = Path(__file__).resolve().parents[2]


def _smi(*args: str) -> str:
    smi = shutil.which("nvidia-smi")
    assert smi, "nvidia-smi not on PATH"
    return subprocess.run([smi, *args], capture_output=True, text=True, check=True).stdout


def _inspect() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("DRADRIVER_MOCK_PROFILE", "DRADRIVER_NVML_LIBRARY")}
    proc = subprocess.run(
        [sys.executable, "-m", "dradriver", "inspect", "-o", "json", "--node-name", "gpu-node"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    slices = json.loads(proc.stdout)
    for s in slices:
        assert_valid_slice(s)
    return slices


def test_inspect_matches_nvidia_smi() -> None:
    rows = _smi(
        "--query-gpu=name,uuid,memory.total,pci.bus_id,driver_version,mig.mode.current",
        "--format=csv,noheader,nounits",
    )
    smi_gpus = [[c.strip() for c in line.split(",")] for line in rows.strip().splitlines()]
    header = _smi()
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", header)
    assert cuda, header
    devices = {d["attributes"]["uuid"]["string"]: d for s in _inspect() for d in s["spec"]["devices"]}
    for name, uuid, memory_mib, bus_id, driver, mig_mode in smi_gpus:
        if mig_mode == "Enabled":
            assert uuid not in devices  # published as MIG devices instead
            continue
        dev = devices[uuid]
        attrs = dev["attributes"]
        assert attrs["productName"]["string"] == name
        assert attrs["driverVersion"]["version"] == normalize_version(driver)
        assert attrs["cudaDriverVersion"]["version"] == normalize_version(cuda.group(1))
        bdf = bus_id.lower()
        if len(bdf.split(":", 1)[0]) == 8:
            bdf = bdf[4:]
        assert attrs["resource.kubernetes.io/pciBusID"]["string"] == bdf
        assert dev["capacity"]["memory"]["value"] == quantity_bytes(int(memory_mib) * 1024 * 1024)
