"""The running kubelet plugin turns an NVML Xid into a slice taint, an UNHEALTHY health report and metrics."""

from __future__ import annotations

import asyncio
import ctypes
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from dradriver.domain.faults import NO_MIG_SCOPE
from dradriver.nvml import mock
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for

EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError


def test_xid_79_reaches_slice_health_stream_and_metrics(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config(http_endpoint="127.0.0.1:0")) as (plugin, kubelet):
            assert plugin.metrics_server is not None
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("watched")), [result("gpu-0")])
            assert (await kubelet.prepare([ref_of(claim)]))[claim["metadata"]["uid"]].error == ""
            stream = kubelet.watch_health()
            first = await stream.__anext__()
            assert {d.device_name for d in first} >= {"gpu-0", "gpu-1"}
            assert all(d.health == "Healthy" for d in first)

            gpu0 = next(g for g in plugin.inventory.gpus if g.name == "gpu-0")
            lib = ctypes.CDLL(str(mock.library_path()))
            rc = lib.mocknvml_inject_event(ctypes.c_uint(gpu0.index), ctypes.c_ulonglong(EVENT_XID),
                                           ctypes.c_ulonglong(79), ctypes.c_uint(NO_MIG_SCOPE),
                                           ctypes.c_uint(NO_MIG_SCOPE))
            assert rc == 0

            def tainted() -> bool:
                for obj in sandbox.api.objects("ResourceSlice") if sandbox.api else []:
                    for dev in obj["spec"]["devices"]:
                        if dev["name"] == "gpu-0" and dev.get("taints"):
                            return True
                return False

            await wait_for(tainted)
            devices = [d for s in sandbox.api.objects("ResourceSlice") for d in s["spec"]["devices"]]
            [dev] = [d for d in devices if d["name"] == "gpu-0"]
            expected = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
            assert expected.items() <= dev["taints"][0].items()
            others = [d for d in devices if d["name"] != "gpu-0"]
            assert all(not d.get("taints") for d in others)

            report = None
            while report is None:
                message = await asyncio.wait_for(stream.__anext__(), timeout=15)
                report = next((d for d in message if d.device_name == "gpu-0" and d.health == "Unhealthy"), None)
            assert "79" in report.message
            await stream.aclose()

            url = plugin.metrics_server.url
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            families = {f.name: f for f in text_string_to_metric_families(text)}
            unhealthy = [s for s in families["dradriver_device_health"].samples
                         if s.labels.get("device") == "gpu-0" and s.labels.get("state") == "unhealthy"]
            assert unhealthy and unhealthy[0].value == 1
            assert unhealthy[0].labels.get("claim") == "watched"
            last_xid = [s for s in families["dradriver_gpu_last_xid"].samples if s.labels.get("device") == "gpu-0"]
            assert last_xid and last_xid[0].value == 79
            prepares = [s for s in families["nvidia_dra_requests"].samples if s.labels.get("operation") == "prepare"]
            assert prepares and prepares[0].value >= 1

    asyncio.run(body())


def test_empty_metrics_path_disables_the_metrics_server(sandbox: SandboxNode) -> None:
    """NVIDIA's ``--metrics-path``: "disabled if empty" (``gpu-kubelet-plugin --help``)."""

    async def body() -> None:
        async with running(sandbox.config(http_endpoint="127.0.0.1:0", metrics_path="")) as (plugin, _kubelet):
            assert plugin.metrics_server is None
            assert plugin.metrics is not None  # the counters still run; only the endpoint is off

    asyncio.run(body())
