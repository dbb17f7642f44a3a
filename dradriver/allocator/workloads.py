"""Workloads become the Pods their controllers would create, so "will my 4-replica Deployment fit?" has an answer.

One workload object gives the Pods that would run at once (their pod templates, names and owner):

* ``apps/v1`` ``Deployment``: ``spec.replicas`` (default 1) Pods of ReplicaSet ``<deployment>-<hash>``, each
  named ``<replicaset>-<5 characters>`` and labelled ``pod-template-hash``; ``apps/v1`` ``ReplicaSet``:
  ``spec.replicas`` Pods ``<replicaset>-<5 characters>``;
* ``apps/v1`` ``StatefulSet``: ``spec.replicas`` Pods ``<statefulset>-<ordinal>``, ordinals from
  ``spec.ordinals.start`` (default 0);
* ``batch/v1`` ``Job``: the Pods running at once, ``spec.parallelism`` (default 1) but no more than
  ``spec.completions``; named ``<job>-<5 characters>``, or ``<job>-<index>-<5 characters>`` with
  ``completionMode: Indexed``; none when ``spec.suspend`` is true;
* ``kubeflow.org/v2beta1`` ``MPIJob``: ``spec.mpiReplicaSpecs.Worker.replicas`` Pods ``<mpijob>-worker-<i>``
  from the Worker template, and the launcher (a Job ``<mpijob>-launcher``, one Pod
  ``<mpijob>-launcher-<5 characters>``) from the Launcher template.

Random characters are stand-ins (:mod:`dradriver.allocator.naming`). A Pod's template claims are then named
by the ResourceClaim controller's rule (``<pod>-<claim>-<5 characters>``) in :mod:`.simulation`.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any

from dradriver.allocator.conversion import as_mapping
from dradriver.allocator.naming import generated_name, pod_template_hash
from dradriver.allocator.resources import InputError
from dradriver.domain.pods import claim_reference_problems

WORKLOAD_KINDS = {
    ("apps", "Deployment"),
    ("apps", "ReplicaSet"),
    ("apps", "StatefulSet"),
    ("batch", "Job"),
    ("kubeflow.org", "MPIJob"),
}
"""(API group, kind) of the workloads :func:`expand` turns into Pods."""

NOT_EXPANDED = {
    ("apps", "DaemonSet"): "one Pod per node: write a Pod with spec.nodeName for the node you ask about",
    ("batch", "CronJob"): "its Jobs exist only at schedule time: give its spec.jobTemplate as a Job",
}
"""Workload kinds the simulator names in a warning instead of expanding, with what to do."""

_UID_NAMESPACE = uuid.UUID("6c3b7f0e-6a55-4c1e-9d0b-6f1f2e9f5a10")


@dataclass
class Expansion:
    """Pods of one workload and the notes explain prints about it (replicas, names)."""

    pods: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def group_kind(obj: dict[str, Any]) -> tuple[str, str]:
    """``(API group, kind)`` of ``obj`` (core group: ``""``)."""
    api_version = str(obj.get("apiVersion", ""))
    group = api_version.split("/", 1)[0] if "/" in api_version else ""
    return group, str(obj.get("kind", ""))


def is_workload(obj: dict[str, Any]) -> bool:
    """True if :func:`expand` handles ``obj``."""
    return group_kind(obj) in WORKLOAD_KINDS


def _meta(obj: dict[str, Any], what: str) -> tuple[str, str, dict[str, Any]]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not meta.get("name"):
        raise InputError(f"{what}: metadata.name: required")
    return str(meta.get("namespace") or "default"), str(meta["name"]), meta


def _count(spec: dict[str, Any], key: str, default: int, where: str) -> int:
    value = spec.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where}.{key}: must be a non-negative integer, got {value!r}")
    return value


def _template(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """The pod template at ``<where>.template``, refused as the API server refuses the workload when its
    containers name a claim the template does not declare (:func:`dradriver.domain.pods.claim_reference_problems`).
    """
    template = spec.get("template")
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        raise InputError(f"{where}.template.spec: required (the pod template)")
    what, _, path = where.rpartition(": ")
    problems = claim_reference_problems(template["spec"], f"{path}.template.spec")
    if problems:
        raise InputError(f"{what} is invalid: " + ", ".join(f"{field}: {message}" for _, field, message in problems))
    return template


def pod_uid(namespace: str, name: str) -> str:
    """A stable UID for a simulated Pod (the API server would assign a random one)."""
    return str(uuid.uuid5(_UID_NAMESPACE, f"{namespace}/{name}"))


def _pod(
    template: dict[str, Any],
    namespace: str,
    name: str,
    owner: dict[str, Any],
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta = copy.deepcopy(template.get("metadata") or {})
    pod_labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    pod_labels.update(labels or {})
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": pod_uid(namespace, name),
        "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}],
    }
    if pod_labels:
        metadata["labels"] = pod_labels
    if meta.get("annotations"):
        metadata["annotations"] = copy.deepcopy(meta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": copy.deepcopy(template["spec"])}


def _owner(api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": pod_uid(namespace, f"{kind}/{name}")}


def expand(obj: dict[str, Any]) -> Expansion:
    """The Pods the controllers of workload ``obj`` would run at once (see the module docstring).

    :raises InputError: a malformed workload (no name, no pod template, a negative or non-integer count),
        naming the object and the field.
    """
    group, kind = group_kind(obj)
    meta = as_mapping(obj.get("metadata"))
    namespace, name, _ = _meta(obj, f"{kind} {meta.get('namespace') or 'default'}/{meta.get('name', '<unnamed>')}")
    what = f"{kind} {namespace}/{name}"
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise InputError(f"{what}: spec: required")
    where = f"{what}: spec"
    out = Expansion()
    if kind == "Deployment":
        template = _template(spec, where)
        replicas = _count(spec, "replicas", 1, where)
        template_hash = pod_template_hash(template)
        replica_set = f"{name}-{template_hash}"
        owner = _owner("apps/v1", "ReplicaSet", namespace, replica_set)
        for i in range(replicas):
            pod_name = generated_name(f"{replica_set}-", f"{namespace}/{replica_set}/{i}")
            out.pods.append(_pod(template, namespace, pod_name, owner, {"pod-template-hash": template_hash}))
        out.notes.append(f"{what}: {replicas} replica(s) of ReplicaSet {replica_set}")
    elif kind == "ReplicaSet":
        template = _template(spec, where)
        replicas = _count(spec, "replicas", 1, where)
        owner = _owner("apps/v1", "ReplicaSet", namespace, name)
        for i in range(replicas):
            pod_name = generated_name(f"{name}-", f"{namespace}/{name}/{i}")
            out.pods.append(_pod(template, namespace, pod_name, owner))
        out.notes.append(f"{what}: {replicas} replica(s)")
    elif kind == "StatefulSet":
        template = _template(spec, where)
        replicas = _count(spec, "replicas", 1, where)
        ordinals = as_mapping(spec.get("ordinals"))
        start = _count(ordinals, "start", 0, f"{where}.ordinals")
        owner = _owner("apps/v1", "StatefulSet", namespace, name)
        for ordinal in range(start, start + replicas):
            out.pods.append(
                _pod(template, namespace, f"{name}-{ordinal}", owner, {"apps.kubernetes.io/pod-index": str(ordinal)})
            )
        out.notes.append(f"{what}: {replicas} replica(s), ordinals {start}..{start + replicas - 1}")
    elif kind == "Job":
        out = _job(spec, where, what, namespace, name, _owner("batch/v1", "Job", namespace, name))
    elif group == "kubeflow.org" and kind == "MPIJob":
        out = _mpijob(obj, spec, where, what, namespace, name)
    else:  # pragma: no cover - is_workload guards the call
        raise InputError(f"{what}: not a workload the simulator expands")
    return out


def _job(
    spec: dict[str, Any], where: str, what: str, namespace: str, name: str, owner: dict[str, Any]
) -> Expansion:
    out = Expansion()
    template = _template(spec, where)
    if spec.get("suspend") is True:
        out.notes.append(f"{what}: suspended (spec.suspend), no Pods run")
        return out
    parallelism = _count(spec, "parallelism", 1, where)
    completions = spec.get("completions")
    running = parallelism
    if completions is not None:
        running = min(parallelism, _count(spec, "completions", 1, where))
    indexed = spec.get("completionMode") == "Indexed"
    for i in range(running):
        base = f"{name}-{i}-" if indexed else f"{name}-"
        pod = _pod(template, namespace, generated_name(base, f"{namespace}/job/{name}/{i}"), owner,
                   {"batch.kubernetes.io/job-name": name})
        if indexed:
            pod["metadata"].setdefault("annotations", {})["batch.kubernetes.io/job-completion-index"] = str(i)
        out.pods.append(pod)
    detail = f"parallelism {parallelism}" + (f", completions {completions}" if completions is not None else "")
    out.notes.append(f"{what}: {running} Pod(s) at once ({detail}{', Indexed' if indexed else ''})")
    return out


def _mpijob(obj: dict[str, Any], spec: dict[str, Any], where: str, what: str, namespace: str, name: str) -> Expansion:
    if obj.get("apiVersion") != "kubeflow.org/v2beta1":
        raise InputError(f"{what}: apiVersion {obj.get('apiVersion')}: only kubeflow.org/v2beta1 MPIJobs are read")
    replica_specs = spec.get("mpiReplicaSpecs")
    if not isinstance(replica_specs, dict):
        raise InputError(f"{where}.mpiReplicaSpecs: required")
    out = Expansion()
    owner = _owner("kubeflow.org/v2beta1", "MPIJob", namespace, name)
    worker = replica_specs.get("Worker")
    workers = 0
    if isinstance(worker, dict):
        w_where = f"{where}.mpiReplicaSpecs.Worker"
        template = _template(worker, w_where)
        workers = _count(worker, "replicas", 1, w_where)
        for i in range(workers):
            out.pods.append(_pod(template, namespace, f"{name}-worker-{i}", owner,
                                 {"training.kubeflow.org/job-name": name, "training.kubeflow.org/job-role": "worker",
                                  "training.kubeflow.org/replica-index": str(i)}))
    launcher = replica_specs.get("Launcher")
    if isinstance(launcher, dict):
        l_where = f"{where}.mpiReplicaSpecs.Launcher"
        template = _template(launcher, l_where)
        job = f"{name}-launcher"
        job_owner = _owner("batch/v1", "Job", namespace, job)
        out.pods.append(_pod(template, namespace, generated_name(f"{job}-", f"{namespace}/job/{job}/0"), job_owner,
                             {"training.kubeflow.org/job-name": name, "training.kubeflow.org/job-role": "launcher"}))
    if worker is None and launcher is None:
        raise InputError(f"{where}.mpiReplicaSpecs: neither Worker nor Launcher is set")
    out.notes.append(f"{what}: {workers} worker Pod(s)" + (" and the launcher" if isinstance(launcher, dict) else ""))
    return out
