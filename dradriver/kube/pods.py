"""One Pod's own view of itself through the API: read it, set one of its labels, read its Ready condition.

What the compute-domain daemon needs of its own Pod (NVIDIA's ``cmd/compute-domain-daemon/``: it labels itself
``resource.nvidia.com/computeDomain.cliqueID=<cliqueID>`` and mirrors its readiness into its clique entry).
RBAC: ``pods`` get/patch in the daemon's namespace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient

__all__ = ["get_pod", "pod_ready", "set_pod_label"]


def get_pod(client: KubeClient, namespace: str, name: str) -> JSONDict | None:
    """``GET`` one Pod; ``None`` when it does not exist.

    :raises errors.KubeAPIError: any other failure, after retries.
    """
    try:
        return client.call(f"GET pods {namespace}/{name}", client.core.read_namespaced_pod, name, namespace)
    except errors.KubeNotFoundError:
        return None


def set_pod_label(client: KubeClient, namespace: str, name: str, key: str, value: str | None) -> JSONDict:
    """Set (``value``, which may be ``""``) or remove (``None``) one label of a Pod with a JSON merge patch.

    :raises errors.KubeNotFoundError: the Pod does not exist.
    :raises errors.KubeAPIError: any other failure, after retries.
    """
    return client.call(f"PATCH pods {namespace}/{name} label {key}", client.core.patch_namespaced_pod, name,
                       namespace, {"metadata": {"labels": {key: value}}},
                       _content_type="application/merge-patch+json")


def pod_ready(pod: Mapping[str, Any] | None) -> bool:
    """Whether the Pod's ``status.conditions`` has ``Ready`` = ``True`` (a missing Pod is not ready)."""
    if not pod:
        return False
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False
