"""Label selectors (equality- and set-based) and field selectors, as list and watch apply them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dradriver.sandbox.apiserver.errors import bad_request
from dradriver.sandbox.apiserver.resources import ResourceType

# (label, equal, value): ``equal`` is False for ``!=``.
FieldTerm = tuple[str, bool, str]


@dataclass(frozen=True, slots=True)
class Requirement:
    """One term of a label selector."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        return not present or value not in self.values  # notin


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


_SET_RE = re.compile(r"^([^\s!=(),]+)\s+(in|notin)\s*\(([^)]*)\)$")


def parse_label_selector(text: str) -> list[Requirement]:
    """Parse a ``labelSelector`` query value (equality- and set-based forms).

    :raises ApiStatusError: 400 with the selector text for a malformed selector.
    """
    reqs: list[Requirement] = []
    for part in _split_top_level(text):
        m = _SET_RE.match(part)
        if m:
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(Requirement(m.group(1), m.group(2), values))
        elif "!=" in part:
            k, v = part.split("!=", 1)
            reqs.append(Requirement(k.strip(), "!=", (v.strip(),)))
        elif "==" in part or "=" in part:
            k, v = part.split("==", 1) if "==" in part else part.split("=", 1)
            reqs.append(Requirement(k.strip(), "=", (v.strip(),)))
        elif part.startswith("!"):
            reqs.append(Requirement(part[1:].strip(), "!"))
        elif re.fullmatch(r"[A-Za-z0-9._/-]+", part):
            reqs.append(Requirement(part, "exists"))
        else:
            raise bad_request(f"unable to parse requirement: {part!r} in labelSelector {text!r}")
    return reqs


def parse_field_selector(text: str, rt: ResourceType) -> list[FieldTerm]:
    """Parse a ``fieldSelector`` into ``(label, equal, value)`` triples.

    :raises ApiStatusError: 400 ``field label not supported`` for a label the resource does not index.
    """
    terms: list[FieldTerm] = []
    allowed = {"metadata.name", "metadata.namespace", *rt.field_labels}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "!=" in part:
            label, value = part.split("!=", 1)
            equal = False
        elif "==" in part:
            label, value = part.split("==", 1)
            equal = True
        elif "=" in part:
            label, value = part.split("=", 1)
            equal = True
        else:
            raise bad_request(f"invalid field selector: {part!r}")
        label = label.strip()
        if label not in allowed:
            raise bad_request(f"field label not supported: {label}")
        terms.append((label, equal, value.strip()))
    return terms


def _lookup_path(obj: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def field_value(obj: Mapping[str, Any], label: str) -> str:
    """The value a field selector compares for ``label`` (``""`` when unset, ``true``/``false`` for bools)."""
    value = _lookup_path(obj, label)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def selects(obj: Mapping[str, Any], labels: list[Requirement], fields: list[FieldTerm]) -> bool:
    """``obj`` matches every label requirement and every field term."""
    obj_labels = (obj.get("metadata") or {}).get("labels") or {}
    if not all(r.matches(obj_labels) for r in labels):
        return False
    return all((field_value(obj, label) == value) == equal for label, equal, value in fields)
