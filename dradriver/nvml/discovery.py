"""Discover the node's GPUs, existing MIG devices and fabric clique through NVML.

:func:`discover` walks every GPU NVML enumerates and returns a
:class:`~dradriver.domain.devices.NodeInventory`.
Facts and their sources (the ``nvidia-smi -q -x`` captures in NVIDIA/k8s-test-infra; NVIDIA's MIG User Guide,
"Supported MIG Profiles"; ``nvmlGpuFabricInfo_t`` in ``nvml.h``; NVIDIA's ``cmd/gpu-kubelet-plugin/deviceinfo.go``,
``mig.go``, ``cmd/compute-domain-kubelet-plugin/nvlib.go``):

* brand and architecture are the strings go-nvlib prints (``Nvidia``, ``Ada Lovelace``, ``Hopper``, ``Rubin``); a
  code go-nvlib does not know is published as ``Unknown`` with a warning, never a failure (:data:`ARCHITECTURES`);
* the PCI bus ID is NVML's ``busId`` lowercased with the leading ``0000`` of the 8-digit domain trimmed
  (``00000000:CA:00.0`` -> ``0000:ca:00.0``);
* ``pcieRoot`` is the ``pci<domain>:<bus>`` element of the ``<sysfs>/bus/pci/devices/<bdf>`` link target;
* the NUMA node is the kernel's ``<sysfs>/bus/pci/devices/<bdf>/numa_node`` (what NVIDIA's driver reads
  through go-nvlib nvpci, and what NIC drivers publish, so GPU and NIC ``numaNode`` constraints agree; on
  Grace hosts ``nvmlDeviceGetNumaNodeId`` reports the GPU memory's own node, 2/10/18/26 on a GB200 tray);
  ``-1`` there means no node. ``nvmlDeviceGetNumaNodeId`` is used only when the sysfs file is missing or
  unreadable; negative means unknown;
* ``addressingMode`` is ``nvmlDeviceGetAddressingMode`` (``nvmlDeviceAddressingMode_v1_t``) as a string:
  ``None``, ``HMM``, ``ATS`` (``nvmlDeviceAddressingModeType_t`` 0-2); NOT_SUPPORTED, an older library
  without the symbol, or a value outside the enum (warned) leave it out;
* ``module_id`` is ``nvmlDeviceGetModuleId`` (NVIDIA's ``gpuModuleID`` attribute; the ``physicalId`` Fabric Manager
  names the GPU by, ``nv_fm_types.h``); NOT_SUPPORTED leaves it ``None``;
* MIG profile names follow go-nvlib: ``<G>g.<GB>gb`` (``<C>c.<G>g.<GB>gb`` when the compute instance is
  smaller than its GPU instance) with ``+me`` for the REV1 profiles, ``+me.all``, ``+gfx``, ``-me`` for the
  RTX PRO ones, and ``GB = round(ceil(memMiB*2^20/total*8)/8 * ceil(total/GiB))``;
* the clique is ``<clusterUUID>.<cliqueId>`` when every fabric-attached GPU agrees.

Failure policy: a GPU whose core query fails (UUID, minor, name, brand, architecture, compute capability,
PCI info; including GPU_IS_LOST or NOT_SUPPORTED) is left out and recorded in ``failures`` with the reason,
and the rest of the node is still discovered. Optional queries (memory, serial, NUMA, addressing mode, module ID,
MIG mode, fabric) that answer NOT_SUPPORTED give ``None``/``False``. A MIG-enabled GPU whose MIG devices cannot be
read is left out as a whole (publishing half of it would be wrong). Each failure is logged.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from dradriver.domain.devices import (
    Clique,
    DiscoveryFailure,
    DriverVersions,
    FabricInfo,
    GpuDevice,
    MigDevice,
    NodeInventory,
)
from dradriver.domain.migplacements import MigPlacement, toggles_mig_without_reset
from dradriver.domain.passthrough import pcie_root_of
from dradriver.nvml.errors import NvmlError
from dradriver.nvml.session import NvmlSession

log = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30

ARCHITECTURES: dict[int, str] = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
    0xFFFFFFFF: "Unknown",
}
"""``nvmlDeviceArchitecture_t`` (nvml.h ``NVML_DEVICE_ARCH_*``) -> go-nvlib ``GetArchitectureAsString``.

