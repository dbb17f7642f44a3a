"""Discovery through pynvml against the C mock ``libnvidia-ml.so.1``, compared with the profile values."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.devices import NodeInventory
from dradriver.domain.pools import build, build_resource_slices
from dradriver.domain.resourceslices import quantity_bytes
from dradriver.domain.versions import normalize_version
from dradriver.nvml import mock
from dradriver.nvml.discovery import discover, mig_profile_name, normalize_pci_bus_id, pcie_root
from dradriver.nvml.session import NvmlSession
from tests.domain.slice_validation import assert_valid_slice, quantity_value
from tests.factories import write_profile
from tests.nvml.mockenv import (
    ADDRESSING_MODE_STRINGS,
    ARCH_STRINGS,
    BRAND_STRINGS,
    dra_bus_id,
    expected_pcie_root,
    make_sysfs,
    mig_layout,
)

Session = Callable[[str], NvmlSession]
PROFILES = mock.profile_names()
MIB = 1 << 20


def run(nvml: Session, profile: str, sysfs: Path, numa: dict[str, int] | None = None) -> NodeInventory:
    """Discover ``profile`` with a sysfs tree for it; the session is closed again (the next init re-reads)."""
    data = mock.load_profile(profile)
    make_sysfs(sysfs, data, numa)
    with nvml(profile) as session:
        return discover(session, sysfs_root=sysfs)


def test_bundled_profiles_are_present() -> None:
    for name in ("dgx-a100", "dgx-h100", "gb200-nvl72-node", "synthetic-large"):
        assert name in PROFILES
    assert len(PROFILES) >= 5  # plus at least one inference GPU without MIG or fabric


@pytest.mark.parametrize("profile", PROFILES)
def test_gpus_match_profile(nvml: Session, sysfs: Path, profile: str) -> None:
    data = mock.load_profile(profile)
    inv = run(nvml, profile, sysfs)
    system = data["system"]
    assert inv.versions.driver == system["driverVersion"]
    assert inv.versions.cuda_driver == system["cudaDriverVersion"]
    assert inv.failures == ()
    expected = mock.resolved_gpus(data)
    assert len(inv.gpus) == len(expected)
    for got, want in zip(inv.gpus, expected, strict=True):
        assert got.uuid == want["uuid"]
        assert got.minor == want["minorNumber"]
        assert got.name == f"gpu-{want['minorNumber']}"
        assert got.product_name == want["name"]
        assert got.brand == BRAND_STRINGS[want["brand"]]
        assert got.architecture == ARCH_STRINGS[want["architecture"]]
        cc = want["cudaComputeCapability"]
        assert got.cuda_compute_capability == (cc["major"], cc["minor"])
        assert got.memory_bytes == want["memory"]["total"]
        assert got.pci_bus_id == dra_bus_id(want["pciBusId"])
        assert got.pcie_root == expected_pcie_root(got.pci_bus_id)
        assert got.numa_node == want.get("numaNode")
        assert got.serial == want.get("serial")
        assert got.mig_capable == bool(want.get("migCapable", False))
        assert got.mig_enabled == (want.get("migMode", {}).get("current") == 1)
        if "fabric" in want:
            assert got.fabric is not None
            registered = want["fabric"]["state"] == 3  # until then NVML has no cluster UUID or clique to report
            assert got.fabric.cluster_uuid == (want["fabric"]["clusterUuid"] if registered else
                                               "00000000-0000-0000-0000-000000000000")
            assert got.fabric.clique_id == (want["fabric"]["cliqueId"] if registered else 0)
            assert got.fabric.state == want["fabric"]["state"]
        else:
            assert got.fabric is None


@pytest.mark.parametrize("profile", PROFILES)
def test_mig_devices_match_profile(nvml: Session, sysfs: Path, profile: str) -> None:
    data = mock.load_profile(profile)
    inv = run(nvml, profile, sysfs)
    want = []
    for gpu in mock.resolved_gpus(data):
        if gpu.get("migMode", {}).get("current") == 1:
            want += [(gpu, m) for m in mig_layout(gpu)]
    assert len(inv.migs) == len(want)
    by_uuid = {m.uuid: m for m in inv.migs}
    for gpu, m in want:
        got = by_uuid[m["ci"]["uuid"]]
        p = m["profile"]
        assert got.parent.uuid == gpu["uuid"]
        assert got.profile == m["ci_profile"]["name"].removeprefix("MIG ")
        assert got.gi_profile_id == p["id"]
        assert got.ci_profile_id == m["ci"]["profileId"]
        assert (got.gi_id, got.ci_id) == (m["gi"]["id"], m["ci"]["id"])
        placement = m["gi"]["placement"]
        assert (got.placement_start, got.placement_size) == (placement["start"], placement["size"])
        assert got.memory_bytes == p["memorySizeMB"] * MIB
        assert got.multiprocessors == p["multiprocessorCount"]
        assert (got.copy_engines, got.decoders, got.encoders) == (
            p["copyEngineCount"],
            p["decoderCount"],
            p["encoderCount"],
        )
        assert (got.jpeg_engines, got.ofa_engines) == (p["jpegCount"], p["ofaCount"])


@pytest.mark.parametrize("profile", PROFILES)
def test_published_attributes_match_profile(nvml: Session, sysfs: Path, profile: str) -> None:
    data = mock.load_profile(profile)
    inv = run(nvml, profile, sysfs)
    slices = build_resource_slices(inv, "node-a")
    for s in slices:
        assert_valid_slice(s)
    devices = {d["name"]: d for s in slices for d in s["spec"]["devices"]}
    driver = normalize_version(data["system"]["driverVersion"])
    cuda = data["system"]["cudaDriverVersion"]
    published = 0
    for gpu in mock.resolved_gpus(data):
        minor = gpu["minorNumber"]
        common = {
            "productName": {"string": gpu["name"]},
            "brand": {"string": BRAND_STRINGS[gpu["brand"]]},
            "architecture": {"string": ARCH_STRINGS[gpu["architecture"]]},
            "driverVersion": {"version": driver},
            "cudaDriverVersion": {"version": f"{cuda // 1000}.{cuda % 1000 // 10}.0"},
            "cudaComputeCapability": {
                "version": f"{gpu['cudaComputeCapability']['major']}.{gpu['cudaComputeCapability']['minor']}.0"
            },
            "resource.kubernetes.io/pciBusID": {"string": dra_bus_id(gpu["pciBusId"])},
            "pcieBusID": {"string": dra_bus_id(gpu["pciBusId"])},
            "resource.kubernetes.io/pcieRoot": {"string": expected_pcie_root(dra_bus_id(gpu["pciBusId"]))},
        }
        if "numaNode" in gpu:
            common["resource.kubernetes.io/numaNode"] = {"int": gpu["numaNode"]}
        if "addressingMode" in gpu:
            common["addressingMode"] = {"string": ADDRESSING_MODE_STRINGS[gpu["addressingMode"]]}
        if gpu.get("migMode", {}).get("current") == 1:
            assert f"gpu-{minor}" not in devices  # not double-published
            for m in mig_layout(gpu):
                p = m["profile"]
                canonical = m["ci_profile"]["name"].removeprefix("MIG ").replace(".", "").replace("+", "-")
                name = f"gpu-{minor}-mig-{canonical}-{p['id']}-{m['gi']['placement']['start']}"
                dev = devices[name]
                published += 1
                assert dev["attributes"] == {
                    "type": {"string": "mig"},
                    "uuid": {"string": m["ci"]["uuid"]},
                    "parentUUID": {"string": gpu["uuid"]},
                    "profile": {"string": m["ci_profile"]["name"].removeprefix("MIG ")},
                    **common,
                }
                start, size = m["gi"]["placement"]["start"], m["gi"]["placement"]["size"]
                assert dev["capacity"] == {
                    "multiprocessors": {"value": str(p["multiprocessorCount"])},
                    "copyEngines": {"value": str(p["copyEngineCount"])},
                    "decoders": {"value": str(p["decoderCount"])},
                    "encoders": {"value": str(p["encoderCount"])},
                    "jpegEngines": {"value": str(p["jpegCount"])},
                    "ofaEngines": {"value": str(p["ofaCount"])},
                    "memory": {"value": f"{p['memorySizeMB']}Mi"},
                    **{f"memorySlice{i}": {"value": "1"} for i in range(start, start + size)},
                }
        else:
            dev = devices[f"gpu-{minor}"]
            published += 1
            assert dev["attributes"] == {"type": {"string": "gpu"}, "uuid": {"string": gpu["uuid"]}, **common}
            assert quantity_value(dev["capacity"]["memory"]["value"]) == gpu["memory"]["total"]
            assert dev["capacity"]["memory"]["value"] == quantity_bytes(gpu["memory"]["total"])
    assert published == len(devices)


@pytest.mark.parametrize("profile", ["dgx-a100", "dgx-h100"])
def test_seed_selector_memory_at_least_40gi(nvml: Session, sysfs: Path, profile: str) -> None:
    inv = run(nvml, profile, sysfs)
    full = [d for s in build_resource_slices(inv, "n") for d in s["spec"]["devices"] if "-mig-" not in d["name"]]
    assert full
    for dev in full:
        assert quantity_value(dev["capacity"]["memory"]["value"]) >= quantity_value("40Gi")


def test_dgx_a100_mig_layout(nvml: Session, sysfs: Path) -> None:
    inv = run(nvml, "dgx-a100", sysfs)
    mig_parents = sorted({m.parent.name for m in inv.migs})
    assert mig_parents == ["gpu-0", "gpu-1"]
    names = {d.name for d in inv.allocatable()}
    assert "gpu-0" not in names and "gpu-1" not in names
    assert {f"gpu-{i}" for i in range(2, 8)} <= names
    known = {"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}
    assert {m.profile for m in inv.migs} <= known
    assert len({m.profile for m in inv.migs}) >= 3  # a mixed layout


def test_gb200_clique(nvml: Session, sysfs: Path) -> None:
    inv = run(nvml, "gb200-nvl72-node", sysfs)
    want = mock.resolved_gpus(mock.load_profile("gb200-nvl72-node"))[0]["fabric"]
    assert inv.clique is not None
    assert inv.clique.id == f"{want['clusterUuid']}.{want['cliqueId']}"
    assert inv.warnings == ()


def test_inference_gpu_not_supported_paths(nvml: Session, sysfs: Path) -> None:
    name = "l4-inference"  # the bundled profile without MIG, fabric or NUMA
    data = mock.load_profile(name)
    inv = run(nvml, name, sysfs)
    assert inv.failures == ()
    assert inv.clique is None
    for gpu, want in zip(inv.gpus, mock.resolved_gpus(data), strict=True):
        assert not gpu.mig_capable and not gpu.mig_enabled
        assert gpu.fabric is None
        assert gpu.numa_node == want.get("numaNode")
    for s in build_resource_slices(inv, "n"):
        assert_valid_slice(s)
        for dev in s["spec"]["devices"]:
            assert dev["attributes"]["type"] == {"string": "gpu"}
            if not any("numaNode" in g for g in mock.resolved_gpus(data)):
                assert "resource.kubernetes.io/numaNode" not in dev["attributes"]


def test_numa_falls_back_to_sysfs(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    def drop_numa(d: dict[str, Any]) -> None:
        for g in d["gpus"]:
            g.pop("numaNode", None)

    path = write_profile(tmp_path, "dgx-h100", drop_numa)
    data = mock.load_profile(path)
    bdfs = [dra_bus_id(g["pciBusId"]) for g in mock.resolved_gpus(data)]
    make_sysfs(sysfs, data, numa={bdfs[0]: 1})
    inv = discover(nvml(path), sysfs_root=sysfs)
    assert inv.gpus[0].numa_node == 1
    assert all(g.numa_node is None for g in inv.gpus[1:])  # sysfs says -1: unknown


def test_numa_node_comes_from_sysfs_before_nvml(nvml: Session, sysfs: Path) -> None:
    """Grace host: NVML reports the GPU memory's own NUMA node (2, 10, 18, 26, gpu-facts.md 4.1), sysfs the
    PCI device's node, the one a NIC on the same socket publishes; sysfs wins so the two constraints agree."""
    data = mock.load_profile("gb200-nvl72-node")
    gpus = mock.resolved_gpus(data)
    assert [g["numaNode"] for g in gpus] == [2, 10, 18, 26]
    kernel = {dra_bus_id(g["pciBusId"]): node for g, node in zip(gpus, [0, 0, 1, 1], strict=True)}
    inv = run(nvml, "gb200-nvl72-node", sysfs, numa=kernel)
    assert [g.numa_node for g in inv.gpus] == [0, 0, 1, 1]
    for s in build_resource_slices(inv, "n"):
        assert_valid_slice(s)
        for dev in s["spec"]["devices"]:
            bdf = dev["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
            assert dev["attributes"]["resource.kubernetes.io/numaNode"] == {"int": kernel[bdf]}


def test_sysfs_numa_minus_one_means_none_even_when_nvml_has_one(nvml: Session, sysfs: Path) -> None:
    data = mock.load_profile("dgx-h100")
    gpus = mock.resolved_gpus(data)
    assert all("numaNode" in g for g in gpus)
    inv = run(nvml, "dgx-h100", sysfs, numa={dra_bus_id(g["pciBusId"]): -1 for g in gpus})
    assert all(g.numa_node is None for g in inv.gpus)
    for s in build_resource_slices(inv, "n"):
        assert_valid_slice(s)
        assert all("resource.kubernetes.io/numaNode" not in d["attributes"] for d in s["spec"]["devices"])


def test_numa_node_falls_back_to_nvml_without_sysfs_entry(nvml: Session, sysfs: Path) -> None:
    data = mock.load_profile("gb200-nvl72-node")
    inv = discover(nvml("gb200-nvl72-node"), sysfs_root=sysfs)  # empty tree: no numa_node file
    assert [g.numa_node for g in inv.gpus] == [g["numaNode"] for g in mock.resolved_gpus(data)]


# gpu-facts.md 1.3 (nvidia-smi captures): A100 and H100 on x86 report HMM, GB200 ATS; no L4 capture.
ADDRESSING_MODES = {
    "dgx-a100": "HMM", "dgx-h100": "HMM", "gb200-nvl72-node": "ATS", "synthetic-large": "HMM",
    "l4-inference": None,
}


@pytest.mark.parametrize("profile", sorted(ADDRESSING_MODES))
def test_addressing_mode_discovered_and_published(nvml: Session, sysfs: Path, profile: str) -> None:
    want = ADDRESSING_MODES[profile]
    inv = run(nvml, profile, sysfs)
    assert inv.failures == ()
    assert [g.addressing_mode for g in inv.gpus] == [want] * len(inv.gpus)
    devices = [d for s in build_resource_slices(inv, "n") for d in s["spec"]["devices"]]
    assert devices
    for dev in devices:  # full GPUs and MIG devices (the parent's value) alike
        if want is None:
            assert "addressingMode" not in dev["attributes"]
        else:
            assert dev["attributes"]["addressingMode"] == {"string": want}
    if profile == "dgx-a100":
        assert {d["attributes"]["type"]["string"] for d in devices} == {"gpu", "mig"}


def test_addressing_mode_none_unsupported_and_unknown(
    nvml: Session, sysfs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["gpus"][0]["addressingMode"] = 0  # NVML_DEVICE_ADDRESSING_MODE_NONE
        d["gpus"][1]["notSupported"] = ["nvmlDeviceGetAddressingMode"]
        d["gpus"][2]["addressingMode"] = 7  # not in nvml.h's enum

    path = write_profile(tmp_path, "dgx-h100", edit)
    make_sysfs(sysfs, mock.load_profile(path))
    with caplog.at_level(logging.WARNING):
        inv = discover(nvml(path), sysfs_root=sysfs)
    assert inv.failures == ()
    assert [g.addressing_mode for g in inv.gpus[:4]] == ["None", None, None, "HMM"]
    assert any("addressing mode 7" in w for w in inv.warnings)
    for s in build_resource_slices(inv, "n"):
        assert_valid_slice(s)
        by_name = {d["name"]: d["attributes"] for d in s["spec"]["devices"]}
        assert by_name["gpu-0"]["addressingMode"] == {"string": "None"}
        assert "addressingMode" not in by_name["gpu-1"]
        assert "addressingMode" not in by_name["gpu-2"]
        assert by_name["gpu-3"]["addressingMode"] == {"string": "HMM"}


def test_addressing_mode_left_out_when_the_library_lacks_the_symbol(
    nvml: Session, sysfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynvml

    def missing(handle: Any) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # what pynvml raises for an old driver

    monkeypatch.setattr(pynvml, "nvmlDeviceGetAddressingMode", missing)
    inv = run(nvml, "gb200-nvl72-node", sysfs)
    assert inv.failures == ()
    assert len(inv.gpus) == 4
    assert all(g.addressing_mode is None for g in inv.gpus)
    for s in build_resource_slices(inv, "n"):
        assert all("addressingMode" not in d["attributes"] for d in s["spec"]["devices"])


def test_no_sysfs_entry_means_no_pcie_root(nvml: Session, sysfs: Path) -> None:
    inv = discover(nvml("dgx-h100"), sysfs_root=sysfs)  # empty tree
    assert all(g.pcie_root is None for g in inv.gpus)
    for s in build_resource_slices(inv, "n"):
        assert_valid_slice(s)
        assert all("resource.kubernetes.io/pcieRoot" not in d["attributes"] for d in s["spec"]["devices"])


def test_synthetic_large_splits(nvml: Session, sysfs: Path) -> None:
    inv = run(nvml, "synthetic-large", sysfs)
    total = len(inv.allocatable())
    assert total > 128
    slices = build_resource_slices(inv, "big")
    assert [len(s["spec"]["devices"]) for s in slices] == [128, total - 128]
    for s in slices:
        assert_valid_slice(s)
        assert s["spec"]["pool"]["resourceSliceCount"] == 2
    first = slices[0]["spec"]["devices"][0]["name"]
    tainted = build_resource_slices(inv, "big", taints={first: [{"key": "gpu.nvidia.com/xid", "effect": "NoSchedule"}]})
    sizes = [len(s["spec"]["devices"]) for s in tainted]
    assert max(sizes) == 64 and sum(sizes) == total
    for s in tainted:
        assert_valid_slice(s)
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names == [d["name"] for s in tainted for d in s["spec"]["devices"]]
    assert len(set(names)) == total


def test_lost_gpu_is_reported_and_names_do_not_shift(
    nvml: Session, sysfs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    healthy = run(nvml, "dgx-h100", sysfs)
    path = write_profile(tmp_path, "dgx-h100", lambda d: d["gpus"][3].update(lost=True), "lost")
    with caplog.at_level(logging.WARNING, logger="dradriver.nvml.discovery"):
        inv = discover(nvml(path), sysfs_root=sysfs)
    assert [f.index for f in inv.failures] == [3]
    assert "lost" in inv.failures[0].reason.lower()
    assert any("index 3" in r.getMessage() for r in caplog.records)
    assert len(inv.gpus) == 7
    lost_name = healthy.gpus[3].name
    before = {d["name"]: d for s in build_resource_slices(healthy, "n") for d in s["spec"]["devices"]}
    after = {d["name"]: d for s in build_resource_slices(inv, "n") for d in s["spec"]["devices"]}
    assert set(before) - set(after) == {lost_name}
    for name, dev in after.items():
        assert dev == before[name]


def test_lost_mig_parent_drops_only_that_gpu(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    path = write_profile(tmp_path, "dgx-a100", lambda d: d["gpus"][0].update(lost=True), "lost-mig")
    make_sysfs(sysfs, mock.load_profile(path))
    inv = discover(nvml(path), sysfs_root=sysfs)
    assert [f.index for f in inv.failures] == [0]
    assert {m.parent.minor for m in inv.migs} == {1}
    names = [d.name for d in inv.allocatable()]
    assert not any(n.startswith("gpu-0-") for n in names)


def test_not_supported_core_query_leaves_gpu_out(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    path = write_profile(
        tmp_path, "dgx-h100", lambda d: d["gpus"][2].update(notSupported=["nvmlDeviceGetUUID"]), "nouuid"
    )
    inv = discover(nvml(path), sysfs_root=sysfs)
    assert [f.index for f in inv.failures] == [2]
    assert "nvmlDeviceGetUUID" in inv.failures[0].reason
    assert "NOT_SUPPORTED" in inv.failures[0].reason or "Not Supported" in inv.failures[0].reason
    assert len(inv.gpus) == 7


def test_not_supported_memory_omits_capacity(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    path = write_profile(
        tmp_path, "dgx-h100", lambda d: d["gpus"][1].update(notSupported=["nvmlDeviceGetMemoryInfo"]), "nomem"
    )
    inv = discover(nvml(path), sysfs_root=sysfs)
    assert inv.failures == ()
    assert inv.gpus[1].memory_bytes is None
    devices = {d["name"]: d for s in build_resource_slices(inv, "n") for d in s["spec"]["devices"]}
    assert "capacity" not in devices[inv.gpus[1].name]
    assert "memory" in devices[inv.gpus[0].name]["capacity"]


def test_mig_profile_name_without_parent_memory(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    path = write_profile(
        tmp_path, "dgx-a100", lambda d: d["gpus"][0].update(notSupported=["nvmlDeviceGetMemoryInfo"]), "nomem-mig"
    )
    with nvml(path) as session:
        inv = discover(session, sysfs_root=sysfs)
    expected = {m["ci"]["uuid"]: m["ci_profile"]["name"].removeprefix("MIG ") for m in mig_layout(
        mock.resolved_gpus(mock.load_profile(path))[0]
    )}
    assert inv.gpus[0].memory_bytes is None
    assert {m.uuid: m.profile for m in inv.migs if m.parent.minor == 0} == expected


def test_fabric_not_supported_everywhere_means_no_clique(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    def no_fabric(d: dict[str, Any]) -> None:
        d.setdefault("faults", {})["notSupported"] = ["nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo"]

    inv = discover(nvml(write_profile(tmp_path, "gb200-nvl72-node", no_fabric)), sysfs_root=sysfs)
    assert inv.clique is None
    assert all(g.fabric is None for g in inv.gpus)


def test_clique_disagreement_is_reported(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    def split(d: dict[str, Any]) -> None:
        fabric = dict(mock.resolved_gpus(d)[1]["fabric"])
        fabric["cliqueId"] = fabric["cliqueId"] + 1
        d["gpus"][1]["fabric"] = fabric

    inv = discover(nvml(write_profile(tmp_path, "gb200-nvl72-node", split)), sysfs_root=sysfs)
    assert inv.clique is None
    assert any("disagree" in w for w in inv.warnings)


def test_mig_mode_without_mig_devices_is_a_warning(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    inv = discover(
        nvml(write_profile(tmp_path, "dgx-a100", lambda d: d["gpus"][1].update(gpuInstances=[]), "empty-mig")),
        sysfs_root=sysfs,
    )
    assert any("no MIG devices" in w for w in inv.warnings)
    assert not any(n.startswith("gpu-1") for n in (d.name for d in inv.allocatable()))


def test_profile_switch_in_one_process(nvml: Session, sysfs: Path) -> None:
    first = nvml("dgx-a100")
    a100 = discover(first, sysfs_root=sysfs)
    first.close()
    second = nvml("dgx-h100")
    h100 = discover(second, sysfs_root=sysfs)
    second.close()
    third = nvml("dgx-a100")
    again = discover(third, sysfs_root=sysfs)
    assert {g.product_name for g in a100.gpus} == {"NVIDIA A100-SXM4-40GB"}
    assert {g.product_name for g in h100.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert again == a100


def test_profile_switch_refused_while_a_session_is_open(nvml: Session) -> None:
    from dradriver.nvml.errors import NvmlError

    nvml("dgx-a100")
    with pytest.raises(NvmlError, match="close it first"):
        nvml("dgx-h100")
    nvml("dgx-a100").close()  # same profile: fine, shares the initialised library


def test_session_caches_handles_and_closes(nvml: Session) -> None:
    from dradriver.nvml.errors import NvmlUninitialized

    layout = mig_layout(mock.resolved_gpus(mock.load_profile("dgx-a100"))[0])
    with nvml("dgx-a100") as session:
        assert session.device(0) is session.device(0)
        uuid = session.call(__import__("pynvml").nvmlDeviceGetUUID, session.device(0))
        assert session.device_by_uuid(uuid) is session.device_by_uuid(uuid)
        assert session.mig_device(0, 0) is not None
        assert session.mig_device(0, 0) is session.mig_device(0, 0)
        assert session.mig_device(0, len(layout)) is None  # empty slot (NOT_FOUND)
    assert session.closed
    with pytest.raises(NvmlUninitialized):
        session.device_count()
    session.close()  # idempotent


def test_build_warnings_are_empty_for_bundled_profiles(nvml: Session, sysfs: Path) -> None:
    for profile in PROFILES:
        session = nvml(profile)
        inv = discover(session, sysfs_root=sysfs)
        session.close()
        assert build(inv, "n").warnings == []


def test_pure_helpers() -> None:
    assert normalize_pci_bus_id("00000000:CA:00.0") == "0000:ca:00.0"
    assert normalize_pci_bus_id(b"00000008:06:00.0\x00junk") == "0008:06:00.0"
    assert normalize_pci_bus_id("0000:3B:00.0") == "0000:3b:00.0"
    total40 = 42949672960
    assert mig_profile_name(0, 1, 1, 4864, total40) == "1g.5gb"
    assert mig_profile_name(7, 1, 1, 4864, total40) == "1g.5gb+me"
    assert mig_profile_name(9, 1, 1, 9856, total40) == "1g.10gb"
    assert mig_profile_name(1, 2, 1, 9856, total40) == "1c.2g.10gb"
    assert mig_profile_name(4, 7, 7, 40192, total40) == "7g.40gb"
    h100 = 85520809984
    assert mig_profile_name(0, 1, 1, 9984, h100) == "1g.10gb"
    assert mig_profile_name(2, 3, 3, 40448, h100) == "3g.40gb"
    h200 = 143771 * MIB
    assert mig_profile_name(0, 1, 1, 16384, h200) == "1g.18gb"
    assert mig_profile_name(2, 3, 3, 71168, h200) == "3g.71gb"
    assert mig_profile_name(13, 1, 1, 16384, h200) == "1g.18gb-me"


def test_pcie_root_reads_the_link(tmp_path: Path) -> None:
    devices = tmp_path / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    (devices / "0000:3b:00.0").symlink_to("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0")
    (devices / "0000:99:00.0").symlink_to("../../../devices/platform/soc/0000:99:00.0")
    assert pcie_root(tmp_path, "0000:3b:00.0") == "pci0000:3a"
    assert pcie_root(tmp_path, "0000:99:00.0") is None
    assert pcie_root(tmp_path, "0000:01:00.0") is None


def test_module_id_discovered_per_gpu_and_none_when_not_supported(nvml: Session, sysfs: Path, tmp_path: Path) -> None:
    inv = run(nvml, "dgx-b200", sysfs)
    assert inv.failures == ()
    assert [g.module_id for g in sorted(inv.gpus, key=lambda g: g.minor)] == [6, 8, 7, 5, 2, 4, 3, 1]  # [CAP] B200

    def edit(d: dict[str, Any]) -> None:
        d["gpus"][1]["notSupported"] = ["nvmlDeviceGetModuleId"]
        del d["gpus"][2]["moduleId"]

    path = write_profile(tmp_path, "dgx-h100", edit)
    make_sysfs(sysfs, mock.load_profile(path))
    inv = discover(nvml(path), sysfs_root=sysfs)
    assert inv.failures == ()
    assert [g.module_id for g in inv.gpus[:4]] == [1, None, None, 4]
    assert all(g.partitions == {} for g in inv.gpus)
