"""Semantic versions (semver 2.0.0) as Kubernetes CEL and DRA version attributes use them.

Strict parsing follows ``blang/semver`` ``Parse`` (used by DRA for ``version`` attributes and by the CEL
``semver()`` function): ``MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]``, no leading ``v``, no leading zeros in
numeric identifiers. ``normalize=True`` (CEL ``semver(s, true)``) first strips a leading ``v``, fills a
missing minor/patch with ``0`` and drops leading zeros, as ``apiserver/pkg/cel/library/semverlib.go`` does.
Precedence follows semver 2.0.0 section 11 (build metadata ignored).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dradriver.errors import DradriverError

_NUM = r"0|[1-9][0-9]*"
_IDENT = r"[0-9A-Za-z-]+"
_STRICT = re.compile(
    rf"^({_NUM})\.({_NUM})\.({_NUM})"
    rf"(?:-({_IDENT}(?:\.{_IDENT})*))?"
    rf"(?:\+({_IDENT}(?:\.{_IDENT})*))?$"
)
_LOOSE_CORE = re.compile(r"^v?([0-9]+)(?:\.([0-9]+))?(?:\.([0-9]+))?(.*)$")


class SemverError(DradriverError, ValueError):
    """A string is not a semantic version."""


@dataclass(frozen=True, slots=True)
class Semver:
    """A semantic version.

    :param major/minor/patch: numeric core.
    :param prerelease: dot-separated identifiers after ``-`` (empty tuple if none).
    :param build: build metadata after ``+`` (ignored for precedence).
    """

    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, normalize: bool = False) -> Semver:
        """Parse ``text``; with ``normalize``, accept ``v1.2``, ``1``, ``01.02.03`` first.

        :raises SemverError: not a semantic version (leading zeros in a numeric prerelease identifier,
            missing parts without ``normalize``, empty identifiers, ...).
        """
        if not isinstance(text, str):
            raise SemverError(f"version {text!r}: not a string")
        if normalize:
            loose = _LOOSE_CORE.match(text)
            if loose is not None:
                major, minor, patch, rest = loose.groups()
                text = f"{int(major)}.{int(minor or 0)}.{int(patch or 0)}{rest}"
        match = _STRICT.match(text)
        if match is None:
            raise SemverError(f"version {text!r}: not a semantic version (MAJOR.MINOR.PATCH[-pre][+build])")
        major, minor, patch, pre, build = match.groups()
        prerelease = tuple(pre.split(".")) if pre else ()
        for ident in prerelease:
            if ident.isdigit() and len(ident) > 1 and ident.startswith("0"):
                raise SemverError(f"version {text!r}: numeric prerelease identifier {ident!r} has a leading zero")
        return cls(int(major), int(minor), int(patch), prerelease, tuple(build.split(".")) if build else ())

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self) -> str:
        return f"Semver({str(self)!r})"

    def compare(self, other: Semver) -> int:
        """-1, 0 or 1 by semver precedence (build metadata ignored)."""
        a = (self.major, self.minor, self.patch)
        b = (other.major, other.minor, other.patch)
        if a != b:
            return -1 if a < b else 1
        if self.prerelease == other.prerelease:
            return 0
        if not self.prerelease:
            return 1
        if not other.prerelease:
            return -1
        for x, y in zip(self.prerelease, other.prerelease, strict=False):
            if x == y:
                continue
            xd, yd = x.isdigit(), y.isdigit()
            if xd and yd:
                return -1 if int(x) < int(y) else 1
            if xd != yd:
                return -1 if xd else 1
            return -1 if x < y else 1
        return (len(self.prerelease) > len(other.prerelease)) - (len(self.prerelease) < len(other.prerelease))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self.compare(other) == 0

    def __hash__(self) -> int:
        return hash((self.major, self.minor, self.patch, self.prerelease))