Rubin (13) is in go-nvlib from v0.12.0; NVIDIA's driver built against an older go-nvlib fails to enumerate a
Rubin node at all ("error interpreting device architecture as string: 13", kubernetes-sigs/dra-driver-nvidia-gpu
#1462), and go-nvlib still fails on any code outside its switch. Here a code outside this table (a GPU newer than
this driver) is published as ``Unknown``, go-nvlib's word for NVML's ``NVML_DEVICE_ARCH_UNKNOWN``, with one
warning naming the code and the GPU; ``cudaComputeCapability`` still comes from NVML and the GPU counts as Hopper
or newer (:func:`dradriver.domain.migplacements.toggles_mig_without_reset`). nvml.h's DLA (11), DLA2 (12) and NPU3
(15) name accelerators that are not GPUs; go-nvlib has no string for them, so they are not in the table either."""

BRANDS: dict[int, str] = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
"""``nvmlBrandType_t`` -> go-nvlib ``GetBrandAsString``."""

ADDRESSING_MODES: dict[int, str] = {0: "None", 1: "HMM", 2: "ATS"}
"""``nvmlDeviceAddressingModeType_t`` (nvml.h ``NVML_DEVICE_ADDRESSING_MODE_*``) -> the ``addressingMode``
value NVIDIA's driver publishes (``HMM`` on an A100, ``None`` on an A30: ResourceSlices posted in ksigs#717/#719)."""

# GPU-instance profile index (NVML_GPU_INSTANCE_PROFILE_*) -> (positive attributes, negative attributes).
_GI_ATTRIBUTES: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (("me",), ()),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: (("me",), ()),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: (("me.all",), ()),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: (("me.all",), ()),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX: (("gfx",), ()),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX: (("gfx",), ()),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX: (("gfx",), ()),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME: ((), ("me",)),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME: ((), ("me",)),
}


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """NVML ``busId`` -> DRA form: lowercase, a leading ``0000`` trimmed (go-nvlib ``GetPCIBusID``).

    ``00000000:CA:00.0`` -> ``0000:ca:00.0``; ``00000008:06:00.0`` -> ``0008:06:00.0``.
    """
    text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else bus_id
    text = text.split("\x00", 1)[0].strip().lower()
    if text != "0000" and text.startswith("0000") and len(text.split(":", 1)[0]) == 8:
        text = text[4:]
    return text


def mig_profile_name(
    gi_profile_index: int, gi_slices: int, ci_slices: int, memory_mib: int, device_total_bytes: int
) -> str:
    """MIG profile name as NVIDIA tools print it (go-nvlib ``MigProfileInfo.String``).

    :param gi_profile_index: the ``NVML_GPU_INSTANCE_PROFILE_*`` index (selects ``+me``/``+gfx``/``-me``).
    :param gi_slices: GPU-instance compute slices (``G``); ``ci_slices``: compute-instance slices (``C``).
    :param memory_mib: ``memorySizeMB`` of the GI profile (MiB); ``device_total_bytes``: the GPU's memory.
    """
    fraction = (memory_mib * MIB) / device_total_bytes if device_total_bytes else 0.0
    fraction = math.ceil(fraction * 8) / 8
    total_gb = (device_total_bytes + GIB - 1) // GIB
    gb = math.floor(fraction * total_gb + 0.5)  # Go math.Round: half away from zero
    positive, negative = _GI_ATTRIBUTES.get(gi_profile_index, ((), ()))
    suffix = ""
    if positive:
        suffix = "+" + ",".join(positive)
    if negative:
        suffix = "-" + ",".join(negative)
    if ci_slices == gi_slices:
        return f"{gi_slices}g.{gb}gb{suffix}"
    return f"{ci_slices}c.{gi_slices}g.{gb}gb{suffix}"


