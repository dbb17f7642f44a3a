"""``--dcgm-compatible``: dcgm-exporter's ``DCGM_FI_*`` names, types, units and labels, parsed back with
prometheus-client's parser; DRA attribution labels on prepared devices; the exporter command serving them."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dradriver.domain.holders import DeviceHolder
from dradriver.health.dcgm import (
    BASE_LABELS,
    DRA_LABELS,
    DRA_MIG_LABELS,
    MIG_LABELS,
    NODE_LABELS,
    exposition,
    nvml_bus_id,
)
from dradriver.health.metrics import DriverMetrics, exporter_registry
from dradriver.sandbox.podresources import PodResourcesServer
from dradriver.server.podresources import PodResourcesError, encode_response, holders, list_holders

from .conftest import MockNode, Services, TaintLog

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
DEFAULT_COUNTERS = {  # dcgm-exporter etc/default-counters.csv entries NVML serves, with their types
    "DCGM_FI_DEV_SM_CLOCK": "gauge", "DCGM_FI_DEV_MEM_CLOCK": "gauge", "DCGM_FI_DEV_GPU_TEMP": "gauge",
    "DCGM_FI_DEV_POWER_USAGE": "gauge", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter",
    "DCGM_FI_DEV_GPU_UTIL": "gauge", "DCGM_FI_DEV_MEM_COPY_UTIL": "gauge", "DCGM_FI_DEV_XID_ERRORS": "gauge",
    "DCGM_FI_DEV_FB_FREE": "gauge", "DCGM_FI_DEV_FB_USED": "gauge",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "counter", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
}


def _parse(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_bus_id_is_spelled_as_nvml_spells_it() -> None:
    assert nvml_bus_id("0000:07:00.0") == "00000000:07:00.0"
    assert nvml_bus_id("0001:bd:1f.7") == "00000001:BD:1F.7"


def test_default_counters_with_dcgm_units_and_labels(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    log = TaintLog()
    service = services(node, log)
    service.start()
    node.xid(2, 79)
    log.wait_for(bool, "a taint update")
    registry = exporter_registry(service, node="node-a", dcgm_compatible=True, process_metrics=False)
    text = exposition(registry).decode()
    assert "dradriver_gpu_" not in text and "dradriver_device_" not in text  # NVML error counts stay
    families = _parse(text)
    for name, kind in DEFAULT_COUNTERS.items():
        # dcgm-exporter's exact names: "# TYPE <field> counter" and samples without a _total suffix
        assert f"\n# TYPE {name} {kind}\n{name}{{" in text, name
        assert families[name].type == kind, name
    assert "dradriver_nvml_errors_total" in text
    gpu2 = node.inventory.gpus[2]
    labels = {"gpu": str(gpu2.index), "UUID": gpu2.uuid, "pci_bus_id": nvml_bus_id(gpu2.pci_bus_id),
              "device": f"nvidia{gpu2.minor}", "modelName": gpu2.product_name, "Hostname": "node-a",
              "DCGM_FI_DRIVER_VERSION": node.inventory.versions.driver}

    def value(name: str, **want: str) -> float:
        found = [s for s in families[name].samples if all(s.labels.get(k) == v for k, v in want.items())]
        assert len(found) == 1, (name, want, found)
        return float(found[0].value)

    [sample] = [s for s in families["DCGM_FI_DEV_FB_USED"].samples if s.labels["UUID"] == gpu2.uuid
                and "GPU_I_ID" not in s.labels]
    assert sample.labels == labels
    latest = service.latest_sample()
    assert latest is not None
    sample_bytes = latest.get(gpu2.uuid, "memory_used_bytes")
    power_mw = latest.get(gpu2.uuid, "power_usage_milliwatts")
    assert sample_bytes is not None and power_mw is not None
    assert value("DCGM_FI_DEV_FB_USED", **labels) == pytest.approx(sample_bytes / 2**20)
    total = gpu2.memory_bytes or 0
    assert value("DCGM_FI_DEV_FB_USED", **labels) + value("DCGM_FI_DEV_FB_FREE", **labels) <= total / 2**20 + 1
    assert value("DCGM_FI_DEV_POWER_USAGE", **labels) == pytest.approx(power_mw / 1000)
    assert 0 <= value("DCGM_FI_DEV_GPU_UTIL", **labels) <= 100
    assert value("DCGM_FI_DEV_SM_CLOCK", **labels) > 100  # MHz, not Hz
    assert value("DCGM_FI_DEV_XID_ERRORS", **labels) == 79
    assert value("DCGM_FI_DEV_XID_ERRORS", UUID=node.inventory.gpus[3].uuid) == 0

    mig = node.inventory.migs[0]
    mig_samples = [s for s in families["DCGM_FI_DEV_FB_USED"].samples if s.labels.get("GPU_I_ID")]
    assert mig_samples, "MIG devices report framebuffer use"
    [mig_sample] = [s for s in mig_samples if s.labels["GPU_I_ID"] == str(mig.gi_id)
                    and s.labels["UUID"] == mig.parent.uuid]
    assert set(mig_sample.labels) == {*BASE_LABELS, *MIG_LABELS, *NODE_LABELS}
    assert mig_sample.labels["GPU_I_PROFILE"] == mig.profile and mig_sample.labels["gpu"] == str(mig.parent.index)
    assert not [s for s in families["DCGM_FI_DEV_GPU_TEMP"].samples if "GPU_I_ID" in s.labels]


def test_prepared_devices_carry_dra_attribution(mock_node: Any, services: Services) -> None:
    node: MockNode = mock_node("dgx-a100")
    service = services(node, TaintLog())
    service.start()
    mig = node.inventory.migs[0]
    claims = {"gpu-3": [("team-a", "training")], mig.name: [("team-b", "notebook")]}
    metrics = DriverMetrics(node="node-a", process_metrics=False)
    metrics.attach_devices(service, claim_of=claims.get, dcgm_compatible=True)
    families = _parse(exposition(metrics.registry).decode())
    assert "dradriver_gpu_memory_used_bytes" not in families
    assert "nvidia_dra_requests" in families  # the driver's own metrics stay
    used = families["DCGM_FI_DEV_FB_USED"].samples
    [gpu3] = [s for s in used if s.labels.get("dra_device_name") == "gpu-3"]
    assert {k: gpu3.labels[k] for k in DRA_LABELS} == {
        "dra_claim_name": "training", "dra_claim_namespace": "team-a", "dra_device_name": "gpu-3",
        "dra_driver_name": "gpu.nvidia.com", "dra_pool_name": "node-a"}
    assert not set(DRA_MIG_LABELS) & set(gpu3.labels)
    [on_mig] = [s for s in used if s.labels.get("dra_device_name") == mig.name]
    assert on_mig.labels["dra_mig_device_uuid"] == mig.uuid and on_mig.labels["dra_mig_profile"] == mig.profile
    assert on_mig.labels["dra_claim_namespace"] == "team-b" and on_mig.labels["GPU_I_ID"] == str(mig.gi_id)
    idle = [s for s in used if s.labels["UUID"] == node.inventory.gpus[4].uuid]
    assert idle and not any(k.startswith("dra_") for s in idle for k in s.labels)


def _pod_resources() -> Any:
    return encode_response([
        ("trainer-0", "team-a", "cuda", "trainer-0-gpu", "team-a", [("gpu.nvidia.com", "n1", "gpu-1")]),
        ("trainer-0", "team-a", "sidecar", "other", "team-a", [("example.com/nic", "n1", "gpu-0")]),
        ("elsewhere", "team-b", "c", "x", "team-b", [("gpu.nvidia.com", "other-node", "gpu-0")]),
    ])


def test_holders_keep_this_drivers_devices_of_this_pool() -> None:
    found = holders(_pod_resources(), driver="gpu.nvidia.com", pool="n1")
    assert set(found) == {"gpu-1"}
    assert found["gpu-1"] == (DeviceHolder("trainer-0", "team-a", "cuda", "trainer-0-gpu", "team-a", "n1"),)
    every_pool = holders(_pod_resources(), driver="gpu.nvidia.com", pool=None)
    assert {d: [h.pool for h in held] for d, held in every_pool.items()} == {"gpu-1": ["n1"], "gpu-0": ["other-node"]}


def test_pod_resources_attribution_in_the_exporter(mock_node: Any, services: Services, short_dir: Path) -> None:
    node: MockNode = mock_node("dgx-a100")
    service = services(node, TaintLog())
    service.start()
    mig = node.inventory.migs[1]
    response = encode_response([("nb", "team-b", "jupyter", "nb-gpu", "team-b", [("gpu.nvidia.com", "node-a",
                                                                                  mig.name)])])
    sock = short_dir / "kubelet.sock"
    with PodResourcesServer(sock, lambda: response) as server:
        lookup = list_holders(str(sock), driver="gpu.nvidia.com", pool="node-a")
        registry = exporter_registry(service, node="node-a", dcgm_compatible=True, process_metrics=False,
                                     holders=lambda: list_holders(str(sock), driver="gpu.nvidia.com", pool="node-a"))
        families = _parse(exposition(registry).decode())
        assert server.calls == 2  # once above, once for the scrape
    assert set(lookup) == {mig.name}
    [held] = [s for s in families["DCGM_FI_DEV_FB_USED"].samples if s.labels.get("dra_device_name") == mig.name]
    assert {k: held.labels[k] for k in ("pod", "namespace", "container", "dra_claim_name", "dra_claim_namespace",
                                        "dra_pool_name", "dra_mig_device_uuid", "dra_mig_profile")} == {
        "pod": "nb", "namespace": "team-b", "container": "jupyter", "dra_claim_name": "nb-gpu",
        "dra_claim_namespace": "team-b", "dra_pool_name": "node-a", "dra_mig_device_uuid": mig.uuid,
        "dra_mig_profile": mig.profile}
    with pytest.raises(PodResourcesError, match=str(sock)):
        list_holders(str(sock), driver="gpu.nvidia.com", pool="node-a", timeout_s=1)


def test_exporter_command_serves_dcgm_names_on_request(short_dir: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = short_dir / "kubelet.sock"
    served = PodResourcesServer(sock, _pod_resources).start()
    proc = subprocess.Popen([sys.executable, "-m", "dradriver", "exporter", "--mock-profile", "l4-inference",
                             "--node-name", "n1", "--http-endpoint", f"127.0.0.1:{port}", "--dcgm-compatible",
                             "--pod-resources-socket", str(sock)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        text = ""
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                    text = answer.read().decode()
                break
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        assert text, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        served.stop()
    assert "\n# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text
    families = _parse(text)
    assert families["DCGM_FI_DEV_GPU_TEMP"].type == "gauge"
    assert {s.labels["Hostname"] for s in families["DCGM_FI_DEV_GPU_TEMP"].samples} == {"n1"}
    assert len(families["DCGM_FI_DEV_GPU_TEMP"].samples) == 2
    assert not any(name.startswith("dradriver_gpu_") for name in families)
    [held] = [s for s in families["DCGM_FI_DEV_GPU_TEMP"].samples if s.labels.get("dra_device_name")]
    assert (held.labels["dra_device_name"], held.labels["pod"], held.labels["container"]) == ("gpu-1", "trainer-0",
                                                                                               "cuda")
