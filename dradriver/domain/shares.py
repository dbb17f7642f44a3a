"""Consumable GPU shares: NVIDIA's ``--consumable-shares`` modes, the capacity request policies they publish, and
the MPS client limits dradriver derives from what the scheduler allocated.

Facts:

* ``--consumable-shares`` / ``CONSUMABLE_SHARES``: ``disabled`` (default), ``memory``, ``unlimited`` or a positive
  integer N; anything but ``disabled`` requires the ``ConsumableShares`` gate (NVIDIA's
  ``cmd/gpu-kubelet-plugin/main.go``, ``consumable_shares.go``).
* With consumable shares, full GPUs and MIG devices get ``allowMultipleAllocations: true`` and their ``memory``
  capacity is rounded down to a multiple of 1Mi and given a request policy (NVIDIA's
  ``cmd/gpu-kubelet-plugin/consumable_shares.go``):

  ============  ==============  =============================  ==========================================
  mode          memory default  memory validRange min/max/step extra
  ============  ==============  =============================  ==========================================
  ``unlimited`` 0               0 / memory / 1Mi               --
  ``memory``    memory          1Mi / memory / 1Mi             --
  N             0               0 / memory / 1Mi               capacity ``shares`` = N, default 1, 1..N step 1
  ============  ==============  =============================  ==========================================

* The scheduler rounds each request up to the policy and records the amount in
  ``status.allocation.devices.results[].consumedCapacity`` (KEP-5075 ``DRAConsumableCapacity``;
  ``resource/v1/types.go`` in kubernetes/api; the allocator's consumable-capacity rule in
  ``structured/internal/incubating/allocator_incubating.go`` of k8s.io/dynamic-resource-allocation): a capacity the
  claim did not request consumes its ``default``.

Beyond NVIDIA (which enforces nothing on the node): every claim's containers get MPS client limits from the
amount allocated to it (:func:`share_limits`): ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from the consumed ``memory``
and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from the consumed ``shares`` (mode N) or, without a ``shares``
capacity, from the consumed fraction of the device's memory. The variables are those of NVIDIA's MPS
documentation (appendix "Environment Variables"): the pinned limit is a list of ``<device ordinal>=<limit>``
pairs, and a client of a per-GPU MPS daemon sees exactly one device, ordinal 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dradriver.errors import DradriverError

MIB = 1 << 20

DISABLED = "disabled"
MEMORY = "memory"
UNLIMITED = "unlimited"
SHARES = "shares"
"""Capacity name of NVIDIA's integer mode (``--consumable-shares=N``)."""

MEMORY_CAPACITY = "memory"

THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED_MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


class ShareModeError(DradriverError, ValueError):
    """A ``--consumable-shares`` value NVIDIA's driver would refuse (the message names the flag)."""


@dataclass(frozen=True, slots=True)
class ShareMode:
    """A ``--consumable-shares`` setting.

    :param kind: ``disabled``, ``memory``, ``unlimited`` or ``shares`` (the integer mode).
    :param shares: N of the integer mode; 0 otherwise.
    """

    kind: str = DISABLED
    shares: int = 0

    @property
    def enabled(self) -> bool:
        """True unless ``disabled``: devices are published with ``allowMultipleAllocations``."""
        return self.kind != DISABLED

    def __str__(self) -> str:
        return str(self.shares) if self.kind == SHARES else self.kind


def parse_share_mode(text: str, *, where: str = "--consumable-shares (env CONSUMABLE_SHARES)",
                     gate_enabled: bool = True) -> ShareMode:
    """Parse ``disabled``, ``memory``, ``unlimited`` or a positive integer (surrounding blanks ignored).

    :param gate_enabled: the ``ConsumableShares`` feature gate is on; any mode but ``disabled`` needs it.
    :raises ShareModeError: an unknown word, an integer below 1, or a mode without the gate.
    """
    value = text.strip()
    if value in ("", DISABLED):
        return ShareMode()
    if value in (MEMORY, UNLIMITED):
        mode = ShareMode(value)
    else:
        try:
            count = int(value, 10)
        except ValueError:
            raise ShareModeError(f"{where}: {text!r} must be 'disabled', 'memory', 'unlimited' or a positive "
                                 "integer") from None
        if count < 1:
            raise ShareModeError(f"{where}: {count} shares; the number of shares must be a positive integer")
        mode = ShareMode(SHARES, count)
    if not gate_enabled:
        raise ShareModeError(f"{where}={value} requires the ConsumableShares feature gate "
                             "(--feature-gates ConsumableShares=true)")
    return mode


