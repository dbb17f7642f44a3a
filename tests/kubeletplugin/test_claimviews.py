"""The runner's views of the claims held (:mod:`dradriver.kubeletplugin.claimviews`): kept by the claims each batch
changed, they stay equal to a rebuild from every stored claim through prepares, failures, unprepares (a kept undo
included), adoptions, another instance's changes and a device leaving the registry; and a one-claim prepare or
unprepare reads its own claims only, however many are held."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.claims import AllocationResult, Claim, ClaimRef
from dradriver.host.claimstate import ClaimPhase, HeldDevice
from dradriver.kubeletplugin.claimviews import ClaimViews
from dradriver.kubeletplugin.payload import encode_payload
from dradriver.kubeletplugin.runner import BatchRunner
from tests.kubeletplugin.test_runner import (
    IDENTITY,
    POOL,
    FakePreparer,
    Node,
    _claim,
    _second_instance,
)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, FakePreparer("alpha"), FakePreparer("beta", fail_apply=["b1"], fail_undo_once=["b2"]))
    yield n
    n.runner.close()
    n.state.close()


def _admin(uid: str, name: str, device: str) -> Claim:
    """An admin-access claim ``team-a/<name>`` on ``device`` (several may hold one device)."""
    return Claim(ClaimRef("team-a", name, uid),
                 (AllocationResult("req", IDENTITY.driver_name, POOL, device, admin_access=True),))


def _kind_of(runner: BatchRunner) -> Callable[[str], str]:
    def kind(name: str) -> str:
        device = runner.registry.get(name)
        preparer = None if device is None else runner.preparer_for(device)
        return "unknown" if preparer is None else preparer.kind

    return kind


def _rebuilt(runner: BatchRunner) -> tuple[int, dict[str, int], dict[str, tuple[tuple[str, str], ...]]]:
    """What the views mean, computed from every stored claim: prepared claims (records less those holding nothing
    while PREPARE_STARTED), device entries by kind, and the owners of the completed claims per device."""
    claims = runner.state.claims()
    kind = _kind_of(runner)
    by_type: dict[str, int] = {}
    owners: dict[str, set[tuple[str, str]]] = {}
    marks = 0
    for record in claims.values():
        if not record.devices and record.phase is ClaimPhase.PREPARE_STARTED:
            marks += 1
        for dev in record.devices:
            by_type[kind(dev.device)] = by_type.get(kind(dev.device), 0) + 1
            if record.phase is ClaimPhase.PREPARE_COMPLETED:
                owners.setdefault(dev.device, set()).add((record.namespace, record.name))
    return len(claims) - marks, by_type, {d: tuple(sorted(o)) for d, o in owners.items()}


def _assert_views_match(runner: BatchRunner) -> tuple[int, dict[str, int], dict[str, Any]]:
    kept = (*runner.views.counts(), dict(runner.prepared_devices()))
    assert kept == _rebuilt(runner)
    fresh = ClaimViews(_kind_of(runner))
    fresh.rebuild(runner.state.claims().values())
    assert (*fresh.counts(), fresh.prepared_devices()) == kept
    return kept


def test_incremental_views_equal_a_rebuild_after_prepares_failures_unprepares_and_adoptions(node: Node) -> None:
    runner = node.runner
    good = node.add(_claim("u-good", "a0", "b0"))
    bad = node.add(_claim("u-bad", "a1", "b1"))  # beta fails on b1: rolled back
    keep = node.add(_claim("u-keep", "b2"))  # its first undo fails: kept
    first = node.add(_admin("u-adm-1", "watcher", "a2"))
    second = node.add(_admin("u-adm-2", "watcher", "a2"))  # the same owner twice: one label, counted twice
    third = node.add(_admin("u-adm-3", "auditor", "a2"))
    answers = runner.prepare_claims([good, bad, keep, first, second, third])
    assert [uid for uid, a in answers.items() if a.error] == [bad.uid]
    assert _assert_views_match(runner) == (5, {"alpha": 4, "beta": 2}, {
        "a0": (("team-a", "claim-u-good"),), "b0": (("team-a", "claim-u-good"),), "b2": (("team-a", "claim-u-keep"),),
        "a2": (("team-a", "auditor"), ("team-a", "watcher"))})

    assert "destroying" in runner.unprepare_claims([keep])[keep.uid]  # kept with its devices
    _assert_views_match(runner)
    assert runner.unprepare_claims([keep, first]) == {keep.uid: "", first.uid: ""}
    assert _assert_views_match(runner)[2]["a2"] == (("team-a", "auditor"), ("team-a", "watcher"))
    assert runner.unprepare_claims([second]) == {second.uid: ""}
    assert _assert_views_match(runner)[2]["a2"] == (("team-a", "auditor"),)

    # Adopted outside a batch (as NVIDIA's claims are at start, or a claim from its CDI spec): seen by the next batch.
    held = [HeldDevice(request_names=(), pool=POOL, device="a3", cdi_device_ids=(IDENTITY.cdi.device_id("u-adopt",
                                                                                                         "a3"),))]
    node.state.prepare_started("u-adopt", namespace="", name="", devices=held,
                               payload=encode_payload(node.spec("u-adopt"), []))
    node.state.prepare_completed("u-adopt")
    node.state.prepare_started("u-mark", namespace="team-a", name="marked", devices=[], payload=b"")
    retry = node.add(_claim("u-bad", "a1", "b1"))
    assert runner.prepare_claims([retry])[retry.uid].error  # fails again; the views take the adoptions with it
    assert _assert_views_match(runner)[2]["a3"] == (("", ""),)
    # the kubelet prepares the adopted claim: prepared again from the claim, with its owner now
    adopted = node.add(_claim("u-adopt", "a3"))
    assert runner.prepare_claims([adopted])[adopted.uid].error == ""
    assert _assert_views_match(runner)[2]["a3"] == (("team-a", "claim-u-adopt"),)

    # Another instance's changes (a rolling update): seen at this instance's next batch, by a rebuild.
    other = _second_instance(node, FakePreparer("alpha"), FakePreparer("beta"))
    try:
        theirs = node.add(_claim("u-theirs", "b3"))
        assert other.prepare_claims([theirs])[theirs.uid].error == ""
        assert other.unprepare_claims([good]) == {good.uid: ""}
        assert runner.unprepare_claims([third]) == {third.uid: ""}
        assert _assert_views_match(runner)[2] == {"b3": (("team-a", "claim-u-theirs"),),
                                                  "a3": (("team-a", "claim-u-adopt"),)}
    finally:
        other.close()
        other.state.close()

    # A device leaving the registry counts as unknown from the next batch on, as a rebuild would count it.
    node.registry.replace(tuple(d for d in node.registry.snapshot if d.name != "b3"))
    assert runner.unprepare_claims([ClaimRef("team-a", "gone", "u-gone")]) == {"u-gone": ""}
    assert _assert_views_match(runner)[:2] == (2, {"alpha": 1, "unknown": 1})  # the mark is no claim

    # A restart rebuilds them from the claim state.
    node.runner.close()
    node.restart()
    node.runner.recover()
    _assert_views_match(node.runner)


def test_a_one_claim_prepare_and_unprepare_read_only_their_claim_however_many_are_held(node: Node) -> None:
    """The hot path never turns every stored claim into a record: after the batch the views are updated from the
    claim state's own account of what it changed (:meth:`ClaimState.take_changes`)."""
    runner = node.runner
    held = [node.add(_admin(f"u-held-{i}", f"held-{i}", f"a{i % 4}")) for i in range(200)]
    assert not any(a.error for a in runner.prepare_claims(held).values())
    walks: list[int] = []
    every_claim = node.state.claims

    def counted() -> dict[str, Any]:
        walks.append(len(node.state))
        return every_claim()

    node.state.claims = counted  # type: ignore[method-assign]
    ref = node.add(_claim("u-one", "b0"))
    assert runner.prepare_claims([ref])[ref.uid].error == ""
    assert runner.unprepare_claims([ref]) == {ref.uid: ""}
    assert walks == []
    node.state.claims = every_claim  # type: ignore[method-assign]
    assert _assert_views_match(runner)[0] == 200


def test_the_claim_state_names_the_claims_it_changed_and_says_when_it_cannot(node: Node) -> None:
    """:meth:`ClaimState.take_changes`: ``None`` after a load or another instance's records (anything may differ),
    else the UIDs this instance stored, replaced or forgot since the last call."""
    state = node.state
    state.take_changes()
    state.prepare_started("u-1", namespace="ns", name="one", devices=[], payload=b"")
    state.prepare_completed("u-1")
    with state.group_commit():
        state.prepare_started("u-2", namespace="ns", name="two", devices=[], payload=b"")
        state.remove("u-1")
    assert not state.remove("u-unknown")
    assert state.take_changes() == {"u-1", "u-2"}
    assert state.take_changes() == set()
    other = node.open_state()
    try:
        assert other.take_changes() is None  # opened: loaded from the file
        other.remove("u-2")
    finally:
        other.close()
    state.refresh()  # reads the other instance's record
    assert state.take_changes() is None
