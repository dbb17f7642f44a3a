"""Generate the bundled mock NVML node profiles in ``dradriver/nvml/profiles/``.

Run ``python ext/mocknvml/make_profiles.py`` after changing a table below; the JSON files are committed.
Every value comes from a public source, named in the comment of its table, except the ``vr200`` model (its comment
names its public sources). The source tags: [CAP] the real ``nvidia-smi -q -x`` captures in NVIDIA/k8s-test-infra
``tests/e2e/go/assertions/nvidiasmi/testdata/hardware/qx-*.xml`` (identity, board values, bus numbers, fabric info);
[MIG] NVIDIA's MIG User Guide (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/: supported profiles, device
names, GI ids, capabilities) and ``nvidia-smi mig -lgip`` listings posted in GitHub threads (e.g.
NVIDIA/mig-parted#120); [NVML] ``nvml.h`` (enums and structs); [NVL72] NVIDIA's GB200 NVL72 documentation (18 compute
trays of 4 GPUs). Values marked ``"_inferred"`` in the output were not read from a real GPU (no public source has them).

UUIDs are derived deterministically so regenerating a profile does not change it: GPU UUIDs are random-shaped
hex from SHA-256 (real GPU UUIDs have unconstrained version bits), MIG UUIDs are RFC 4122 version-5 UUIDs of
(GPU UUID, GI id, CI id), the shape real drivers (R470+) report (NVIDIA's MIG User Guide, "MIG Device Names").
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "dradriver" / "nvml" / "profiles"
MIG_NS = uuid.UUID("6f1c1d1e-8d3a-4f57-9a51-3b6c0d1e2f30")

MiB = 1024 * 1024

# nvmlDeviceAddressingModeType_t (nvml.h); per-model values from [CAP] ("Addressing mode" of the captures)
ADDR_NONE, ADDR_HMM, ADDR_ATS = 0, 1, 2

# nvmlGpuVirtualizationMode_t (nvml.h); every MIG-capable capture reports "Pass-Through" ([CAP])
VIRT_NONE, VIRT_PASSTHROUGH, VIRT_VGPU = 0, 1, 2

# nvmlEventType bits (nvml.h)
EV_SBE, EV_DBE, EV_PSTATE, EV_XID, EV_CLOCK = 0x1, 0x2, 0x4, 0x8, 0x10
EV_SUPPORTED_DC = EV_SBE | EV_DBE | EV_PSTATE | EV_XID | EV_CLOCK
EV_SUPPORTED_NO_ECC = EV_PSTATE | EV_XID | EV_CLOCK


def gpu_uuid(seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def mig_uuid(parent: str, gi: int, ci: int) -> str:
    return "MIG-" + str(uuid.uuid5(MIG_NS, f"{parent}/{gi}/{ci}"))


def placements(starts: list[int], size: int) -> dict[str, Any]:
    return {"starts": starts, "size": size}


def gip(index: int, pid: int, name: str, slices: int, inst: int, sm: int, ce: int, dec: int, jpeg: int,
        ofa: int, mem_mb: int, starts: list[int], size: int, cips: list[dict[str, Any]],
        inferred: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {
        "index": index, "id": pid, "name": f"MIG {name}", "sliceCount": slices, "instanceCount": inst,
        "multiprocessorCount": sm, "copyEngineCount": ce, "decoderCount": dec, "encoderCount": 0,
        "jpegCount": jpeg, "ofaCount": ofa, "memorySizeMB": mem_mb, "isP2pSupported": 0,
        "placements": placements(starts, size), "computeInstanceProfiles": cips,
    }
    if inferred:
        d["_inferred"] = True
    return d


def cip(index: int, name: str, slices: int, inst: int, sm: int) -> dict[str, Any]:
    return {"index": index, "id": index, "name": f"MIG {name}", "sliceCount": slices, "instanceCount": inst,
            "multiprocessorCount": sm}


def _a100_gips(gb: dict[str, int], mem: dict[str, int]) -> list[dict[str, Any]]:
    """A100 GI profiles ([MIG]) with the CI tables read on A100 ([MIG]); ``gb`` names the memory of each
    size class (``1``, ``2``, ``4``, ``8`` memory slices), ``mem`` its ``memorySizeMB``."""
    n1, n2, n4, n8 = (f"{gb[k]}gb" for k in ("1", "2", "4", "8"))
    m1, m2, m4, m8 = (mem[k] for k in ("1", "2", "4", "8"))
    return [
        gip(0, 19, f"1g.{n1}", 1, 7, 14, 1, 0, 0, 0, m1, [0, 1, 2, 3, 4, 5, 6], 1, [cip(0, f"1g.{n1}", 1, 1, 14)]),
        gip(1, 14, f"2g.{n2}", 2, 3, 28, 2, 1, 0, 0, m2, [0, 2, 4], 2,
            [cip(0, f"1c.2g.{n2}", 1, 2, 14), cip(1, f"2g.{n2}", 2, 1, 28)]),
        gip(2, 9, f"3g.{n4}", 3, 2, 42, 3, 2, 0, 0, m4, [0, 4], 4,
            [cip(0, f"1c.3g.{n4}", 1, 3, 14), cip(1, f"2c.3g.{n4}", 2, 1, 28), cip(2, f"3g.{n4}", 3, 1, 42)]),
        gip(3, 5, f"4g.{n4}", 4, 1, 56, 4, 2, 0, 0, m4, [0], 4,
            [cip(0, f"1c.4g.{n4}", 1, 4, 14), cip(1, f"2c.4g.{n4}", 2, 2, 28), cip(3, f"4g.{n4}", 4, 1, 56)]),
        gip(4, 0, f"7g.{n8}", 7, 1, 98, 7, 5, 1, 1, m8, [0], 8,
            [cip(0, f"1c.7g.{n8}", 1, 7, 14), cip(1, f"2c.7g.{n8}", 2, 3, 28), cip(2, f"3c.7g.{n8}", 3, 2, 42),
             cip(3, f"4c.7g.{n8}", 4, 1, 56), cip(4, f"7g.{n8}", 7, 1, 98)]),
        gip(7, 20, f"1g.{n1}+me", 1, 1, 14, 1, 1, 1, 1, m1, [0, 1, 2, 3, 4, 5, 6], 1,
            [cip(0, f"1g.{n1}+me", 1, 1, 14)]),
        gip(9, 15, f"1g.{n2}", 1, 4, 14, 1, 1, 0, 0, m2, [0, 2, 4, 6], 2, [cip(0, f"1g.{n2}", 1, 1, 14)]),
    ]


# [MIG] A100-SXM4-40GB, older-driver memory set (matches go-nvml dgxa100 and the DRA docs), [MIG] CI tables.
A100_40_GIPS = _a100_gips({"1": 5, "2": 10, "4": 20, "8": 40}, {"1": 4864, "2": 9856, "4": 19968, "8": 40192})
# [MIG] A100-SXM4-80GB (the 39.25/78.75 GiB driver set); CI tables as on the 40GB board ([MIG], same SMs).
A100_80_GIPS = _a100_gips({"1": 10, "2": 20, "4": 40, "8": 80}, {"1": 9728, "2": 19968, "4": 40192, "8": 80640})


# [MIG] H100 80GB. Per-CI SMs on Hopper are unknown ([MIG]); only the full-GI CI is listed, with the GI's SMs.
# CI profile index by compute slices (NVML_COMPUTE_INSTANCE_PROFILE_*: 1 -> 0, 2 -> 1, 3 -> 2, 4 -> 3, 7 -> 4).
_CI_INDEX = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
CI_1_SLICE_REV1, CI_7_SLICE_NVL = 7, 8  # nvml.h; the DRA enumeration skips both (updates 2b)


def _full_ci(name: str, slices: int, sm: int, *, rev1: bool = False, nvl: bool = False) -> list[dict[str, Any]]:
    """The full-GI compute-instance profile, plus the 1-slice REV1 (``rev1``) or the 7-slice NVL (``nvl``)
    variant that the same GI also offers on Hopper and Blackwell drivers (same slices, so a name-based
    enumeration that did not skip them would publish the profile twice: ksigs#1480)."""
    out = [cip(_CI_INDEX[slices], name, slices, 1, sm)]
    if rev1:
        out.append(cip(CI_1_SLICE_REV1, name, slices, 1, sm))
    if nvl:
        out.append(cip(CI_7_SLICE_NVL, name, slices, 1, sm))
    return out


def _hopper_gips(n: dict[str, str], mem: dict[str, int], sm: dict[str, int], ce: dict[str, int],
                 eng: dict[str, int], *, nvl: bool = False, inferred: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Hopper/Blackwell GI profiles. Keys of every table: ``1`` (1g), ``1me`` (1g+me), ``1x2`` (1g with two
    memory slices), ``2``, ``3``, ``4``, ``7``; ``eng`` gives the decoder = JPEG count (equal on every Hopper
    and Blackwell row read, [MIG]); OFA is 1 on +me and 7g only. ``inferred``: rows not read from a GPU."""
    def row(key: str, index: int, pid: int, slices: int, inst: int, starts: list[int], size: int,
            *, ofa: int = 0, rev1: bool = False, nvl_ci: bool = False) -> dict[str, Any]:
        return gip(index, pid, n[key], slices, inst, sm[key], ce[key], eng[key], eng[key], ofa, mem[key], starts,
                   size, _full_ci(n[key], slices, sm[key], rev1=rev1, nvl=nvl_ci), inferred=key in inferred)
    return [
        row("1", 0, 19, 1, 7, [0, 1, 2, 3, 4, 5, 6], 1),
        row("2", 1, 14, 2, 3, [0, 2, 4], 2),
        row("3", 2, 9, 3, 2, [0, 4], 4),
        row("4", 3, 5, 4, 1, [0], 4),
        row("7", 4, 0, 7, 1, [0], 8, ofa=1, nvl_ci=nvl),
        row("1me", 7, 20, 1, 1, [0, 1, 2, 3, 4, 5, 6], 1, ofa=1, rev1=True),
        row("1x2", 9, 15, 1, 4, [0, 2, 4, 6], 2),
    ]


def _names(g1: int, g2: int, g4: int, g8: int) -> dict[str, str]:
    return {"1": f"1g.{g1}gb", "1me": f"1g.{g1}gb+me", "1x2": f"1g.{g2}gb", "2": f"2g.{g2}gb",
            "3": f"3g.{g4}gb", "4": f"4g.{g4}gb", "7": f"7g.{g8}gb"}


def _by_class(m1: int, m2: int, m4: int, m8: int) -> dict[str, int]:
    return {"1": m1, "1me": m1, "1x2": m2, "2": m2, "3": m4, "4": m4, "7": m8}


# [MIG] H100 80GB
H100_GIPS = _hopper_gips(
    _names(10, 20, 40, 80), _by_class(9984, 20096, 40448, 81152),
    {"1": 16, "1me": 16, "1x2": 26, "2": 32, "3": 60, "4": 64, "7": 132},
    {"1": 1, "1me": 1, "1x2": 1, "2": 2, "3": 3, "4": 4, "7": 8},
    {"1": 1, "1me": 1, "1x2": 1, "2": 2, "3": 3, "4": 4, "7": 7},
)
# [MIG] H200 141GB (NVIDIA/mig-parted#120)
H200_GIPS = _hopper_gips(
    _names(18, 35, 71, 141), _by_class(16384, 33024, 71168, 143104),
    {"1": 16, "1me": 16, "1x2": 26, "2": 32, "3": 60, "4": 64, "7": 132},
    {"1": 1, "1me": 1, "1x2": 1, "2": 2, "3": 3, "4": 4, "7": 8},
    {"1": 1, "1me": 1, "1x2": 1, "2": 2, "3": 3, "4": 4, "7": 7},
)
# [MIG] B200 (Mar 2025 driver: 20.50 GiB 1g). The 3g/4g/7g rows were not readable ([MIG]): memory follows the
# slice pattern (88.5 / 178 GiB), SMs the Hopper pattern scaled to 148, CE from MIGUG; marked _inferred.
B200_GIPS = _hopper_gips(
    _names(23, 45, 90, 180), _by_class(20992, 45312, 90624, 182272),
    {"1": 18, "1me": 18, "1x2": 30, "2": 36, "3": 68, "4": 72, "7": 148},
    {"1": 2, "1me": 2, "1x2": 2, "2": 4, "3": 6, "4": 8, "7": 16},
    {"1": 1, "1me": 1, "1x2": 1, "2": 2, "3": 3, "4": 4, "7": 7},
    nvl=True, inferred=("3", "4", "7"),
)
# A GI profile NVML lists but rejects: the A30-only 2_SLICE_REV1 index (8, [MIG]) answers its profile info and
# NOT_SUPPORTED (3) for the possible placements, so discovery has to skip it like NVIDIA's (updates 2b). This
# row is a mock construct (no B200 dump shows it), there to exercise that path on a realistic node.
B200_GIPS.append({
    **gip(8, 21, "2g.45gb+me", 2, 1, 36, 4, 2, 2, 1, 45312, [0, 2, 4], 2, _full_ci("2g.45gb+me", 2, 36),
          inferred=True),
    "placementsReturn": 3,
    "_note": "mock construct: NVML rejects this profile (possible placements NOT_SUPPORTED); never published",
})

# [MIG] GB200 production boards; 3g/4g/7g rows are names and counts only in [MIG]: the numbers here
# follow the pattern of the rows that were read and are marked _inferred.
GB200_GIPS = _hopper_gips(
    _names(23, 47, 93, 186), _by_class(22528, 46592, 93184, 186368),
    {"1": 18, "1me": 18, "1x2": 32, "2": 38, "3": 58, "4": 76, "7": 152},
    {"1": 2, "1me": 2, "1x2": 2, "2": 4, "3": 6, "4": 8, "7": 16},
    {"1": 1, "1me": 1, "1x2": 1, "2": 2, "3": 3, "4": 4, "7": 7},
    nvl=True, inferred=("3", "4", "7"),
)

# [CAP] per-model identity and board values.
MODELS: dict[str, dict[str, Any]] = {
    "a100-sxm4-40gb": {
        "name": "NVIDIA A100-SXM4-40GB", "brand": 14, "architecture": 7,
        "cudaComputeCapability": {"major": 8, "minor": 0}, "pciDeviceId": 0x20B010DE,
        "pciSubSystemId": 0x134F10DE, "multiprocessorCount": 108,
        "memory": {"total": 40960 * MiB, "reserved": 518 * MiB, "used": 0}, "bar1Total": 65536 * MiB,
        "migCapable": True, "maxMigDeviceCount": 7, "virtualizationMode": VIRT_PASSTHROUGH,
        "power": {"usage": 61000, "limit": 400000, "minLimit": 100000, "maxLimit": 400000},
        "temperature": 31, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 1410, "sm": 1410, "mem": 1215, "video": 1275},
        "maxClocks": {"graphics": 1410, "sm": 1410, "mem": 1215, "video": 1290},
        "pcieThroughput": {"tx": 1024, "rx": 2048}, "pcieMaxGen": 4, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": A100_40_GIPS,
        "addressingMode": ADDR_HMM,
    },
    "h100-sxm5-80gb": {
        "name": "NVIDIA H100 80GB HBM3", "brand": 14, "architecture": 9,
        "cudaComputeCapability": {"major": 9, "minor": 0}, "pciDeviceId": 0x233010DE,
        "pciSubSystemId": 0x16C110DE, "multiprocessorCount": 132,
        "memory": {"total": 81559 * MiB, "reserved": 480 * MiB, "used": 0}, "bar1Total": 131072 * MiB,
        "migCapable": True, "maxMigDeviceCount": 7, "virtualizationMode": VIRT_PASSTHROUGH,
        "power": {"usage": 72000, "limit": 700000, "minLimit": 200000, "maxLimit": 700000},
        "temperature": 29, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 345, "sm": 345, "mem": 2619, "video": 765},
        "maxClocks": {"graphics": 1980, "sm": 1980, "mem": 2619, "video": 1545},
        "pcieThroughput": {"tx": 512, "rx": 1024}, "pcieMaxGen": 5, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": H100_GIPS,
        "addressingMode": ADDR_HMM,
    },
    "gb200": {
        "name": "NVIDIA GB200", "brand": 14, "architecture": 10,
        "cudaComputeCapability": {"major": 10, "minor": 0}, "pciDeviceId": 0x294110DE,
        "pciSubSystemId": 0x204610DE, "multiprocessorCount": 152,
        "memory": {"total": 189471 * MiB, "reserved": 742 * MiB, "used": 0}, "bar1Total": 262144 * MiB,
        "migCapable": True, "maxMigDeviceCount": 7, "virtualizationMode": VIRT_PASSTHROUGH,
        "power": {"usage": 183000, "limit": 1200000, "minLimit": 200000, "maxLimit": 1200000},
        "temperature": 33, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 1965, "sm": 1965, "mem": 3996, "video": 1680},
        "maxClocks": {"graphics": 2062, "sm": 2062, "mem": 3996, "video": 1965},
        "pcieThroughput": {"tx": 256, "rx": 512}, "pcieMaxGen": 5, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": GB200_GIPS,
        "addressingMode": ADDR_ATS,
    },
    "a100-sxm4-80gb": {
        "name": "NVIDIA A100-SXM4-80GB", "brand": 14, "architecture": 7,
        "cudaComputeCapability": {"major": 8, "minor": 0}, "pciDeviceId": 0x20B210DE,
        "pciSubSystemId": 0x147F10DE, "multiprocessorCount": 108,
        "memory": {"total": 81920 * MiB, "reserved": 578 * MiB, "used": 0}, "bar1Total": 131072 * MiB,
        "migCapable": True, "maxMigDeviceCount": 7, "virtualizationMode": VIRT_PASSTHROUGH,
        "power": {"usage": 64000, "limit": 400000, "minLimit": 100000, "maxLimit": 400000},
        "temperature": 32, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 1410, "sm": 1410, "mem": 1593, "video": 1275},
        "maxClocks": {"graphics": 1410, "sm": 1410, "mem": 1593, "video": 1290},
        "pcieThroughput": {"tx": 1024, "rx": 2048}, "pcieMaxGen": 4, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": A100_80_GIPS,
        "addressingMode": ADDR_HMM,
    },
    "h200": {
        "name": "NVIDIA H200", "brand": 14, "architecture": 9,
        "cudaComputeCapability": {"major": 9, "minor": 0}, "pciDeviceId": 0x233510DE,
        "pciSubSystemId": 0x18A610DE, "multiprocessorCount": 132,
        "memory": {"total": 143771 * MiB, "reserved": 550 * MiB, "used": 0}, "bar1Total": 262144 * MiB,
        "migCapable": True, "maxMigDeviceCount": 7, "virtualizationMode": VIRT_PASSTHROUGH,
        "power": {"usage": 78000, "limit": 700000, "minLimit": 200000, "maxLimit": 700000},
        "temperature": 30, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 345, "sm": 345, "mem": 3201, "video": 765},
        "maxClocks": {"graphics": 1980, "sm": 1980, "mem": 3201, "video": 1545},
        "pcieThroughput": {"tx": 512, "rx": 1024}, "pcieMaxGen": 5, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": H200_GIPS,
        "addressingMode": ADDR_HMM,
    },
    "b200": {
        "name": "NVIDIA B200", "brand": 14, "architecture": 10,
        "cudaComputeCapability": {"major": 10, "minor": 0}, "pciDeviceId": 0x290110DE,
        "pciSubSystemId": 0x199910DE, "multiprocessorCount": 148,
        "memory": {"total": 183359 * MiB, "reserved": 728 * MiB, "used": 0}, "bar1Total": 262144 * MiB,
        "migCapable": True, "maxMigDeviceCount": 7, "virtualizationMode": VIRT_PASSTHROUGH,
        "power": {"usage": 141000, "limit": 1000000, "minLimit": 200000, "maxLimit": 1000000},
        "temperature": 32, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 1965, "sm": 1965, "mem": 3996, "video": 1635},
        "maxClocks": {"graphics": 1965, "sm": 1965, "mem": 3996, "video": 1830},
        "pcieThroughput": {"tx": 512, "rx": 1024}, "pcieMaxGen": 5, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": B200_GIPS,
        "addressingMode": ADDR_NONE,
    },
    "l4": {
        "name": "NVIDIA L4", "brand": 14, "architecture": 8,
        "cudaComputeCapability": {"major": 8, "minor": 9}, "pciDeviceId": 0x27B810DE,
        "pciSubSystemId": 0x16CA10DE, "multiprocessorCount": 58,
        "memory": {"total": 23034 * MiB, "reserved": 441 * MiB, "used": 0}, "bar1Total": 32768 * MiB,
        "migCapable": False, "maxMigDeviceCount": 0,
        "power": {"usage": 16000, "limit": 72000, "minLimit": 40000, "maxLimit": 72000},
        "temperature": 38, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 210, "sm": 210, "mem": 405, "video": 795},
        "maxClocks": {"graphics": 2040, "sm": 2040, "mem": 6251, "video": 1770},
        "pcieThroughput": {"tx": 128, "rx": 256}, "pcieMaxGen": 4, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": [],
    },
    "vr200": {
        # A Rubin GPU of a Vera Rubin superchip. Published: architecture Rubin (nvml.h NVML_DEVICE_ARCH_RUBIN 13),
        # 288 GB HBM4 per GPU, NVLink 6 and NVLink-C2C to the Vera CPU (NVIDIA's Vera Rubin announcement and its
        # developer blog "Inside NVIDIA Rubin GPU architecture"). From the `nvidia-smi -q -x` capture of a 4-GPU
        # Vera Rubin tray (driver 615.23, CUDA 13.4) that NVIDIA's mock NVML profile `mock-nvml-config-vr200.yaml`
        # (NVIDIA/k8s-test-infra, pkg/gpu/mocknvml/configs) is authored from: the name a pre-release board reports
        # ("NVIDIA Graphics Device"), PCI device/subsystem IDs, memory total/reserved, BAR1, clocks, power, MIG
        # mode disabled. _INFERRED_NOTES says what no public source gives.
        "name": "NVIDIA Graphics Device", "brand": 14, "architecture": 13,
        "cudaComputeCapability": {"major": 10, "minor": 7}, "pciDeviceId": 0x307F10DE,
        "pciSubSystemId": 0x221A10DE,
        "memory": {"total": 286524 * MiB, "reserved": 1277 * MiB, "used": 0}, "bar1Total": 524288 * MiB,
        "migCapable": True, "virtualizationMode": VIRT_NONE,
        "power": {"usage": 400000, "limit": 2300000, "minLimit": 200000, "maxLimit": 2300000},
        "temperature": 30, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 120, "sm": 120, "mem": 3186, "video": 744},
        "maxClocks": {"graphics": 2424, "sm": 2424, "mem": 4752, "video": 2412},
        "pcieThroughput": {"tx": 0, "rx": 0}, "pcieMaxGen": 6, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": [],
        "addressingMode": ADDR_ATS,
    },
}
_INFERRED_NOTES = {
    "a100-sxm4-80gb": "subsystem id, reserved and BAR1 memory, memory clock and power are typical values, not captures",
    "h200": "subsystem id, reserved and BAR1 memory, clocks and power are typical values, not captures (no public "
            "capture of an H200 has them); GI table from mig-parted#120",
    "l4": "subsystem id, reserved and BAR1 memory, clocks and power of the L4 are typical values, not captures; "
          "no addressing mode capture exists, so nvmlDeviceGetAddressingMode is NOT_SUPPORTED",
    "vr200": "not published for Rubin: the MIG profile table (MIG capable with MIG disabled as the capture shows, "
             "no GPU-instance profile, so every profile answers NOT_SUPPORTED), the SM count (no "
             "multiprocessorCount), the addressing mode (ATS by analogy with GB200's coherent NVLink-C2C host, not "
             "captured); compute capability 10.7 is the value of NVIDIA's mock NVML, which cites the CUDA 13.4 "
             "developer-preview release notes, not a GA CUDA document",
}


def bus_id(domain: int, bus: int) -> str:
    return f"{domain:08X}:{bus:02X}:00.0"


def gpu(profile: str, model: str, i: int, bus: str, numa: int | None, serial: str,
        module_id: int | None = None) -> dict[str, Any]:
    g: dict[str, Any] = {
        "model": model, "uuid": gpu_uuid(f"{profile}/{i}"), "serial": serial, "pciBusId": bus,
        "minorNumber": i, "migMode": {"current": 0, "pending": 0},
    }
    if numa is not None:
        g["numaNode"] = numa
    if module_id is not None:
        g["moduleId"] = module_id
    return g


# nvmlDeviceGetModuleId per GPU in minor (= PCI bus) order. [CAP]: B200 8-GPU 6, 8, 7, 5, 2, 4, 3, 1 (not in bus
# order); GB200 tray 2, 1, 4, 3. HGX A100/H100/H200 8-GPU: 1..8 in bus order, synthetic (no capture shows them);
# Fabric Manager names GPUs by this ID (nv_fm_types.h fmFabricPartitionGpuInfo_t.physicalId).
MODULE_IDS_HGX8 = [1, 2, 3, 4, 5, 6, 7, 8]
MODULE_IDS_B200 = [6, 8, 7, 5, 2, 4, 3, 1]
MODULE_IDS_GB200_TRAY = [2, 1, 4, 3]


def gi(g: dict[str, Any], gi_id: int, profile_id: int, start: int, size: int, slices: int,
       ci_profile: int) -> dict[str, Any]:
    return {
        "id": gi_id, "profileId": profile_id, "placement": {"start": start, "size": size},
        "computeInstances": [{
            "id": 0, "profileId": ci_profile, "placement": {"start": 0, "size": slices},
            "uuid": mig_uuid(g["uuid"], gi_id, 0),
        }],
    }


def system(driver: str, cuda: int) -> dict[str, Any]:
    return {"driverVersion": driver, "cudaDriverVersion": cuda, "nvmlVersion": f"{cuda // 1000}.{driver}"}


def dgx_a100() -> dict[str, Any]:
    name = "dgx-a100"
    buses = [0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD]
    gpus = [gpu(name, "a100-sxm4-40gb", i, bus_id(0, b), 0 if i < 4 else 1, f"15642200{18311 + i:05d}",
                MODULE_IDS_HGX8[i])
            for i, b in enumerate(buses)]
    g0, g1 = gpus[0], gpus[1]
    for g in (g0, g1):
        g["migMode"] = {"current": 1, "pending": 1}
    # GPU0: 2g.10gb at 0:2 (id 3), 1g.5gb at 2:1 (id 9) and 3:1 (id 10), 3g.20gb at 4:4 (id 1). 7 compute
    # slices, 8 memory slices. GI ids follow the driver's pools ([MIG]): 3g/4g 1-2, 2g 3-6, 1g 7-14.
    g0["gpuInstances"] = [
        gi(g0, 1, 9, 4, 4, 3, 2), gi(g0, 3, 14, 0, 2, 2, 1), gi(g0, 9, 19, 2, 1, 1, 0), gi(g0, 10, 19, 3, 1, 1, 0),
    ]
    # GPU1: 4g.20gb at 0:4 (id 2), 1g.5gb at 4:1 (id 11) and 5:1 (id 12), 1g.10gb at 6:2 (id 6).
    g1["gpuInstances"] = [
        gi(g1, 2, 5, 0, 4, 4, 3), gi(g1, 11, 19, 4, 1, 1, 0), gi(g1, 12, 19, 5, 1, 1, 0), gi(g1, 6, 15, 6, 2, 1, 0),
    ]
    return {
        "format": 1, "description": "NVIDIA DGX A100: 8x A100-SXM4-40GB, GPUs 0 and 1 in MIG mode (mixed layouts)",
        "system": system("570.148.08", 12080), "models": {"a100-sxm4-40gb": MODELS["a100-sxm4-40gb"]},
        "gpus": gpus,
    }


def dgx_h100() -> dict[str, Any]:
    name = "dgx-h100"
    buses = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
    gpus = [gpu(name, "h100-sxm5-80gb", i, bus_id(0, b), 0 if i < 4 else 1, f"16523230{40121 + i:05d}",
                MODULE_IDS_HGX8[i])
            for i, b in enumerate(buses)]
    return {
        "format": 1, "description": "NVIDIA DGX H100: 8x H100 80GB HBM3, MIG capable, MIG disabled",
        "system": system("580.105.08", 13000), "models": {"h100-sxm5-80gb": MODELS["h100-sxm5-80gb"]},
        "gpus": gpus,
    }


def gb200_tray() -> dict[str, Any]:
    name = "gb200-nvl72-node"
    buses = [0x29, 0x3F, 0x9C, 0xB2]
    numa = [2, 10, 18, 26]  # [NVL72]
    gpus = [gpu(name, "gb200", i, bus_id(0, b), numa[i], f"18242250{71201 + i:05d}", MODULE_IDS_GB200_TRAY[i])
            for i, b in enumerate(buses)]
    fabric = {
        "clusterUuid": "abc9829a-d4c8-491c-8da5-ad28fb34876b", "cliqueId": 2, "state": 3, "status": 0,
        "healthMask": 0xAA, "healthSummary": 1,
    }
    for g in gpus:
        g["fabric"] = fabric
    return {
        "format": 1,
        "description": "One compute tray of a GB200 NVL72 rack: 4x GB200, fabric registration completed, healthy",
        "system": system("580.173.02", 13000), "models": {"gb200": MODELS["gb200"]}, "gpus": gpus,
    }


# GB200 NVL72 racks ([NVL72]: 18 compute trays of 4 GPUs; [NVML]: one cluster UUID and clique ID shared by every GPU of
# the rack's NVLink domain). Rack A reuses the capture's cluster UUID and clique 2; rack B's values are synthetic.
NVL72_TRAYS = 18
NVL72_RACKS = {
    "a": {"clusterUuid": "abc9829a-d4c8-491c-8da5-ad28fb34876b", "cliqueId": 2},
    "b": {"clusterUuid": "5b1f40c2-7e93-4d0a-b6e1-93c2f07d4a58", "cliqueId": 7},
}
FABRIC_IN_PROGRESS, FABRIC_COMPLETED = 2, 3  # [NVML] state values
NVML_ERROR_UNKNOWN = 999


def _nvl72_fabric(rack: str, *, state: int = FABRIC_COMPLETED, status: int = 0) -> dict[str, Any]:
    return {**NVL72_RACKS[rack], "state": state, "status": status, "healthMask": 0xAA, "healthSummary": 1}


def _nvl72_tray_gpus(rack: str, tray: int) -> list[dict[str, Any]]:
    """The 4 GPUs of tray ``tray`` of rack ``rack``: distinct UUIDs and serials per tray; PCI domain = tray index
    (the capture's bus numbers; distinct domains keep every GPU of the rack distinguishable), NUMA ids of [NVL72]."""
    buses, numa = [0x29, 0x3F, 0x9C, 0xB2], [2, 10, 18, 26]
    rack_number = ord(rack) - ord("a") + 1
    return [gpu(f"gb200-nvl72-rack-{rack}/tray-{tray:02d}", "gb200", i, bus_id(tray, b), numa[i],
                f"1824{rack_number:02d}{tray:02d}{71201 + i:05d}", MODULE_IDS_GB200_TRAY[i])
            for i, b in enumerate(buses)]


def gb200_rack(rack: str) -> dict[str, Any]:
    """A whole NVL72 rack in one profile: the mock serves tray 00 (``gpus``); ``rack.trays`` lists the GPU
    identities of all 18 trays, from which ``dradriver.nvml.mock.rack_node_profile`` writes any tray's view."""
    fabric = _nvl72_fabric(rack)
    trays = [_nvl72_tray_gpus(rack, t) for t in range(NVL72_TRAYS)]
    gpus = [dict(g, fabric=fabric) for g in trays[0]]
    return {
        "format": 1,
        "description": f"GB200 NVL72 rack {rack.upper()}, tray 00 of {NVL72_TRAYS} (4x GB200 each; clique "
                       f"{fabric['cliqueId']}, fabric completed); other trays via rack_node_profile",
        "system": system("580.173.02", 13000), "models": {"gb200": MODELS["gb200"]}, "gpus": gpus,
        "rack": {
            "name": f"rack-{rack}", "number": ord(rack) - ord("a") + 1, "trays": [
                [{"uuid": g["uuid"], "serial": g["serial"], "pciBusId": g["pciBusId"]} for g in tray]
                for tray in trays],
        },
    }


def gb200_fabric_variant(state: int, status: int, what: str) -> dict[str, Any]:
    """The single ``gb200-nvl72-node`` tray with its fabric registration not done: ``state`` IN_PROGRESS, or
    COMPLETED with a failure ``status`` (which nvmlReturn_t a real failed registration reports is unconfirmed;
    the mock uses NVML_ERROR_UNKNOWN)."""
    profile = gb200_tray()
    for g in profile["gpus"]:
        g["fabric"] = {**g["fabric"], "state": state, "status": status}
    profile["description"] = f"One compute tray of a GB200 NVL72 rack: 4x GB200, fabric registration {what}"
    return profile


def _noted(model: str) -> dict[str, Any]:
    m = dict(MODELS[model])
    if model in _INFERRED_NOTES:
        m["_note"] = _INFERRED_NOTES[model]
    return m


def dgx_h200() -> dict[str, Any]:
    name = "dgx-h200"
    buses = [0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB]  # DGX/HGX 8-GPU layout; not a capture
    gpus = [gpu(name, "h200", i, bus_id(0, b), 0 if i < 4 else 1, f"16524240{30101 + i:05d}",
                MODULE_IDS_HGX8[i])
            for i, b in enumerate(buses)]
    return {
        "format": 1, "description": "NVIDIA DGX H200: 8x H200 141GB, MIG capable, MIG disabled, no instances",
        "system": system("580.105.08", 13000), "models": {"h200": _noted("h200")}, "gpus": gpus,
    }


def dgx_b200() -> dict[str, Any]:
    name = "dgx-b200"
    buses = [0x8F, 0x90, 0x96, 0x97, 0xC4, 0xC5, 0xCB, 0xCC]  # [CAP]: minors 0-7 in this bus order
    gpus = [gpu(name, "b200", i, bus_id(0, b), 0 if i < 4 else 1, f"18252250{40101 + i:05d}",
                MODULE_IDS_B200[i])
            for i, b in enumerate(buses)]
    fabric = {  # [NVML]: B200 HGX: state Completed, clique 0, all-zero cluster UUID, summary Healthy
        "clusterUuid": "00000000-0000-0000-0000-000000000000", "cliqueId": 0, "state": 3, "status": 0,
        "healthMask": 0xAA, "healthSummary": 1,
    }
    for g in gpus:
        g["fabric"] = fabric
    return {
        "format": 1, "description": "NVIDIA DGX B200: 8x B200 180GB, MIG capable, MIG disabled, no instances",
        "system": system("580.105.08", 13000), "models": {"b200": MODELS["b200"]}, "gpus": gpus,
    }


def a100_80gb_node() -> dict[str, Any]:
    name = "a100-80gb-node"
    buses = [0x07, 0x0F, 0x47, 0x4E]
    gpus = [gpu(name, "a100-sxm4-80gb", i, bus_id(0, b), 0 if i < 2 else 1, f"13232210{20101 + i:05d}")
            for i, b in enumerate(buses)]
    for g in gpus[:2]:  # Ampere: MIG on already (so dynamic MIG may use them), no instances yet
        g["migMode"] = {"current": 1, "pending": 1}
    return {
        "format": 1,
        "description": "4x A100-SXM4-80GB: GPUs 0 and 1 in MIG mode with no instances, GPUs 2 and 3 MIG disabled",
        "system": system("580.95.05", 13000), "models": {"a100-sxm4-80gb": _noted("a100-sxm4-80gb")},
        "gpus": gpus,
    }


def l4_inference() -> dict[str, Any]:
    name = "l4-inference"
    buses = [0x70, 0xF0]  # [CAP] shows an L4 at 0000:70:00.0
    gpus = [gpu(name, "l4", i, bus_id(0, b), None, f"13232230{10311 + i:05d}") for i, b in enumerate(buses)]
    model = dict(MODELS["l4"])
    model["_note"] = _INFERRED_NOTES["l4"]
    return {
        "format": 1, "description": "Inference node: 2x NVIDIA L4 (no MIG, no fabric, no NUMA affinity reported)",
        "system": system("595.91.07", 13020), "models": {"l4": model}, "gpus": gpus,
    }


def synthetic_large() -> dict[str, Any]:
    name = "synthetic-large"
    gpus = []
    for i in range(20):
        dom, bus = divmod(i, 8)
        g = gpu(name, "h100-sxm5-80gb", i, bus_id(dom, 0x18 + 0x10 * bus), dom % 2, f"16523230{50000 + i:05d}")
        g["migMode"] = {"current": 1, "pending": 1}
        # seven 1g.10gb GIs at starts 0..6; ids 7..13 as the driver assigns them to 1g placements ([MIG])
        g["gpuInstances"] = [gi(g, 7 + s, 19, s, 1, 1, 0) for s in range(7)]
        gpus.append(g)
    return {
        "format": 1,
        "description": "Synthetic: 20x H100 80GB HBM3, all in MIG mode with 7x 1g.10gb each (140 MIG devices)",
        "system": system("580.105.08", 13000), "models": {"h100-sxm5-80gb": MODELS["h100-sxm5-80gb"]},
        "gpus": gpus,
    }


def vr200_node() -> dict[str, Any]:
    """One compute tray of a Vera Rubin NVL144 rack as its OS sees it: two superchips (a Vera CPU and 2 Rubin GPUs).

    As in the capture NVIDIA's ``mock-nvml-config-vr200.yaml`` reproduces: each superchip is its own PCI domain
    (``0002``, ``000A``: the only non-zero domains of a single-node bundled profile), minor numbers do not follow
    the NVML index (0, 3, 1, 2), the two GPUs of a superchip share a board serial, one NUMA node per superchip,
    fabric registration completed on the default clique of an unpartitioned NVLink 6 fabric (clique 32766).
    """
    name = "vr200-node"
    layout = [(0x0002, 0x81, 0, 0), (0x0002, 0xC1, 3, 0), (0x000A, 0x81, 1, 1), (0x000A, 0xE1, 2, 1)]
    gpus = []
    for i, (domain, bus, minor, superchip) in enumerate(layout):
        g = gpu(name, "vr200", i, bus_id(domain, bus), superchip, f"16500000{superchip + 1:05d}")
        g["minorNumber"] = minor
        g["fabric"] = {"clusterUuid": "00000000-0000-0000-0000-000000000001", "cliqueId": 32766,
                       "state": FABRIC_COMPLETED, "status": 0, "healthMask": 0xAA, "healthSummary": 1}
        gpus.append(g)
    return {
        "format": 1,
        "description": "Vera Rubin NVL144 compute tray: 2 Vera CPU + 2x Rubin superchips, 4 Rubin GPUs (288 GB HBM4, "
                       "compute capability 10.7), NVLink 6 fabric completed, MIG capable (profiles unpublished), MIG "
                       "disabled",
        "system": system("615.23", 13040), "models": {"vr200": _noted("vr200")}, "gpus": gpus,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, build in [("dgx-a100", dgx_a100), ("dgx-h100", dgx_h100), ("gb200-nvl72-node", gb200_tray),
                        ("l4-inference", l4_inference), ("synthetic-large", synthetic_large),
                        ("dgx-h200", dgx_h200), ("dgx-b200", dgx_b200), ("a100-80gb-node", a100_80gb_node),
                        ("vr200-node", vr200_node),
                        ("gb200-nvl72-rack-a", lambda: gb200_rack("a")),
                        ("gb200-nvl72-rack-b", lambda: gb200_rack("b")),
                        ("gb200-nvl72-fabric-in-progress",
                         lambda: gb200_fabric_variant(FABRIC_IN_PROGRESS, 0, "in progress (state IN_PROGRESS)")),
                        ("gb200-nvl72-fabric-failed",
                         lambda: gb200_fabric_variant(FABRIC_COMPLETED, NVML_ERROR_UNKNOWN,
                                                      "failed (state COMPLETED, status NVML_ERROR_UNKNOWN)"))]:
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(build(), indent=1) + "\n")
        print(path)


if __name__ == "__main__":
    main()
