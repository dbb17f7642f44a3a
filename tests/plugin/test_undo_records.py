"""Undo records across releases (downgrade safety): a claim prepared by a newer release is unprepared by this one
from the facts its records hold, and a record that says only a newer reader can undo it keeps the claim with a
message that says what to do. The newer writer is played by rewriting the stored payload as it would write it,
then this release starts over that claim state (as a rollback of the DaemonSet does) and the kubelet unprepares
over real gRPC; GPU settings are read back through the mock NVML."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dradriver.domain.claims import ClaimRef
from dradriver.nvml import settings
from dradriver.sandbox.node import SandboxNode
from tests.configs.test_plugin import allocate
from tests.plugin.conftest import ref_of, result, running
from tests.plugin.test_timeslicing import GATE_ON, plugin_payload, session_of, time_slicing, uuid_of


def as_a_newer_release_writes(payload: str, *, reader: int | None = None) -> str:
    """The payload a later release would store for the same claim: payload and record layouts 2, more facts per
    record and per GPU (which this release does not know), and with ``reader`` the oldest reader layout it
    declares."""
    doc: dict[str, Any] = json.loads(payload)
    doc["v"] = 2
    doc["preparedBy"] = "dradriver 9.9.0"
    for record in doc["undo"]:
        record["v"] = 2
        record["data"]["writtenAt"] = "2027-01-01T00:00:00Z"
        if reader is not None:
            record["reader"] = reader
        for gpu in record["data"].get("gpus", []):
            gpu["timesliceBefore"] = 0
            gpu["schedulingPolicy"] = "equal-share"
    return json.dumps(doc)


async def prepared_by_a_newer_release(sandbox: SandboxNode, name: str, *,
                                      reader: int | None = None) -> tuple[ClaimRef, str]:
    """Prepare a claim time-slicing ``gpu-0`` (``Long``; the GPU was ``EXCLUSIVE_PROCESS`` before) and rewrite its
    stored payload as a newer release would have written it; the plugin is stopped after. Returns the claim and
    the GPU's UUID."""
    async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
        gpu0 = uuid_of(plugin, "gpu-0")
        settings.set_compute_mode(session_of(plugin), gpu0, settings.ComputeMode.EXCLUSIVE_PROCESS)
        ref = ref_of(allocate(sandbox, name, [result("gpu-0")], [time_slicing("Long")]))
        assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        newer = as_a_newer_release_writes(plugin_payload(plugin, ref.uid), reader=reader)
        plugin.state.prepare_completed(ref.uid, payload=newer)
    return ref, gpu0


def test_a_newer_releases_records_are_undone_from_their_facts(sandbox: SandboxNode) -> None:
    async def body() -> None:
        ref, gpu0 = await prepared_by_a_newer_release(sandbox, "newer")
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            nvml = session_of(plugin)
            assert settings.compute_timeslice(nvml, gpu0) == 3
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
            assert settings.compute_timeslice(nvml, gpu0) == 0
            assert settings.compute_mode(nvml, gpu0) is settings.ComputeMode.EXCLUSIVE_PROCESS
            assert plugin.state.get(ref.uid) is None

    asyncio.run(body())


def test_a_record_that_needs_a_newer_reader_keeps_the_claim_and_says_what_to_do(sandbox: SandboxNode) -> None:
    async def body() -> None:
        ref, gpu0 = await prepared_by_a_newer_release(sandbox, "newest", reader=2)
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            error = (await kubelet.unprepare([ref]))[ref.uid]
            assert "'timeslicing' undo record of 'gpu-0' (layout 2) needs a reader of layout 2 or newer" in error
            assert "this plugin reads layout 1" in error
            assert "Run that release (or a newer one) to unprepare the claim" in error
            assert gpu0 in error  # the record's facts: what an operator would undo by hand
            assert plugin.state.get(ref.uid) is not None  # kept: nothing was undone on a guess
            assert settings.compute_timeslice(session_of(plugin), gpu0) == 3

    asyncio.run(body())
