"""Errors from the Kubernetes API, keyed on the HTTP status the API server answered with.

The client library raises its own exception types (``kubernetes.client.ApiException``, urllib3 errors,
pydantic validation errors for bodies the client's models refuse). They never leave ``dradriver.kube``:
:mod:`dradriver.kube.client` turns each into one of the classes below and chains the original as
``__cause__``. Messages come from the ``Status`` object the server returned (``message``, ``reason``) and
are truncated to :data:`MAX_MESSAGE_CHARS`; a body that is not a ``Status`` is not echoed (it may be large
or hold object content), only its size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from dradriver.errors import DradriverError

#: Longest API message carried in an exception (characters); longer ones end in "...".
MAX_MESSAGE_CHARS = 512


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked with ``...`` when cut."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


class KubeAPIError(DradriverError):
    """A Kubernetes API request failed.

    :param what: the request, e.g. ``GET resourceclaims default/my-claim``.
    :param status: HTTP status code, or ``None`` when no response arrived.
    :param reason: ``Status.reason`` (``NotFound``, ``Conflict``, ...) or a short description.
    :param message: ``Status.message``, truncated.
    :param retry_after_s: the ``Retry-After`` header in seconds, when the server sent one.
    """

    #: True for failures worth retrying with backoff (overload, server errors, lost connections).
    retryable: ClassVar[bool] = False

    def __init__(self, what: str, *, status: int | None = None, reason: str = "", message: str = "",
                 retry_after_s: float | None = None) -> None:
        self.what = what
        self.status = status
        self.reason = reason
        self.message = truncate(message)
        self.retry_after_s = retry_after_s
        code = f"HTTP {status}" if status is not None else "no response"
        detail = ": ".join(p for p in (reason, self.message) if p)
        super().__init__(truncate(f"{what}: {code}" + (f" {detail}" if detail else ""), 2 * MAX_MESSAGE_CHARS))


class KubeBadRequestError(KubeAPIError):
    """400: the request was malformed (e.g. an unsupported field selector)."""


class KubeUnauthorizedError(KubeAPIError):
    """401: credentials missing or rejected."""


class KubeForbiddenError(KubeAPIError):
    """403: RBAC does not allow the request (check the ClusterRole of the plugin's service account)."""


class KubeNotFoundError(KubeAPIError):
    """404: the object (or its namespace, or the API group) does not exist."""


class KubeConflictError(KubeAPIError):
    """409: stale ``resourceVersion`` or a failed delete precondition; re-read and try again."""


class KubeAlreadyExistsError(KubeConflictError):
    """409 with reason ``AlreadyExists``: an object of that name exists."""


class KubeGoneError(KubeAPIError):
    """410: a watch or list continuation asked for a ``resourceVersion`` the server no longer has."""


class KubeUnprocessableError(KubeAPIError):
    """422: the object failed server-side validation; ``message`` names the fields."""


class KubeTooManyRequestsError(KubeAPIError):
    """429: the server (API priority and fairness) asks the client to slow down."""

    retryable = True


class KubeServerError(KubeAPIError):
    """5xx: the API server failed or is overloaded."""

    retryable = True


class KubeUnavailableError(KubeAPIError):
    """No HTTP response: connection refused or reset, DNS failure, or a timeout."""

    retryable = True


class KubeTimeoutError(KubeUnavailableError):
    """No answer within the time limit the caller gave the whole call (:meth:`~dradriver.kube.client.KubeClient.call`
    ``timeout_s``): its tries, their pauses and its rate-limit wait included. Not retried by the client (the time
    is spent); a later call may try again."""

    retryable = False

    def __init__(self, what: str, *, message: str = "") -> None:
        super().__init__(what, reason="Timeout", message=message)


class KubeRequestInvalidError(KubeAPIError):
    """The client library refused to send the request (its model rejected the body); not retried."""


_BY_STATUS: dict[int, type[KubeAPIError]] = {
    400: KubeBadRequestError,
    401: KubeUnauthorizedError,
    403: KubeForbiddenError,
    404: KubeNotFoundError,
    409: KubeConflictError,
    410: KubeGoneError,
    422: KubeUnprocessableError,
    429: KubeTooManyRequestsError,
}


def _parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    if not headers:
        return None
    for key, value in headers.items():
        if key.lower() == "retry-after":
            try:
                return max(0.0, float(value))
            except ValueError:
                return None
    return None


def error_from_response(what: str, status: int, body: bytes | str | None,
                        headers: Mapping[str, str] | None = None) -> KubeAPIError:
    """The error class for an HTTP error answer, with the ``Status`` reason and message when present."""
    reason, message = "", ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    parsed: Any = None
    if text:
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
    if isinstance(parsed, dict) and parsed.get("kind") == "Status":
        reason = str(parsed.get("reason") or "")
        message = str(parsed.get("message") or "")
    elif text:
        message = f"(response body of {len(text)} characters, not a Status object)"
    if status in _BY_STATUS:
        cls = _BY_STATUS[status]
        if status == 409 and reason == "AlreadyExists":
            cls = KubeAlreadyExistsError
    elif status >= 500:
        cls = KubeServerError
    else:
        cls = KubeAPIError
    return cls(what, status=status, reason=reason, message=message, retry_after_s=_parse_retry_after(headers))
