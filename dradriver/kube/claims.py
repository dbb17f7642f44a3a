"""Reading ResourceClaims (``resource.k8s.io/v1``) for NodePrepareResources.

The kubelet sends only ``(namespace, name, uid)``; the allocation lives in the claim's status. The GET is
here; the checks and the reduction to a :class:`dradriver.domain.claims.Claim` are pure and live in
:func:`dradriver.domain.claims.claim_from_object`.
"""

from __future__ import annotations

from dradriver.domain import claims as domain_claims
from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient


def get_resource_claim(client: KubeClient, namespace: str, name: str) -> JSONDict:
    """``GET /apis/resource.k8s.io/v1/namespaces/<namespace>/resourceclaims/<name>`` as a dict.

    :raises errors.KubeNotFoundError: no such claim.
    :raises errors.KubeAPIError: any other failure, after retries for 429/5xx/connection errors.
    """
    return client.call(f"GET resourceclaims {namespace}/{name}", client.resource.read_namespaced_resource_claim,
                       name, namespace)


def fetch_claim(client: KubeClient, ref: domain_claims.ClaimRef, *, driver: str, pool: str) -> domain_claims.Claim:
    """GET the claim named by ``ref`` and reduce it to this node's allocation results for ``driver``.

    :raises dradriver.domain.claims.ClaimError: the claim is gone (404), replaced (UID mismatch), not
        allocated, or has nothing for this driver on this node.
    :raises errors.KubeAPIError: the API server could not be asked (transient; the kubelet retries).
    """
    try:
        obj = get_resource_claim(client, ref.namespace, ref.name)
    except errors.KubeNotFoundError as exc:
        raise domain_claims.ClaimError(ref, "ResourceClaim not found in the API server (deleted?)") from exc
    return domain_claims.claim_from_object(obj, ref, driver=driver, pool=pool)


def claim_standing(client: KubeClient, ref: domain_claims.ClaimRef, *, driver: str, pool: str) -> str:
    """Whether a prepared claim still stands: ``""`` when its ResourceClaim exists with the same UID and its
    allocation still has devices of ``driver`` in ``pool``; otherwise why not (``gone``, ``replaced by UID <uid>``,
    ``no longer allocated to this node``).

    :raises errors.KubeAPIError: the API server could not be asked (the caller decides nothing then).
    """
    try:
        obj = get_resource_claim(client, ref.namespace, ref.name)
    except errors.KubeNotFoundError:
        return "gone: the ResourceClaim no longer exists"
    uid = str((obj.get("metadata") or {}).get("uid", ""))
    if uid != ref.uid:
        return f"replaced: the ResourceClaim {ref.namespace}/{ref.name} now has UID {uid or '<none>'}"
    try:
        domain_claims.claim_from_object(obj, ref, driver=driver, pool=pool)
    except domain_claims.ClaimError as exc:
        return f"no longer allocated to this node ({exc.cause})"
    return ""
