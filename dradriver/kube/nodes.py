"""Reading this node's Node object (core ``v1``): UID for ResourceSlice owner references, allocatable, labels."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from dradriver.kube.client import JSONDict, KubeClient
from dradriver.kube.errors import KubeGoneError


@dataclass(frozen=True, slots=True)
class Node:
    """The fields of a Node the driver uses.

    :param allocatable: ``status.allocatable``, resource name -> quantity string (e.g. ``nvidia.com/gpu``:
        ``"8"`` when the NVIDIA device plugin also runs on the node).
    :param raw: the whole object as the API returned it.
    """

    name: str
    uid: str
    allocatable: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Node:
        """Build from the API's JSON (``metadata.name``, ``metadata.uid``, ``status.allocatable``)."""
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            allocatable={str(k): str(v) for k, v in (status.get("allocatable") or {}).items()},
            labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
            raw=obj,
        )


def get_node(client: KubeClient, name: str) -> Node:
    """``GET /api/v1/nodes/<name>``.

    :raises dradriver.kube.errors.KubeNotFoundError: no Node of that name (wrong ``--node-name``?).
    :raises dradriver.kube.errors.KubeAPIError: any other failure, after retries.
    """
    # raw: the only CoreV1Api call at start-up, and that class is the client's largest import
    obj: JSONDict = client.call(f"GET nodes {name}", client.raw("GET", f"/api/v1/nodes/{quote(name, safe='')}"))
    return Node.from_object(obj)


def watch_node(client: KubeClient, name: str, resource_version: str, timeout_s: float) -> Iterator[JSONDict]:
    """Watch the Node ``name`` (``fieldSelector=metadata.name=<name>``) from ``resource_version`` (``""``: its
    current state first, as an ``ADDED`` event); yields watch events (``type``, ``object``) until the server ends
    the watch (after ``timeout_s``). RBAC: ``watch`` on ``nodes``.

    :raises dradriver.kube.errors.KubeGoneError: the server ended the watch with an ``ERROR`` event (410
        ``Expired``): watch again from ``""``.
    :raises dradriver.kube.errors.KubeAPIError: opening or reading failed.
    """
    what = f"WATCH nodes {name}"
    options: dict[str, Any] = {"field_selector": f"metadata.name={name}"}
    if resource_version:
        options["resource_version"] = resource_version
    for event in client.stream(what, client.raw("GET", "/api/v1/nodes"), timeout_s=timeout_s, **options):
        if event.get("type") == "ERROR":
            status = event.get("object") or {}
            raise KubeGoneError(what, reason=str(status.get("reason") or "Expired"),
                                message=str(status.get("message") or ""))
        yield event
