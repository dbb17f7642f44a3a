"""The update rules of the multi-node sandbox's DaemonSet controller: a DaemonSet's revision hash, its update
strategy and the pods one pass of a RollingUpdate replaces, as kube-controller-manager's daemonset controller
computes them (kubernetes ``pkg/controller/daemon/update.go`` ``rollingUpdate``, ``updatedDesiredNodeCounts``,
``findUpdatedPodsOnNode``; ``pkg/controller/daemon/util`` ``IsPodUpdated``; the rules as kubernetes.io documents
them: "Perform a Rolling Update on a DaemonSet" and the DaemonSet concept page's "Updating a DaemonSet").

* Every Pod the controller creates carries ``controller-revision-hash`` (the hash of the DaemonSet's pod template
  now, :func:`revision_hash`) and ``pod-template-generation`` (the DaemonSet's ``metadata.generation``); a Pod is
  *updated* when either matches the DaemonSet now (:func:`is_updated`).
* ``spec.updateStrategy``: ``RollingUpdate`` (the API server's default) with ``rollingUpdate.maxUnavailable``
  (default 1) and ``maxSurge`` (default 0), each an integer or a percentage of the nodes that should run a Pod
  (rounded up); both 0 counts as ``maxUnavailable`` 1. ``OnDelete``: a template change replaces nothing, a Pod
  deleted by hand is recreated from the new template.
* A pass without surge (:func:`rolling_update`) deletes every old Pod that is not available (nothing is lost by
  replacing it; each counts as unavailable) and, while fewer than ``maxUnavailable`` nodes are unavailable (no
  Pod, a Pod being replaced, or an updated Pod not yet available), old available Pods up to that budget; the
  controller's usual pass then creates the updated Pod on each node left without one, and the next old Pod goes
  only once it is available. With surge, the updated Pod is created beside the old one on up to ``maxSurge``
  nodes at once (at once where the old one is unavailable), and the old one is deleted as soon as its replacement
  is available.
* A Pod is *available* once Ready for ``spec.minReadySeconds`` (default 0).

What the sandbox does not keep: ControllerRevision objects and ``status.collisionCount`` (the hash is of the
template alone: FNV-1a 32 of its canonical JSON, encoded as Kubernetes' ``rand.SafeEncodeString``, so it has the
shape of kube's hash but not its value). Percentages and defaults are read here, where the API server would have
filled them in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LABEL_REVISION_HASH", "LABEL_TEMPLATE_GENERATION", "ON_DELETE", "ROLLING_UPDATE", "RollingPlan",
           "UpdateStrategy", "is_updated", "revision_hash", "rolling_update", "update_strategy"]

JSONDict = dict[str, Any]
LABEL_REVISION_HASH = "controller-revision-hash"
"""The label of a DaemonSet Pod with the hash of the template it was made from (``apps/v1``
``DefaultDaemonSetUniqueLabelKey``)."""
LABEL_TEMPLATE_GENERATION = "pod-template-generation"
"""The label of a DaemonSet Pod with the DaemonSet's ``metadata.generation`` when it was made (``apps/v1``
``DaemonSetTemplateGenerationKey``, deprecated in favour of the hash but still set)."""
ROLLING_UPDATE, ON_DELETE = "RollingUpdate", "OnDelete"
_SAFE = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery pkg/util/rand alphanums (no vowels, no 0/1/3)


def revision_hash(template: Mapping[str, Any]) -> str:
    """The ``controller-revision-hash`` of a DaemonSet's pod template: FNV-1a 32 of its canonical JSON, its decimal
    digits mapped by ``rand.SafeEncodeString`` (module docstring: the shape of kube's hash, not its value)."""
    value = 0x811C9DC5
    for byte in json.dumps(template, sort_keys=True, separators=(",", ":")).encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE[ord(c) % len(_SAFE)] for c in str(value))


@dataclass(frozen=True, slots=True)
class UpdateStrategy:
    """A DaemonSet's ``spec.updateStrategy`` resolved against the number of nodes that should run its Pod.

    :param type: :data:`ROLLING_UPDATE` or :data:`ON_DELETE`.
    :param max_unavailable: nodes whose Pod may be unavailable at once during a rolling update.
    :param max_surge: nodes that may run an updated Pod beside the old one at once.
    :param min_ready_s: ``spec.minReadySeconds``: how long a Pod must be Ready to count as available, seconds.
    """

    type: str = ROLLING_UPDATE
    max_unavailable: int = 1
    max_surge: int = 0
    min_ready_s: float = 0.0


def _scaled(value: Any, total: int, *, name: str) -> int:
    """An ``IntOrString`` (``3`` or ``"30%"``) of ``total``, percentages rounded up as kube rounds both fields."""
    if isinstance(value, bool):
        raise ValueError(f"spec.updateStrategy.rollingUpdate.{name}: {value!r} is not an integer or a percentage")
    if isinstance(value, int):
        return max(0, value)
    text = str(value).strip()
    if text.endswith("%") and text[:-1].isdigit():
        return math.ceil(int(text[:-1]) * total / 100)
    raise ValueError(f"spec.updateStrategy.rollingUpdate.{name}: {value!r} is not an integer or a percentage")


