"""The edits cache (``host.devicenodes.EditsCache``): a full GPU's and the spec-level edits reused for NVIDIA's
5 minutes, so a one-claim prepare reads neither ``/proc/devices`` nor the control nodes."""

from __future__ import annotations

import pytest

from dradriver.domain.cdi import ContainerEdits, DeviceNodeError
from dradriver.domain.claims import ClaimRef
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.ports import DevicePlan, UndoRecord
from dradriver.host.devicenodes import EDITS_TTL_S, DeviceNodeInfo, EditsCache, device_edits
from dradriver.preparers.gpu import FullGpuPreparer, StaticMigPreparer
from tests.cdi.conftest import make_gpu, make_migs

REF = ClaimRef("default", "c", "9d62b159-ff64-49fc-8821-57195148c626")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_is_reused_until_its_ttl_and_a_failure_is_not_kept() -> None:
    clock = Clock()
    cache = EditsCache(ttl_s=EDITS_TTL_S, clock=clock)
    made: list[int] = []

    def make() -> ContainerEdits:
        made.append(1)
        return ContainerEdits(env=(f"N={len(made)}",))

    assert cache.get("spec", make).env == ("N=1",)
    clock.now += EDITS_TTL_S - 1
    assert cache.get("spec", make).env == ("N=1",) and len(made) == 1
    clock.now += 1  # expired
    assert cache.get("spec", make).env == ("N=2",)

    def fail() -> ContainerEdits:
        raise DeviceNodeError("no major number for /dev/nvidiactl")

    with pytest.raises(DeviceNodeError):
        cache.get("other", fail)
    assert cache.get("other", make).env == ("N=3",)  # the failure was not kept
    cache.clear()
    assert cache.get("spec", make).env == ("N=4",)


def _plan(preparer: FullGpuPreparer | StaticMigPreparer, device: GpuDevice | MigDevice) -> DevicePlan:
    return DevicePlan(preparer.kind, device.name, device, ("gpu",), False, (), None)


def test_a_full_gpus_edits_come_from_the_cache_and_a_mig_devices_are_read_each_time(
        node_info: DeviceNodeInfo) -> None:
    """After the first claim of a GPU the preparer answers without ``/proc/devices`` (removed here to prove it);
    a MIG device's nodes are read for each claim, as NVIDIA's plugin reads its capability minors."""
    cache = EditsCache()
    gpu = make_gpu(0)
    full, mig = FullGpuPreparer(node_info, cache), StaticMigPreparer(node_info, cache)
    record = UndoRecord("gpu", 1, gpu.name, {})
    first = full.edits(REF, _plan(full, gpu), record)
    assert first == device_edits(gpu, node_info, node_info.read_majors())
    migs = make_migs(make_gpu(1, mig=True))
    assert mig.edits(REF, _plan(mig, migs[0]), record).device_nodes
    node_info.proc_devices.unlink()
    assert full.edits(REF, _plan(full, gpu), record) == first
    with pytest.raises(DeviceNodeError, match="no major number"):
        mig.edits(REF, _plan(mig, migs[0]), record)
    other = make_gpu(2)  # another GPU (or the same name with another minor) is its own entry
    with pytest.raises(DeviceNodeError):
        full.edits(REF, _plan(full, other), record)
