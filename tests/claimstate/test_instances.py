"""Two store instances on one journal, as two plugin pods during a rolling update."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dradriver.host.claimstate import ClaimConflictError, ClaimState, ClaimStateLockError, ClaimUnknownError
from tests.claimstate.conftest import gpu

Opener = Callable[..., ClaimState]


def test_interleaved_mutations_see_each_other(open_state: Opener) -> None:
    old, new = open_state(), open_state()
    old.prepare_started("a", namespace="ns", name="a", devices=[gpu(0)])
    new.prepare_started("b", namespace="ns", name="b", devices=[gpu(1)])  # reads a's record first
    assert set(new.claims()) == {"a", "b"}
    old.prepare_completed("a")
    assert "b" in old  # the mutation brought old up to date
    new.refresh()
    assert new.get("a") is not None and new.get("a").phase == old.get("a").phase  # type: ignore[union-attr]
    # a stale in-memory table cannot hand out a device the other instance took meanwhile
    new.prepare_started("c", namespace="ns", name="c", devices=[gpu(2)])
    with pytest.raises(ClaimConflictError, match=r"already prepared for claim ns/c \(uid c\)"):
        old.prepare_started("d", namespace="ns", name="d", devices=[gpu(2)])
    # unprepare by one instance, late completion by the other
    new.remove("a")
    with pytest.raises(ClaimUnknownError):
        old.prepare_completed("a")
    assert set(old.claims()) == set(new.claims()) == {"b", "c"}


def test_compaction_by_one_instance_is_detected_by_the_other(open_state: Opener, state_dir: Path) -> None:
    a = open_state(compact_min_bytes=300)
    b = open_state(compact_min_bytes=300)
    a.prepare_started("keep", namespace="ns", name="keep", devices=[gpu(0)])
    inode = os.stat(state_dir / "claims.state").st_ino
    for i in range(20):
        a.prepare_started(f"t{i}", namespace="ns", name="t", devices=[gpu(1)])
        a.remove(f"t{i}")
    assert a.compactions >= 1
    assert os.stat(state_dir / "claims.state").st_ino != inode
    b.prepare_completed("keep")  # b reloads the renamed journal before appending
    b.prepare_started("other", namespace="ns", name="o", devices=[gpu(3)])
    a.refresh()
    assert a.claims() == b.claims()
    assert [r.phase.name for r in a.claims().values()] == ["PREPARE_COMPLETED", "PREPARE_STARTED"]
    a.close()
    b.close()
    reopened = open_state()
    assert list(reopened.claims()) == ["keep", "other"] and reopened.problems == ()


def test_locked_section_is_atomic_and_lock_timeout_is_reported(open_state: Opener, state_dir: Path) -> None:
    a = open_state()
    b = open_state(lock_timeout=0.05)
    with a.locked():
        if a.get("x") is None:
            a.prepare_started("x", namespace="ns", name="x", devices=[gpu(0)])
        with pytest.raises(ClaimStateLockError, match=r"serialize\.lock"):
            b.prepare_started("y", namespace="ns", name="y", devices=[gpu(1)])
    b.prepare_started("y", namespace="ns", name="y", devices=[gpu(1)])
    # a foreign holder of the lock file (another process) blocks as well
    fd = os.open(state_dir / "serialize.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ClaimStateLockError):
            b.remove("y")
    finally:
        os.close(fd)
    assert b.remove("y")


def test_other_instance_torn_append_is_truncated(open_state: Opener, state_dir: Path) -> None:
    a = open_state()
    a.prepare_started("a", namespace="ns", name="a", devices=[gpu(0)])
    b = open_state()
    b.prepare_started("b", namespace="ns", name="b", devices=[gpu(1)])
    size = b.journal_size()
    with open(state_dir / "claims.state", "ab") as f:  # a third instance died mid-append
        f.write(b"\x10\x00\x00\x00\xaa")
    a.prepare_completed("a")
    assert [p.kind.value for p in a.problems] == ["torn-tail"]
    assert set(a.claims()) == {"a", "b"}
    assert a.journal_size() > size
    b.refresh()
    assert b.claims() == a.claims()


def test_vanished_journal_is_rewritten_from_memory(open_state: Opener, state_dir: Path) -> None:
    a = open_state()
    a.prepare_started("a", namespace="ns", name="a", devices=[gpu(0)])
    os.unlink(state_dir / "claims.state")
    a.prepare_started("b", namespace="ns", name="b", devices=[gpu(1)])
    assert [p.kind.value for p in a.problems] == ["missing"]
    a.close()
    assert list(open_state().claims()) == ["a", "b"]
