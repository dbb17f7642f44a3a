"""A scheduler emulator: allocates pending ResourceClaims in the API emulator with our allocation simulator.

What kube-scheduler's DRA plugin does for a pod, reduced to what the node side needs: read the
ResourceSlices, DeviceClasses and already-allocated claims from the API server, run the structured
allocator (:mod:`dradriver.allocator`), and write ``status.allocation`` (plus a ``status.reservedFor`` entry
per consuming pod) through the ``status`` subresource, as the scheduler does.

:func:`schedule_extended` is the scheduler's part of DRA-backed extended resources (KEP-5004,
:mod:`dradriver.allocator.extended`): for a Pod that asks for ``nvidia.com/gpu: 1`` with no
``resourceClaims``, it creates the claim (``generateName: <pod>-extended-resources-``), allocates and
reserves it, and writes ``status.extendedResourceClaimStatus`` into the Pod.

Binding conditions (KEP-5007, gate ``DRADeviceBindingConditions``; ``binding_conditions=True``): devices with
``bindingConditions`` become selectable, their results carry the conditions and the allocation gets its
``allocationTimestamp``. The pod is then bound only after :func:`prebind` says ``ready``: as kube-scheduler's
DynamicResources PreBind (``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`` in
kubernetes/kubernetes, ``isClaimReadyForBinding``), every binding condition of every allocated result must be
``True`` in the claim's ``status.devices[]`` entry of that device; any of its ``bindingFailureConditions``
``True`` fails the binding, and so does a claim still not ready ``bindingTimeout`` (the plugin argument, default
:data:`BINDING_TIMEOUT_S`) after its ``allocationTimestamp``. A failed binding is undone by :func:`unreserve`
(the pod leaves ``status.reservedFor``; a claim with binding conditions is deallocated, its ``status.devices``
cleared with it) and the pod is scheduled again later.
"""

from __future__ import annotations

import copy
import datetime
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dradriver.allocator import simulation
from dradriver.allocator.allocation import AllocationError
from dradriver.allocator.extended import class_mapping, plan, unserved_reason
from dradriver.sandbox.apiserver import ApiServerEmulator

BINDING_TIMEOUT_S = 600.0
"""kube-scheduler's DynamicResources ``bindingTimeout`` default (seconds): how long PreBind waits for a claim's
binding conditions, counted from its ``allocationTimestamp``."""


