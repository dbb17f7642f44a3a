"""The node's NVLink clique ID and fabric health from NVML fabric info, with NVIDIA's strict and legacy rules.

The compute-domain kubelet plugin reads it at start and every 30 seconds (NVIDIA's
``cmd/compute-domain-kubelet-plugin/nvlib.go``, ``nvmlGpuFabricInfo_t`` in ``nvml.h``). The ID is
``<clusterUUID>.<cliqueId>`` (:func:`dradriver.domain.computedomains.format_clique_id`); ``""`` means the node is in no
multi-node NVLink clique (not MNNVL), and every GPU of the node must agree on it.

Per GPU (:func:`clique_id_of`): fabric info not supported by NVML, or state ``NOT_SUPPORTED`` -> in no clique; an
all-zero cluster UUID -> in no clique. Registration not finished (state ``NOT_STARTED`` or ``IN_PROGRESS``; NVML
reports no cluster UUID or clique until it is): in strict mode (gate ``CrashOnNVLinkFabricErrors``, NVIDIA's
default) :class:`FabricPendingError`, which the plugin waits out (NVIDIA's plugin exits and crash-loops until the
fabric manager is done, NVIDIA's #1264); in legacy mode the GPU is in no clique (and when that makes the GPUs
disagree, the registration is waited out too). Registration failed (state ``COMPLETED``, status other than
``NVML_SUCCESS``): the GPU is not fabric-attached (in no clique, and it has no say in the node's clique) and its
fabric is faulty. Health summary UNHEALTHY: the GPU keeps its clique and its fabric is faulty (NVIDIA's #626:
neither "not attached" nor healthy). Faults are in :attr:`NodeFabric.faults`
(:attr:`dradriver.domain.devices.FabricInfo.fault`); NVIDIA's strict mode exits on a failed registration instead,
and ignores the health summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pynvml

from dradriver.domain.computedomains import format_clique_id
from dradriver.domain.devices import (
    FABRIC_REGISTRATION_FAILED,
    FABRIC_STATE_COMPLETED,
    FABRIC_STATE_NAMES,
    FABRIC_STATE_NOT_SUPPORTED,
    FABRIC_UNHEALTHY,
    FabricFault,
    FabricInfo,
)
from dradriver.errors import DradriverError
from dradriver.nvml.discovery import read_fabric_info
from dradriver.nvml.session import NvmlSession

__all__ = ["FabricError", "FabricPendingError", "GpuFabric", "NodeFabric", "assess_node",
           "clique_id", "clique_id_of", "gpu_minors", "read_node_fabric"]


class FabricError(DradriverError):
    """The node's GPUs disagree on the clique; the message names the GPUs (index and UUID) and their cliques."""


class FabricPendingError(FabricError):
    """A GPU's fabric registration has not finished yet (state ``NOT_STARTED`` or ``IN_PROGRESS``; strict mode, or
    legacy mode when it makes the GPUs disagree); the message names each such GPU (index and UUID) and its state.
    Wait and read again: the fabric manager finishes it."""


@dataclass(frozen=True, slots=True)
class GpuFabric:
    """One GPU's fabric info as read: ``fabric`` is ``None`` when NVML does not support fabric info on it."""

    index: int
    uuid: str
    fabric: FabricInfo | None

    @property
    def where(self) -> str:
        """``GPU <index> (<UUID>)``, how messages name the GPU."""
        return f"GPU {self.index} ({self.uuid})"


@dataclass(frozen=True, slots=True)
class NodeFabric:
    """The node's fabric as the compute-domain plugin sees it.

    :param clique_id: the node's clique ID (``""``: in no clique).
    :param faults: each GPU whose fabric is faulty, with why (registration failed, health summary UNHEALTHY).
    """

    clique_id: str
    faults: tuple[tuple[GpuFabric, FabricFault], ...] = ()

    @property
    def healthy(self) -> bool:
        """No GPU's fabric is faulty."""
        return not self.faults

    @property
    def reason(self) -> str:
        """``""`` when healthy, else the taint value: ``registration-failed`` when any GPU's registration failed,
        else ``unhealthy``."""
        if not self.faults:
            return ""
        reasons = {fault.reason for _gpu, fault in self.faults}
        return FABRIC_REGISTRATION_FAILED if FABRIC_REGISTRATION_FAILED in reasons else FABRIC_UNHEALTHY

    @property
    def message(self) -> str:
        """``""`` when healthy, else every faulty GPU with its fault, joined by ``; ``."""
        return "; ".join(f"{gpu.where}: {fault.message}" for gpu, fault in self.faults)


