"""Consumable capacity (KEP-5075 ``DRAConsumableCapacity``): how much of a multi-allocatable device one allocation
consumes, and whether it still fits.

Rules (``resource/v1/types.go`` in kubernetes/api; the consumable-capacity rule of
``structured/internal/incubating/allocator_incubating.go`` in k8s.io/dynamic-resource-allocation; the API's
``CapacityRequestPolicy`` field documentation):

* a device with ``allowMultipleAllocations: true`` may be allocated many times; each allocation gets a fresh
  ``shareID`` and a ``consumedCapacity`` entry for every capacity of the device;
* requested capacity (``spec.devices.requests[].exactly.capacity.requests``) is rounded up by the capacity's
  ``requestPolicy``: ``validRange`` -- below ``min`` becomes ``min``, else ``min + n*step`` for the smallest n that
  covers the request, above ``max`` violates the policy; ``validValues`` -- the smallest valid value at least the
  request, above all of them violates the policy; no policy -- the request as is;
* a capacity the request does not name consumes the policy's ``default``, or the whole capacity when there is no
  policy or no default;
* the sum of all allocations' consumption of a capacity may not exceed its ``value``;
* a device without ``allowMultipleAllocations`` is allocated whole; a capacity request then only asks that the
  device has at least that much;
* a request naming a capacity the device does not have cannot use the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from dradriver.allocator.quantity import Quantity

CapacityKey = tuple[str, str]
"""``(domain, id)`` of a capacity, as :class:`~dradriver.allocator.resources.Device` files them."""


@dataclass(frozen=True)
class RequestPolicy:
    """A ``DeviceCapacity.requestPolicy``.

    :param default: ``default`` (``None`` when absent).
    :param valid_values: ``validValues`` in order (empty when absent).
    :param minimum: ``validRange.min`` (``None`` without a range); ``maximum``/``step`` likewise (optional in
        the range).
    """

    default: Quantity | None = None
    valid_values: tuple[Quantity, ...] = ()
    minimum: Quantity | None = None
    maximum: Quantity | None = None
    step: Quantity | None = None


@dataclass(frozen=True)
class Consumption:
    """What one allocation of a device takes: capacity key -> amount; or why it cannot be taken.

    :param problem: ``""`` when the allocation fits the device's policies (amounts still have to fit what is left).
    """

    amounts: dict[CapacityKey, Fraction] = field(default_factory=dict)
    problem: str = ""


def _name(key: CapacityKey, driver: str) -> str:
    return key[1] if key[0] == driver else f"{key[0]}/{key[1]}"


def round_up(requested: Fraction, value: Fraction, policy: RequestPolicy | None) -> Fraction | str:
    """The amount one request of ``requested`` consumes of a capacity of ``value`` under ``policy``, or why it
    violates the policy (a phrase)."""
    if policy is None:
        return requested
    if policy.valid_values:
        for valid in policy.valid_values:
            if valid.value >= requested:
                return valid.value
        return f"is above every valid value ({', '.join(str(v) for v in policy.valid_values)})"
    if policy.minimum is not None:
        low = policy.minimum.value
        high = policy.maximum.value if policy.maximum is not None else value
        amount = low
        if requested > low:
            if policy.step is not None and policy.step.value > 0:
                steps = -(-(requested - low) // policy.step.value)
                amount = low + steps * policy.step.value
            else:
                amount = requested
        if amount > high:
            return f"is above the request policy's maximum {policy.maximum or Quantity.of(high)}"
        return amount
    return requested


def consumption(driver: str, capacity: Mapping[CapacityKey, Quantity],
                policies: Mapping[CapacityKey, RequestPolicy], requests: Mapping[CapacityKey, Quantity],
                *, multiple: bool) -> Consumption:
    """How much one allocation with ``requests`` takes of a device with ``capacity`` and ``policies``.

    :param multiple: the device has ``allowMultipleAllocations``; otherwise only the minimum-capacity check runs
        and the result has no amounts.
    """
    for key, wanted in requests.items():
        if key not in capacity:
            return Consumption(problem=f"has no capacity {_name(key, driver)} (requested {wanted})")
        if not multiple and wanted.value > capacity[key].value:
            return Consumption(problem=f"capacity {_name(key, driver)} is {capacity[key]}, requested {wanted}")
    if not multiple:
        return Consumption()
    amounts: dict[CapacityKey, Fraction] = {}
    for key, total in capacity.items():
        policy = policies.get(key)
        if key in requests:
            amount = round_up(requests[key].value, total.value, policy)
            if isinstance(amount, str):
                return Consumption(problem=f"capacity {_name(key, driver)}: request {requests[key]} {amount}")
        elif policy is not None and policy.default is not None:
            amount = policy.default.value
        else:
            amount = total.value
        amounts[key] = amount
    return Consumption(amounts)


def shortfall(driver: str, device: str, capacity: Mapping[CapacityKey, Quantity], taken: Consumption,
              used: Mapping[CapacityKey, Fraction]) -> str | None:
    """Why ``taken`` does not fit beside ``used`` (what other allocations consume), naming the capacity and the
    device: ``capacity memory of device gpu-0 exhausted: needs 10Gi, 4Gi left``; ``None`` when it fits."""
    for key, amount in taken.amounts.items():
        total = capacity[key]
        already = used.get(key, Fraction(0))
        if already + amount > total.value:
            left = Quantity.of(max(total.value - already, Fraction(0)), total.format)
            return (f"capacity {_name(key, driver)} of device {device} exhausted: needs "
                    f"{Quantity.of(amount, total.format)}, {left} left")
    return None


def render(driver: str, capacity: Mapping[CapacityKey, Quantity],
           amounts: Mapping[CapacityKey, Fraction]) -> dict[str, str]:
    """``consumedCapacity`` of a result: capacity name (unqualified in the device's driver domain) -> quantity."""
    return {_name(key, driver): str(Quantity.of(amount, capacity[key].format)) for key, amount in amounts.items()}
