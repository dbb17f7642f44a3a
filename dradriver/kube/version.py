"""The API server's version (``GET /version``): decides which ResourceSlice features may be used."""

from __future__ import annotations

import re

import kubernetes

from dradriver.kube.client import KubeClient

_MINOR = re.compile(r"^(\d+)")


def server_version(client: KubeClient) -> tuple[int, int]:
    """``(major, minor)`` of the API server, e.g. ``(1, 34)``; a minor like ``"34+"`` counts as 34.

    :raises dradriver.kube.errors.KubeAPIError: the request failed after retries.
    """
    api = kubernetes.client.VersionApi(client.api_client)
    info = client.call("GET /version", api.get_code)
    major = _MINOR.match(str(info.get("major", "0")))
    minor = _MINOR.match(str(info.get("minor", "0")))
    return (int(major.group(1)) if major else 0, int(minor.group(1)) if minor else 0)
