"""The edits cache (``host.devicenodes.EditsCache``): a full GPU's and the spec-level edits reused for NVIDIA's
5 minutes at most, so a one-claim prepare stats no control node, and only while ``/proc/devices`` (the majors they
were computed from) is unchanged."""

from __future__ import annotations

import pytest

from dradriver.domain.cdi import ContainerEdits, DeviceNodeError
from dradriver.domain.claims import ClaimRef
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.ports import DevicePlan, UndoRecord
from dradriver.host.devicenodes import EDITS_TTL_S, DeviceNodeInfo, EditsCache, device_edits
from dradriver.preparers.gpu import FullGpuPreparer, StaticMigPreparer, spec_edits
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
    """After the first claim of a GPU the preparer answers with the same edits object (nothing stat'ed again);
    a MIG device's nodes are read for each claim, as NVIDIA's plugin reads its capability minors."""
    cache = EditsCache(node_info)
    gpu = make_gpu(0)
    full, mig = FullGpuPreparer(node_info, cache), StaticMigPreparer(node_info, cache)
    record = UndoRecord("gpu", 1, gpu.name, {})
    first = full.edits(REF, _plan(full, gpu), record)
    assert first == device_edits(gpu, node_info, node_info.read_majors())
    migs = make_migs(make_gpu(1, mig=True))
    assert mig.edits(REF, _plan(mig, migs[0]), record).device_nodes
    assert full.edits(REF, _plan(full, gpu), record) is first
    other = make_gpu(2)  # another GPU (or the same name with another minor) is its own entry
    assert full.edits(REF, _plan(full, other), record) is not first


def test_cached_edits_are_computed_again_when_the_majors_they_came_from_change(node_info: DeviceNodeInfo) -> None:
    """A driver module unloaded (``nvidia-uvm`` gone from ``/proc/devices``) or loaded with another major: the
    cached spec-level and GPU edits are not served; they are computed again and fail as on a fresh node."""
    clock = Clock()
    cache = EditsCache(node_info, clock=clock)
    full = FullGpuPreparer(node_info, cache)
    gpu = make_gpu(0)
    record = UndoRecord("gpu", 1, gpu.name, {})
    text = node_info.proc_devices.read_text()
    spec = cache.get("spec", lambda: spec_edits(node_info))
    assert {n.path: n.major for n in spec.device_nodes}["/dev/nvidia-uvm"] == 510
    node_info.proc_devices.write_text(text.replace("510 nvidia-uvm", "506 nvidia-uvm"))  # reloaded: new major
    assert {n.path: n.major for n in cache.get("spec", lambda: spec_edits(node_info)).device_nodes}[
        "/dev/nvidia-uvm"] == 506
    node_info.proc_devices.write_text(text.replace("510 nvidia-uvm\n", ""))  # unloaded
    with pytest.raises(DeviceNodeError, match="nvidia-uvm"):
        cache.get("spec", lambda: spec_edits(node_info))
    assert full.edits(REF, _plan(full, gpu), record).device_nodes[0].major == 195  # nvidia is still there
    node_info.proc_devices.unlink()  # the nvidia module gone too
    with pytest.raises(DeviceNodeError, match="no major number"):
        full.edits(REF, _plan(full, gpu), record)
    node_info.proc_devices.write_text(text)
    assert cache.get("spec", lambda: spec_edits(node_info)) == spec
