"""What the stored claims hold, as the plugin's metrics read it, kept per claim: updated by the claims a batch
changed, so that a one-claim prepare or unprepare costs the same whatever the number of claims held.

The views are a function of the claim state (:class:`~dradriver.host.claimstate.ClaimState`) and of the device
kinds now: :meth:`ClaimViews.rebuild` computes them from every record (at start, and when the claim state says any
record may have changed: :meth:`~dradriver.host.claimstate.ClaimState.take_changes` ``None``, another instance's
records), :meth:`ClaimViews.update` replaces one claim's part. Either way the result is the same
(``tests/kubeletplugin/test_claimviews.py`` compares them after prepares, failures, unprepares, adoptions and
another instance's changes):

* **prepared claims**: the records less those holding nothing while PREPARE_STARTED (an aborted-prepare mark, an
  undo kept while the driver is away, a claim recorded but not planned yet);
* **devices by type**: every device entry of every record, counted under its preparer's kind now (``unknown``
  for a device no preparer handles or the registry does not have);
* **prepared devices**: DRA device name -> ``(namespace, name)`` of every PREPARE_COMPLETED claim holding it, each
  owner once, sorted (several with admin access or shares).

Cost: :meth:`~ClaimViews.update` is O(devices of the claim); :meth:`~ClaimViews.counts` O(distinct devices held),
which the node's devices bound, not its claims; :meth:`~ClaimViews.prepared_devices` rebuilds only the devices
whose owners changed since its last call (a metrics scrape, off the prepare path).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dradriver.host.claimstate import ClaimPhase, ClaimRecord

__all__ = ["ClaimViews", "Owner", "PreparedDevices"]

Owner = tuple[str, str]
"""A claim's ``(namespace, name)``."""

PreparedDevices = dict[str, tuple[Owner, ...]]
"""DRA device name -> the owners of the completed claims holding it, sorted."""


@dataclass(frozen=True, slots=True)
class _Part:
    """One claim's part of the views."""

    prepared: bool  # counted as a prepared claim
    devices: tuple[str, ...]  # every device entry of the record, in record order
    owner: Owner | None  # set when the record is PREPARE_COMPLETED


def _part_of(record: ClaimRecord) -> _Part:
    completed = record.phase is ClaimPhase.PREPARE_COMPLETED
    return _Part(prepared=bool(record.devices) or record.phase is not ClaimPhase.PREPARE_STARTED,
                 devices=tuple(d.device for d in record.devices),
                 owner=(record.namespace, record.name) if completed else None)


class ClaimViews:
    """The views of the claims held (see the module docstring). Thread-safe: the runner updates them under its
    lock; :meth:`prepared_devices` may be called from any thread and never waits on the claim state.

    :param kind_of: DRA device name -> the kind of the preparer that handles it now (``"unknown"`` when none).
    """

    def __init__(self, kind_of: Callable[[str], str]) -> None:
        self._kind_of = kind_of
        self._lock = threading.Lock()
        self._parts: dict[str, _Part] = {}
        self._prepared = 0
        self._held: dict[str, int] = {}  # device -> device entries of every record naming it
        self._owners: dict[str, dict[Owner, int]] = {}  # device -> owner -> completed claims of that owner
        self._dirty: set[str] = set()  # devices whose owners changed since the last prepared_devices()
        self._published: PreparedDevices = {}

    def rebuild(self, records: Iterable[ClaimRecord]) -> None:
        """Replace the views with those of ``records`` (every stored claim). O(records)."""
        with self._lock:
            self._dirty.update(self._published)
            self._parts, self._prepared, self._held, self._owners = {}, 0, {}, {}
            for record in records:
                self._add(record.uid, _part_of(record))
            self._dirty.update(self._owners)

    def update(self, uid: str, record: ClaimRecord | None) -> None:
        """Replace claim ``uid``'s part with ``record``'s (``None``: the claim is no longer stored)."""
        part = None if record is None else _part_of(record)
        with self._lock:
            old = self._parts.pop(uid, None)
            if old is not None:
                self._remove(old)
            if part is not None:
                self._add(uid, part)

    def counts(self) -> tuple[int, dict[str, int]]:
        """``(prepared claims, devices by type)`` as :meth:`~dradriver.domain.ports.RequestMetrics.set_prepared`
        takes them; types are the preparers' kinds now."""
        with self._lock:
            held = list(self._held.items())
            prepared = self._prepared
        by_type: dict[str, int] = {}
        for device, n in held:
            kind = self._kind_of(device)
            by_type[kind] = by_type.get(kind, 0) + n
        return prepared, by_type

    def prepared_devices(self) -> PreparedDevices:
        """DRA device name -> the owners of every completed claim holding it, sorted. The mapping returned is never
        changed afterwards (a later change publishes a new one)."""
        with self._lock:
            if self._dirty:
                published = dict(self._published)
                for device in self._dirty:
                    owners = self._owners.get(device)
                    if owners:
                        published[device] = tuple(sorted(owners))
                    else:
                        published.pop(device, None)
                self._published = published
                self._dirty.clear()
            return self._published

    # ---- the part of one claim (caller holds the lock) -------------------------------------------------------
    def _add(self, uid: str, part: _Part) -> None:
        self._parts[uid] = part
        self._prepared += part.prepared
        for device in part.devices:
            self._held[device] = self._held.get(device, 0) + 1
        if part.owner is not None:
            for device in dict.fromkeys(part.devices):
                owners = self._owners.setdefault(device, {})
                owners[part.owner] = owners.get(part.owner, 0) + 1
                self._dirty.add(device)

    def _remove(self, part: _Part) -> None:
        self._prepared -= part.prepared
        for device in part.devices:
            left = self._held[device] - 1
            if left:
                self._held[device] = left
            else:
                del self._held[device]
        if part.owner is not None:
            for device in dict.fromkeys(part.devices):
                owners = self._owners[device]
                left = owners[part.owner] - 1
                if left:
                    owners[part.owner] = left
                else:
                    del owners[part.owner]
                    if not owners:
                        del self._owners[device]
                self._dirty.add(device)
