"""Extension and twin agree: identical bytes for every input, identical exception type and message."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dradriver._native import cdispec_py  # noqa: E402
from tests.cdi.helpers import validate  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("DRADRIVER_NO_EXTENSIONS") == "1", reason="needs the compiled renderer")

# Text that breaks names, paths, env entries or exercises JSON escaping.
_text = st.text(alphabet='abcAZ09_-.:/= "\\\n\x00\x7fé\u2028\U0001f600', max_size=12)
_junk = st.one_of(st.integers(-3, 2**33), st.booleans(), st.none(), _text)
_small = st.integers(0, 2000)


def _build(junk: bool) -> dict[str, st.SearchStrategy[Any]]:
    """Strategies for renderer arguments; with ``junk`` about one field in 40 has a wrong value or type."""

    def maybe(strategy: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] = _junk) -> st.SearchStrategy[Any]:
        if not junk:
            return strategy
        return st.integers(0, 39).flatmap(lambda i: bad if i == 0 else strategy)

    def seq(strategy: st.SearchStrategy[Any], min_size: int = 0, max_size: int = 3) -> st.SearchStrategy[Any]:
        return maybe(
            st.lists(strategy, min_size=min_size, max_size=max_size).map(tuple)
            | st.lists(strategy, min_size=min_size, max_size=max_size)
        )

    name = maybe(st.from_regex(r"[a-z0-9][a-z0-9.:-]{0,10}[a-z0-9]", fullmatch=True), _text)
    path = maybe(st.from_regex(r"/dev/[a-z0-9é\"-]{1,12}", fullmatch=True), _text)
    env = maybe(st.from_regex(r"[A-Z_]{1,6}=[a-z0-9é\"\n\U0001f600]{0,6}", fullmatch=True), _text)
    text = st.text(alphabet='abc-=/é\n"\U0001f600', max_size=6)
    node = st.tuples(
        path,
        maybe(st.sampled_from(["", "/host/dev/x"])),
        maybe(st.sampled_from(["", "c", "b", "p", "u"])),
        maybe(st.integers(0, 4095)),
        maybe(st.integers(0, 2**20 - 1)),
        maybe(st.none() | st.integers(0, 0o7777)),
        maybe(st.sampled_from(["", "rwm", "rw"]), st.sampled_from(["none", "x"])),
        maybe(st.none() | _small),
        maybe(st.none() | st.integers(0, 2**32 - 1)),
    )
    hook = st.tuples(
        maybe(st.sampled_from(["createContainer", "prestart", "poststop"]), st.just("bogus")),
        path,
        seq(maybe(text)),
        seq(env),
        maybe(st.none() | st.integers(1, 60)),
    )
    mount = st.tuples(path, path, seq(maybe(text)), maybe(st.sampled_from(["", "bind"])))
    net = st.tuples(st.sampled_from(["eth0", "eth1", "eth2"]), st.sampled_from(["n0", "n1", "n2"]))
    nets = maybe(
        st.lists(net, max_size=2, unique_by=(lambda n: n[0], lambda n: n[1])).map(tuple),
        st.lists(maybe(net), max_size=3),
    )
    gids = seq(maybe(_small | st.integers(0, 2**32 - 1), st.integers(-1, 2**33)), max_size=2)
    edits = st.tuples(
        seq(env), seq(maybe(node), max_size=3), nets, seq(maybe(hook), max_size=2), seq(maybe(mount), max_size=2), gids
    )
    # device edits must not be empty: always at least one node unless junk is wanted
    dev_edits = maybe(
        st.tuples(
            seq(env),
            seq(maybe(node), min_size=1, max_size=3),
            nets,
            seq(maybe(hook), max_size=2),
            seq(maybe(mount), max_size=2),
            gids,
        ),
        edits,
    )
    key = maybe(st.sampled_from(["k", "a.b/c", "x", "vendor.com/k9", "Z_9"]), _text | st.sampled_from(["B_/x"]))
    annotations = maybe(
        st.lists(st.tuples(key, maybe(text)), max_size=2, unique_by=lambda kv: kv[0]).map(tuple),
        st.lists(st.tuples(key, text), max_size=3).map(tuple),
    )
    device = maybe(st.one_of(st.tuples(name, dev_edits), st.tuples(name, dev_edits, annotations)))
    devices = maybe(
        st.lists(device, min_size=1, max_size=4, unique_by=lambda d: d[0] if isinstance(d, tuple) else repr(d)),
        st.lists(device, max_size=4),
    )
    kind = maybe(
        st.sampled_from(["vendor.com/gpu", "k8s.gpu.nvidia.com/claim", "vendor.com/g.x"]),
        st.sampled_from(["a/b", "x", "vendor.com/gpu/x"]) | _junk,
    )
    version = maybe(st.none(), st.sampled_from(["0.3.0", "v0.5.0", "1.1.0", "0.9"]))
    return {
        "kind": kind,
        "devices": devices,
        "common": st.none() | edits,
        "annotations": annotations,
        "version": version,
        "maybe_int": maybe(st.integers(0, 4095)),
        "text": maybe(text),
    }


VALID = _build(junk=False)
JUNK = _build(junk=True)


def _outcome(call: Callable[[], bytes]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:
        return type(exc).__name__, str(exc)


def _compiled() -> ModuleType:
    from dradriver._native import cdispec

    return cdispec


def _check_spec(kind: Any, devices: Any, common: Any, annotations: Any, version: Any) -> str:
    args = (kind, devices, common, annotations, version)
    got = _outcome(lambda: _compiled().render_spec(*args))
    want = _outcome(lambda: cdispec_py.render_spec(*args))
    assert got == want
    if want[0] == "ok" and version is None:
        validate(want[1])
    return want[0]


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=VALID["kind"],
    devices=VALID["devices"],
    common=VALID["common"],
    annotations=VALID["annotations"],
    version=VALID["version"],
)
def test_valid_specs_render_identically(kind: Any, devices: Any, common: Any, annotations: Any, version: Any) -> None:
    assert _check_spec(kind, devices, common, annotations, version) == "ok"


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=JUNK["kind"],
    devices=JUNK["devices"],
    common=JUNK["common"],
    annotations=JUNK["annotations"],
    version=JUNK["version"],
)
def test_bad_input_fails_identically(kind: Any, devices: Any, common: Any, annotations: Any, version: Any) -> None:
    _check_spec(kind, devices, common, annotations, version)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    kind=JUNK["kind"],
    channels=st.one_of(
        st.lists(st.integers(0, 2047), max_size=6, unique=True),
        st.lists(st.integers(-2, 2050), max_size=6),
        st.integers(0, 2048).map(range),
        _junk,
    ),
    major=JUNK["maybe_int"],
    prefix=st.sampled_from(["", "uid-channel-", "bad name", "-x", "é"]) | JUNK["text"],
    file_mode=st.none() | st.integers(0, 0o7777) | _junk,
    host_root=st.sampled_from(["", "/", "/run/nvidia/driver/", "rel"]) | _junk,
    common=JUNK["common"],
    version=JUNK["version"],
)
def test_channel_spec_parity(
    kind: Any,
    channels: Any,
    major: Any,
    prefix: Any,
    file_mode: Any,
    host_root: Any,
    common: Any,
    version: Any,
) -> None:
    args = (kind, channels, major, prefix, file_mode, host_root, common, version)
    got = _outcome(lambda: _compiled().render_channel_spec(*args))
    want = _outcome(lambda: cdispec_py.render_channel_spec(*args))
    assert got == want
    if want[0] == "ok" and version is None:
        validate(want[1])


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    kind=JUNK["kind"],
    channels=st.one_of(
        st.lists(st.integers(0, 2047), max_size=6, unique=True),
        st.lists(st.integers(-2, 2050), max_size=6),
        st.integers(0, 2048).map(range),
        _junk,
    ),
    major=JUNK["maybe_int"],
    prefix=st.sampled_from(["", "", "", "uid-"]) | JUNK["text"],
    file_mode=st.none() | st.integers(0, 0o7777) | _junk,
    host_root=st.sampled_from(["", "/", "/run/nvidia/driver/", "rel"]) | _junk,
    common=JUNK["common"],
    version=JUNK["version"],
    device_name=st.sampled_from(["uid-channel-0", "0uid-channel-0", "bad name", "-x", "é", ""]) | _junk,
)
def test_one_device_channel_spec_parity(
    kind: Any,
    channels: Any,
    major: Any,
    prefix: Any,
    file_mode: Any,
    host_root: Any,
    common: Any,
    version: Any,
    device_name: Any,
) -> None:
    """``device_name`` (every channel's node in one device): the same bytes or the same error from both."""
    args = (kind, channels, major, prefix, file_mode, host_root, common, version, device_name)
    got = _outcome(lambda: _compiled().render_channel_spec(*args))
    want = _outcome(lambda: cdispec_py.render_channel_spec(*args))
    assert got == want
    if want[0] == "ok" and version is None:
        spec = validate(want[1])
        names = [d["name"] for d in spec["devices"]]
        # None (a junk draw) is the per-channel form: one device <prefix><N> per channel.
        assert names == ([device_name] if device_name is not None else [f"{prefix}{n}" for n in channels])


def test_one_device_channel_spec_all_channels() -> None:
    """The All-mode claim's spec: one device, 2048 nodes in order, identical from both implementations."""
    args = ("k8s.compute-domain.nvidia.com/claim", range(2048), 234, "", 0o666, "", None, None, "uid-channel-0")
    data = _compiled().render_channel_spec(*args)
    assert data == cdispec_py.render_channel_spec(*args)
    spec = validate(data)
    (device,) = spec["devices"]
    assert device["name"] == "uid-channel-0"
    nodes = device["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == [f"/dev/nvidia-caps-imex-channels/channel{i}" for i in range(2048)]
    assert [n.get("minor", 0) for n in nodes] == list(range(2048))
    assert {(n["type"], n["major"], n["fileMode"]) for n in nodes} == {("c", 234, 0o666)}