def pcie_root(sysfs_root: Path, bdf: str) -> str | None:
    """``pci<domain>:<bus>`` from the ``<sysfs_root>/bus/pci/devices/<bdf>`` link target, or ``None``.

    The link normally points to ``../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0``; the element after
    ``devices`` is the root complex (Kubernetes ``deviceattribute`` ``GetPCIeRootAttributeByPCIBusID``).
    """
    link = sysfs_root / "bus" / "pci" / "devices" / bdf
    try:
        return pcie_root_of(os.readlink(link))
    except OSError:
        return None


def sysfs_numa_node(sysfs_root: Path, bdf: str) -> int | None:
    """The kernel's ``<sysfs_root>/bus/pci/devices/<bdf>/numa_node``: the node (``>= 0``), ``-1`` for "no
    node", or ``None`` when the file is missing or unreadable (then the caller may ask NVML)."""
    try:
        value = int((sysfs_root / "bus" / "pci" / "devices" / bdf / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else -1


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _uuid_text(raw: Any) -> str:
    data = bytes(raw)
    h = data.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(slots=True)
class _GiProfile:
    index: int
    info: Any


class _Discoverer:
    def __init__(self, session: NvmlSession, sysfs_root: Path) -> None:
        self.s = session
        self.sysfs_root = sysfs_root
        self.failures: list[DiscoveryFailure] = []
        self.warnings: list[str] = []

    def fail(self, index: int, reason: str, uuid: str | None = None) -> None:
        log.warning("GPU index %d%s left out: %s", index, f" ({uuid})" if uuid else "", reason)
        self.failures.append(DiscoveryFailure(index=index, reason=reason, uuid=uuid))

    def warn(self, text: str) -> None:
        log.warning("%s", text)
        self.warnings.append(text)

    # -- GPUs --------------------------------------------------------------------------------------------

    def gpu(self, index: int) -> GpuDevice:
        s = self.s
        h = s.device(index)
        where = f"GPU index {index}"

        def core(fn: Callable[..., Any], *args: Any) -> Any:
            return s.call(fn, h, *args, context=f"{fn.__name__} on {where}")

        def opt(fn: Callable[..., Any], *args: Any) -> Any:
            return s.optional(fn, h, *args, context=f"{fn.__name__} on {where}")

        uuid = _text(core(pynvml.nvmlDeviceGetUUID))
        minor = int(core(pynvml.nvmlDeviceGetMinorNumber))
        name = _text(core(pynvml.nvmlDeviceGetName))
        brand_code = int(core(pynvml.nvmlDeviceGetBrand))
        arch_code = int(core(pynvml.nvmlDeviceGetArchitecture))
        major, minor_cc = core(pynvml.nvmlDeviceGetCudaComputeCapability)
        pci = core(pynvml.nvmlDeviceGetPciInfo)
        bus_id = normalize_pci_bus_id(pci.busId)
        brand = BRANDS.get(brand_code)
        if brand is None:
            self.warn(f"{where} ({uuid}): unknown brand code {brand_code}, published as Unknown")
            brand = "Unknown"
        arch = ARCHITECTURES.get(arch_code)
        if arch is None:
            self.warn(f"{where} ({uuid}): unknown architecture code {arch_code}, published as Unknown")
            arch = "Unknown"
        memory = opt(pynvml.nvmlDeviceGetMemoryInfo)
        serial = opt(pynvml.nvmlDeviceGetSerial)
        numa = sysfs_numa_node(self.sysfs_root, bus_id)
        if numa is None:
            numa = opt(pynvml.nvmlDeviceGetNumaNodeId)
        addressing_code = opt(pynvml.nvmlDeviceGetAddressingMode)
        addressing = None
        if addressing_code is not None:
            addressing = ADDRESSING_MODES.get(int(addressing_code))
            if addressing is None:
                self.warn(f"{where} ({uuid}): unknown addressing mode {addressing_code}, not published")
        module_id = opt(pynvml.nvmlDeviceGetModuleId)
        mig_mode = opt(pynvml.nvmlDeviceGetMigMode)
        try:
            virtualization = opt(pynvml.nvmlDeviceGetVirtualizationMode)
        except NvmlError as exc:  # an older library without the symbol: not a vGPU guest as far as we know
            if exc.code != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            virtualization = None
        return GpuDevice(
            index=index,
            minor=minor,
            uuid=uuid,
            product_name=name,
            brand=brand,
            architecture=arch,
            cuda_compute_capability=(int(major), int(minor_cc)),
            memory_bytes=int(memory.total) if memory is not None else None,
            pci_bus_id=bus_id,
            pcie_root=pcie_root(self.sysfs_root, bus_id),
            numa_node=int(numa) if numa is not None and int(numa) >= 0 else None,
            serial=_text(serial) if serial else None,
            mig_capable=mig_mode is not None,
            mig_enabled=mig_mode is not None and int(mig_mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE,
            fabric=self.fabric(h, where),
            addressing_mode=addressing,
            vgpu_guest=virtualization is not None and int(virtualization) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_VGPU,
            module_id=int(module_id) if module_id is not None else None,
        )

    def fabric(self, handle: Any, where: str) -> FabricInfo | None:
        """See :func:`read_fabric_info`."""
        return read_fabric_info(self.s, handle, where)

    def gi_profiles(self, gpu: GpuDevice) -> dict[int, _GiProfile]:
        """GI profile ID -> (profile index, info) for every profile the GPU supports."""
        h = self.s.device(gpu.index)
        out: dict[int, _GiProfile] = {}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = self.s.optional(
                    pynvml.nvmlDeviceGetGpuInstanceProfileInfo,
                    h,
                    index,
                    context=f"GPU-instance profile {index} on {gpu.name}",
                )
            except NvmlError as exc:
                if exc.code == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                    continue
                raise
            if info is not None:
                out[int(info.id)] = _GiProfile(index, info)
        return out

    def migs(self, gpu: GpuDevice) -> list[MigDevice]:
        s = self.s
        h = s.device(gpu.index)
        profiles = self.gi_profiles(gpu)
        count = int(s.call(pynvml.nvmlDeviceGetMaxMigDeviceCount, h, context=f"max MIG count of {gpu.name}"))
        found: list[MigDevice] = []
        for slot in range(count):
            mh = s.mig_device(gpu.index, slot)
            if mh is None:
                continue
            where = f"MIG slot {slot} of {gpu.name}"
            uuid = _text(s.call(pynvml.nvmlDeviceGetUUID, mh, context=f"UUID of {where}"))
            gi_id = int(s.call(pynvml.nvmlDeviceGetGpuInstanceId, mh, context=f"GI id of {where}"))
            ci_id = int(s.call(pynvml.nvmlDeviceGetComputeInstanceId, mh, context=f"CI id of {where}"))
            gi = s.call(pynvml.nvmlDeviceGetGpuInstanceById, h, gi_id, context=f"GI {gi_id} of {gpu.name}")
            gi_info = s.call(pynvml.nvmlGpuInstanceGetInfo, gi, context=f"GI {gi_id} info of {gpu.name}")
            ci = s.call(
                pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, ci_id, context=f"CI {ci_id} of GI {gi_id}"
            )
            ci_info = s.call(pynvml.nvmlComputeInstanceGetInfo, ci, context=f"CI {ci_id} info of GI {gi_id}")
            gi_profile = profiles.get(int(gi_info.profileId))
            if gi_profile is None:
                raise NvmlError(f"{where} ({uuid}): GPU-instance profile {gi_info.profileId} not reported")
            ci_profile = self.ci_profile(gi, int(ci_info.profileId), where)
            p = gi_profile.info
            gi_slices = int(p.sliceCount)
            if gpu.memory_bytes:
                profile = mig_profile_name(
                    gi_profile.index, gi_slices, int(ci_profile.sliceCount), int(p.memorySizeMB), gpu.memory_bytes
                )
            else:  # no device total to scale by: fall back to the name NVML gives the CI profile
                profile = _text(ci_profile.name).removeprefix("MIG ").strip()
            found.append(
                MigDevice(
                    parent=gpu,
                    uuid=uuid,
                    profile=profile,
                    gi_profile_id=int(p.id),
                    ci_profile_id=int(ci_info.profileId),
                    gi_id=gi_id,
                    ci_id=ci_id,
                    placement_start=int(gi_info.placement.start),
                    placement_size=int(gi_info.placement.size),
                    memory_bytes=int(p.memorySizeMB) * MIB,
                    multiprocessors=int(p.multiprocessorCount),
                    copy_engines=int(p.copyEngineCount),
                    decoders=int(p.decoderCount),
                    encoders=int(p.encoderCount),
                    jpeg_engines=int(p.jpegCount),
                    ofa_engines=int(p.ofaCount),
                )
            )
        return found

    def ci_profile(self, gi: Any, ci_profile_id: int, where: str) -> Any:
        """The compute-instance profile info (v2: ``sliceCount``, ``name``) whose ID is ``ci_profile_id``."""
        for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = self.s.optional(
                    pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                    gi,
                    index,
                    pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    context=f"compute-instance profile {index} of {where}",
                )
            except NvmlError as exc:
                if exc.code == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                    continue
                raise
            if info is not None and int(info.id) == ci_profile_id:
                return info
        raise NvmlError(f"{where}: compute-instance profile {ci_profile_id} not reported")

    # -- node --------------------------------------------------------------------------------------------

    def clique(self, gpus: list[GpuDevice]) -> Clique | None:
        """The node's clique when every fabric-attached GPU reports the same one (NVIDIA's
        ``cmd/compute-domain-kubelet-plugin/nvlib.go``).

        GPUs without fabric support, or with an all-zero cluster UUID, are in no clique and ignored. A GPU
        whose registration has not completed, or whose fabric status is an error, is reported and ignored.
        """
        members: dict[Clique, list[str]] = {}
        for gpu in gpus:
            fabric = gpu.fabric
            if fabric is None or fabric.clique is None:
                continue
            if fabric.state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
                self.warn(f"{gpu.name}: fabric registration not completed (state {fabric.state})")
                continue
            if fabric.status != 0:
                self.warn(f"{gpu.name}: fabric status {fabric.status} is not success")
                continue
            members.setdefault(fabric.clique, []).append(gpu.name)
        if len(members) > 1:
            detail = "; ".join(f"{c.id}: {', '.join(names)}" for c, names in sorted(members.items(), key=str))
            self.warn(f"GPUs disagree on the fabric clique, none is published ({detail})")
            return None
        return next(iter(members), None)


def read_fabric_info(session: NvmlSession, handle: Any, where: str) -> FabricInfo | None:
    """``nvmlDeviceGetGpuFabricInfoV`` (v3, then v2), else v1, of one GPU; ``None`` when fabric is not supported.

    Shared by discovery and the health monitor, so both read the same fields.

    pynvml passes the struct argument through unchanged, so it must be a pointer (``byref``).
    """
    s = session
    for struct in (pynvml.c_nvmlGpuFabricInfo_v3_t, pynvml.c_nvmlGpuFabricInfo_v2_t):
        info = struct()
        try:
            got = s.optional(
                pynvml.nvmlDeviceGetGpuFabricInfoV, handle, ctypes.byref(info), context=f"fabric info on {where}"
            )
        except NvmlError as exc:
            if exc.code == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
                continue
            raise
        if got is None:
            break
        return FabricInfo(
            cluster_uuid=_uuid_text(info.clusterUuid),
            clique_id=int(info.cliqueId),
            state=int(info.state),
            status=int(info.status),
            health_mask=int(info.healthMask),
            health_summary=int(getattr(info, "healthSummary", 0)),
        )
    v1 = pynvml.c_nvmlGpuFabricInfo_t()
    got_v1 = s.optional(
        pynvml.nvmlDeviceGetGpuFabricInfo, handle, ctypes.byref(v1), context=f"fabric info on {where}"
    )
    if got_v1 is None:
        return None
    return FabricInfo(
        cluster_uuid=_uuid_text(v1.clusterUuid),
        clique_id=int(v1.cliqueId),
        state=int(v1.state),
        status=int(v1.status),
    )

# -- MIG ---------------------------------------------------------------------------------------------

CI_SLICES: dict[int, int] = {
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE: 8,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE: 6,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1: 1,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL: 7,
}
"""``NVML_COMPUTE_INSTANCE_PROFILE_*`` index -> compute slices (go-nvlib ``NewMigProfile``)."""

SKIPPED_CI_PROFILES = frozenset({pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1,
                                 pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL})
"""CI profiles NVIDIA's enumeration skips (NVIDIA's ``cmd/gpu-kubelet-plugin/nvlib.go``, ksigs#1480): each has the slice
count of a regular profile, so keeping it would publish the same GI profile twice under one name."""

_REJECTED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)


def full_ci_profile_index(gi_slices: int) -> int | None:
    """The compute-instance profile index that fills a GI of ``gi_slices`` compute slices (C == G), skipping
    :data:`SKIPPED_CI_PROFILES`; ``None`` when no CI profile has that many slices.

    NVML has no call that lists a GI profile's CI profiles before a GI exists (go-nvlib says as much), so the
    choice is structural, as NVIDIA's: the CI index whose slice count equals the GI's.
    """
    for index, slices in CI_SLICES.items():
        if slices == gi_slices and index not in SKIPPED_CI_PROFILES:
            return index
    return None


def is_dynamic_mig_capable(gpu: GpuDevice) -> bool:
    """NVIDIA's ``isDynamicMIGCapable`` (updates 2b): MIG-capable, not a vGPU guest, and Hopper or newer or an
    Ampere already in MIG mode (Ampere needs a GPU reset to toggle MIG, so an Ampere with MIG off stays a full GPU).
    """
    if not gpu.mig_capable or gpu.vgpu_guest:
        return False
    return toggles_mig_without_reset(gpu) or gpu.mig_enabled


def mig_placements(session: NvmlSession, gpu: GpuDevice) -> list[MigPlacement]:
    """Every (GPU-instance profile, placement) NVML offers on ``gpu``, as abstract dynamic-MIG devices.

    Walks profile index ``0 .. NVML_GPU_INSTANCE_PROFILE_COUNT-1`` with ``nvmlDeviceGetGpuInstanceProfileInfoV``
    (v2), then ``nvmlDeviceGetGpuInstancePossiblePlacements_v2`` by profile ID; a profile either call rejects
    with NOT_SUPPORTED or INVALID_ARGUMENT is skipped, as NVIDIA's driver does (``cmd/gpu-kubelet-plugin/nvlib.go``);
    both answer whatever the MIG mode is (nvml.h). The full-GI compute instance is :func:`full_ci_profile_index`. Names
    follow :func:`mig_profile_name` (``+me``, ``+gfx``, ``-me``, ...).

    :returns: placements in profile-index order, then placement order, as NVML lists them.
    :raises NvmlError: any other NVML error (the caller leaves the GPU out of dynamic MIG).
    """
    h = session.device(gpu.index)
    out: list[MigPlacement] = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        where = f"GPU-instance profile {index} on {gpu.name}"
        try:
            info = session.call(pynvml.nvmlDeviceGetGpuInstanceProfileInfoV, h, index, context=where)
        except NvmlError as exc:
            if exc.code in _REJECTED:
                continue
            raise
        count = ctypes.c_uint(0)
        try:
            session.call(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, int(info.id), None,
                         ctypes.byref(count), context=f"possible placements of {where}")
            array = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
            session.call(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, int(info.id), array,
                         ctypes.byref(count), context=f"possible placements of {where}")
        except NvmlError as exc:
            if exc.code in _REJECTED:
                log.info("%s: NVML rejects its placements (%s); not offered", where, exc)
                continue
            raise
        slices = int(info.sliceCount)
        ci_index = full_ci_profile_index(slices)
        if ci_index is None:
            log.warning("%s: no compute-instance profile with %d slices; not offered", where, slices)
            continue
        if gpu.memory_bytes:
            profile = mig_profile_name(index, slices, slices, int(info.memorySizeMB), gpu.memory_bytes)
        else:
            profile = _text(info.name).removeprefix("MIG ").strip()
        for k in range(count.value):
            out.append(MigPlacement(
                parent=gpu, profile=profile, gi_profile_index=index, gi_profile_id=int(info.id),
                ci_profile_index=ci_index, placement_start=int(array[k].start), placement_size=int(array[k].size),
                memory_bytes=int(info.memorySizeMB) * MIB, slice_count=slices,
                multiprocessors=int(info.multiprocessorCount), copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount), encoders=int(info.encoderCount), jpeg_engines=int(info.jpegCount),
                ofa_engines=int(info.ofaCount),
            ))
    return out


def discover(session: NvmlSession, *, sysfs_root: Path = Path("/sys"), dynamic_mig: bool = False) -> NodeInventory:
    """Everything NVML reports about this node, as a :class:`NodeInventory`.

    :param session: an open :class:`NvmlSession`.
    :param sysfs_root: root of sysfs, for ``pcieRoot`` and the NUMA fallback (tests pass a fixture tree).
    :param dynamic_mig: the ``DynamicMIG`` gate: also enumerate :func:`mig_placements` of every
        :func:`is_dynamic_mig_capable` GPU into ``placements`` (a GPU whose enumeration fails is left out of
        dynamic MIG with a warning and stays a full GPU).
    :returns: the inventory; GPUs that failed are in ``failures``, node-level problems (clique
        disagreement, MIG mode without MIG devices) in ``warnings``.
    :raises NvmlError: a node-level query failed (driver version, device count).
    """
    d = _Discoverer(session, sysfs_root)
    versions = DriverVersions(
        driver=session.driver_version(),
        cuda_driver=session.cuda_driver_version(),
        nvml=session.nvml_version(),
    )
    gpus: list[GpuDevice] = []
    migs: list[MigDevice] = []
    for index in range(session.device_count()):
        try:
            gpu = d.gpu(index)
        except NvmlError as exc:
            d.fail(index, str(exc))
            continue
        if gpu.mig_enabled:
            try:
                found = d.migs(gpu)
            except NvmlError as exc:
                d.fail(index, f"MIG devices of {gpu.name} cannot be read: {exc}", gpu.uuid)
                continue
            if not found:
                d.warn(f"{gpu.name} ({gpu.uuid}) is in MIG mode but has no MIG devices; nothing is published")
            migs.extend(found)
        gpus.append(gpu)
    placements: list[MigPlacement] = []
    for gpu in gpus if dynamic_mig else ():
        if not is_dynamic_mig_capable(gpu):
            continue
        try:
            placements.extend(mig_placements(session, gpu))
        except NvmlError as exc:
            d.warn(f"{gpu.name} ({gpu.uuid}): MIG profiles cannot be enumerated ({exc}); no dynamic MIG on it")
    return NodeInventory(
        versions=versions,
        gpus=tuple(gpus),
        migs=tuple(migs),
        failures=tuple(d.failures),
        clique=d.clique(gpus),
        warnings=tuple(d.warnings),
        placements=tuple(placements),
    )
