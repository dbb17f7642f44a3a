"""Prometheus metrics: exposition parsed with prometheus-client's parser; series, labels, units; HTTP."""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dradriver.health.metrics import (
    DriverMetrics,
    MetricsEndpointError,
    exporter_registry,
    parse_endpoint,
    serve_metrics,
)
from tests.factories import vfio_for

from .conftest import MockNode, Services, TaintLog

pytestmark = pytest.mark.timeout(30)

DEVICE_LABELS = {"uuid", "device", "node", "namespace", "claim"}  # the plugin: no pod, container


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(families: dict[str, Any], name: str, **labels: str) -> list[Any]:
    family = families[name]
    return [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]


def _value(families: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    found = [s for s in _samples(families, family, **labels) if s.name == sample]
    assert len(found) == 1, (sample, labels, found)
    return float(found[0].value)


def test_device_metrics_show_readings_xid_and_health(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    mig = node.inventory.migs[0]
    claims = {"gpu-3": [("team-a", "training")], mig.name: [("team-b", "notebook")]}
    metrics = DriverMetrics(node="node-a")
    metrics.attach_devices(service, claim_of=claims.get)
    node.xid(2, 79)
    log.wait_for(bool, "a taint update")
    families = _families(generate_latest(metrics.registry).decode())

    gpu2 = {"device": "gpu-2", "uuid": node.gpu_uuid(2), "node": "node-a"}
    for family in ("dradriver_gpu_utilization_ratio", "dradriver_gpu_memory_used_bytes",
                   "dradriver_gpu_memory_free_bytes", "dradriver_gpu_temperature_celsius",
                   "dradriver_gpu_power_usage_watts", "dradriver_gpu_sm_clock_hertz", "dradriver_gpu_last_xid"):
        [sample] = _samples(families, family, **gpu2)
        assert set(sample.labels) == DEVICE_LABELS
        assert sample.labels["namespace"] == sample.labels["claim"] == ""
    assert 0.0 <= _value(families, "dradriver_gpu_utilization_ratio", "dradriver_gpu_utilization_ratio", **gpu2) <= 1
    assert _value(families, "dradriver_gpu_sm_clock_hertz", "dradriver_gpu_sm_clock_hertz", **gpu2) >= 1e8
    assert _value(families, "dradriver_gpu_power_usage_watts", "dradriver_gpu_power_usage_watts", **gpu2) < 1000
    assert _value(families, "dradriver_gpu_memory_total_bytes", "dradriver_gpu_memory_total_bytes", **gpu2) == (
        node.inventory.find("gpu-2").memory_bytes  # type: ignore[union-attr]
    )
    assert _value(families, "dradriver_gpu_last_xid", "dradriver_gpu_last_xid", **gpu2) == 79
    assert _value(families, "dradriver_gpu_xid_errors", "dradriver_gpu_xid_errors_total", xid="79", **gpu2) == 1
    assert _value(families, "dradriver_device_health", "dradriver_device_health", state="unhealthy", **gpu2) == 1
    assert _value(families, "dradriver_device_health", "dradriver_device_health", state="healthy", **gpu2) == 0
    assert _value(families, "dradriver_device_taint", "dradriver_device_taint", key="gpu.nvidia.com/xid",
                  value="79", effect="NoSchedule", **gpu2) == 1  # fmt: skip
    assert _value(families, "dradriver_device_health", "dradriver_device_health", state="healthy",
                  device="gpu-3") == 1  # fmt: skip
    # ECC counters by error and counter kind
    assert {(s.labels["error"], s.labels["counter"]) for s in _samples(families, "dradriver_gpu_ecc_errors", **gpu2)
            if s.name.endswith("_total")} == {("corrected", "volatile"), ("uncorrected", "volatile"),
                                               ("corrected", "aggregate"), ("uncorrected", "aggregate")}  # fmt: skip
    # prepared devices carry their claim
    [claimed] = _samples(families, "dradriver_gpu_temperature_celsius", device="gpu-3")
    assert (claimed.labels["namespace"], claimed.labels["claim"]) == ("team-a", "training")
    [mig_mem] = _samples(families, "dradriver_gpu_memory_total_bytes", device=mig.name)
    assert mig_mem.labels["uuid"] == mig.uuid and mig_mem.value == mig.memory_bytes
    assert (mig_mem.labels["namespace"], mig_mem.labels["claim"]) == ("team-b", "notebook")
    assert _samples(families, "dradriver_gpu_temperature_celsius", device=mig.name) == []  # NOT_SUPPORTED on MIG
    assert _value(families, "dradriver_device_health", "dradriver_device_health", state="healthy",
                  device=mig.name) == 1  # fmt: skip
    # the scrape never waited on NVML: it came from the sample taken at start
    assert "dradriver_nvml_sample_timestamp_seconds" in families


def test_driver_metrics_series_and_names(mock_node: Any, services: Services) -> None:
    metrics = DriverMetrics(node="node-a")
    other = DriverMetrics(node="node-b")  # registries are independent
    metrics.observe_prepare("success", 0.07)
    metrics.observe_prepare("error", 0.2, error_type="lock_acquire")
    metrics.observe_unprepare("success", 0.01)
    with metrics.in_flight("prepare"):
        inflight = _families(generate_latest(metrics.registry).decode())
    metrics.set_prepared(3, {"gpu": 2, "mig": 5})
    metrics.observe_claim_store("append", "success", 0.0004)
    metrics.count_publish_error("Conflict")
    metrics.count_nvml_error(15)
    fam = _families(generate_latest(metrics.registry).decode())
    d = {"driver": "gpu.nvidia.com"}
    assert _value(inflight, "nvidia_dra_requests_inflight", "nvidia_dra_requests_inflight", operation="prepare") == 1
    assert _value(fam, "nvidia_dra_requests_inflight", "nvidia_dra_requests_inflight", operation="prepare") == 0
    assert _value(fam, "nvidia_dra_requests", "nvidia_dra_requests_total", operation="prepare", **d) == 1
    assert _value(fam, "nvidia_dra_requests", "nvidia_dra_requests_total", operation="unprepare", **d) == 1
    assert _value(fam, "nvidia_dra_request_duration_seconds", "nvidia_dra_request_duration_seconds_bucket",
                  operation="prepare", le="0.1") == 1  # fmt: skip
    assert {s.labels["le"] for s in fam["nvidia_dra_request_duration_seconds"].samples if "le" in s.labels} >= {
        "0.05", "0.1", "0.2", "0.4", "0.8", "1.6", "3.2", "6.4", "12.8", "+Inf"
    }
    assert _value(fam, "dradriver_claim_requests", "dradriver_claim_requests_total", operation="prepare",
                  outcome="error") == 1  # fmt: skip
    assert _value(fam, "nvidia_dra_node_prepare_errors", "nvidia_dra_node_prepare_errors_total",
                  error_type="lock_acquire") == 1  # fmt: skip
    assert _value(fam, "nvidia_dra_prepared_devices", "nvidia_dra_prepared_devices", device_type="mig",
                  node="node-a") == 5  # fmt: skip
    assert _value(fam, "nvidia_dra_prepared_devices", "nvidia_dra_prepared_devices", device_type="vfio") == 0
    assert _value(fam, "dradriver_prepared_claims", "dradriver_prepared_claims") == 3
    assert _value(fam, "dradriver_claim_store_operations", "dradriver_claim_store_operations_total",
                  operation="append", outcome="success") == 1  # fmt: skip
    assert _value(fam, "dradriver_resourceslice_publish_errors", "dradriver_resourceslice_publish_errors_total",
                  reason="Conflict") == 1  # fmt: skip
    assert _value(fam, "dradriver_nvml_errors", "dradriver_nvml_errors_total", return_code="15",
                  error="NVML_ERROR_GPU_IS_LOST") == 1  # fmt: skip
    assert _value(_families(generate_latest(other.registry).decode()), "nvidia_dra_requests",
                  "nvidia_dra_requests_total", operation="prepare") == 0  # fmt: skip
    # every counter ends in _total, every unit is a base unit
    for name, family in fam.items():
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name
        assert not any(bad in name for bad in ("milli", "mhz", "percent", "kilobytes")), name


def test_exporter_registry_served_over_http(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("l4-inference")
    service = services(node)
    service.start()
    server = serve_metrics(exporter_registry(service, node="node-x"), "127.0.0.1:0", "/custom/metrics")
    try:
        with urllib.request.urlopen(server.url, timeout=10) as response:
            assert response.status == 200
            fam = _families(response.read().decode())
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url.replace("/custom/metrics", "/metrics"), timeout=10)
        assert missing.value.code == 404
    finally:
        server.stop()
    temps = _samples(fam, "dradriver_gpu_temperature_celsius", node="node-x")
    assert {s.labels["device"] for s in temps} == {g.name for g in node.inventory.gpus}
    assert "nvidia_dra_requests" not in fam  # the exporter does not prepare claims
    assert "dradriver_nvml_errors" in fam
    assert "process_cpu_seconds" in fam


def test_parse_endpoint() -> None:
    assert parse_endpoint(":8080") == ("0.0.0.0", 8080)
    assert parse_endpoint("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_endpoint("[::1]:9400") == ("::1", 9400)
    for bad in ("8080", "host:", "host:http", ":70000"):
        with pytest.raises(MetricsEndpointError, match="expected"):
            parse_endpoint(bad)


def test_passthrough_gauge_says_which_gpus_are_passed_through_and_vfio_devices_are_unknown(
        mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("l4-inference")
    node.inventory = dataclasses.replace(node.inventory, vfio=vfio_for(*node.inventory.gpus))
    service = services(node)
    service.start()
    first, second = node.inventory.vfio[:2]
    service.set_held({first.name})
    metrics = DriverMetrics(node="node-a")
    metrics.attach_devices(service, claim_of={first.name: [("vms", "guest-0")]}.get)
    families = _families(generate_latest(metrics.registry).decode())
    [passed] = _samples(families, "dradriver_gpu_passthrough", device=first.name)
    assert passed.value == 1.0
    assert passed.labels == {"uuid": first.uuid, "device": first.name, "node": "node-a", "namespace": "vms",
                             "claim": "guest-0", "gpu": first.sibling, "pci_bus_id": first.function.address}
    [host] = _samples(families, "dradriver_gpu_passthrough", device=second.name)
    assert host.value == 0.0 and host.labels["gpu"] == second.sibling
    assert len(_samples(families, "dradriver_gpu_passthrough")) == len(node.inventory.vfio)
    for name in (first.name, first.sibling, second.name):
        assert _value(families, "dradriver_device_health", "dradriver_device_health", state="unknown",
                      device=name) == 1
    assert _value(families, "dradriver_device_health", "dradriver_device_health", state="healthy",
                  device=second.sibling) == 1
    assert _samples(families, "dradriver_gpu_temperature_celsius", device=first.sibling) == []  # not polled
    assert _samples(families, "dradriver_gpu_temperature_celsius", device=second.sibling)
