"""The device status writer's start-up re-queue (:meth:`DeviceStatusWriter.requeue`) against the API emulator over
HTTP with the official client: a prepared claim missing its entries gets them, one whose entries are in place is
read and not written, one with nothing to describe is not queued, and a newer write of a claim wins over the
re-queued one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.claims import ClaimRef
from dradriver.domain.ports import UndoRecord
from dradriver.kube import claims as kube_claims
from dradriver.kube.client import KubeClient, RetryPolicy, open_client
from dradriver.kubeletplugin.devicestatus import DeviceData, DeviceStatusWriter
from dradriver.sandbox.apiserver import ApiServerEmulator

DRIVER, POOL = "gpu.nvidia.com", "node-a"


@pytest.fixture
def api_client(tmp_path: Path) -> Iterator[tuple[ApiServerEmulator, KubeClient]]:
    with ApiServerEmulator(schema_version="1.34") as api:
        api.add_node(POOL, allocatable={"cpu": "64", "memory": "512Gi", "pods": "110"})
        with open_client(api.kubeconfig_path(tmp_path), connect_timeout_s=2.0, read_timeout_s=10.0,
                         retry=RetryPolicy(attempts=2, initial_delay_s=0.01, max_delay_s=0.05, jitter=0.0)) as kube:
            yield api, kube


def _claim(api: ApiServerEmulator, name: str, device: str) -> ClaimRef:
    stored = api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                         "metadata": {"name": name, "namespace": "default"},
                         "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                             "deviceClassName": DRIVER}}]}}})
    stored["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": device}]}}}
    meta = api.update(stored, subresource="status")["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


def _describe(records: Sequence[UndoRecord]) -> dict[str, DeviceData]:
    return {r.target: dict(r.data) for r in records if r.data}


def _record(device: str, **data: Any) -> UndoRecord:
    return UndoRecord("gpu", 1, device, data)


def _entries(api: ApiServerEmulator, name: str) -> list[dict[str, Any]]:
    return list(((api.get("ResourceClaim", name, "default") or {}).get("status") or {}).get("devices") or [])


def _version(api: ApiServerEmulator, name: str) -> str:
    return str((api.get("ResourceClaim", name, "default") or {})["metadata"]["resourceVersion"])


def test_requeue_writes_missing_entries_only_and_skips_claims_with_nothing_to_describe(
        api_client: tuple[ApiServerEmulator, KubeClient]) -> None:
    api, client = api_client
    missing = _claim(api, "missing", "gpu-0")
    in_place = _claim(api, "in-place", "gpu-1")
    bare = _claim(api, "bare", "gpu-2")
    kube_claims.publish_device_status(client, in_place, driver=DRIVER, pool=POOL, devices={"gpu-1": {"uuid": "B"}})
    before = _version(api, "in-place")
    writer = DeviceStatusWriter(client, driver=DRIVER, pool=POOL, describe=_describe, settle_s=0.0,
                                requeue_spacing_s=0.0)
    try:
        queued = writer.requeue([(missing, [_record("gpu-0", uuid="A")]), (in_place, [_record("gpu-1", uuid="B")]),
                                 (bare, [_record("gpu-2")])])
        assert queued == 2
        assert writer.flush()
        assert [e["data"] for e in _entries(api, "missing")] == [{"uuid": "A"}]
        assert _version(api, "in-place") == before  # read, found as wanted, not written
        assert _entries(api, "bare") == []
        assert writer.writes == 2
    finally:
        writer.close()


def test_a_write_queued_before_the_requeue_wins_over_it(api_client: tuple[ApiServerEmulator, KubeClient]) -> None:
    api, client = api_client
    ref = _claim(api, "newer", "gpu-0")
    writer = DeviceStatusWriter(client, driver=DRIVER, pool=POOL, describe=_describe, settle_s=0.2,
                                requeue_spacing_s=0.0)
    try:
        writer.prepared(ref, [_record("gpu-0", uuid="NEW")])
        assert writer.requeue([(ref, [_record("gpu-0", uuid="OLD")])]) == 0
        assert writer.flush()
        assert [e["data"] for e in _entries(api, "newer")] == [{"uuid": "NEW"}]
        assert writer.writes == 1
    finally:
        writer.close()
