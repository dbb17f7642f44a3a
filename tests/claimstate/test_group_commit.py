"""Group commit: a batch's records are buffered in the table and written with one append at the block's end."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dradriver.host.claimstate import ClaimConflictError, ClaimPhase, ClaimState, HeldDevice

Opener = Callable[..., ClaimState]


def _held(device: str) -> list[HeldDevice]:
    return [HeldDevice(("gpu",), "node", device, (f"k8s.gpu.nvidia.com/claim=x-{device}",))]


def test_records_are_written_together_when_the_block_ends(open_state: Opener, state_dir: Path) -> None:
    state = open_state()
    path = state_dir / "claims.state"
    before = os.path.getsize(path)
    with state.group_commit():
        for i in range(5):
            state.prepare_started(f"uid-{i}", namespace="ns", name=f"c{i}", devices=_held(f"gpu-{i}"))
        assert os.path.getsize(path) == before  # buffered, not yet on disk
        assert len(state) == 5  # but the table already has them (conflict checks see them)
        with pytest.raises(ClaimConflictError):
            state.prepare_started("uid-x", namespace="ns", name="x", devices=_held("gpu-0"))
    assert os.path.getsize(path) > before
    with state.group_commit():
        for i in range(5):
            state.prepare_completed(f"uid-{i}")
    reopened = open_state()
    assert {uid: r.phase for uid, r in reopened.claims().items()} == {
        f"uid-{i}": ClaimPhase.PREPARE_COMPLETED for i in range(5)
    }


def test_nested_blocks_join_the_outer_one_and_an_exception_still_flushes(open_state: Opener) -> None:
    state = open_state()
    with pytest.raises(RuntimeError), state.group_commit():
        state.prepare_started("a", namespace="ns", name="a", devices=_held("gpu-0"))
        with state.group_commit():
            state.prepare_started("b", namespace="ns", name="b", devices=_held("gpu-1"))
        raise RuntimeError("the caller failed after recording")
    # The table held both changes, so both records were written: table and file agree.
    assert set(open_state().claims()) == {"a", "b"}


def test_same_bytes_as_one_by_one(open_state: Opener, state_dir: Path, tmp_path: Path) -> None:
    grouped = open_state()
    with grouped.group_commit():
        for i in range(3):
            grouped.prepare_started(f"u{i}", namespace="ns", name=f"c{i}", devices=_held(f"gpu-{i}"))
            grouped.prepare_completed(f"u{i}")
    data_grouped = (state_dir / "claims.state").read_bytes()
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    single = ClaimState.open(other_dir / "claims.state", boot_id_path=tmp_path / "boot_id",
                             backend=grouped._backend)
    try:
        for i in range(3):
            single.prepare_started(f"u{i}", namespace="ns", name=f"c{i}", devices=_held(f"gpu-{i}"))
            single.prepare_completed(f"u{i}")
        assert (other_dir / "claims.state").read_bytes() == data_grouped
    finally:
        single.close()


def test_failed_compaction_keeps_the_acknowledged_change(open_state: Opener, state_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    state = open_state(compact_min_bytes=0, compact_ratio=0.0)  # every change would compact

    def disk_full(self: ClaimState) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ClaimState, "_write_journal", disk_full)
    for i in range(3):  # each record is durable although its compaction fails (completion leaves dead bytes)
        state.prepare_started(f"u{i}", namespace="ns", name=f"c{i}", devices=_held(f"gpu-{i}"))
        state.prepare_completed(f"u{i}")
    assert state.compaction_failures >= 3
    monkeypatch.undo()
    assert set(open_state().claims()) == {"u0", "u1", "u2"}
