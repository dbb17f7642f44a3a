"""ClaimState over a real journal file: round trip, restart, recovery from damage, boot ID, versions."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from dradriver.host.claimstate import (
    ClaimConflictError,
    ClaimPhase,
    ClaimRecordError,
    ClaimState,
    ClaimStateCorruptError,
    ClaimStateProblem,
    ClaimStateVersionError,
    ClaimUnknownError,
    HeldDevice,
    ProblemKind,
)
from tests.claimstate.conftest import BOOT_ID, gpu

Opener = Callable[..., ClaimState]


def _prepare(state: ClaimState, uid: str, *devices: HeldDevice, payload: bytes | str = b"") -> None:
    state.prepare_started(uid, namespace="ns", name=f"claim-{uid}", devices=devices, payload=payload)
    state.prepare_completed(uid)


def _snapshot(state: ClaimState) -> dict[str, tuple[object, ...]]:
    return {
        uid: (r.phase, r.namespace, r.name, r.devices, r.payload) for uid, r in state.claims().items()
    }


def test_round_trip_and_restart(open_state: Opener) -> None:
    state = open_state()
    assert len(state) == 0 and state.problems == ()
    rec = state.prepare_started(
        "uid-1", namespace="team-a", name="big-gpu", devices=[gpu(0, uid="uid-1")], payload="/var/run/cdi/x"
    )
    assert rec.phase is ClaimPhase.PREPARE_STARTED
    assert rec.devices[0].to_prepared().device_name == "gpu-0"
    done = state.prepare_completed("uid-1", payload=b"\x00\xffbinary")
    assert done.phase is ClaimPhase.PREPARE_COMPLETED
    assert done.namespace == "team-a" and done.name == "big-gpu" and done.payload == b"\x00\xffbinary"
    assert done.ref.uid == "uid-1"
    _prepare(state, "uid-2", gpu(1), gpu(2, admin=True), payload="spec-path")
    assert state.holder("node-a", "gpu-0") == "uid-1"
    assert state.holder("node-a", "gpu-2") is None  # admin access does not hold the device
    before = _snapshot(state)
    state.close()

    reopened = open_state()
    assert _snapshot(reopened) == before
    assert reopened.problems == ()
    assert reopened.remove("uid-1") is True
    assert reopened.remove("uid-1") is False
    assert reopened.holder("node-a", "gpu-0") is None
    reopened.close()
    assert list(open_state().claims()) == ["uid-2"]


def test_conflict_names_both_claims_and_admin_access_is_exempt(open_state: Opener) -> None:
    state = open_state()
    _prepare(state, "uid-1", gpu(0))
    with pytest.raises(ClaimConflictError) as info:
        state.prepare_started("uid-2", namespace="ns2", name="other", devices=[gpu(0)])
    assert "ns2/other (uid uid-2)" in str(info.value) and "ns/claim-uid-1 (uid uid-1)" in str(info.value)
    assert info.value.holder == "uid-1" and info.value.device == "gpu-0"
    assert "uid-2" not in state
    size = state.journal_size()
    state.prepare_started("uid-3", namespace="ns", name="admin", devices=[gpu(0, admin=True)])
    assert state.journal_size() > size
    assert state.holder("node-a", "gpu-0") == "uid-1"
    # the same device name in another pool is another device
    state.prepare_started("uid-4", namespace="ns", name="other-node", devices=[gpu(0, pool="node-b")])
    # re-preparing the same claim with its own device is no conflict
    state.prepare_started("uid-1", namespace="ns", name="claim-uid-1", devices=[gpu(0)])
    with pytest.raises(ClaimConflictError):
        state.prepare_completed("uid-4", devices=[gpu(0)])


def test_late_completion_after_unprepare_does_not_resurrect(open_state: Opener) -> None:
    state = open_state()
    state.prepare_started("uid-1", namespace="ns", name="c", devices=[gpu(0)])
    assert state.remove("uid-1")
    with pytest.raises(ClaimUnknownError):
        state.prepare_completed("uid-1")
    assert state.get("uid-1") is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"uid": ""}, "claim UID"),
        ({"namespace": 3}, "namespace"),
        ({"name": "x" * 70000}, "name is 70000 bytes"),
        ({"payload": 12}, "payload"),
        ({"name": "\ud800"}, "UTF-8"),
    ],
)
def test_bad_fields_are_refused_and_nothing_is_written(open_state: Opener, kwargs: dict[str, object],
                                                       needle: str) -> None:
    state = open_state()
    args: dict[str, object] = {"uid": "u", "namespace": "ns", "name": "n", "devices": [gpu(0)], "payload": b""}
    args.update(kwargs)
    size = state.journal_size()
    with pytest.raises(ClaimRecordError, match=needle):
        state.prepare_started(args.pop("uid"), **args)  # type: ignore[arg-type]
    assert state.journal_size() == size and len(state) == 0


def _journal(state_dir: Path) -> Path:
    return state_dir / "claims.state"


def test_every_cut_point_recovers_the_acknowledged_prefix(open_state: Opener, state_dir: Path) -> None:
    """A crash can leave any prefix of the last append on disk: each one reopens to a consistent table."""
    state = open_state()
    sizes = [state.journal_size()]
    tables = [_snapshot(state)]
    ops: list[Callable[[], object]] = [
        lambda: state.prepare_started("a", namespace="ns", name="a", devices=[gpu(0)], payload="p"),
        lambda: state.prepare_completed("a"),
        lambda: state.prepare_started("b", namespace="ns", name="b", devices=[gpu(1), gpu(2)]),
        lambda: state.remove("a"),
        lambda: state.prepare_completed("b", payload=b"done"),
    ]
    for op in ops:
        op()
        sizes.append(state.journal_size())
        tables.append(_snapshot(state))
    state.close()
    full = _journal(state_dir).read_bytes()
    assert len(full) == sizes[-1]
    for cut in range(sizes[0], len(full) + 1):
        _journal(state_dir).write_bytes(full[:cut])
        acked = max(i for i, size in enumerate(sizes) if size <= cut)
        reopened = open_state(strict=True)
        assert _snapshot(reopened) == tables[acked], cut
        torn = [p for p in reopened.problems if p.kind is ProblemKind.TORN_TAIL]
        assert bool(torn) == (cut != sizes[acked]), cut
        assert reopened.journal_size() == sizes[acked] == _journal(state_dir).stat().st_size
        reopened.close()


def test_zero_filled_tail_counts_as_torn(open_state: Opener, state_dir: Path) -> None:
    state = open_state()
    _prepare(state, "a", gpu(0))
    state.close()
    with open(_journal(state_dir), "ab") as f:
        f.write(b"\x00" * 40)
    reopened = open_state()
    assert [p.kind for p in reopened.problems] == [ProblemKind.TORN_TAIL]
    assert list(reopened.claims()) == ["a"]


def _frame_offsets(data: bytes, header_len: int) -> list[int]:
    offsets, pos = [], header_len
    while pos < len(data):
        offsets.append(pos)
        (body_len,) = struct.unpack_from("<I", data, pos)
        pos += 12 + body_len
    return offsets


def _header_len(data: bytes) -> int:
    (boot_len,) = struct.unpack_from("<I", data, 12)
    return 16 + boot_len + 4


def test_corrupt_middle_record_is_reported_kept_aside_and_readable_claims_survive(
    open_state: Opener, state_dir: Path
) -> None:
    state = open_state()
    for i, uid in enumerate(["a", "b", "c"]):
        _prepare(state, uid, gpu(i))
    state.close()
    data = bytearray(_journal(state_dir).read_bytes())
    offsets = _frame_offsets(bytes(data), _header_len(bytes(data)))
    # damage the body of b's PREPARE_COMPLETED record (the 4th frame); its head still frames it
    data[offsets[3] + 20] ^= 0x40
    _journal(state_dir).write_bytes(bytes(data))
    seen: list[ClaimStateProblem] = []
    with pytest.raises(ClaimStateCorruptError) as info:
        open_state(on_problem=seen.append)
    err = info.value
    assert "fails its checksum" in str(err) and "recovered 3 claim(s)" in str(err)
    recovered = err.state
    assert isinstance(recovered, ClaimState)
    claims = recovered.claims()
    assert list(claims) == ["a", "b", "c"]
    assert claims["b"].phase is ClaimPhase.PREPARE_STARTED  # its completion was in the damaged record
    assert claims["c"].phase is ClaimPhase.PREPARE_COMPLETED
    assert [p.kind for p in seen] == [ProblemKind.CORRUPT_RECORD] and seen[0].damage
    kept = seen[0].kept_at
    assert kept is not None and kept.name.startswith("claims.state.corrupt-")
    assert kept.read_bytes() == bytes(data)
    # the rewritten journal is clean and the recovered store keeps working
    recovered.prepare_started("d", namespace="ns", name="d", devices=[gpu(3)])
    recovered.close()
    again = open_state()
    assert again.problems == () and list(again.claims()) == ["a", "b", "c", "d"]


def test_damaged_frame_head_keeps_records_before_it(open_state: Opener, state_dir: Path) -> None:
    state = open_state()
    for i, uid in enumerate(["a", "b", "c"]):
        _prepare(state, uid, gpu(i))
    state.close()
    data = bytearray(_journal(state_dir).read_bytes())
    offsets = _frame_offsets(bytes(data), _header_len(bytes(data)))
    data[offsets[2]] ^= 0x01  # length of b's first record: nothing after it can be framed
    _journal(state_dir).write_bytes(bytes(data))
    recovered = open_state(strict=False)
    assert [p.kind for p in recovered.problems] == [ProblemKind.CORRUPT_TAIL]
    assert list(recovered.claims()) == ["a"]


def test_corrupt_header(open_state: Opener, state_dir: Path) -> None:
    state = open_state()
    _prepare(state, "a", gpu(0))
    state.close()
    data = bytearray(_journal(state_dir).read_bytes())
    data[20] ^= 0x01  # inside the boot ID: header CRC fails, the declared length is still plausible
    _journal(state_dir).write_bytes(bytes(data))
    with pytest.raises(ClaimStateCorruptError, match="header checksum mismatch") as info:
        open_state()
    assert isinstance(info.value.state, ClaimState)
    assert list(info.value.state.claims()) == ["a"]  # records after a damaged header are still read

    _journal(state_dir).write_bytes(b"NOTOURS!" + bytes(data[8:]))
    with pytest.raises(ClaimStateCorruptError, match="bad magic") as info:
        open_state()
    assert len(info.value.state) == 0
    assert len(list(state_dir.glob("claims.state.corrupt-*"))) == 2


def test_boot_id_change_discards_prepared_claims(open_state: Opener, state_dir: Path, boot_id_file: Path) -> None:
    state = open_state()
    _prepare(state, "a", gpu(0))
    _prepare(state, "b", gpu(1))
    state.close()
    boot_id_file.write_text("0b0b0b0b-0000-4000-8000-000000000000\n")
    seen: list[ClaimStateProblem] = []
    after = open_state(on_problem=seen.append)
    assert len(after) == 0
    assert [p.kind for p in seen] == [ProblemKind.BOOT_ID_CHANGED]
    assert "discarded 2 prepared claim(s)" in seen[0].message and seen[0].discarded == 2
    assert BOOT_ID in seen[0].message and not seen[0].damage
    kept = seen[0].kept_at
    assert kept is not None and kept.name.startswith("claims.state.boot-")
    after.close()
    assert open_state().problems == ()


def test_newer_version_is_refused(open_state: Opener, impl: ModuleType, state_dir: Path) -> None:
    state = open_state()
    _prepare(state, "a", gpu(0))
    state.close()
    data = _journal(state_dir).read_bytes()
    header = impl.encode_header(BOOT_ID, version=2)
    _journal(state_dir).write_bytes(header + data[_header_len(data):])
    with pytest.raises(ClaimStateVersionError, match="version 2 is newer"):
        open_state()
    assert _journal(state_dir).read_bytes() == header + data[_header_len(data):]  # left untouched


def test_old_unknown_version_is_refused(open_state: Opener, impl: ModuleType, state_dir: Path) -> None:
    _journal(state_dir).write_bytes(impl.encode_header(BOOT_ID, version=0))
    with pytest.raises(ClaimStateVersionError, match="version 0 is not a known version"):
        open_state()


def test_compaction_keeps_the_table_and_shrinks_the_file(open_state: Opener, state_dir: Path) -> None:
    state = open_state(compact_min_bytes=2000)
    _prepare(state, "keep", gpu(0), payload="keep")
    for i in range(60):
        _prepare(state, f"churn-{i}", gpu(1))
        state.remove(f"churn-{i}")
    assert state.compactions >= 1
    assert state.journal_size() < 2000 * 4
    before = _snapshot(state)
    state.close()
    assert not list(state_dir.glob(".claims.state.tmp-*"))
    assert _snapshot(open_state()) == before


def test_leftover_compaction_temp_file_is_removed(open_state: Opener, state_dir: Path) -> None:
    open_state().close()
    stale = state_dir / ".claims.state.tmp-999-1"
    stale.write_bytes(b"half a snapshot")
    open_state()
    assert not stale.exists()


def test_crc_is_zlib_crc32(impl: ModuleType) -> None:
    for data in (b"", b"a", b"123456789", bytes(range(256)) * 3):
        assert impl.crc32(data) == zlib.crc32(data)
    assert impl.crc32(b"6789", impl.crc32(b"12345")) == zlib.crc32(b"123456789")


def test_file_mode_is_owner_only(open_state: Opener, state_dir: Path) -> None:
    open_state().compact()
    assert _journal(state_dir).stat().st_mode & 0o777 == 0o600
    assert os.stat(state_dir / "serialize.lock").st_mode & 0o777 == 0o600
