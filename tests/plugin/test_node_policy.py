"""The per-node device policy (gate PerNodeGPUConfig): the node label nvidia.com/dra-driver-gpu.config selects a
profile file whose gpu.advertisedDeviceTypes limits what the running plugin publishes and prepares, applied on a
label change without a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.driverconfig import NODE_LABEL
from dradriver.domain.featuregates import FeatureGates
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for

PROFILES = {
    "mixed": "version: v1alpha1\ngpu:\n  advertisedDeviceTypes: [gpu, mig, vfio]\n",
    "full-gpu": "version: v1alpha1\ngpu:\n  advertisedDeviceTypes: [gpu]\n",
    "passthrough": "version: v1alpha1\ngpu:\n  advertisedDeviceTypes: [vfio]\n",
    "broken": "version: v1alpha1\ngpu:\n  advertisedDeviceTypes: [gpu, mgi]\n",
}
GATE = FeatureGates({"PerNodeGPUConfig": True})


def _profiles(sandbox: SandboxNode) -> Path:
    directory = sandbox.root / "available-configs"
    directory.mkdir(exist_ok=True)
    for name, text in PROFILES.items():
        (directory / name).write_text(text)
    return directory


def _config(sandbox: SandboxNode, **overrides: Any) -> Any:
    return sandbox.config(feature_gates=GATE, driver_config_directory=_profiles(sandbox), **overrides)


def _label(sandbox: SandboxNode, value: str | None) -> None:
    assert sandbox.api is not None
    node = sandbox.api.get("Node", sandbox.node_name)
    assert node is not None
    labels = node["metadata"].setdefault("labels", {})
    if value is None:
        labels.pop(NODE_LABEL, None)
    else:
        labels[NODE_LABEL] = value
    sandbox.api.update(node)


def _published(sandbox: SandboxNode) -> list[str]:
    assert sandbox.api is not None
    return sorted(d["name"] for s in sandbox.api.objects("ResourceSlice") for d in s["spec"].get("devices") or [])


def _events(sandbox: SandboxNode, reason: str) -> list[str]:
    assert sandbox.api is not None
    return [e["message"] for e in sandbox.api.objects("Event") if e.get("reason") == reason]


def _is_mig(name: str) -> bool:
    return "-mig-" in name


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_label_change_republishes_without_restart_and_keeps_prepared_claims(sandbox: SandboxNode) -> None:
    api = sandbox.api
    assert api is not None

    async def body() -> None:
        async with running(_config(sandbox)) as (plugin, kubelet):
            await wait_for(lambda: any(_is_mig(n) for n in _published(sandbox)))
            everything = _published(sandbox)
            migs = [n for n in everything if _is_mig(n)]
            prepared = ref_of(set_allocation(sandbox, api.create(claim_object("before")), [result(migs[0])]))
            assert (await kubelet.prepare([prepared]))[prepared.uid].error == ""
            late = ref_of(set_allocation(sandbox, api.create(claim_object("late")), [result(migs[1])]))

            _label(sandbox, "full-gpu")  # only full GPUs from now on
            await wait_for(lambda: not any(_is_mig(n) for n in _published(sandbox)))
            assert _published(sandbox) == [n for n in everything if not _is_mig(n)]
            assert plugin.node_policy is not None and plugin.node_policy.changes == 1
            assert plugin.lifecycle.stopped is False  # the same running plugin, no restart
            assert any("full-gpu" in m for m in _events(sandbox, "DriverConfigApplied"))

            # The claim prepared before the change is untouched: answered again, then unprepared.
            again = await kubelet.prepare([prepared])
            assert again[prepared.uid].error == "" and again[prepared.uid].devices
            # A MIG claim allocated before the change and not prepared yet is refused, naming device and profile.
            refused = (await kubelet.prepare([late]))[late.uid].error
            assert migs[1] in refused and "full-gpu" in refused and "mig" in refused
            assert await kubelet.unprepare([prepared]) == {prepared.uid: ""}

            _label(sandbox, None)  # label removed: no default profile, everything is back
            await wait_for(lambda: _published(sandbox) == everything)
            assert (await kubelet.prepare([late]))[late.uid].error == ""

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_bad_profile_is_refused_naming_file_and_field_and_publication_is_kept(sandbox: SandboxNode) -> None:
    _label(sandbox, "full-gpu")
    config = _config(sandbox)

    async def body() -> None:
        async with running(config) as (plugin, _):
            await wait_for(lambda: bool(_published(sandbox)) and not any(_is_mig(n) for n in _published(sandbox)))
            kept = _published(sandbox)

            _label(sandbox, "broken")
            await wait_for(lambda: bool(_events(sandbox, "DriverConfigInvalid")))
            message = _events(sandbox, "DriverConfigInvalid")[0]
            assert str(config.driver_config_directory / "broken") in message
            assert "gpu.advertisedDeviceTypes[1]" in message and "'mgi'" in message
            assert "keeping driver config profile 'full-gpu'" in message

            _label(sandbox, "no-such-profile")
            await wait_for(lambda: len(_events(sandbox, "DriverConfigInvalid")) == 2)
            assert "unknown profile" in _events(sandbox, "DriverConfigInvalid")[1]
            await asyncio.sleep(0.3)
            assert _published(sandbox) == kept
            assert plugin.node_policy is not None and plugin.node_policy.policy.profile == "full-gpu"

    asyncio.run(body())


def test_bad_profile_at_start_advertises_nothing(sandbox: SandboxNode) -> None:
    """Fail closed: with no good profile read yet the pool is published empty, and the Event says why."""
    _label(sandbox, "broken")

    async def body() -> None:
        async with running(_config(sandbox)) as (plugin, _):
            assert plugin.node_policy is not None and plugin.node_policy.policy.source == "fail-closed"
            assert _published(sandbox) == []  # an empty pool, not a missing one
            message = _events(sandbox, "DriverConfigInvalid")[0]
            assert "gpu.advertisedDeviceTypes[1]" in message and "nothing is advertised" in message
            _label(sandbox, "full-gpu")
            await wait_for(lambda: len(_published(sandbox)) == 8)

    asyncio.run(body())


def test_passthrough_profile_publishes_an_empty_pool(sandbox: SandboxNode) -> None:
    """A node for VM workloads: vfio only, and without the PassthroughSupport gate no VFIO device, so none at all."""
    async def body() -> None:
        async with running(_config(sandbox, default_config="passthrough")) as (plugin, _):
            assert plugin.node_policy is not None and plugin.node_policy.policy.source == "default"
            assert _published(sandbox) == []

    asyncio.run(body())


def test_label_is_ignored_without_the_gate(sandbox: SandboxNode) -> None:
    _label(sandbox, "passthrough")

    async def body() -> None:
        async with running(sandbox.config(driver_config_directory=_profiles(sandbox))) as (plugin, _):
            await wait_for(lambda: len(_published(sandbox)) == 8)
            assert plugin.node_policy is not None and plugin.node_policy.policy.advertised is None

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_profile_file_edit_is_applied_and_a_lasting_error_is_reported_once(sandbox: SandboxNode,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited ConfigMap changes the file, not the label: the file is re-read when each watch request ends."""
    from dradriver.kubeletplugin.nodepolicy import NodePolicyWatch

    monkeypatch.setattr(NodePolicyWatch, "WATCH_TIMEOUT_S", 1.0)
    _label(sandbox, "full-gpu")
    config = _config(sandbox)

    async def body() -> None:
        async with running(config) as (plugin, _):
            await wait_for(lambda: len(_published(sandbox)) == 6)
            (config.driver_config_directory / "full-gpu").write_text(PROFILES["full-gpu"].replace("[gpu]", "[mig]"))
            await wait_for(lambda: bool(_published(sandbox)) and all(_is_mig(n) for n in _published(sandbox)))
            (config.driver_config_directory / "full-gpu").write_text("version: v1alpha2\n")
            await wait_for(lambda: bool(_events(sandbox, "DriverConfigInvalid")))
            await asyncio.sleep(2.5)  # two more watch requests end, each re-reading the bad file
            assert len(_events(sandbox, "DriverConfigInvalid")) == 1
            assert "version: unsupported version 'v1alpha2'" in _events(sandbox, "DriverConfigInvalid")[0]
            assert all(_is_mig(n) for n in _published(sandbox))
            assert plugin.node_policy is not None and plugin.node_policy.changes == 1

    asyncio.run(body())
