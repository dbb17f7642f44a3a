"""Who a device's series are attributed to, and the device set they follow (both naming modes).

The collectors of :mod:`dradriver.health.metrics` (``dradriver_*``) and :mod:`dradriver.health.dcgm`
(``DCGM_FI_*``) label each device's series with its users (:func:`holders_of`): every pod container the
kubelet's PodResources lists for it (``dradriver exporter``), else every claim the kubelet plugin prepared on
it; one series per user, as dcgm-exporter writes them for a shared GPU. Their device set is the source's current
inventory (:class:`InventoryView`), never a copy taken at start; what they read is a :class:`DeviceSource`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from dradriver.domain.devices import NodeInventory
from dradriver.domain.holders import DeviceHolder
from dradriver.domain.passthrough import VfioDevice
from dradriver.nvml.poller import Sample

ClaimLookup = Callable[[str], "Sequence[tuple[str, str]] | None"]
"""Device name -> ``(namespace, claim name)`` of every prepared claim holding it (several with admin access or
consumable shares), or ``None``."""



class InventorySource(Protocol):
    """Anything with a current device set (the health monitor; its ``inventory`` is replaced, never mutated)."""

    inventory: NodeInventory


HolderLookup = Callable[[], Mapping[str, Sequence[DeviceHolder]]]
"""Called once per scrape: device name -> every container holding it, for the devices in use on this node."""


def holders_of(name: str, held: Mapping[str, Sequence[DeviceHolder]] | None,
               claim_of: ClaimLookup | None) -> Sequence[DeviceHolder]:
    """Who device ``name``'s series are attributed to: every container the PodResources view ``held`` lists
    for it, else every prepared claim ``claim_of`` names, else nobody (one unattributed series)."""
    if held:
        found = held.get(name)
        if found:
            return found
    owners = claim_of(name) if claim_of is not None and name else None
    return tuple(DeviceHolder.of_claim(namespace, claim) for namespace, claim in owners or ())


T = TypeVar("T")


class InventoryView(Generic[T]):
    """What a collector derives from its source's device set (labels by UUID), rebuilt when the set changes.

    The source (the health monitor) replaces its ``inventory`` as a subscriber of the plugin's
    :class:`~dradriver.domain.registry.DeviceRegistry` (dynamic MIG creating or destroying MIG devices) or of
    the exporter's re-discovery, so a device created after the collectors started is labelled and attributed
    at the next scrape. Thread-safe: concurrent scrapes each see one consistent ``(inventory, derived)`` pair.
    """

    def __init__(self, source: InventorySource, derive: Callable[[NodeInventory], T]) -> None:
        self._source = source
        self._derive = derive
        self._current: tuple[NodeInventory, T] | None = None

    def get(self) -> T:
        """What ``derive`` made of the source's current inventory."""
        inventory = self._source.inventory
        current = self._current
        if current is None or current[0] is not inventory:
            current = self._current = (inventory, self._derive(inventory))
        return current[1]


class _XidStats(Protocol):
    last: int
    counts: dict[int, int]


class DeviceSource(Protocol):
    """What both collectors read (:class:`~dradriver.health.metrics.DeviceCollector`,
    :class:`~dradriver.health.dcgm.DcgmCollector`; (implemented by :class:`~dradriver.health.monitor.HealthMonitor`)."""

    inventory: NodeInventory

    def latest_sample(self) -> Sample | None: ...
    def devices(self) -> Any: ...
    def xid_stats(self) -> Mapping[str, _XidStats]: ...
    def nvml_errors(self) -> dict[int, int]: ...
    def passthrough(self) -> Sequence[tuple[VfioDevice, bool]]: ...
