"""Kubernetes quantity parsing and canonical text (k8s.io/apimachinery resource.Quantity behaviour)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from dradriver.allocator.quantity import Format, Quantity, QuantityError, parse_quantity

# (input, exact value, canonical String())
TABLE = [
    ("0", 0, "0"),
    ("0Gi", 0, "0"),
    ("1", 1, "1"),
    ("40Gi", 40 * 2**30, "40Gi"),
    ("40960Mi", 40 * 2**30, "40Gi"),
    ("81559Mi", 81559 * 2**20, "81559Mi"),
    ("23034Mi", 23034 * 2**20, "23034Mi"),
    ("1.5Gi", 3 * 2**29, "1536Mi"),
    ("0.5Ki", 512, "512"),
    ("1023Ki", 1023 * 1024, "1023Ki"),
    ("1024Ki", 2**20, "1Mi"),
    ("1Ei", 2**60, "1Ei"),
    ("42949672960", 42949672960, "42949672960"),
    ("1000", 1000, "1k"),
    ("1500", 1500, "1500"),
    ("1.5", Fraction(3, 2), "1500m"),
    ("0.1", Fraction(1, 10), "100m"),
    ("100m", Fraction(1, 10), "100m"),
    ("1000m", 1, "1"),
    ("1u", Fraction(1, 10**6), "1u"),
    ("1n", Fraction(1, 10**9), "1n"),
    ("0.0000000001", Fraction(1, 10**9), "1n"),  # rounded up to the nano
    ("40G", 40 * 10**9, "40G"),
    ("1k", 1000, "1k"),
    ("12M", 12 * 10**6, "12M"),
    ("2T", 2 * 10**12, "2T"),
    ("1P", 10**15, "1P"),
    ("1E", 10**18, "1E"),
    ("1e3", 1000, "1e3"),
    ("1E3", 1000, "1e3"),
    ("1.5e3", 1500, "1500"),
    ("1e-3", Fraction(1, 1000), "1e-3"),
    ("-1Gi", -(2**30), "-1Gi"),
    ("+5", 5, "5"),
    ("-500m", Fraction(-1, 2), "-500m"),
    (".5", Fraction(1, 2), "500m"),
    ("5.", 5, "5"),
]


@pytest.mark.parametrize(("text", "value", "canonical"), TABLE)
def test_parse_and_canonical_text(text: str, value: int | Fraction, canonical: str) -> None:
    quantity = Quantity.parse(text)
    assert quantity.value == value
    assert str(quantity) == canonical
    assert Quantity.parse(canonical) == quantity


@pytest.mark.parametrize("text", ["", "Gi", "1K", "1GB", "1.2.3", "1 Gi", "--1", "1e", "1ee3", "abc", "1Gi5"])
def test_invalid_quantities_are_rejected(text: str) -> None:
    with pytest.raises(QuantityError):
        Quantity.parse(text)


def test_formats_follow_the_suffix() -> None:
    assert Quantity.parse("1Gi").format is Format.BINARY_SI
    assert Quantity.parse("1G").format is Format.DECIMAL_SI
    assert Quantity.parse("1e9").format is Format.DECIMAL_EXPONENT


def test_arithmetic_and_comparison() -> None:
    a, b = Quantity.parse("40Gi"), Quantity.parse("40960Mi")
    assert a.compare(b) == 0 and a == b
    assert Quantity.parse("23034Mi").compare(a) == -1
    assert str(a.add(Quantity.parse("1Gi"))) == "41Gi"
    assert str(a.sub(a)) == "0"
    assert Quantity.parse("-1").sign() == -1 and Quantity.parse("0").sign() == 0
    assert Quantity.parse("1k").is_integer() and not Quantity.parse("1m").is_integer()
    assert not Quantity.parse("10E").is_integer()  # 10^19 does not fit in int64


def test_yaml_numbers_are_quantities() -> None:
    assert str(parse_quantity(132)) == "132"
    assert str(parse_quantity(1.5)) == "1500m"
    with pytest.raises(QuantityError):
        parse_quantity(True)
