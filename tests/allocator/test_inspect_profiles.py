"""The seed's selector against ``dradriver inspect --mock-profile X`` output, for every bundled mock profile.

The expected set is computed without CEL: every full GPU (``type: gpu``) whose ``capacity.memory`` is at least
40Gi. Needs the mock NVML library built by the setup command (``python -m pip install -e '.[test]'``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dradriver.allocator.quantity import Quantity
from dradriver.allocator.simulation import load, simulate
from dradriver.cli import main
from dradriver.nvml import mock
from tests.nvml.mockenv import make_sysfs

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SEED = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
CLAIM = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "big-gpu", "namespace": "default"},
    "spec": {
        "devices": {
            "requests": [
                {
                    "name": "gpu",
                    "exactly": {
                        "deviceClassName": "gpu.nvidia.com",
                        "allocationMode": "All",
                        "selectors": [{"cel": {"expression": SEED}}],
                    },
                }
            ]
        }
    },
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DRADRIVER_MOCK_PROFILE", "DRADRIVER_NVML_LIBRARY", "NODE_NAME", "SYSFS_ROOT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "profile",
    [pytest.param(p, marks=pytest.mark.slow) if p == "synthetic-large" else p for p in mock.profile_names()],
)
def test_seed_selector_on_inspect_output(profile: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sysfs = make_sysfs(tmp_path / "sys", mock.load_profile(profile))
    rc = main(["inspect", "--mock-profile", profile, "--node-name", "node-x", "--sysfs-root", str(sysfs)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    slices = [s for s in yaml.safe_load_all(out) if s]
    forty = Quantity.parse("40Gi")
    expected = [
        d["name"]
        for s in slices
        for d in s["spec"].get("devices") or []
        if d["attributes"]["type"]["string"] == "gpu"
        and "memory" in d.get("capacity", {})
        and Quantity.parse(str(d["capacity"]["memory"]["value"])).compare(forty) >= 0
    ]
    outcome = simulate(load([(FIXTURES / "deviceclasses.yaml").read_text(), out, yaml.safe_dump(CLAIM)]))
    if not expected:
        assert len(outcome.failures) == 1 and "0 of" in outcome.failures[0], outcome.failures
        return
    assert not outcome.failures, outcome.failures
    (claim,) = outcome.claims
    assert sorted(r["device"] for r in claim["status"]["allocation"]["devices"]["results"]) == sorted(expected)
    if profile.startswith("l4"):
        pytest.fail("an L4 (24 GB) must not satisfy the seed's 40Gi selector")
