"""HealthMonitor against the mock NVML library: events and polls -> device taints, recovery, coalescing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.devices import MigDevice
from dradriver.domain.faults import GPU_RESET_XIDS
from tests.factories import wait_until, write_profile

from .conftest import MockNode, Services, TaintLog

pytestmark = pytest.mark.timeout(30)

XID_79 = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]


def test_xid_79_taints_the_gpu_and_recovery_removes_it(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.xid(2, 79)
    assert log.wait_for(bool, "a taint update") == {"gpu-2": XID_79}
    status = {s.device_name: s for s in service.snapshot()}
    assert status["gpu-2"].health == "Unhealthy"
    assert "Xid 79" in status["gpu-2"].message
    assert status["gpu-3"].health == "Healthy"
    assert service.xid_stats()[node.gpu_uuid(2)].counts == {79: 1}
    # No poll has run since the event, so NVML has not shown recovery: the taint stays.
    assert service.taints() == {"gpu-2": XID_79}
    service.poll_now()  # the GPU answers, nothing pending: recovery, then the quiet period
    assert log.wait_for(lambda t: t == {}, "the taint to be removed") == {}
    assert {s.health for s in service.snapshot()} == {"Healthy"}


def test_non_fatal_xid_gives_no_no_schedule_taint(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.xid(3, 13)
    update = log.wait_for(bool, "a taint update")
    assert update == {"gpu-3": [{"key": "gpu.nvidia.com/xid-informational", "value": "13", "effect": "None"}]}
    assert all(t["effect"] != "NoSchedule" for ts in update.values() for t in ts)
    assert {s.device_name: s.health for s in service.snapshot()}["gpu-3"] == "Healthy"


def test_additional_ignored_xid_is_informational(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log, ignored_xids={13, 31, 43, 45, 68, 109, 94}, informational_taints=False)
    service.start()
    node.xid(4, 94)
    node.xid(5, 48)
    assert log.wait_for(bool, "a taint update") == {
        "gpu-5": [{"key": "gpu.nvidia.com/xid", "value": "48", "effect": "NoSchedule"}]
    }


def test_mig_scoped_xid_taints_only_that_mig_device(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    target = next(m for m in node.inventory.migs if m.parent.index == 0 and m.gi_id == 3)
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.xid(0, 94, gi=target.gi_id, ci=target.ci_id)
    update = log.wait_for(bool, "a taint update")
    assert update == {target.name: [{"key": "gpu.nvidia.com/xid", "value": "94", "effect": "NoSchedule"}]}
    assert service.xid_stats()[target.uuid].last == 94
    health = {s.device_name: s.health for s in service.snapshot()}
    siblings = node.names_of(0) - {target.name}
    assert siblings and all(health[name] == "Healthy" for name in siblings)
    assert health[target.name] == "Unhealthy"


def test_unscoped_xid_on_a_mig_gpu_taints_every_mig_device(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    services(node, log).start()
    node.xid(1, 48)
    update = log.wait_for(bool, "a taint update")
    assert set(update) == node.names_of(1)
    assert all(isinstance(node.inventory.find(name), MigDevice) for name in update)


def test_lost_gpu_is_tainted_and_clears_after_it_returns(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.set_lost(0, True)
    update = log.wait_for(bool, "a gpu-lost taint")
    assert set(update) == node.names_of(0)
    assert all(ts == [{"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}] for ts in update.values())
    assert service.monitor is not None and service.monitor.lost == {node.gpu_uuid(0)}
    assert {s.device_name: s.health for s in service.snapshot()}[sorted(update)[0]] == "Unhealthy"
    service.poll_now()  # still lost: polling confirms it, nothing clears
    assert service.taints() == update
    # Other GPUs' events still arrive while one GPU is lost (the event set was rebuilt without it).
    node.xid(2, 79)
    log.wait_for(lambda t: "gpu-2" in t, "the Xid on another GPU")
    node.set_lost(0, False)
    wait_until(lambda: not service.monitor.lost, "the monitor to see the GPU answer again")  # type: ignore[union-attr]
    service.poll_now()
    after = log.wait_for(lambda t: not set(t) & node.names_of(0), "the gpu-lost taints to go")
    assert set(after) <= {"gpu-2"}


def test_burst_of_100_events_yields_one_taint_update(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    fatal = (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)
    expected: dict[str, list[dict[str, str]]] = {}
    for i in range(100):  # queued in the mock until the monitor registers the GPUs
        gpu, xid = 2 + i % 6, fatal[i % len(fatal)]
        node.xid(gpu, xid)
        kept = expected.get(f"gpu-{gpu}")
        if kept and int(kept[0]["value"]) in GPU_RESET_XIDS and xid not in GPU_RESET_XIDS:
            continue  # the class keeps its GPU-reset Xid over a milder one
        expected[f"gpu-{gpu}"] = [{"key": "gpu.nvidia.com/xid", "value": str(xid), "effect": "NoSchedule"}]
    log = TaintLog()
    service = services(node, log)
    service.start()
    assert log.wait_for(bool, "a taint update") == expected
    assert not service.flush()  # nothing left pending
    assert service.taint_updates == 1
    assert log.updates == [expected]
    assert sum(sum(s.counts.values()) for s in service.xid_stats().values()) == 100


def test_rising_double_bit_ecc_counter_taints(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.control("ecc 4 uncorrected volatile 3")
    service.poll_now()
    update = log.wait_for(bool, "a taint update")
    assert update == {"gpu-4": [{"key": "gpu.nvidia.com/ecc-dbe", "effect": "NoSchedule"}]}
    assert "rose from 0 to 3" in {s.device_name: s for s in service.snapshot()}["gpu-4"].message


def test_row_remap_failure_and_pending_retirement_hold_until_cleared(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.control("set 5 remappedRows.failure 1")
    node.control("set 6 retiredPages.pending 1")
    service.poll_now()
    update = log.wait_for(bool, "a taint update")
    assert update == {
        "gpu-5": [{"key": "gpu.nvidia.com/row-remap-failure", "effect": "NoSchedule"}],
        "gpu-6": [{"key": "gpu.nvidia.com/retired-pages-pending", "effect": "NoSchedule"}],
    }
    node.control("set 5 remappedRows.failure 0")
    service.poll_now()
    assert log.wait_for(lambda t: "gpu-5" not in t, "gpu-5 to recover") == {
        "gpu-6": [{"key": "gpu.nvidia.com/retired-pages-pending", "effect": "NoSchedule"}]
    }


def test_gpu_without_event_support_is_unmonitored(mock_node: Any, services: Services, tmp_path: Path) -> None:
    def edit(profile: dict[str, Any]) -> None:
        profile["gpus"][3]["notSupported"] = ["nvmlDeviceRegisterEvents"]

    node: MockNode = mock_node(write_profile(tmp_path, "dgx-a100", edit))
    log = TaintLog()
    service = services(node, log)
    service.start()
    update = log.wait_for(bool, "a taint update")
    assert update == {"gpu-3": [{"key": "gpu.nvidia.com/unmonitored", "effect": "None"}]}
    status = {s.device_name: s for s in service.snapshot()}["gpu-3"]
    assert status.health == "Unknown"
    assert "not supported" in status.message.lower() or "NOT_SUPPORTED" in status.message
    service.poll_now()  # polls answer, but an unmonitored GPU stays reported as such
    assert service.taints() == update


def test_unhealthy_nvlink_fabric_taints_the_gpu_until_it_recovers(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("gb200-nvl72-node")
    assert node.inventory.clique is not None
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.control("set 1 fabric.healthSummary 2")  # NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY
    service.poll_now()
    update = log.wait_for(bool, "a taint update")
    [name] = node.names_of(1)
    assert update == {name: [{"key": "gpu.nvidia.com/fabric-unhealthy", "value": "unhealthy", "effect": "NoSchedule"}]}
    assert "NVLink fabric health summary UNHEALTHY (health mask 0xaa)" in {
        s.device_name: s for s in service.snapshot()}[name].message
    node.control("set 1 fabric.healthSummary 1")
    service.poll_now()
    assert log.wait_for(lambda t: t == {}, "the fabric taint to go") == {}


def test_failed_fabric_registration_taints_the_gpu_and_reaches_the_health_stream(mock_node: Any,
                                                                                  services: Services) -> None:
    node: MockNode = mock_node("gb200-nvl72-node")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.control("set 0 fabric.state 2")  # registering again (IN_PROGRESS): passing, not a fault
    node.control("set 3 fabric.status 999")  # registration completed with NVML_ERROR_UNKNOWN
    node.control("set 3 fabric.healthMask 16")  # route unhealthy
    service.poll_now()
    update = log.wait_for(bool, "a taint update")
    [name] = node.names_of(3)
    assert update == {name: [{"key": "gpu.nvidia.com/fabric-unhealthy", "value": "registration-failed",
                              "effect": "NoSchedule"}]}
    status = {s.device_name: s for s in service.snapshot()}
    assert status[name].health == "Unhealthy"
    assert "NVLink fabric registration failed (status: NVML error 999)" in status[name].message
    assert {s.health for n, s in status.items() if n != name} == {"Healthy"}
    node.control("set 3 fabric.status 0")
    node.control("set 3 fabric.healthSummary 2")  # registered now, but the fabric is unhealthy: the value follows
    service.poll_now()
    update = log.wait_for(lambda t: t.get(name, [{}])[0].get("value") == "unhealthy", "the value to change")
    assert "route unhealthy" in {s.device_name: s for s in service.snapshot()}[name].message


@pytest.mark.parametrize("xid", [95, 119])
def test_mig_scoped_gpu_reset_xid_taints_the_gpu_and_every_mig_device(
    mock_node: Any, services: Services, xid: int
) -> None:
    """Xid 95 (uncontained ECC) and 119 (GSP timeout) need a GPU reset: every device of the GPU goes."""
    node: MockNode = mock_node("dgx-a100")
    target = next(m for m in node.inventory.migs if m.parent.index == 0 and m.gi_id == 3)
    siblings = {m.name for m in node.inventory.migs if m.parent.index == 0} - {target.name}
    assert siblings  # the profile has more MIG devices on that GPU
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.xid(0, xid, gi=target.gi_id, ci=target.ci_id)
    expected = [{"key": "gpu.nvidia.com/xid", "value": str(xid), "effect": "NoSchedule"}]
    update = log.wait_for(bool, "a taint update")
    assert update == {name: expected for name in node.names_of(0)}
    assert {target.name} | siblings <= set(update)
    health = {s.device_name: s.health for s in service.snapshot()}
    assert all(health[name] == "Unhealthy" for name in node.names_of(0))
    assert all(health[name] == "Healthy" for name in health if name not in node.names_of(0))
    assert service.xid_stats()[target.uuid].last == xid


def test_informational_xid_after_fatal_one_keeps_the_fatal_taint(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log, quiet_period_s=3600.0)
    service.start()
    node.xid(2, 79)
    log.wait_for(bool, "the fatal taint")
    node.xid(2, 13)
    informational = {"key": "gpu.nvidia.com/xid-informational", "value": "13", "effect": "None"}
    log.wait_for(lambda t: informational in t.get("gpu-2", []), "the informational taint")
    assert service.taints() == {"gpu-2": [*XID_79, informational]}
    status = {s.device_name: s for s in service.snapshot()}["gpu-2"]
    assert status.health == "Unhealthy" and "Xid 79" in status.message


@pytest.mark.parametrize(("xid", "action", "whole_gpu"), [(94, 1, True), (94, 4, True), (95, 0, False),
                                                         (95, 3, False)])
def test_nvml_recovery_action_decides_whether_a_mig_scoped_xid_takes_the_whole_gpu(
    mock_node: Any, services: Services, xid: int, action: int, whole_gpu: bool
) -> None:
    """The recovery action NVML reports with the Xid (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) wins over the
    table of reset Xids: Xid 94 (contained) with GPU_RESET or DRAIN_AND_RESET takes every device of the GPU;
    Xid 95 with NONE or DRAIN_P2P only the MIG device it names."""
    node: MockNode = mock_node("dgx-a100")
    target = next(m for m in node.inventory.migs if m.parent.index == 0 and m.gi_id == 3)
    node.control(f"set 0 recoveryAction {action}")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.xid(0, xid, gi=target.gi_id, ci=target.ci_id)
    update = log.wait_for(bool, "a taint update")
    tainted = {name for name, taints in update.items() if taints}
    assert tainted == (node.names_of(0) if whole_gpu else {target.name})
