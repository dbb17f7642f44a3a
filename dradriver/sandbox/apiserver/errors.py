"""``Status`` errors: the exception the emulator answers with and the constructors for the usual reasons."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dradriver.sandbox.apiserver.resources import ResourceType

JSONDict = dict[str, Any]
# (reason, field, message), e.g. ("FieldValueRequired", "spec.driver", "Required value")
Cause = tuple[str, str, str]

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Gone",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiStatusError(Exception):
    """An error the emulator answers with a ``Status`` object (also raised by the in-process helpers)."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: JSONDict | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = dict(headers or {})

    def status(self) -> JSONDict:
        """The ``Status`` object, shaped as ``kube-apiserver`` writes it."""
        body: JSONDict = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def details_of(rt: ResourceType, name: str) -> JSONDict:
    """``Status.details`` as the server writes it (``group`` omitted for the core group)."""
    return {"name": name, **({"group": rt.group} if rt.group else {}), "kind": rt.plural}


def not_found(rt: ResourceType, name: str) -> ApiStatusError:
    return ApiStatusError(404, "NotFound", f'{rt.group_resource} "{name}" not found', details=details_of(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiStatusError:
    return ApiStatusError(
        409, "AlreadyExists", f'{rt.group_resource} "{name}" already exists', details=details_of(rt, name)
    )


def conflict(rt: ResourceType, name: str, why: str) -> ApiStatusError:
    return ApiStatusError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {why}',
        details=details_of(rt, name),
    )


def invalid(group: str, kind: str, name: str, causes: list[Cause]) -> ApiStatusError:
    """422 ``Invalid`` for ``<kind>.<group> "<name>"``; each cause is ``(reason, field, message)``."""
    text = ", ".join(f"{fld}: {msg}" for _, fld, msg in causes)
    group_kind = f"{kind}.{group}" if group else kind
    return ApiStatusError(
        422,
        "Invalid",
        f'{group_kind} "{name}" is invalid: {text}',
        details={
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": r, "message": m, "field": f} for r, f, m in causes],
        },
    )


def bad_request(message: str) -> ApiStatusError:
    return ApiStatusError(400, "BadRequest", message)


def method_not_allowed() -> ApiStatusError:
    return ApiStatusError(
        405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
    )
