"""Check the API client's configuration before anything touches the host (no Kubernetes client imported).

A kubelet plugin creates sockets, directories and files on the node at start. A kubeconfig that cannot work is
found first, by :func:`check_kubeconfig`: the file is read and parsed as YAML (the Kubernetes client library
does the same with ``yaml.safe_load``), its ``current-context`` must name a context whose cluster and user exist;
without a kubeconfig the in-cluster configuration needs ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the service
account token (Kubernetes docs, "Accessing the Kubernetes API from a Pod"). The client library's full load
(:func:`dradriver.kube.client.open_client`) still runs afterwards; this catches what fails without a network.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import yaml

from dradriver.kube import errors

KUBECONFIG_HINT = "pass the cluster's kubeconfig with --kubeconfig or KUBECONFIG"
"""The advice every kubeconfig or connection failure at start-up ends with."""

TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
"""The service account token of the in-cluster configuration."""


def config_error(kubeconfig: str, exc: BaseException | str) -> errors.KubeAPIError:
    """The one-line error for a configuration that cannot be loaded: names the file (or the in-cluster service
    account) and ends with :data:`KUBECONFIG_HINT`."""
    source = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"
    if isinstance(exc, OSError) and exc.strerror:
        message = f"cannot read it: {exc.strerror}"
    else:
        kind = "invalid YAML: " if isinstance(exc, yaml.YAMLError) else ""
        message = kind + " ".join(str(exc).split())
    return errors.KubeAPIError(f"load {source}", reason="ConfigInvalid", message=f"{message}; {KUBECONFIG_HINT}")


def _named(doc: dict[str, Any], key: str, name: object) -> bool:
    entries = doc.get(key)
    return isinstance(entries, list) and any(isinstance(e, dict) and e.get("name") == name for e in entries)


def check_kubeconfig(kubeconfig: str) -> None:
    """Refuse a configuration that cannot work, without a network call.

    :param kubeconfig: the file (``--kubeconfig``/``KUBECONFIG``); empty: the in-cluster configuration.
    :raises errors.KubeAPIError: reason ``ConfigInvalid``; the message is one line (:func:`config_error`).
    """
    if not kubeconfig:
        if not os.environ.get("KUBERNETES_SERVICE_HOST") or not os.environ.get("KUBERNETES_SERVICE_PORT"):
            raise config_error("", "Service host/port is not set (not running in a Pod)")
        if not os.path.isfile(TOKEN_FILE):
            raise config_error("", f"Service token file {TOKEN_FILE} does not exist")
        return
    try:
        if not os.path.exists(kubeconfig):  # worded as the full load words it (dradriver.kube.client)
            raise FileNotFoundError(errno.ENOENT, "no such file", kubeconfig)
        with open(kubeconfig, "rb") as fh:
            text = fh.read()
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError) as exc:
        raise config_error(kubeconfig, exc) from exc
    if not isinstance(doc, dict):
        raise config_error(kubeconfig, "not a kubeconfig (the document is not a mapping)")
    current = doc.get("current-context")
    if not current:
        raise config_error(kubeconfig, "no current-context")
    contexts = [c for c in doc.get("contexts") or () if isinstance(c, dict) and c.get("name") == current]
    if not contexts or not isinstance(contexts[0].get("context"), dict):
        raise config_error(kubeconfig, f"current-context {current!r} names no context")
    context = contexts[0]["context"]
    if not _named(doc, "clusters", context.get("cluster")):
        raise config_error(kubeconfig, f"context {current!r} names cluster {context.get('cluster')!r}, which is "
                                       "not in the file")
    if context.get("user") and not _named(doc, "users", context.get("user")):
        raise config_error(kubeconfig, f"context {current!r} names user {context.get('user')!r}, which is not in "
                                       "the file")
