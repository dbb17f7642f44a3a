"""Selector results once per device shape: the values a selector reads, not the device that holds them.

A fleet publishes many devices of one model that agree on nearly every attribute (all H100 80GB HBM3 GPUs of
one driver release have the same ``productName``, ``architecture``, ``driverVersion``, ``memory``; they differ
in ``uuid`` and ``pciBusID``). A CEL selector is a pure function of the parts of ``device`` it reads
(:func:`~dradriver.allocator.expression.device_reads`), so the **shape** of a device for a selector, the tuple
of those values, decides its outcome, its error text and the words ``explain`` prints about it. :class:`ShapeCache`
evaluates each selector once per distinct shape and hands every other device of that shape the stored result:
the cost follows distinct device shapes, not devices.

Exactness: a value enters the shape with its type (``1``, ``true`` and ``"1"`` differ; a version with its build
metadata, a quantity with its printed format); a name the device does not publish enters as missing together with
the names the device does publish in that domain, which the "did you mean" hint of an error reads. A selector whose
reads are not known statically (``reads is None``) is evaluated once per device; with the cache disabled
(``ShapeCache(enabled=False)``: the evaluator as it was, kept for the benchmark's baseline) every call evaluates.
"""

from __future__ import annotations

from typing import Any

from dradriver.allocator.diagnosis import describe_error, missing_names
from dradriver.allocator.expression import DevicePath, Outcome, Selector
from dradriver.allocator.quantity import Quantity
from dradriver.allocator.resources import Device
from dradriver.allocator.semver import Semver
from dradriver.allocator.wording import rejection

Shape = tuple[Any, ...]


def _token(value: Any) -> Any:
    """``value`` with what tells it apart from an equal value of another kind or spelling."""
    if isinstance(value, Semver):
        return (Semver, value.major, value.minor, value.patch, value.prerelease, value.build)
    if isinstance(value, Quantity):  # the fraction's parts: hashing a Fraction is slow
        return (Quantity, value.value.numerator, value.value.denominator, value.format)
    return (type(value), value)


def _domain(table: dict[tuple[str, str], Any], domain: str) -> tuple[Any, ...]:
    return tuple(sorted((name, _token(value)) for (d, name), value in table.items() if d == domain))


def shape(device: Device, reads: tuple[DevicePath, ...]) -> Shape:
    """The values of ``device`` at ``reads`` (:attr:`Selector.reads`), each tagged with its type; a missing name
    as ``("missing", names the device publishes in that domain)``. Kept on the device (``Device.shapes``)."""
    found = device.shapes.get(reads)
    if found is None:
        found = device.shapes[reads] = _shape(device, reads)
    return found


def _shape(device: Device, reads: tuple[DevicePath, ...]) -> Shape:
    out: list[Any] = []
    for path in reads:
        field = path[0]
        if field == "driver":
            out.append(device.driver)
            continue
        if field == "allowMultipleAllocations":
            out.append(device.allow_multiple_allocations)
            continue
        table: dict[tuple[str, str], Any] = device.attributes if field == "attributes" else device.capacity
        if len(path) == 2:
            out.append(_domain(table, path[1]))
            continue
        value = table.get((path[1], path[2]), _MISSING)
        if value is _MISSING:
            out.append(("missing", tuple(sorted(n for d, n in table if d == path[1]))))
        else:
            out.append(_token(value))
    return tuple(out)


_MISSING = object()


class ShapeCache:
    """Outcomes and diagnoses of selectors on devices, computed once per (selector, device shape).

    :param enabled: ``False`` evaluates every selector on every device (the per-device evaluator, for baselines
        and parity checks); results are the same either way.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._selectors: dict[int, Selector] = {}
        """Keeps each selector alive while its ``id`` keys the tables below."""
        self._outcomes: dict[tuple[int, Shape], Outcome] = {}
        self._texts: dict[tuple[str, int, Shape, str], Any] = {}

    def _key(self, selector: Selector, device: Device) -> Shape | None:
        """The cache key of ``device`` for ``selector``: its shape, or the device ID when the selector's reads
        are not known (evaluated once per device, as the per-device evaluator caches it)."""
        if not self.enabled:
            return None
        self._selectors.setdefault(id(selector), selector)
        if selector.reads is None:
            return ("device", *device.id)
        return shape(device, selector.reads)

    def outcome(self, selector: Selector, device: Device) -> Outcome:
        """``selector`` evaluated on ``device`` (:meth:`Selector.evaluate`)."""
        key = self._key(selector, device)
        if key is None:
            return selector.evaluate(device.cel())
        found = self._outcomes.get((id(selector), key))
        if found is None:
            found = self._outcomes[(id(selector), key)] = selector.evaluate(device.cel())
        return found

    def rejection(self, selector: Selector, device: Device) -> str:
        """Why ``selector`` is false for ``device`` (:func:`dradriver.allocator.wording.rejection`)."""
        return str(self._text("rejection", selector, device, "", lambda: rejection(selector, device.cel())))

    def error(self, selector: Selector, device: Device, error: str) -> str:
        """The run-time ``error`` in the user's terms (:func:`dradriver.allocator.diagnosis.describe_error`)."""
        return str(self._text("error", selector, device, error,
                              lambda: describe_error(selector, device.cel(), error)))

    def missing(self, selector: Selector, device: Device) -> list[tuple[str, str]]:
        """Names ``selector`` reads that ``device`` lacks (:func:`dradriver.allocator.diagnosis.missing_names`)."""
        found: list[tuple[str, str]] = self._text("missing", selector, device, "",
                                                  lambda: missing_names(selector, device.cel()))
        return found

    def _text(self, what: str, selector: Selector, device: Device, extra: str, compute: Any) -> Any:
        key = self._key(selector, device)
        if key is None:
            return compute()
        full = (what, id(selector), key, extra)
        if full not in self._texts:
            self._texts[full] = compute()
        return self._texts[full]
