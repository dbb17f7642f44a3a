"""Kubernetes' name rules, with the API server's own wording, so a tool can refuse a bad name before it reaches
the API server (or its emulator) and say why in the same words.

Source: ``k8s.io/apimachinery/pkg/util/validation`` (``IsDNS1123Subdomain``, ``IsDNS1123Label``, ``RegexError``,
``MaxLenError``). A Node's name, like most object names, is an RFC 1123 subdomain (the Kubernetes documentation,
"Object Names and IDs"); a ResourceSlice's device name and a request name are RFC 1123 labels.
"""

from __future__ import annotations

import re

DNS_SUBDOMAIN_MAX_LENGTH = 253
"""Longest RFC 1123 subdomain, in characters."""

DNS_LABEL_MAX_LENGTH = 63
"""Longest RFC 1123 label, in characters."""

_LABEL_FORMAT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN_FORMAT = _LABEL_FORMAT + r"(\." + _LABEL_FORMAT + ")*"
_LABEL = re.compile(_LABEL_FORMAT)
_SUBDOMAIN = re.compile(_SUBDOMAIN_FORMAT)

DNS_SUBDOMAIN_RULE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    f"start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    f"'{_SUBDOMAIN_FORMAT}')"
)
"""The API server's message for a name that is not an RFC 1123 subdomain."""

DNS_LABEL_RULE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    f"end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    f"'{_LABEL_FORMAT}')"
)
"""The API server's message for a name that is not an RFC 1123 label (its double space included)."""


def dns_subdomain_problems(value: str) -> list[str]:
    """Why ``value`` is not a lowercase RFC 1123 subdomain (a Node's name), in the API server's words; empty
    when it is one."""
    return _problems(value, DNS_SUBDOMAIN_MAX_LENGTH, _SUBDOMAIN, DNS_SUBDOMAIN_RULE)


def dns_label_problems(value: str) -> list[str]:
    """Why ``value`` is not a lowercase RFC 1123 label (a device or request name), in the API server's words;
    empty when it is one."""
    return _problems(value, DNS_LABEL_MAX_LENGTH, _LABEL, DNS_LABEL_RULE)


def _problems(value: str, max_length: int, pattern: re.Pattern[str], rule: str) -> list[str]:
    """apimachinery's order: the length (``MaxLenError``), then the pattern (``RegexError``)."""
    problems = []
    if len(value) > max_length:
        problems.append(f"must be no more than {max_length} characters")
    if not pattern.fullmatch(value):
        problems.append(rule)
    return problems
