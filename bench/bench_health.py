"""Health scenarios on an 8-GPU node with every GPU in MIG mode (8 GPUs x 7 MIG devices, ``bench/nvmlenv.py``).

* ``health_cycle_8gpu_7mig``: one poll-and-publish cycle of :class:`dradriver.health.monitor.HealthMonitor`:
  the compiled poll of all 64 devices, the health checks and tracker update, and the ResourceSlice build
  with the resulting taints (one GPU tainted). Variants: ``poll_track_build`` (the whole cycle),
  ``poll_track`` (without the slice build) and ``build`` (the slice build alone).
* ``metrics_scrape_8gpu_7mig``: one Prometheus scrape, ``generate_latest`` of the device collector and the
  driver metrics, served from the latest sample (variant ``generate_latest``).

With ``DRADRIVER_BENCH_REAL_NVML=1`` the real driver is used (read-only) and the scenarios end in
``_real_gpu``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest

from bench import nvmlenv
from dradriver.domain.faults import FaultKind, HealthEvent
from dradriver.domain.pools import build_resource_slices
from dradriver.health.metrics import DriverMetrics
from dradriver.health.monitor import HealthMonitor
from dradriver.nvml.discovery import discover
from dradriver.nvml.session import open_session

SUFFIX = "real_gpu" if nvmlenv.REAL else "8gpu_7mig"
CYCLE = f"health_cycle_{SUFFIX}"
SCRAPE = f"metrics_scrape_{SUFFIX}"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HealthMonitor]:
    directory = tmp_path_factory.mktemp("health")
    profile = "" if nvmlenv.REAL else str(nvmlenv.all_mig_profile(directory))
    session = open_session(mock_profile=profile)
    sysfs = directory / "sys"
    sysfs.mkdir()
    inventory = discover(session, sysfs_root=sysfs)
    svc = HealthMonitor(inventory, pool_name="node-bench", session=session, poll_interval_s=3600.0)
    if inventory.gpus:
        svc.record(HealthEvent(inventory.gpus[0].uuid, FaultKind.XID, time=time.monotonic(), xid=79))
    yield svc
    svc.stop()
    session.close()


def _info(benchmark: Any, scenario: str, variant: str, svc: HealthMonitor) -> None:
    benchmark.extra_info.update(
        scenario=scenario,
        variant=variant,
        devices=len(svc.device_uuids),
        published_devices=len(svc.inventory.allocatable()),
    )


def test_cycle_poll_track_build(benchmark: Any, service: HealthMonitor) -> None:
    def cycle() -> list[dict[str, Any]]:
        service.poll_now()
        return build_resource_slices(service.inventory, "node-bench", taints=service.taints())

    _info(benchmark, CYCLE, "poll_track_build", service)
    slices = benchmark(cycle)
    assert sum(len(s["spec"]["devices"]) for s in slices) == len(service.inventory.allocatable())
    assert any(d.get("taints") for s in slices for d in s["spec"]["devices"]) == bool(service.inventory.gpus)


def test_cycle_poll_track(benchmark: Any, service: HealthMonitor) -> None:
    _info(benchmark, CYCLE, "poll_track", service)
    sample = benchmark(service.poll_now)
    assert sample is not None and len(sample.devices) == len(service.device_uuids)


def test_cycle_build(benchmark: Any, service: HealthMonitor) -> None:
    taints = service.taints()
    _info(benchmark, CYCLE, "build", service)
    benchmark(build_resource_slices, service.inventory, "node-bench", taints=taints)


def test_scrape(benchmark: Any, service: HealthMonitor) -> None:
    service.poll_now()
    metrics = DriverMetrics(node="node-bench")
    metrics.attach_devices(service, claim_of=lambda name: [("default", f"claim-{name}")] if "mig" in name else None)
    _info(benchmark, SCRAPE, "generate_latest", service)
    body = benchmark(generate_latest, metrics.registry)
    benchmark.extra_info.update(bytes=len(body), lines=body.count(b"\n"))
    assert b"dradriver_gpu_memory_used_bytes" in body
