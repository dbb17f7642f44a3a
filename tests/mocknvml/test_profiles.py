"""Every bundled profile, read back through pynvml, against the profile's own values and gpu-facts.md."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import pytest

from dradriver.nvml import mock

MiB = 1024 * 1024
PROFILES = mock.profile_names()


def _is_mig(pynvml: Any, h: Any) -> int:
    """pynvml returns the ctypes c_uint itself from nvmlDeviceIsMigDeviceHandle."""
    value = pynvml.nvmlDeviceIsMigDeviceHandle(h)
    return int(getattr(value, "value", value))


def _gpus(name: str) -> list[dict[str, Any]]:
    return mock.resolved_gpus(mock.load_profile(name))


@pytest.mark.parametrize("name", PROFILES)
def test_system_versions(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    system = mock.load_profile(name)["system"]
    assert pynvml.nvmlSystemGetDriverVersion() == system["driverVersion"]
    assert pynvml.nvmlSystemGetCudaDriverVersion() == system["cudaDriverVersion"]
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == system["cudaDriverVersion"]
    assert pynvml.nvmlSystemGetNVMLVersion() == system["nvmlVersion"]
    major = system["cudaDriverVersion"] // 1000
    assert system["nvmlVersion"] == f"{major}.{system['driverVersion']}"


@pytest.mark.parametrize("name", PROFILES)
def test_full_gpu_identity(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    gpus = _gpus(name)
    assert pynvml.nvmlDeviceGetCount() == len(gpus)
    for index, g in enumerate(gpus):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        assert pynvml.nvmlDeviceGetIndex(h) == index
        assert pynvml.nvmlDeviceGetName(h) == g["name"]
        assert pynvml.nvmlDeviceGetUUID(h) == g["uuid"]
        assert pynvml.nvmlDeviceGetSerial(h) == g["serial"]
        assert pynvml.nvmlDeviceGetMinorNumber(h) == g["minorNumber"]  # not always the index (vr200-node)
        assert pynvml.nvmlDeviceGetBrand(h) == g["brand"]
        assert pynvml.nvmlDeviceGetArchitecture(h) == g["architecture"]
        cc = g["cudaComputeCapability"]
        assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (cc["major"], cc["minor"])
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        assert pci.busId == g["pciBusId"]
        assert pci.busIdLegacy == g["pciBusId"][4:]
        assert pci.pciDeviceId == g["pciDeviceId"] and pci.pciSubSystemId == g["pciSubSystemId"]
        assert (pci.pciDeviceId & 0xFFFF) == 0x10DE
        assert pynvml.nvmlDeviceGetBoardId(h) == (pci.domain << 16) | (pci.bus << 8) | pci.device
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        total, reserved = g["memory"]["total"], g["memory"]["reserved"]
        assert (mem.total, mem.used, mem.free) == (total, reserved, total - reserved)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        assert (v2.total, v2.reserved, v2.used, v2.free) == (total, reserved, 0, total - reserved)
        assert total % MiB == 0, "NVML totals are whole MiB on every real dump (gpu-facts 1.2)"
        assert pynvml.nvmlDeviceGetHandleByUUID(g["uuid"]).contents is not None
        by_uuid = pynvml.nvmlDeviceGetHandleByUUID(g["uuid"])
        by_bus = pynvml.nvmlDeviceGetHandleByPciBusId(g["pciBusId"])
        assert ctypes.addressof(by_uuid.contents) == ctypes.addressof(h.contents)
        assert ctypes.addressof(by_bus.contents) == ctypes.addressof(h.contents)
        if "numaNode" in g:
            assert pynvml.nvmlDeviceGetNumaNodeId(h) == g["numaNode"]
        else:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetNumaNodeId(h)


@pytest.mark.parametrize("name", PROFILES)
def test_minor_numbers_are_distinct(name: str) -> None:
    minors = [g["minorNumber"] for g in _gpus(name)]
    assert sorted(minors) == sorted(set(minors))


def test_vera_rubin_tray_reads_as_the_capture(nvml: Any) -> None:
    """vr200-node against the public values of NVIDIA's mock NVML ``mock-nvml-config-vr200.yaml`` (k8s-test-infra;
    its capture of a 4-GPU Vera Rubin tray): Rubin (13), compute capability 10.7, 286524 MiB of HBM4, device ID
    0x307F, one PCI domain per superchip, minors 0, 3, 1, 2, a board serial per superchip, clique 32766."""
    pynvml = nvml("vr200-node")
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    assert len(handles) == 4
    for h in handles:
        assert pynvml.nvmlDeviceGetArchitecture(h) == 13
        assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (10, 7)
        assert pynvml.nvmlDeviceGetMemoryInfo(h).total == 286524 * MiB
        assert pynvml.nvmlDeviceGetPciInfo(h).pciDeviceId == 0x307F10DE
        assert pynvml.nvmlDeviceGetMigMode(h) == [0, 0]
        fabric = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(fabric))
        assert (fabric.state, fabric.cliqueId) == (3, 32766)
    assert [pynvml.nvmlDeviceGetPciInfo(h).busId for h in handles] == [
        "00000002:81:00.0", "00000002:C1:00.0", "0000000A:81:00.0", "0000000A:E1:00.0"]
    assert [pynvml.nvmlDeviceGetMinorNumber(h) for h in handles] == [0, 3, 1, 2]
    serials = [pynvml.nvmlDeviceGetSerial(h) for h in handles]
    assert serials[0] == serials[1] != serials[2] == serials[3]
    assert [pynvml.nvmlDeviceGetNumaNodeId(h) for h in handles] == [0, 0, 1, 1]


def test_bus_id_lookup_accepts_lowercase_and_short_domain(nvml: Any) -> None:
    pynvml = nvml("dgx-a100")
    h = pynvml.nvmlDeviceGetHandleByPciBusId("0000:b7:00.0")
    assert pynvml.nvmlDeviceGetIndex(h) == 6


def test_real_identity_values_from_gpu_facts(nvml: Any) -> None:
    """Spot checks against gpu-facts.md tables 1.1, 1.2 and 4.1 (not against our own profile)."""
    expected = {
        "dgx-a100": ("NVIDIA A100-SXM4-40GB", 0x20B010DE, 40960, 7, (8, 0), "570.148.08"),
        "dgx-h100": ("NVIDIA H100 80GB HBM3", 0x233010DE, 81559, 9, (9, 0), "580.105.08"),
        "gb200-nvl72-node": ("NVIDIA GB200", 0x294110DE, 189471, 10, (10, 0), "580.173.02"),
        "l4-inference": ("NVIDIA L4", 0x27B810DE, 23034, 8, (8, 9), "595.91.07"),
    }
    for name, (gpu_name, pci_id, mib, arch, cc, driver) in expected.items():
        pynvml = nvml(name)
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetName(h) == gpu_name
        assert pynvml.nvmlDeviceGetPciInfo(h).pciDeviceId == pci_id
        assert pynvml.nvmlDeviceGetMemoryInfo(h).total == mib * MiB
        assert pynvml.nvmlDeviceGetArchitecture(h) == arch
        assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == cc
        assert pynvml.nvmlSystemGetDriverVersion() == driver
        pynvml.nvmlShutdown()
    pynvml = nvml("gb200-nvl72-node")
    numa = [pynvml.nvmlDeviceGetNumaNodeId(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(4)]
    assert numa == [2, 10, 18, 26]


def _mig_name(memory_mb: int, total_bytes: int, slices: int, extra: str = "") -> str:
    """go-nvlib's profile name formula (gpu-facts 2.3); Go's math.Round rounds halves away from zero."""
    frac = math.ceil(memory_mb * MiB / total_bytes * 8) / 8
    gb = math.floor(frac * math.ceil(total_bytes / (1024 * MiB)) + 0.5)
    return f"{slices}g.{gb}gb{extra}"


@pytest.mark.parametrize("name", ["dgx-a100", "a100-80gb-node", "dgx-h100", "dgx-h200", "dgx-b200",
                                  "gb200-nvl72-node"])
def test_gpu_instance_profile_table(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    g = _gpus(name)[0]
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    by_index = {p["index"]: p for p in g["gpuInstanceProfiles"]}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        if index not in by_index:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            continue
        want = by_index[index]
        for version in (1, 2):
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index, version=version)
            assert info.id == want["id"]
            assert info.sliceCount == want["sliceCount"] and info.instanceCount == want["instanceCount"]
            assert info.multiprocessorCount == want["multiprocessorCount"]
            assert (info.copyEngineCount, info.decoderCount, info.encoderCount, info.jpegCount, info.ofaCount) == (
                want["copyEngineCount"], want["decoderCount"], want["encoderCount"], want["jpegCount"],
                want["ofaCount"])
            assert info.memorySizeMB == want["memorySizeMB"]
            if version == 2:
                assert info.name == want["name"]
        slices = want["sliceCount"]
        extra = "+me" if index in (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
                                      pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1) else ""
        assert want["name"] == "MIG " + _mig_name(want["memorySizeMB"], g["memory"]["total"], slices, extra)
        count = ctypes.c_uint(0)
        if "placementsReturn" in want:  # a profile NVML lists but rejects (B200's 2g+me construct)
            with pytest.raises(pynvml.NVMLError) as refused:
                pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, want["id"], None, ctypes.byref(count))
            assert refused.value.value == want["placementsReturn"]
            continue
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, want["id"], None, ctypes.byref(count))
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, want["id"], placements, ctypes.byref(count))
        got = [(p.start, p.size) for p in placements]
        assert got == [(s, want["placements"]["size"]) for s in want["placements"]["starts"]]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)


def test_placements_match_gpu_facts_2_2(nvml: Any) -> None:
    pynvml = nvml("dgx-h100")
    h = pynvml.nvmlDeviceGetHandleByIndex(3)
    table = {19: ([0, 1, 2, 3, 4, 5, 6], 1), 20: ([0, 1, 2, 3, 4, 5, 6], 1), 15: ([0, 2, 4, 6], 2),
             14: ([0, 2, 4], 2), 9: ([0, 4], 4), 5: ([0], 4), 0: ([0], 8)}
    for profile_id, (starts, size) in table.items():
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
        count = ctypes.c_uint(8)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, placements, ctypes.byref(count))
        assert [(p.start, p.size) for p in placements[: count.value]] == [(s, size) for s in starts]


def test_h100_sm_counts_are_not_multiples_of_16(nvml: Any) -> None:
    """gpu-facts 2.6 and 7: 1g(2 memory slices) = 26, 3g = 60, 7g = 132 SMs on every Hopper lgip."""
    pynvml = nvml("dgx-h100")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    sm = {pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, i).id: pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, i)
          .multiprocessorCount for i in (0, 2, 4, 9)}
    assert sm == {19: 16, 9: 60, 0: 132, 15: 26}


def _mig_devices(pynvml: Any, h: Any) -> list[Any]:
    out = []
    for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            out.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, index))
        except pynvml.NVMLError_NotFound:
            continue
    return out


@pytest.mark.parametrize("name", ["dgx-a100", "synthetic-large"])
def test_mig_devices_match_the_profile(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    total_mig = 0
    for index, g in enumerate(_gpus(name)):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        mig = g["migMode"]["current"]
        if not mig:
            assert pynvml.nvmlDeviceGetMigMode(h) == [0, 0]
            assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
            continue
        assert pynvml.nvmlDeviceGetMigMode(h) == [1, 1]
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h) == 7
        profiles = {p["id"]: p for p in g["gpuInstanceProfiles"]}
        expected = [(gi, ci) for gi in g["gpuInstances"] for ci in gi["computeInstances"]]
        devices = _mig_devices(pynvml, h)
        assert len(devices) == len(expected)
        total_mig += len(devices)
        used_slices = 0
        for m, (gi, ci) in zip(devices, expected, strict=True):
            gp = profiles[gi["profileId"]]
            assert _is_mig(pynvml, m) == 1
            assert pynvml.nvmlDeviceGetUUID(m) == ci["uuid"]
            assert pynvml.nvmlDeviceGetName(m) == f"{g['name']} {gp['name']}"
            assert pynvml.nvmlDeviceGetGpuInstanceId(m) == gi["id"]
            assert pynvml.nvmlDeviceGetComputeInstanceId(m) == ci["id"]
            assert pynvml.nvmlDeviceGetMemoryInfo(m).total == gp["memorySizeMB"] * MiB
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
            assert pynvml.nvmlDeviceGetUUID(parent) == g["uuid"]
            attrs = pynvml.nvmlDeviceGetAttributes(m)
            assert attrs.gpuInstanceSliceCount == gp["sliceCount"]
            assert attrs.memorySizeMB == gp["memorySizeMB"]
            by_uuid = pynvml.nvmlDeviceGetHandleByUUID(ci["uuid"])
            assert ctypes.addressof(by_uuid.contents) == ctypes.addressof(m.contents)
            # v5-shaped MIG UUID (gpu-facts 3.1)
            parts = ci["uuid"][4:].split("-")
            assert ci["uuid"].startswith("MIG-") and [len(x) for x in parts] == [8, 4, 4, 4, 12]
            assert parts[2][0] == "5" and parts[3][0] in "89ab"
            # the GI itself
            gi_handle = pynvml.nvmlDeviceGetGpuInstanceById(h, gi["id"])
            info = pynvml.nvmlGpuInstanceGetInfo(gi_handle)
            assert (info.id, info.profileId) == (gi["id"], gi["profileId"])
            assert (info.placement.start, info.placement.size) == (gi["placement"]["start"], gi["placement"]["size"])
            assert gi["placement"]["start"] in gp["placements"]["starts"]
            bits = ((1 << gi["placement"]["size"]) - 1) << gi["placement"]["start"]
            assert used_slices & bits == 0
            used_slices |= bits
            cis = (pynvml.c_nvmlComputeInstance_t * 8)()
            count = ctypes.c_uint(0)
            pynvml.nvmlGpuInstanceGetComputeInstances(gi_handle, ci["profileId"], cis, ctypes.byref(count))
            assert count.value == 1
            ci_info = pynvml.nvmlComputeInstanceGetInfo(cis[0])
            assert (ci_info.id, ci_info.profileId) == (ci["id"], ci["profileId"])
            assert ci_info.placement.size == ci["placement"]["size"]
            cip = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi_handle, ci["profileId"], 0)
            assert cip.sliceCount == gp["sliceCount"], "each MIG device here is the full-GI compute instance"
            assert cip.sharedCopyEngineCount == gp["copyEngineCount"]
        assert bin(used_slices).count("1") <= 8
    assert total_mig == {"dgx-a100": 8, "synthetic-large": 140}[name]


def test_a100_gpu_instance_ids_follow_the_driver_pools(nvml: Any) -> None:
    """gpu-facts 3.1: 3g/4g GIs get 1-2, 2g and 1g(2 slices) 3-6, 1g 7-14."""
    pynvml = nvml("dgx-a100")
    pools = {9: range(1, 3), 5: range(1, 3), 14: range(3, 7), 15: range(3, 7), 19: range(7, 15)}
    for index in (0, 1):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        for m in _mig_devices(pynvml, h):
            gi = pynvml.nvmlDeviceGetGpuInstanceById(h, pynvml.nvmlDeviceGetGpuInstanceId(m))
            info = pynvml.nvmlGpuInstanceGetInfo(gi)
            assert info.id in pools[info.profileId]


def test_a100_compute_instance_profiles_of_a_3g_instance(nvml: Any) -> None:
    """gpu-facts 2.10: a 3g.20gb GI offers 1c (x3, 14 SM), 2c (x1, 28 SM), 3g (x1, 42 SM)."""
    pynvml = nvml("dgx-a100")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    gi = pynvml.nvmlDeviceGetGpuInstanceById(h, 1)
    rows = []
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0)
        except pynvml.NVMLError_NotSupported:
            continue
        rows.append((info.id, info.name, info.instanceCount, info.multiprocessorCount))
    assert rows == [(0, "MIG 1c.3g.20gb", 3, 14), (1, "MIG 2c.3g.20gb", 1, 28), (2, "MIG 3g.20gb", 1, 42)]


def test_mig_disabled_gpu_reports_profiles_but_no_instances(nvml: Any) -> None:
    pynvml = nvml("dgx-h100")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMigMode(h) == [0, 0]
    assert pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, 0).id == 19
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstances(h, 19, (pynvml.c_nvmlGpuInstance_t * 7)(), ctypes.byref(ctypes.c_uint()))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)


def test_synthetic_large_needs_several_resource_slices() -> None:
    gpus = _gpus("synthetic-large")
    mig_devices = sum(len(gi["computeInstances"]) for g in gpus for gi in g["gpuInstances"])
    assert mig_devices > 128


def test_gb200_fabric_info(nvml: Any) -> None:
    pynvml = nvml("gb200-nvl72-node")
    cluster = bytes.fromhex("abc9829a-d4c8-491c-8da5-ad28fb34876b".replace("-", ""))
    for index in range(4):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        v1 = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(v1))
        assert bytes(v1.clusterUuid) == cluster
        assert (v1.cliqueId, v1.state, v1.status) == (2, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 0)
        v2 = pynvml.c_nvmlGpuFabricInfo_v2_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v2))
        assert bytes(v2.clusterUuid) == cluster and v2.cliqueId == 2 and v2.healthMask == 0xAA
        v3 = pynvml.c_nvmlGpuFabricInfo_v3_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v3))
        assert v3.state == 3 and v3.healthMask == 0xAA
        assert v3.healthSummary == pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
        wrong = pynvml.c_nvmlGpuFabricInfo_v3_t()
        wrong.version = 7
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(wrong))


@pytest.mark.parametrize("name", ["l4-inference", "dgx-a100", "dgx-h100"])
def test_no_fabric_outside_nvl72(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t()))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(pynvml.c_nvmlGpuFabricInfo_v3_t()))


def test_l4_has_no_mig(nvml: Any) -> None:
    pynvml = nvml("l4-inference")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    assert _is_mig(pynvml, h) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceId(h)
