"""Generate the bundled mock NVML node profiles in ``dradriver/nvml/profiles/``.

Run ``python ext/mocknvml/make_profiles.py`` after changing a table below; the JSON files are committed.
Every value comes from ``../shared/reference/gpu-facts.md`` (section numbers in comments); values marked
``"_inferred"`` in the output were not read from a real GPU (the fact sheet lists them as unknown).

UUIDs are derived deterministically so regenerating a profile does not change it: GPU UUIDs are random-shaped
hex from SHA-256 (real GPU UUIDs have unconstrained version bits), MIG UUIDs are RFC 4122 version-5 UUIDs of
(GPU UUID, GI id, CI id), the shape real drivers (R470+) report (gpu-facts §3.1).
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

# nvmlDeviceAddressingModeType_t (nvml.h); per-model values from §1.3 ("Addressing mode" of the captures)
ADDR_NONE, ADDR_HMM, ADDR_ATS = 0, 1, 2

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


# §2.4 A100-SXM4-40GB, older-driver memory set (matches go-nvml dgxa100 and the DRA docs), §2.10 CI tables.
A100_40_GIPS = [
    gip(0, 19, "1g.5gb", 1, 7, 14, 1, 0, 0, 0, 4864, [0, 1, 2, 3, 4, 5, 6], 1, [cip(0, "1g.5gb", 1, 1, 14)]),
    gip(1, 14, "2g.10gb", 2, 3, 28, 2, 1, 0, 0, 9856, [0, 2, 4], 2,
        [cip(0, "1c.2g.10gb", 1, 2, 14), cip(1, "2g.10gb", 2, 1, 28)]),
    gip(2, 9, "3g.20gb", 3, 2, 42, 3, 2, 0, 0, 19968, [0, 4], 4,
        [cip(0, "1c.3g.20gb", 1, 3, 14), cip(1, "2c.3g.20gb", 2, 1, 28), cip(2, "3g.20gb", 3, 1, 42)]),
    gip(3, 5, "4g.20gb", 4, 1, 56, 4, 2, 0, 0, 19968, [0], 4,
        [cip(0, "1c.4g.20gb", 1, 4, 14), cip(1, "2c.4g.20gb", 2, 2, 28), cip(3, "4g.20gb", 4, 1, 56)]),
    gip(4, 0, "7g.40gb", 7, 1, 98, 7, 5, 1, 1, 40192, [0], 8,
        [cip(0, "1c.7g.40gb", 1, 7, 14), cip(1, "2c.7g.40gb", 2, 3, 28), cip(2, "3c.7g.40gb", 3, 2, 42),
         cip(3, "4c.7g.40gb", 4, 1, 56), cip(4, "7g.40gb", 7, 1, 98)]),
    gip(7, 20, "1g.5gb+me", 1, 1, 14, 1, 1, 1, 1, 4864, [0, 1, 2, 3, 4, 5, 6], 1,
        [cip(0, "1g.5gb+me", 1, 1, 14)]),
    gip(9, 15, "1g.10gb", 1, 4, 14, 1, 1, 0, 0, 9856, [0, 2, 4, 6], 2, [cip(0, "1g.10gb", 1, 1, 14)]),
]


# §2.6 H100 80GB. Per-CI SMs on Hopper are unknown (§2.10); only the full-GI CI is listed, with the GI's SMs.
def _full_ci(name: str, slices: int, sm: int) -> list[dict[str, Any]]:
    return [cip({1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices], name, slices, 1, sm)]


H100_GIPS = [
    gip(0, 19, "1g.10gb", 1, 7, 16, 1, 1, 1, 0, 9984, [0, 1, 2, 3, 4, 5, 6], 1, _full_ci("1g.10gb", 1, 16)),
    gip(1, 14, "2g.20gb", 2, 3, 32, 2, 2, 2, 0, 20096, [0, 2, 4], 2, _full_ci("2g.20gb", 2, 32)),
    gip(2, 9, "3g.40gb", 3, 2, 60, 3, 3, 3, 0, 40448, [0, 4], 4, _full_ci("3g.40gb", 3, 60)),
    gip(3, 5, "4g.40gb", 4, 1, 64, 4, 4, 4, 0, 40448, [0], 4, _full_ci("4g.40gb", 4, 64)),
    gip(4, 0, "7g.80gb", 7, 1, 132, 8, 7, 7, 1, 81152, [0], 8, _full_ci("7g.80gb", 7, 132)),
    gip(7, 20, "1g.10gb+me", 1, 1, 16, 1, 1, 1, 1, 9984, [0, 1, 2, 3, 4, 5, 6], 1,
        _full_ci("1g.10gb+me", 1, 16)),
    gip(9, 15, "1g.20gb", 1, 4, 26, 1, 1, 1, 0, 20096, [0, 2, 4, 6], 2, _full_ci("1g.20gb", 1, 26)),
]

# §2.9 GB200 production boards; 3g/4g/7g rows are names and counts only in the fact sheet: the numbers here
# follow the pattern of the rows that were read and are marked _inferred.
GB200_GIPS = [
    gip(0, 19, "1g.23gb", 1, 7, 18, 2, 1, 1, 0, 22528, [0, 1, 2, 3, 4, 5, 6], 1, _full_ci("1g.23gb", 1, 18)),
    gip(1, 14, "2g.47gb", 2, 3, 38, 4, 2, 2, 0, 46592, [0, 2, 4], 2, _full_ci("2g.47gb", 2, 38)),
    gip(2, 9, "3g.93gb", 3, 2, 58, 6, 3, 3, 0, 93184, [0, 4], 4, _full_ci("3g.93gb", 3, 58), inferred=True),
    gip(3, 5, "4g.93gb", 4, 1, 76, 8, 4, 4, 0, 93184, [0], 4, _full_ci("4g.93gb", 4, 76), inferred=True),
    gip(4, 0, "7g.186gb", 7, 1, 152, 16, 7, 7, 1, 186368, [0], 8, _full_ci("7g.186gb", 7, 152), inferred=True),
    gip(7, 20, "1g.23gb+me", 1, 1, 18, 2, 1, 1, 1, 22528, [0, 1, 2, 3, 4, 5, 6], 1,
        _full_ci("1g.23gb+me", 1, 18)),
    gip(9, 15, "1g.47gb", 1, 4, 32, 2, 1, 1, 0, 46592, [0, 2, 4, 6], 2, _full_ci("1g.47gb", 1, 32)),
]

# §1.1-1.3 per-model identity and board values.
MODELS: dict[str, dict[str, Any]] = {
    "a100-sxm4-40gb": {
        "name": "NVIDIA A100-SXM4-40GB", "brand": 14, "architecture": 7,
        "cudaComputeCapability": {"major": 8, "minor": 0}, "pciDeviceId": 0x20B010DE,
        "pciSubSystemId": 0x134F10DE, "multiprocessorCount": 108,
        "memory": {"total": 40960 * MiB, "reserved": 518 * MiB, "used": 0}, "bar1Total": 65536 * MiB,
        "migCapable": True, "maxMigDeviceCount": 7,
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
        "migCapable": True, "maxMigDeviceCount": 7,
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
        "migCapable": True, "maxMigDeviceCount": 7,
        "power": {"usage": 183000, "limit": 1200000, "minLimit": 200000, "maxLimit": 1200000},
        "temperature": 33, "utilization": {"gpu": 0, "memory": 0},
        "clocks": {"graphics": 1965, "sm": 1965, "mem": 3996, "video": 1680},
        "maxClocks": {"graphics": 2062, "sm": 2062, "mem": 3996, "video": 1965},
        "pcieThroughput": {"tx": 256, "rx": 512}, "pcieMaxGen": 5, "eccMode": 1,
        "supportedEventTypes": EV_SUPPORTED_DC, "gpuInstanceProfiles": GB200_GIPS,
        "addressingMode": ADDR_ATS,
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
}
_INFERRED_NOTES = {
    "l4": "subsystem id, reserved and BAR1 memory, clocks and power of the L4 are typical values, not captures; "
          "no addressing mode capture exists, so nvmlDeviceGetAddressingMode is NOT_SUPPORTED",
}


def bus_id(domain: int, bus: int) -> str:
    return f"{domain:08X}:{bus:02X}:00.0"


def gpu(profile: str, model: str, i: int, bus: str, numa: int | None, serial: str) -> dict[str, Any]:
    g: dict[str, Any] = {
        "model": model, "uuid": gpu_uuid(f"{profile}/{i}"), "serial": serial, "pciBusId": bus,
        "minorNumber": i, "migMode": {"current": 0, "pending": 0},
    }
    if numa is not None:
        g["numaNode"] = numa
    return g


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
    gpus = [gpu(name, "a100-sxm4-40gb", i, bus_id(0, b), 0 if i < 4 else 1, f"15642200{18311 + i:05d}")
            for i, b in enumerate(buses)]
    g0, g1 = gpus[0], gpus[1]
    for g in (g0, g1):
        g["migMode"] = {"current": 1, "pending": 1}
    # GPU0: 2g.10gb at 0:2 (id 3), 1g.5gb at 2:1 (id 9) and 3:1 (id 10), 3g.20gb at 4:4 (id 1). 7 compute
    # slices, 8 memory slices. GI ids follow the driver's pools (§3.1): 3g/4g 1-2, 2g 3-6, 1g 7-14.
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
    gpus = [gpu(name, "h100-sxm5-80gb", i, bus_id(0, b), 0 if i < 4 else 1, f"16523230{40121 + i:05d}")
            for i, b in enumerate(buses)]
    return {
        "format": 1, "description": "NVIDIA DGX H100: 8x H100 80GB HBM3, MIG capable, MIG disabled",
        "system": system("580.105.08", 13000), "models": {"h100-sxm5-80gb": MODELS["h100-sxm5-80gb"]},
        "gpus": gpus,
    }


def gb200_tray() -> dict[str, Any]:
    name = "gb200-nvl72-node"
    buses = [0x29, 0x3F, 0x9C, 0xB2]
    numa = [2, 10, 18, 26]  # §4.1
    gpus = [gpu(name, "gb200", i, bus_id(0, b), numa[i], f"18242250{71201 + i:05d}") for i, b in enumerate(buses)]
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


def l4_inference() -> dict[str, Any]:
    name = "l4-inference"
    buses = [0x70, 0xF0]  # §5 shows an L4 at 0000:70:00.0
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
        # seven 1g.10gb GIs at starts 0..6; ids 7..13 as the driver assigns them to 1g placements (§3.1)
        g["gpuInstances"] = [gi(g, 7 + s, 19, s, 1, 1, 0) for s in range(7)]
        gpus.append(g)
    return {
        "format": 1,
        "description": "Synthetic: 20x H100 80GB HBM3, all in MIG mode with 7x 1g.10gb each (140 MIG devices)",
        "system": system("580.105.08", 13000), "models": {"h100-sxm5-80gb": MODELS["h100-sxm5-80gb"]},
        "gpus": gpus,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, build in [("dgx-a100", dgx_a100), ("dgx-h100", dgx_h100), ("gb200-nvl72-node", gb200_tray),
                        ("l4-inference", l4_inference), ("synthetic-large", synthetic_large)]:
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(build(), indent=1) + "\n")
        print(path)


if __name__ == "__main__":
    main()
