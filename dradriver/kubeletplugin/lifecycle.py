"""One lifecycle for a running kubelet plugin: an ordered list of start steps, stopped in reverse.

Each :meth:`Lifecycle.step` runs a start function and records how to stop what it started; :meth:`Lifecycle.stop`
runs the stop functions newest first, best effort (one failing stop is logged and does not keep the others from
running), once. A start that raises stops everything started before it, so a failed start leaves nothing
running (the ``async with`` form does that too).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar, overload

T = TypeVar("T")

log = logging.getLogger(__name__)

Stop = Callable[[], Any]
"""A stop function; may return an awaitable, which is awaited."""


async def _call(function: Callable[[], Any]) -> Any:
    result = function()
    if asyncio.iscoroutine(result):  # a Task a step returns is its running value, not awaited here
        result = await result
    return result


class Lifecycle:
    """Start steps in order; stop them in reverse.

    :param name: for log lines (e.g. the driver name).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._stops: list[tuple[str, Stop]] = []
        self._stopped = False
        self.started: list[str] = []
        """Names of the steps that started, in order."""
        self.grace_s = 5.0
        """How long stop functions may let in-flight work finish (seconds); set by :meth:`stop`."""

    @overload
    async def step(self, name: str, start: Callable[[], Awaitable[T]], stop: Callable[[T], Any] | None = None) -> T:
        ...

    @overload
    async def step(self, name: str, start: Callable[[], T], stop: Callable[[T], Any] | None = None) -> T:
        ...

    async def step(self, name: str, start: Callable[[], Any], stop: Callable[[Any], Any] | None = None) -> Any:
        """Run ``start()`` (awaited when it returns an awaitable), then remember ``stop(result)`` for :meth:`stop`.

        :raises Exception: whatever ``start`` raised, after stopping every earlier step.
        """
        if self._stopped:
            raise RuntimeError(f"{self.name}: lifecycle already stopped; cannot start {name}")
        try:
            value = await _call(start)
        except BaseException:
            log.debug("%s: start step %s failed; stopping %d earlier step(s)", self.name, name, len(self._stops))
            await self.stop()
            raise
        if stop is not None:
            self._stops.append((name, lambda: stop(value)))
        self.started.append(name)
        return value

    def on_stop(self, name: str, stop: Stop) -> None:
        """Add a stop function without a start step (e.g. for a resource opened synchronously)."""
        self._stops.append((name, stop))

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop every started step, newest first, best effort; idempotent.

        :param grace_s: sets :attr:`grace_s` for the stop functions (seconds).
        """
        if self._stopped:
            return
        self._stopped = True
        if grace_s is not None:
            self.grace_s = grace_s
        while self._stops:
            name, stop = self._stops.pop()
            try:
                await _call(stop)
            except Exception:
                log.exception("%s: stopping the %s failed", self.name, name)

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` ran."""
        return self._stopped

    async def __aenter__(self) -> Lifecycle:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc_type is not None:
            await self.stop()
