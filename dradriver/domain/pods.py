"""What the API server checks of a Pod's claim references, in its words, so a tool refuses the Pod a cluster would
refuse.

Source: ``k8s.io/kubernetes/pkg/apis/core/validation`` (``validateResourceClaimNames``, called for every
container and init container with the names of ``spec.resourceClaims``): each
``resources.claims[i].name`` must be set, be one of the names in ``spec.resourceClaims`` and, with its
``request``, appear once per container. The messages are ``field.Error`` strings
(``<field>: Not found: "<name>": must be one of the names in pod.spec.resourceClaims: <names>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Problem = tuple[str, str, str]
"""``(reason, field path, message)``: the reason as the API server's ``StatusCause.reason``
(``FieldValueNotFound``), the path from the object's root, the message after the path."""


def claim_reference_problems(spec: Mapping[str, Any], path: str = "spec") -> list[Problem]:
    """Why the API server would refuse the claim references of pod spec ``spec`` (at ``path`` in its object:
    ``spec`` for a Pod, ``spec.template.spec`` for a Deployment); empty when it would not."""
    declared = sorted({str(entry.get("name")) for entry in spec.get("resourceClaims") or []
                       if isinstance(entry, Mapping) and entry.get("name")})
    problems: list[Problem] = []
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            if not isinstance(container, Mapping):
                continue
            refs = (container.get("resources") or {}).get("claims") or []
            problems.extend(_container_problems(refs, declared, f"{path}.{kind}[{i}].resources.claims"))
    return problems


def _container_problems(refs: list[Any], declared: list[str], where: str) -> list[Problem]:
    problems: list[Problem] = []
    seen: set[str] = set()
    for i, ref in enumerate(refs):
        name = str(ref.get("name") or "") if isinstance(ref, Mapping) else ""
        field = f"{where}[{i}]"
        if not name:
            problems.append(("FieldValueRequired", field, "Required value"))
            continue
        request = str(ref.get("request") or "") if isinstance(ref, Mapping) else ""
        key = f"{name}/{request}" if request else name
        if key in seen:
            problems.append(("FieldValueDuplicate", field, f'Duplicate value: "{name}"'))
        seen.add(key)
        if name not in declared:
            names = f": {', '.join(declared)}" if declared else " which is empty"
            problems.append(("FieldValueNotFound", field,
                             f'Not found: "{name}": must be one of the names in pod.spec.resourceClaims{names}'))
    return problems
