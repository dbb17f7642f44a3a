"""Deployments (``apps/v1``) and the Pods they own: what the MPS control daemons need of the API.

Create a Deployment, read it, list the Pods its selector matches, and delete it with foreground propagation
(NVIDIA's ``cmd/gpu-kubelet-plugin/sharing.go``: NVIDIA deletes the control daemon's Deployment with
``propagationPolicy: Foreground`` and treats NotFound as done). RBAC: ``deployments`` create/get/list/delete in
the plugin's namespace, ``pods`` list (``deploy/kustomize/components/mps``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient


def create_deployment(client: KubeClient, manifest: Mapping[str, Any]) -> JSONDict | None:
    """``POST /apis/apps/v1/namespaces/<ns>/deployments``; ``None`` when one of that name already exists.

    :raises errors.KubeAPIError: any other failure, after retries (a 422 names the invalid field).
    """
    meta = manifest["metadata"]
    namespace, name = str(meta["namespace"]), str(meta["name"])
    try:
        return client.call(f"POST deployments {namespace}/{name}", client.apps.create_namespaced_deployment,
                           namespace, dict(manifest))
    except errors.KubeAlreadyExistsError:
        return None


def get_deployment(client: KubeClient, namespace: str, name: str) -> JSONDict | None:
    """``GET`` a Deployment; ``None`` when it does not exist.

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        return client.call(f"GET deployments {namespace}/{name}", client.apps.read_namespaced_deployment,
                           name, namespace)
    except errors.KubeNotFoundError:
        return None


def list_deployments(client: KubeClient, namespace: str, label_selector: str) -> list[JSONDict]:
    """Deployments of ``namespace`` matching ``label_selector`` (``key=value,...``).

    :raises errors.KubeAPIError: after retries.
    """
    body = client.call(f"LIST deployments {namespace} {label_selector}", client.apps.list_namespaced_deployment,
                       namespace, label_selector=label_selector)
    return list(body.get("items") or [])


def list_pods(client: KubeClient, namespace: str, label_selector: str, field_selector: str = "") -> list[JSONDict]:
    """Pods of ``namespace`` matching ``label_selector`` (and ``field_selector``, e.g. ``spec.nodeName=<node>``),
    fetched in pages (:meth:`KubeClient.list_items`).

    :raises errors.KubeAPIError: after retries.
    """
    return list(client.list_items(f"LIST pods {namespace} {label_selector} {field_selector}".rstrip(),
                                  client.core.list_namespaced_pod, namespace, label_selector=label_selector,
                                  field_selector=field_selector or None))


def delete_deployment(client: KubeClient, namespace: str, name: str) -> bool:
    """``DELETE`` with ``propagationPolicy: Foreground``; False when it was already gone (NotFound).

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        client.call(f"DELETE deployments {namespace}/{name}", client.apps.delete_namespaced_deployment, name,
                    namespace, body={"propagationPolicy": "Foreground"})
    except errors.KubeNotFoundError:
        return False
    return True