def shareable_memory(memory_bytes: int) -> int:
    """The ``memory`` capacity published with consumable shares: rounded down to a multiple of 1Mi (bytes)."""
    return memory_bytes - memory_bytes % MIB


def request_policies(mode: ShareMode, memory_bytes: int | None) -> dict[str, dict[str, Any]]:
    """The capacity entries a shareable device gets, by capacity name, as integer byte/share counts.

    Returns ``{"memory": {"value", "default", "min", "max", "step"}, "shares": {...}}`` (``shares`` only in the
    integer mode; ``memory`` only when the device reports memory). The ResourceSlice builder renders them as
    ``DeviceCapacity`` objects with ``requestPolicy.default`` and ``requestPolicy.validRange``.
    """
    out: dict[str, dict[str, Any]] = {}
    if not mode.enabled:
        return out
    if memory_bytes is not None and memory_bytes >= MIB:
        memory = shareable_memory(memory_bytes)
        if mode.kind == MEMORY:
            out[MEMORY_CAPACITY] = {"value": memory, "default": memory, "min": MIB, "max": memory, "step": MIB}
        else:
            out[MEMORY_CAPACITY] = {"value": memory, "default": 0, "min": 0, "max": memory, "step": MIB}
    if mode.kind == SHARES:
        out[SHARES] = {"value": mode.shares, "default": 1, "min": 1, "max": mode.shares, "step": 1}
    return out


@dataclass(frozen=True, slots=True)
class ShareLimits:
    """The MPS client limits of one claim's share of one device.

    :param thread_percentage: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (1-100), ``None`` for no compute limit.
    :param pinned_memory_mib: ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` of device ordinal 0 in MiB, ``None`` for no
        memory limit.
    """

    thread_percentage: int | None = None
    pinned_memory_mib: int | None = None

    def env(self) -> list[str]:
        """The client environment (``KEY=value`` strings, CDI ``containerEdits.env`` form)."""
        out: list[str] = []
        if self.thread_percentage is not None:
            out.append(f"{THREAD_PERCENTAGE_ENV}={self.thread_percentage}")
        if self.pinned_memory_mib is not None:
            out.append(f"{PINNED_MEMORY_ENV}=0={self.pinned_memory_mib}M")
        return out

    def to_json(self) -> dict[str, int]:
        """``{"threads": n, "memoryMiB": m}`` without the unset ones (stored in the claim's undo record)."""
        out: dict[str, int] = {}
        if self.thread_percentage is not None:
            out["threads"] = self.thread_percentage
        if self.pinned_memory_mib is not None:
            out["memoryMiB"] = self.pinned_memory_mib
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ShareLimits:
        """Inverse of :meth:`to_json`. :raises ValueError: a value is not a positive integer."""
        threads, memory = raw.get("threads"), raw.get("memoryMiB")
        for value in (threads, memory):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"share limits {dict(raw)!r}: not positive integers")
        return cls(threads, memory)


def share_limits(mode: ShareMode, consumed: Mapping[str, int], memory_bytes: int | None) -> ShareLimits:
    """The MPS limits of a share from its ``consumedCapacity`` (capacity name -> integer amount).

    * memory: the consumed bytes, rounded down to MiB (at least 1 MiB); no limit when 0 bytes were consumed
      (modes ``unlimited`` and N default to 0: such a share asked for no memory) or when the claim holds the
      whole device;
    * compute: ``ceil(100 * shares / N)`` in the integer mode; otherwise ``ceil(100 * memory / device memory)``
      when memory was consumed; no limit at 100 %.

    :param memory_bytes: the device's memory as NVML reports it (``None`` when unknown: no compute limit from
        memory).
    :raises ValueError: a consumed amount is negative or larger than the device.
    """
    memory = consumed.get(MEMORY_CAPACITY, 0)
    if memory < 0:
        raise ValueError(f"consumedCapacity.memory {memory} is negative")
    total = shareable_memory(memory_bytes) if memory_bytes is not None else None
    if total is not None and memory > total:
        raise ValueError(f"consumedCapacity.memory {memory} exceeds the device's {total} bytes")
    pinned = max(1, memory // MIB) if 0 < memory and (total is None or memory < total) else None
    threads: int | None = None
    if mode.kind == SHARES:
        shares = consumed.get(SHARES, 1)
        if not 0 < shares <= mode.shares:
            raise ValueError(f"consumedCapacity.shares {shares} is outside 1..{mode.shares}")
        threads = math.ceil(100 * shares / mode.shares)
    elif memory > 0 and total:
        threads = max(1, math.ceil(100 * memory / total))
    if threads is not None and threads >= 100:
        threads = None
    return ShareLimits(threads, pinned)
