"""Node CPU and memory in the simulator: a Pod's requests plus its devices' KEP-5517 overhead against the Node's
``status.allocatable``, as kube-scheduler's NodeResourcesFit filter does with the ``DRANodeAllocatableResources``
gate (Kubernetes 1.37, alpha).

Facts (Kubernetes documentation "Resource Management for Pods and Containers", "Pod Overhead" and the 1.37 API
reference of ``NodeAllocatableOverhead``):

* A Pod's request of a resource is the sum of its containers' ``resources.requests``, or the largest request of
  one init container when that is larger, plus ``spec.overhead``.
* Each allocated device that publishes ``nodeAllocatableResources[<resource>].overhead`` adds, for each Pod that
  references the claim, ``perPod + perContainer * N`` (``N``: the Pod's containers, init containers included, whose
  ``resources.claims`` name the Pod's entry for that claim; for the claim the scheduler generates for extended
  resources, the containers asking for them). Overhead counts per referencing Pod, not once per claim.
* The Pod fits a node when, for ``cpu`` and ``memory``, its requests plus that overhead plus what the Pods already
  on the node take is at most the node's ``status.allocatable``. A resource the Node does not list, or a node the
  input has no Node object for, is not checked (the simulator cannot know it).

Not modelled: ``nodeAllocatableResources[...].mapping`` (devices that *are* node resources, such as a CPU
driver's; dradriver publishes only overhead), hugepages and ephemeral storage, sidecar (restartable) init
containers' running requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from dradriver.allocator.quantity import Format, Quantity, QuantityError, parse_quantity
from dradriver.allocator.resources import Device, InputError

RESOURCES = ("cpu", "memory")


def _amount(value: Any, where: str) -> Fraction:
    try:
        return parse_quantity(value).value
    except (QuantityError, TypeError) as exc:
        raise InputError(f"{where}: {value!r} is not a quantity ({exc})") from None


def _requests(container: Mapping[str, Any], where: str) -> dict[str, Fraction]:
    raw = ((container.get("resources") or {}).get("requests") or {})
    return {r: _amount(raw[r], f"{where}.resources.requests.{r}") for r in RESOURCES if r in raw}


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Fraction]:
    """``cpu`` (cores) and ``memory`` (bytes) the Pod requests (module docstring's rule).

    :raises InputError: a request is not a quantity (names the container and resource).
    """
    spec = pod.get("spec") or {}
    name = (pod.get("metadata") or {}).get("name")
    total: dict[str, Fraction] = {r: Fraction(0) for r in RESOURCES}
    for c in spec.get("containers") or []:
        for r, v in _requests(c, f"Pod {name}: containers[{c.get('name')}]").items():
            total[r] += v
    for c in spec.get("initContainers") or []:
        for r, v in _requests(c, f"Pod {name}: initContainers[{c.get('name')}]").items():
            total[r] = max(total[r], v)
    for r in RESOURCES:
        if r in (spec.get("overhead") or {}):
            total[r] += _amount(spec["overhead"][r], f"Pod {name}: spec.overhead.{r}")
    return total


def claim_references(pod: Mapping[str, Any]) -> dict[str, int]:
    """Pod claim entry name -> how many of the Pod's containers (init containers included) reference it."""
    spec = pod.get("spec") or {}
    counts: dict[str, int] = {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for ref in {str(r.get("name")) for r in (c.get("resources") or {}).get("claims") or [] if r.get("name")}:
            counts[ref] = counts.get(ref, 0) + 1
    return counts


@dataclass
class Charge:
    """One device's overhead charged to one Pod: ``amounts[resource]`` and the words for ``explain``."""

    claim: str
    device: str
    containers: int
    amounts: dict[str, Fraction]
    words: str


@dataclass
class Demand:
    """What one Pod takes of its node: its requests and its devices' overhead, per resource."""

    requests: dict[str, Fraction]
    charges: list[Charge] = field(default_factory=list)

    def overhead(self, resource: str) -> Fraction:
        """The devices' overhead of ``resource`` summed."""
        return sum((c.amounts.get(resource, Fraction(0)) for c in self.charges), Fraction(0))

    def total(self, resource: str) -> Fraction:
        """Requests plus overhead of ``resource``."""
        return self.requests.get(resource, Fraction(0)) + self.overhead(resource)


def device_charges(claims: Iterable[tuple[str, int, Sequence[Mapping[str, Any]]]],
                   devices: Mapping[tuple[str, str, str], Device]) -> list[Charge]:
    """The overhead a Pod is charged for its claims.

    :param claims: ``(claim ref, containers referencing it, status.allocation.devices.results)`` per claim.
    :param devices: ``(driver, pool, device)`` -> the published device.
    """
    out: list[Charge] = []
    for ref, containers, results in claims:
        for result in results:
            if result.get("adminAccess"):
                continue  # admin access grants no device for the Pod's own use
            device = devices.get((str(result.get("driver")), str(result.get("pool")), str(result.get("device"))))
            if device is None or not device.overhead:
                continue
            amounts: dict[str, Fraction] = {}
            words = []
            for resource, (per_pod, per_container) in sorted(device.overhead.items()):
                amount = (per_pod.value if per_pod else Fraction(0)) + containers * (
                    per_container.value if per_container else Fraction(0))
                amounts[resource] = amount
                parts = [f"perPod {per_pod}"] if per_pod else []
                if per_container:
                    parts.append(f"perContainer {per_container} x {containers} container(s)")
                words.append(f"{resource} {show(resource, amount)} ({' + '.join(parts)})")
            out.append(Charge(ref, f"{result.get('pool')}/{result.get('device')}", containers, amounts,
                              "; ".join(words)))
    return out


def show(resource: str, amount: Fraction) -> str:
    """A quantity as Kubernetes prints it (memory in binary units when they divide it)."""
    fmt = Format.BINARY_SI if resource == "memory" and amount.denominator == 1 else Format.DECIMAL_SI
    return str(Quantity.of(amount, fmt))


def allocatable_of(raw: Mapping[str, Any] | None, node: str) -> dict[str, Fraction]:
    """``cpu``/``memory`` of a Node's ``status.allocatable`` (those it lists)."""
    raw = raw or {}
    return {r: _amount(raw[r], f"Node {node}: status.allocatable.{r}") for r in RESOURCES if r in raw}


def misfit(demand: Demand, allocatable: Mapping[str, Fraction], used: Mapping[str, Fraction]) -> str:
    """Why the Pod does not fit the node (``Insufficient memory: ...``), or ``""`` when it does."""
    reasons = []
    for resource in RESOURCES:
        if resource not in allocatable:
            continue
        wanted, taken, limit = demand.total(resource), used.get(resource, Fraction(0)), allocatable[resource]
        if wanted + taken > limit:
            reasons.append(
                f"Insufficient {resource}: the pod needs {show(resource, wanted)} (requests "
                f"{show(resource, demand.requests.get(resource, Fraction(0)))} + DRA device overhead "
                f"{show(resource, demand.overhead(resource))}), {show(resource, max(limit - taken, Fraction(0)))} "
                f"of {show(resource, limit)} allocatable is left ({show(resource, taken)} taken by other pods)")
    return "; ".join(reasons)


def describe(demand: Demand, allocatable: Mapping[str, Fraction], used: Mapping[str, Fraction]) -> list[str]:
    """Lines for ``explain``: per resource, requests + overhead against the node's allocatable, then each charge."""
    lines = []
    for resource in RESOURCES:
        line = (f"{resource}: requests {show(resource, demand.requests.get(resource, Fraction(0)))} + DRA device "
                f"overhead {show(resource, demand.overhead(resource))} = {show(resource, demand.total(resource))}")
        if resource in allocatable:
            line += (f" of {show(resource, allocatable[resource])} allocatable "
                     f"({show(resource, used.get(resource, Fraction(0)))} taken by other pods)")
        else:
            line += " (the Node lists no allocatable " + resource + ": not checked)"
        lines.append(line)
    lines.extend(f"overhead of claim {c.claim}, device {c.device}: {c.words}" for c in demand.charges)
    return lines
