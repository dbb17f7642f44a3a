""":func:`dradriver.host.claimstate.read_claims`: the claim state read as :meth:`ClaimState.open` parses it, with
nothing written (no lock file, no truncation, no copy kept aside), for ``dradriver rollback-check``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from dradriver.host.claimstate import ClaimPhase, ClaimState, ProblemKind, read_claims
from tests.claimstate.conftest import BOOT_ID, gpu


def test_a_torn_or_damaged_journal_is_read_without_touching_a_file(open_state: Callable[..., ClaimState],
                                                                    state_dir: Path, impl: ModuleType) -> None:
    state = open_state()
    state.prepare_started("uid-1", namespace="ns", name="done", devices=[gpu(0)], payload="spec-1")
    state.prepare_completed("uid-1")
    state.prepare_started("uid-2", namespace="ns", name="half", devices=[gpu(1)], payload="spec-2")
    state.close()
    journal = state_dir / "claims.state"
    (state_dir / "serialize.lock").unlink()
    with journal.open("ab") as f:
        f.write(b"\x01\x02\x03")  # a record a crash cut short
    before = {p.name: p.read_bytes() for p in state_dir.iterdir()}

    snapshot = read_claims(journal, backend=impl)

    assert {p.name: p.read_bytes() for p in state_dir.iterdir()} == before  # no lock file, nothing truncated
    assert snapshot.exists and snapshot.boot_id == BOOT_ID
    assert {uid: (r.phase, r.name) for uid, r in snapshot.claims.items()} == {
        "uid-1": (ClaimPhase.PREPARE_COMPLETED, "done"), "uid-2": (ClaimPhase.PREPARE_STARTED, "half")}
    assert [p.kind for p in snapshot.problems] == [ProblemKind.TORN_TAIL]
    missing = read_claims(state_dir / "none.state", backend=impl)
    assert (missing.exists, missing.claims) == (False, {})
    assert not (state_dir / "none.state").exists()
