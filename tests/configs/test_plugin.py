"""Opaque configs through the real kubelet plugin: mock NVML, API emulator over HTTP, kubelet emulator over
the plugin's Unix sockets (fixtures from ``tests/plugin/conftest.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dradriver.domain.identity import GPU_DRIVER
from dradriver.sandbox import scheduler
from dradriver.sandbox.node import SandboxNode
from tests.configs.helpers import entry, params
from tests.plugin.conftest import claim_object, ref_of, result, running


def allocate(node: SandboxNode, name: str, results: list[dict[str, Any]],
             config: list[dict[str, Any]]) -> dict[str, Any]:
    """Create claim ``name`` and write its ``status.allocation`` with ``results`` and ``config``."""
    assert node.api is not None
    created = node.api.create(claim_object(name))
    stored = node.api.get("ResourceClaim", created["metadata"]["name"], created["metadata"]["namespace"])
    assert stored is not None
    stored.setdefault("status", {})["allocation"] = {"devices": {"results": results, "config": config}}
    return node.api.update(stored, subresource="status")


def test_batch_with_valid_gated_and_malformed_configs(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            valid = allocate(sandbox, "valid", [result("gpu-0")], [entry(params(), requests=["gpu"])])
            plain = allocate(sandbox, "plain", [result("gpu-1")], [])
            gated = allocate(sandbox, "gated", [result("gpu-2")], [
                entry(params(), source="FromClass"),
                entry(params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
            ])
            malformed = allocate(sandbox, "malformed", [result("gpu-3")], [
                entry({"anything": 1}, driver="net.example.com"),
                entry(params(sharing={"strategy": "MPS", "mpsConfig": {"threadPercentage": 50}})),
            ])
            refs = [ref_of(c) for c in (valid, plain, gated, malformed)]
            answer = await kubelet.prepare(refs)
            ok_valid, ok_plain, bad_gated, bad_malformed = (answer[r.uid] for r in refs)

            assert ok_valid.error == "" and [d.device_name for d in ok_valid.devices] == ["gpu-0"]
            assert ok_plain.error == "" and [d.device_name for d in ok_plain.devices] == ["gpu-1"]
            assert bad_gated.error == (
                f"claim {refs[2]}: status.allocation.devices.config[1].opaque.parameters.sharing.strategy: "
                '"TimeSlicing" is selected as the GPU sharing strategy, but the "TimeSlicingSettings" feature '
                "gate is not enabled")
            assert bad_malformed.error.startswith(
                f"claim {refs[3]}: status.allocation.devices.config[1].opaque.parameters.sharing.mpsConfig."
                "threadPercentage: unknown field")

            # Nothing written for the refused claims: no state record, no CDI spec; the others are prepared.
            assert set(plugin.state.claims()) == {refs[0].uid, refs[1].uid}
            assert GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, refs[0].uid).exists()
            assert not GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, refs[2].uid).exists()
            assert not GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, refs[3].uid).exists()
            assert len(sandbox.cdi_specs()) == 2

            # The refused claims' devices stay free: a valid claim gets gpu-2 at once.
            after = allocate(sandbox, "after", [result("gpu-2")], [entry(params())])
            assert (await kubelet.prepare([ref_of(after)]))[after["metadata"]["uid"]].error == ""

    asyncio.run(body())


@pytest.mark.parametrize("sandbox", ["dgx-a100"], indirect=True)
def test_mig_configs_select_by_device_type(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            migs = [d.name for d in plugin.inventory.allocatable() if d.name.startswith("gpu-0-mig-")]
            fine = allocate(sandbox, "fine", [result(migs[0], request="small")], [
                entry(params(), source="FromClass"),  # a GpuConfig for every request: skipped for MIG devices
                entry(params("MigDeviceConfig"), requests=["small"]),
            ])
            wrong = allocate(sandbox, "wrong", [result(migs[1], request="small")], [
                entry(params(), requests=["small"]),
            ])
            refs = [ref_of(fine), ref_of(wrong)]
            answer = await kubelet.prepare(refs)
            assert answer[refs[0].uid].error == ""
            assert answer[refs[1].uid].error == (
                f"claim {refs[1]}: status.allocation.devices.config[0]: cannot apply GpuConfig to device "
                f'"{migs[1]}" of type "mig" (request: small)')
            assert set(plugin.state.claims()) == {refs[0].uid}

    asyncio.run(body())


def test_configs_copied_by_the_scheduler_reach_the_plugin(sandbox: SandboxNode) -> None:
    async def body() -> None:
        assert sandbox.api is not None
        async with running(sandbox.config()) as (_, kubelet):
            for name, parameters in (("exclusive", params()),
                                     ("mps", params(sharing={"strategy": "MPS"}))):
                obj = claim_object(name)
                obj["spec"]["devices"]["config"] = [
                    {"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": parameters}}]
                sandbox.api.create(obj)
            claims = scheduler.allocate(sandbox.api, [("default", "exclusive"), ("default", "mps")],
                                        node_name=sandbox.node_name)
            refs = [ref_of(c) for c in claims]
            answer = await kubelet.prepare(refs)
            assert answer[refs[0].uid].error == ""
            assert answer[refs[1].uid].error.endswith(
                'status.allocation.devices.config[0].opaque.parameters.sharing.strategy: "MPS" is selected as '
                'the GPU sharing strategy, but the "MPSSupport" feature gate is not enabled')

    asyncio.run(body())
