"""Allocation simulator: read Kubernetes objects, allocate claims like kube-scheduler, explain the outcome.

Input is any mix of ``ResourceSlice``, ``DeviceClass``, ``ResourceClaim``, ``ResourceClaimTemplate``
(``resource.k8s.io`` v1, v1beta2 or v1beta1, converted as the API server converts them:
:mod:`.conversion`; retired versions are refused with the reason, as are NVIDIA's classic-DRA parameter
kinds and mig-parted configs: :mod:`.refusals`), ``Pod``, ``Node``, ``Namespace``, and
workloads (Deployments, ReplicaSets, StatefulSets, Jobs, MPIJobs), which become the Pods their controllers
would run (:mod:`.workloads`), and ``ComputeDomain`` objects, which become the ResourceClaimTemplates the
compute-domain controller creates (the workload's IMEX channel, the IMEX daemons' claims:
:mod:`.computedomains`). ``List`` objects are flattened. Every other object is named in
:attr:`Inputs.warnings`; an input without any object is an error, a YAML error names the source and line.

The control plane's claims are generated as it generates them: per template entry of a Pod, one claim named
by the ResourceClaim controller's rule (``<pod>-<claim>-<5 characters>``, :mod:`.naming`; a Pod whose
``status.resourceClaimStatuses`` names a claim in the input uses it); per Pod that asks for extended
resources a DeviceClass maps (``nvidia.com/gpu: 1``), the claim kube-scheduler generates
(:mod:`.extended`, KEP-5004); a template no Pod references gives one claim named after the template.
Claims that already carry ``status.allocation`` hold their devices.

Claims of one Pod are allocated together on the Pod's ``spec.nodeName`` (or the first node, in name order,
that fits); claims no Pod references are allocated one by one, in input order. A Pod with an extended
resource nothing serves (no DeviceClass maps it, no Node offers it in ``status.allocatable``) is not
scheduled, and the failure says why. A Pod must also fit its node's ``status.allocatable`` CPU and memory with its
requests plus its devices' KEP-5517 overhead (``nodeAllocatableResources``; :mod:`.noderesources`), Pods already
bound to the node taking their share first; ``explain`` prints the sums per scheduled Pod.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import yaml

from dradriver.allocator import computedomains, noderesources
from dradriver.allocator.allocation import (
    AllocationError,
    Allocator,
    Pool,
    Verdict,
    constraint_text,
)
from dradriver.allocator.conversion import as_mapping, is_resource_api, to_v1
from dradriver.allocator.extended import ExtendedPlan, class_mapping, plan, unserved_reason
from dradriver.allocator.naming import template_claim_name
from dradriver.allocator.refusals import refusal
from dradriver.allocator.resources import (
    Claim,
    Device,
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
from dradriver.allocator.shapes import ShapeCache
from dradriver.allocator.wording import describe
from dradriver.allocator.workloads import NOT_EXPANDED, expand, group_kind, is_workload
from dradriver.domain.claims import POD_CLAIM_NAME_ANNOTATION
from dradriver.domain.pods import claim_reference_problems

ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


@dataclass
class Inputs:
    """Objects read from YAML, parsed.

    :param pod_claims: ``namespace/pod`` -> the refs of the Pod's claims (named, from templates, extended).
    :param extended: ``namespace/pod`` -> what the scheduler makes of the Pod's extended resources.
    :param warnings: objects read but not used, each named with its source (nothing is dropped silently).
    :param notes: what workloads became (``Deployment default/x: 4 replica(s) of ReplicaSet x-...``).
    """

    slices: list[ResourceSlice] = field(default_factory=list)
    classes: dict[str, DeviceClass] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)
    templates: list[dict[str, Any]] = field(default_factory=list)
    raw_classes: list[dict[str, Any]] = field(default_factory=list)
    allocatable: dict[str, dict[str, Any]] = field(default_factory=dict)
    pod_claims: dict[str, list[str]] = field(default_factory=dict)
    extended: dict[str, ExtendedPlan] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    domains: computedomains.DomainTemplates = field(default_factory=computedomains.DomainTemplates)


def _flatten(objects: Iterable[Any], source: str) -> Iterable[dict[str, Any]]:
    for obj in objects:
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise InputError(f"{source}: expected a Kubernetes object (a mapping), got {type(obj).__name__}")
        if str(obj.get("kind", "")).endswith("List") and isinstance(obj.get("items"), list):
            yield from _flatten(obj["items"], source)
        else:
            yield obj


def _parse_yaml(text: str, source: str) -> list[Any]:
    if text.lstrip().startswith("{"):  # one JSON document (JSON is YAML too): the JSON parser is far faster
        try:
            return [json.loads(text)]
        except ValueError:
            pass  # not plain JSON after all: YAML decides (and reports errors with a line)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it: ~10x faster on slices
    try:
        return list(yaml.load_all(text, Loader=loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise InputError(f"{where}: invalid YAML: {problem or exc}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: invalid YAML: {exc}") from None


def _name_of(obj: dict[str, Any]) -> str:
    meta = as_mapping(obj.get("metadata"))
    name = str(meta.get("name", "<unnamed>"))
    return f"{meta['namespace']}/{name}" if meta.get("namespace") else name


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a fleet dump is read or explained: those build millions of
    objects that live on (no cycles to find), and each collection walks all of them, so with the collector on,
    reading 18,000 nodes' slices took four times as long. Restored on the way out (nested uses leave it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load(texts: Iterable[str], sources: Sequence[str] | None = None) -> Inputs:
    """Parse multi-document YAML texts (any mix of the kinds in the module docstring).

    :param sources: a name per text for messages (file names); default ``<input N>``.
    :raises InputError: YAML syntax errors (source, line and column), an empty input, an input with nothing to
        allocate (no claim, template, Pod or workload that runs a Pod), a retired API version, malformed
        objects (object and field named), a Pod the API server would refuse (a container naming a claim the Pod
        does not declare), invalid CEL (line, column and caret).
    """
    texts = list(texts)
    names = list(sources) if sources is not None else [f"<input {i + 1}>" for i in range(len(texts))]
    objects: list[tuple[dict[str, Any], str]] = []
    with collection_paused():
        for text, source in zip(texts, names, strict=True):
            objects.extend((obj, source) for obj in _flatten(_parse_yaml(text, source), source))
        if not objects:
            raise InputError(f"no Kubernetes objects in {', '.join(names) or 'the input'} (empty input)")
        inputs = _read(objects)
    if not inputs.claims and not inputs.pods:
        raise InputError(_nothing_to_allocate(names, [obj for obj, _ in objects], inputs.notes))
    return inputs


def _nothing_to_allocate(names: Sequence[str], objects: list[dict[str, Any]], notes: list[str]) -> str:
    """``nothing to allocate in a.yaml: no ResourceClaim, ResourceClaimTemplate, Pod or workload (read: 1
    ResourceSlice, 2 DeviceClass)``, with what workloads became when they run no Pod."""
    counts: dict[str, int] = {}
    for obj in objects:
        counts[str(obj.get("kind") or "<no kind>")] = counts.get(str(obj.get("kind") or "<no kind>"), 0) + 1
    read = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    became = f"; {'; '.join(notes)}" if notes else ""
    return (f"nothing to allocate in {', '.join(names) or 'the input'}: no ResourceClaim, ResourceClaimTemplate, "
            f"Pod or workload (read: {read}){became}")


def load_objects(objects: Iterable[dict[str, Any]], source: str = "<objects>") -> Inputs:
    """:func:`load` for objects already parsed (API objects as dicts, ``List`` objects flattened), without a
    YAML round trip: what the sandbox's scheduler hands over from the API emulator. The objects are read, not
    changed.

    :raises InputError: as :func:`load`, naming ``source``.
    """
    pairs = [(obj, source) for item in objects for obj in _flatten([item], source)]
    if not pairs:
        raise InputError(f"no Kubernetes objects in {source} (empty input)")
    return _read(pairs)


def _read(objects: list[tuple[dict[str, Any], str]]) -> Inputs:
    inputs = Inputs()
    raw_claims: list[tuple[dict[str, Any], str]] = []
    owners = _controllers(obj for obj, _ in objects)
    for original, source in objects:
        refused = refusal(original)
        if refused is not None:
            raise InputError(f"{source}: {refused}")
        try:
            obj = to_v1(original)
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None
        kind = obj.get("kind")
        is_resource = is_resource_api(obj)
        if kind == "ResourceSlice" and is_resource:
            inputs.slices.append(parse_slice(obj))
        elif kind == "DeviceClass" and is_resource:
            device_class = parse_device_class(obj)
            inputs.classes[device_class.name] = device_class
            inputs.raw_classes.append(obj)
        elif kind == "ResourceClaim" and is_resource:
            raw_claims.append((obj, source))
        elif kind == "ResourceClaimTemplate" and is_resource:
            inputs.templates.append(obj)
        elif kind == "Pod" and obj.get("apiVersion") == "v1":
            problems = claim_reference_problems(as_mapping(obj.get("spec")))
            if problems:  # what the API server answers to kubectl apply
                raise InputError(f"{source}: Pod {_name_of(obj)} is invalid: "
                                 + ", ".join(f"{field}: {message}" for _, field, message in problems))
            inputs.pods.append(obj)
        elif kind == "Node" and obj.get("apiVersion") == "v1":
            node = parse_node(obj)
            inputs.nodes[node.name] = node
            allocatable = (obj.get("status") or {}).get("allocatable")
            if isinstance(allocatable, dict):
                inputs.allocatable[node.name] = allocatable
        elif kind == "Namespace" and obj.get("apiVersion") == "v1":
            meta = obj.get("metadata") or {}
            inputs.namespaces[str(meta.get("name"))] = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        elif computedomains.is_compute_domain(obj):
            try:
                computedomains.read_domain(obj, inputs.domains)
            except InputError as exc:
                raise InputError(f"{source}: {exc}") from None
        elif is_workload(obj) and _key(obj) in owners:
            inputs.notes.append(
                f"{obj.get('kind')} {_key(obj)[0]}/{_key(obj)[2]}: not expanded, the objects it controls are in "
                "the input (ownerReferences)"
            )
        elif is_workload(obj):
            try:
                expansion = expand(obj)
            except InputError as exc:
                raise InputError(f"{source}: {exc}") from None
            inputs.pods.extend(expansion.pods)
            inputs.notes.extend(expansion.notes)
        else:
            reason = NOT_EXPANDED.get(group_kind(obj), "a kind the simulator does not read")
            inputs.warnings.append(
                f"{source}: ignored {obj.get('apiVersion', '<no apiVersion>')} {kind or '<no kind>'} "
                f"{_name_of(obj)}: {reason}"
            )
    for obj, source in raw_claims:
        try:
            inputs.claims.append(parse_claim(obj))
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None
    _add_domain_templates(inputs)
    inputs.claims.extend(_instantiate(inputs))
    return inputs


def _add_domain_templates(inputs: Inputs) -> None:
    """The ComputeDomains' workload templates join the input's templates (one of the same name given in the input,
    a dump's, wins); a daemon template given in the input (a dump's) serves its domain's daemon claims."""
    for template in inputs.domains.workload:
        meta = as_mapping(template.get("metadata"))
        if _template(inputs, str(meta.get("namespace")), str(meta.get("name"))) is None:
            inputs.templates.append(template)
    for template in inputs.templates:
        if domain := computedomains.daemon_domain(template):
            inputs.domains.daemon[domain] = template
    inputs.notes.extend(inputs.domains.notes)


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = as_mapping(obj.get("metadata"))
    return str(meta.get("namespace") or "default"), str(obj.get("kind")), str(meta.get("name"))


