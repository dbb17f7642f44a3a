"""NVIDIA's ComputeDomain membership protocol, modelled faithfully: the baseline of the ``compute_domain_*``
benchmarks (``bench/bench_computedomain.py``).

Facts, from kubernetes-sigs/dra-driver-nvidia-gpu: ``api/nvidia.com/resource/v1beta1/computedomainclique.go``
(the ComputeDomainClique), ``cmd/compute-domain-controller/`` (reconcile, status sync loop),
``cmd/compute-domain-daemon/`` (index rule, conflict retries, workqueue backoff 5 ms -> 6 s). NVIDIA issue #816: one
256-pod domain took about 8 minutes on a real cluster.

* The daemon (:func:`join_clique`, :func:`leave_clique`): each IMEX daemon read-modify-writes the ONE shared
  ComputeDomainClique ``<cdUID>.<cliqueID>`` of its domain and clique: GET, insert its own entry with the lowest
  free index (or update its status), PUT conditional on ``resourceVersion``; a 409 (another daemon of the clique
  wrote first) is retried after a jittered exponential backoff. This is the code dradriver's
  ``app/cddaemon.py`` ran before it moved to server-side apply (copied here at commit 04f64f3 so the baseline
  stays NVIDIA's whatever ``app/`` becomes).
* The controller's status loop (:func:`status_round`, every 2 s): list every ComputeDomain, every daemon pod
  (label ``resource.nvidia.com/computeDomain``) and every clique of the driver namespace; per domain, prune clique
  entries whose node runs no daemon pod of the domain (written back, conditional), set ``status.nodes`` to the
  cliques' entries and ``status.status`` to the global status; write the status when it changed. Its cost grows
  with the fleet (three lists of everything per round), not with what changed.

Only the default gate settings (ComputeDomainCliques on) are modelled, as in dradriver.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.domain import computedomains as cd
from dradriver.domain import imex
from dradriver.domain.computedomains import CliqueDaemon
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kube.client import JSONDict, KubeClient
from dradriver.kube.deployments import list_pods

__all__ = ["CONFLICT_RETRIES", "DaemonIdentity", "ProtocolError", "RoundResult", "join_clique", "leave_clique",
           "status_round"]

CONFLICT_RETRIES = 20  # NVIDIA's workqueue retries a failed update without bound; 20 tries bound one call here


class ProtocolError(Exception):
    """A daemon's update did not settle: no free index, or :data:`CONFLICT_RETRIES` conflicts in a row."""


@dataclass(frozen=True, slots=True)
class DaemonIdentity:
    """What one IMEX daemon knows about itself (the DaemonSet's env, NVIDIA's ``cmd/compute-domain-daemon/main.go``).

    :param max_nodes: ``MAX_NODES_PER_IMEX_DOMAIN`` (slots of the clique; 18 on GB200 NVL72).
    :param imexd_dir: its domain directory (``/imexd`` in its container; ``None``: not modelled).
    """

    cd_uid: str
    clique_id: str
    node_name: str
    pod_ip: str
    pod_name: str
    pod_uid: str
    namespace: str
    max_nodes: int = cd.DEFAULT_MAX_NODES_PER_IMEX_DOMAIN
    imexd_dir: Path | None = None

    @property
    def clique_name(self) -> str:
        return cd.clique_object_name(self.cd_uid, self.clique_id)


def _owner(me: DaemonIdentity) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "name": me.pod_name, "uid": me.pod_uid}


def _new_clique(me: DaemonIdentity) -> JSONDict:
    return {"apiVersion": cd.API_GROUP_VERSION, "kind": cd.CLIQUE_KIND,
            "metadata": {"name": me.clique_name, "namespace": me.namespace,
                         "labels": {cd.LABEL_COMPUTE_DOMAIN: me.cd_uid, cd.LABEL_CLIQUE_ID: me.clique_id},
                         "ownerReferences": [_owner(me)]},
            "daemons": []}


def _daemons(obj: Mapping[str, Any]) -> list[CliqueDaemon]:
    return [CliqueDaemon.from_entry(e) for e in obj.get("daemons") or ()]


CONFLICT_BACKOFF_S = (0.005, 6.0)
"""NVIDIA's daemon workqueue backoff, first and longest, seconds (``cmd/compute-domain-daemon/``: jittered exponential
5 ms -> 6 s)."""


def conflict_backoff_s(attempt: int, longest_s: float = CONFLICT_BACKOFF_S[1]) -> float:
    """Delay before retry ``attempt`` (0-based) after a 409: 5 ms doubling, up to 100 % jitter, at most
    ``longest_s`` (NVIDIA's daemon workqueue, :data:`CONFLICT_BACKOFF_S`; the jitter stays under the cap, the
    reading kindest to the baseline)."""
    first, _ = CONFLICT_BACKOFF_S
    return min(longest_s, first * 2 ** attempt * (1 + random.random()))


