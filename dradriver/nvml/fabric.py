"""The node's NVLink clique ID from NVML fabric info, with NVIDIA's strict and legacy rules.

The compute-domain kubelet plugin reads it at start and every 10 minutes (``nvidia-dra-driver.md`` 7.2,
``nvidia-dra-driver-updates.md`` 2c, ``gpu-facts.md`` 4.2). The ID is ``<clusterUUID>.<cliqueId>``
(:func:`dradriver.domain.computedomains.format_clique_id`); ``""`` means the node is in no multi-node NVLink
clique (not MNNVL), and every GPU of the node must agree on it.

Strict mode (gate ``CrashOnNVLinkFabricErrors``, NVIDIA's default): per GPU, fabric info not supported by NVML or
state ``NOT_SUPPORTED`` -> that GPU is in no clique; a state other than ``COMPLETED`` (registration not started or
in progress) or a status other than ``NVML_SUCCESS`` is an error (the plugin does not start); an all-zero cluster
UUID -> no clique. Legacy mode (gate off): a GPU that is not fabric-attached (state not ``COMPLETED`` or status
not success) is in no clique; only NVML call errors propagate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pynvml

from dradriver.domain.computedomains import format_clique_id
from dradriver.domain.devices import FabricInfo
from dradriver.errors import DradriverError
from dradriver.nvml.discovery import read_fabric_info
from dradriver.nvml.session import NvmlSession

__all__ = ["STATE_NAMES", "FabricError", "GpuFabric", "clique_id", "clique_id_of", "gpu_minors", "read_node_fabric"]

STATE_NOT_SUPPORTED, STATE_NOT_STARTED, STATE_IN_PROGRESS, STATE_COMPLETED = 0, 1, 2, 3
STATE_NAMES = {STATE_NOT_SUPPORTED: "NOT_SUPPORTED", STATE_NOT_STARTED: "NOT_STARTED",
               STATE_IN_PROGRESS: "IN_PROGRESS", STATE_COMPLETED: "COMPLETED"}
"""``nvmlGpuFabricState_t`` values (``gpu-facts.md`` 4.2)."""


class FabricError(DradriverError):
    """The node's fabric state does not allow a clique ID (strict mode), or its GPUs disagree; the message names
    the GPU (index and UUID) and the state or status."""


@dataclass(frozen=True, slots=True)
class GpuFabric:
    """One GPU's fabric info as read: ``fabric`` is ``None`` when NVML does not support fabric info on it."""

    index: int
    uuid: str
    fabric: FabricInfo | None


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


def clique_id_of(gpu: GpuFabric, *, strict: bool = True) -> str:
    """One GPU's clique ID (``""``: in no clique) under NVIDIA's rules (module docstring).

    :raises FabricError: strict mode and the GPU's registration is not completed or its status is an error.
    """
    fabric = gpu.fabric
    where = f"GPU {gpu.index} ({gpu.uuid})"
    if fabric is None or fabric.state == STATE_NOT_SUPPORTED:
        return ""
    if fabric.state != STATE_COMPLETED:
        if not strict:
            return ""
        state = STATE_NAMES.get(fabric.state, str(fabric.state))
        raise FabricError(f"{where}: NVLink fabric registration state is {state}, not COMPLETED (gate "
                          "CrashOnNVLinkFabricErrors: the plugin does not start until the fabric manager has "
                          "registered every GPU)")
    if fabric.status != 0:
        if not strict:
            return ""
        raise FabricError(f"{where}: NVLink fabric status is NVML error {fabric.status}, not success (gate "
                          "CrashOnNVLinkFabricErrors)")
    return format_clique_id(_cluster_bytes(fabric.cluster_uuid), fabric.clique_id)


def clique_id(gpus: Sequence[GpuFabric], *, strict: bool = True) -> str:
    """The node's clique ID: the one every GPU reports, ``""`` when none is in a clique (or there are no GPUs).

    :raises FabricError: a GPU's state breaks the strict rules, or two GPUs report different clique IDs (one in a
        clique and one in none counts as different), naming both GPUs.
    """
    seen: dict[str, GpuFabric] = {}
    for gpu in gpus:
        seen.setdefault(clique_id_of(gpu, strict=strict), gpu)
    if len(seen) > 1:
        listed = "; ".join(f"GPU {g.index} ({g.uuid}): {cid or 'no clique'}" for cid, g in seen.items())
        raise FabricError(f"GPUs of this node disagree on the NVLink clique: {listed}")
    return next(iter(seen), "")


def gpu_minors(session: NvmlSession) -> list[int]:
    """``nvmlDeviceGetMinorNumber`` of every GPU (``/dev/nvidia<minor>``), in index order.

    :raises dradriver.nvml.errors.NvmlError: an NVML call failed.
    """
    return [int(session.call(pynvml.nvmlDeviceGetMinorNumber, session.device(i), context=f"minor number of GPU {i}"))
            for i in range(session.device_count())]