def update_strategy(ds: Mapping[str, Any], desired: int) -> UpdateStrategy:
    """The update strategy of DaemonSet ``ds`` (defaults filled in as the API server fills them) for ``desired``
    nodes that should run its Pod.

    :raises ValueError: an unknown strategy type or a ``maxUnavailable``/``maxSurge`` that is neither an integer
        nor a percentage (the message names the field).
    """
    spec = ds.get("spec") or {}
    strategy = spec.get("updateStrategy") or {}
    kind = str(strategy.get("type") or ROLLING_UPDATE)
    if kind not in (ROLLING_UPDATE, ON_DELETE):
        raise ValueError(f"spec.updateStrategy.type: {kind!r} is not {ROLLING_UPDATE} or {ON_DELETE}")
    rolling = strategy.get("rollingUpdate") or {}
    unavailable = _scaled(rolling.get("maxUnavailable", 1), desired, name="maxUnavailable")
    surge = _scaled(rolling.get("maxSurge", 0), desired, name="maxSurge")
    if unavailable == 0 and surge == 0:
        unavailable = 1  # updatedDesiredNodeCounts: never stuck
    return UpdateStrategy(kind, unavailable, surge, float(spec.get("minReadySeconds") or 0))


def is_updated(pod: Mapping[str, Any], ds: Mapping[str, Any], hash_: str) -> bool:
    """Pod ``pod`` was made from DaemonSet ``ds``'s template now: its ``controller-revision-hash`` is ``hash_`` or
    its ``pod-template-generation`` is the DaemonSet's generation (``IsPodUpdated``)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    generation = (ds.get("metadata") or {}).get("generation")
    return labels.get(LABEL_REVISION_HASH) == hash_ or (
        generation is not None and labels.get(LABEL_TEMPLATE_GENERATION) == str(generation))


@dataclass
class RollingPlan:
    """What one pass of a rolling update does.

    :param delete: names of the old Pods to delete now.
    :param surge: nodes on which to create the updated Pod beside the old one now.
    :param scheduled: nodes with a Pod (``status.currentNumberScheduled``).
    :param updated: nodes whose oldest Pod is updated (``status.updatedNumberScheduled``: a node that surged counts
        once its old Pod is gone).
    :param ready: nodes whose oldest Pod is Ready (``status.numberReady``).
    :param available: nodes whose oldest Pod is available (``status.numberAvailable``).
    """

    delete: list[str] = field(default_factory=list)
    surge: list[str] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    updated: set[str] = field(default_factory=set)
    ready: set[str] = field(default_factory=set)
    available: set[str] = field(default_factory=set)


def rolling_update(ds: Mapping[str, Any], by_node: Mapping[str, Sequence[Mapping[str, Any]]], *,
                   strategy: UpdateStrategy, ready: Mapping[str, bool], available: Mapping[str, bool]) -> RollingPlan:
    """One pass of DaemonSet ``ds``'s update (module docstring) over ``by_node``: each node that should run its Pod
    -> the DaemonSet's Pods there not being deleted, oldest first; ``ready`` and ``available``: Pod name -> whether
    it is Ready, available. With :data:`ON_DELETE` the plan only counts (nothing is deleted or surged). Nodes are
    taken in name order (kube's order is its map's)."""
    hash_ = revision_hash(((ds.get("spec") or {}).get("template")) or {})
    plan = RollingPlan()
    states: dict[str, tuple[Mapping[str, Any] | None, Mapping[str, Any] | None, bool]] = {}
    for node in sorted(by_node):
        pods = by_node[node]
        fresh = [p for p in pods if is_updated(p, ds, hash_)]
        stale = [p for p in pods if not is_updated(p, ds, hash_)]
        ok = len(fresh) <= 1 and len(stale) <= 1  # findUpdatedPodsOnNode: more than one of either: the manage loop's
        states[node] = (fresh[0] if len(fresh) == 1 else None, stale[0] if len(stale) == 1 else None, ok)
        if not pods:
            continue
        oldest = (stale or pods)[0]  # updateDaemonSetStatus counts each node's oldest Pod (an old one is older)
        name = str(oldest["metadata"]["name"])
        plan.scheduled.add(node)
        if is_updated(oldest, ds, hash_):
            plan.updated.add(node)
        if ready.get(name):
            plan.ready.add(node)
        if available.get(name):
            plan.available.add(node)
    if strategy.type != ROLLING_UPDATE:
        return plan

    def up(pod: Mapping[str, Any]) -> bool:
        return bool(available.get(str(pod["metadata"]["name"])))

    if strategy.max_surge == 0:
        unavailable = 0
        replace: list[str] = []
        candidates: list[str] = []
        for new, old, ok in states.values():
            if not ok or (new is None) == (old is None):
                unavailable += 1  # the manage loop creates or trims this node's Pods: unavailable meanwhile
            elif new is not None:
                unavailable += 0 if up(new) else 1
            elif old is not None and not up(old):
                replace.append(str(old["metadata"]["name"]))  # not available: nothing is lost by replacing it,
                unavailable += 1  # but it counts against the budget
            elif old is not None and unavailable < strategy.max_unavailable:
                candidates.append(str(old["metadata"]["name"]))
        budget = max(0, min(strategy.max_unavailable - unavailable, len(candidates)))
        plan.delete = replace + candidates[:budget]
        return plan
    surging = 0
    allowed: list[str] = []
    candidate_nodes: list[str] = []
    for node, (new, old, ok) in states.items():
        if not ok:
            surging += 1
        elif old is None:
            continue  # nothing to replace: the manage loop keeps this node's Pod
        elif new is None:
            if not up(old):
                allowed.append(node)
            elif surging < strategy.max_surge:
                candidate_nodes.append(node)
        elif not up(new):
            surging += 1  # surged here, the new Pod not yet available
        else:
            plan.delete.append(str(old["metadata"]["name"]))  # its replacement is available
    budget = max(0, min(strategy.max_surge - surging, len(candidate_nodes)))
    plan.surge = allowed + candidate_nodes[:budget]
    return plan
