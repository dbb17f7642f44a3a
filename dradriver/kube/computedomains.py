"""ComputeDomain and ComputeDomainClique objects (``resource.nvidia.com/v1beta1``), and node labels, through the
API: what the compute-domain kubelet plugin, daemon and controller read and write.

Every call goes through :meth:`KubeClient.call` (retries, rate limit, our errors) with the official client's
``CustomObjectsApi``; bodies are the API's JSON. Writes that must not lose a concurrent change carry the
object's ``resourceVersion`` (optimistic concurrency: a 409 is :class:`~dradriver.kube.errors.KubeConflictError`).
Names and labels: :mod:`dradriver.domain.computedomains`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dradriver.domain.computedomains import API_GROUP, API_VERSION, CLIQUE_PLURAL, COMPUTE_DOMAIN_PLURAL
from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient

__all__ = [
    "create_clique",
    "delete_clique",
    "find_compute_domain",
    "get_clique",
    "get_compute_domain",
    "list_cliques",
    "list_compute_domains",
    "set_node_label",
    "update_clique",
    "update_compute_domain",
    "update_compute_domain_status",
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


def list_cliques(client: KubeClient, namespace: str, label_selector: str = "") -> list[JSONDict]:
    """ComputeDomainCliques of ``namespace`` matching ``label_selector``.

    :raises errors.KubeAPIError: after retries.
    """
    body = client.call(f"LIST computedomaincliques {namespace} {label_selector}",
                       client.custom.list_namespaced_custom_object, API_GROUP, API_VERSION, namespace,
                       CLIQUE_PLURAL, label_selector=label_selector)
    return list(body.get("items") or [])


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
                _content_type="application/merge-patch+json")
    return True
