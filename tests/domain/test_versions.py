"""Semver normalisation of version attributes (``dradriver.domain.versions``), table-driven."""

from __future__ import annotations

import logging

import pytest

from dradriver.domain.versions import MAX_VERSION_LENGTH, is_semver, normalize_version

CASES = [
    # (input, expected output) -- None means "attribute omitted"
    ("550.127.08", "550.127.8"),
    ("570.124.06", "570.124.6"),
    ("580.95.05", "580.95.5"),
    ("580.105.08", "580.105.8"),
    ("595.58.03", "595.58.3"),
    ("570.86.15", "570.86.15"),
    ("535.104.05.01", "535.104.5+1"),
    ("535.104.05.01.7", "535.104.5+1.7"),
    ("12.8", "12.8.0"),
    ("13.0", "13.0.0"),
    ("8.0", "8.0.0"),
    ("10.0", "10.0.0"),
    ("12", "12.0.0"),
    ("v1.2.3", "1.2.3"),
    (" 570.148.08\n", "570.148.8"),
    ("00.01.02", "0.1.2"),
    ("1.2.3-rc.01", "1.2.3-rc.1"),
    ("1.2.3-01a", "1.2.3-01a"),
    ("1.2.3+build.007", "1.2.3+build.007"),
    ("1.2.3.4+meta", "1.2.3+4.meta"),
    ("", None),
    ("   ", None),
    ("N/A", None),
    ("1..2", None),
    ("1.2.", None),
    ("1.2.3-", None),
    ("abc", None),
    ("570.x.1", None),
    ("9" * 70, None),
]


@pytest.mark.parametrize(("raw", "expected"), CASES)
def test_normalize_version_table(raw: str, expected: str | None) -> None:
    got = normalize_version(raw)
    assert got == expected
    if got is not None:
        assert is_semver(got), got


def test_none_input_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert normalize_version(None) is None
    assert caplog.records == []


@pytest.mark.parametrize("raw", ["", "garbage", "1..2"])
def test_rejected_input_warns_with_its_name(raw: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dradriver.domain.versions"):
        assert normalize_version(raw, what="driverVersion") is None
    assert any("driverVersion" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("1.2.3", True),
        ("0.0.0", True),
        ("1.2.3-alpha.1+b.02", True),
        ("01.2.3", False),  # leading zero
        ("1.02.3", False),
        ("1.2.03", False),
        ("1.2", False),  # three parts required
        ("1.2.3.4", False),
        ("1.2.3-01", False),  # numeric pre-release identifier with a leading zero
        ("1.2.3+", False),
        ("v1.2.3", False),
        ("1." + "1" * MAX_VERSION_LENGTH + ".0", False),  # over the length limit
    ],
)
def test_is_semver_matches_kubernetes_rules(text: str, valid: bool) -> None:
    assert is_semver(text) is valid
