"""Injected faults: the next N matching requests are answered with an error status or a given raw body
instead of served, or served only after a delay (a hung API server)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dradriver.sandbox.apiserver.errors import REASONS, ApiStatusError

_MESSAGES = {
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected fault",
    503: "the server is currently unable to handle the request",
}


@dataclass(slots=True)
class Fault:
    """``remaining`` more requests matching ``method`` and ``path`` get ``status`` (0: served normally) after
    ``delay_s`` seconds.

    :param body: when set, the response body sent as is (with ``content_type``) instead of a ``Status``:
        bodies the emulator could not produce itself (e.g. an object nested deeper than ``json.dumps`` goes).
    """

    remaining: int
    status: int
    method: str | None
    path: str | re.Pattern[str] | None
    retry_after: int | None
    body: bytes | None = None
    content_type: str = "application/json"
    delay_s: float = 0.0

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method.upper() != method:
            return False
        if self.path is None:
            return True
        if isinstance(self.path, re.Pattern):
            return self.path.search(path) is not None
        return path == self.path or path.startswith(self.path.rstrip("/") + "/")

    def error(self) -> ApiStatusError:
        """The ``Status`` error the real server would send for this code (``Retry-After`` when given)."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        details = {"retryAfterSeconds": self.retry_after} if self.retry_after is not None else None
        return ApiStatusError(
            self.status,
            REASONS.get(self.status, "InternalError"),
            _MESSAGES.get(self.status, "injected fault"),
            details=details,
            headers=headers,
        )


def take_fault(faults: list[Fault], method: str, path: str) -> Fault | None:
    """Consume one use of the first matching fault; drops used-up faults when none matches."""
    for fault in faults:
        if fault.remaining > 0 and fault.matches(method, path):
            fault.remaining -= 1
            return fault
    faults[:] = [f for f in faults if f.remaining > 0]
    return None
