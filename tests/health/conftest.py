"""Fixtures for the health tests: a mock NVML node (session, inventory, fault injection) and health services.

Everything runs through the real C ABI of the mock ``libnvidia-ml.so.1``: pynvml for the event monitor, the
compiled poller for polling, and the mock's exported control functions (``mocknvml_inject_event``,
``mocknvml_set_lost``, ``mocknvml_control``; ``ext/mocknvml/README.md``) for faults.
"""

from __future__ import annotations

import copy
import ctypes
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.claims import ClaimRef, ClaimResult
from dradriver.domain.devices import NodeInventory
from dradriver.domain.faults import NO_MIG_SCOPE
from dradriver.health.monitor import HealthMonitor, TaintMap
from dradriver.nvml import mock
from dradriver.nvml.discovery import discover
from dradriver.nvml.session import NvmlSession
from tests.factories import wait_until

EVENT_XID = 0x8


@dataclass
class MockNode:
    """An open NVML session on the mock, the discovered inventory, and the mock's control functions."""

    session: NvmlSession
    inventory: NodeInventory
    lib: ctypes.CDLL

    def inject(self, gpu: int, event_type: int, data: int, gi: int = NO_MIG_SCOPE, ci: int = NO_MIG_SCOPE) -> None:
        rc = self.lib.mocknvml_inject_event(
            ctypes.c_uint(gpu), ctypes.c_ulonglong(event_type), ctypes.c_ulonglong(data), ctypes.c_uint(gi),
            ctypes.c_uint(ci),
        )  # fmt: skip
        assert rc == 0, f"mocknvml_inject_event returned {rc}"

    def xid(self, gpu: int, xid: int, gi: int = NO_MIG_SCOPE, ci: int = NO_MIG_SCOPE) -> None:
        self.inject(gpu, EVENT_XID, xid, gi, ci)

    def set_lost(self, gpu: int, lost: bool) -> None:
        assert self.lib.mocknvml_set_lost(ctypes.c_uint(gpu), ctypes.c_int(int(lost))) == 0

    def control(self, command: str) -> None:
        assert self.lib.mocknvml_control(command.encode()) == 0, command

    def gpu_uuid(self, index: int) -> str:
        return next(g.uuid for g in self.inventory.gpus if g.index == index)

    def names_of(self, index: int) -> set[str]:
        """Published device names of GPU ``index`` (the GPU or its MIG devices)."""
        uuid = self.gpu_uuid(index)
        return {
            d.name
            for d in self.inventory.allocatable()
            if getattr(d, "uuid", None) == uuid or getattr(getattr(d, "parent", None), "uuid", None) == uuid
        }


@pytest.fixture
def mock_node(mock_session: Callable[[str], NvmlSession]) -> Callable[[str], MockNode]:
    """Factory ``mock_node(profile)``: session on the mock with that profile plus the discovered inventory."""

    def start(profile: str) -> MockNode:
        session = mock_session(profile)
        sysfs = Path(tempfile.mkdtemp(prefix="health-sysfs-"))
        try:
            inventory = discover(session, sysfs_root=sysfs)
        finally:
            shutil.rmtree(sysfs, ignore_errors=True)
        return MockNode(session, inventory, ctypes.CDLL(str(mock.library_path())))

    return start


class TaintLog:
    """``on_taints_changed`` target: records every update."""

    def __init__(self) -> None:
        self.updates: list[TaintMap] = []
        self._lock = threading.Lock()

    def __call__(self, taints: TaintMap) -> None:
        with self._lock:
            self.updates.append(copy.deepcopy(taints))

    def wait_for(self, predicate: Callable[[TaintMap], bool], what: str) -> TaintMap:
        """The first update (from the start) that satisfies ``predicate``."""
        found: list[TaintMap] = []

        def check() -> bool:
            with self._lock:
                found[:] = [u for u in self.updates if predicate(u)]
            return bool(found)

        wait_until(check, what)
        return found[0]

    @property
    def last(self) -> TaintMap:
        with self._lock:
            return self.updates[-1] if self.updates else {}


@dataclass
class Services:
    """Creates health services with test-sized settings; stops them all at the end."""

    made: list[HealthMonitor] = field(default_factory=list)

    def __call__(
        self, node: MockNode, taints: Callable[[TaintMap], None] | None = None, **overrides: Any
    ) -> HealthMonitor:
        settings: dict[str, Any] = dict(
            pool_name="node-a",
            session=node.session,
            quiet_period_s=0.2,
            poll_interval_s=3600.0,  # polls only when a test calls poll_now(): recovery is deterministic
            snapshot_interval_s=10.0,
            debounce_s=0.05,
            wait_timeout_ms=100,
            on_taints_changed=taints,
        )
        settings.update(overrides)
        service = HealthMonitor(node.inventory, **settings)
        self.made.append(service)
        return service


@pytest.fixture
def services() -> Iterator[Services]:
    made = Services()
    yield made
    for service in reversed(made.made):
        service.stop()


class NullPreparer:
    """A ClaimPreparer with no claims (the health tests only need the DRA server to exist)."""

    def prepare_claims(self, claims: Sequence[ClaimRef], *,
                       deadline_s: float | None = None) -> Mapping[str, ClaimResult]:
        return {ref.uid: ClaimResult(error="no devices in this test") for ref in claims}

    def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return {ref.uid: "" for ref in claims}
