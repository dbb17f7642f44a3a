"""CEL run-time errors in the user's terms: which attribute or capacity a selector reads that a device lacks.

Looking up a name a device does not publish is a run-time error in Kubernetes' CEL environment (reference
``cel/compile.go`` in k8s.io/dynamic-resource-allocation: "accessing an unknown id is a runtime error"). When such an
error meets ``||`` or ``&&`` on both sides, cel-python reports only that no overload of the operator takes two
errors, which names neither the attribute nor the device. :func:`missing_names` finds the lookups that fail
by evaluating each attribute and capacity access of the selector on the device; :func:`describe_error`
words the outcome, with the names the device does publish and a close match for a typo.
"""

from __future__ import annotations

import difflib
from typing import Any

from celpy.evaluation import CELEvalError

from dradriver.allocator.expression import Selector, error_text

LOOKUPS = ("member_dot", "member_index")
"""Parse-tree nodes of an attribute/capacity access (``x.name``, ``x['name']``)."""

RETIRED_ATTRIBUTES = {
    "index": "older NVIDIA driver releases published index; select a GPU by uuid, "
    "resource.kubernetes.io/pciBusID or the device name instead",
}
"""Attribute names users carry over from older ResourceSlices, with what to use now."""


def missing_names(selector: Selector, device: Any) -> list[tuple[str, str]]:
    """``[(kind, "domain/name")]`` of attributes or capacities ``selector`` reads that ``device`` lacks.

    :param device: the CEL ``device`` value (:func:`dradriver.allocator.expression.device_variable`).
    :returns: in source order, each name once; kind is ``attribute`` or ``capacity``.
    """
    found: list[tuple[str, str]] = []
    for tree in selector.tree.iter_subtrees_topdown():
        if tree.data not in LOOKUPS:
            continue
        try:
            value = selector.evaluate_part(tree, device)
        except Exception:
            continue
        if not isinstance(value, CELEvalError):
            continue
        message = error_text(value)
        for kind in ("attribute", "capacity"):
            prefix = f"no {kind} "
            if message.startswith(prefix) and (kind, message[len(prefix) :]) not in found:
                found.append((kind, message[len(prefix) :]))
    return found


def _published(device: Any, kind: str, domain: str) -> list[str]:
    table = device.get("attributes" if kind == "attribute" else "capacity")
    try:
        names = table[domain]
    except (KeyError, TypeError):
        return []
    return sorted(str(k) for k in names) if isinstance(names, dict) else []


def describe_error(selector: Selector, device: Any, error: str) -> str:
    """The run-time ``error`` of ``selector`` on ``device``, reworded when a lookup of a missing name caused it.

    ``device gpu-0 does not publish attribute gpu.nvidia.com/index (... hint)``; other errors come back as
    they are.
    """
    missing = missing_names(selector, device)
    if not missing:
        return error
    parts = []
    for kind, name in missing:
        domain, _, ident = name.rpartition("/")
        text = f"the selector reads {kind} {name}, which this device does not publish"
        published = _published(device, kind, domain)
        close = difflib.get_close_matches(ident, published, n=1, cutoff=0.6) or [
            p for p in published if p.lower() == ident.lower()
        ]
        if ident in RETIRED_ATTRIBUTES and kind == "attribute":
            text += f" ({RETIRED_ATTRIBUTES[ident]})"
        elif close:
            text += f" (did you mean {domain}/{close[0]}?)"
        parts.append(text)
    return "; ".join(parts)


def published_summary(device: Any, kind: str, domain: str) -> str:
    """``type, uuid, productName, ...`` for a hint line (empty if the device publishes none there)."""
    return ", ".join(_published(device, kind, domain))