def _controllers(objects: Iterable[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """``(namespace, kind, name)`` of every controller an input object names in its ``ownerReferences``.

    A workload whose Pods (or ReplicaSets, or launcher Job) are in the input, as ``kubectl get deploy,rs,pods
    -o yaml`` gives them, is not expanded a second time.
    """
    found = set()
    for obj in objects:
        meta = as_mapping(obj.get("metadata"))
        for ref in meta.get("ownerReferences") or []:
            if isinstance(ref, dict) and ref.get("controller"):
                found.add((str(meta.get("namespace") or "default"), str(ref.get("kind")), str(ref.get("name"))))
    return found


def _pod_ref(pod: dict[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name"))


def _instantiate(inputs: Inputs) -> list[Claim]:
    """Claims the control plane would create: per template entry of a Pod, per Pod's extended resources.

    A Pod whose ``status.resourceClaimStatuses`` (or ``status.extendedResourceClaimStatus``) already names a
    claim given in the input uses that claim, as on a running cluster.
    """
    claims: list[Claim] = []
    used: set[tuple[str, str]] = set()
    given = {c.ref for c in inputs.claims}
    mapping = class_mapping(inputs.raw_classes)
    for pod in inputs.pods:
        namespace, pod_name = _pod_ref(pod)
        ref = f"{namespace}/{pod_name}"
        status = as_mapping(pod.get("status"))
        statuses = {
            str(s.get("name")): s.get("resourceClaimName")
            for s in status.get("resourceClaimStatuses") or []
            if isinstance(s, dict)
        }
        refs: list[str] = []
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            entry_name = str(entry.get("name"))
            if entry.get("resourceClaimName"):
                refs.append(f"{namespace}/{entry['resourceClaimName']}")
                continue
            template_name = entry.get("resourceClaimTemplateName")
            if not template_name:
                raise InputError(
                    f"Pod {ref}: spec.resourceClaims[{entry_name}]: one of resourceClaimName, "
                    "resourceClaimTemplateName must be set"
                )
            existing = statuses.get(entry_name)
            if existing and f"{namespace}/{existing}" in given:
                refs.append(f"{namespace}/{existing}")
                continue
            template = _template(inputs, namespace, str(template_name))
            if template is None:
                raise InputError(
                    f"Pod {ref}: spec.resourceClaims[{entry_name}]: "
                    f"ResourceClaimTemplate {namespace}/{template_name} not found"
                )
            used.add((namespace, str(template_name)))
            name = str(existing) if existing else template_claim_name(namespace, pod_name, entry_name)
            claims.append(
                _from_template(template, namespace, name, f"from template {template_name} for pod {pod_name}", pod,
                               entry_name)
            )
            refs.append(f"{namespace}/{name}")
            refs.extend(_daemon_claims(inputs, template, ref, claims))
        extended_status = status.get("extendedResourceClaimStatus")
        existing_extended = extended_status.get("resourceClaimName") if isinstance(extended_status, dict) else None
        extended = plan(pod, mapping, inputs.allocatable, claim_name=str(existing_extended or "") or None)
        inputs.extended[ref] = extended
        if extended.claim is not None:
            claim_ref = f"{namespace}/{extended.claim['metadata']['name']}"
            if claim_ref not in given:
                claims.append(parse_claim(extended.claim, f"generated by the scheduler for the extended resources "
                                                          f"of pod {pod_name}"))
            refs.append(claim_ref)
        inputs.pod_claims[ref] = refs
    for template in inputs.templates:
        meta = template.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        if (namespace, name) not in used and not computedomains.is_daemon_template(template):
            claims.append(_from_template(template, namespace, name, f"from template {name}", None, None))
    return claims


def _daemon_claims(inputs: Inputs, template: dict[str, Any], pod_ref: str, claims: list[Claim]) -> list[str]:
    """The daemon claim allocated with a ComputeDomain workload claim of ``pod_ref`` (on the same node; added to
    ``claims``), as a ref list: empty for other templates and for host-managed IMEX (no daemon template)."""
    domain = computedomains.domain_of(template)
    daemon = inputs.domains.daemon.get(domain) if domain else None
    if domain is None or daemon is None:
        return []
    namespace, name, origin = computedomains.daemon_claim(daemon, inputs.domains.domains.get(domain, domain), pod_ref)
    claims.append(_from_template(daemon, namespace, name, origin, None, None))
    return [f"{namespace}/{name}"]


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
        metadata.setdefault("annotations", {})[POD_CLAIM_NAME_ANNOTATION] = entry
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
        namespace, pod_name = _pod_ref(pod)
        ref = f"{namespace}/{pod_name}"
        members = []
        for claim_ref in inputs.pod_claims.get(ref, []):
            claim = by_ref.get(claim_ref)
            if claim is None:
                raise InputError(f"Pod {ref}: ResourceClaim {claim_ref} not found")
            referenced.add(claim.ref)
            if claim not in members:
                members.append(claim)
        node = (pod.get("spec") or {}).get("nodeName")
        result.append(Group(members, str(node) if node else None, ref))
    for claim in inputs.claims:
        if claim.ref not in referenced:
            result.append(Group([claim], None))
    return result


@dataclass
class Outcome:
    """What the simulator did.

    :param claims: claims in output order (allocations filled in).
    :param failures: one line per claim group or Pod that cannot be allocated or scheduled.
    :param pods: the Pods as the scheduler and the ResourceClaim controller leave them: ``spec.nodeName``,
        ``status.resourceClaimStatuses`` and ``status.extendedResourceClaimStatus`` filled in once every claim
        of the Pod is allocated.
    :param pod_nodes: ``namespace/pod`` -> node, for scheduled Pods.
    """

    claims: list[dict[str, Any]]
    failures: list[str]
    nodes: dict[str, str | None]
    allocator: Allocator
    pods: list[dict[str, Any]] = field(default_factory=list)
    pod_nodes: dict[str, str | None] = field(default_factory=dict)
    placements: dict[str, PodPlacement] = field(default_factory=dict)
    """``namespace/pod`` -> its CPU/memory demand on its node (:mod:`.noderesources`)."""


def _check_admin(inputs: Inputs, claim: Claim) -> None:
    if not any(r.admin_access for r in claim.requests) or claim.namespace not in inputs.namespaces:
        return
    if inputs.namespaces[claim.namespace].get(ADMIN_ACCESS_LABEL) != "true":
        raise AllocationError(
            f"cannot allocate claim {claim.ref}: adminAccess requires the namespace label "
            f"{ADMIN_ACCESS_LABEL}=true on namespace {claim.namespace}"
        )


def pending_reasons(inputs: Inputs, pod_ref: str) -> list[str]:
    """Why the Pod cannot be scheduled whatever the devices: extended resources nothing serves."""
    extended = inputs.extended.get(pod_ref)
    return [unserved_reason(r) for r in extended.unserved] if extended else []


def simulate(inputs: Inputs, per_shape: bool = True, *, binding_conditions: bool = False) -> Outcome:
    """Allocate every unallocated claim (see module docstring); a Pod also has to fit its node's CPU and memory
    with its devices' KEP-5517 overhead (:mod:`.noderesources`).

    :param per_shape: evaluate selectors once per device shape (:class:`Allocator`); ``False``: per device.
    :param binding_conditions: the scheduler's gate ``DRADeviceBindingConditions`` (:class:`Allocator`).
    """
    with collection_paused():
        return _simulate(inputs, per_shape, binding_conditions)


def _simulate(inputs: Inputs, per_shape: bool, binding_conditions: bool = False) -> Outcome:
    allocator = Allocator(inputs.slices, inputs.classes, inputs.nodes, [c for c in inputs.claims if c.allocation],
                          per_shape=per_shape, binding_conditions=binding_conditions)
    allocations: dict[str, dict[str, Any]] = {}
    nodes: dict[str, str | None] = {}
    failures: list[str] = []
    pod_nodes: dict[str, str | None] = {}
    budget = _NodeBudget(inputs, allocations)
    for group in groups(inputs):
        if group.pod is not None:
            reasons = pending_reasons(inputs, group.pod)
            if reasons:
                failures.append(f"cannot schedule pod {group.pod}: " + "; ".join(reasons))
                continue
        pending = [c for c in group.claims if c.allocation is None and c.ref not in allocations]
        if not pending:
            if group.pod is not None:
                pod_nodes[group.pod] = group.node or next(
                    (nodes.get(c.ref) for c in group.claims if nodes.get(c.ref)), None
                )
                budget.take(group.pod, pod_nodes[group.pod], {})
            continue
        fit = budget.fit_check(group.pod, pending) if group.pod is not None else None
        try:
            for claim in pending:
                _check_admin(inputs, claim)
            node, results = allocator.allocate(pending, group.node, fit)
        except AllocationError as exc:
            failures.append(str(exc))
            continue
        for claim, allocation in zip(pending, results, strict=True):
            allocations[claim.ref] = allocation
            nodes[claim.ref] = node
        if group.pod is not None:
            pod_nodes[group.pod] = node
            budget.take(group.pod, node, {})
    out = []
    for claim in inputs.claims:
        obj = copy.deepcopy(claim.obj)
        if claim.ref in allocations:
            obj.setdefault("status", {})["allocation"] = allocations[claim.ref]
        if claim.allocation is not None or claim.ref in allocations:
            out.append(obj)
    return Outcome(out, failures, nodes, allocator, _scheduled_pods(inputs, pod_nodes), pod_nodes, budget.placed)


class _NodeBudget:
    """CPU and memory of each Node taken by the Pods placed so far (Pods already bound, ``spec.nodeName`` with every
    claim allocated, first), and each placed Pod's demand (:mod:`.noderesources`)."""

    def __init__(self, inputs: Inputs, allocations: dict[str, dict[str, Any]]) -> None:
        self.inputs, self.allocations = inputs, allocations
        self.devices = {d.id: d for s in inputs.slices for d in s.devices}
        self.allocatable = {n: noderesources.allocatable_of(raw, n) for n, raw in inputs.allocatable.items()}
        self.used: dict[str, dict[str, Fraction]] = {}
        self.placed: dict[str, PodPlacement] = {}
        self.pods = {"/".join(_pod_ref(p)): p for p in inputs.pods}
        by_ref = {c.ref: c for c in inputs.claims}
        for ref, pod in self.pods.items():  # bound Pods take their share before anything is placed
            node = (pod.get("spec") or {}).get("nodeName")
            if node and all(by_ref.get(c) is not None and by_ref[c].allocation is not None
                            for c in inputs.pod_claims.get(ref, [])):
                self.take(ref, str(node), {})

    def _claims(self, pod_ref: str) -> list[tuple[str, int]]:
        """``(claim ref, containers referencing it)`` of a Pod's claims."""
        pod = self.pods[pod_ref]
        refs = self.inputs.pod_claims.get(pod_ref, [])
        entries = (pod.get("spec") or {}).get("resourceClaims") or []
        counts = noderesources.claim_references(pod)
        out = [(ref, counts.get(str(e.get("name")), 0)) for ref, e in zip(refs, entries, strict=False)]
        extended = self.inputs.extended.get(pod_ref)
        if extended is not None and extended.claim is not None and len(refs) > len(entries):
            out.append((refs[-1], len({r.container for r in extended.requests})))
        return out

    def demand(self, pod_ref: str, candidate: Mapping[str, dict[str, Any]]) -> noderesources.Demand:
        """The Pod's requests and its devices' overhead with ``candidate`` (claim ref -> allocation) added to the
        allocations known."""
        by_ref = {c.ref: c for c in self.inputs.claims}
        claims = []
        for ref, containers in self._claims(pod_ref):
            claim = by_ref.get(ref)
            allocation = candidate.get(ref) or self.allocations.get(ref) or (claim.obj.get("status") or {}).get(
                "allocation") if claim is not None else candidate.get(ref)
            results = ((allocation or {}).get("devices") or {}).get("results") or []
            claims.append((ref, containers, results))
        return noderesources.Demand(noderesources.pod_requests(self.pods[pod_ref]),
                                    noderesources.device_charges(claims, self.devices))

    def fit_check(self, pod_ref: str, pending: Sequence[Claim]) -> Callable[[str | None, list[dict[str, Any]]], str]:
        """The allocator's ``node_fit`` for this Pod's pending claims."""
        def fit(node: str | None, allocations: list[dict[str, Any]]) -> str:
            if node is None or node not in self.allocatable:
                return ""
            demand = self.demand(pod_ref, {c.ref: a for c, a in zip(pending, allocations, strict=True)})
            reason = noderesources.misfit(demand, self.allocatable[node], self.used.get(node, {}))
            return f"pod {pod_ref} does not fit: {reason}" if reason else ""
        return fit

    def take(self, pod_ref: str, node: str | None, candidate: Mapping[str, dict[str, Any]]) -> None:
        """Record the Pod on ``node`` (nothing for a Pod placed nowhere or placed already)."""
        if node is None or pod_ref in self.placed:
            return
        demand = self.demand(pod_ref, candidate)
        used = self.used.setdefault(node, {})
        self.placed[pod_ref] = PodPlacement(node, demand, self.allocatable.get(node, {}), dict(used))
        for resource in noderesources.RESOURCES:
            used[resource] = used.get(resource, Fraction(0)) + demand.total(resource)


@dataclass
class PodPlacement:
    """A placed Pod's demand on its node and what its node had: ``allocatable`` and ``used`` by Pods before it."""

    node: str
    demand: noderesources.Demand
    allocatable: dict[str, Fraction]
    used: dict[str, Fraction]


def _scheduled_pods(inputs: Inputs, pod_nodes: dict[str, str | None]) -> list[dict[str, Any]]:
    """Copies of the scheduled Pods with what the control plane writes into them."""
    out = []
    for pod in inputs.pods:
        namespace, name = _pod_ref(pod)
        ref = f"{namespace}/{name}"
        if ref not in pod_nodes:
            continue
        obj = copy.deepcopy(pod)
        if pod_nodes[ref]:
            obj.setdefault("spec", {})["nodeName"] = pod_nodes[ref]
        status = obj.setdefault("status", {})
        template_entries = [
            e for e in (pod.get("spec") or {}).get("resourceClaims") or [] if e.get("resourceClaimTemplateName")
        ]
        claim_refs = iter(
            r for r, e in zip(inputs.pod_claims.get(ref, []), (pod.get("spec") or {}).get("resourceClaims") or [],
                              strict=False)
            if e.get("resourceClaimTemplateName")
        )
        if template_entries:
            status["resourceClaimStatuses"] = [
                {"name": e["name"], "resourceClaimName": next(claim_refs).split("/", 1)[1]} for e in template_entries
            ]
        extended = inputs.extended.get(ref)
        if extended is not None and extended.status() is not None:
            status["extendedResourceClaimStatus"] = extended.status()
        out.append(obj)
    return out


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


def _verdict_text(verdict: Verdict, request: Request, classes: dict[str, DeviceClass], device: Device,
                  shapes: ShapeCache) -> str:
    if verdict.stage in ("class", "request") and verdict.outcome is not None:
        selectors = classes[request.class_name].selectors if verdict.stage == "class" else request.selectors
        label = f"{'class' if verdict.stage == 'class' else 'request'} selector #{verdict.selector + 1}"
        if verdict.outcome.error:
            error = shapes.error(selectors[verdict.selector], device, verdict.outcome.error)
            return f"rejected by {label}: error: {error}"
        return f"rejected by {label}: {shapes.rejection(selectors[verdict.selector], device)}"
    if verdict.stage == "accepted":
        return "accepted"
    if verdict.stage == "in-use":
        return verdict.reason
    return (f"rejected: {verdict.reason}" if verdict.stage in ("pool", "counters", "binding", "capacity")
            else verdict.reason)


def explain(inputs: Inputs, per_shape: bool = True) -> tuple[str, int]:
    """Explain every claim: per request, every candidate device and its verdict.

    :param per_shape: as :func:`simulate` (the text is the same either way).
    :returns: ``(text, exit code)``; the code is 1 if some claim cannot be allocated.
    """
    with collection_paused():
        return _explain(inputs, per_shape)


def _explain(inputs: Inputs, per_shape: bool) -> tuple[str, int]:
    outcome = simulate(inputs, per_shape)
    lines: list[str] = [f"warning: {w}" for w in inputs.warnings] + [f"note: {n}" for n in inputs.notes]
    if lines:
        lines.append("")
    extended_by_claim = {
        f"{ref.split('/', 1)[0]}/{p.claim['metadata']['name']}": p for ref, p in inputs.extended.items() if p.claim
    }
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
        extended = extended_by_claim.get(claim.ref)
        for r in extended.requests if extended else []:
            if any(req.name == r.request_name for req in claim.requests):
                lines.append(
                    f"  request {r.request_name!r} is container {r.container!r} asking for {r.resource}: {r.count} "
                    f"(DeviceClass {claim_class(claim, r.request_name)} maps {r.resource})"
                )
        for constraint in claim.constraints:
            lines.append(f"  constraint: {constraint_text(constraint)}")
        for node_name in node_names:
            pools = base.pools(base.node(node_name))
            used = base.baseline_counters(pools)
            if len(node_names) > 1 or results is None:
                lines.append(f"  on node {node_name}:" if node_name else "  on no particular node (allNodes slices):")
            for request in claim.requests:
                lines.extend(_explain_request(claim, request, pools, used, base, inputs, results))
        lines.append("")
    base.in_use = everything
    base.consumed = base.consumption_without(None)
    lines.extend(_explain_pods(inputs, outcome))
    return "\n".join(lines).rstrip() + "\n", 1 if outcome.failures else 0


def claim_class(claim: Claim, request_name: str) -> str:
    """The DeviceClass of ``claim``'s request ``request_name``."""
    return next((r.class_name for r in claim.requests if r.name == request_name), "?")


def _explain_pods(inputs: Inputs, outcome: Outcome) -> list[str]:
    """One line (or a few) per Pod: scheduled where, pending why, or asking for no devices."""
    lines: list[str] = []
    allocated = {f"{(c.get('metadata') or {}).get('namespace') or 'default'}/{c['metadata']['name']}"
                 for c in outcome.claims}
    for pod in inputs.pods:
        namespace, name = _pod_ref(pod)
        ref = f"{namespace}/{name}"
        claims = inputs.pod_claims.get(ref, [])
        extended = inputs.extended.get(ref)
        reasons = pending_reasons(inputs, ref)
        served_elsewhere = [
            f"{resource} is served by a device plugin on node(s) {', '.join(nodes)} (Node status.allocatable)"
            for resource, nodes in (extended.device_plugin if extended else {}).items()
        ]
        if reasons:
            lines.append(f"pod {ref}: PENDING")
            lines.extend(f"  {reason}" for reason in reasons)
        elif not claims:
            lines.append(f"pod {ref}: asks for no devices through DRA (no spec.resourceClaims, no extended "
                         "resource a DeviceClass maps)")
        elif ref in outcome.pod_nodes:
            node = outcome.pod_nodes[ref]
            lines.append(f"pod {ref}: scheduled" + (f" on node {node}" if node else "")
                         + f" with claim(s) {', '.join(c.split('/', 1)[1] for c in claims)}")
            status = extended.status() if extended else None
            if status is not None:
                mappings = ", ".join(
                    f"container {m['containerName']!r} {m['resourceName']} -> request {m['requestName']}"
                    for m in status["requestMappings"]
                )
                lines.append(f"  status.extendedResourceClaimStatus: claim {status['resourceClaimName']}; {mappings}")
            placement = outcome.placements.get(ref)
            if placement is not None and (placement.allocatable or placement.demand.charges):
                lines.append(f"  node allocatable on {placement.node} (KEP-5517 device overhead included):")
                lines.extend(f"    {text}" for text in noderesources.describe(
                    placement.demand, placement.allocatable, placement.used))
        else:
            stuck = [c for c in claims if c not in allocated]
            lines.append(f"pod {ref}: PENDING: claim(s) {', '.join(stuck)} cannot be allocated (see above)")
        lines.extend(f"  {text}" for text in served_elsewhere)
    if lines:
        lines.append("")
    return lines


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
    missing: dict[tuple[str, str, str], list[str]] = {}
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
            exhausted: dict[str, dict[str, int]] = {}
            for device in pool.devices:
                verdict = base.verdict(alt, device, pool, used, claim)
                if verdict.counter is not None and results is None:
                    per_set = exhausted.setdefault(verdict.counter[0], {})
                    per_set[verdict.counter[1]] = per_set.get(verdict.counter[1], 0) + 1
                text = _verdict_text(verdict, alt, inputs.classes, device, base.shapes)
                picked = chosen.get((device.pool, device.name))
                if picked == alt.name:
                    text = "accepted -> allocated" + (" (admin access)" if alt.admin_access else "")
                elif verdict.accepted:
                    text = _unpicked(claim, alt, device, chosen_values, picked, results)
                elif verdict.outcome is not None and verdict.outcome.error:
                    _note_missing(missing, verdict, alt, inputs.classes, device, base.shapes)
                lines.append(f"{indent}    {device.name.ljust(width)}  {text}")
            lines.extend(f"{indent}  {line}" for line in counter_summary(pool, exhausted))
        for (label, kind, name), devices in missing.items():
            shown = ", ".join(devices[:8]) + (f" and {len(devices) - 8} more" if len(devices) > 8 else "")
            lines.append(
                f"{indent}  {label} reads {kind} {name}, which {len(devices)} device(s) do not publish: {shown}"
            )
        missing.clear()
    return lines


def _note_missing(
    missing: dict[tuple[str, str, str], list[str]],
    verdict: Verdict,
    request: Request,
    classes: dict[str, DeviceClass],
    device: Device,
    shapes: ShapeCache,
) -> None:
    """Record which attributes or capacities the rejecting selector read that ``device`` lacks."""
    selectors = classes[request.class_name].selectors if verdict.stage == "class" else request.selectors
    label = f"{'class' if verdict.stage == 'class' else 'request'} selector #{verdict.selector + 1}"
    for kind, name in shapes.missing(selectors[verdict.selector], device):
        missing.setdefault((label, kind, name), []).append(f"{device.pool}/{device.name}")


def counter_summary(pool: Pool, exhausted: dict[str, dict[str, int]]) -> list[str]:
    """One line per counter set whose counters stopped matching devices: which counters ran out, for how many
    devices, and on which device the set belongs to when the driver names it ``<device>-counter-set`` (NVIDIA's
    ``gpu-<minor>-counter-set``, so the line names the GPU)."""
    names = {d.name for d in pool.devices}
    out = []
    for set_name in sorted(exhausted):
        owner = set_name.removesuffix("-counter-set")
        where = f"on GPU {owner} (counter set {set_name})" if owner != set_name and owner in names else \
            f"in counter set {set_name}"
        counters = ", ".join(f"{c} ({n} device{'s' if n != 1 else ''})" for c, n in sorted(exhausted[set_name].items()))
        out.append(f"shared counters ran out {where}: {counters}")
    return out


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
