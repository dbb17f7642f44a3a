"""Allocation simulator: read Kubernetes objects, allocate claims like kube-scheduler, explain the outcome.

Input is any mix of ``ResourceSlice``, ``DeviceClass``, ``ResourceClaim``, ``ResourceClaimTemplate``, ``Pod``,
``Node`` and ``Namespace`` objects (``List`` objects are flattened; other kinds are ignored). Templates become
claims: one per Pod that references the template (named ``<pod>-<pod claim name>``), or, when no Pod does,
one claim named after the template. Claims that already carry ``status.allocation`` hold their devices.

Claims of one Pod are allocated together on the Pod's ``spec.nodeName`` (or the first node, in name order,
that fits); claims no Pod references are allocated one by one, in input order.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from dradriver.allocator.allocation import (
    AllocationError,
    Allocator,
    Pool,
    Verdict,
    constraint_text,
    gather_pools,
)
from dradriver.allocator.resources import (
    Claim,
    DeviceClass,
    InputError,
    Node,
    Request,
    ResourceSlice,
    parse_claim,
    parse_device_class,
    parse_node,
    parse_slice,
)
from dradriver.allocator.wording import describe, rejection

ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


@dataclass
class Inputs:
    """Objects read from YAML, parsed."""

    slices: list[ResourceSlice] = field(default_factory=list)
    classes: dict[str, DeviceClass] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)
    templates: list[dict[str, Any]] = field(default_factory=list)


def _flatten(objects: Iterable[Any]) -> Iterable[dict[str, Any]]:
    for obj in objects:
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise InputError(f"expected a Kubernetes object (a mapping), got {type(obj).__name__}")
        if str(obj.get("kind", "")).endswith("List") and isinstance(obj.get("items"), list):
            yield from _flatten(obj["items"])
        else:
            yield obj


def load(texts: Iterable[str]) -> Inputs:
    """Parse multi-document YAML texts.

    :raises InputError: YAML syntax errors (with line), malformed objects (object and field named),
        invalid CEL (line, column and caret).
    """
    objects: list[Any] = []
    for text in texts:
        try:
            objects.extend(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            raise InputError(f"invalid YAML: {exc}") from None
    inputs = Inputs()
    raw_claims: list[dict[str, Any]] = []
    for obj in _flatten(objects):
        kind = obj.get("kind")
        if kind == "ResourceSlice":
            inputs.slices.append(parse_slice(obj))
        elif kind == "DeviceClass":
            device_class = parse_device_class(obj)
            inputs.classes[device_class.name] = device_class
        elif kind == "ResourceClaim":
            raw_claims.append(obj)
        elif kind == "ResourceClaimTemplate":
            inputs.templates.append(obj)
        elif kind == "Pod":
            inputs.pods.append(obj)
        elif kind == "Node":
            node = parse_node(obj)
            inputs.nodes[node.name] = node
        elif kind == "Namespace":
            meta = obj.get("metadata") or {}
            inputs.namespaces[str(meta.get("name"))] = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    inputs.claims = [parse_claim(c) for c in raw_claims]
    inputs.claims.extend(_instantiate(inputs))
    return inputs


def _instantiate(inputs: Inputs) -> list[Claim]:
    claims: list[Claim] = []
    used: set[tuple[str, str]] = set()
    for pod in inputs.pods:
        meta = pod.get("metadata") or {}
        namespace, pod_name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            template_name = entry.get("resourceClaimTemplateName")
            if not template_name:
                continue
            template = _template(inputs, namespace, str(template_name))
            if template is None:
                raise InputError(
                    f"Pod {namespace}/{pod_name}: spec.resourceClaims[{entry.get('name')}]: "
                    f"ResourceClaimTemplate {namespace}/{template_name} not found"
                )
            used.add((namespace, str(template_name)))
            claims.append(
                _from_template(
                    template,
                    namespace,
                    f"{pod_name}-{entry.get('name')}",
                    f"from template {template_name} for pod {pod_name}",
                    pod,
                    str(entry.get("name")),
                )
            )
    for template in inputs.templates:
        meta = template.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        if (namespace, name) not in used:
            claims.append(_from_template(template, namespace, name, f"from template {name}", None, None))
    return claims


def _template(inputs: Inputs, namespace: str, name: str) -> dict[str, Any] | None:
    for template in inputs.templates:
        meta = template.get("metadata") or {}
        if str(meta.get("namespace") or "default") == namespace and meta.get("name") == name:
            return template
    return None


def _from_template(
    template: dict[str, Any], namespace: str, name: str, origin: str, pod: dict[str, Any] | None, entry: str | None
) -> Claim:
    spec = template.get("spec") or {}
    metadata = copy.deepcopy(spec.get("metadata") or {})
    metadata.update({"name": name, "namespace": namespace})
    if pod is not None and entry is not None:
        metadata.setdefault("annotations", {})["resource.kubernetes.io/pod-claim-name"] = entry
        pod_meta = pod.get("metadata") or {}
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod_meta.get("name"),
                "uid": pod_meta.get("uid", ""),
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": copy.deepcopy(spec.get("spec") or {}),
    }
    return parse_claim(obj, origin)


@dataclass
class Group:
    """Claims allocated together (one Pod's claims, or a lone claim), and where."""

    claims: list[Claim]
    node: str | None
    pod: str | None = None


def groups(inputs: Inputs) -> list[Group]:
    """Allocation units in order: each Pod's unallocated claims, then claims no Pod references."""
    by_ref = {c.ref: c for c in inputs.claims}
    referenced: set[str] = set()
    result = []
    for pod in inputs.pods:
        meta = pod.get("metadata") or {}
        namespace, pod_name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        members = []
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            name = entry.get("resourceClaimName") or (
                f"{pod_name}-{entry.get('name')}" if entry.get("resourceClaimTemplateName") else None
            )
            claim = by_ref.get(f"{namespace}/{name}")
            if claim is None:
                raise InputError(f"Pod {namespace}/{pod_name}: ResourceClaim {namespace}/{name} not found")
            referenced.add(claim.ref)
            if claim not in members:
                members.append(claim)
        node = (pod.get("spec") or {}).get("nodeName")
        result.append(Group(members, str(node) if node else None, f"{namespace}/{pod_name}"))
    for claim in inputs.claims:
        if claim.ref not in referenced:
            result.append(Group([claim], None))
    return result


@dataclass
class Outcome:
    """What the simulator did: claims in output order (allocations filled in) and failures."""

    claims: list[dict[str, Any]]
    failures: list[str]
    nodes: dict[str, str | None]
    allocator: Allocator


def _check_admin(inputs: Inputs, claim: Claim) -> None:
    if not any(r.admin_access for r in claim.requests) or claim.namespace not in inputs.namespaces:
        return
    if inputs.namespaces[claim.namespace].get(ADMIN_ACCESS_LABEL) != "true":
        raise AllocationError(
            f"cannot allocate claim {claim.ref}: adminAccess requires the namespace label "
            f"{ADMIN_ACCESS_LABEL}=true on namespace {claim.namespace}"
        )


def simulate(inputs: Inputs) -> Outcome:
    """Allocate every unallocated claim (see module docstring)."""
    allocator = Allocator(inputs.slices, inputs.classes, inputs.nodes, [c for c in inputs.claims if c.allocation])
    allocations: dict[str, dict[str, Any]] = {}
    nodes: dict[str, str | None] = {}
    failures: list[str] = []
    for group in groups(inputs):
        pending = [c for c in group.claims if c.allocation is None and c.ref not in allocations]
        if not pending:
            continue
        try:
            for claim in pending:
                _check_admin(inputs, claim)
            node, results = allocator.allocate(pending, group.node)
        except AllocationError as exc:
            failures.append(str(exc))
            continue
        for claim, allocation in zip(pending, results, strict=True):
            allocations[claim.ref] = allocation
            nodes[claim.ref] = node
    out = []
    for claim in inputs.claims:
        obj = copy.deepcopy(claim.obj)
        if claim.ref in allocations:
            obj.setdefault("status", {})["allocation"] = allocations[claim.ref]
        if claim.allocation is not None or claim.ref in allocations:
            out.append(obj)
    return Outcome(out, failures, nodes, allocator)


# ------------------------------------------------------------------------------------------------ explain


def _count_words(request: Request) -> str:
    if request.mode == "All":
        return "all devices"
    return f"{request.count} device{'s' if request.count != 1 else ''}"


def request_header(request: Request, classes: dict[str, DeviceClass]) -> str:
    """``request "gpu": 1 device of class gpu.nvidia.com (type is "gpu") where memory at least 40Gi``."""
    device_class = classes.get(request.class_name)
    class_words = " and ".join(describe(s) for s in device_class.selectors) if device_class else "class not found"
    text = f"{_count_words(request)} of class {request.class_name}"
    if class_words:
        text += f" ({class_words})"
    if request.selectors:
        text += " where " + " and ".join(describe(s) for s in request.selectors)
    if request.admin_access:
        text += ", with admin access (devices in use by other claims are allowed)"
    if request.capacity:
        text += ", consuming " + ", ".join(f"{name} {amount}" for name, amount in sorted(request.capacity.items()))
    if request.tolerations:
        text += ", tolerating " + ", ".join(
            f"{t.key or '*'}{'=' + t.value if t.value else ''}:{t.effect or '*'}" for t in request.tolerations
        )
    return text


def _verdict_text(verdict: Verdict, request: Request, classes: dict[str, DeviceClass], cel_device: Any) -> str:
    if verdict.stage in ("class", "request") and verdict.outcome is not None:
        selectors = classes[request.class_name].selectors if verdict.stage == "class" else request.selectors
        label = f"{'class' if verdict.stage == 'class' else 'request'} selector #{verdict.selector + 1}"
        if verdict.outcome.error:
            return f"rejected by {label}: error: {verdict.outcome.error}"
        return f"rejected by {label}: {rejection(selectors[verdict.selector], cel_device)}"
    if verdict.stage == "accepted":
        return "accepted"
    if verdict.stage == "in-use":
        return verdict.reason
    return (f"rejected: {verdict.reason}" if verdict.stage in ("pool", "counters", "binding", "capacity")
            else verdict.reason)


def explain(inputs: Inputs) -> tuple[str, int]:
    """Explain every claim: per request, every candidate device and its verdict.

    :returns: ``(text, exit code)``; the code is 1 if some claim cannot be allocated.
    """
    outcome = simulate(inputs)
    lines: list[str] = []
    results_by_claim: dict[str, list[dict[str, Any]]] = {}
    for obj in outcome.claims:
        meta = obj.get("metadata") or {}
        ref = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        results_by_claim[ref] = ((obj.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
            "results"
        ) or []
    failures = {f.split(": ", 1)[0].removeprefix("cannot allocate claim "): f for f in outcome.failures}
    # Each claim is explained against every other claim's devices (pre-allocated or allocated in this run).
    base = outcome.allocator
    everything = dict(base.in_use)
    for claim in inputs.claims:
        base.in_use = {k: v for k, v in everything.items() if v != claim.ref}
        base.consumed = base.consumption_without(claim.ref)
        head = f"claim {claim.ref}" + (f" ({claim.origin})" if claim.origin else "")
        results = results_by_claim.get(claim.ref)
        failure = next((text for refs, text in failures.items() if claim.ref in refs.split(", ")), None)
        if claim.allocation is not None:
            lines.append(f"{head}: already allocated")
            lines.extend(f"  {r.get('request')}: {r.get('pool')}/{r.get('device')}" for r in results or [])
            lines.append("")
            continue
        if failure is not None:
            lines.append(f"{head}: CANNOT ALLOCATE")
            lines.append(f"  {failure}")
        elif results is not None:
            node = outcome.nodes.get(claim.ref)
            lines.append(f"{head}: allocated" + (f" on node {node}" if node else ""))
        node_names: list[str | None] = (
            [outcome.nodes.get(claim.ref)] if results is not None else list(base.node_names()) or [None]
        )
        for constraint in claim.constraints:
            lines.append(f"  constraint: {constraint_text(constraint)}")
        for node_name in node_names:
            pools = gather_pools(inputs.slices, base.node(node_name))
            used = base.baseline_counters(pools)
            if len(node_names) > 1 or results is None:
                lines.append(f"  on node {node_name}:" if node_name else "  on no particular node (allNodes slices):")
            for request in claim.requests:
                lines.extend(_explain_request(claim, request, pools, used, base, inputs, results))
        lines.append("")
    base.in_use = everything
    base.consumed = base.consumption_without(None)
    return "\n".join(lines).rstrip() + "\n", 1 if outcome.failures else 0


def _explain_request(
    claim: Claim,
    request: Request,
    pools: list[Pool],
    used: Any,
    base: Allocator,
    inputs: Inputs,
    results: list[dict[str, Any]] | None,
) -> list[str]:
    lines = []
    alternatives = request.subrequests or [request]
    if request.subrequests:
        lines.append(
            f"  request {request.name!r}: the first available of "
            + ", then ".join(repr(s.name) for s in request.subrequests)
        )
    chosen = {(r.get("pool"), r.get("device")): str(r.get("request")) for r in results or []}
    chosen_values: dict[int, Any] = {}
    for k, constraint in enumerate(claim.constraints):
        for pool in pools:
            for device in pool.devices:
                name = chosen.get((device.pool, device.name))
                if name is not None and constraint.covers(name) and constraint.attribute in device.attributes:
                    chosen_values.setdefault(k, device.attributes[constraint.attribute])
    for alt in alternatives:
        if alt.class_name not in inputs.classes:
            lines.append(f"    request {alt.name!r}: device class {alt.class_name!r} does not exist")
            continue
        indent = "    " if request.subrequests else "  "
        lines.append(f"{indent}request {alt.name!r}: {request_header(alt, inputs.classes)}")
        if not any(pool.devices for pool in pools):
            lines.append(f"{indent}  (no devices on this node)")
        for pool in pools:
            if not pool.devices:
                continue
            lines.append(f"{indent}  pool {pool.name} (driver {pool.driver}):")
            width = max(len(d.name) for d in pool.devices)
            for device in pool.devices:
                verdict = base.verdict(alt, device, pool, used, claim)
                text = _verdict_text(verdict, alt, inputs.classes, device.cel())
                picked = chosen.get((device.pool, device.name))
                if picked == alt.name:
                    text = "accepted -> allocated" + (" (admin access)" if alt.admin_access else "")
                elif verdict.accepted:
                    text = _unpicked(claim, alt, device, chosen_values, picked, results)
                lines.append(f"{indent}    {device.name.ljust(width)}  {text}")
    return lines


def _unpicked(
    claim: Claim,
    request: Request,
    device: Any,
    chosen_values: dict[int, Any],
    picked: str | None,
    results: list[dict[str, Any]] | None,
) -> str:
    for k, constraint in enumerate(claim.constraints):
        if not constraint.covers(request.name):
            continue
        value = device.attributes.get(constraint.attribute)
        if value is None:
            return f"rejected by constraint #{k + 1}: no attribute {constraint.text}"
        if k in chosen_values and not (type(value) is type(chosen_values[k]) and value == chosen_values[k]):
            return (
                f"rejected by constraint #{k + 1}: {constraint.attribute[1]} {_show(value)} differs from "
                f"{_show(chosen_values[k])} of the allocated devices"
            )
    if picked is not None:
        return f"accepted, but allocated to request {picked!r} of this claim"
    if results is None:
        return "accepted"
    return "accepted, not needed"


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def dump(claims: list[dict[str, Any]]) -> str:
    """Claims as multi-document YAML."""
    return yaml.safe_dump_all(claims, sort_keys=False, default_flow_style=False)
