"""Dynamic MIG ResourceSlices (partitionable devices, shared counters) built from placements NVML enumerates
through the C mock, validated against the official schema of each layout's Kubernetes version and the API
limits, and allocated by the simulator."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dradriver.allocator.simulation import explain, load, simulate
from dradriver.domain import partitions
from dradriver.domain.devices import NodeInventory
from dradriver.domain.pools import build
from dradriver.domain.resourceslices import limit_violations
from dradriver.nvml import discovery, mock
from dradriver.nvml.discovery import is_dynamic_mig_capable
from dradriver.nvml.session import NvmlSession

Session = Callable[[str], NvmlSession]
LAYOUTS = [((1, 34), "1.34.0"), ((1, 35), "1.35.0"), ((1, 36), "1.36.0")]
MIG_CLASS = Path(__file__).resolve().parents[1] / "allocator" / "fixtures" / "deviceclasses.yaml"


_INVENTORIES: dict[str, NodeInventory] = {}


def inventory(nvml: Session, profile: str, tmp_path: Path) -> NodeInventory:
    """Discovery plus placement enumeration through the mock; bundled profiles are read once per test run (the
    result is frozen data)."""
    bundled = profile in mock.profile_names()
    if bundled and profile in _INVENTORIES:
        return _INVENTORIES[profile]
    session = nvml(profile)
    inv = discovery.discover(session, sysfs_root=tmp_path / "no-sysfs", dynamic_mig=True)
    if bundled:
        _INVENTORIES[profile] = inv
    return inv


def devices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for s in slices for d in s["spec"].get("devices", ())]


def counter_sets(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c["counters"] for s in slices for c in s["spec"].get("sharedCounters", ())}


def assert_valid_pool(slices: list[dict[str, Any]], version: tuple[int, int], schema: str) -> None:
    """Schema of that Kubernetes version, per-slice limits, and pool rules: unique device and counter-set names,
    every consumed counter defined, resourceSliceCount right."""
    for s in slices:
        kubernetes_validate.validate(s, schema, strict=True)
        assert limit_violations(s, version) == [], s["spec"].get("sharedCounters", [{}])[0].get("name")
        assert s["spec"]["pool"]["resourceSliceCount"] == len(slices)
    names = [d["name"] for d in devices(slices)]
    assert len(names) == len(set(names))
    set_names = [c["name"] for s in slices for c in s["spec"].get("sharedCounters", ())]
    assert len(set_names) == len(set(set_names))
    sets = counter_sets(slices)
    for d in devices(slices):
        for consumption in d.get("consumesCounters", ()):
            assert set(consumption["counters"]) <= set(sets[consumption["counterSet"]])


def _cases() -> list[Any]:
    """Every bundled profile x every layout; the 20-GPU profile's 1.34 and 1.36 runs (seconds of schema
    validation each) are marked slow, its 1.35 run stays in the default run."""
    out = []
    for profile in mock.profile_names():
        for version, schema in LAYOUTS:
            marks = [pytest.mark.slow] if profile == "synthetic-large" and version != (1, 35) else []
            out.append(pytest.param(profile, version, schema, marks=marks, id=f"{profile}-{schema}"))
    return out


@pytest.mark.parametrize(("profile", "version", "schema"), _cases())
def test_every_mock_profile_publishes_valid_slices(mock_session: Session, tmp_path: Path, profile: str,
                                                  version: tuple[int, int], schema: str) -> None:
    inv = inventory(mock_session, profile, tmp_path)
    result = build(inv, "node-a", server_version=version)
    assert_valid_pool(result.slices, version, schema)
    assert result.warnings == []
    published = {d["name"] for d in devices(result.slices)}
    assert {p.name for p in inv.placements} <= published
    for gpu in inv.gpus:  # Hopper+: the full GPU too; Ampere in MIG mode: placements only
        offered = any(p.parent.uuid == gpu.uuid for p in inv.placements)
        if offered:
            assert (gpu.name in published) == (gpu.architecture not in ("Ampere",))


def test_h200_devices_counters_and_names(mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-h200", tmp_path)
    slices = build(inv, "node-a", server_version=(1, 35)).slices
    assert len(slices) == 9 and "devices" not in slices[0]["spec"]  # counter sets first, then one slice per GPU
    gpu0 = slices[1]["spec"]["devices"]
    assert len(gpu0) == 26  # 25 placements + the full GPU (nvidia-dra-driver-updates.md 2b)
    assert counter_sets(slices)["gpu-0-counter-set"] == {
        "multiprocessors": {"value": "132"}, "copy-engines": {"value": "8"}, "decoders": {"value": "7"},
        "encoders": {"value": "0"}, "jpeg-engines": {"value": "7"}, "ofa-engines": {"value": "1"},
        "memory": {"value": "143104Mi"}, **{f"memory-slice-{i}": {"value": "1"} for i in range(8)},
    }
    by_name = {d["name"]: d for d in gpu0}
    one = by_name["gpu-0-mig-1g18gb-19-3"]
    assert "uuid" not in one["attributes"]
    assert one["attributes"]["type"] == {"string": "mig"}
    assert one["attributes"]["profile"] == {"string": "1g.18gb"}
    assert one["attributes"]["parentUUID"] == {"string": inv.gpus[0].uuid}
    assert one["capacity"]["memory"] == {"value": "16Gi"}
    assert one["consumesCounters"] == [{"counterSet": "gpu-0-counter-set", "counters": {
        "multiprocessors": {"value": "16"}, "copy-engines": {"value": "1"}, "decoders": {"value": "1"},
        "encoders": {"value": "0"}, "jpeg-engines": {"value": "1"}, "ofa-engines": {"value": "0"},
        "memory": {"value": "16Gi"}, "memory-slice-3": {"value": "1"}}}]
    three = by_name["gpu-0-mig-3g71gb-9-4"]["consumesCounters"][0]["counters"]
    assert sorted(k for k in three if k.startswith("memory-slice")) == [f"memory-slice-{i}" for i in range(4, 8)]
    assert {"gpu-0-mig-1g18gb-me-20-0", "gpu-0-mig-1g35gb-15-6", "gpu-0-mig-2g35gb-14-4", "gpu-0-mig-4g71gb-5-0",
            "gpu-0-mig-7g141gb-0-0"} <= set(by_name)
    full = gpu0[-1]
    assert full["name"] == "gpu-0" and full["attributes"]["uuid"] == {"string": inv.gpus[0].uuid}
    assert full["consumesCounters"][0]["counters"] == counter_sets(slices)["gpu-0-counter-set"]
    assert full["capacity"]["multiprocessors"] == {"value": "132"}


def test_device_order_packs_one_gpu_first(mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-h200", tmp_path)
    names = [d["name"] for d in devices(build(inv, "node-a", server_version=(1, 34)).slices)]
    gpu0 = [n for n in names if n.startswith("gpu-0")]
    assert names[: len(gpu0)] == gpu0  # every device of GPU 0 before any of GPU 1
    assert gpu0[:7] == [f"gpu-0-mig-1g18gb-19-{s}" for s in range(6, -1, -1)]  # small first, high starts first
    assert gpu0[-2:] == ["gpu-0-mig-7g141gb-0-0", "gpu-0"]


def test_ampere_counter_set_matches_nvidias_worked_example(mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-a100", tmp_path)  # GPUs 0 and 1 in MIG mode, 2-7 MIG off
    slices = build(inv, "node-a", server_version=(1, 34)).slices
    sets = counter_sets(slices)
    assert sorted(sets) == ["gpu-0-counter-set", "gpu-1-counter-set"]
    assert sets["gpu-0-counter-set"] == {
        "multiprocessors": {"value": "98"}, "copy-engines": {"value": "7"}, "decoders": {"value": "5"},
        "encoders": {"value": "0"}, "jpeg-engines": {"value": "1"}, "ofa-engines": {"value": "1"},
        "memory": {"value": "40192Mi"}, **{f"memory-slice-{i}": {"value": "1"} for i in range(8)},
    }
    names = [d["name"] for d in devices(slices)]
    assert "gpu-0" not in names and "gpu-1" not in names  # Ampere in MIG mode: placements only
    assert [n for n in names if n.startswith("gpu-0-")] and "gpu-2" in names  # MIG off: the full GPU as today
    assert not any(n.startswith("gpu-0-mig-") and n.endswith("-2-1") for n in names)  # no static MIG names
    assert inv.migs  # the existing instances are not published as static MIG devices (no MIG- uuid anywhere)
    assert not any(d["attributes"].get("uuid", {}).get("string", "").startswith("MIG-") for d in devices(slices))
    gpu2 = next(d for d in devices(slices) if d["name"] == "gpu-2")
    assert "consumesCounters" not in gpu2 and gpu2["capacity"]["memory"] == {"value": "40Gi"}


def test_more_than_eight_gpus_split_counter_sets(mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "synthetic-large", tmp_path)  # 20 H100
    slices = build(inv, "node-a", server_version=(1, 35)).slices
    counter_slices = [s for s in slices if "sharedCounters" in s["spec"]]
    assert [len(s["spec"]["sharedCounters"]) for s in counter_slices] == [8, 8, 4]
    assert all(limit_violations(s, (1, 35)) == [] for s in slices)  # the schema: the all-profiles test
    nvidia_style = {"spec": {"sharedCounters": [c for s in counter_slices for c in s["spec"]["sharedCounters"]]}}
    assert limit_violations(nvidia_style, (1, 35)) == ["20 counter sets, limit 8"]  # what one slice would break


def _stretched(inv: NodeInventory, copies: int) -> NodeInventory:
    """The first GPU with its placements repeated under distinct profile IDs (a GPU with many placements)."""
    gpu = inv.placements[0].parent
    own = [p for p in inv.placements if p.parent.uuid == gpu.uuid]
    many = [dataclasses.replace(p, gi_profile_id=p.gi_profile_id + 100 * k) for k in range(copies) for p in own]
    return dataclasses.replace(inv, gpus=(gpu,), migs=(), placements=tuple(many))


def test_more_than_64_devices_of_one_gpu(mock_session: Session, tmp_path: Path) -> None:
    inv = _stretched(inventory(mock_session, "dgx-h200", tmp_path), 6)  # 150 placements + the full GPU
    split = build(inv, "node-a", server_version=(1, 35))
    assert [len(s["spec"].get("devices", ())) for s in split.slices] == [0, 64, 64, 23]
    assert_valid_pool(split.slices, (1, 35), "1.35.0")
    combined = build(inv, "node-a", server_version=(1, 34))  # one slice per GPU: 128 devices at most
    assert len(combined.slices) == 1 and combined.warnings
    assert "not published" in combined.warnings[0]
    assert_valid_pool(combined.slices, (1, 34), "1.34.0")


def test_counter_set_over_32_counters_falls_back_to_the_full_gpu(mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-h200", tmp_path)
    gpu = inv.gpus[0]
    wide = tuple(dataclasses.replace(p, placement_size=30) if p.parent.uuid == gpu.uuid else p
                 for p in inv.placements)
    result = build(dataclasses.replace(inv, placements=wide), "node-a", server_version=(1, 35))
    assert any("counter set of 37 counters" in w for w in result.warnings)
    gpu0 = next(d for d in devices(result.slices) if d["name"] == "gpu-0")
    assert "consumesCounters" not in gpu0 and "gpu-0-counter-set" not in counter_sets(result.slices)
    assert_valid_pool(result.slices, (1, 35), "1.35.0")


def test_taints_and_republish_rebuilds_only_the_changed_gpu(mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-h200", tmp_path)
    cache = partitions.PartitionCache()
    taint = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    first = build(inv, "node-a", server_version=(1, 35), cache=cache,
                  taints={"gpu-1-mig-1g18gb-19-0": [taint], "gpu-9": [taint]})
    assert cache.misses == 8 and first.warnings == ["taints for unknown device gpu-9 ignored"]
    tainted = next(d for d in devices(first.slices) if d["name"] == "gpu-1-mig-1g18gb-19-0")
    assert tainted["taints"] == [taint]
    gpus = list(inv.gpus)
    gpus[3] = dataclasses.replace(gpus[3], mig_enabled=True)  # one instance created on GPU 3
    placements = tuple(dataclasses.replace(p, parent=gpus[3]) if p.parent.uuid == gpus[3].uuid else p
                       for p in inv.placements)
    again = build(dataclasses.replace(inv, gpus=tuple(gpus), placements=placements), "node-a",
                  server_version=(1, 35), cache=cache)
    assert (cache.hits, cache.misses) == (8, 8)  # an instance changes no published device
    gpus[4] = dataclasses.replace(gpus[4], pcie_root="pci0000:9a")
    placements = tuple(dataclasses.replace(p, parent=gpus[4]) if p.parent.uuid == gpus[4].uuid else p
                       for p in placements)
    third = build(dataclasses.replace(inv, gpus=tuple(gpus), placements=placements), "node-a",
                  server_version=(1, 35), cache=cache)
    assert (cache.hits, cache.misses) == (15, 9)  # only GPU 4 rebuilt
    assert third.slices[5]["spec"]["devices"][0]["attributes"]["resource.kubernetes.io/pcieRoot"] == {
        "string": "pci0000:9a"}
    assert all("taints" not in d for d in devices(again.slices))
    assert again.slices[1:3] != first.slices[1:3]  # GPU 1 lost its taint
    assert again.slices[5] == first.slices[5]  # GPU 4: the same entries


def test_vgpu_guest_is_not_dynamic_mig_capable(mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-h200", tmp_path)
    assert is_dynamic_mig_capable(inv.gpus[0])
    assert not is_dynamic_mig_capable(dataclasses.replace(inv.gpus[0], vgpu_guest=True))
    data = mock.load_profile("dgx-h200")
    data["gpus"][0]["virtualizationMode"] = 2  # NVML_GPU_VIRTUALIZATION_MODE_VGPU
    path = tmp_path / "vgpu.json"
    path.write_text(json.dumps(data))
    guest = inventory(mock_session, str(path), tmp_path)
    assert guest.gpus[0].vgpu_guest and not any(p.parent.minor == 0 for p in guest.placements)
    assert len({p.parent.minor for p in guest.placements}) == 7


def test_enumeration_skips_rejected_profiles_and_names_variants(mock_session: Session, tmp_path: Path) -> None:
    b200 = inventory(mock_session, "dgx-b200", tmp_path)
    assert 21 not in {p.gi_profile_id for p in b200.placements}  # placements NOT_SUPPORTED: skipped
    ci = {(p.profile, p.ci_profile_index) for p in b200.placements if p.parent.minor == 0}
    assert ("1g.23gb+me", 0) in ci and ("7g.180gb", 4) in ci  # never 1_SLICE_REV1 (7) or 7_SLICE_NVL (8)
    data = mock.load_profile("dgx-h200")
    gips = data["models"]["h200"]["gpuInstanceProfiles"]
    one = next(g for g in gips if g["index"] == 0)
    gips.append({**one, "index": 10, "id": 47, "name": "MIG 1g.18gb+gfx"})   # 1_SLICE_GFX
    gips.append({**one, "index": 13, "id": 48, "name": "MIG 1g.18gb-me"})    # 1_SLICE_NO_ME
    gips.append({**one, "index": 15, "id": 65, "name": "MIG 1g.18gb+me.all", "infoReturn": 2})  # rejected
    path = tmp_path / "variants.json"
    path.write_text(json.dumps(data))
    names = {p.name for p in inventory(mock_session, str(path), tmp_path).placements if p.parent.minor == 0}
    assert {"gpu-0-mig-1g18gb-gfx-47-0", "gpu-0-mig-1g18gb-me-48-6"} <= names
    assert not any("-65-" in n for n in names)


def _claims(count: int, profile: str) -> list[str]:
    return [yaml.safe_dump({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": f"mig-{i}", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"}}],
        }}]}},
    }) for i in range(count)]


def _inputs(slices: list[dict[str, Any]], claims: list[str]) -> list[str]:
    node = yaml.safe_dump({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
    return [MIG_CLASS.read_text(), node, json.dumps({"apiVersion": "v1", "kind": "List", "items": slices}), *claims]


@pytest.mark.parametrize("version", [(1, 34), (1, 35)])
def test_ten_1g_claims_land_on_as_few_gpus_as_possible(mock_session: Session, tmp_path: Path,
                                                      version: tuple[int, int]) -> None:
    slices = build(inventory(mock_session, "dgx-h200", tmp_path), "node-a", server_version=version).slices
    outcome = simulate(load(_inputs(slices, _claims(10, "1g.18gb"))))
    assert outcome.failures == []
    picked = [c["status"]["allocation"]["devices"]["results"][0]["device"] for c in outcome.claims]
    parents = [name.split("-mig-")[0] for name in picked]
    assert parents.count("gpu-0") == 7 and parents.count("gpu-1") == 3  # ceil(10 / 7) = 2 GPUs
    starts = {name.rsplit("-", 1)[1] for name in picked if name.startswith("gpu-0-")}
    assert starts == {str(s) for s in range(7)}


def test_counters_stop_overlapping_placements_and_explain_names_the_counter(mock_session: Session,
                                                                            tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-h200", tmp_path)
    one_gpu = dataclasses.replace(inv, gpus=inv.gpus[:1], placements=tuple(p for p in inv.placements
                                                                          if p.parent.minor == 0))
    slices = build(one_gpu, "node-a", server_version=(1, 35)).slices
    claims = _claims(1, "4g.71gb") + _claims(2, "3g.71gb")  # 4g takes slices 0-3, one 3g fits at 4, not two
    claims = [c.replace("name: mig-0", "name: big") if i == 0 else c for i, c in enumerate(claims)]
    outcome = simulate(load(_inputs(slices, claims)))
    assert len(outcome.failures) == 1 and "mig-1" in outcome.failures[0]
    text, code = explain(load(_inputs(slices, claims)))
    assert code == 1
    assert "gpu-0-mig-3g71gb-9-0" in text and "gpu-0-counter-set/memory-slice-0" in text
    assert "on GPU gpu-0" in text



@pytest.mark.parametrize("code", [13, 99])
def test_a_gpu_newer_than_hopper_offers_itself_and_its_placements(mock_session: Session, tmp_path: Path,
                                                                   code: int) -> None:
    """Rubin (13) and a code newer than the driver's table (published ``Unknown``) are Hopper or newer, as NVIDIA's
    ``GetArchitecture() >= DEVICE_ARCH_HOPPER``: dynamic MIG with MIG mode off, placements plus the full GPU."""
    data = mock.load_profile("dgx-h200")
    data["gpus"][0]["architecture"] = code
    path = tmp_path / f"arch-{code}.json"
    path.write_text(json.dumps(data))
    inv = inventory(mock_session, str(path), tmp_path)
    gpu = inv.gpus[0]
    assert gpu.architecture == {13: "Rubin", 99: "Unknown"}[code] and not gpu.mig_enabled
    assert is_dynamic_mig_capable(gpu)
    own = [p for p in inv.placements if p.parent.uuid == gpu.uuid]
    assert len(own) == len([p for p in inv.placements if p.parent.uuid == inv.gpus[1].uuid]) > 0
    result = build(inv, "node-a", server_version=(1, 35))
    assert_valid_pool(result.slices, (1, 35), "1.35.0")
    published = {d["name"] for d in devices(result.slices)}
    assert gpu.name in published and {p.name for p in own} <= published


def test_dynamic_mig_full_gpus_carry_fabric_partitions_and_a_new_module_id_misses_the_cache(
        mock_session: Session, tmp_path: Path) -> None:
    inv = inventory(mock_session, "dgx-h100", tmp_path)
    first = inv.gpus[0]
    numbered = dataclasses.replace(inv, gpus=(dataclasses.replace(first, module_id=1, partitions={8: 0}),
                                              *(dataclasses.replace(g, module_id=None) for g in inv.gpus[1:])))
    cache = partitions.PartitionCache()
    slices = build(numbered, "n", server_version=(1, 35), cache=cache, fabric_partitions=True).slices
    assert_valid_pool(slices, (1, 35), "1.35.0")
    entry = next(d for d in devices(slices) if d["name"] == first.name)
    assert (entry["attributes"]["gpuModuleID"], entry["attributes"]["partition8"]) == ({"int": 1}, {"int": 0})
    assert not any("gpuModuleID" in d["attributes"] for d in devices(slices) if d["name"] != first.name)
    renumbered = dataclasses.replace(numbered, gpus=(dataclasses.replace(numbered.gpus[0], module_id=2),
                                                     *numbered.gpus[1:]))
    again = build(renumbered, "n", server_version=(1, 35), cache=cache, fabric_partitions=True).slices
    entry = next(d for d in devices(again) if d["name"] == first.name)
    assert entry["attributes"]["gpuModuleID"] == {"int": 2}
