"""Recording core ``v1`` Events about objects (claim state found corrupt, device-plugin conflict, ...).

Events are best-effort notices for ``kubectl describe``; callers usually log and carry on when recording
fails. The shape follows what client-go's event recorder writes: name ``<object>.<hex nanoseconds>``,
``involvedObject``, ``reason`` (UpperCamelCase), ``message``, ``type`` (``Normal`` or ``Warning``),
``source.component``/``host``, ``firstTimestamp``/``lastTimestamp``, ``count``. Events about a
cluster-scoped object (a Node) go to the ``default`` namespace, as the kubelet's do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from dradriver.kube.client import JSONDict, KubeClient
from dradriver.kube.errors import truncate

#: ``message`` limit the API server enforces for core Events (bytes; ASCII assumed).
MAX_EVENT_MESSAGE = 1024


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an Event is about (``involvedObject``)."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"


def node_ref(name: str, uid: str = "") -> ObjectRef:
    """Reference to a Node (kubectl shows the event under ``kubectl describe node <name>``)."""
    return ObjectRef(kind="Node", name=name, uid=uid or name, api_version="v1")


def create_event(client: KubeClient, about: ObjectRef, *, reason: str, message: str, type_: str = "Warning",
                 component: str = "dradriver", host: str = "") -> JSONDict:
    """``POST /api/v1/namespaces/<ns>/events``; returns the created Event.

    :param reason: short UpperCamelCase reason, e.g. ``ClaimStateCorrupt``.
    :param message: human-readable text, truncated to :data:`MAX_EVENT_MESSAGE` characters.
    :param type_: ``Normal`` or ``Warning``.
    :raises ValueError: ``type_`` is neither.
    :raises dradriver.kube.errors.KubeAPIError: the Event could not be written.
    """
    if type_ not in ("Normal", "Warning"):
        raise ValueError(f"event type must be Normal or Warning, not {type_!r}")
    namespace = about.namespace or "default"
    now = datetime.now(tz=UTC)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    involved: JSONDict = {"apiVersion": about.api_version, "kind": about.kind, "name": about.name}
    if about.namespace:
        involved["namespace"] = about.namespace
    if about.uid:
        involved["uid"] = about.uid
    source: JSONDict = {"component": component}
    if host:
        source["host"] = host
    body: JSONDict = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{about.name}.{time.time_ns():x}", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": truncate(message, MAX_EVENT_MESSAGE),
        "type": type_,
        "source": source,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "reportingComponent": component,
        "reportingInstance": host or component,
    }
    return client.call(f"POST events {namespace}/{about.kind}/{about.name}", client.core.create_namespaced_event,
                       namespace, body)
