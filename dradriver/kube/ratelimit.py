"""Client-side rate limiting of API requests: client-go's token bucket behind ``--kube-api-qps``/``--kube-api-burst``.

NVIDIA's binaries pass both flags to client-go's ``rest.Config`` (``cmd/*/main.go``, ``pkg/flags/
kubeclient.go``), whose rules :func:`rate_limiter` follows: a negative QPS means no client-side limit, 0 means
client-go's default 5, a burst of 0 client-go's default 10. The bucket starts full (``burst`` requests go at
once), then refills at ``qps`` tokens per second; a request that finds it empty waits for its token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: client-go's ``rest.DefaultQPS`` and ``rest.DefaultBurst``.
DEFAULT_QPS = 5.0
DEFAULT_BURST = 10


class RateLimitTimeout(Exception):
    """A request's turn under the client-side rate limit comes after its deadline (:meth:`TokenBucket.wait`)."""


class TokenBucket:
    """A thread-safe token bucket; :meth:`wait` blocks until the caller's request may go.

    :param qps: tokens added per second (> 0).
    :param burst: bucket size, the most requests sent back to back (> 0).
    :param clock: a monotonic clock in seconds (tests pass a fake one).
    :param sleep: the sleep function.
    :raises ValueError: ``qps`` or ``burst`` not positive.
    """

    def __init__(self, qps: float, burst: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if qps <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs qps > 0 and burst > 0, not {qps} and {burst}")
        self.qps = qps
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._last = clock()

    def reserve(self) -> float:
        """Take one token now and return the seconds the caller must wait before using it (0 when one was free).

        Tokens may go negative: later callers queue behind earlier reservations, in order.
        """
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def wait(self, timeout_s: float | None = None) -> float:
        """Block until one request may be sent; returns the seconds waited.

        :param timeout_s: the longest the caller may wait, seconds (``None``: no limit). When its turn comes later
            than that, the token is handed back at once and nothing is waited (as client-go's limiter refuses a
            wait that would pass its context's deadline).
        :raises RateLimitTimeout: the turn comes after ``timeout_s``.
        """
        delay = self.reserve()
        if timeout_s is not None and delay > timeout_s:
            with self._lock:
                self._tokens += 1.0
            raise RateLimitTimeout(f"the client-side rate limit ({self.qps:g} requests/s, burst {self.burst}) "
                                   f"would hold this request {delay:.2f} s, longer than the {timeout_s:.2f} s left")
        if delay > 0:
            self._sleep(delay)
        return delay


def rate_limiter(qps: float, burst: int, **kwargs: object) -> TokenBucket | None:
    """The limiter client-go would build for ``qps`` and ``burst``, or ``None`` for no client-side limit.

    :raises ValueError: a negative ``burst``.
    """
    if burst < 0:
        raise ValueError(f"burst {burst} must not be negative")
    if qps < 0:
        return None
    return TokenBucket(qps or DEFAULT_QPS, burst or DEFAULT_BURST, **kwargs)  # type: ignore[arg-type]
