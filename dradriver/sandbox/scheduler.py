"""A scheduler emulator: allocates pending ResourceClaims in the API emulator with our allocation simulator.

What kube-scheduler's DRA plugin does for a pod, reduced to what the node side needs: read the
ResourceSlices, DeviceClasses and already-allocated claims from the API server, run the structured
allocator (:mod:`dradriver.allocator`), and write ``status.allocation`` (plus a ``status.reservedFor`` entry
per consuming pod) through the ``status`` subresource, as the scheduler does.

:func:`schedule_extended` is the scheduler's part of DRA-backed extended resources (KEP-5004,
:mod:`dradriver.allocator.extended`): for a Pod that asks for ``nvidia.com/gpu: 1`` with no
``resourceClaims``, it creates the claim (``generateName: <pod>-extended-resources-``), allocates and
reserves it, and writes ``status.extendedResourceClaimStatus`` into the Pod.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from dradriver.allocator import simulation
from dradriver.allocator.allocation import AllocationError
from dradriver.allocator.extended import class_mapping, plan, unserved_reason
from dradriver.sandbox.apiserver import ApiServerEmulator


def allocate(
    api: ApiServerEmulator,
    claims: Iterable[tuple[str, str]],
    *,
    node_name: str | None = None,
    reserved_for: Iterable[Mapping[str, str]] = (),
) -> list[dict[str, Any]]:
    """Allocate the claims named ``(namespace, name)`` together and store their allocation.

    :param node_name: the node the pod was placed on (``None``: the first node that fits).
    :param reserved_for: pod references (``{"resource": "pods", "name", "uid"}``) added to
        ``status.reservedFor``.
    :returns: the updated claim objects.
    :raises AllocationError: the claims cannot be allocated (the message says why).
    """
    wanted = list(claims)
    objects: list[dict[str, Any]] = []
    # A pod placed on a node can only get devices that node sees: the other nodes' slices (spec.nodeName set to
    # another node) cannot be chosen, so they are not handed over (2048 IMEX channels a node make this count).
    objects += [s for s in api.objects("ResourceSlice")
                if node_name is None or (s.get("spec") or {}).get("nodeName") in (None, "", node_name)]
    objects += api.objects("DeviceClass")
    objects += api.objects("Node")
    allocated = [c for c in api.objects("ResourceClaim") if (c.get("status") or {}).get("allocation")]
    objects += allocated
    pending = []
    for namespace, name in wanted:
        claim = api.get("ResourceClaim", name, namespace)
        if claim is None:
            raise AllocationError(f"cannot allocate claim {namespace}/{name}: no such ResourceClaim")
        if not (claim.get("status") or {}).get("allocation"):
            pending.append(claim)
    if pending:
        if node_name is not None:
            # One pod's claims, placed on one node: the simulator groups claims of a pod by nodeName.
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "scheduler-emulator", "namespace": wanted[0][0]},
                "spec": {
                    "nodeName": node_name,
                    "containers": [{"name": "c", "image": "x"}],
                    "resourceClaims": [
                        {"name": c["metadata"]["name"], "resourceClaimName": c["metadata"]["name"]} for c in pending
                    ],
                },
            }
            objects.append(pod)
        outcome = simulation.simulate(simulation.load_objects([*objects, *pending], "the API emulator"))
        if outcome.failures:
            raise AllocationError("; ".join(outcome.failures))
        by_ref = {(c["metadata"].get("namespace", "default"), c["metadata"]["name"]): c for c in outcome.claims}
        for claim in pending:
            ref = (claim["metadata"].get("namespace", "default"), claim["metadata"]["name"])
            updated = copy.deepcopy(claim)
            updated.setdefault("status", {})["allocation"] = by_ref[ref]["status"]["allocation"]
            api.update(updated, subresource="status")
    out = []
    extra = [dict(r) for r in reserved_for]
    for namespace, name in wanted:
        claim = api.get("ResourceClaim", name, namespace)
        assert claim is not None
        if extra:
            status = claim.setdefault("status", {})
            reserved = status.setdefault("reservedFor", [])
            for pod_ref in extra:
                if pod_ref not in reserved:
                    reserved.append(pod_ref)
            claim = api.update(claim, subresource="status")
        out.append(claim)
    return out


def schedule_extended(api: ApiServerEmulator, pod: Mapping[str, Any], *, node_name: str) -> dict[str, Any] | None:
    """Serve ``pod``'s extended resources through DRA on ``node_name``, as kube-scheduler does.

    Reuses the claim ``status.extendedResourceClaimStatus`` names, if it exists; otherwise creates it
    (owned by the Pod, annotated ``resource.kubernetes.io/extended-resource-claim: "true"``, requests
    ``container-<i>-request-<j>``), allocates it on ``node_name`` reserved for the Pod, and records it in the
    Pod's ``status.extendedResourceClaimStatus`` (``resourceClaimName``, ``requestMappings``).

    :returns: the allocated claim, or ``None`` when the Pod asks for no extended resource DRA serves here
        (none at all, or the node's device plugin offers it in ``status.allocatable``).
    :raises AllocationError: an extended resource nothing serves, or devices that do not fit (the message
        says why, in the scheduler's terms).
    """
    meta = pod["metadata"]
    namespace, name = meta.get("namespace", "default"), meta["name"]
    node = api.get("Node", node_name)
    allocatable = {node_name: dict((node or {}).get("status", {}).get("allocatable") or {})}
    spec = dict(pod.get("spec") or {})
    spec["nodeName"] = node_name
    planned = plan({**pod, "spec": spec}, class_mapping(api.objects("DeviceClass")), allocatable)
    if planned.unserved:
        raise AllocationError(f"cannot schedule pod {namespace}/{name}: "
                              + "; ".join(unserved_reason(r) for r in planned.unserved))
    if planned.claim is None:
        return None
    status = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    claim = api.get("ResourceClaim", status["resourceClaimName"], namespace) if status.get("resourceClaimName") \
        else None
    if claim is None:
        body = dict(planned.claim)
        body["metadata"] = {k: v for k, v in planned.claim["metadata"].items() if k != "name"}
        body["metadata"]["generateName"] = f"{name}-extended-resources-"
        claim = api.create(body)
    pod_ref = {"resource": "pods", "name": name, "uid": meta["uid"]}
    [claim] = allocate(api, [(namespace, claim["metadata"]["name"])], node_name=node_name, reserved_for=[pod_ref])
    if not status:
        fresh = api.get("Pod", name, namespace)
        if fresh is not None:
            fresh.setdefault("status", {})["extendedResourceClaimStatus"] = {
                "requestMappings": planned.mappings,
                "resourceClaimName": claim["metadata"]["name"],
            }
            api.update(fresh, subresource="status")
    return claim
