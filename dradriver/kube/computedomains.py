"""ComputeDomain and ComputeDomainClique objects (``resource.nvidia.com/v1beta1``), and node labels, through the
API: what the compute-domain kubelet plugin, daemon and controller read and write.

Every call goes through :meth:`KubeClient.call` (retries, rate limit, our errors) with the official client's
``CustomObjectsApi``; bodies are the API's JSON. Writes that must not lose a concurrent change carry the
object's ``resourceVersion`` (optimistic concurrency: a 409 is :class:`~dradriver.kube.errors.KubeConflictError`).
Names and labels: :mod:`dradriver.domain.computedomains`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from dradriver.domain.computedomains import API_GROUP, API_VERSION, CLIQUE_PLURAL, COMPUTE_DOMAIN_PLURAL
from dradriver.kube import errors
from dradriver.kube.client import LIST_PAGE_SIZE, JSONDict, KubeClient

APPLY_PATCH = "application/apply-patch+yaml"
"""Server-side apply (Kubernetes "Server-Side Apply"; JSON is valid YAML, so the body is the object's JSON)."""
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
"""RFC 6902 JSON patch: a ``test`` operation makes it conditional on a value, not on the whole object."""
NODE_LEASE_NAMESPACE = "kube-node-lease"

__all__ = [
    "APPLY_PATCH",
    "JSON_PATCH",
    "MERGE_PATCH",
    "apply_clique",
    "create_clique",
    "delete_clique",
    "find_compute_domain",
    "get_clique",
    "get_compute_domain",
    "iterate_compute_domains",
    "list_cliques",
    "list_compute_domains",
    "list_node_leases",
    "patch_clique",
    "patch_compute_domain_status",
    "set_node_label",
    "update_clique",
    "update_compute_domain",
    "update_compute_domain_status",
    "watch_cliques",
]


def get_compute_domain(client: KubeClient, namespace: str, name: str) -> JSONDict | None:
    """``GET`` one ComputeDomain; ``None`` when it does not exist.

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        return client.call(f"GET computedomains {namespace}/{name}", client.custom.get_namespaced_custom_object,
                           API_GROUP, API_VERSION, namespace, COMPUTE_DOMAIN_PLURAL, name)
    except errors.KubeNotFoundError:
        return None


def list_compute_domains(client: KubeClient, namespace: str = "", label_selector: str = "") -> JSONDict:
    """List ComputeDomains of ``namespace`` (all namespaces when empty); the whole list body (``items``,
    ``metadata.resourceVersion``).

    :raises errors.KubeAPIError: after retries.
    """
    if namespace:
        return client.call(f"LIST computedomains {namespace}", client.custom.list_namespaced_custom_object,
                           API_GROUP, API_VERSION, namespace, COMPUTE_DOMAIN_PLURAL, label_selector=label_selector)
    return client.call("LIST computedomains", client.custom.list_cluster_custom_object, API_GROUP, API_VERSION,
                       COMPUTE_DOMAIN_PLURAL, label_selector=label_selector)


def find_compute_domain(client: KubeClient, uid: str) -> JSONDict | None:
    """The ComputeDomain whose ``metadata.uid`` is ``uid`` (the ``domainID`` of a channel or daemon config),
    found by listing all namespaces; ``None`` when none has it.

    :raises errors.KubeAPIError: after retries.
    """
    for item in list_compute_domains(client).get("items") or ():
        if (item.get("metadata") or {}).get("uid") == uid:
            return dict(item)
    return None


def update_compute_domain(client: KubeClient, obj: Mapping[str, Any]) -> JSONDict:
    """``PUT`` a ComputeDomain (metadata and spec; the API keeps status). The body's ``resourceVersion`` makes
    it conditional.

    :raises errors.KubeConflictError: it changed since it was read.
    :raises errors.KubeAPIError: any other failure (422: ``spec`` is immutable), after retries.
    """
    meta = obj["metadata"]
    return client.call(f"PUT computedomains {meta['namespace']}/{meta['name']}",
                       client.custom.replace_namespaced_custom_object, API_GROUP, API_VERSION, meta["namespace"],
                       COMPUTE_DOMAIN_PLURAL, meta["name"], dict(obj))


def update_compute_domain_status(client: KubeClient, obj: Mapping[str, Any]) -> JSONDict:
    """``PUT .../status`` of a ComputeDomain (conditional on the body's ``resourceVersion``).

    :raises errors.KubeConflictError: it changed since it was read.
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    meta = obj["metadata"]
    return client.call(f"PUT computedomains/status {meta['namespace']}/{meta['name']}",
                       client.custom.replace_namespaced_custom_object_status, API_GROUP, API_VERSION,
                       meta["namespace"], COMPUTE_DOMAIN_PLURAL, meta["name"], dict(obj))


def patch_compute_domain_status(client: KubeClient, namespace: str, name: str, status: Mapping[str, Any],
                                removed: Iterable[str] = ()) -> JSONDict | None:
    """``PATCH .../status`` of a ComputeDomain with a JSON merge patch (RFC 7386) setting ``status`` to
    ``status`` (its lists replaced whole, ``removed`` keys deleted), with no ``resourceVersion``: the
    controller is the only writer of a domain's status and computes it from one fresh read of its members, so a
    write never waits on a conflict (issue 14: NVIDIA's RV-guarded status updates answer 409 under churn).

    :returns: the domain after the patch; ``None`` when it no longer exists.
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    body = {"status": {**{key: None for key in removed}, **dict(status)}}
    try:
        return client.call(f"PATCH computedomains/status {namespace}/{name}",
                           client.custom.patch_namespaced_custom_object_status, API_GROUP, API_VERSION, namespace,
                           COMPUTE_DOMAIN_PLURAL, name, body, _content_type=MERGE_PATCH)
    except errors.KubeNotFoundError:
        return None


def get_clique(client: KubeClient, namespace: str, name: str) -> JSONDict | None:
    """``GET`` one ComputeDomainClique (name ``<cdUID>.<cliqueID>``); ``None`` when it does not exist.

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        return client.call(f"GET computedomaincliques {namespace}/{name}",
                           client.custom.get_namespaced_custom_object, API_GROUP, API_VERSION, namespace,
                           CLIQUE_PLURAL, name)
    except errors.KubeNotFoundError:
        return None


def iterate_compute_domains(client: KubeClient, page_size: int = LIST_PAGE_SIZE) -> Iterator[JSONDict]:
    """The ComputeDomains of every namespace, fetched ``page_size`` at a time as they are consumed
    (:meth:`KubeClient.list_items`).

    :raises errors.KubeAPIError: after retries.
    """
    return client.list_items("LIST computedomains", client.custom.list_cluster_custom_object, API_GROUP,
                             API_VERSION, COMPUTE_DOMAIN_PLURAL, page_size=page_size)


def list_cliques(client: KubeClient, namespace: str, label_selector: str = "") -> list[JSONDict]:
    """ComputeDomainCliques of ``namespace`` (every namespace when empty) matching ``label_selector``.

    :raises errors.KubeAPIError: after retries.
    """
    if not namespace:
        return list(client.list_items(f"LIST computedomaincliques {label_selector}",
                                      client.custom.list_cluster_custom_object, API_GROUP, API_VERSION,
                                      CLIQUE_PLURAL, label_selector=label_selector))
    return list(client.list_items(f"LIST computedomaincliques {namespace} {label_selector}",
                                  client.custom.list_namespaced_custom_object, API_GROUP, API_VERSION, namespace,
                                  CLIQUE_PLURAL, label_selector=label_selector))


def watch_cliques(client: KubeClient, namespace: str, label_selector: str, resource_version: str,
                  timeout_s: float, *, field_selector: str = "") -> Iterator[JSONDict]:
    """Watch the ComputeDomainCliques of ``namespace`` matching ``label_selector`` (and ``field_selector``, e.g.
    ``metadata.name=<clique>``: one clique) from ``resource_version`` (``""``: the current ones first, as
    ``ADDED``); yields watch events until the server ends the watch.

    :raises errors.KubeAPIError: opening or reading failed (410 ``Expired``: watch again from ``""``).
    """
    method = functools.partial(client.custom.list_namespaced_custom_object, API_GROUP, API_VERSION, namespace,
                               CLIQUE_PLURAL)
    options: dict[str, Any] = {"label_selector": label_selector}
    if field_selector:
        options["field_selector"] = field_selector
    if resource_version:
        options["resource_version"] = resource_version
    return client.stream(f"WATCH computedomaincliques {namespace} {label_selector or field_selector}", method,
                         timeout_s=timeout_s, **options)


def create_clique(client: KubeClient, obj: Mapping[str, Any]) -> JSONDict | None:
    """``POST`` a ComputeDomainClique; ``None`` when one of that name already exists (read it and update).

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    meta = obj["metadata"]
    try:
        return client.call(f"POST computedomaincliques {meta['namespace']}/{meta['name']}",
                           client.custom.create_namespaced_custom_object, API_GROUP, API_VERSION,
                           meta["namespace"], CLIQUE_PLURAL, dict(obj))
    except errors.KubeAlreadyExistsError:
        return None


def update_clique(client: KubeClient, obj: Mapping[str, Any]) -> JSONDict:
    """``PUT`` a ComputeDomainClique (it has no status subresource: ``daemons`` is top level), conditional on
    the body's ``resourceVersion``.

    :raises errors.KubeConflictError: another daemon changed it since it was read.
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    meta = obj["metadata"]
    return client.call(f"PUT computedomaincliques {meta['namespace']}/{meta['name']}",
                       client.custom.replace_namespaced_custom_object, API_GROUP, API_VERSION, meta["namespace"],
                       CLIQUE_PLURAL, meta["name"], dict(obj))


def apply_clique(client: KubeClient, namespace: str, name: str, body: Mapping[str, Any], *, field_manager: str,
                 force: bool = True) -> JSONDict:
    """Server-side apply ``body`` (a partial ComputeDomainClique: ``apiVersion``, ``kind``, ``metadata.name``
    and only the fields ``field_manager`` owns) to the clique ``namespace/name``, creating it when missing.

    The API merges the ``daemons`` list-map by ``nodeName``: fields of other managers' items (and other
    managers' fields of the same item) are left alone, fields this manager applied before and leaves out now are
    removed. No ``resourceVersion``: the write never conflicts with another manager's write; ``force`` takes over
    a field another manager set to a different value (the only contested one is a daemon's own entry after its
    node's fields were cleared by the controller, which is not an apply).

    :returns: the clique after the apply.
    :raises errors.KubeAPIError: after retries (422: the body breaks the CRD schema; 415: the API server does
        not implement server-side apply).
    """
    return client.call(f"APPLY computedomaincliques {namespace}/{name} as {field_manager}",
                       client.custom.patch_namespaced_custom_object, API_GROUP, API_VERSION, namespace,
                       CLIQUE_PLURAL, name, dict(body), field_manager=field_manager, force=force,
                       _content_type=APPLY_PATCH)


def patch_clique(client: KubeClient, namespace: str, name: str, operations: list[dict[str, Any]]) -> JSONDict | None:
    """Apply RFC 6902 ``operations`` to a ComputeDomainClique (an update, not an apply: the fields it removes
    leave their managers' sets). Callers put a ``test`` of the item's ``nodeName`` before operations on
    ``/daemons/<i>`` so that a list reordered meanwhile makes the patch fail instead of touching another item.

    :returns: the clique after the patch; ``None`` when it does not exist or a ``test`` failed (read it again).
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        return client.call(f"PATCH computedomaincliques {namespace}/{name}",
                           client.custom.patch_namespaced_custom_object, API_GROUP, API_VERSION, namespace,
                           CLIQUE_PLURAL, name, operations, _content_type=JSON_PATCH)
    except errors.KubeNotFoundError:
        return None
    except errors.KubeUnprocessableError:
        return None


def list_node_leases(client: KubeClient) -> Iterator[JSONDict]:
    """The kubelets' heartbeat Leases (``coordination.k8s.io/v1`` in ``kube-node-lease``, one per Node, named
    after it; ``spec.renewTime`` is the last heartbeat), fetched page by page as they are consumed
    (:meth:`KubeClient.list_items`: one page of a large fleet's Leases held at a time).

    :raises errors.KubeAPIError: after retries.
    """
    return client.list_items(f"LIST leases {NODE_LEASE_NAMESPACE}", client.coordination.list_namespaced_lease,
                             NODE_LEASE_NAMESPACE)


def delete_clique(client: KubeClient, namespace: str, name: str) -> bool:
    """``DELETE`` a ComputeDomainClique; False when it was already gone.

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        client.call(f"DELETE computedomaincliques {namespace}/{name}", client.custom.delete_namespaced_custom_object,
                    API_GROUP, API_VERSION, namespace, CLIQUE_PLURAL, name)
        return True
    except errors.KubeNotFoundError:
        return False


def set_node_label(client: KubeClient, node: str, key: str, value: str | None, *,
                   only_if: str | None = None) -> bool:
    """Set (``value``) or remove (``None``) one label of a Node with a JSON merge patch.

    :param only_if: remove or overwrite only when the label's current value is this one (a plugin removes
        ``resource.nvidia.com/computeDomain`` only when it names its own domain); the check and the patch are
        two requests, guarded by the Node's ``resourceVersion``.
    :returns: whether the Node was changed.
    :raises errors.KubeConflictError: ``only_if`` was given and the Node changed between read and patch.
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    metadata: dict[str, Any] = {"labels": {key: value}}
    if only_if is not None:
        obj = client.call(f"GET nodes {node}", client.core.read_node, node)
        current = ((obj.get("metadata") or {}).get("labels") or {}).get(key)
        if current != only_if:
            return False
        metadata["resourceVersion"] = (obj.get("metadata") or {}).get("resourceVersion")
    client.call(f"PATCH nodes {node} label {key}", client.core.patch_node, node, {"metadata": metadata},
                _content_type=MERGE_PATCH)
    return True
