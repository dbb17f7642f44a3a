"""Re-reading this node's devices into the device registry after dynamic MIG changed them (the GPU plugin).

:class:`DeviceRefresher` is the dynamic-MIG preparer's ``on_change``: it marks the devices stale and one background
thread discovers again (:func:`dradriver.nvml.discovery.discover`) and replaces the
:class:`~dradriver.domain.registry.DeviceRegistry` snapshot, which the health monitor and the ResourceSlice
publisher follow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from dradriver.config import PluginConfig
from dradriver.domain.devices import NodeInventory
from dradriver.domain.migplacements import MigPlacement
from dradriver.domain.registry import DeviceRegistry
from dradriver.nvml import discovery
from dradriver.nvml.mig import MigControl
from dradriver.nvml.session import NvmlSession

log = logging.getLogger(__name__)


class DeviceRefresher:
    """Re-reads this node's devices after dynamic MIG created or destroyed instances and replaces the device
    registry (the health monitor and the ResourceSlice publisher are its subscribers).

    A call only marks the devices stale and returns (it runs on the prepare path); one background thread re-reads
    while changes keep coming, so a burst of prepares costs one or two discoveries and the snapshot installed
    last is never older than the last change.
    """

    RETRIES = 3
    """Discoveries per refresh while a GPU of the previous snapshot is left out (a transient read error)."""
    RETRY_DELAY_S = 0.05

    def __init__(self, session: NvmlSession, config: PluginConfig, registry: DeviceRegistry[NodeInventory],
                 mig_control: MigControl | None = None, *, placements: bool = True,
                 extend: Callable[[NodeInventory], NodeInventory] | None = None,
                 reopen: Callable[[], AbstractContextManager[object]] | None = None) -> None:
        self.session, self.config, self.registry = session, config, registry
        self.mig_control = mig_control
        self.extend = extend
        """What the host adds to NVML's devices (VFIO devices, Fabric Manager partitions), applied to each
        discovery."""
        self.reopen = reopen
        """Held around each discovery when NVML must enumerate anew (VFIO passthrough moved a GPU between drivers):
        it stops what holds NVML handles and initialises NVML again on entry, and restarts them on exit, after the
        registry is replaced."""
        self.with_placements = placements
        """False with the ``DynamicMIG`` gate off (a claim of before the gate was turned off destroyed its
        instance): the devices are re-read as discovered, without placements."""
        self._lock = threading.Lock()
        self._closed = False
        self._stale = False
        self._thread: threading.Thread | None = None
        self._placements: dict[str, list[MigPlacement]] | None = None
        self.refreshes = 0
        """Discoveries run so far."""

    def __call__(self) -> None:
        """Mark the devices stale; a background thread re-reads them (nothing once :meth:`close` ran)."""
        with self._lock:
            if self._closed:
                return
            self._stale = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="device-refresh", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._stale:
                    self._thread = None
                    return
                self._stale = False
            try:
                self.refresh()
            except Exception:  # retried at the next change; the registry keeps the last good snapshot
                log.exception("re-reading devices after a change failed")

    def refresh(self) -> None:
        """Discover again now (on this thread) and replace the registry's snapshot.

        A GPU's placements never change while it is present, so they are enumerated once per GPU UUID (the
        first snapshot's, or at the first refresh that sees a new GPU) and re-parented to the GPU's new entry:
        a refresh costs a plain discovery, not ~20 NVML profile queries per GPU.
        """
        if self.reopen is not None:
            with self.reopen():
                inventory = self._discover()
                self.registry.replace(inventory)
            self.refreshes += 1
            log.info("devices read again after a GPU moved between drivers: %d GPU(s), %d VFIO device(s)",
                     len(inventory.gpus), len(inventory.vfio))
            return
        inventory = self._discover()
        if not self.with_placements:
            self.registry.replace(inventory)
            self.refreshes += 1
            log.info("devices read again after a MIG change with DynamicMIG off: %d GPU(s), %d MIG device(s)",
                     len(inventory.gpus), len(inventory.migs))
            return
        cache = self._placements
        if cache is None:
            cache = self._placements = {}
            for placement in self.registry.snapshot.placements:
                cache.setdefault(placement.parent.uuid, []).append(placement)
        placements: list[MigPlacement] = []
        for gpu in inventory.gpus:
            if gpu.uuid not in cache:
                cache[gpu.uuid] = (discovery.mig_placements(self.session, gpu)
                                   if discovery.is_dynamic_mig_capable(gpu) else [])
            placements.extend(dataclasses.replace(p, parent=gpu) for p in cache[gpu.uuid])
        self.registry.replace(dataclasses.replace(inventory, placements=tuple(placements)))
        self.refreshes += 1

    def _discover(self) -> NodeInventory:
        """Discover with every known GPU's MIG lock held, so no instance of ours is half created or destroyed
        while it is read; a GPU of the previous snapshot that is left out (another NVML client changing MIG at
        that moment: its GPU instance exists before its compute instance) is read again after a short delay,
        up to :attr:`RETRIES` times, before the snapshot without it is installed."""
        before = {gpu.uuid for gpu in self.registry.snapshot.gpus}
        for attempt in range(self.RETRIES + 1):
            with self.mig_control.hold(before) if self.mig_control is not None else contextlib.nullcontext():
                self.session.forget_mig_handles()
                inventory = discovery.discover(self.session, sysfs_root=self.config.sysfs_root)
            if self.extend is not None:
                inventory = self.extend(inventory)
            missing = before - {gpu.uuid for gpu in inventory.gpus}
            if not missing or attempt == self.RETRIES or self.reopen is not None:
                return inventory
            log.info("re-reading devices: %d GPU(s) of the last snapshot left out (%s); retrying",
                     len(missing), ", ".join(sorted(missing)))
            time.sleep(self.RETRY_DELAY_S * (attempt + 1))
        raise AssertionError("unreachable")

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no refresh is pending or running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                thread = self._thread
            if thread is None:
                return True
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return False

    def close(self) -> None:
        """Wait for a refresh in progress (the NVML session closes after this)."""
        with self._lock:
            thread, self._stale, self._closed = self._thread, False, True
        if thread is not None:
            thread.join(timeout=10)
