"""The structured allocator: kube-scheduler's algorithm for DRA claims, on one node at a time.

Follows ``k8s.io/dynamic-resource-allocation/structured/internal/incubating`` (reference
``structured/internal/incubating/allocator_incubating.go`` in k8s.io/dynamic-resource-allocation) with the gates a
1.34/1.35 cluster enables (admin access, prioritized list, partitionable devices, device taints):

1. gather pools reachable from the node (``nodeName``, ``allNodes``, ``nodeSelector``, per-device node
   selection; slices with shared counters always), keep each pool's highest generation, mark pools
   incomplete (slice count) or invalid (duplicate devices, dangling counter sets);
2. depth-first search over claims, requests, (sub)requests in order and devices in order (pools sorted by
   driver and name, slices by name); a device is usable when it is not in use (admin access ignores other
   claims), passes the class and request selectors, is reachable, fits the shared counters and has no
   untolerated NoSchedule/NoExecute taint, and keeps every ``matchAttribute`` constraint; the first complete
   solution wins;
3. results in allocation order with ``adminAccess``/``tolerations`` copied, class configs then claim configs,
   and the node selector for the node.

Consumable capacity (``DRAConsumableCapacity``, :mod:`dradriver.allocator.capacity`): a device with
``allowMultipleAllocations`` is never "in use"; each allocation takes the capacity its request asks for, rounded
up by the request policy, and gets a fresh ``shareID`` and its ``consumedCapacity``; the device is usable while
every capacity still fits, and the verdict names the capacity and the device that ran out.

Devices are picked in increasing candidate order within a request, which finds the same first solution as
the scheduler's permutation search with less work.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from dradriver.allocator import capacity as consumable
from dradriver.allocator.expression import Outcome, Selector
from dradriver.allocator.quantity import QuantityError, parse_quantity
from dradriver.allocator.resources import (
    MAX_RESULTS_PER_CLAIM,
    Claim,
    Constraint,
    Device,
    DeviceClass,
    Node,
    Request,
    ResourceSlice,
    split_qualified,
)
from dradriver.allocator.shapes import ShapeCache
from dradriver.errors import DradriverError

SEARCH_STEP_LIMIT = 200_000
"""Devices tried before the search gives up (the scheduler bounds its search by time instead)."""

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


class AllocationError(DradriverError):
    """A claim cannot be allocated; the message says why (``cannot allocate claim ns/name: ...``)."""


@dataclass
class Pool:
    """Devices of one (driver, pool) at its newest generation, as seen from one node."""

    driver: str
    name: str
    generation: int
    slices: list[ResourceSlice]
    devices: list[Device] = field(default_factory=list)
    counters: dict[str, dict[str, Fraction]] = field(default_factory=dict)
    incomplete: str | None = None
    invalid: str | None = None


class SliceIndex:
    """ResourceSlices arranged for :func:`gather_pools`: built once, so gathering one node's pools costs that
    node's slices plus the slices every node may reach, not every slice of the fleet.

    :param slices: every ResourceSlice known.
    """

    def __init__(self, slices: Sequence[ResourceSlice]) -> None:
        self.newest: dict[tuple[str, str], int] = {}
        """Highest generation per (driver, pool)."""
        for s in slices:
            key = (s.driver, s.pool)
            self.newest[key] = max(self.newest.get(key, s.generation), s.generation)
        self.present: dict[tuple[str, str], int] = {}
        """Slices published at the newest generation, per (driver, pool)."""
        self.by_node: dict[str, list[ResourceSlice]] = {}
        """Slices bound to one node by ``nodeName`` alone, per node name."""
        self.shared: list[ResourceSlice] = []
        """Slices any node may reach (``allNodes``, ``nodeSelector``, per-device selection, shared counters)."""
        for s in sorted(slices, key=lambda x: x.name):
            key = (s.driver, s.pool)
            if s.generation != self.newest[key]:
                continue
            self.present[key] = self.present.get(key, 0) + 1
            bound = s.selection.node_name
            if bound is not None and not s.selection.all_nodes and not s.per_device_node_selection \
                    and not s.shared_counters:
                self.by_node.setdefault(bound, []).append(s)
            else:
                self.shared.append(s)

    def candidates(self, node: Node | None) -> list[ResourceSlice]:
        """Newest-generation slices ``node`` may reach, in name order."""
        own = self.by_node.get(node.name, []) if node is not None else []
        if not own:
            return self.shared
        if not self.shared:
            return own
        return sorted([*own, *self.shared], key=lambda x: x.name)


def gather_pools(slices: Sequence[ResourceSlice], node: Node | None, index: SliceIndex | None = None) -> list[Pool]:
    """Pools reachable from ``node`` (``None``: only ``allNodes`` slices), sorted by (driver, pool).

    :param index: :class:`SliceIndex` of ``slices`` (built here when not given).
    """
    index = index or SliceIndex(slices)
    pools: dict[tuple[str, str], Pool] = {}
    for s in index.candidates(node):
        key = (s.driver, s.pool)
        reachable = s.selection.matches(node) or bool(s.shared_counters)
        if s.per_device_node_selection:
            reachable = any(d.node_selection is not None and d.node_selection.matches(node) for d in s.devices)
        if not reachable:
            continue
        pool = pools.setdefault(key, Pool(s.driver, s.pool, s.generation, []))
        pool.slices.append(s)
        for d in s.devices:
            if s.per_device_node_selection and not (d.node_selection and d.node_selection.matches(node)):
                continue
            if not s.per_device_node_selection and not s.selection.matches(node):
                continue
            pool.devices.append(d)
    for key, pool in pools.items():
        expected = max(s.slice_count for s in pool.slices)
        present = index.present[key]
        if present < expected:
            pool.incomplete = f"pool {pool.name} is incomplete ({present} of {expected} slices published)"
        names: set[str] = set()
        for s in pool.slices:
            for set_name, counters in s.shared_counters.items():
                if set_name in pool.counters:
                    pool.invalid = f"pool {pool.name} is invalid: counter set {set_name} defined twice"
                pool.counters[set_name] = {k: q.value for k, q in counters.items()}
        for d in pool.devices:
            if d.name in names:
                pool.invalid = f"pool {pool.name} is invalid: device {d.name} listed twice"
            names.add(d.name)
        for d in pool.devices:
            for set_name, counters in d.consumes_counters:
                missing = [c for c in counters if c not in pool.counters.get(set_name, {})]
                if set_name not in pool.counters or missing:
                    pool.invalid = (
                        f"pool {pool.name} is invalid: device {d.name} consumes unknown counter "
                        f"{set_name}/{(missing or ['*'])[0]}"
                    )
    return [pools[k] for k in sorted(pools)]


@dataclass(frozen=True)
class Verdict:
    """Why a device can or cannot serve a request.

    :param stage: ``pool``, ``in-use``, ``class``, ``request``, ``binding``, ``taint``, ``counters``, ``capacity``
        or ``accepted``.
    :param reason: the sentence ``explain`` prints.
    :param selector: index (0-based) of the rejecting selector, for ``class``/``request``.
    """

    stage: str
    reason: str
    selector: int = -1
    outcome: Outcome | None = None
    counter: tuple[str, str] | None = None
    """``counters`` stage: the ``(counter set, counter)`` that ran out (the first one checked)."""

    @property
    def accepted(self) -> bool:
        """True if the device can serve the request on its own."""
        return self.stage == "accepted"


@dataclass
class Pick:
    """One tentative result: which device serves which (sub)request of which claim."""

    claim: int
    request: Request
    device: Device
    pool: Pool
    consumed: consumable.Consumption | None = None


class Allocator:
    """Allocate claims against slices and classes (reference section 6.3).

    :param slices: every ResourceSlice known.
    :param classes: DeviceClasses by name.
    :param nodes: known Nodes by name (their labels matter for ``nodeSelector`` slices).
    :param allocated: claims already allocated; their non-admin results are devices in use, or, with a
        ``shareID``, shares whose ``consumedCapacity`` is taken from the device.
    :param share_ids: makes the ``shareID`` of each new share (default: random UUIDs, as the scheduler does).
    :param per_shape: evaluate each selector once per device shape (:mod:`.shapes`); ``False`` evaluates it on
        every device (the same results, slower: the benchmark's baseline).
    :param binding_conditions: the scheduler's gate ``DRADeviceBindingConditions`` (KEP-5007): devices with
        ``bindingConditions`` are selectable, their results carry ``bindingConditions`` and
        ``bindingFailureConditions``, and a ``bindsToNode`` device pins the allocation to the node; off (the
        1.34/1.35 default), such devices are never picked.
    """

    def __init__(
        self,
        slices: Sequence[ResourceSlice],
        classes: dict[str, DeviceClass],
        nodes: dict[str, Node] | None = None,
        allocated: Iterable[Claim] = (),
        share_ids: Callable[[], str] | None = None,
        per_shape: bool = True,
        binding_conditions: bool = False,
    ) -> None:
        self.slices = list(slices)
        self.binding_conditions = binding_conditions
        self.classes = classes
        self.nodes = dict(nodes or {})
        self.in_use: dict[tuple[str, str, str], str] = {}
        self.consumed: dict[tuple[str, str, str], dict[consumable.CapacityKey, Fraction]] = {}
        """Capacity taken by existing shares, per device ID (consumable capacity)."""
        self.shares: list[tuple[str, tuple[str, str, str], dict[consumable.CapacityKey, Fraction]]] = []
        """Every share: (claim ``namespace/name``, device ID, what it consumes)."""
        self.share_ids = share_ids or (lambda: str(uuid.uuid4()))
        self._selector_cache: dict[tuple[int, tuple[str, str, str]], list[Outcome]] = {}
        self._index: SliceIndex | None = None
        self._pools: dict[str | None, tuple[Node | None, list[Pool]]] = {}
        self.shapes = ShapeCache(per_shape)
        """Selector outcomes and their diagnosis per device shape."""
        for claim in allocated:
            self.mark_allocated(claim)

    # ------------------------------------------------------------------------------------------ inputs

    def mark_allocated(self, claim: Claim) -> None:
        """Record the devices of an allocated claim as in use (admin-access results excluded); a result with a
        ``shareID`` is a share of a multi-allocatable device and takes its ``consumedCapacity`` instead.

        :raises AllocationError: a ``consumedCapacity`` amount is not a quantity.
        """
        allocation = claim.allocation or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            key = (str(result.get("driver")), str(result.get("pool")), str(result.get("device")))
            if result.get("shareID"):
                taken = self.consumed.setdefault(key, {})
                share: dict[consumable.CapacityKey, Fraction] = {}
                self.shares.append((claim.ref, key, share))
                for name, amount in (result.get("consumedCapacity") or {}).items():
                    try:
                        value = parse_quantity(str(amount)).value
                    except QuantityError as exc:
                        raise AllocationError(f"claim {claim.ref}: status.allocation consumedCapacity.{name}: "
                                              f"{exc}") from None
                    capacity_key = split_qualified(str(name), key[0])
                    taken[capacity_key] = taken.get(capacity_key, Fraction(0)) + value
                    share[capacity_key] = share.get(capacity_key, Fraction(0)) + value
            elif not result.get("adminAccess"):
                self.in_use[key] = claim.ref

    def consumption_without(
        self, ref: str | None
    ) -> dict[tuple[str, str, str], dict[consumable.CapacityKey, Fraction]]:
        """Capacity taken per device by every share except those of claim ``ref`` (``None``: all shares)."""
        out: dict[tuple[str, str, str], dict[consumable.CapacityKey, Fraction]] = {}
        for owner, device, amounts in self.shares:
            if owner == ref:
                continue
            taken = out.setdefault(device, {})
            for key, amount in amounts.items():
                taken[key] = taken.get(key, Fraction(0)) + amount
        return out

    def node_names(self) -> list[str]:
        """Every node known: Node objects plus ``nodeName`` of slices and devices, sorted."""
        names = set(self.nodes)
        for s in self.slices:
            if s.selection.node_name:
                names.add(s.selection.node_name)
            for d in s.devices:
                if d.node_selection is not None and d.node_selection.node_name:
                    names.add(d.node_selection.node_name)
        return sorted(names)

    def pools(self, node: Node | None) -> list[Pool]:
        """:func:`gather_pools` for ``node`` over this allocator's slices (indexed once; the pools of a node are
        kept, since allocating and explaining gather them again; they are read, never changed)."""
        if self._index is None:
            self._index = SliceIndex(self.slices)
        key = node.name if node is not None else None
        kept = self._pools.get(key)
        if kept is None or kept[0] != node:
            kept = self._pools[key] = (node, gather_pools(self.slices, node, self._index))
        return kept[1]

    def node(self, name: str | None) -> Node | None:
        """The Node called ``name`` (an unlabelled one if only slices mention it)."""
        if name is None:
            return None
        return self.nodes.get(name) or Node(name)

    def check_classes(self, claim: Claim) -> None:
        """:raises AllocationError: a request names a DeviceClass that does not exist, or too many devices."""
        minimum = 0
        for request in claim.requests:
            alternatives = request.subrequests or [request]
            for alt in alternatives:
                if alt.class_name not in self.classes:
                    raise AllocationError(
                        f"cannot allocate claim {claim.ref}: request {alt.name!r} uses device class "
                        f"{alt.class_name!r}, which does not exist"
                    )
            minimum += min(alt.count if alt.mode == "ExactCount" else 0 for alt in alternatives)
        if minimum > MAX_RESULTS_PER_CLAIM:
            raise AllocationError(
                f"cannot allocate claim {claim.ref}: it asks for {minimum} devices, at most "
                f"{MAX_RESULTS_PER_CLAIM} fit in one allocation"
            )

    # ------------------------------------------------------------------------------------------ verdicts

    def selector_outcomes(self, selectors: list[Selector], device: Device, cache_key: int) -> list[Outcome]:
        """Outcomes of ``selectors`` on ``device`` up to the first that does not match (cached)."""
        if self.shapes.enabled:
            outcomes = []
            for selector in selectors:
                outcomes.append(self.shapes.outcome(selector, device))
                if not outcomes[-1].matched:
                    break
            return outcomes
        key = (cache_key, device.id)
        cached = self._selector_cache.get(key)
        if cached is None:
            cached = []
            for selector in selectors:
                outcome = selector.evaluate(device.cel())
                cached.append(outcome)
                if not outcome.matched:
                    break
            self._selector_cache[key] = cached
        return cached

    def static_verdict(self, request: Request, device: Device, pool: Pool) -> Verdict:
        """Checks that do not depend on other picks: pool state, selectors, binding conditions."""
        if pool.incomplete:
            return Verdict("pool", pool.incomplete)
        if pool.invalid:
            return Verdict("pool", pool.invalid)
        device_class = self.classes[request.class_name]
        for stage, selectors in (("class", device_class.selectors), ("request", request.selectors)):
            outcomes = self.selector_outcomes(selectors, device, id(selectors))
            for index, outcome in enumerate(outcomes):
                if not outcome.matched:
                    return Verdict(stage, "", index, outcome)
        if device.binding_conditions and not self.binding_conditions:
            return Verdict("binding", "has binding conditions (DRADeviceBindingConditions is not enabled)")
        return Verdict("accepted", "accepted")

    def untolerated(self, request: Request, device: Device) -> list[str]:
        """Taints of ``device`` with a blocking effect that no toleration of ``request`` tolerates."""
        return [
            str(t)
            for t in device.taints
            if t.effect in BLOCKING_EFFECTS and not any(tol.tolerates(t) for tol in request.tolerations)
        ]

    def counter_shortfall(self, device: Device, pool: Pool, used: dict[tuple[str, str, str], Fraction]) -> str | None:
        """Why ``device`` does not fit its pool's shared counters given ``used``, or ``None``."""
        short = self.exhausted_counter(device, pool, used)
        return short[2] if short else None

    def exhausted_counter(
        self, device: Device, pool: Pool, used: dict[tuple[str, str, str], Fraction]
    ) -> tuple[str, str, str] | None:
        """``(counter set, counter, reason)`` of the first counter ``device`` would overdraw, or ``None``."""
        for set_name, counters in device.consumes_counters:
            for counter, amount in counters.items():
                available = pool.counters.get(set_name, {}).get(counter, Fraction(0))
                taken = used.get((pool.driver, pool.name, f"{set_name}/{counter}"), Fraction(0))
                if taken + amount.value > available:
                    from dradriver.allocator.quantity import Quantity

                    left = Quantity.of(max(available - taken, Fraction(0)), amount.format)
                    reason = f"shared counter {set_name}/{counter} exhausted: needs {amount}, {left} left"
                    return set_name, counter, reason
        return None

    def baseline_counters(self, pools: list[Pool]) -> dict[tuple[str, str, str], Fraction]:
        """Counters consumed by devices already in use, per ``(driver, pool, "set/counter")``."""
        used: dict[tuple[str, str, str], Fraction] = {}
        for pool in pools:
            for device in pool.devices:
                if device.id in self.in_use:
                    _consume(used, pool, device, +1)
        return used

    # ------------------------------------------------------------------------------------------ search

    def allocate(
        self, claims: Sequence[Claim], node_name: str | None = None,
        node_fit: Callable[[str | None, list[dict[str, Any]]], str] | None = None,
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """Allocate ``claims`` together (one pod's claims) on one node.

        :param node_name: the node to use; ``None`` tries every known node in name order (and, if no node is
            known at all, allocates from ``allNodes`` slices only).
        :param node_fit: ``(node, allocations) -> why the Pod does not fit that node with them, or ""`` (node CPU
            and memory with the devices' overhead, :mod:`.noderesources`); a node it refuses is skipped, its reason
            kept for the error.
        :returns: ``(node name or None, [status.allocation per claim])``; the devices become in use.
        :raises AllocationError: ``cannot allocate claim ns/name: <reason>``.
        """
        for claim in claims:
            self.check_classes(claim)
        candidates: list[str | None]
        if node_name is not None:
            candidates = [node_name]
        else:
            candidates = list(self.node_names()) or [None]
        reasons: list[str] = []
        for candidate in candidates:
            node = self.node(candidate)
            pools = self.pools(node)
            search = _Search(self, claims, pools)
            if search.run():
                allocations = [search.allocation(i, node) for i in range(len(claims))]
                misfit = node_fit(candidate, allocations) if node_fit is not None else ""
                if misfit:
                    reasons.append(f"{misfit} on node {candidate}")
                    continue
                for pick in search.picks:
                    if pick.consumed is not None:
                        taken = self.consumed.setdefault(pick.device.id, {})
                        self.shares.append((claims[pick.claim].ref, pick.device.id, dict(pick.consumed.amounts)))
                        for capacity_key, amount in pick.consumed.amounts.items():
                            taken[capacity_key] = taken.get(capacity_key, Fraction(0)) + amount
                    elif not pick.request.admin_access:
                        self.in_use[pick.device.id] = claims[pick.claim].ref
                return candidate, allocations
            reasons.append(self.diagnose(claims, pools, search, candidate))
        names = ", ".join(c.ref for c in claims)
        if len(reasons) == 1:
            raise AllocationError(f"cannot allocate claim {names}: {reasons[0]}")
        raise AllocationError(f"cannot allocate claim {names}: no node fits: " + "; ".join(reasons))

    def diagnose(self, claims: Sequence[Claim], pools: list[Pool], search: _Search, node: str | None) -> str:
        """One sentence saying why ``claims`` do not fit on ``node``."""
        where = f"on node {node}" if node else "on any node (no node known; only allNodes slices count)"
        if search.gave_up:
            return f"search gave up after {SEARCH_STEP_LIMIT} steps {where}"
        used = self.baseline_counters(pools)
        for claim in claims:
            for request in claim.requests:
                shortages: list[str] = []
                for alt in request.subrequests or [request]:
                    total, usable = 0, 0
                    rejected: dict[str, int] = {}
                    first_reason: dict[str, str] = {}
                    for pool in pools:
                        for device in pool.devices:
                            total += 1
                            verdict = self.verdict(alt, device, pool, used, claim)
                            if verdict.accepted:
                                usable += 1
                            else:
                                label = _stage_label(verdict)
                                rejected[label] = rejected.get(label, 0) + 1
                                if verdict.stage == "capacity":
                                    first_reason.setdefault(label, verdict.reason)
                    need = (
                        alt.count
                        if alt.mode == "ExactCount"
                        else max(
                            1, total - sum(v for k, v in rejected.items() if k.endswith("selector") or k == "pool")
                        )
                    )
                    if usable >= need and (alt.mode == "ExactCount" or usable > 0):
                        shortages = []
                        break
                    detail = ", ".join(f"{n} {label}" + (f": {first_reason[label]}" if label in first_reason else "")
                                       for label, n in rejected.items())
                    amount = (
                        f"{alt.count} device{'s' if alt.count != 1 else ''}"
                        if alt.mode == "ExactCount"
                        else "all matching devices"
                    )
                    shortages.append(
                        f"request {alt.name!r} needs {amount}, {usable} of {total} devices {where} qualify"
                        + (f" ({detail})" if detail else "")
                    )
                if shortages:
                    return "; ".join(shortages)
            for constraint in claim.constraints:
                covered = ", ".join(constraint.requests) or "all requests"
                return f"no devices {where} share the same {constraint.text} across {covered}"
        return (
            f"no combination of devices {where} satisfies every request together "
            f"(shared counters or the {MAX_RESULTS_PER_CLAIM}-result limit)"
        )

    def verdict(
        self, request: Request, device: Device, pool: Pool, used: dict[tuple[str, str, str], Fraction], claim: Claim
    ) -> Verdict:
        """Full per-device verdict against the cluster state (not other tentative picks)."""
        holder = self.in_use.get(device.id)
        if holder is not None and not request.admin_access:
            return Verdict("in-use", f"already allocated to {holder}")
        verdict = self.static_verdict(request, device, pool)
        if not verdict.accepted:
            return verdict
        taints = self.untolerated(request, device)
        if taints:
            return Verdict("taint", f"tainted {taints[0]} (not tolerated)")
        short = self.exhausted_counter(device, pool, used)
        if short:
            return Verdict("counters", short[2], counter=(short[0], short[1]))
        capacity = self.capacity_verdict(request, device, self.consumed.get(device.id, {}))
        if isinstance(capacity, str):
            return Verdict("capacity", capacity)
        return verdict

    def capacity_verdict(self, request: Request, device: Device,
                         used: dict[consumable.CapacityKey, Fraction]) -> consumable.Consumption | str | None:
        """What one allocation of ``device`` for ``request`` consumes (``None``: the device is allocated whole),
        or why it cannot be allocated: a policy violation, a missing capacity, or a capacity exhausted by ``used``.
        """
        if request.admin_access and not request.capacity:
            return None
        taken = consumable.consumption(device.driver, device.capacity, device.policies,
                                       request.capacity_for(device.driver), multiple=device.allow_multiple_allocations)
        if taken.problem:
            return f"device {device.name}: {taken.problem}"
        if not device.allow_multiple_allocations:
            return None
        return consumable.shortfall(device.driver, device.name, device.capacity, taken, used) or taken


def _stage_label(verdict: Verdict) -> str:
    return {
        "pool": "in an unusable pool",
        "in-use": "in use",
        "class": "rejected by the class selector",
        "request": "rejected by the request selector",
        "binding": "waiting for binding conditions",
        "taint": "tainted",
        "counters": "out of shared counters",
        "capacity": "out of consumable capacity",
    }.get(verdict.stage, verdict.stage)


def _consume(used: dict[tuple[str, str, str], Fraction], pool: Pool, device: Device, sign: int) -> None:
    for set_name, counters in device.consumes_counters:
        for counter, amount in counters.items():
            key = (pool.driver, pool.name, f"{set_name}/{counter}")
            used[key] = used.get(key, Fraction(0)) + sign * amount.value


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


class _Search:
    """Depth-first search state for one node."""

    def __init__(self, allocator: Allocator, claims: Sequence[Claim], pools: list[Pool]) -> None:
        self.allocator = allocator
        self.claims = claims
        self.pools = pools
        self.candidates = [(pool, device) for pool in pools for device in pool.devices]
        self.used = allocator.baseline_counters(pools)
        self.picks: list[Pick] = []
        self.taken: dict[tuple[str, str, str], int] = {}
        self.consumed = {k: dict(v) for k, v in allocator.consumed.items()}
        self.values: dict[tuple[int, int], list[Any]] = {}
        self.steps = 0
        self.gave_up = False

    def run(self) -> bool:
        return self._claim(0)

    def _claim(self, ci: int) -> bool:
        if ci == len(self.claims):
            return True
        return self._request(ci, 0)

    def _request(self, ci: int, ri: int) -> bool:
        claim = self.claims[ci]
        if ri == len(claim.requests):
            return self._claim(ci + 1)
        request = claim.requests[ri]
        for alt in request.subrequests or [request]:
            if alt.mode == "All":
                if self._all(ci, ri, alt):
                    return True
            elif self._pick(ci, ri, alt, alt.count, 0):
                return True
            if self.gave_up:
                return False
        return False

    def _results(self, ci: int) -> int:
        return sum(1 for p in self.picks if p.claim == ci)

    def _usable(self, ci: int, request: Request, pool: Pool, device: Device) -> consumable.Consumption | bool:
        """False, or True / the consumption of a share when ``device`` can serve ``request`` now."""
        allocator = self.allocator
        if device.allow_multiple_allocations:
            if any(p.claim == ci and p.request.name == request.name and p.device.id == device.id for p in self.picks):
                return False
        elif request.admin_access:
            if any(p.claim == ci and p.device.id == device.id for p in self.picks):
                return False
        elif device.id in allocator.in_use or self.taken.get(device.id):
            return False
        if not allocator.static_verdict(request, device, pool).accepted:
            return False
        if allocator.untolerated(request, device):
            return False
        if allocator.counter_shortfall(device, pool, self.used) is not None:
            return False
        capacity = allocator.capacity_verdict(request, device, self.consumed.get(device.id, {}))
        if isinstance(capacity, str):
            return False
        if not self._constraints_hold(ci, request, device):
            return False
        return capacity if capacity is not None else True

    def _constraints_hold(self, ci: int, request: Request, device: Device) -> bool:
        for k, constraint in enumerate(self.claims[ci].constraints):
            if not constraint.covers(request.name):
                continue
            value = device.attributes.get(constraint.attribute)
            if value is None:
                return False
            existing = self.values.get((ci, k))
            if existing and not _same(existing[0], value):
                return False
        return True

    def _add(self, ci: int, request: Request, pool: Pool, device: Device,
             consumed: consumable.Consumption | bool = True) -> None:
        share = consumed if isinstance(consumed, consumable.Consumption) else None
        self.picks.append(Pick(ci, request, device, pool, share))
        if share is not None:
            taken = self.consumed.setdefault(device.id, {})
            for key, amount in share.amounts.items():
                taken[key] = taken.get(key, Fraction(0)) + amount
        elif not request.admin_access:
            self.taken[device.id] = self.taken.get(device.id, 0) + 1
        _consume(self.used, pool, device, +1)
        for k, constraint in enumerate(self.claims[ci].constraints):
            if constraint.covers(request.name):
                self.values.setdefault((ci, k), []).append(device.attributes[constraint.attribute])

    def _undo(self) -> None:
        pick = self.picks.pop()
        if pick.consumed is not None:
            taken = self.consumed[pick.device.id]
            for key, amount in pick.consumed.amounts.items():
                taken[key] -= amount
        elif not pick.request.admin_access:
            self.taken[pick.device.id] -= 1
        _consume(self.used, pick.pool, pick.device, -1)
        for k, constraint in enumerate(self.claims[pick.claim].constraints):
            if constraint.covers(pick.request.name):
                self.values[(pick.claim, k)].pop()

    def _pick(self, ci: int, ri: int, request: Request, remaining: int, start: int) -> bool:
        if remaining == 0:
            return self._request(ci, ri + 1)
        if self._results(ci) >= MAX_RESULTS_PER_CLAIM:
            return False
        for index in range(start, len(self.candidates)):
            self.steps += 1
            if self.steps > SEARCH_STEP_LIMIT:
                self.gave_up = True
                return False
            pool, device = self.candidates[index]
            usable = self._usable(ci, request, pool, device)
            if usable is False:
                continue
            self._add(ci, request, pool, device, usable)
            if self._pick(ci, ri, request, remaining - 1, index + 1):
                return True
            self._undo()
            if self.gave_up:
                return False
        return False

    def _all(self, ci: int, ri: int, request: Request) -> bool:
        matching = []
        for pool, device in self.candidates:
            if self.allocator.static_verdict(request, device, pool).stage in ("accepted", "binding"):
                matching.append((pool, device))
            elif pool.incomplete or pool.invalid:
                return False
        if not matching:
            return False
        added = 0
        for pool, device in matching:
            usable = self._usable(ci, request, pool, device)
            if usable is False or self._results(ci) >= MAX_RESULTS_PER_CLAIM:
                for _ in range(added):
                    self._undo()
                return False
            self._add(ci, request, pool, device, usable)
            added += 1
        if self._request(ci, ri + 1):
            return True
        for _ in range(added):
            self._undo()
        return False

    def allocation(self, ci: int, node: Node | None) -> dict[str, Any]:
        """``status.allocation`` for claim ``ci`` from the picks."""
        claim = self.claims[ci]
        picks = [p for p in self.picks if p.claim == ci]
        results = []
        class_requests: dict[str, list[str]] = {}
        for pick in picks:
            result: dict[str, Any] = {
                "request": pick.request.name,
                "driver": pick.device.driver,
                "pool": pick.device.pool,
                "device": pick.device.name,
            }
            if pick.request.admin_access:
                result["adminAccess"] = True
            if pick.consumed is not None:
                result["shareID"] = self.allocator.share_ids()
                result["consumedCapacity"] = consumable.render(pick.device.driver, pick.device.capacity,
                                                               pick.consumed.amounts)
            if pick.request.raw_tolerations:
                result["tolerations"] = copy.deepcopy(pick.request.raw_tolerations)
            if self.allocator.binding_conditions and pick.device.binding_conditions:
                result["bindingConditions"] = list(pick.device.binding_conditions)
                result["bindingFailureConditions"] = list(pick.device.binding_failure_conditions)
            results.append(result)
            names = class_requests.setdefault(pick.request.class_name, [])
            if pick.request.name not in names:
                names.append(pick.request.name)
        config: list[dict[str, Any]] = []
        for class_name, names in class_requests.items():
            for entry in self.allocator.classes[class_name].config:
                config.append({"source": "FromClass", "requests": list(names), **copy.deepcopy(entry)})
        allocated = {p.request.name for p in picks} | {p.request.base for p in picks}
        for entry in claim.config:
            wanted = entry.get("requests") or []
            if not wanted or any(str(w) in allocated for w in wanted):
                config.append({"source": "FromClaim", **copy.deepcopy(entry)})
        devices: dict[str, Any] = {"results": results}
        if config:
            devices["config"] = config
        allocation: dict[str, Any] = {"devices": devices}
        selector = _node_selector([p.device for p in picks], [p.pool for p in picks], node,
                                  binds_to_node=self.allocator.binding_conditions)
        if selector is not None:
            allocation["nodeSelector"] = selector
        return allocation


def _node_selector(devices: list[Device], pools: list[Pool], node: Node | None, *,
                   binds_to_node: bool = False) -> dict[str, Any] | None:
    """``metadata.name In [node]`` if any device is node-local (or, ``binds_to_node``, has ``bindsToNode``), else
    the slices' merged selector, else None."""
    selectors: list[dict[str, Any]] = []
    for device, pool in zip(devices, pools, strict=True):
        selection = device.node_selection
        if selection is None:
            selection = next(s.selection for s in pool.slices if s.name == device.slice_name)
        if (selection.node_name or (binds_to_node and device.binds_to_node)) and node is not None:
            return {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node.name]}]}
                ]
            }
        if selection.node_selector is not None and selection.node_selector not in selectors:
            selectors.append(selection.node_selector)
    if not selectors:
        return None
    if len(selectors) == 1:
        return copy.deepcopy(selectors[0])
    expressions: list[Any] = []
    fields: list[Any] = []
    for selector in selectors:
        terms = selector.get("nodeSelectorTerms") or [{}]
        expressions.extend(terms[0].get("matchExpressions") or [])
        fields.extend(terms[0].get("matchFields") or [])
    term: dict[str, Any] = {}
    if expressions:
        term["matchExpressions"] = expressions
    if fields:
        term["matchFields"] = fields
    return {"nodeSelectorTerms": [term]}


def constraint_text(constraint: Constraint) -> str:
    """``same resource.kubernetes.io/pcieRoot for requests a, b`` (for explain headers)."""
    covered = ", ".join(constraint.requests) if constraint.requests else "all requests"
    return f"same {constraint.text} for {covered}"
