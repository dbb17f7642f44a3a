"""Property tests: the compiled claim store and its twin give identical bytes, tables and exception types."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dradriver import _native  # noqa: E402
from dradriver._native import claimstore_py as py  # noqa: E402
from dradriver.host.claimstate import ClaimState, HeldDevice  # noqa: E402

if not _native.use_extensions():
    pytest.skip("DRADRIVER_NO_EXTENSIONS=1: no compiled module to compare with", allow_module_level=True)
c: ModuleType = importlib.import_module("dradriver._native.claimstore")

pytestmark = pytest.mark.native

def _mostly(valid: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], odds: int = 40) -> st.SearchStrategy[Any]:
    """Valid values except about once in ``odds`` draws, where ``rare`` (mostly invalid) ones come."""
    return st.integers(0, 1 << 20).flatmap(lambda n: rare if n % odds == 7 else valid)


texts = _mostly(st.text(max_size=6), st.sampled_from(["", "\ud800", "é✓", "x" * 65536]), odds=40)
uids = _mostly(st.sampled_from(["a", "b", "c", "dd"]), st.sampled_from(["", 7]))
strs_seq = _mostly(st.lists(texts, max_size=3).map(tuple), st.one_of(st.lists(texts, max_size=2), st.just("req")))
devices_st = st.tuples(
    strs_seq,
    _mostly(st.sampled_from(["p1", "p2"]), st.just(None)),
    st.sampled_from(["gpu-0", "gpu-1", "gpu-2"]),
    strs_seq,
    _mostly(st.booleans(), st.just(1)),
)
device_lists = _mostly(
    st.lists(devices_st, max_size=3),
    st.one_of(st.lists(devices_st, max_size=3).map(tuple), st.just([("too", "short")]), st.just("not-a-list")),
)
payloads = _mostly(st.one_of(st.binary(max_size=12), st.text(max_size=6)), st.sampled_from(["\udfff", 3]))
start_ops = st.tuples(st.just("start"), uids, texts, texts, device_lists, payloads)
ops = st.one_of(
    start_ops,
    start_ops,
    st.tuples(st.just("complete"), uids, st.one_of(st.none(), device_lists), st.one_of(st.none(), payloads)),
    st.tuples(st.just("remove"), uids),
)


def _run(table: Any, op: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        if op[0] == "start":
            return "ok", table.prepare_started(*op[1:])
        if op[0] == "complete":
            return "ok", table.prepare_completed(*op[1:])
        return "ok", table.remove(op[1])
    except Exception as exc:
        return type(exc).__qualname__ + ":" + type(exc).__module__, str(exc)


def _view(table: Any) -> tuple[Any, ...]:
    holders = {(p, d): table.holder(p, d) for p in ("p1", "p2") for d in ("gpu-0", "gpu-1", "gpu-2")}
    return table.uids(), [table.get(u) for u in table.uids()], holders, table.live_bytes, table.snapshot()


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=25))
def test_tables_agree(sequence: list[tuple[Any, ...]]) -> None:
    tc, tp = c.Table(), py.Table()
    frames = b""
    for op in sequence:
        rc, rp = _run(tc, op), _run(tp, op)
        assert rc == rp
        assert _view(tc) == _view(tp)
        if rc[0] == "ok":
            frames += rc[1]
    header = py.encode_header("boot")
    assert c.encode_header("boot") == header
    # replaying the journal rebuilds the same table in both
    rc_, rp_ = c.Table(), py.Table()
    assert rc_.apply(header + frames, len(header), 1) == rp_.apply(header + frames, len(header), 1)
    assert _view(rc_)[:4] == _view(tp)[:4] and _view(rp_) == _view(rc_)


damage = st.lists(
    st.tuples(st.sampled_from(["flip", "cut", "zero", "insert"]), st.integers(0, 10_000), st.integers(0, 255)),
    min_size=1,
    max_size=3,
)


def _damage(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, pos, val in edits:
        if not buf:
            break
        pos %= len(buf)
        if kind == "flip":
            buf[pos] ^= val or 1
        elif kind == "cut":
            del buf[pos:]
        elif kind == "zero":
            buf[pos:] = bytes(len(buf) - pos)
        else:
            buf.insert(pos, val)
    return bytes(buf)


def _decode(mod: ModuleType, data: bytes) -> tuple[Any, ...]:
    try:
        return ("ok", mod.decode_header(data))
    except Exception as exc:
        return (type(exc).__qualname__, str(exc), getattr(exc, "header_len", None))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=15), damage)
def test_damaged_journals_are_read_identically(sequence: list[tuple[Any, ...]], edits: Any) -> None:
    tp = py.Table()
    data = py.encode_header("0b0b-boot")
    for op in sequence:
        kind, frame = _run(tp, op)
        if kind == "ok":
            data += frame
    bad = _damage(data, edits)
    assert _decode(c, bad) == _decode(py, bad)
    hdr = _decode(py, bad)
    start = hdr[1][2] if hdr[0] == "ok" else (hdr[2] or 0)
    tc, tp2 = c.Table(), py.Table()
    pos = start
    for _ in range(len(bad) + 1):
        if not pos:
            break
        out_c, out_p = tc.apply(bad, pos, 1), tp2.apply(bad, pos, 1)
        assert out_c == out_p
        assert _view(tc) == _view(tp2)
        if out_c[0] != py.APPLY_BAD_RECORD:
            break
        pos = out_c[2]


store_ops = st.one_of(
    st.tuples(st.just("start"), st.sampled_from(["a", "b", "c"]), st.sampled_from(["gpu-0", "gpu-1"]),
              st.booleans(), st.one_of(st.binary(max_size=6), st.text(max_size=4))),
    st.tuples(st.just("complete"), st.sampled_from(["a", "b", "c"])),
    st.tuples(st.just("remove"), st.sampled_from(["a", "b", "c"])),
    st.tuples(st.just("compact")),
)


def _store_op(state: ClaimState, op: tuple[Any, ...]) -> str:
    try:
        if op[0] == "start":
            dev = HeldDevice(("r",), "node", op[2], (f"cdi/{op[1]}",), op[3])
            state.prepare_started(op[1], namespace="ns", name=op[1], devices=[dev], payload=op[4])
        elif op[0] == "complete":
            state.prepare_completed(op[1])
        elif op[0] == "remove":
            state.remove(op[1])
        else:
            state.compact()
    except Exception as exc:
        return type(exc).__qualname__ + ": " + str(exc)
    return "ok"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(store_ops, max_size=12))
def test_stores_write_identical_files(sequence: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "boot_id").write_text("boot-1\n")
        stores = {}
        for tag, mod in (("c", c), ("py", py)):
            (root / tag).mkdir()
            stores[tag] = ClaimState.open(root / tag / "claims.state", boot_id_path=root / "boot_id",
                                          backend=mod, compact_min_bytes=200)
        for op in sequence:
            assert _store_op(stores["c"], op) == _store_op(stores["py"], op)
            assert (root / "c" / "claims.state").read_bytes() == (root / "py" / "claims.state").read_bytes()
            assert stores["c"].claims() == stores["py"].claims()
        for state in stores.values():
            state.close()
