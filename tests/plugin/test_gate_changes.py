"""Feature gates turned on or off while claims are prepared: teardown follows the kind stored with each claim, and
every prepared claim's devices stay owned whatever its kind. The real plugin over gRPC, the mock NVML with its MIG
state file, the API emulator over HTTP; the plugin is stopped and started again with other gates, as a DaemonSet
rollout with a changed ``FEATURE_GATES`` does."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dradriver.domain.devices import MigDevice
from dradriver.domain.migplacements import MigPlacement
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import running, wait_for
from tests.plugin.test_dynamic_mig import GATES, ONE_G, THREE_G, _create_out_of_band, claim_for, mig_mode, state_lines


def test_dynamic_claims_are_unprepared_after_the_dynamic_mig_gate_is_turned_off(
        mig_node: SandboxNode, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def body() -> None:
        device = ONE_G.format(m=1, s=5)
        async with running(mig_node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(mig_node, "dyn", device)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        assert len(state_lines(mig_node, "gi")) == 1
        async with running(mig_node.config()) as (plugin, kubelet):  # DynamicMIG off now
            assert plugin.registry is not None
            # the start says that the prepared claim is still undone by its kind (the troubleshooting row)
            assert ("DynamicMIG is off: 1 prepared claim(s) hold dynamic-mig undo records from when it was on; "
                    "each is undone when the kubelet unprepares it") in caplog.text
            assert not any(isinstance(d, MigPlacement) for d in plugin.registry.devices.values())
            assert isinstance(plugin.registry.get(device), MigDevice)  # the claim's instance, read as a static one
            assert len(state_lines(mig_node, "gi")) == 1 and not plugin.recovery.swept
            # the claim's stored kind (dynamic-mig) undoes it: the instance goes, MIG mode with it (Hopper)
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert state_lines(mig_node, "gi") == [] and mig_mode(mig_node, 1) == (0, 0)
            assert plugin.state.get(ref.uid) is None
            # the devices are read again: the destroyed instance is no longer published, the whole GPU is back
            await wait_for(lambda: plugin.registry is not None and plugin.registry.get(device) is None
                           and plugin.registry.get("gpu-1") is not None)
            assert "destroyed MIG device MIG-" in caplog.text and f"({device}: GPU instance" in caplog.text
            await wait_for(lambda: "devices read again after a MIG change with DynamicMIG off: 8 GPU(s), "
                                   "0 MIG device(s)" in caplog.text)

    asyncio.run(body())


def test_static_mig_claims_keep_their_instance_when_the_dynamic_mig_gate_is_turned_on(mig_node: SandboxNode) -> None:
    async def body() -> None:
        _create_out_of_band(2, 19, 6, 1)  # the admin's static MIG layout: one 1g.10gb at slice 6 of GPU 2
        static = ONE_G.format(m=2, s=6)
        async with running(mig_node.config()) as (plugin, kubelet):  # DynamicMIG off: a static MIG device
            assert plugin.registry is not None and not isinstance(plugin.registry.get(static), MigPlacement)
            ref = claim_for(mig_node, "static", static)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        [gi] = state_lines(mig_node, "gi")
        async with running(mig_node.config(feature_gates=GATES)) as (plugin, kubelet):
            # the start-up sweep leaves the prepared static claim's instance alone
            assert state_lines(mig_node, "gi") == [gi]
            assert not any(s.startswith("dynamic-mig:") for s in plugin.recovery.swept)
            assert ref.uid not in plugin.recovery.unusable  # its pinned MIG UUID is the instance on the placement
            answer = (await kubelet.prepare([ref]))[ref.uid]  # a pod restart: answered from the claim state
            assert answer.error == "" and [d.device_name for d in answer.devices] == [static]
            # and a dynamic claim whose placement overlaps it is refused instead of destroying it
            other = claim_for(mig_node, "overlap", THREE_G.format(m=2, s=4))
            error = (await kubelet.prepare([other]))[other.uid].error
            assert f"prepared for device {static!r} of another claim" in error, error
            assert state_lines(mig_node, "gi") == [gi]
            # unpreparing the static claim leaves the admin's instance where it was
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert state_lines(mig_node, "gi") == [gi]

    asyncio.run(body())


def test_mps_claims_are_unprepared_after_the_mps_gate_is_turned_off(sandbox: SandboxNode,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A claim dradriver prepared with ``sharing.strategy: MPS`` while ``MPSSupport`` was on is unprepared after
    a restart with the gate off: the stored ``mps`` record's kind undoes it (the daemon's Deployment, its pipe,
    shm and log directories, and the GPUs' compute mode back to DEFAULT), though no new MPS claim is served."""
    from dataclasses import replace

    from dradriver.domain import mps
    from dradriver.domain.featuregates import MPS_SUPPORT
    from dradriver.sandbox.node import SANDBOX_NAMESPACE
    from tests.mps.test_plugin import _modes, _uuids, mps_claim

    sandbox.run_workloads()
    gated = sandbox.mps_config()
    assert gated.feature_gates.mps_support
    ungated = replace(gated, feature_gates=gated.feature_gates.with_gates(**{MPS_SUPPORT: False}))
    caplog.set_level(logging.INFO)

    async def body() -> None:
        assert sandbox.api is not None
        async with running(gated) as (plugin, kubelet):
            ref, claim = mps_claim(sandbox, "mps", count=2)
            uuids = _uuids(plugin, claim)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            daemon_id = mps.control_daemon_id(ref.uid, uuids)
            directory = gated.mps_root / daemon_id
            assert (directory / mps.PIPE_DIR).is_dir() and _modes(plugin, uuids) == {"EXCLUSIVE_PROCESS"}
        deployment = f"mps-control-daemon-{daemon_id}"
        assert sandbox.api.get("Deployment", deployment, SANDBOX_NAMESPACE) is not None
        async with running(ungated) as (plugin, kubelet):  # MPSSupport off now
            assert not plugin.config.feature_gates.mps_support and plugin.mps_daemons is None
            assert ("MPSSupport is off: 1 prepared claim(s) hold mps undo records from when it was on; each is "
                    "undone when the kubelet unprepares it") in caplog.text
            # nothing swept at start: the prepared claim still holds its daemon, and a pod restart is answered
            assert sandbox.api.get("Deployment", deployment, SANDBOX_NAMESPACE) is not None
            assert (directory / mps.PIPE_DIR).is_dir() and ref.uid not in plugin.recovery.unusable
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            # the claim's stored kind (mps) undoes it with the gate off
            assert await kubelet.unprepare([ref]) == {ref.uid: ""}
            assert f"stopped MPS control daemon {SANDBOX_NAMESPACE}/{deployment} of gpu-0,gpu-1" in caplog.text
            assert sandbox.api.get("Deployment", deployment, SANDBOX_NAMESPACE) is None
            assert [d["metadata"]["name"] for d in sandbox.api.objects("Deployment")] == []
            assert not directory.exists() and not sandbox.mounts.is_mounted(directory / mps.SHM_DIR)
            assert _modes(plugin, uuids) == {"DEFAULT"}
            assert plugin.state.get(ref.uid) is None and sandbox.cdi_specs() == []

    asyncio.run(body())
