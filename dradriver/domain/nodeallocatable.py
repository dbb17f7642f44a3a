"""Node-allocatable overhead of devices (KEP-5517 "DRA: node allocatable resources", alpha in Kubernetes 1.37):
the host CPU and memory a pod uses because it holds a GPU, MIG or VFIO device, published per device so that the
scheduler debits it from the node's ``status.allocatable`` and the kubelet adds it to the pod's cgroups.

API (``resource.k8s.io/v1`` ``Device.nodeAllocatableResources`` in 1.37, behind the cluster's
``DRANodeAllocatableResources`` gate; the Kubernetes documentation "DRANodeAllocatableResources" and the generated
1.37 API reference): a map from a node resource name (``cpu``, ``memory``) to a ``NodeAllocatableResource`` with at
least one of ``mapping`` (a device that *is* a node resource, e.g. a CPU driver's) and ``overhead``
(``NodeAllocatableOverhead``: ``perPod`` and/or ``perContainer``, quantities). GPUs publish only ``overhead``.
For each pod referencing a claim, the overhead charged per allocated device is ``perPod + perContainer * N``,
``N`` the number of the pod's containers that reference the claim (``resources.claims``); the scheduler checks it
with the pod's own requests against the node's allocatable, and the pod's QoS class does not change.

NVIDIA's names (kubernetes-sigs/dra-driver-nvidia-gpu PR #1329, a draft as last seen): gate
``NodeAllocatableResources`` (alpha, default off), overhead per device class ``gpu`` (full GPUs) and ``mig``
(static and dynamic MIG devices) configured by the kubelet-plugin flags
``--node-allocatable-<class>-<resource>-overhead-per-<pod|container>`` with ``NODE_ALLOCATABLE_*`` environment
twins and the chart values ``nodeAllocatableOverhead.<class>.<resource>.<perPod|perContainer>``; zero or empty
values are left out, a class without values publishes nothing, and any value set with the gate off (``0``
included: NVIDIA's ``parseNodeAllocatableOverheadFlags`` counts every non-empty value) is a start-up error, after
every value was parsed. NVIDIA's third class, ``vfio``, belongs to VFIO passthrough devices (``gpu-vfio-<index>``,
published with the gate ``PassthroughSupport``).

Schema validation: the field exists in the 1.37 ResourceSlice schema (the API emulator's schemas are 1.37's,
``tools/gen_openapi.py``; ``kubernetes-validate``'s 1.34/1.35 schemas do not know it, so a slice carrying it is
validated against 1.37). The OpenAPI schema checks types only; :func:`field_problems` checks the rules the API
server's validation adds (at least one of ``mapping``/``overhead`` and of ``perPod``/``perContainer``,
non-negative quantities, ``mapping``'s exclusive branches). An API server older than 1.37, or without its
``DRANodeAllocatableResources`` gate, drops the field; the slice publisher then keeps the stored form as current
(:mod:`dradriver.kube.resourceslices`), and no overhead is accounted by that cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dradriver.domain.quantity import Quantity, QuantityError, parse_quantity

FIELD = "nodeAllocatableResources"
"""The ``Device`` field (Kubernetes 1.37)."""
DEVICE_CLASSES = ("gpu", "mig", "vfio")
"""NVIDIA's device classes: the value of the device's ``type`` attribute (``vfio``: VFIO passthrough devices)."""
RESOURCES = ("cpu", "memory")
PER = (("pod", "perPod"), ("container", "perContainer"))
"""``(flag word, API field)``."""


class OverheadError(ValueError):
    """An overhead flag value is not a non-negative quantity, or overhead is set with the gate off."""


def flag_name(device_class: str, resource: str, per: str) -> str:
    """``--node-allocatable-gpu-memory-overhead-per-pod`` (NVIDIA's spelling)."""
    return f"--node-allocatable-{device_class}-{resource}-overhead-per-{per}"


def env_name(device_class: str, resource: str, per: str) -> str:
    """``NODE_ALLOCATABLE_GPU_MEMORY_OVERHEAD_PER_POD``."""
    return flag_name(device_class, resource, per).removeprefix("--").replace("-", "_").upper()


def flag_dest(device_class: str, resource: str, per: str) -> str:
    """The parsed option's attribute name."""
    return flag_name(device_class, resource, per).removeprefix("--").replace("-", "_")


FLAG_KEYS: tuple[tuple[str, str, str], ...] = tuple(
    (c, r, p) for c in DEVICE_CLASSES for r in RESOURCES for p, _ in PER)
"""Every ``(device class, resource, per)`` with a flag, in flag-table order."""


@dataclass(frozen=True, slots=True)
class NodeAllocatableOverhead:
    """The configured overhead: ``values[(device class, resource, API field)]`` -> quantity (non-zero only).

    Empty (the default) publishes nothing.
    """

    values: Mapping[tuple[str, str, str], Quantity] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.values)

    def field_for(self, device_class: str) -> dict[str, Any] | None:
        """The ``nodeAllocatableResources`` value of a device of ``device_class``; ``None`` without overhead."""
        out: dict[str, Any] = {}
        for (cls, resource, api_field), quantity in self.values.items():
            if cls == device_class:
                out.setdefault(resource, {"overhead": {}})["overhead"][api_field] = str(quantity)
        return out or None

    def flag_text(self, device_class: str, resource: str, per: str) -> str:
        """The value of :func:`flag_name` ``(device_class, resource, per)`` that gives this overhead (``""``: none)."""
        quantity = self.values.get((device_class, resource, dict(PER)[per]))
        return "" if quantity is None else str(quantity)

    def render(self) -> str:
        """``gpu memory perPod=256Mi, ...`` for logs; ``none`` when empty."""
        return ", ".join(f"{c} {r} {f}={q}" for (c, r, f), q in self.values.items()) or "none"


