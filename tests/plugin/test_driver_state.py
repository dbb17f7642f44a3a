"""The plugin and the NVIDIA driver's state: a driver that is not loaded at start, comes back, or loses a module
while the plugin runs (the real plugin over the mock ``libnvidia-ml.so.1``, the kubelet emulator over its Unix
sockets, the API emulator over HTTP)."""

from __future__ import annotations

import asyncio

from dradriver.sandbox import scheduler
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import SEED_SELECTOR, claim_object, ref_of, running


def test_a_prepare_after_nvidia_uvm_is_unloaded_fails_instead_of_reusing_its_device_numbers(
        sandbox: SandboxNode) -> None:
    """The spec-level edits are reused only while ``/proc/devices`` is what they were computed from: with
    ``nvidia-uvm`` gone the next prepare fails cleanly, as on a fresh node, instead of giving containers
    ``/dev/nvidia-uvm`` numbers of a module that is not loaded."""
    api = sandbox.api
    assert api is not None
    proc_devices = sandbox.root / "proc" / "devices"
    loaded = proc_devices.read_text()

    async def body() -> None:
        async with running(sandbox.config()) as (plugin, kubelet):
            refs = []
            for name in ("before", "after", "again"):
                api.create(claim_object(name, selector=SEED_SELECTOR))
                [claim] = scheduler.allocate(api, [("default", name)], node_name=sandbox.node_name)
                refs.append(ref_of(claim))
            before, after, again = refs
            assert (await kubelet.prepare([before]))[before.uid].error == ""
            proc_devices.write_text(loaded.replace("508 nvidia-uvm\n", ""))  # the module was unloaded
            error = (await kubelet.prepare([after]))[after.uid].error
            assert after.uid in error and "nvidia-uvm" in error, error
            assert plugin.state.get(after.uid) is None
            proc_devices.write_text(loaded.replace("508 nvidia-uvm", "506 nvidia-uvm"))  # loaded again
            assert (await kubelet.prepare([again]))[again.uid].error == ""
            spec = plugin.runner.spec_path(again.uid).read_text()
            assert '"major":506' in spec.replace(" ", ""), spec

    asyncio.run(body())
