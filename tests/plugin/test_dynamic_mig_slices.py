"""The running plugin publishes dynamic-MIG ResourceSlices (``DynamicMIG`` gate) over HTTP to the API emulator
(which answers ``GET /version`` as 1.34: the combined layout), and an instance created at prepare leaves them as
they are (the publisher has nothing to write)."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes_validate
import pytest

from dradriver.domain import featuregates as fg
from dradriver.domain.resourceslices import limit_violations
from dradriver.sandbox.node import SandboxNode
from tests import factories
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for

GATES = fg.parse_feature_gates("DynamicMIG=true")


def _slices(node: SandboxNode) -> list[dict[str, Any]]:
    assert node.api is not None
    return sorted(node.api.objects("ResourceSlice"), key=lambda s: s["metadata"]["name"])


@pytest.mark.slow  # a plugin start on 8 GPUs with 200 placements plus a prepare: several seconds
def test_plugin_publishes_counter_sets_and_placements_and_keeps_them_across_prepare() -> None:
    with SandboxNode(profile="dgx-h100", mig_state=True) as node:
        assert node.api is not None
        node.api.create(factories.DEVICE_CLASS)

        async def body() -> None:
            async with running(node.config(feature_gates=GATES)) as (plugin, kubelet):
                await wait_for(lambda: len(_slices(node)) == 8)
                slices = _slices(node)
                kubernetes_validate.validate(slices[0], "1.34.0", strict=True)  # all of them: test_partitions.py
                for s in slices:
                    assert limit_violations(s, (1, 34)) == []
                    [counter_set] = s["spec"]["sharedCounters"]
                    minor = counter_set["name"].split("-")[1]
                    names = [d["name"] for d in s["spec"]["devices"]]
                    assert len(names) == 26 and names[-1] == f"gpu-{minor}"
                    assert all(n.startswith(f"gpu-{minor}-mig-") for n in names[:-1])
                before = [(s["metadata"]["name"], s["metadata"]["resourceVersion"]) for s in slices]
                device = "gpu-0-mig-1g10gb-19-6"  # what first fit takes (tests/domain/test_partitions.py)
                assert slices[0]["spec"]["devices"][0]["name"] == device
                assert node.api is not None
                created = node.api.create(claim_object("one-g-real"))
                ref = ref_of(set_allocation(node, created, [result(device)]))
                answer = await kubelet.prepare([ref])
                assert answer[ref.uid].error == ""
                await wait_for(lambda: len(plugin.inventory.migs) == 1)
                assert plugin.publisher is not None and plugin.desired is not None
                published = await asyncio.to_thread(plugin.publisher.publish, plugin.desired())
                assert not published.wrote  # the instance changed no published device
                after = [(s["metadata"]["name"], s["metadata"]["resourceVersion"]) for s in _slices(node)]
                assert after == before
                assert await kubelet.unprepare([ref]) == {ref.uid: ""}

        asyncio.run(body())
