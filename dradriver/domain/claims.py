"""Claims as the kubelet plugin sees them: references, allocation results, and what preparing returns.

Field names follow ``resource.k8s.io/v1`` (``ResourceClaim.status.allocation.devices.results[]``) and the
DRA node API (``NodePrepareResourcesResponse.claims[uid].devices[]``); reference
``kubelet-dra-protocol.md`` sections 2.1 and 5.3.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dradriver.errors import DradriverError


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """The claim identity the kubelet sends: ``Claim{namespace, uid, name}``."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True, slots=True)
class AllocationResult:
    """One entry of ``status.allocation.devices.results[]``.

    :param request: request name, ``"<request>"`` or ``"<request>/<subrequest>"``.
    :param admin_access: ``adminAccess``; admin-access results may share a device with another claim.
    """

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as returned to the kubelet (DRA ``Device`` message).

    :param request_names: requests this device serves, with any ``/<subrequest>`` suffix removed.
    :param cdi_device_ids: fully-qualified CDI device names, e.g. ``k8s.gpu.nvidia.com/claim=<uid>-gpu-0``.
    """

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """Outcome of preparing one claim: devices, or an error string naming the claim and the cause."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the claim was prepared."""
        return not self.error


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim fetched from the API server, reduced to what node preparation needs.

    :param results: only the allocation results whose driver is ours and whose pool is this node.
    :param configs: opaque device configs for our driver (``status.allocation.devices.config[]``), raw
        entries (``source``, ``requests``, ``opaque.driver``, ``opaque.parameters`` as the API returned them),
        lowest precedence first.
    :param config_indices: for each entry of ``configs``, its index in ``status.allocation.devices.config[]``
        (for error messages); empty when the claim was built by hand (then positions in ``configs`` are used).
    """

    ref: ClaimRef
    results: tuple[AllocationResult, ...]
    configs: tuple[dict[str, object], ...] = field(default_factory=tuple)
    config_indices: tuple[int, ...] = field(default_factory=tuple)


class ClaimError(DradriverError):
    """A claim cannot be prepared; the message names the claim and the field at fault."""

    def __init__(self, ref: ClaimRef | str, cause: str) -> None:
        super().__init__(f"claim {ref}: {cause}")
        self.ref = ref
        self.cause = cause


def base_request_name(request: str) -> str:
    """Strip a ``/<subrequest>`` suffix: containers reference the parent request (``firstAvailable``)."""
    return request.split("/", 1)[0]


def claim_from_object(obj: Mapping[str, Any], ref: ClaimRef, *, driver: str, pool: str) -> Claim:
    """Reduce a ``resource.k8s.io/v1`` ResourceClaim (the API's JSON as a dict) to what this node prepares.

    Checks, in the order the kubelet plugin helper applies them (``kubelet-dra-protocol.md`` §4.3):
    ``metadata.uid`` equals the UID the kubelet sent (otherwise the claim was deleted and re-created under
    the same name), and ``status.allocation`` is present. Then keeps the allocation results whose
    ``driver`` is ``driver`` and whose ``pool`` is ``pool`` (claims with several drivers are normal; results
    for other drivers are not ours to prepare), and the ``status.allocation.devices.config[]`` entries
    whose ``opaque.driver`` is ``driver``, class configs (``source: FromClass``) before claim configs
    (``FromClaim``), each group in API order, so a later entry overrides an earlier one. As NVIDIA's
    ``GetOpaqueDeviceConfigs`` does, a config entry without ``opaque`` (a future, non-opaque config type) or
    with a ``source`` other than ``FromClass``/``FromClaim`` is an error, whichever driver it is meant for.

    :param pool: this node's pool name (the node name).
    :raises ClaimError: naming the claim and the field: UID mismatch, not allocated, a malformed result,
        or no result for this driver on this node, a non-opaque config or a config with an unknown source.
    """
    if not isinstance(obj, Mapping):
        raise ClaimError(ref, f"the API returned {type(obj).__name__}, not a ResourceClaim object")
    metadata = obj.get("metadata")
    uid = metadata.get("uid", "") if isinstance(metadata, Mapping) else ""
    if uid != ref.uid:
        raise ClaimError(ref, f"metadata.uid is {uid or '<empty>'!r}, kubelet asked for {ref.uid!r}: the claim "
                              "was deleted and re-created")
    status = obj.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    if not isinstance(allocation, Mapping) or not allocation:
        raise ClaimError(ref, "status.allocation is empty: claim is not allocated")
    devices = allocation.get("devices") or {}
    if not isinstance(devices, Mapping):
        raise ClaimError(ref, "status.allocation.devices is not an object")
    raw_results = devices.get("results")
    raw_results = [] if raw_results is None else raw_results
    if not isinstance(raw_results, list):
        raise ClaimError(ref, "status.allocation.devices.results is not a list")
    results: list[AllocationResult] = []
    our_pools: set[str] = set()
    for i, raw in enumerate(raw_results):
        where = f"status.allocation.devices.results[{i}]"
        if not isinstance(raw, Mapping):
            raise ClaimError(ref, f"{where} is not an object")
        for key in ("request", "driver", "pool", "device"):
            if not isinstance(raw.get(key), str) or not raw.get(key):
                raise ClaimError(ref, f"{where}.{key} is missing or not a string")
        if raw["driver"] != driver:
            continue
        our_pools.add(raw["pool"])
        if raw["pool"] != pool:
            continue
        share_id = raw.get("shareID")
        results.append(AllocationResult(
            request=raw["request"], driver=raw["driver"], pool=raw["pool"], device=raw["device"],
            admin_access=bool(raw.get("adminAccess") or False),
            share_id=share_id if isinstance(share_id, str) and share_id else None,
        ))
    if not results:
        if our_pools:
            raise ClaimError(ref, f"status.allocation.devices.results has devices of driver {driver} only in "
                                  f"pool(s) {', '.join(sorted(our_pools))}, none in this node's pool {pool!r}")
        raise ClaimError(ref, f"status.allocation.devices.results has no device of driver {driver}")
    raw_configs = devices.get("config")
    raw_configs = [] if raw_configs is None else raw_configs
    if not isinstance(raw_configs, list):
        raise ClaimError(ref, "status.allocation.devices.config is not a list")
    ours: list[tuple[int, int, dict[str, object]]] = []
    for i, entry in enumerate(raw_configs):
        if not isinstance(entry, Mapping):
            raise ClaimError(ref, f"status.allocation.devices.config[{i}] is not an object")
        source = entry.get("source")
        if source not in ("FromClass", "FromClaim"):
            raise ClaimError(ref, f"status.allocation.devices.config[{i}].source is {source!r}: must be "
                                  "'FromClass' or 'FromClaim'")
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping):
            raise ClaimError(ref, f"status.allocation.devices.config[{i}]: only opaque device configs "
                                  "(an 'opaque' field) are supported by this driver")
        if opaque.get("driver") != driver:
            continue
        rank = 0 if source == "FromClass" else 1
        ours.append((rank, i, dict(entry)))
    ours.sort(key=lambda t: (t[0], t[1]))
    return Claim(ref=ref, results=tuple(results), configs=tuple(c for _, _, c in ours),
                 config_indices=tuple(i for _, i, _ in ours))
