"""The renderer on its own, run against both implementations: output shape, version rules, bad input."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.cdi.helpers import validate

NODE = ("/dev/nvidia0", "", "c", 195, 0, 0o666, "rwm", None, None)
EMPTY = ((), (), (), (), (), ())


def edits(**kw: Any) -> tuple[Any, ...]:
    """Return an edits record with the named sections filled (env, nodes, nets, hooks, mounts, gids)."""
    order = ["env", "nodes", "nets", "hooks", "mounts", "gids"]
    return tuple(tuple(kw.get(k, ())) for k in order)


DEV = ("gpu-0", edits(nodes=[NODE]))


@pytest.mark.parametrize(
    ("devices", "common", "annotations", "kind", "expected"),
    [
        ([DEV], None, (), "vendor.com/gpu", "0.3.0"),
        ([DEV], edits(mounts=[("/a", "/b", ("ro",), "bind")]), (), "vendor.com/gpu", "0.4.0"),
        ([("0", edits(nodes=[NODE]))], None, (), "vendor.com/gpu", "0.5.0"),
        (
            [("gpu-0", edits(nodes=[("/dev/x", "/host/dev/x", "", 0, 0, None, "", None, None)]))],
            None,
            (),
            "vendor.com/gpu",
            "0.5.0",
        ),
        ([DEV], None, (("vendor.com/k", "v"),), "vendor.com/gpu", "0.6.0"),
        ([("gpu-0", edits(nodes=[NODE]), (("k", "v"),))], None, (), "vendor.com/gpu", "0.6.0"),
        ([DEV], None, (), "vendor.com/gpu.coherent", "0.6.0"),
        ([DEV], edits(gids=[44]), (), "vendor.com/gpu", "0.7.0"),
        ([DEV], edits(nets=[("eth0", "net0")]), (), "vendor.com/gpu", "1.1.0"),
    ],
)
def test_minimum_version(
    impl: ModuleType, devices: Any, common: Any, annotations: Any, kind: str, expected: str
) -> None:
    spec = validate(impl.render_spec(kind, devices, common, annotations))
    assert spec["cdiVersion"] == expected


def test_declared_version(impl: ModuleType) -> None:
    spec = validate_declared(impl.render_spec("vendor.com/gpu", [DEV], None, (), "v1.0.0"))
    assert spec["cdiVersion"] == "v1.0.0"
    with pytest.raises(ValueError, match=r"older than '0\.5\.0'"):
        impl.render_spec("vendor.com/gpu", [("0", edits(nodes=[NODE]))], None, (), "0.4.0")
    with pytest.raises(ValueError, match="not a known CDI version"):
        impl.render_spec("vendor.com/gpu", [DEV], None, (), "0.9.0")


def validate_declared(data: bytes) -> dict[str, Any]:
    from tests.cdi.helpers import check_strict, schema_validator

    spec = check_strict(data)
    schema_validator().validate(spec)
    return spec


def test_all_fields_in_go_order(impl: ModuleType) -> None:
    common = edits(
        env=["A=1", "B="],
        nodes=[("/dev/x", "/h/dev/x", "b", 8, 1, 0o600, "rw", 0, 1000)],
        hooks=[
            (
                "createContainer",
                "/usr/bin/nvidia-cdi-hook",
                ("nvidia-cdi-hook", "update-ldcache"),
                ("NVIDIA_CTK_DEBUG=false",),
                30,
            )
        ],
        mounts=[("/usr/lib/libcuda.so.1", "/usr/lib/libcuda.so.1", ("ro", "nosuid"), "")],
    )
    data = impl.render_spec("vendor.com/gpu", [DEV], common)
    assert data.startswith(b'{"cdiVersion":"0.5.0","kind":"vendor.com/gpu","devices":[{"name":"gpu-0"')
    spec = validate(data)
    assert spec["containerEdits"]["deviceNodes"][0] == {
        "path": "/dev/x",
        "hostPath": "/h/dev/x",
        "type": "b",
        "major": 8,
        "minor": 1,
        "fileMode": 384,
        "permissions": "rw",
        "uid": 0,
        "gid": 1000,
    }
    assert impl.render_spec("vendor.com/gpu", [DEV]).endswith(b',"containerEdits":{}}')


def test_escaping_matches_json(impl: ModuleType) -> None:
    import json

    env = 'X=é"\\\n\t\x00\x7f\U0001f600 <&>'
    data = impl.render_spec("vendor.com/gpu", [("gpu-0", edits(env=[env]))])
    assert json.loads(data)["devices"][0]["containerEdits"]["env"] == [env]
    assert data.isascii()


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("vendor.com", [DEV]), ValueError, "must be vendor/class"),
        (("v/gpu", [DEV]), ValueError, "vendor must be at least 2 characters"),
        (("vendor.com/1gpu", [DEV]), ValueError, "class must start with a letter"),
        (("vendor.com/gpu/x", [DEV]), ValueError, "invalid character '/'"),
        ((42, [DEV]), TypeError, "kind must be str, not int"),
        (("vendor.com/gpu", []), ValueError, "at least one device"),
        (("vendor.com/gpu", {"a": 1}), TypeError, "devices must be a tuple or list"),
        (("vendor.com/gpu", [("gpu 0", edits(nodes=[NODE]))]), ValueError, "invalid character ' '"),
        (("vendor.com/gpu", [("-gpu", edits(nodes=[NODE]))]), ValueError, "must start with a letter or digit"),
        (("vendor.com/gpu", [("gpu-", edits(nodes=[NODE]))]), ValueError, "must end with a letter or digit"),
        (("vendor.com/gpu", [DEV, DEV]), ValueError, r"duplicate device name \(also devices\[0\]\)"),
        (("vendor.com/gpu", [("gpu-0", EMPTY)]), ValueError, "needs at least one edit"),
        (("vendor.com/gpu", [("gpu-0", edits(env=["=x"]))]), ValueError, "not NAME=VALUE"),
        (("vendor.com/gpu", [("gpu-0", edits(nodes=[NODE[:8]]))]), TypeError, "must have 9 fields"),
        (
            ("vendor.com/gpu", [("gpu-0", edits(nodes=[("dev/x", *NODE[1:])]))]),
            ValueError,
            r"deviceNodes\[0\].path 'dev/x' is not an absolute path",
        ),
        (
            ("vendor.com/gpu", [("gpu-0", edits(nodes=[("/x", "", "char", 1, 1, None, "", None, None)]))]),
            ValueError,
            "type 'char'",
        ),
        (
            ("vendor.com/gpu", [("gpu-0", edits(nodes=[("/x", "", "c", 4096, 1, None, "", None, None)]))]),
            ValueError,
            r"major 4096 is out of range \[0, 4095\]",
        ),
        (
            ("vendor.com/gpu", [("gpu-0", edits(nodes=[("/x", "", "c", True, 1, None, "", None, None)]))]),
            TypeError,
            "major must be int, not bool",
        ),
        (
            ("vendor.com/gpu", [("gpu-0", edits(nodes=[("/x", "", "c", 1, 1, None, "none", None, None)]))]),
            ValueError,
            "may hold only",
        ),
        (
            ("vendor.com/gpu", [("gpu-0", edits(hooks=[("preStart", "/h", (), (), None)]))]),
            ValueError,
            "not a CDI hook name",
        ),
        (
            ("vendor.com/gpu", [("gpu-0", edits(hooks=[("prestart", "/h", (), (), 0)]))]),
            ValueError,
            "timeout 0 is out of range",
        ),
        (("vendor.com/gpu", [("gpu-0", edits(mounts=[("", "/b", (), "")]))]), ValueError, "not an absolute path"),
        (("vendor.com/gpu", [("gpu-0", edits(nets=[("eth0", "a"), ("eth0", "b")]))]), ValueError, "duplicated"),
        (("vendor.com/gpu", [("gpu-0", edits(gids=[-1]))]), ValueError, "out of range"),
        (("vendor.com/gpu", [DEV], None, (("Bad_Prefix/k", "v"),)), ValueError, "DNS subdomain"),
        (("vendor.com/gpu", [DEV], None, (("k", "v"), ("k", "w"))), ValueError, "duplicate key"),
    ],
)
def test_bad_input(impl: ModuleType, args: tuple[Any, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        impl.render_spec(*args)


def test_channel_spec_matches_generic_spec(impl: ModuleType) -> None:
    channels = list(range(0, 2048, 7))
    devices = [
        (
            f"ch-{n}",
            edits(
                nodes=[
                    (
                        f"/dev/nvidia-caps-imex-channels/channel{n}",
                        f"/r/dev/nvidia-caps-imex-channels/channel{n}",
                        "c",
                        234,
                        n,
                        438,
                        "",
                        None,
                        None,
                    )
                ]
            ),
        )
        for n in channels
    ]
    bulk = impl.render_channel_spec("nvidia.com/imex-channel", channels, 234, "ch-", 438, "/r/")
    assert bulk == impl.render_spec("nvidia.com/imex-channel", devices)
    validate(bulk)
    with pytest.raises(ValueError, match=r"channels\[0\] -1 is out of range"):
        impl.render_channel_spec("nvidia.com/imex-channel", [-1], 234)
    with pytest.raises(ValueError, match=r"duplicate device name"):
        impl.render_channel_spec("nvidia.com/imex-channel", [5, 5], 234)
    with pytest.raises(ValueError, match="invalid CDI device name"):
        impl.render_channel_spec("nvidia.com/imex-channel", [5], 234, "bad name-")


def test_one_device_channel_spec_matches_generic_spec(impl: ModuleType) -> None:
    """``device_name``: the bytes of a generic spec whose one device lists every channel's node."""
    channels = [0, *range(2047, 0, -5)]
    nodes = [
        (
            f"/dev/nvidia-caps-imex-channels/channel{n}",
            f"/r/dev/nvidia-caps-imex-channels/channel{n}",
            "c",
            234,
            n,
            438,
            "",
            None,
            None,
        )
        for n in channels
    ]
    common = (("NVIDIA_VISIBLE_DEVICES=void",), (), (), (), (), ())
    bulk = impl.render_channel_spec("k8s.compute-domain.nvidia.com/claim", channels, 234, "", 438, "/r/", common,
                                    None, "uid-channel-0")
    assert bulk == impl.render_spec("k8s.compute-domain.nvidia.com/claim", [("uid-channel-0", edits(nodes=nodes))],
                                    common)
    validate(bulk)
    with pytest.raises(ValueError, match=r"channels\[2\] 5: duplicate channel \(also channels\[0\]\)"):
        impl.render_channel_spec("nvidia.com/imex-channel", [5, 6, 5], 234, device_name="all")
    with pytest.raises(ValueError, match="takes no name_prefix"):
        impl.render_channel_spec("nvidia.com/imex-channel", [5], 234, "ch-", device_name="all")
    with pytest.raises(ValueError, match="needs at least one channel"):
        impl.render_channel_spec("nvidia.com/imex-channel", [], 234, device_name="all")
    with pytest.raises(ValueError, match=r"devices\[0\]\.name 'a b': invalid CDI device name"):
        impl.render_channel_spec("nvidia.com/imex-channel", [5], 234, device_name="a b")
