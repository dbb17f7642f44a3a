"""A first-come, first-served lock: threads acquire it in the order they asked.

``threading.Lock`` makes no promise about who gets a released lock; a thread that releases and re-acquires at
once (a large batch working chunk by chunk) can starve the others. With :class:`FairLock` a one-claim prepare
waiting behind a 10,000-claim batch gets the lock at the batch's next chunk boundary.
"""

from __future__ import annotations

import collections
import threading
from types import TracebackType


class FairLock:
    """A non-reentrant mutual-exclusion lock granted in FIFO order (a ticket lock)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[object] = collections.deque()
        self._held = False

    def acquire(self) -> None:
        """Block until every earlier caller has had the lock and released it."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            while self._held or self._queue[0] is not ticket:
                self._cond.wait()
            self._queue.popleft()
            self._held = True

    def release(self) -> None:
        """Hand the lock to the longest waiter.

        :raises RuntimeError: the lock is not held.
        """
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an unlocked FairLock")
            self._held = False
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