def read_node_fabric(session: NvmlSession) -> list[GpuFabric]:
    """Fabric info of every GPU of the node (``nvmlDeviceGetGpuFabricInfoV`` v3/v2, else v1).

    :raises dradriver.nvml.errors.NvmlError: an NVML call failed (other than not supported).
    """
    out: list[GpuFabric] = []
    for index in range(session.device_count()):
        handle = session.device(index)
        raw = session.call(pynvml.nvmlDeviceGetUUID, handle, context=f"UUID of GPU {index}")
        uuid = raw.decode() if isinstance(raw, bytes) else str(raw)
        out.append(GpuFabric(index, uuid, read_fabric_info(session, handle, f"GPU {index} ({uuid})")))
    return out


def _cluster_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace("-", ""))


def _registering(gpu: GpuFabric) -> str:
    assert gpu.fabric is not None
    state = FABRIC_STATE_NAMES.get(gpu.fabric.state, str(gpu.fabric.state))
    return (f"{gpu.where}: NVLink fabric registration state is {state}, not COMPLETED (the fabric manager has not "
            "registered the GPU yet)")


def clique_id_of(gpu: GpuFabric, *, strict: bool = True) -> str:
    """One GPU's clique ID (``""``: in no clique) under the module's rules.

    :raises FabricPendingError: strict mode and the GPU's registration has not finished.
    """
    fabric = gpu.fabric
    if fabric is None or fabric.state == FABRIC_STATE_NOT_SUPPORTED:
        return ""
    if fabric.state != FABRIC_STATE_COMPLETED:
        if not strict:
            return ""
        raise FabricPendingError(_registering(gpu))
    if fabric.status != 0:
        return ""
    return format_clique_id(_cluster_bytes(fabric.cluster_uuid), fabric.clique_id)


def assess_node(gpus: Sequence[GpuFabric], *, strict: bool = True) -> NodeFabric:
    """The node's clique ID (the one every GPU with a registered fabric reports; ``""`` when none is in a clique, or
    there are no GPUs) and its faulty GPUs.

    :raises FabricPendingError: a GPU's registration has not finished (names every such GPU): in strict mode
        always, in legacy mode when the GPUs disagree because of it (the others are registered already).
    :raises FabricError: two GPUs report different clique IDs (one in a clique and one in none counts as
        different), naming both GPUs.
    """
    seen: dict[str, GpuFabric] = {}
    faults: list[tuple[GpuFabric, FabricFault]] = []
    pending: list[str] = []
    for gpu in gpus:
        if gpu.fabric is not None and gpu.fabric.registering:
            pending.append(_registering(gpu))
            if strict:
                continue  # legacy mode: in no clique for now
        cid = clique_id_of(gpu, strict=strict)
        fault = gpu.fabric.fault if gpu.fabric is not None else None
        if fault is not None:
            faults.append((gpu, fault))
            if fault.reason == FABRIC_REGISTRATION_FAILED:
                continue  # not fabric-attached: no say in the node's clique
        seen.setdefault(cid, gpu)
    if pending and (strict or len(seen) > 1):
        raise FabricPendingError("; ".join(pending))
    if len(seen) > 1:
        listed = "; ".join(f"{g.where}: {cid or 'no clique'}" for cid, g in seen.items())
        raise FabricError(f"GPUs of this node disagree on the NVLink clique: {listed}")
    return NodeFabric(next(iter(seen), ""), tuple(faults))


def clique_id(gpus: Sequence[GpuFabric], *, strict: bool = True) -> str:
    """The node's clique ID (:func:`assess_node`); same errors."""
    return assess_node(gpus, strict=strict).clique_id


def gpu_minors(session: NvmlSession) -> list[int]:
    """``nvmlDeviceGetMinorNumber`` of every GPU (``/dev/nvidia<minor>``), in index order.

    :raises dradriver.nvml.errors.NvmlError: an NVML call failed.
    """
    return [int(session.call(pynvml.nvmlDeviceGetMinorNumber, session.device(i), context=f"minor number of GPU {i}"))
            for i in range(session.device_count())]
