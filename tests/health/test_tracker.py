"""Additions to the health domain used by the service: unmonitored taints, stale readings, explicit clearing."""

from __future__ import annotations

from dradriver.domain.devices import DriverVersions, NodeInventory
from dradriver.domain.faults import Effect, FaultKind, HealthEvent, HealthTracker, classify
from tests.factories import gpu_device

UUID = "GPU-00000000-0000-0000-0000-000000000001"


def _tracker(quiet: float = 10.0) -> HealthTracker:
    gpu = gpu_device(
        0, uuid=UUID, product_name="NVIDIA L4", architecture="Ada Lovelace", cuda_compute_capability=(8, 9),
        memory_bytes=24 << 30, pci_bus_id="0000:01:00.0",
    )
    return HealthTracker(NodeInventory(DriverVersions("570.148.08", 12080), (gpu,)), quiet_period_s=quiet)


def test_unmonitored_is_informational_and_survives_recovery() -> None:
    event = HealthEvent(UUID, FaultKind.UNMONITORED, time=1.0, detail="NOT_SUPPORTED")
    assert classify(event).effect is Effect.NONE
    tracker = _tracker()
    assert tracker.record(event) == {"gpu-0"}
    assert tracker.states()["gpu-0"].healthy
    assert tracker.observe_recovery(UUID, now=100.0) == set()
    assert tracker.taints() == {"gpu-0": [{"key": "gpu.nvidia.com/unmonitored", "effect": "None"}]}
    assert tracker.clear(UUID, FaultKind.UNMONITORED, now=101.0) == {"gpu-0"}
    assert tracker.taints() == {}


def test_reading_older_than_the_fault_is_not_recovery() -> None:
    tracker = _tracker(quiet=0.0)
    tracker.record(HealthEvent(UUID, FaultKind.XID, time=50.0, xid=79))
    assert tracker.observe_recovery(UUID, now=60.0, observed_at=49.0) == set()
    assert tracker.observe_recovery(UUID, now=61.0, observed_at=51.0) == {"gpu-0"}


def test_informational_taint_expires_a_quiet_period_after_it_was_recorded() -> None:
    tracker = _tracker(quiet=10.0)
    tracker.record(HealthEvent(UUID, FaultKind.XID, time=100.0, xid=13))
    assert tracker.tick(105.0) == set()
    assert tracker.tick(110.0) == {"gpu-0"}
