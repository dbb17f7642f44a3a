"""Semantic-version normalisation for ResourceSlice ``version`` attributes.

The API server parses every ``version`` attribute with a strict Semantic Versioning 2.0.0 parser
(``blang/semver`` ``Parse``: exactly three numeric parts, no leading zeros, at most 64 characters) and
rejects the whole ResourceSlice when one value fails (``resource/v1/types.go`` in kubernetes/api). NVIDIA's
driver feeds NVML strings through Masterminds ``semver`` first, which drops leading zeros
(``580.95.05`` -> ``580.95.5``, NVIDIA's ``cmd/gpu-kubelet-plugin/deviceinfo.go``). This module does the same, and more
forgivingly:

==========================  =====================  =============================================
input                       output                 rule
==========================  =====================  =============================================
``550.127.08``              ``550.127.8``          leading zeros dropped from numeric parts
``12.8``                    ``12.8.0``             missing minor/patch filled with ``0``
``12``                      ``12.0.0``
``v1.2.3``                  ``1.2.3``              a leading ``v`` is dropped
``535.104.05.01``           ``535.104.5+1``        parts after the third become build metadata
``1.2.3-rc.01``             ``1.2.3-rc.1``         numeric pre-release identifiers lose zeros
``""``, ``N/A``, ``1..2``   ``None``               not a version: the attribute is omitted
==========================  =====================  =============================================

Extra numeric parts go into *build metadata*, not the pre-release: build metadata is ignored when versions
are compared, so ``535.104.05.01`` still compares equal to ``535.104.5`` (a pre-release would sort it
*below* ``535.104.5``, which is wrong for a patch-level suffix).
"""

from __future__ import annotations

import logging
import re

MAX_VERSION_LENGTH = 64
"""Longest ``version`` attribute value the API accepts (``DeviceAttributeMaxValueLength``)."""

log = logging.getLogger(__name__)

_NUM = r"0|[1-9]\d*"
_IDENT = r"[0-9A-Za-z-]+"
_SEMVER = re.compile(
    rf"^(?:{_NUM})\.(?:{_NUM})\.(?:{_NUM})"
    rf"(?:-(?:{_NUM}|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:{_NUM}|\d*[A-Za-z-][0-9A-Za-z-]*))*)?"
    rf"(?:\+{_IDENT}(?:\.{_IDENT})*)?$"
)
_LOOSE = re.compile(
    r"^[vV]?(?P<core>\d+(?:\.\d+)*)"
    rf"(?:-(?P<pre>{_IDENT}(?:\.{_IDENT})*))?"
    rf"(?:\+(?P<build>{_IDENT}(?:\.{_IDENT})*))?$"
)


def is_semver(text: str) -> bool:
    """Whether ``text`` is strict Semantic Versioning 2.0.0 as Kubernetes validates it (length included)."""
    return len(text) <= MAX_VERSION_LENGTH and _SEMVER.match(text) is not None


def _strip_zeros(ident: str) -> str:
    return str(int(ident)) if ident.isdigit() else ident


def normalize_version(text: str | None, *, what: str = "version") -> str | None:
    """Return ``text`` as strict semver for a ``version`` attribute, or ``None`` when it is not a version.

    :param text: a version as a driver reports it (``"570.124.06"``, ``"12.8"``, ``"8.0"``).
    :param what: name of the value in the warning logged when ``None`` is returned (``"driverVersion"``).
    :returns: normalised text (see the module table), or ``None`` for empty, garbage or over-long input;
        a warning is logged in the latter two cases, nothing for ``None``/empty input.
    """
    if text is None:
        return None
    raw = text.strip()
    if not raw:
        log.warning("%s is empty; the attribute is omitted", what)
        return None
    match = _LOOSE.match(raw)
    if match is None:
        log.warning("%s %r is not a version; the attribute is omitted", what, raw)
        return None
    parts = [str(int(p)) for p in match.group("core").split(".")]
    core, extra = [*parts, "0", "0"][:3], parts[3:]
    out = ".".join(core)
    if match.group("pre"):
        out += "-" + ".".join(_strip_zeros(i) for i in match.group("pre").split("."))
    build = [*extra, *(match.group("build").split(".") if match.group("build") else [])]
    if build:
        out += "+" + ".".join(build)
    if not is_semver(out):
        log.warning("%s %r gives %r, which is not valid semver; the attribute is omitted", what, raw, out)
        return None
    return out

