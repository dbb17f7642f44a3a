"""Semantic versions as DRA version attributes and the CEL semver library use them."""

from __future__ import annotations

import pytest

from dradriver.allocator.semver import Semver, SemverError


@pytest.mark.parametrize(
    ("smaller", "larger"),
    [
        ("535.183.1", "550.0.0"),
        ("550.0.0", "550.54.15"),
        ("8.9.0", "9.0.0"),
        ("9.0.0", "10.0.0"),
        ("1.0.0-alpha", "1.0.0"),
        ("1.0.0-alpha", "1.0.0-alpha.1"),
        ("1.0.0-alpha.1", "1.0.0-alpha.beta"),
        ("1.0.0-beta.2", "1.0.0-beta.11"),
        ("1.0.0-rc.1", "1.0.0"),
    ],
)
def test_precedence(smaller: str, larger: str) -> None:
    assert Semver.parse(smaller).compare(Semver.parse(larger)) == -1
    assert Semver.parse(larger).compare(Semver.parse(smaller)) == 1


def test_build_metadata_is_ignored() -> None:
    assert Semver.parse("1.2.3+abc") == Semver.parse("1.2.3+def")


@pytest.mark.parametrize("text", ["570.124.06", "v1.2.3", "1.2", "1", "1.2.3-", "1.2.3-01", "", "a.b.c"])
def test_strict_parsing_rejects(text: str) -> None:
    with pytest.raises(SemverError):
        Semver.parse(text)


@pytest.mark.parametrize(("text", "normal"), [("v1.2", "1.2.0"), ("1", "1.0.0"), ("570.124.06", "570.124.6")])
def test_normalize(text: str, normal: str) -> None:
    assert str(Semver.parse(text, normalize=True)) == normal
