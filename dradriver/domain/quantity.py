"""Kubernetes resource quantities (``k8s.io/apimachinery/pkg/api/resource``), exact.

A quantity is ``<sign><digits>[.<digits>]<suffix>`` where the suffix is a binary SI suffix (``Ki`` ... ``Ei``,
powers of 1024), a decimal SI suffix (``n u m "" k M G T P E``, powers of 1000) or a decimal exponent
(``e<int>`` / ``E<int>``). The suffix also fixes the *format* used to print the value back. Values are kept as
exact fractions; like Kubernetes, parsing rounds up (away from zero) to a multiple of 10^-9 (nano).

Canonical text follows ``Quantity.String()``/``CanonicalizeBytes``:

* zero prints as ``0``;
* BinarySI values that are not integers, or lie strictly between -1024 and 1024, print as DecimalSI;
* BinarySI prints ``<mantissa><Ki|Mi|...>`` with the largest power of 1024 that divides the value;
* DecimalSI/DecimalExponent print the smallest integer mantissa whose base-10 exponent is a multiple of 3,
  with the SI suffix (``1500m``, ``1k``, ``40G``) or ``e<exp>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

from dradriver.errors import DradriverError

NANO = Fraction(1, 10**9)
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class QuantityError(DradriverError, ValueError):
    """A string is not a valid Kubernetes quantity."""


class Format(str, Enum):
    """How a quantity prints (``resource.Format``)."""

    BINARY_SI = "BinarySI"
    DECIMAL_SI = "DecimalSI"
    DECIMAL_EXPONENT = "DecimalExponent"


_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_BY_EXP = {exp: suffix for suffix, exp in _DECIMAL.items()}
_BINARY_BY_EXP = {exp: suffix for suffix, exp in _BINARY.items()}
_SYNTAX = re.compile(r"^([+-]?)([0-9]*)(?:\.([0-9]*))?(.*)$")
_EXPONENT = re.compile(r"^[eE]([+-]?[0-9]+)$")


def _round_up_nano(value: Fraction) -> Fraction:
    """Round away from zero to a multiple of 10^-9 (``inf.RoundUp`` at scale 9)."""
    scaled = value / NANO
    if scaled.denominator == 1:
        return value
    magnitude = -(-abs(scaled.numerator) // scaled.denominator)
    return Fraction(magnitude if value > 0 else -magnitude) * NANO


@dataclass(frozen=True, slots=True)
class Quantity:
    """An exact Kubernetes quantity.

    :param value: the amount, an exact fraction (bytes for memory, cores for CPU, plain count otherwise).
    :param format: how :meth:`__str__` prints it (taken from the suffix at parse time).
    """

    value: Fraction
    format: Format = Format.DECIMAL_SI

    @classmethod
    def parse(cls, text: str) -> Quantity:
        """Parse ``text`` as ``resource.ParseQuantity`` does.

        :raises QuantityError: empty text, bad digits, unknown suffix ("quantities must match the regular
            expression ..." in Kubernetes).
        """
        if not isinstance(text, str) or not text:
            raise QuantityError(f"quantity {text!r}: empty")
        match = _SYNTAX.match(text)
        if match is None:
            raise QuantityError(f"quantity {text!r}: must look like 40Gi, 1.5, 500m or 1e3")
        sign, whole, fraction, suffix = match.groups()
        fraction = fraction or ""
        if not whole and not fraction:
            raise QuantityError(f"quantity {text!r}: no digits")
        number = Fraction(int(whole or "0"))
        if fraction:
            number += Fraction(int(fraction), 10 ** len(fraction))
        if sign == "-":
            number = -number
        if suffix in _BINARY:
            fmt = Format.BINARY_SI
            number *= 1024 ** _BINARY[suffix]
        elif suffix in _DECIMAL:
            fmt = Format.DECIMAL_SI
            number *= Fraction(10) ** _DECIMAL[suffix]
        elif (exp := _EXPONENT.match(suffix)) is not None:
            fmt = Format.DECIMAL_EXPONENT
            number *= Fraction(10) ** int(exp.group(1))
        else:
            raise QuantityError(
                f"quantity {text!r}: unknown suffix {suffix!r} (use Ki..Ei, n u m k M G T P E, or e<n>)"
            )
        return cls(_round_up_nano(number), fmt)

    @classmethod
    def of(cls, value: int | Fraction, fmt: Format = Format.DECIMAL_SI) -> Quantity:
        """Return a quantity holding ``value`` (rounded up to nano) printed in ``fmt``."""
        return cls(_round_up_nano(Fraction(value)), fmt)

    def __str__(self) -> str:
        value = self.value
        if value == 0:
            return "0"
        fmt = self.format
        if fmt is Format.BINARY_SI and (-1024 < value < 1024 or value.denominator != 1):
            fmt = Format.DECIMAL_SI
        if fmt is Format.BINARY_SI:
            mantissa, exp = int(value), 0
            while exp < 6 and mantissa % 1024 == 0:
                mantissa //= 1024
                exp += 1
            return f"{mantissa}{_BINARY_BY_EXP.get(exp, '')}"
        # Decimal: integer mantissa, exponent a multiple of 3.
        exp10 = 0
        scaled = value
        while scaled.denominator != 1:
            scaled *= 10
            exp10 -= 1
        mantissa = int(scaled)
        while mantissa % 10 == 0:
            mantissa //= 10
            exp10 += 1
        while exp10 % 3 != 0:
            mantissa *= 10
            exp10 -= 1
        if fmt is Format.DECIMAL_SI and exp10 in _DECIMAL_BY_EXP:
            return f"{mantissa}{_DECIMAL_BY_EXP[exp10]}"
        return f"{mantissa}" if exp10 == 0 else f"{mantissa}e{exp10}"

    def __repr__(self) -> str:
        return f"Quantity({str(self)!r})"

    def compare(self, other: Quantity) -> int:
        """-1, 0 or 1 as ``Quantity.Cmp``."""
        return (self.value > other.value) - (self.value < other.value)

    def sign(self) -> int:
        """-1, 0 or 1 (``Quantity.Sign``)."""
        return (self.value > 0) - (self.value < 0)

    def is_integer(self) -> bool:
        """True if the value is a whole number that fits in int64 (``AsInt64`` succeeds)."""
        return self.value.denominator == 1 and INT64_MIN <= self.value <= INT64_MAX

    def add(self, other: Quantity) -> Quantity:
        """Sum, printed in this quantity's format (``Quantity.Add``)."""
        return Quantity(self.value + other.value, self.format)

    def sub(self, other: Quantity) -> Quantity:
        """Difference, printed in this quantity's format (``Quantity.Sub``)."""
        return Quantity(self.value - other.value, self.format)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantity) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def parse_quantity(text: str | int | float) -> Quantity:
    """Parse a quantity as it appears in YAML (an int or float is read as its decimal text)."""
    if isinstance(text, bool):
        raise QuantityError(f"quantity {text!r}: not a number")
    if isinstance(text, int):
        return Quantity.of(text)
    if isinstance(text, float):
        return Quantity.parse(repr(text))
    return Quantity.parse(text)
