"""Feature gates turned on or off while claims are prepared: teardown follows the kind stored with each claim, and
every prepared claim's devices stay owned whatever its kind. The real plugin over gRPC, the mock NVML with its MIG
state file, the API emulator over HTTP; the plugin is stopped and started again with other gates, as a DaemonSet
rollout with a changed ``FEATURE_GATES`` does."""

from __future__ import annotations

import asyncio

from dradriver.domain.devices import MigDevice
from dradriver.domain.migplacements import MigPlacement
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import running, wait_for
from tests.plugin.test_dynamic_mig import GATES, ONE_G, THREE_G, _create_out_of_band, claim_for, mig_mode, state_lines


def test_dynamic_claims_are_unprepared_after_the_dynamic_mig_gate_is_turned_off(mig_node: SandboxNode) -> None:
    async def body() -> None:
        device = ONE_G.format(m=1, s=5)
        async with running(mig_node.config(feature_gates=GATES)) as (_plugin, kubelet):
            ref = claim_for(mig_node, "dyn", device)
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
        assert len(state_lines(mig_node, "gi")) == 1
        async with running(mig_node.config()) as (plugin, kubelet):  # DynamicMIG off now
            assert plugin.registry is not None
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
