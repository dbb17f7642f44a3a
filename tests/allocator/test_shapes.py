"""Selectors evaluated once per device shape (:mod:`dradriver.allocator.shapes`) give exactly what the per-device
evaluator gives: the same allocations and the same ``explain`` text, over every mock profile's ResourceSlices (with
and without dynamic MIG placements) and selectors that read capacities, attributes, whole domains, the driver,
names a device does not publish, and the device in ways not resolved statically."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.allocator import simulation
from dradriver.allocator.expression import Selector
from dradriver.allocator.shapes import ShapeCache
from dradriver.domain.pools import build_resource_slices
from dradriver.nvml import discovery, mock
from dradriver.nvml.session import open_session
from tests.nvml.mockenv import make_sysfs

FIXTURES = Path(__file__).resolve().parent / "fixtures"

SELECTORS = [
    ("gpu.nvidia.com", "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"),
    ("gpu.nvidia.com", "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('500Gi')) >= 0"),
    ("gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H')"),
    ("gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].index == 0"),
    ("gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].productNam == 'x' || "
                       "device.capacity['gpu.nvidia.com'].memry.compareTo(quantity('1Gi')) > 0"),
    ("gpu.nvidia.com", "device.driver == 'gpu.nvidia.com' && "
                       "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('560.0.0'))"),
    ("gpu.nvidia.com", "'pcieRoot' in device.attributes['resource.kubernetes.io']"),
    ("gpu.nvidia.com", "device.attributes['resource.kubernetes.io'].pciBusID.endsWith('0')"),
    ("gpu.nvidia.com", "device.attributes[device.driver].architecture == 'Hopper'"),
    ("gpu.nvidia.com", "!device.allowMultipleAllocations && device.attributes['gpu.nvidia.com'].uuid == 'GPU-x'"),
    ("gpu.nvidia.com", "device.capacity['gpu.nvidia.com'].memory"),
    ("mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"),
    ("mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile.startsWith('3g') && "
                       "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('20Gi')) > 0"),
    ("mig.nvidia.com", "device.attributes['gpu.nvidia.com'].parentUUID.size() > 0"),
]
"""(DeviceClass, request selector): matches, rejections with the value seen, run-time errors of missing names
(one retired, typos with a close match), a non-bool result, and ``device.attributes[device.driver]`` (a computed
key: evaluated per device)."""


def _slices(profile: str, tmp_path: Path, dynamic_mig: bool, nodes: int) -> list[dict[str, Any]]:
    sysfs = make_sysfs(tmp_path / "sys", mock.load_profile(profile))
    session = open_session(mock_profile=profile)
    try:
        inventory = discovery.discover(session, sysfs_root=sysfs, dynamic_mig=dynamic_mig)
    finally:
        session.close()
    out = []
    for i in range(nodes):
        for index, item in enumerate(build_resource_slices(inventory, f"node-{i}", server_version=(1, 35))):
            item = copy.deepcopy(item)
            item["metadata"] = {"name": f"node-{i}-{index}"}
            out.append(item)
    return out


def _claims() -> list[dict[str, Any]]:
    claims = []
    for n, (device_class, expression) in enumerate(SELECTORS):
        for mode, count in (("ExactCount", 1), ("ExactCount", 9)):
            claims.append({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": f"c{n}-{count}", "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "r", "exactly": {
                    "deviceClassName": device_class, "allocationMode": mode, "count": count,
                    "selectors": [{"cel": {"expression": expression}}]}}]}},
            })
    return claims


def _texts(slices: list[dict[str, Any]]) -> list[str]:
    return [(FIXTURES / "deviceclasses.yaml").read_text(), json.dumps({"kind": "List", "apiVersion": "v1",
                                                                      "items": slices + _claims()})]


PROFILES = [p for p in mock.profile_names() if p != "synthetic-large"]
QUICK_DYNAMIC_MIG = "a100-80gb-node"
"""The profile whose dynamic MIG placements the default run checks (the others are ``slow``: 100-200 placements a
node, evaluated per device for the comparison)."""


@pytest.mark.parametrize(
    ("profile", "dynamic_mig"),
    [(p, False) for p in PROFILES]
    + [pytest.param(p, True, id=f"{p}-dynamic-mig", marks=() if p == QUICK_DYNAMIC_MIG else pytest.mark.slow)
       for p in PROFILES],
)
def test_per_shape_evaluation_gives_the_per_device_results_and_text(profile: str, dynamic_mig: bool,
                                                                     tmp_path: Path) -> None:
    texts = _texts(_slices(profile, tmp_path, dynamic_mig, nodes=2 if dynamic_mig else 4))
    per_device = simulation.load(texts)
    per_shape = simulation.load(texts)
    assert simulation.simulate(per_shape).claims == simulation.simulate(per_device, per_shape=False).claims
    shaped, shaped_code = simulation.explain(simulation.load(texts))
    plain, plain_code = simulation.explain(simulation.load(texts), per_shape=False)
    assert shaped.splitlines() == plain.splitlines()
    assert shaped_code == plain_code
    if not dynamic_mig and "pool node-3" in shaped:  # node-3 publishes devices; claims that fit took earlier ones
        assert "does not publish" in shaped and "rejected by request selector #1" in shaped


def test_selectors_are_evaluated_once_per_device_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """50 DGX H100 nodes (400 GPUs of one model) and a claim that fits nowhere: the memory selector runs once per
    distinct memory value, not once per GPU; a selector with a computed key still runs on every GPU."""
    calls: dict[str, int] = {}
    evaluate = Selector.evaluate

    def counting(self: Selector, device: Any) -> Any:
        calls[self.expression] = calls.get(self.expression, 0) + 1
        return evaluate(self, device)

    monkeypatch.setattr(Selector, "evaluate", counting)
    slices = _slices("dgx-h100", tmp_path, False, nodes=50)
    huge = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('500Gi')) >= 0"
    computed = "device.attributes[device.driver].architecture == 'Ampere'"
    claims = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
               "metadata": {"name": name, "namespace": "default"},
               "spec": {"devices": {"requests": [{"name": "r", "exactly": {
                   "deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": expression}}]}}]}}}
              for name, expression in (("huge", huge), ("computed", computed))]
    inputs = simulation.load([(FIXTURES / "deviceclasses.yaml").read_text(),
                              yaml.safe_dump_all([*slices, *claims])])
    text, code = simulation.explain(inputs)
    assert code == 1
    assert text.count("rejected by request selector #1: memory 81559Mi < 500Gi") == 400
    assert calls[huge] == 1
    assert calls[computed] == 400
    assert ShapeCache(enabled=False).enabled is False
