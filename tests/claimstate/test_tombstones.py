"""Unprepare tombstones beside the claim state: shared by the instances on a node, crash-safe, pruned, per boot, and
invisible to the journal an older release reads."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dradriver.host.claimstate import ClaimState
from tests.claimstate import worker
from tests.claimstate.conftest import gpu

Opener = Callable[..., ClaimState]
WORKER = Path(worker.__file__)


class Clock:
    """A ``CLOCK_MONOTONIC`` stand-in, nanoseconds."""

    def __init__(self) -> None:
        self.now = 5 * 10**12

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def test_a_tombstone_left_by_one_instance_is_seen_by_the_other(open_state: Opener) -> None:
    old, new = open_state(), open_state()
    began = old.monotonic_ns()  # a prepare call of the old instance starts
    assert old.unprepared_at("u-1") is None
    stamp = new.note_unprepared(["u-1", "u-2"])
    assert stamp > began
    assert old.unprepared_at("u-1") == stamp and old.unprepared_at("u-2") == stamp
    again = old.note_unprepared(["u-1"])  # a later unprepare of the same UID moves its stamp
    assert again >= stamp and new.unprepared_at("u-1") == again and new.unprepared_at("u-2") == stamp
    assert new.unprepared_at("u-3") is None
    new.close()
    assert open_state().unprepared_at("u-2") == stamp  # a restarted instance reads them back


def test_tombstones_leave_the_journal_as_an_older_release_reads_it(open_state: Opener, state_dir: Path) -> None:
    """The journal's bytes do not change (an older release, which knows no tombstones, reads it as before); the
    tombstones are a file of their own."""
    state = open_state()
    state.prepare_started("a", namespace="ns", name="a", devices=[gpu(0)])
    state.prepare_completed("a")
    journal = (state_dir / "claims.state").read_bytes()
    state.note_unprepared(["b", "c"])
    assert (state_dir / "claims.state").read_bytes() == journal
    lines = (state_dir / "claims.state.unprepared").read_text().splitlines()
    assert json.loads(lines[0])["format"] == "dradriver-unprepared" and len(lines) == 3
    assert list(state.claims()) == ["a"]


def test_a_torn_tombstone_line_is_truncated_and_a_damaged_one_skipped(open_state: Opener, state_dir: Path) -> None:
    state = open_state()
    stamp = state.note_unprepared(["kept"])
    path = state_dir / "claims.state.unprepared"
    with path.open("ab") as f:
        f.write(b"not json\n[12, \"half")  # a damaged line, then a write cut short by a crash
    other = open_state()
    assert other.unprepared_at("kept") == stamp and other.unprepared_at("half") is None
    later = other.note_unprepared(["next"])  # appended after the truncated tail, not glued to it
    assert path.read_bytes().endswith(json.dumps([later, "next"]).encode() + b"\n")
    assert open_state().unprepared_at("next") == later


def test_tombstones_expire_and_the_file_is_rewritten_small(open_state: Opener, state_dir: Path) -> None:
    clock = Clock()
    state = open_state(tombstone_ttl_s=10.0, clock_ns=clock)
    other = open_state(tombstone_ttl_s=10.0, clock_ns=clock)
    first = state.note_unprepared(["early"])
    clock.advance(9)
    assert other.unprepared_at("early") == first
    clock.advance(2)
    assert other.unprepared_at("early") is None  # older than the TTL
    path = state_dir / "claims.state.unprepared"
    for i in range(2000):
        state.note_unprepared([f"u-{i}"])
        clock.advance(0.1)
    assert len(path.read_text().splitlines()) < 2 * 100 + 256 + 2  # 100 live (10 s / 0.1 s) plus slack
    other.refresh()
    assert other.unprepared_at("u-1999") is not None and other.unprepared_at("u-1800") is None
    assert not list(state_dir.glob(".claims.state.unprepared.tmp-*"))


def test_tombstones_of_another_boot_are_discarded(open_state: Opener, boot_id_file: Path) -> None:
    open_state().note_unprepared(["before-reboot"])
    boot_id_file.write_text("another-boot\n")
    state = open_state()
    assert state.unprepared_at("before-reboot") is None
    stamp = state.note_unprepared(["after"])
    assert open_state().unprepared_at("after") == stamp


def test_sigkill_while_leaving_tombstones_keeps_every_acknowledged_one(
        state_dir: Path, boot_id_file: Path, open_state: Opener) -> None:
    """A process leaving tombstones is SIGKILLed at random points (with a long TTL, and with one so short that the
    file is rewritten all the time): the file always loads; with the long TTL every acknowledged tombstone is there;
    no temporary file survives the next open, and the next tombstone is written after whatever the kill left."""
    rng = random.Random(32)
    for ttl in ("300", "0.001"):
        for _ in range(3):
            proc = subprocess.Popen([sys.executable, str(WORKER), "tombstones", str(state_dir), str(boot_id_file),
                                     "py", ttl], stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            target, acked = rng.randint(50, 400), 0
            for line in proc.stdout:
                acked = int(line.split()[1])
                if acked >= target:
                    proc.send_signal(signal.SIGKILL)
                    break
            proc.wait(10)
            assert proc.returncode == -signal.SIGKILL
            state = open_state(tombstone_ttl_s=float(ttl))
            if ttl == "300":
                assert all(state.unprepared_at(f"u-{n}") is not None for n in range(1, acked + 1))
            stamp = state.note_unprepared(["after-kill"])
            assert open_state(tombstone_ttl_s=300.0).unprepared_at("after-kill") == stamp
            assert not list(state_dir.glob(".claims.state.unprepared.tmp-*"))
            state.close()
