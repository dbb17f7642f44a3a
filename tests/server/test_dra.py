"""NodePrepareResources / NodeUnprepareResources: per-claim isolation, v1beta1 parity, batch failures."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from dradriver._proto import dra_v1_pb2
from dradriver.domain.claims import ClaimResult
from dradriver.domain.ports import ClaimPreparer
from dradriver.errors import DradriverError
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.server import start_servers

from .conftest import TablePreparer, claims, make_config, run

pytestmark = pytest.mark.timeout(15)

T = TypeVar("T")
BOTH = pytest.mark.parametrize("service", ["v1.DRAPlugin", "v1beta1.DRAPlugin"])


def with_plugin(short_dir: Path, preparer: ClaimPreparer, body: Callable[[PluginConnection], Awaitable[T]]) -> T:
    async def scenario() -> T:
        config = make_config(short_dir)
        async with await start_servers(config, preparer):
            async with KubeletEmulator(config.kubelet_registrar_directory_path) as kubelet:
                return await body(await kubelet.wait_for_plugin("gpu.nvidia.com"))

    return run(scenario())


@BOTH
def test_one_bad_claim_does_not_fail_the_batch(short_dir: Path, service: str) -> None:
    bad = "claim default/claim-u2 (uid u2): device gpu-7 does not exist in pool node-a"
    preparer = TablePreparer(failing={"u2": bad})

    async def body(plugin: PluginConnection) -> dict[str, ClaimResult]:
        return await plugin.prepare(claims("u1", "u2", "u3"), service=service)

    results = with_plugin(short_dir, preparer, body)
    assert sorted(results) == ["u1", "u2", "u3"]
    assert results["u2"] == ClaimResult(error=bad)
    for uid, index in (("u1", 0), ("u3", 2)):
        (device,) = results[uid].devices
        assert results[uid].error == ""
        assert (device.pool_name, device.device_name, device.request_names) == ("node-a", f"gpu-{index}", ("gpu",))
        assert device.cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={uid}-gpu-{index}",)
    assert [[c.uid for c in batch] for batch in preparer.prepared] == [["u1", "u2", "u3"]]
    assert preparer.prepared[0][0].namespace == "default" and preparer.prepared[0][0].name == "claim-u1"


def test_v1beta1_matches_v1_except_share_id(short_dir: Path) -> None:
    async def body(plugin: PluginConnection) -> tuple[dict[str, ClaimResult], dict[str, ClaimResult]]:
        batch = claims("u1", "u2")
        return await plugin.prepare(batch, service="v1.DRAPlugin"), await plugin.prepare(
            batch, service="v1beta1.DRAPlugin"
        )

    v1, v1beta1 = with_plugin(short_dir, TablePreparer(), body)
    assert v1["u2"].devices[0].share_id == "share-1"  # v1 field 5
    assert v1["u1"].devices[0].share_id is None  # unset, not ""
    assert v1beta1["u2"].devices[0].share_id is None  # v1beta1 has no share_id
    for uid in ("u1", "u2"):
        assert [dataclasses.replace(d, share_id=None) for d in v1[uid].devices] == list(v1beta1[uid].devices)


@BOTH
def test_empty_requests_get_empty_responses(short_dir: Path, service: str) -> None:
    preparer = TablePreparer()

    async def body(plugin: PluginConnection) -> tuple[dict[str, ClaimResult], dict[str, str]]:
        return await plugin.prepare([], service=service), await plugin.unprepare([], service=service)

    assert with_plugin(short_dir, preparer, body) == ({}, {})
    assert preparer.prepared == [] and preparer.unprepared == []


@BOTH
def test_unexpected_exception_becomes_per_claim_errors(
    short_dir: Path, service: str, caplog: pytest.LogCaptureFixture
) -> None:
    preparer = TablePreparer(raise_on_prepare=ZeroDivisionError("boom"), raise_on_unprepare=KeyError("gone"))

    async def body(plugin: PluginConnection) -> tuple[dict[str, ClaimResult], dict[str, str]]:
        return await plugin.prepare(claims("u1", "u2"), service=service), await plugin.unprepare(
            claims("u1", "u2"), service=service
        )

    with caplog.at_level(logging.ERROR, logger="dradriver.server.dra"):
        prepared, unprepared = with_plugin(short_dir, preparer, body)
    assert sorted(prepared) == ["u1", "u2"]
    for uid in ("u1", "u2"):
        error = prepared[uid].error
        assert error.startswith(f"claim default/claim-{uid} (uid {uid}): internal error in the DRA plugin")
        assert "ZeroDivisionError" in error and not prepared[uid].devices
        assert "KeyError" in unprepared[uid]
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert {type(r.exc_info[1]) for r in tracebacks if r.exc_info} == {ZeroDivisionError, KeyError}


def test_dradriver_error_for_the_batch_names_each_claim(short_dir: Path) -> None:
    preparer = TablePreparer(raise_on_prepare=DradriverError("node-wide claim state is locked by another instance"))

    async def body(plugin: PluginConnection) -> dict[str, ClaimResult]:
        return await plugin.prepare(claims("u1", "u2"))

    results = with_plugin(short_dir, preparer, body)
    assert results["u1"].error == (
        "claim default/claim-u1 (uid u1): node-wide claim state is locked by another instance"
    )
    assert results["u2"].error.startswith("claim default/claim-u2 (uid u2): ")


def test_missing_and_unrequested_results(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    preparer = TablePreparer(omit=["u2"], extra=["stranger"])

    async def body(plugin: PluginConnection) -> tuple[dict[str, ClaimResult], dict[str, str]]:
        return await plugin.prepare(claims("u1", "u2")), await plugin.unprepare(claims("u1", "u2"))

    prepared, unprepared = with_plugin(short_dir, preparer, body)
    assert sorted(prepared) == ["u1", "u2"]  # the kubelet would reject an unrequested UID
    assert prepared["u1"].ok
    assert prepared["u2"].error == "claim default/claim-u2 (uid u2): the DRA plugin returned no result for this claim"
    assert unprepared == {
        "u1": "",
        "u2": "claim default/claim-u2 (uid u2): the DRA plugin returned no result for this claim",
    }
    assert "stranger" in caplog.text


@BOTH
def test_unprepare_per_claim_errors(short_dir: Path, service: str) -> None:
    preparer = TablePreparer(failing={"u1": "claim default/claim-u1 (uid u1): CDI spec file is not removable"})

    async def body(plugin: PluginConnection) -> dict[str, str]:
        return await plugin.unprepare(claims("u1", "u2"), service=service)

    assert with_plugin(short_dir, preparer, body) == {
        "u1": "claim default/claim-u1 (uid u1): CDI spec file is not removable",
        "u2": "",
    }
    assert [[c.uid for c in batch] for batch in preparer.unprepared] == [["u1", "u2"]]


def test_incomplete_claims_are_refused_per_claim(short_dir: Path) -> None:
    preparer = TablePreparer()

    async def scenario() -> dra_v1_pb2.NodePrepareResourcesResponse:
        config = make_config(short_dir)
        async with await start_servers(config, preparer):
            async with grpc.aio.insecure_channel(f"unix:{config.dra_socket}") as channel:
                from dradriver._proto import dra_v1_pb2_grpc

                stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
                request = dra_v1_pb2.NodePrepareResourcesRequest(
                    claims=[
                        dra_v1_pb2.Claim(namespace="default", uid="u1", name="ok"),
                        dra_v1_pb2.Claim(namespace="", uid="u2", name="no-namespace"),
                        dra_v1_pb2.Claim(namespace="default", uid="u1", name="ok"),  # repeated
                    ]
                )
                response: dra_v1_pb2.NodePrepareResourcesResponse = await stub.NodePrepareResources(request, timeout=5)
                return response

    response = run(scenario())
    assert sorted(response.claims) == ["u1", "u2"]
    assert response.claims["u1"].error == "" and len(response.claims["u1"].devices) == 1
    assert response.claims["u2"].error == "claim /no-namespace (uid u2): empty namespace in the kubelet's request"
    assert [[c.uid for c in batch] for batch in preparer.prepared] == [["u1"]]
