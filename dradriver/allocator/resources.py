"""Typed views of the resource.k8s.io/v1 objects the allocator reads (reference section 5).

Parsing validates only what the allocator relies on and raises :class:`InputError` naming the object and the
field (``ResourceSlice node-a-gpu: spec.devices[2].capacity.memory: quantity 'x': no digits``). Unqualified
attribute and capacity names are filed under the slice's driver as domain.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, cast

from dradriver.allocator.capacity import RequestPolicy
from dradriver.allocator.expression import AttributeValue, CelCompileError, Selector, device_variable
from dradriver.allocator.quantity import Quantity, QuantityError, parse_quantity
from dradriver.allocator.semver import Semver, SemverError
from dradriver.domain import nodeallocatable
from dradriver.errors import DradriverError

MAX_RESULTS_PER_CLAIM = 32
"""``AllocationResultsMaxSize``: at most 32 devices in one claim's allocation."""


class InputError(DradriverError):
    """An input object is malformed; the message names the object and the field."""


def _map(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: must be a mapping, got {type(value).__name__}")
    return value


def _bool(value: Any, where: str) -> bool:
    """A JSON boolean (absent or null: false); a string such as ``"false"`` or a number is an error, not truthy."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InputError(f"{where}: must be a boolean, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InputError(f"{where}: must be a list, got {type(value).__name__}")
    return value


def split_qualified(name: str, driver: str) -> tuple[str, str]:
    """``"domain/id"`` -> ``(domain, id)``; an unqualified ``"id"`` belongs to ``driver``."""
    domain, sep, ident = name.rpartition("/")
    return (domain, ident) if sep else (driver, name)


@dataclass(frozen=True)
class Taint:
    """A device taint (``key``, ``value``, ``effect`` None|NoSchedule|NoExecute)."""

    key: str
    value: str
    effect: str

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


@dataclass(frozen=True)
class Toleration:
    """A request toleration (operator ``Equal`` (default) or ``Exists``)."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        """Kubernetes toleration matching: effect (empty = all), key (empty + Exists = all), value."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass
class NodeSelection:
    """Where a slice (or a device, with per-device node selection) is available."""

    node_name: str | None = None
    node_selector: dict[str, Any] | None = None
    all_nodes: bool = False

    def matches(self, node: Node | None) -> bool:
        """True if the devices are reachable from ``node`` (``None``: only ``allNodes`` matches)."""
        if self.all_nodes:
            return True
        if node is None:
            return False
        if self.node_name is not None:
            return self.node_name == node.name
        if self.node_selector is not None:
            return node.matches(self.node_selector)
        return False


@dataclass
class Device:
    """One device of a ResourceSlice.

    :param attributes: ``(domain, id) -> int|bool|str|Semver``.
    :param capacity: ``(domain, id) -> Quantity``.
    :param consumes_counters: ``[(counter set, {counter: Quantity})]``.
    """

    name: str
    driver: str
    pool: str
    slice_name: str
    attributes: dict[tuple[str, str], AttributeValue]
    capacity: dict[tuple[str, str], Quantity]
    consumes_counters: list[tuple[str, dict[str, Quantity]]] = field(default_factory=list)
    taints: list[Taint] = field(default_factory=list)
    node_selection: NodeSelection | None = None
    allow_multiple_allocations: bool = False
    binding_conditions: list[str] = field(default_factory=list)
    binding_failure_conditions: list[str] = field(default_factory=list)
    binds_to_node: bool = False
    policies: dict[tuple[str, str], RequestPolicy] = field(default_factory=dict)
    """``capacity.<name>.requestPolicy`` by capacity key (consumable capacity)."""
    overhead: dict[str, tuple[Quantity | None, Quantity | None]] = field(default_factory=dict)
    """KEP-5517 ``nodeAllocatableResources[<resource>].overhead``: resource -> ``(perPod, perContainer)``."""
    _cel: Any = None
    shapes: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    """This device's shape per selector reads (:func:`dradriver.allocator.shapes.shape`), filled on first use."""

    @property
    def id(self) -> tuple[str, str, str]:
        """``(driver, pool, device)`` -- the DeviceID the scheduler uses."""
        return (self.driver, self.pool, self.name)

    def cel(self) -> Any:
        """The CEL ``device`` value (built once)."""
        if self._cel is None:
            self._cel = device_variable(self.driver, self.attributes, self.capacity, self.allow_multiple_allocations)
        return self._cel


@dataclass
class ResourceSlice:
    """A ResourceSlice: pool identity, node selection, devices, shared counter sets."""

    name: str
    driver: str
    pool: str
    generation: int
    slice_count: int
    selection: NodeSelection
    per_device_node_selection: bool
    devices: list[Device]
    shared_counters: dict[str, dict[str, Quantity]]


def _node_selection(spec: dict[str, Any], where: str) -> NodeSelection:
    node_name = spec.get("nodeName")
    selector = spec.get("nodeSelector")
    return NodeSelection(
        node_name=str(node_name) if node_name else None,
        node_selector=_map(selector, f"{where}.nodeSelector") if selector is not None else None,
        all_nodes=_bool(spec.get("allNodes"), f"{where}.allNodes"),
    )


def _attribute(raw: Any, where: str) -> AttributeValue:
    if type(raw) is dict and len(raw) == 1:  # the common well-formed case, checked in one step
        kind, item = next(iter(raw.items()))
        if (kind == "string" and type(item) is str) or (kind == "int" and type(item) is int) \
                or (kind == "bool" and type(item) is bool):
            return cast(AttributeValue, item)
    value = _map(raw, where)
    kinds = [k for k in ("int", "bool", "string", "version") if k in value]
    if len(kinds) != 1:
        raise InputError(f"{where}: exactly one of int, bool, string, version must be set")
    kind = kinds[0]
    item = value[kind]
    if kind == "int":
        if isinstance(item, bool) or not isinstance(item, int):
            raise InputError(f"{where}.int: must be an integer")
        return item
    if kind == "bool":
        if not isinstance(item, bool):
            raise InputError(f"{where}.bool: must be true or false")
        return item
    if kind == "string":
        return str(item)
    try:
        return _version(str(item))
    except SemverError as exc:
        raise InputError(f"{where}.version: {exc}") from None


@functools.lru_cache(maxsize=4096)
def _version(text: str) -> Semver:
    """:meth:`Semver.parse`, once per text: a fleet's GPUs publish a handful of versions (values are immutable)."""
    return Semver.parse(text)


@functools.lru_cache(maxsize=4096)
def _quantity_text(text: str) -> Quantity:
    """:func:`parse_quantity` once per text (a fleet's devices share a few capacities; values are immutable)."""
    return parse_quantity(text)


def parse_slice(obj: dict[str, Any]) -> ResourceSlice:
    """Parse a ``ResourceSlice`` object. :raises InputError: on a malformed field."""
    name = str(_map(obj.get("metadata"), "ResourceSlice metadata").get("name", "<unnamed>"))
    where = f"ResourceSlice {name}: spec"
    spec = _map(obj.get("spec"), where)
    driver = spec.get("driver")
    if not driver:
        raise InputError(f"{where}.driver: required")
    pool = _map(spec.get("pool"), f"{where}.pool")
    if not pool.get("name"):
        raise InputError(f"{where}.pool.name: required")
    pool_name = str(pool["name"])
    counters: dict[str, dict[str, Quantity]] = {}
    for i, counter_set in enumerate(_list(spec.get("sharedCounters"), f"{where}.sharedCounters")):
        cs_where = f"{where}.sharedCounters[{i}]"
        cs = _map(counter_set, cs_where)
        counters[str(cs.get("name"))] = _counters(cs.get("counters"), f"{cs_where}.counters")
    devices = []
    per_device = _bool(spec.get("perDeviceNodeSelection"), f"{where}.perDeviceNodeSelection")
    for i, raw in enumerate(_list(spec.get("devices"), f"{where}.devices")):
        d_where = f"{where}.devices[{i}]"
        dev = _map(raw, d_where)
        if not dev.get("name"):
            raise InputError(f"{d_where}.name: required")
        attributes: dict[tuple[str, str], AttributeValue] = {}
        for key, value in _map(dev.get("attributes"), f"{d_where}.attributes").items():
            attributes[split_qualified(str(key), str(driver))] = _attribute(value, f"{d_where}.attributes.{key}")
        capacity: dict[tuple[str, str], Quantity] = {}
        policies: dict[tuple[str, str], RequestPolicy] = {}
        for key, value in _map(dev.get("capacity"), f"{d_where}.capacity").items():
            cap = _map(value, f"{d_where}.capacity.{key}")
            capacity[split_qualified(str(key), str(driver))] = _quantity(
                cap.get("value"), f"{d_where}.capacity.{key}.value"
            )
            if cap.get("requestPolicy") is not None:
                policies[split_qualified(str(key), str(driver))] = _policy(
                    cap["requestPolicy"], f"{d_where}.capacity.{key}.requestPolicy")
        consumes = []
        for j, raw_consumption in enumerate(_list(dev.get("consumesCounters"), f"{d_where}.consumesCounters")):
            c_where = f"{d_where}.consumesCounters[{j}]"
            consumption = _map(raw_consumption, c_where)
            consumes.append(
                (str(consumption.get("counterSet")), _counters(consumption.get("counters"), f"{c_where}.counters"))
            )
        taints = []
        for j, raw_taint in enumerate(_list(dev.get("taints"), f"{d_where}.taints")):
            taint = _map(raw_taint, f"{d_where}.taints[{j}]")
            taints.append(
                Taint(str(taint.get("key", "")), str(taint.get("value", "") or ""), str(taint.get("effect", "")))
            )
        devices.append(
            Device(
                name=str(dev["name"]),
                driver=str(driver),
                pool=pool_name,
                slice_name=name,
                attributes=attributes,
                capacity=capacity,
                consumes_counters=consumes,
                taints=taints,
                node_selection=_node_selection(dev, d_where) if per_device else None,
                allow_multiple_allocations=_bool(dev.get("allowMultipleAllocations"),
                                                 f"{d_where}.allowMultipleAllocations"),
                binding_conditions=[
                    str(c) for c in _list(dev.get("bindingConditions"), f"{d_where}.bindingConditions")
                ],
                binding_failure_conditions=[
                    str(c) for c in _list(dev.get("bindingFailureConditions"), f"{d_where}.bindingFailureConditions")
                ],
                binds_to_node=_bool(dev.get("bindsToNode"), f"{d_where}.bindsToNode"),
                policies=policies,
                overhead=_overhead(dev.get(nodeallocatable.FIELD), f"{d_where}.{nodeallocatable.FIELD}"),
            )
        )
    return ResourceSlice(
        name=name,
        driver=str(driver),
        pool=pool_name,
        generation=int(pool.get("generation", 0) or 0),
        slice_count=int(pool.get("resourceSliceCount", 1) or 1),
        selection=_node_selection(spec, where),
        per_device_node_selection=per_device,
        devices=devices,
        shared_counters=counters,
    )


def _overhead(raw: Any, where: str) -> dict[str, tuple[Quantity | None, Quantity | None]]:
    """A device's ``nodeAllocatableResources`` (checked by :func:`dradriver.domain.nodeallocatable.field_problems`)
    reduced to its overheads; ``mapping`` entries are checked but not kept (the simulator does not model them)."""
    if raw is None:
        return {}
    problems = nodeallocatable.field_problems(raw, where)
    if problems:
        raise InputError("; ".join(problems))
    out: dict[str, tuple[Quantity | None, Quantity | None]] = {}
    for resource, entry in raw.items():
        overhead = entry.get("overhead")
        if overhead:
            per_pod, per_container = (parse_quantity(overhead[k]) if overhead.get(k) is not None else None
                                      for k in ("perPod", "perContainer"))
            out[str(resource)] = (per_pod, per_container)
    return out


def _quantity(value: Any, where: str) -> Quantity:
    if value is None:
        raise InputError(f"{where}: required")
    try:
        return _quantity_text(value) if isinstance(value, str) else parse_quantity(value)
    except QuantityError as exc:
        raise InputError(f"{where}: {exc}") from None


def _policy(raw: Any, where: str) -> RequestPolicy:
    policy = _map(raw, where)
    default = _quantity(policy["default"], f"{where}.default") if policy.get("default") is not None else None
    values = tuple(_quantity(v, f"{where}.validValues[{i}]")
                   for i, v in enumerate(_list(policy.get("validValues"), f"{where}.validValues")))
    if values and policy.get("validRange") is not None:
        raise InputError(f"{where}: at most one of validValues, validRange may be set")
    if values != tuple(sorted(set(values), key=lambda q: q.value)):
        raise InputError(f"{where}.validValues: must be ascending without duplicates")
    minimum = maximum = step = None
    if policy.get("validRange") is not None:
        valid_range = _map(policy["validRange"], f"{where}.validRange")
        minimum = _quantity(valid_range.get("min"), f"{where}.validRange.min")
        if valid_range.get("max") is not None:
            maximum = _quantity(valid_range["max"], f"{where}.validRange.max")
        if valid_range.get("step") is not None:
            step = _quantity(valid_range["step"], f"{where}.validRange.step")
    return RequestPolicy(default, values, minimum, maximum, step)


def _counters(raw: Any, where: str) -> dict[str, Quantity]:
    return {
        str(k): _quantity(_map(v, f"{where}.{k}").get("value"), f"{where}.{k}.value")
        for k, v in _map(raw, where).items()
    }


def _selectors(raw: Any, where: str) -> list[Selector]:
    selectors = []
    for i, item in enumerate(_list(raw, where)):
        expression = _map(_map(item, f"{where}[{i}]").get("cel"), f"{where}[{i}].cel").get("expression")
        if not isinstance(expression, str) or not expression.strip():
            raise InputError(f"{where}[{i}].cel.expression: required")
        try:
            selectors.append(Selector(expression))
        except CelCompileError as exc:
            raise InputError(f"{where}[{i}].cel.expression: invalid CEL: {exc}") from None
    return selectors


@dataclass
class DeviceClass:
    """A DeviceClass: its CEL selectors and opaque configs."""

    name: str
    selectors: list[Selector]
    config: list[dict[str, Any]]


def parse_device_class(obj: dict[str, Any]) -> DeviceClass:
    """Parse a ``DeviceClass``. :raises InputError: on a malformed field or invalid CEL."""
    name = str(_map(obj.get("metadata"), "DeviceClass metadata").get("name", "<unnamed>"))
    where = f"DeviceClass {name}: spec"
    spec = _map(obj.get("spec"), where)
    return DeviceClass(
        name=name,
        selectors=_selectors(spec.get("selectors"), f"{where}.selectors"),
        config=[_map(c, f"{where}.config") for c in _list(spec.get("config"), f"{where}.config")],
    )


@dataclass
class Request:
    """One device request (or one ``firstAvailable`` subrequest).

    :param name: ``req`` or, for a subrequest, ``req/sub`` as it appears in results.
    :param mode: ``ExactCount`` or ``All``.
    :param subrequests: alternatives in order, for a ``firstAvailable`` request (then the other fields are unused).
    """

    name: str
    class_name: str = ""
    selectors: list[Selector] = field(default_factory=list)
    mode: str = "ExactCount"
    count: int = 1
    admin_access: bool = False
    tolerations: list[Toleration] = field(default_factory=list)
    raw_tolerations: list[dict[str, Any]] = field(default_factory=list)
    subrequests: list[Request] = field(default_factory=list)
    capacity: dict[str, Quantity] = field(default_factory=dict)
    """``capacity.requests``: capacity name (qualified, or unqualified for the device's driver) -> amount."""

    def capacity_for(self, driver: str) -> dict[tuple[str, str], Quantity]:
        """``capacity.requests`` keyed like a device of ``driver`` files its capacities."""
        return {split_qualified(name, driver): amount for name, amount in self.capacity.items()}

    @property
    def base(self) -> str:
        """The request name without ``/subrequest``."""
        return self.name.split("/", 1)[0]


def _exact(name: str, body: dict[str, Any], where: str, allow_admin: bool) -> Request:
    class_name = body.get("deviceClassName")
    if not class_name:
        raise InputError(f"{where}.deviceClassName: required")
    mode = str(body.get("allocationMode") or "ExactCount")
    if mode not in ("ExactCount", "All"):
        raise InputError(f"{where}.allocationMode: must be ExactCount or All, got {mode!r}")
    count = body.get("count")
    if mode == "All" and count is not None:
        raise InputError(f"{where}.count: must be unset with allocationMode All")
    count = 1 if count is None else count
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise InputError(f"{where}.count: must be a positive integer")
    admin = _bool(body.get("adminAccess"), f"{where}.adminAccess")
    if admin and not allow_admin:
        raise InputError(f"{where}.adminAccess: not allowed in a firstAvailable subrequest")
    raw_tolerations = [_map(t, f"{where}.tolerations") for t in _list(body.get("tolerations"), f"{where}.tolerations")]
    tolerations = [
        Toleration(
            str(t.get("key", "") or ""),
            str(t.get("operator") or "Equal"),
            str(t.get("value", "") or ""),
            str(t.get("effect", "") or ""),
        )
        for t in raw_tolerations
    ]
    return Request(
        name=name,
        class_name=str(class_name),
        selectors=_selectors(body.get("selectors"), f"{where}.selectors"),
        mode=mode,
        count=count,
        admin_access=admin,
        tolerations=tolerations,
        raw_tolerations=raw_tolerations,
        capacity={
            str(k): _quantity(v, f"{where}.capacity.requests.{k}")
            for k, v in _map(_map(body.get("capacity"), f"{where}.capacity").get("requests"),
                             f"{where}.capacity.requests").items()
        },
    )


@dataclass
class Constraint:
    """A ``matchAttribute`` constraint over some requests (empty list = all requests)."""

    requests: list[str]
    attribute: tuple[str, str]
    text: str

    def covers(self, request_name: str) -> bool:
        """True if the result named ``req`` or ``req/sub`` falls under this constraint."""
        if not self.requests:
            return True
        return request_name in self.requests or request_name.split("/", 1)[0] in self.requests


@dataclass
class Claim:
    """A ResourceClaim to allocate (or one that is already allocated).

    :param obj: the object as read (output adds ``status.allocation`` to a copy).
    :param origin: how it came to be ("from template big-gpu for pod dra-gpu-pod"), or "".
    """

    namespace: str
    name: str
    requests: list[Request]
    constraints: list[Constraint]
    config: list[dict[str, Any]]
    obj: dict[str, Any]
    origin: str = ""

    @property
    def ref(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    @property
    def allocation(self) -> dict[str, Any] | None:
        """``status.allocation`` if the claim is already allocated."""
        status = self.obj.get("status") or {}
        allocation = status.get("allocation") if isinstance(status, dict) else None
        return allocation if isinstance(allocation, dict) else None


def parse_claim(obj: dict[str, Any], origin: str = "") -> Claim:
    """Parse a ``ResourceClaim`` (spec.devices). :raises InputError: on a malformed field or invalid CEL."""
    meta = _map(obj.get("metadata"), "ResourceClaim metadata")
    name = str(meta.get("name", "<unnamed>"))
    namespace = str(meta.get("namespace") or "default")
    where = f"ResourceClaim {namespace}/{name}: spec.devices"
    devices = _map(_map(obj.get("spec"), f"ResourceClaim {namespace}/{name}: spec").get("devices"), where)
    requests: list[Request] = []
    seen: set[str] = set()
    for i, raw in enumerate(_list(devices.get("requests"), f"{where}.requests")):
        r_where = f"{where}.requests[{i}]"
        body = _map(raw, r_where)
        req_name = body.get("name")
        if not req_name:
            raise InputError(f"{r_where}.name: required")
        if req_name in seen:
            raise InputError(f"{r_where}.name: duplicate request name {req_name!r}")
        seen.add(str(req_name))
        if ("exactly" in body) == ("firstAvailable" in body):
            raise InputError(f"{r_where}: exactly one of exactly, firstAvailable must be set")
        if "exactly" in body:
            requests.append(
                _exact(str(req_name), _map(body["exactly"], f"{r_where}.exactly"), f"{r_where}.exactly", True)
            )
        else:
            subs = []
            for j, raw_sub in enumerate(_list(body["firstAvailable"], f"{r_where}.firstAvailable")):
                s_where = f"{r_where}.firstAvailable[{j}]"
                sub = _map(raw_sub, s_where)
                if not sub.get("name"):
                    raise InputError(f"{s_where}.name: required")
                subs.append(_exact(f"{req_name}/{sub['name']}", sub, s_where, False))
            if not subs:
                raise InputError(f"{r_where}.firstAvailable: at least one subrequest required")
            requests.append(Request(name=str(req_name), subrequests=subs))
    constraints = []
    for i, raw in enumerate(_list(devices.get("constraints"), f"{where}.constraints")):
        c_where = f"{where}.constraints[{i}]"
        constraint = _map(raw, c_where)
        attribute = constraint.get("matchAttribute")
        if not attribute or "/" not in str(attribute):
            raise InputError(f"{c_where}.matchAttribute: a fully-qualified attribute name (domain/name) is required")
        names = [str(n) for n in _list(constraint.get("requests"), f"{c_where}.requests")]
        for n in names:
            if n.split("/", 1)[0] not in seen:
                raise InputError(f"{c_where}.requests: unknown request {n!r}")
        constraints.append(Constraint(names, split_qualified(str(attribute), ""), str(attribute)))
    config = [_map(c, f"{where}.config") for c in _list(devices.get("config"), f"{where}.config")]
    return Claim(namespace, name, requests, constraints, config, obj, origin)


@dataclass
class Node:
    """A Node: name and labels (for slices with ``nodeSelector``)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)

    def matches(self, selector: dict[str, Any]) -> bool:
        """Node-affinity semantics: terms are ORed, requirements within a term ANDed."""
        terms = selector.get("nodeSelectorTerms") or []
        return any(self._term(term or {}) for term in terms)

    def _term(self, term: dict[str, Any]) -> bool:
        expressions = term.get("matchExpressions") or []
        fields = term.get("matchFields") or []
        if not expressions and not fields:
            return False
        for req in expressions:
            if not _requirement(req, self.labels.get(str(req.get("key"))), str(req.get("key")) in self.labels):
                return False
        for req in fields:
            value = self.name if req.get("key") == "metadata.name" else None
            if not _requirement(req, value, value is not None):
                return False
        return True


def _requirement(req: dict[str, Any], value: str | None, present: bool) -> bool:
    operator = req.get("operator")
    values = [str(v) for v in req.get("values") or []]
    if operator == "In":
        return present and value in values
    if operator == "NotIn":
        return not present or value not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and values:
        try:
            left, right = int(str(value)), int(values[0])
        except ValueError:
            return False
        return left > right if operator == "Gt" else left < right
    return False


def parse_node(obj: dict[str, Any]) -> Node:
    """Parse a ``Node`` (name and labels)."""
    meta = _map(obj.get("metadata"), "Node metadata")
    return Node(str(meta.get("name", "")), {str(k): str(v) for k, v in _map(meta.get("labels"), "Node labels").items()})