def join_clique(client: KubeClient, me: DaemonIdentity, status: str,
                sleep: Callable[[float], None] = time.sleep) -> list[CliqueDaemon]:
    """Insert or update ``me``'s entry (and owner reference) in its clique by read-modify-write, creating the
    clique when missing; returns the clique's entries after the write (or as read, when nothing changed).

    :param status: ``Ready`` or ``NotReady`` (the daemon pod's Ready condition).
    :raises ProtocolError: no free index, or the conflicts did not settle in :data:`CONFLICT_RETRIES` tries.
    :raises dradriver.kube.errors.KubeAPIError: the API failed after its own retries.
    """
    for attempt in range(CONFLICT_RETRIES):
        obj = kube_cd.get_clique(client, me.namespace, me.clique_name)
        if obj is None:
            created = kube_cd.create_clique(client, _new_clique(me))
            obj = created if created is not None else kube_cd.get_clique(client, me.namespace, me.clique_name)
            if obj is None:
                continue
        daemons = _daemons(obj)
        try:
            updated, _ = imex.upsert_entry(daemons, node_name=me.node_name, ip_address=me.pod_ip,
                                           clique_id=me.clique_id, max_nodes=me.max_nodes, status=status)
        except cd.ComputeDomainError as exc:
            raise ProtocolError(f"ComputeDomainClique {me.namespace}/{me.clique_name}: {exc}") from exc
        meta = obj.setdefault("metadata", {})
        owners = list(meta.get("ownerReferences") or [])
        has_owner = any(o.get("uid") == me.pod_uid for o in owners)
        if updated == daemons and has_owner:
            return daemons
        if not has_owner:
            meta["ownerReferences"] = [*owners, _owner(me)]
        obj["daemons"] = [d.to_clique_entry() for d in updated]
        try:
            written = kube_cd.update_clique(client, obj)
        except kube_errors.KubeConflictError:
            sleep(conflict_backoff_s(attempt))
            continue
        return _daemons(written)
    raise ProtocolError(f"ComputeDomainClique {me.namespace}/{me.clique_name}: {CONFLICT_RETRIES} conflicting "
                        "updates in a row")


def leave_clique(client: KubeClient, me: DaemonIdentity, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Remove ``me``'s entry (matched by node name and pod IP) from its clique by read-modify-write.

    :returns: whether an entry was removed.
    :raises dradriver.kube.errors.KubeAPIError: the API failed after its own retries.
    """
    for attempt in range(CONFLICT_RETRIES):
        obj = kube_cd.get_clique(client, me.namespace, me.clique_name)
        if obj is None:
            return False
        daemons = _daemons(obj)
        kept = imex.remove_entry(daemons, node_name=me.node_name, ip_address=me.pod_ip)
        if kept == daemons:
            return False
        obj["daemons"] = [d.to_clique_entry() for d in kept]
        try:
            kube_cd.update_clique(client, obj)
        except kube_errors.KubeConflictError:
            sleep(conflict_backoff_s(attempt))
            continue
        return True
    return False


@dataclass
class RoundResult:
    """What one status round did: objects listed (domains, pods, cliques), status writes, clique prunes, 409s."""

    domains: int = 0
    pods: int = 0
    cliques: int = 0
    status_writes: int = 0
    prunes: int = 0
    conflicts: int = 0
    ready: dict[str, str] = field(default_factory=dict)  # CD uid -> status.status after the round


def _node_of(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def status_round(client: KubeClient, namespace: str) -> RoundResult:
    """One round of NVIDIA's 2 s status loop (module docstring) over every ComputeDomain.

    :param namespace: the driver namespace (daemon pods and cliques).
    :raises dradriver.kube.errors.KubeAPIError: a list failed after retries (a conflicting write is counted and
        left to the next round, as NVIDIA's loop does).
    """
    out = RoundResult()
    domains = list(kube_cd.list_compute_domains(client).get("items") or ())
    pods = list_pods(client, namespace, cd.LABEL_COMPUTE_DOMAIN)
    cliques = kube_cd.list_cliques(client, namespace, cd.LABEL_COMPUTE_DOMAIN)
    out.domains, out.pods, out.cliques = len(domains), len(pods), len(cliques)
    nodes_by_cd: dict[str, set[str]] = {}
    for pod in pods:
        uid = str(((pod.get("metadata") or {}).get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN) or "")
        nodes_by_cd.setdefault(uid, set()).add(_node_of(pod))
    cliques_by_cd: dict[str, list[JSONDict]] = {}
    for clique in cliques:
        uid = str(((clique.get("metadata") or {}).get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN) or "")
        cliques_by_cd.setdefault(uid, []).append(clique)
    for obj in domains:
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        uid = str(meta.get("uid") or "")
        nodes = nodes_by_cd.get(uid, set())
        entries: dict[str, CliqueDaemon] = {}
        for clique in cliques_by_cd.get(uid, []):
            daemons = list(clique.get("daemons") or [])
            kept = [d for d in daemons if d.get("nodeName") in nodes]
            if len(kept) != len(daemons):
                try:
                    kube_cd.update_clique(client, {"apiVersion": cd.API_GROUP_VERSION, "kind": cd.CLIQUE_KIND,
                                                   **clique, "daemons": kept})
                    out.prunes += 1
                except kube_errors.KubeConflictError:
                    out.conflicts += 1
                except kube_errors.KubeNotFoundError:
                    pass
            for raw in kept:
                daemon = CliqueDaemon.from_entry(raw)
                entries[daemon.node_name] = daemon
        listed = [entries[name] for name in sorted(entries)]
        num_nodes = int((obj.get("spec") or {}).get("numNodes") or 0)
        status = dict(obj.get("status") or {})
        wanted = {**status, "nodes": [n.to_status_node() for n in listed],
                  "status": cd.global_status(num_nodes, listed)}
        out.ready[uid] = str(wanted["status"])
        if wanted == status:
            continue
        obj.setdefault("apiVersion", cd.API_GROUP_VERSION)
        obj.setdefault("kind", "ComputeDomain")
        obj["status"] = wanted
        try:
            kube_cd.update_compute_domain_status(client, obj)
            out.status_writes += 1
        except kube_errors.KubeConflictError:
            out.conflicts += 1
    return out
