"""The renderers reuse the last spec-level edits they rendered when the same immutable record comes again (a plugin
passes one spec-level record for every claim spec): the bytes, the version it raises and its errors stay those of a
fresh render, in both implementations."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest

from dradriver.domain import cdi
from dradriver.domain.cdi import CdiKind
from tests.cdi.helpers import validate

NODE = ("/dev/nvidia0", "", "c", 195, 0, 0o666, "rwm", None, None)
KIND = "k8s.gpu.nvidia.com/claim"


def edits(**kw: Any) -> tuple[Any, ...]:
    """An edits record with the named sections filled (env, nodes, nets, hooks, mounts, gids)."""
    return tuple(tuple(kw.get(k, ())) for k in ("env", "nodes", "nets", "hooks", "mounts", "gids"))


def _common(n: int = 3, **kw: Any) -> tuple[Any, ...]:
    mounts = [(f"/usr/lib/lib{i}.so", f"/usr/lib/lib{i}.so", ("ro", "nosuid", "nodev", "bind"), "") for i in range(n)]
    return edits(env=["NVIDIA_VISIBLE_DEVICES=void"], mounts=mounts, **kw)


def _copy(value: Any) -> Any:
    """An equal record made of new tuples (a different object at every level)."""
    return tuple(_copy(v) for v in value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("common", [_common(), _common(gids=[44]), _common(nodes=[("/dev/x", "/host/dev/x", "", 0, 0,
                                                                                   None, "", None, None)])],
                         ids=["mounts", "gids-0.7", "hostpath-0.5"])
def test_same_record_again_renders_as_fresh(impl: ModuleType, common: tuple[Any, ...]) -> None:
    devices_a = [("uid-gpu-0", edits(nodes=[NODE]))]
    devices_b = [("uid-gpu-1", edits(env=["A=1"]))]
    first = impl.render_spec(KIND, devices_a, common)
    again = impl.render_spec(KIND, devices_b, common)  # the cached part, other devices
    fresh = impl.render_spec(KIND, devices_b, _copy(common))  # an equal record: rendered anew
    assert again == fresh
    assert impl.render_spec(KIND, devices_a, common) == first
    spec_again, spec_fresh = validate(again), validate(fresh)
    assert spec_again["cdiVersion"] == spec_fresh["cdiVersion"]  # the version the common part raises is kept
    # the cached fragment does not leak the version it raised into a spec without it
    assert validate(impl.render_spec(KIND, devices_b, None))["cdiVersion"] == "0.3.0"


def test_mutable_common_is_not_reused(impl: ModuleType) -> None:
    """A record holding a list could change between calls: it is rendered every time."""
    mounts = [("/a", "/b", ("ro",), "bind")]
    common = ((), (), (), (), mounts, ())  # the mounts section is the list itself
    before = json.loads(impl.render_spec(KIND, [("d", edits(nodes=[NODE]))], common))
    mounts.append(("/c", "/d", ("ro",), "bind"))
    after = json.loads(impl.render_spec(KIND, [("d", edits(nodes=[NODE]))], common))
    assert len(before["containerEdits"]["mounts"]) == 1
    assert len(after["containerEdits"]["mounts"]) == 2


def test_bad_common_fails_every_time(impl: ModuleType) -> None:
    """A record that fails is never cached: the same bad record fails again with the same message."""
    bad = edits(env=["NOT AN ENV ENTRY"])
    messages = []
    for _ in range(2):
        with pytest.raises(ValueError) as err:
            impl.render_spec(KIND, [("d", edits(nodes=[NODE]))], bad)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "containerEdits" in messages[0]


def test_claim_spec_builds_the_spec_level_record_once() -> None:
    """``render_claim_spec`` hands the renderer the same record object for the same ContainerEdits, and a new one
    for other edits."""
    kind = CdiKind("k8s.gpu.nvidia.com", "claim")
    spec_edits = cdi.ContainerEdits(env=("NVIDIA_VISIBLE_DEVICES=void",),
                                    mounts=(cdi.Mount("/usr/lib/libx.so", "/usr/lib/libx.so", ("ro", "bind")),))
    device = [("gpu-0", cdi.ContainerEdits(device_nodes=(cdi.DeviceNode("/dev/nvidia0", major=195, minor=0),)))]
    uid = "6c6ae1b3-1c6e-4a3b-9d0f-2b1f1c1f0a11"
    one = cdi.render_claim_spec(kind, uid, device, spec_edits)
    record = cdi._spec_edits_record(spec_edits)
    assert cdi._spec_edits_record(spec_edits) is record
    assert cdi.render_claim_spec(kind, uid, device, spec_edits) == one
    other = cdi.ContainerEdits(env=("NVIDIA_VISIBLE_DEVICES=void",))
    assert cdi._spec_edits_record(other) is not record
    assert json.loads(cdi.render_claim_spec(kind, uid, device, other))["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"]}
