"""The device registry: this node's devices, owned in one place, and who to tell when they change.

A kubelet plugin's devices are a snapshot (for the GPU plugin a
:class:`~dradriver.domain.devices.NodeInventory`) plus a by-name index of the devices it publishes (DRA device
name -> device). The batch runner looks devices up here on every claim; the health monitor, the ResourceSlice
publication and the metrics subscribe and are told when the snapshot is replaced (dynamic MIG creating and
destroying devices, a GPU falling off the bus), instead of each keeping a frozen copy.

Thread-safe: readers get an immutable snapshot; :meth:`DeviceRegistry.replace` swaps it under a lock and calls
the subscribers in subscription order, outside the lock, on the caller's thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

S = TypeVar("S")

log = logging.getLogger(__name__)

Subscriber = Callable[[S], None]
"""Called with the new snapshot after :meth:`DeviceRegistry.replace`."""


class DeviceRegistry(Generic[S]):
    """The devices of one kubelet plugin.

    :param snapshot: the devices as discovered (any immutable object, e.g. a ``NodeInventory``).
    :param index: snapshot -> DRA device name -> device, for the devices the plugin publishes and prepares.
    """

    def __init__(self, snapshot: S, index: Callable[[S], Mapping[str, object]]) -> None:
        self._index_of = index
        self._lock = threading.Lock()
        self._snapshot = snapshot
        self._by_name: Mapping[str, object] = dict(index(snapshot))
        self._subscribers: list[Callable[[S], None]] = []
        self.generation = 1
        """Incremented by every :meth:`replace`."""

    @property
    def snapshot(self) -> S:
        """The current snapshot (never mutated; replaced whole)."""
        return self._snapshot

    @property
    def devices(self) -> Mapping[str, object]:
        """DRA device name -> device, for the current snapshot (replaced whole, never mutated)."""
        return self._by_name

    def get(self, name: str) -> object | None:
        """The device named ``name`` in the current snapshot, or ``None``."""
        return self._by_name.get(name)

    def subscribe(self, subscriber: Callable[[S], None]) -> Callable[[], None]:
        """Call ``subscriber(snapshot)`` after every :meth:`replace`; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            with self._lock:
                if subscriber in self._subscribers:
                    self._subscribers.remove(subscriber)

        return unsubscribe

    def replace(self, snapshot: S) -> None:
        """Make ``snapshot`` current and tell every subscriber.

        A subscriber that raises is logged and does not keep the others from being told.
        """
        by_name = dict(self._index_of(snapshot))
        with self._lock:
            self._snapshot, self._by_name = snapshot, by_name
            self.generation += 1
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            try:
                subscriber(snapshot)
            except Exception:
                log.exception("device registry subscriber %r failed", subscriber)
