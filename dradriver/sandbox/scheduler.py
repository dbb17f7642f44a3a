"""A scheduler emulator: allocates pending ResourceClaims in the API emulator with our allocation simulator.

What kube-scheduler's DRA plugin does for a pod, reduced to what the node side needs: read the
ResourceSlices, DeviceClasses and already-allocated claims from the API server, run the structured
allocator (:mod:`dradriver.allocator`), and write ``status.allocation`` (plus a ``status.reservedFor`` entry
per consuming pod) through the ``status`` subresource, as the scheduler does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from dradriver.allocator import simulation
from dradriver.allocator.allocation import AllocationError
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
    objects += api.objects("ResourceSlice")
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
        text = yaml.safe_dump_all([*objects, *pending])
        outcome = simulation.simulate(simulation.load([text]))
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
