"""Health classification, scoping and recovery (pure domain logic)."""

from __future__ import annotations

import pytest

from dradriver.domain.devices import DriverVersions, GpuDevice, MigDevice, NodeInventory
from dradriver.domain.faults import (
    DEFAULT_IGNORED_XIDS,
    GPU_RESET_XIDS,
    NO_MIG_SCOPE,
    Effect,
    FaultKind,
    HealthEvent,
    HealthTracker,
    classify,
)
from tests.factories import gpu_device, mig_device


def _gpu(minor: int, *, mig: bool = False) -> GpuDevice:
    return gpu_device(
        minor, uuid=f"GPU-0000000{minor}-0000-0000-0000-000000000000", pci_bus_id=f"0000:0{minor}:00.0",
        mig_capable=True, mig_enabled=mig,
    )


def _mig(parent: GpuDevice, gi: int, start: int) -> MigDevice:
    return mig_device(parent, start, gi_id=gi, uuid=f"MIG-{gi:08x}-0000-5000-8000-000000000000")


def _inventory() -> NodeInventory:
    g0, g1 = _gpu(0), _gpu(1, mig=True)
    return NodeInventory(
        versions=DriverVersions("570.148.08", 12080),
        gpus=(g0, g1),
        migs=(_mig(g1, 7, 0), _mig(g1, 8, 1)),
    )


def test_default_ignored_xids_match_reference() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == DEFAULT_IGNORED_XIDS


def test_xid_79_taints_whole_gpu_no_schedule() -> None:
    tracker = HealthTracker(_inventory())
    g0 = _inventory().gpus[0]
    changed = tracker.record(HealthEvent(g0.uuid, FaultKind.XID, time=10.0, xid=79))
    assert changed == {"gpu-0"}
    assert tracker.taints() == {"gpu-0": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]}
    assert not tracker.states()["gpu-0"].healthy
    assert "Xid 79" in tracker.states()["gpu-0"].message


def test_informational_xid_is_effect_none_and_device_stays_healthy() -> None:
    tracker = HealthTracker(_inventory())
    g0 = _inventory().gpus[0]
    tracker.record(HealthEvent(g0.uuid, FaultKind.XID, time=1.0, xid=13))
    assert tracker.taints()["gpu-0"][0]["effect"] == "None"
    assert tracker.states()["gpu-0"].healthy
    quiet = HealthTracker(_inventory(), informational_taints=False)
    assert quiet.record(HealthEvent(g0.uuid, FaultKind.XID, time=1.0, xid=13)) == set()
    assert quiet.taints() == {}


def test_mig_scoped_xid_taints_only_that_mig_device() -> None:
    inv = _inventory()
    tracker = HealthTracker(inv)
    g1 = inv.gpus[1]
    changed = tracker.record(HealthEvent(g1.uuid, FaultKind.XID, time=1.0, xid=94, gi_id=8, ci_id=0))
    assert changed == {inv.migs[1].name}
    assert set(tracker.taints()) == {inv.migs[1].name}


def test_unscoped_event_on_mig_gpu_taints_every_mig_device() -> None:
    inv = _inventory()
    tracker = HealthTracker(inv)
    event = HealthEvent(inv.gpus[1].uuid, FaultKind.GPU_LOST, time=1.0, gi_id=NO_MIG_SCOPE, ci_id=NO_MIG_SCOPE)
    assert tracker.record(event) == {m.name for m in inv.migs}
    assert all(t[0]["key"] == "gpu.nvidia.com/gpu-lost" for t in tracker.taints().values())


def test_recovery_needs_nvml_recovery_and_quiet_period() -> None:
    inv = _inventory()
    tracker = HealthTracker(inv, quiet_period_s=30.0)
    uuid = inv.gpus[0].uuid
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=100.0, xid=79))
    assert tracker.tick(200.0) == set()  # NVML has not shown recovery yet
    assert tracker.observe_recovery(uuid, now=110.0) == set()  # quiet period not over
    assert tracker.tick(129.0) == set()
    assert tracker.tick(130.0) == {"gpu-0"}
    assert tracker.taints() == {}
    assert tracker.states()["gpu-0"].healthy


def test_new_fault_during_quiet_period_restarts_it() -> None:
    inv = _inventory()
    tracker = HealthTracker(inv, quiet_period_s=30.0)
    uuid = inv.gpus[0].uuid
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=100.0, xid=79))
    tracker.observe_recovery(uuid, now=110.0)
    tracker.record(HealthEvent(uuid, FaultKind.DOUBLE_BIT_ECC, time=120.0))
    assert tracker.tick(140.0) == set()  # new fault: NVML must show recovery again
    tracker.observe_recovery(uuid, now=141.0)
    assert tracker.tick(150.0) == {"gpu-0"}


