"""Claims as the kubelet plugin sees them: references, allocation results, and what preparing returns.

Field names follow ``resource.k8s.io/v1`` (``ResourceClaim.status.allocation.devices.results[]``) and the
DRA node API (``NodePrepareResourcesResponse.claims[uid].devices[]``): ``pkg/apis/dra/v1/api.proto`` in
kubernetes/kubelet and ``resource/v1/types.go`` in kubernetes/api.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dradriver.domain.quantity import Quantity, QuantityError
from dradriver.errors import DradriverError

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
"""Set by the ResourceClaim controller on a claim it creates from a pod's ResourceClaimTemplate: the pod's
``spec.resourceClaims[].name`` (``k8s.io/api/resource/v1`` ``PodResourceClaimAnnotation``)."""


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
    :param share_id: ``shareID``: the result is one consumable share of a multi-allocatable device (KEP-5075).
    :param consumed_capacity: ``consumedCapacity`` as (capacity name, quantity) pairs in API order: how much of
        the device the share was given.
    """

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed_capacity: tuple[tuple[str, Quantity], ...] = ()

    def consumed(self) -> dict[str, int]:
        """``consumedCapacity`` as capacity name -> integer amount (fractions rounded up)."""
        return {name: -(-q.value.numerator // q.value.denominator) for name, q in self.consumed_capacity}


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
    :param pod_claim_name: the ``resource.kubernetes.io/pod-claim-name`` annotation (the pod's
        ``spec.resourceClaims[].name``) of a claim made from a ResourceClaimTemplate; ``None`` otherwise.
    :param status: the claim's whole ``status`` as the API returned it (``None`` when built by hand): what
        NVIDIA's checkpoint stores with a prepared claim (:mod:`dradriver.domain.nvcheckpoint`).
    """

    ref: ClaimRef
    results: tuple[AllocationResult, ...]
    configs: tuple[dict[str, object], ...] = field(default_factory=tuple)
    config_indices: tuple[int, ...] = field(default_factory=tuple)
    pod_claim_name: str | None = None
    status: Mapping[str, Any] | None = field(default=None, compare=False)


class ClaimError(DradriverError):
    """A claim cannot be prepared; the message names the claim and the field at fault."""

    def __init__(self, ref: ClaimRef | str, cause: str) -> None:
        super().__init__(f"claim {ref}: {cause}")
        self.ref = ref
        self.cause = cause


def json_type(value: object) -> str:
    """The JSON type name of a decoded value, for error messages: ``string``, ``number``, ``boolean``, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


_TYPE_WORDS: dict[type, str] = {bool: "a boolean", str: "a string", list: "a list", Mapping: "an object"}


def _optional(ref: ClaimRef, parent: Mapping[str, Any], key: str, kind: type, where: str, *,
              allow_null: bool = True) -> Any:
    """``parent[key]`` if it has JSON type ``kind``, ``None`` when absent (or null where Go reads null as absent).

    :param where: the field path of ``parent`` (``""`` for the top level).
    :raises ClaimError: ``<where>.<key>: must be a boolean, got string`` and the like; ``bool`` is never an
        ``int`` here and no value is coerced.
    """
    if key not in parent:
        return None
    value = parent[key]
    if value is None and allow_null:
        return None
    if isinstance(value, kind):
        return value
    path = f"{where}.{key}" if where else key
    raise ClaimError(ref, f"{path}: must be {_TYPE_WORDS[kind]}, got {json_type(value)}")


def base_request_name(request: str) -> str:
    """Strip a ``/<subrequest>`` suffix: containers reference the parent request (``firstAvailable``)."""
    return request.split("/", 1)[0]


def claim_from_object(obj: Mapping[str, Any], ref: ClaimRef, *, driver: str, pool: str) -> Claim:
    """Reduce a ``resource.k8s.io/v1`` ResourceClaim (the API's JSON as a dict) to what this node prepares.

    Checks, in the order the kubelet plugin helper applies them (``kubeletplugin/draplugin.go`` in
    k8s.io/dynamic-resource-allocation): ``metadata.uid`` equals the UID the kubelet sent (otherwise the claim was
    deleted and re-created under the same name), and ``status.allocation`` is present. Then keeps the allocation results
    whose ``driver`` is ``driver`` and whose ``pool`` is ``pool`` (claims with several drivers are normal; results
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
    metadata = _optional(ref, obj, "metadata", Mapping, "")
    uid = _optional(ref, metadata, "uid", str, "metadata") if metadata is not None else None
    if uid != ref.uid:
        raise ClaimError(ref, f"metadata.uid is {uid or '<empty>'!r}, kubelet asked for {ref.uid!r}: the claim "
                              "was deleted and re-created")
    status = _optional(ref, obj, "status", Mapping, "")
    allocation = _optional(ref, status, "allocation", Mapping, "status") if status is not None else None
    if not allocation:
        raise ClaimError(ref, "status.allocation is empty: claim is not allocated")
    devices = _optional(ref, allocation, "devices", Mapping, "status.allocation") or {}
    raw_results = _optional(ref, devices, "results", list, "status.allocation.devices") or []
    results: list[AllocationResult] = []
    our_pools: set[str] = set()
    for i, raw in enumerate(raw_results):
        where = f"status.allocation.devices.results[{i}]"
        if not isinstance(raw, Mapping):
            raise ClaimError(ref, f"{where}: must be an object, got {json_type(raw)}")
        for key in ("request", "driver", "pool", "device"):
            if not isinstance(raw.get(key), str) or not raw.get(key):
                raise ClaimError(ref, f"{where}.{key} is missing or not a string (got {json_type(raw.get(key))})")
        admin_access = _optional(ref, raw, "adminAccess", bool, where, allow_null=False)
        share_id = _optional(ref, raw, "shareID", str, where)
        if raw["driver"] != driver:
            continue
        consumed: list[tuple[str, Quantity]] = []
        for key, amount in (_optional(ref, raw, "consumedCapacity", Mapping, where) or {}).items():
            try:
                quantity = Quantity.parse(amount) if isinstance(amount, str) else None
            except QuantityError as exc:
                raise ClaimError(ref, f"{where}.consumedCapacity.{key}: {exc}") from None
            if quantity is None or quantity.value < 0:
                raise ClaimError(ref, f"{where}.consumedCapacity.{key}: must be a non-negative quantity string, got "
                                      f"{json_type(amount) if quantity is None else amount}")
            consumed.append((str(key), quantity))
        our_pools.add(raw["pool"])
        if raw["pool"] != pool:
            continue
        results.append(AllocationResult(
            request=raw["request"], driver=raw["driver"], pool=raw["pool"], device=raw["device"],
            admin_access=admin_access is True, share_id=share_id or None, consumed_capacity=tuple(consumed),
        ))
    if not results:
        if our_pools:
            raise ClaimError(ref, f"status.allocation.devices.results has devices of driver {driver} only in "
                                  f"pool(s) {', '.join(sorted(our_pools))}, none in this node's pool {pool!r}")
        raise ClaimError(ref, f"status.allocation.devices.results has no device of driver {driver}")
    raw_configs = _optional(ref, devices, "config", list, "status.allocation.devices") or []
    ours: list[tuple[int, int, dict[str, object]]] = []
    for i, entry in enumerate(raw_configs):
        where = f"status.allocation.devices.config[{i}]"
        if not isinstance(entry, Mapping):
            raise ClaimError(ref, f"{where}: must be an object, got {json_type(entry)}")
        source = _optional(ref, entry, "source", str, where)
        if source not in ("FromClass", "FromClaim"):
            raise ClaimError(ref, f"{where}.source is {source!r}: must be 'FromClass' or 'FromClaim'")
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping):
            raise ClaimError(ref, f"{where}: only opaque device configs "
                                  "(an 'opaque' field) are supported by this driver")
        opaque_driver = _optional(ref, opaque, "driver", str, f"{where}.opaque", allow_null=False)
        if opaque_driver != driver:
            continue
        requests = entry.get("requests")
        if requests is not None:
            if not isinstance(requests, list):
                raise ClaimError(ref, f"{where}.requests: must be a list of request names, got {json_type(requests)}")
            for j, name in enumerate(requests):
                if not isinstance(name, str):
                    raise ClaimError(ref, f"{where}.requests[{j}]: must be a string, got {json_type(name)}")
        rank = 0 if source == "FromClass" else 1
        ours.append((rank, i, dict(entry)))
    ours.sort(key=lambda t: (t[0], t[1]))
    annotations = _optional(ref, metadata, "annotations", Mapping, "metadata") if metadata is not None else None
    pod_claim_name = (annotations or {}).get(POD_CLAIM_NAME_ANNOTATION)
    return Claim(ref=ref, results=tuple(results), configs=tuple(c for _, _, c in ours),
                 config_indices=tuple(i for _, i, _ in ours),
                 pod_claim_name=pod_claim_name if isinstance(pod_claim_name, str) and pod_claim_name else None,
                 status=status)