def allocate(
    api: ApiServerEmulator,
    claims: Iterable[tuple[str, str]],
    *,
    node_name: str | None = None,
    reserved_for: Iterable[Mapping[str, str]] = (),
    binding_conditions: bool = False,
) -> list[dict[str, Any]]:
    """Allocate the claims named ``(namespace, name)`` together and store their allocation.

    :param node_name: the node the pod was placed on (``None``: the first node that fits).
    :param reserved_for: pod references (``{"resource": "pods", "name", "uid"}``) added to
        ``status.reservedFor``.
    :param binding_conditions: the scheduler's gate ``DRADeviceBindingConditions`` (module docstring): devices
        with binding conditions can be chosen, and each new allocation gets ``allocationTimestamp``.
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
        outcome = simulation.simulate(simulation.load_objects([*objects, *pending], "the API emulator"),
                                      binding_conditions=binding_conditions)
        if outcome.failures:
            raise AllocationError("; ".join(outcome.failures))
        by_ref = {(c["metadata"].get("namespace", "default"), c["metadata"]["name"]): c for c in outcome.claims}
        for claim in pending:
            ref = (claim["metadata"].get("namespace", "default"), claim["metadata"]["name"])
            updated = copy.deepcopy(claim)
            allocation = by_ref[ref]["status"]["allocation"]
            if binding_conditions:
                allocation["allocationTimestamp"] = _rfc3339(time.time())
            updated.setdefault("status", {})["allocation"] = allocation
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


def _rfc3339(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def unix_seconds(stamp: str) -> float | None:
    """An RFC 3339 UTC stamp (``2026-01-01T00:00:00Z``) as Unix seconds; ``None`` when it is not one."""
    try:
        return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PreBind:
    """What :func:`prebind` found for a pod's claims.

    :ivar state: ``ready`` (bind the pod), ``waiting`` (look again), ``failed`` (a failure condition is True, or
        a claim is gone or no longer allocated) or ``timeout`` (``bindingTimeout`` passed); the last two call for
        :func:`unreserve`.
    :ivar message: why, naming the claim and the device (``""`` when ready).
    """

    state: str
    message: str = ""


def _claim_binding(claim: Mapping[str, Any], now: float, timeout_s: float) -> PreBind:
    meta = claim.get("metadata") or {}
    ref = f"{meta.get('namespace', 'default')}/{meta.get('name')}"
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        return PreBind("failed", f"claim {ref} is no longer allocated")
    entries = {(d.get("driver"), d.get("pool"), d.get("device"), d.get("shareID") or ""): d
               for d in (claim.get("status") or {}).get("devices") or []}
    waiting = ""
    for result in (allocation.get("devices") or {}).get("results") or []:
        wanted = result.get("bindingConditions") or []
        if not wanted:
            continue
        device = f"{result.get('driver')}/{result.get('pool')}/{result.get('device')}"
        entry = entries.get((result.get("driver"), result.get("pool"), result.get("device"),
                             result.get("shareID") or "")) or {}
        conditions = {c.get("type"): c for c in entry.get("conditions") or []}
        for name in result.get("bindingFailureConditions") or []:
            failed = conditions.get(name)
            if failed is not None and failed.get("status") == "True":
                return PreBind("failed", f"claim {ref} binding failed on device {device}: {name}=True "
                                         f"(reason={failed.get('reason', '')}, message={failed.get('message', '')!r})")
        missing = [n for n in wanted if (conditions.get(n) or {}).get("status") != "True"]
        if missing and not waiting:
            waiting = f"claim {ref} waits for binding condition(s) {', '.join(missing)} of device {device}"
    if not waiting:
        return PreBind("ready")
    allocated_at = unix_seconds(str(allocation.get("allocationTimestamp") or ""))
    if allocated_at is not None and now - allocated_at > timeout_s:
        return PreBind("timeout", f"{waiting}: bindingTimeout of {timeout_s:g} s passed since its allocation")
    return PreBind("waiting", waiting)


def prebind(api: ApiServerEmulator, claims: Iterable[tuple[str, str]], *, timeout_s: float = BINDING_TIMEOUT_S,
            now: float | None = None) -> PreBind:
    """kube-scheduler's PreBind check of a pod's claims named ``(namespace, name)`` (module docstring): ``ready``
    once every binding condition of every allocated device is True; the first failure or timeout otherwise.

    :param timeout_s: ``bindingTimeout``, seconds, from each claim's ``allocationTimestamp``.
    :param now: Unix seconds (default: the clock).
    """
    at = time.time() if now is None else now
    waiting: PreBind | None = None
    for namespace, name in claims:
        claim = api.get("ResourceClaim", name, namespace)
        if claim is None:
            return PreBind("failed", f"claim {namespace}/{name} no longer exists")
        outcome = _claim_binding(claim, at, timeout_s)
        if outcome.state in ("failed", "timeout"):
            return outcome
        if outcome.state == "waiting" and waiting is None:
            waiting = outcome
    return waiting or PreBind("ready")


def unreserve(api: ApiServerEmulator, claims: Iterable[tuple[str, str]], pod_ref: Mapping[str, str]) -> None:
    """Undo a failed binding as kube-scheduler's Unreserve does: ``pod_ref`` leaves each claim's
    ``status.reservedFor``, and a claim whose allocation has binding conditions is deallocated (``allocation``,
    ``reservedFor`` and ``devices`` cleared), so the pod's next attempt allocates anew."""
    for namespace, name in claims:
        claim = api.get("ResourceClaim", name, namespace)
        if claim is None:
            continue
        status = claim.setdefault("status", {})
        status["reservedFor"] = [r for r in status.get("reservedFor") or [] if r.get("uid") != pod_ref.get("uid")]
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        if any(r.get("bindingConditions") for r in results):
            for key in ("allocation", "reservedFor", "devices"):
                status.pop(key, None)
        elif not status["reservedFor"]:
            status.pop("reservedFor")
        api.update(claim, subresource="status")


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