def parse_overhead(values: Mapping[tuple[str, str, str], str], *, gate_enabled: bool) -> NodeAllocatableOverhead:
    """Build the overhead from the flag values (``(device class, resource, per)`` -> text, empty when unset).

    Every value is parsed first; then any value set (non-empty, ``0`` included) with the gate off is refused, as
    NVIDIA's ``parseNodeAllocatableOverheadFlags`` (PR #1329, ``cmd/gpu-kubelet-plugin/node_allocatable.go``) does.

    :raises OverheadError: a value is not a non-negative Kubernetes quantity, or a value is set while the
        ``NodeAllocatableResources`` gate is off (each message names the flag and its environment variable).
    """
    out: dict[tuple[str, str, str], Quantity] = {}
    api_fields = dict(PER)
    set_without_gate: list[str] = []
    for (device_class, resource, per), text in values.items():
        text = (text or "").strip()
        if not text:
            continue
        where = f"{flag_name(device_class, resource, per)} (env {env_name(device_class, resource, per)})"
        try:
            quantity = parse_quantity(text)
        except QuantityError as exc:
            raise OverheadError(f"{where} {text!r} is not a Kubernetes quantity: {exc}") from None
        if quantity.value < 0:
            raise OverheadError(f"{where} {text!r} is negative; an overhead is zero or more")
        if not gate_enabled:
            set_without_gate.append(where)
        elif quantity.value != 0:
            out[(device_class, resource, api_fields[per])] = quantity
    if set_without_gate:
        raise OverheadError(f"{', '.join(set_without_gate)} {'is' if len(set_without_gate) == 1 else 'are'} set but "
                            "the NodeAllocatableResources feature gate is off: enable it (--feature-gates "
                            "NodeAllocatableResources=true) or leave the overhead unset (empty; 0 counts as set)")
    return NodeAllocatableOverhead(out)


def apply_overhead(slices: Iterable[dict[str, Any]], overhead: NodeAllocatableOverhead) -> None:
    """Set ``nodeAllocatableResources`` on every device of ``slices`` (in place) from its ``type`` attribute
    (``gpu``, ``mig`` or ``vfio``); nothing when ``overhead`` is empty."""
    if not overhead:
        return
    fields = {c: overhead.field_for(c) for c in DEVICE_CLASSES}
    for resource_slice in slices:
        for device in (resource_slice.get("spec") or {}).get("devices") or []:
            kind = ((device.get("attributes") or {}).get("type") or {}).get("string")
            value = fields.get(str(kind))
            if value is not None:
                device[FIELD] = {resource: {"overhead": dict(entry["overhead"])} for resource, entry in value.items()}


def field_problems(value: object, where: str = FIELD) -> list[str]:
    """What is wrong with a device's ``nodeAllocatableResources`` (empty when valid): a map from a resource name
    to an object with at least one of ``mapping``/``overhead``; ``overhead`` with at least one of ``perPod`` and
    ``perContainer``, each a non-negative quantity; ``mapping`` with exactly one of ``deviceMultiplier`` and
    ``capacityKey`` (which needs ``capacityMultiplier``). Unknown keys are problems (strict, as the API's
    decoding is for a known type)."""
    if not isinstance(value, Mapping):
        return [f"{where}: must be an object (resource name -> NodeAllocatableResource)"]
    problems: list[str] = []
    for resource, entry in value.items():
        at = f"{where}[{resource}]"
        if not isinstance(resource, str) or not resource:
            problems.append(f"{at}: the resource name must be a non-empty string")
        if not isinstance(entry, Mapping):
            problems.append(f"{at}: must be an object with mapping and/or overhead")
            continue
        problems += [f"{at}.{k}: unknown field" for k in entry if k not in ("mapping", "overhead")]
        if "mapping" not in entry and "overhead" not in entry:
            problems.append(f"{at}: at least one of mapping, overhead must be set")
        if "overhead" in entry:
            problems += _quantities(entry["overhead"], f"{at}.overhead", ("perPod", "perContainer"), need_one=True)
        if "mapping" in entry:
            mapping = entry["mapping"]
            problems += _quantities(mapping, f"{at}.mapping", ("deviceMultiplier", "capacityMultiplier"),
                                    need_one=False, extra=("capacityKey",))
            if isinstance(mapping, Mapping):
                if ("deviceMultiplier" in mapping) == ("capacityKey" in mapping):
                    problems.append(f"{at}.mapping: exactly one of deviceMultiplier, capacityKey must be set")
                if "capacityKey" in mapping and "capacityMultiplier" not in mapping:
                    problems.append(f"{at}.mapping: capacityMultiplier must be set with capacityKey")
    return problems


def _quantities(value: object, at: str, keys: Sequence[str], *, need_one: bool,
                extra: Sequence[str] = ()) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"{at}: must be an object"]
    problems = [f"{at}.{k}: unknown field" for k in value if k not in (*keys, *extra)]
    if need_one and not any(k in value for k in keys):
        problems.append(f"{at}: at least one of {', '.join(keys)} must be set")
    for key in keys:
        if key not in value:
            continue
        if not isinstance(value[key], str | int):
            problems.append(f"{at}.{key}: {value[key]!r} is not a quantity")
            continue
        try:
            if parse_quantity(value[key]).value < 0:
                problems.append(f"{at}.{key}: {value[key]!r} must not be negative")
        except QuantityError as exc:
            problems.append(f"{at}.{key}: {value[key]!r} is not a quantity ({exc})")
    return problems