def test_classify_and_repeat_event_is_not_a_change() -> None:
    taint = classify(HealthEvent("GPU-x", FaultKind.XID, time=0.0, xid=48))
    assert (taint.key, taint.value, taint.effect) == ("gpu.nvidia.com/xid", "48", Effect.NO_SCHEDULE)
    tracker = HealthTracker(_inventory())
    uuid = _inventory().gpus[0].uuid
    assert tracker.record(HealthEvent(uuid, FaultKind.XID, time=1.0, xid=48)) == {"gpu-0"}
    assert tracker.record(HealthEvent(uuid, FaultKind.XID, time=2.0, xid=48)) == set()
    assert tracker.record(HealthEvent("GPU-unknown", FaultKind.XID, time=2.0, xid=48)) == set()


# -- one taint per health class ---------------------------------------------------------------------------

FATAL_79 = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
INFO_13 = {"key": "gpu.nvidia.com/xid-informational", "value": "13", "effect": "None"}


@pytest.mark.parametrize("informational_taints", [False, True], ids=["k8s-1.34", "k8s-1.35"])
def test_informational_xid_after_fatal_one_keeps_the_fatal_taint(informational_taints: bool) -> None:
    inv = _inventory()
    tracker = HealthTracker(inv, quiet_period_s=60.0, informational_taints=informational_taints)
    uuid = inv.gpus[0].uuid
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=10.0, xid=79))
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=11.0, xid=13))
    expected = [FATAL_79, INFO_13] if informational_taints else [FATAL_79]
    assert tracker.taints() == {"gpu-0": expected}
    state = tracker.states()["gpu-0"]
    assert not state.healthy
    assert "Xid 79" in state.message  # the most severe taint speaks for the device
    # A later informational Xid neither replaces nor clears the fatal one, and its own quiet period does
    # not clear it either: NVML has not shown recovery.
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=50.0, xid=31))
    tracker.tick(500.0)
    assert tracker.taints() == {"gpu-0": [FATAL_79]}
    assert "Xid 79" in tracker.states()["gpu-0"].message


@pytest.mark.parametrize("informational_taints", [False, True], ids=["k8s-1.34", "k8s-1.35"])
def test_recovery_clears_each_class_on_its_own_clock(informational_taints: bool) -> None:
    inv = _inventory()
    tracker = HealthTracker(inv, quiet_period_s=60.0, informational_taints=informational_taints)
    uuid = inv.gpus[0].uuid
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=10.0, xid=79))
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=50.0, xid=13))
    assert tracker.observe_recovery(uuid, now=55.0) == set()
    # The fatal class has been quiet for 60 s: it goes; the informational one (1.35) stays until its own
    # quiet period ends.
    assert tracker.tick(71.0) == {"gpu-0"}
    assert tracker.taints() == ({"gpu-0": [{**INFO_13}]} if informational_taints else {})
    assert tracker.states()["gpu-0"].healthy
    tracker.tick(111.0)
    assert tracker.taints() == {}


def test_more_severe_xid_of_a_class_is_not_replaced_by_a_milder_one() -> None:
    inv = _inventory()
    tracker = HealthTracker(inv)
    uuid = inv.gpus[0].uuid
    tracker.record(HealthEvent(uuid, FaultKind.XID, time=1.0, xid=95))  # needs a GPU reset
    assert tracker.record(HealthEvent(uuid, FaultKind.XID, time=2.0, xid=8)) == set()  # restart the app
    assert tracker.taints() == {"gpu-0": [{"key": "gpu.nvidia.com/xid", "value": "95", "effect": "NoSchedule"}]}
    assert "Xid 95" in tracker.states()["gpu-0"].message


# -- GPU-reset Xids are GPU-wide --------------------------------------------------------------------------


@pytest.mark.parametrize("xid", sorted(GPU_RESET_XIDS))
def test_mig_scoped_gpu_reset_xid_taints_every_device_of_the_gpu(xid: int) -> None:
    inv = _inventory()
    tracker = HealthTracker(inv)
    g1 = inv.gpus[1]
    changed = tracker.record(HealthEvent(g1.uuid, FaultKind.XID, time=1.0, xid=xid, gi_id=8, ci_id=0))
    assert changed == {m.name for m in inv.migs}
    assert tracker.taints() == {
        m.name: [{"key": "gpu.nvidia.com/xid", "value": str(xid), "effect": "NoSchedule"}] for m in inv.migs
    }


def test_gpu_reset_xids_include_the_catalogue_reset_xids() -> None:
    assert {48, 79, 95, 119, 120} <= GPU_RESET_XIDS
    assert not GPU_RESET_XIDS & DEFAULT_IGNORED_XIDS
    assert 94 not in GPU_RESET_XIDS  # contained ECC error: restart the application, not the GPU
