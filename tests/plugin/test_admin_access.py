"""Admin-access claims never change a device (NVIDIA's kubernetes-sigs/dra-driver-nvidia-gpu#1280): an admin claim
with a sharing config is refused per claim with the config's field path, and the owner's settings stay. Real gRPC,
the API emulator over HTTP, GPU settings read back through the mock NVML."""

from __future__ import annotations

import asyncio

from dradriver.nvml import settings
from dradriver.sandbox.node import SandboxNode
from tests.configs.helpers import entry, params
from tests.configs.test_plugin import allocate
from tests.plugin.conftest import ref_of, result, running
from tests.plugin.test_timeslicing import GATE_ON, PARAMS_AT, session_of, time_slicing, uuid_of


def test_an_admin_claim_with_a_sharing_config_is_refused_and_the_owners_setting_stays(sandbox: SandboxNode) -> None:
    async def body() -> None:
        async with running(sandbox.config(feature_gates=GATE_ON)) as (plugin, kubelet):
            nvml = session_of(plugin)
            owned, idle = uuid_of(plugin, "gpu-0"), uuid_of(plugin, "gpu-1")
            owner = ref_of(allocate(sandbox, "owner", [result("gpu-0")], [time_slicing("Long")]))
            assert (await kubelet.prepare([owner]))[owner.uid].error == ""
            assert settings.compute_timeslice(nvml, owned) == 3
            # an admin claim on the owner's GPU and one on a GPU nobody uses, both with a sharing config
            watch = ref_of(allocate(sandbox, "watch", [result("gpu-0", admin=True)], [time_slicing("Short")]))
            lone = ref_of(allocate(sandbox, "lone", [result("gpu-1", admin=True)], [time_slicing("Medium")]))
            answers = await kubelet.prepare([watch, lone])
            for ref, device in ((watch, "gpu-0"), (lone, "gpu-1")):
                error = answers[ref.uid].error
                assert f"{PARAMS_AT}.sharing.strategy: \"TimeSlicing\" cannot apply to " \
                       f"status.allocation.devices.results[0] (request \"gpu\", device \"{device}\"): it has " \
                       "adminAccess" in error, error
                assert plugin.state.get(ref.uid) is None
            assert settings.compute_timeslice(nvml, owned) == 3 and settings.compute_timeslice(nvml, idle) == 0
            # without sharing the admin claim observes the owner's GPU; its unprepare leaves the owner's setting
            plain = ref_of(allocate(sandbox, "plain", [result("gpu-0", admin=True)], [entry(params())]))
            assert (await kubelet.prepare([plain]))[plain.uid].error == ""
            assert (await kubelet.unprepare([plain]))[plain.uid] == ""
            assert settings.compute_timeslice(nvml, owned) == 3
            assert settings.compute_mode(nvml, owned) is settings.ComputeMode.DEFAULT
            assert (await kubelet.unprepare([owner]))[owner.uid] == ""
            assert settings.compute_timeslice(nvml, owned) == 0

    asyncio.run(body())
