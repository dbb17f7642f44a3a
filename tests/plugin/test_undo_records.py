"""Undo records across releases (downgrade safety): a claim prepared by a newer release is unprepared by this one
from the facts its records hold, and a record that says only a newer reader can undo it keeps the claim with a
message that says what to do. The newer writer is played by rewriting the stored payload as it would write it,
then this release starts over that claim state (as a rollback of the DaemonSet does) and the kubelet unprepares
over real gRPC; GPU settings are read back through the mock NVML."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.claims import ClaimRef
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE
from dradriver.nvml import settings
from dradriver.sandbox.node import SandboxNode
from tests.configs.test_plugin import allocate
from tests.plugin import undo_fixtures
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


# -- golden records: what each release wrote, undone by this one and readable by the ones before ----------------

def undoable_by_97aaf35(payload: str) -> list[str]:
    """Why the release at commit 97aaf35 (before undo records had a ``reader``) could not unprepare a claim stored
    with ``payload``; ``[]`` when it could. A frozen copy of that release's reading rule, a test oracle, not product
    code (``git show 97aaf35:dradriver/kubeletplugin/runner.py``: ``read_payload``, ``_undo``;
    ``dradriver/domain/ports.py``: ``UndoRecord.from_json``; each kind's ``undo`` in ``dradriver/preparers/``):

    * a payload not starting with ``{`` is a bare spec path with no records; else a JSON object whose ``undo`` is a
      list, ``pins`` and ``shares`` objects, ``aborted_at`` a number;
    * a record has ``kind`` (str), ``v`` (int), ``target`` (str), ``data`` (object); other keys are ignored, so a
      ``reader`` above 1 is not honoured: 97aaf35 would undo such a record from facts whose meaning changed;
    * its kind has a part registered (the GPU plugin with its gates on, the compute-domain plugin), or is the
      alias ``mig-timeslicing``; otherwise ``no preparer of kind ...``;
    * ``timeslicing`` records must be version 1, each ``gpus`` entry has a ``uuid`` and an integer
      ``computeMode`` when present; ``dynamic-mig`` records have ``parentUUID`` and integer ``giId``,
      ``placementStart`` and ``giProfileId``; the other kinds read optional facts only.
    """
    known = {"gpu", "mig", "exclusive", "timeslicing", "mig-timeslicing", "mps", "dynamic-mig", "gpu-share",
             "imex-channel", "imex-daemon"}
    if not payload.startswith("{"):
        return []
    try:
        doc = json.loads(payload)
    except ValueError as exc:
        return [f"payload is not JSON: {exc}"]
    if not isinstance(doc, dict) or not isinstance(doc.get("undo", []), list) \
            or not isinstance(doc.get("pins", {}), dict) or not isinstance(doc.get("shares", {}), dict):
        return ["not a payload document"]
    aborted = doc.get("aborted_at")
    if aborted is not None and (not isinstance(aborted, int | float) or isinstance(aborted, bool)):
        return ["aborted_at is not a number"]
    problems: list[str] = []
    for raw in doc.get("undo", []):
        if not isinstance(raw, dict) or not all(k in raw for k in ("kind", "v", "target")):
            problems.append(f"undo record {raw!r}: missing field")
            continue
        kind, version, target, data = raw["kind"], raw["v"], raw["target"], raw.get("data", {})
        if not isinstance(kind, str) or not isinstance(version, int) or not isinstance(target, str) \
                or not isinstance(data, dict):
            problems.append(f"undo record {raw!r}: wrong field types")
            continue
        if raw.get("reader", 1) != 1:
            problems.append(f"{kind} record of {target}: reader {raw['reader']} is ignored by 97aaf35")
        if kind not in known:
            problems.append(f"no preparer of kind {kind!r} to undo {target!r}")
        elif kind == "timeslicing":
            if version != 1:
                problems.append(f"time-slicing undo record version {version} is not known")
            for entry in [e for e in data.get("gpus", ()) if isinstance(e, dict)]:
                if "uuid" not in entry:
                    problems.append(f"timeslicing record of {target}: a GPU entry without uuid")
                if "computeMode" in entry and not isinstance(entry["computeMode"], int):
                    problems.append(f"timeslicing record of {target}: computeMode is not an integer")
        elif kind == "dynamic-mig":
            if "parentUUID" not in data:
                problems.append(f"dynamic-mig record of {target}: no parentUUID")
            for name in ("giId", "placementStart", "giProfileId"):
                if not isinstance(data.get(name), int):
                    problems.append(f"dynamic-mig record of {target}: {name} is not an integer")
    return problems


FIXTURE_FILES = undo_fixtures.fixture_files()


def _fixture(path: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _record_kinds() -> dict[str, str]:
    """Kind -> class of every preparer and sharing step of this release (a class of ``dradriver.preparers`` with
    a ``kind`` and an ``undo``)."""
    import importlib
    import inspect
    import pkgutil

    import dradriver.preparers

    out: dict[str, str] = {}
    for info in pkgutil.iter_modules(dradriver.preparers.__path__):
        module = importlib.import_module(f"dradriver.preparers.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            kind = getattr(cls, "kind", None)
            if cls.__module__ == module.__name__ and isinstance(kind, str) and kind and callable(
                    getattr(cls, "undo", None)):
                out[kind] = f"{module.__name__}.{name}"
    return out


def test_every_kind_this_release_registers_has_a_golden_record() -> None:
    """A kind added without its fixture fails here: add its scenario to ``tests/plugin/undo_fixtures.py`` and run
    ``python -m tests.plugin.undo_fixtures``."""
    kinds = {r["kind"] for path in FIXTURE_FILES for r in _fixture(path)["payload"]["undo"]}
    registered = _record_kinds()
    assert {"gpu", "mig", "exclusive", "timeslicing", "mps", "dynamic-mig", "gpu-share", "imex-channel",
            "imex-daemon"} <= set(registered)
    assert set(registered) <= kinds, {k: registered[k] for k in set(registered) - kinds}
    assert {s.kind for s in undo_fixtures.SCENARIOS} == {_fixture(p)["kind"] for p in FIXTURE_FILES}


KINDS_AFTER_97AAF35 = frozenset({"vfio", "fm-partition"})
"""Kinds 97aaf35 had no part for (VFIO passthrough and Fabric Manager partitions came later): a downgrade to it
refuses to unprepare such a claim (``no preparer of kind``; the claim stays recorded until a release that knows
the kind runs) rather than dropping what the record says was done."""


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_golden_record_is_readable_by_the_release_before_readers(path: Any) -> None:
    """What a release wrote can be unprepared by the release of commit 97aaf35 (a downgrade): its reading rule,
    frozen in :func:`undoable_by_97aaf35`, accepts the stored payload; a record of a kind that came later is
    refused by name, and nothing else of the payload is."""
    doc = _fixture(path)
    payload = undo_fixtures.materialise(doc["payload"], Path("/var/lib/kubelet/plugins"), "0000-uid")
    later = [r for r in doc["payload"]["undo"] if r["kind"] in KINDS_AFTER_97AAF35]
    assert undoable_by_97aaf35(payload) == [f"no preparer of kind {r['kind']!r} to undo {r['target']!r}"
                                            for r in later]


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_golden_record_is_undone_by_this_release(path: Any, tmp_path: Path) -> None:
    """The claim of the fixture's kind is prepared on a fresh node, its stored payload replaced by the golden one
    (as the release that wrote it stored it), the plugin restarted (an upgrade or downgrade of the DaemonSet), and
    the kubelet's unprepare undoes what the golden record says was done."""
    doc = _fixture(path)
    scenario = undo_fixtures.scenario_of(doc["kind"])

    async def body() -> None:
        with scenario.node(tmp_path) as node:
            config = scenario.config(node)
            async with scenario.running(config) as (plugin, kubelet):
                ref, ctx = await scenario.prepare(node, plugin, kubelet)
                golden = undo_fixtures.materialise(doc["payload"], node.root, ref.uid, ctx.get("marks"))
                plugin.state.prepare_completed(ref.uid, payload=golden)
            # The release that wrote the golden record kept NVIDIA's checkpoint of that record, not of the one this
            # release prepared (a consumable share's ID differs): the entry goes, the next start names it again
            # from the claim state, as after an upgrade from a release that kept no checkpoint.
            (config.plugin_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
            async with scenario.running(config) as (plugin, kubelet):
                assert undo_fixtures.stored_payload(plugin, ref.uid) == golden
                # the golden record owns what the claim made: nothing swept at start, all of it still there
                assert plugin.recovery.swept == () and ref.uid not in plugin.recovery.unusable
                scenario.held(node, plugin, ctx)
                assert (await kubelet.unprepare([ref]))[ref.uid] == ""
                scenario.undone(node, plugin, ctx)
                assert plugin.state.get(ref.uid) is None

    asyncio.run(body())


def test_the_frozen_rule_refuses_what_97aaf35_could_not_undo() -> None:
    """The oracle is not a yes-machine: the records 97aaf35 failed on are refused by it."""
    record = {"kind": "timeslicing", "v": 2, "target": "gpu-0", "data": {"gpus": [{"uuid": "GPU-1"}]}}
    assert undoable_by_97aaf35(json.dumps({"undo": [record]})) == [
        "time-slicing undo record version 2 is not known"]
    assert undoable_by_97aaf35(json.dumps({"undo": [{**record, "v": 1, "reader": 2}]})) == [
        "timeslicing record of gpu-0: reader 2 is ignored by 97aaf35"]
    assert undoable_by_97aaf35(json.dumps({"undo": [{"kind": "nvlink", "v": 1, "target": "gpu-0"}]})) == [
        "no preparer of kind 'nvlink' to undo 'gpu-0'"]
    dynamic = {"kind": "dynamic-mig", "v": 1, "target": "gpu-0-mig-1g10gb-19-0",
               "data": {"parentUUID": "GPU-1", "giId": 1, "placementStart": 0}}
    assert undoable_by_97aaf35(json.dumps({"undo": [dynamic]})) == [
        "dynamic-mig record of gpu-0-mig-1g10gb-19-0: giProfileId is not an integer"]
    assert undoable_by_97aaf35("/var/run/cdi/claim.yaml") == []
