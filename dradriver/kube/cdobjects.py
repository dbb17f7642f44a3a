"""The objects the compute-domain controller owns, through the API: ResourceClaimTemplates
(``resource.k8s.io/v1``), DaemonSets (``apps/v1``) and their watches, and what it reads besides (Nodes by label,
the watch on ComputeDomains).

Every call goes through :meth:`KubeClient.call` (retries, rate limit, our errors); bodies are the API's JSON.
Finalizers are removed with a read-modify-write guarded by ``resourceVersion`` (a JSON merge patch would replace
the whole list and could drop a finalizer another party added meanwhile). RBAC: ``deploy/kustomize/components/
compute-domains/rbac.yaml``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dradriver.domain.computedomains import API_GROUP, API_VERSION, COMPUTE_DOMAIN_PLURAL
from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient

__all__ = [
    "DAEMON_SETS",
    "PODS",
    "RESOURCE_CLAIMS",
    "RESOURCE_CLAIM_TEMPLATES",
    "ObjectKind",
    "create",
    "delete",
    "get",
    "list_nodes",
    "list_objects",
    "remove_finalizer",
    "replace",
    "watch_compute_domains",
    "watch_objects",
]


@dataclass(frozen=True, slots=True)
class ObjectKind:
    """A namespaced kind and the official client's methods for it (``api`` is a :class:`KubeClient` attribute)."""

    plural: str
    api: str
    suffix: str  # ``resource_claim_template``: the client's method names are ``<verb>_namespaced_<suffix>``

    def method(self, client: KubeClient, verb: str) -> Any:
        """The bound client method ``<verb>_namespaced_<suffix>`` (``list_all``:
        ``list_<suffix>_for_all_namespaces``)."""
        api = getattr(client, self.api)
        if verb == "list_all":
            return getattr(api, f"list_{self.suffix}_for_all_namespaces")
        return getattr(api, f"{verb}_namespaced_{self.suffix}")


RESOURCE_CLAIM_TEMPLATES = ObjectKind("resourceclaimtemplates", "resource", "resource_claim_template")
DAEMON_SETS = ObjectKind("daemonsets", "apps", "daemon_set")
PODS = ObjectKind("pods", "core", "pod")
RESOURCE_CLAIMS = ObjectKind("resourceclaims", "resource", "resource_claim")


def get(client: KubeClient, kind: ObjectKind, namespace: str, name: str) -> JSONDict | None:
    """``GET`` one object; ``None`` when it does not exist.

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        return client.call(f"GET {kind.plural} {namespace}/{name}", kind.method(client, "read"), name, namespace)
    except errors.KubeNotFoundError:
        return None


def create(client: KubeClient, kind: ObjectKind, obj: Mapping[str, Any]) -> JSONDict | None:
    """``POST`` an object; ``None`` when one of that name already exists.

    :raises errors.KubeAPIError: any other failure, after retries (422 names the invalid field).
    """
    meta = obj["metadata"]
    try:
        return client.call(f"POST {kind.plural} {meta['namespace']}/{meta['name']}", kind.method(client, "create"),
                           meta["namespace"], dict(obj))
    except errors.KubeAlreadyExistsError:
        return None


def replace(client: KubeClient, kind: ObjectKind, obj: Mapping[str, Any]) -> JSONDict:
    """``PUT`` an object, conditional on its ``resourceVersion``.

    :raises errors.KubeConflictError: it changed since it was read.
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    meta = obj["metadata"]
    return client.call(f"PUT {kind.plural} {meta['namespace']}/{meta['name']}", kind.method(client, "replace"),
                       meta["name"], meta["namespace"], dict(obj))


def delete(client: KubeClient, kind: ObjectKind, namespace: str, name: str) -> bool:
    """``DELETE`` (background propagation); False when it was already gone. An object with finalizers only gets
    its ``deletionTimestamp``.

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        client.call(f"DELETE {kind.plural} {namespace}/{name}", kind.method(client, "delete"), name, namespace,
                    body={"propagationPolicy": "Background"})
        return True
    except errors.KubeNotFoundError:
        return False


def list_objects(client: KubeClient, kind: ObjectKind, namespace: str = "", label_selector: str = "") -> list[JSONDict]:
    """Objects of ``namespace`` (every namespace when empty) matching ``label_selector``.

    :raises errors.KubeAPIError: after retries.
    """
    if namespace:
        body = client.call(f"LIST {kind.plural} {namespace} {label_selector}", kind.method(client, "list"),
                           namespace, label_selector=label_selector)
    else:
        body = client.call(f"LIST {kind.plural} {label_selector}", kind.method(client, "list_all"),
                           label_selector=label_selector)
    return list(body.get("items") or [])


def remove_finalizer(client: KubeClient, kind: ObjectKind, namespace: str, name: str, finalizer: str, *,
                     attempts: int = 5) -> bool:
    """Remove ``finalizer`` from an object (read, drop, conditional write; a conflict is read again).

    :returns: False when the object is gone or never had the finalizer.
    :raises errors.KubeConflictError: still conflicting after ``attempts`` rounds.
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    for attempt in range(attempts):
        obj = get(client, kind, namespace, name)
        if obj is None:
            return False
        finalizers = list((obj.get("metadata") or {}).get("finalizers") or [])
        if finalizer not in finalizers:
            return False
        obj["metadata"]["finalizers"] = [f for f in finalizers if f != finalizer]
        try:
            replace(client, kind, obj)
            return True
        except errors.KubeNotFoundError:
            return False
        except errors.KubeConflictError:
            if attempt == attempts - 1:
                raise
    return False


def list_nodes(client: KubeClient, label_selector: str = "") -> Iterator[JSONDict]:
    """Nodes matching ``label_selector``, fetched page by page as they are consumed (:meth:`KubeClient.list_items`:
    one page of a large fleet's Nodes held at a time).

    :raises errors.KubeAPIError: after retries.
    """
    return client.list_items(f"LIST nodes {label_selector}", client.core.list_node, label_selector=label_selector)


def watch_compute_domains(client: KubeClient, resource_version: str, timeout_s: float) -> Iterator[JSONDict]:
    """Watch ComputeDomains of every namespace from ``resource_version``; yields watch events (``type``,
    ``object``) until the server ends the watch (after ``timeout_s``).

    :raises errors.KubeAPIError: opening or reading failed (410 ``Expired``: list again).
    """
    method = functools.partial(client.custom.list_cluster_custom_object, API_GROUP, API_VERSION,
                               COMPUTE_DOMAIN_PLURAL)
    return client.stream("WATCH computedomains", method, timeout_s=timeout_s, resource_version=resource_version)


def watch_objects(client: KubeClient, kind: ObjectKind, namespace: str, label_selector: str, resource_version: str,
                  timeout_s: float) -> Iterator[JSONDict]:
    """Watch objects of ``kind`` in ``namespace`` (every namespace when empty) matching ``label_selector`` from
    ``resource_version`` (``""``: the current objects first, as ``ADDED`` events); yields watch events (``type``,
    ``object``) until the server ends the watch (after ``timeout_s``).

    :raises errors.KubeAPIError: opening or reading failed (410 ``Expired``: watch again from ``""``).
    """
    if namespace:
        method = functools.partial(kind.method(client, "list"), namespace)
        what = f"WATCH {kind.plural} {namespace} {label_selector}"
    else:
        method = kind.method(client, "list_all")
        what = f"WATCH {kind.plural} {label_selector}"
    options: dict[str, Any] = {"label_selector": label_selector}
    if resource_version:
        options["resource_version"] = resource_version
    return client.stream(what, method, timeout_s=timeout_s, **options)
