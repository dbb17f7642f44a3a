"""URL paths: resource routes (``/api/v1/namespaces/<ns>/<plural>/<name>/status``), discovery documents,
``/version`` and the health endpoints."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver.sandbox.apiserver.errors import JSONDict
from dradriver.sandbox.apiserver.resources import ResourceType


def _schemas_version() -> tuple[str, str, str]:
    """``(major, minor, patch)`` of the Kubernetes release whose OpenAPI schemas the emulator serves
    (``openapi-schemas.json``, ``kubernetesVersion``): ``/version`` answers as that release, so a client that
    picks features by the server's version (kubectl, the plugin's slice layout) sees the API it validates against."""
    text = Path(__file__).with_name("openapi-schemas.json").read_text()[:200]  # the head line holds the version
    major, minor, patch = json.loads(text.split("\n", 1)[0].rstrip(",") + "}")["kubernetesVersion"].split(".")
    return major, minor, patch


_MAJOR, _MINOR, _PATCH = _schemas_version()
SERVER_VERSION: JSONDict = {
    "major": _MAJOR,
    "minor": _MINOR,
    "gitVersion": f"v{_MAJOR}.{_MINOR}.{_PATCH}-dradriver-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-08-27T00:00:00Z",
    "goVersion": "go1.24.6",
    "compiler": "gc",
    "platform": "linux/amd64",
}
HEALTH_PATHS = ("/healthz", "/livez", "/readyz")
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(slots=True)
class Route:
    """A resource path: collection (``name`` None), object, or its ``status`` subresource."""

    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def resolve(types: Sequence[ResourceType], path: str, server_address: str) -> Route | JSONDict | str | None:
    """A resource route, a discovery document, ``"ok"`` for a health path, or None (404)."""
    parts = [p for p in path.split("/") if p]
    if path in HEALTH_PATHS:
        return "ok"
    if parts == ["version"]:
        return SERVER_VERSION
    if parts == ["api"]:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
        }
    if parts == ["apis"]:
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_doc(types, g) for g in groups(types)]}
    if parts and parts[0] == "apis" and len(parts) == 2:
        return group_doc(types, parts[1]) if parts[1] in groups(types) else None
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    in_version = [t for t in types if t.group == group and t.version == version]
    if not in_version:
        return None
    if not rest:
        return resource_list_doc(group, version, in_version)
    by_plural = {t.plural: t for t in in_version}
    ns: str | None = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in by_plural and by_plural[rest[2]].namespaced:
        ns, rest = rest[1], rest[2:]
    rt = by_plural.get(rest[0])
    if rt is None or len(rest) > 3:
        return None
    name = rest[1] if len(rest) >= 2 else None
    sub = rest[2] if len(rest) == 3 else None
    if sub is not None and not (sub == "status" and rt.status):
        return None
    if rt.namespaced and ns is None and name is not None:
        return None
    return Route(rt, ns, name, sub)


def groups(types: Sequence[ResourceType]) -> list[str]:
    """The named API groups served, sorted."""
    return sorted({t.group for t in types if t.group})


def group_doc(types: Sequence[ResourceType], group: str) -> JSONDict:
    """``APIGroup`` for ``/apis/<group>``."""
    versions = sorted({t.version for t in types if t.group == group})
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": gvs, "preferredVersion": gvs[0]}


def resource_list_doc(group: str, version: str, types: Sequence[ResourceType]) -> JSONDict:
    """``APIResourceList`` for ``/api/v1`` or ``/apis/<group>/<version>``."""
    resources: list[JSONDict] = []
    for t in types:
        resources.append(
            {
                "name": t.plural,
                "singularName": t.singular,
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": list(_VERBS),
                **({"shortNames": list(t.short_names)} if t.short_names else {}),
            }
        )
        if t.status:
            resources.append(
                {
                    "name": f"{t.plural}/status",
                    "singularName": "",
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }
