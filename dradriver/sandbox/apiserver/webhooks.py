"""Validating admission webhooks, called as ``kube-apiserver`` calls them (``admissionregistration.k8s.io/v1``).

For every create and update over HTTP (not in-process seeding), after the emulator's own validation, each stored
ValidatingWebhookConfiguration's webhooks whose ``rules`` match the write (operation, API group, version,
resource; ``*`` wildcards) get an ``admission.k8s.io/v1`` AdmissionReview POSTed over HTTPS, verified with the
webhook's ``clientConfig.caBundle``:

* ``clientConfig.url``, or ``clientConfig.service`` (``namespace``, ``name``, ``port`` 443, ``path``): the
  emulator runs no Services, so a service is reached at the address a test registers with
  :meth:`~dradriver.sandbox.apiserver.emulator.ApiServerEmulator.route_service`, with the server name
  ``<name>.<namespace>.svc`` checked against the certificate as the API server checks it;
* ``timeoutSeconds`` (default 10) per call; a call that fails (connection, TLS, HTTP status, unreadable answer)
  refuses the write with 500 ``InternalError`` ``failed calling webhook "<name>": ...`` when ``failurePolicy`` is
  ``Fail`` (the default) and is skipped when it is ``Ignore``;
* a refusal becomes the API server's error (``ToStatusErr`` in ``k8s.io/apiserver/.../webhook/errors``): the
  webhook's status code when it is 400 or more, else 400; its reason; the message ``admission webhook "<name>"
  denied the request: <message>``.

The call is made while the write holds the emulator's storage lock, so writes are admitted one at a time and a
webhook must not call the emulator back (it would wait for the lock until its own timeout).

Not evaluated: ``namespaceSelector``, ``objectSelector``, ``matchConditions``, ``matchPolicy`` (the emulator
serves one version per resource), ``scope``. The ValidatingWebhookConfiguration objects themselves are never
sent to webhooks, as in the API server.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import uuid
from collections.abc import Mapping
from typing import Any

from dradriver.sandbox.apiserver.errors import ApiStatusError, JSONDict
from dradriver.sandbox.apiserver.resources import ResourceType

CONFIG_GROUP = "admissionregistration.k8s.io"
CONFIG_KIND = "ValidatingWebhookConfiguration"
DEFAULT_TIMEOUT_S = 10

#: ``(namespace, name)`` of a Service -> ``(host, port)`` where its webhook listens (set by tests).
ServiceRoutes = dict[tuple[str, str], tuple[str, int]]


def _matches(values: object, wanted: str) -> bool:
    return isinstance(values, list) and ("*" in values or wanted in values)


def matching_webhooks(configs: list[JSONDict], rt: ResourceType, operation: str) -> list[JSONDict]:
    """The webhooks of ``configs`` whose ``rules`` select ``operation`` on resource ``rt``, in order."""
    found: list[JSONDict] = []
    for config in configs:
        for webhook in config.get("webhooks") or []:
            for rule in webhook.get("rules") or []:
                if (_matches(rule.get("operations"), operation) and _matches(rule.get("apiGroups"), rt.group)
                        and _matches(rule.get("apiVersions"), rt.version)
                        and _matches(rule.get("resources"), rt.plural)):
                    found.append(webhook)
                    break
    return found


def review_for(rt: ResourceType, operation: str, obj: JSONDict, old: JSONDict | None) -> JSONDict:
    """The AdmissionReview the API server sends for a write of ``obj`` (``old`` on update)."""
    meta = obj.get("metadata") or {}
    gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
    gvr = {"group": rt.group, "version": rt.version, "resource": rt.plural}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()), "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "name": meta.get("name", ""), "namespace": meta.get("namespace", ""), "operation": operation,
            "userInfo": {"username": "system:admin", "groups": ["system:masters", "system:authenticated"]},
            "object": obj, "oldObject": old, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1",
                        "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"},
        },
    }


def _endpoint(client: Mapping[str, Any], routes: ServiceRoutes) -> tuple[str, int, str, str]:
    """``(host, port, path, TLS server name)`` of a webhook's ``clientConfig``."""
    from urllib.parse import urlsplit

    if client.get("url"):
        url = urlsplit(str(client["url"]))
        if url.scheme != "https" or not url.hostname:
            raise ValueError(f"clientConfig.url {client['url']!r} is not an https URL")
        return url.hostname, url.port or 443, url.path or "/", url.hostname
    service = client.get("service") or {}
    namespace, name = str(service.get("namespace", "")), str(service.get("name", ""))
    if (namespace, name) not in routes:
        raise ValueError(f'service "{name}" not found in namespace "{namespace}" (no route registered)')
    host, port = routes[(namespace, name)]
    return host, port, str(service.get("path") or "/"), f"{name}.{namespace}.svc"


def call_webhook(webhook: Mapping[str, Any], review: JSONDict, routes: ServiceRoutes) -> JSONDict:
    """POST ``review`` to ``webhook`` and return the response AdmissionReview's ``response``.

    :raises OSError, ssl.SSLError, ValueError: the call failed or its answer is no AdmissionReview response.
    """
    client = webhook.get("clientConfig") or {}
    host, port, path, server_name = _endpoint(client, routes)
    context = ssl.create_default_context()
    if client.get("caBundle"):
        context = ssl.create_default_context(cadata=base64.b64decode(client["caBundle"]).decode())
    timeout = float(webhook.get("timeoutSeconds") or DEFAULT_TIMEOUT_S)
    connection = _NamedHTTPSConnection(host, port, server_name, context, timeout)
    try:
        connection.request("POST", path, json.dumps(review).encode(),
                           {"Content-Type": "application/json", "Accept": "application/json"})
        answer = connection.getresponse()
        body = answer.read()
    finally:
        connection.close()
    if answer.status != 200:
        raise ValueError(f"expected response code 200, got {answer.status}: {body.decode(errors='replace')[:300]}")
    decoded = json.loads(body)
    response = decoded.get("response") if isinstance(decoded, dict) else None
    if not isinstance(response, dict) or response.get("uid") != review["request"]["uid"]:
        raise ValueError("the webhook's answer is no AdmissionReview response for this request's uid")
    return response


class _NamedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to an address, with another name sent as SNI and checked against the certificate (a Service's
    ``<name>.<namespace>.svc`` reached at a routed address)."""

    def __init__(self, host: str, port: int, server_name: str, context: ssl.SSLContext, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.server_name = server_name
        self.tls = context

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self.tls.wrap_socket(self.sock, server_hostname=self.server_name)


def run_validating_webhooks(configs: list[JSONDict], rt: ResourceType, operation: str, obj: JSONDict,
                            old: JSONDict | None, routes: ServiceRoutes) -> None:
    """Call every matching webhook (module docstring); the first refusal or failed ``Fail`` call ends the write.

    :raises ApiStatusError: a webhook denied the write (its code, at least 400), or a call with failure policy
        ``Fail`` did not succeed (500 ``InternalError``).
    """
    if rt.group == CONFIG_GROUP:
        return
    for webhook in matching_webhooks(configs, rt, operation):
        name = str(webhook.get("name", ""))
        if "v1" not in (webhook.get("admissionReviewVersions") or []):
            raise ApiStatusError(500, "InternalError", f'failed calling webhook "{name}": the emulator sends '
                                 "admission.k8s.io/v1 reviews only and admissionReviewVersions does not list v1")
        try:
            response = call_webhook(webhook, review_for(rt, operation, obj, old), routes)
        except (OSError, ssl.SSLError, ValueError) as exc:
            if webhook.get("failurePolicy", "Fail") == "Ignore":
                continue
            raise ApiStatusError(500, "InternalError",
                                 f'Internal error occurred: failed calling webhook "{name}": failed to call '
                                 f"webhook: {exc}") from None
        if response.get("allowed") is True:
            continue
        status = response.get("status") or {}
        code = int(status.get("code") or 0)
        denied = f'admission webhook "{name}" denied the request'
        if status.get("message"):
            message = f"{denied}: {status['message']}"
        elif status.get("reason"):
            message = f"{denied}: {status['reason']}"
        else:
            message = f"{denied} without explanation"
        raise ApiStatusError(code if code >= 400 else 400, str(status.get("reason") or ""), message,
                             details=status.get("details"))
