"""The VFIO device preparer (:mod:`dradriver.preparers.vfio`) on a sandbox node's PCI tree served by the PCI bus
stand-in, with the mock NVML reading the same tree: the round trip back to ``nvidia`` (NVML lists the GPU again
with its UUID and minor), each step's failure and rollback, a SIGKILL between steps converged by a fresh
preparer's sweep and undo, the IOMMU group, SR-IOV, MIG and in-use refusals, and the CDI edits per config."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef
from dradriver.domain.passthrough import VfioDevice
from dradriver.domain.ports import DevicePlan, DevicePreparer, PartiallyApplied, UndoRecord
from dradriver.host.pci import ModuleLoadError, NvidiaNotLoadedError, PciHost
from dradriver.nvml import mock
from dradriver.preparers.vfio import VfioPreparer, vfio_options
from dradriver.sandbox.node import FIRST_IOMMU_GROUP, SandboxNode
from tests import factories

PROFILE = "dgx-h100"
GPU0 = "0000:18:00.0"
AUDIO = "0000:18:00.1"
REF = ClaimRef("vms", "vm-a", "7a1c0de0-0000-4000-8000-000000000001")
OTHER = ClaimRef("vms", "vm-b", "7a1c0de0-0000-4000-8000-000000000002")


def _nvml_gpus() -> dict[str, tuple[str, int]]:
    """PCI bus ID -> (UUID, minor) of every GPU NVML lists now (a fresh nvmlInit)."""
    ctypes.CDLL(str(mock.activate(PROFILE)), mode=ctypes.RTLD_GLOBAL)
    pynvml.nvmlInit()
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            out[(bus.decode() if isinstance(bus, bytes) else bus)[4:].lower()] = (
                pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetMinorNumber(h))
        return out
    finally:
        pynvml.nvmlShutdown()


def _device(host: PciHost, address: str = GPU0, index: int = 0) -> VfioDevice:
    gpu = next(g for g in mock.resolved_gpus(mock.load_profile(PROFILE))
               if g["pciBusId"][4:].lower() == address)
    return VfioDevice(index=index, function=host.function(address), product_name=gpu["name"],
                      parent_minor=gpu["minorNumber"], parent_uuid=gpu["uuid"])


def _claim(device: VfioDevice, ref: ClaimRef = REF) -> Claim:
    return Claim(ref, (AllocationResult("vm", "gpu.nvidia.com", "gpu-node-1", device.name),))


def _config(policy: str = "LegacyOnly", api: bool = False) -> Any:
    return SimpleNamespace(config=SimpleNamespace(iommu=SimpleNamespace(backend_policy=policy,
                                                                        enable_api_device=api)))


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile=PROFILE, pci_tree=True) as n:
        yield n


def _prepare(preparer: VfioPreparer, device: VfioDevice, group: Any = None) -> tuple[Any, UndoRecord]:
    plan = preparer.plan(_claim(device), device, _claim(device).results, group)
    return plan, preparer.apply(REF, plan)


def _on_nvidia(host: PciHost, address: str = GPU0) -> bool:
    f = host.function(address)
    return f.driver == "nvidia" and f.driver_override is None


def test_a_gpu_is_passed_through_and_given_back_to_nvidia_with_its_uuid_and_minor(node: SandboxNode) -> None:
    host = node.pci_host(settle_s=5.0)
    before = _nvml_gpus()
    assert len(before) == 8
    changes: list[int] = []
    preparer = VfioPreparer(host, on_change=lambda: changes.append(1))
    assert isinstance(preparer, DevicePreparer)
    device = _device(host)
    plan, record = _prepare(preparer, device)
    f = host.function(GPU0)
    assert (f.driver, f.driver_override) == ("vfio-pci", "vfio-pci")
    assert (node.root / "dev" / "vfio" / str(FIRST_IOMMU_GROUP)).exists()
    assert record.data["steps"] == ["override", "unbind", "bind", "groupNode"]
    assert (record.data["originalDriver"], record.data["minor"], record.data["uuid"]) == (
        "nvidia", device.parent_minor, device.parent_uuid)
    assert GPU0 not in _nvml_gpus() and len(_nvml_gpus()) == 7
    edits = preparer.edits(REF, plan, record)
    assert edits.env == () and preparer.claim_edits(REF, [plan], [record]).env == ("NVIDIA_VISIBLE_DEVICES=void",)
    assert [(n.path, n.host_path) for n in edits.device_nodes] == [
        (f"/dev/vfio/{FIRST_IOMMU_GROUP}", f"{node.root}/dev/vfio/{FIRST_IOMMU_GROUP}")]
    fresh = VfioPreparer(host)  # undo from the stored record, as after a restart
    fresh.undo(REF, UndoRecord.from_json(record.to_json()))
    fresh.undo(REF, record)  # idempotent
    assert _on_nvidia(host)
    assert not (node.root / "dev" / "vfio" / str(FIRST_IOMMU_GROUP)).exists()
    assert _nvml_gpus() == before
    assert changes


def test_the_give_back_while_the_nvidia_module_is_unloaded_writes_nothing_and_names_why(node: SandboxNode) -> None:
    """``rmmod nvidia`` (a driver upgrade) while the GPU is on vfio-pci: its undo raises before any write, naming
    the function and why (a bind to ``nvidia`` cannot happen), the GPU stays on vfio-pci with its override and group
    node, and nothing is re-read; once the module is loaded the same record gives it back."""
    host = node.pci_host(settle_s=5.0)
    changes: list[int] = []
    preparer = VfioPreparer(host, on_change=lambda: changes.append(1))
    _, record = _prepare(preparer, _device(host))
    changes.clear()
    node.unload_nvidia_module()
    with pytest.raises(NvidiaNotLoadedError, match=rf"{GPU0}: cannot give it back to nvidia: the nvidia driver is "
                                                   r"not loaded \(.*/bus/pci/drivers/nvidia does not exist"):
        preparer.undo(REF, record)
    f = host.function(GPU0)
    assert (f.driver, f.driver_override) == ("vfio-pci", "vfio-pci") and changes == []
    assert (node.root / "dev" / "vfio" / str(FIRST_IOMMU_GROUP)).exists()
    node.load_nvidia_module()
    preparer.undo(REF, record)
    assert _on_nvidia(host) and changes == [1]


def test_a_retried_prepare_of_a_gpu_already_on_vfio_changes_nothing(node: SandboxNode) -> None:
    host = node.pci_host(settle_s=5.0)
    preparer = VfioPreparer(host)
    device = _device(host)
    _prepare(preparer, device)
    _, again = _prepare(preparer, device)
    assert again.data["steps"] == [] and host.function(GPU0).driver == "vfio-pci"
    preparer.undo(REF, again)
    assert _on_nvidia(host)


@pytest.mark.parametrize(("fault", "done"), [
    ("unbind", ["override"]),
    ("bind", ["override", "unbind"]),
    ("vfio-node", ["override", "unbind", "bind"]),
])
def test_a_failed_step_is_partially_applied_with_the_steps_done_and_undone_to_nvidia(
        node: SandboxNode, fault: str, done: list[str]) -> None:
    host = node.pci_host(settle_s=0.3)
    assert node.pci_bus is not None
    node.pci_bus.inject(fault, GPU0)
    preparer = VfioPreparer(host)
    device = _device(host)
    with pytest.raises(PartiallyApplied) as err:
        _prepare(preparer, device)
    assert err.value.record.data["steps"] == done
    assert str(REF) in str(err.value) and "gpu-vfio-0" in str(err.value) and GPU0 in str(err.value)
    node.pci_bus.clear_faults()
    preparer.undo(REF, err.value.record)
    assert _on_nvidia(host)
    assert GPU0 in _nvml_gpus()


def test_a_module_that_cannot_be_loaded_fails_the_prepare_with_nothing_changed(node: SandboxNode) -> None:
    host = node.pci_host(settle_s=0.3)
    assert node.pci_bus is not None
    node.pci_bus.inject("modprobe", module="vfio-pci")
    device = _device(host)
    with pytest.raises(ModuleLoadError, match=f"PCI function {GPU0}: loading module vfio-pci"):
        _prepare(VfioPreparer(host), device)
    assert _on_nvidia(host)


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_a_sigkill_between_steps_is_given_back_by_a_fresh_preparers_sweep(node: SandboxNode, steps: int) -> None:
    host = node.pci_host(settle_s=5.0)
    actions = [lambda: host.set_driver_override(GPU0, "vfio-pci"), lambda: host.unbind(GPU0),
               lambda: host.load_module("vfio-pci"), lambda: host.bind(GPU0, "vfio-pci")]
    for action in actions[:steps]:
        action()
    assert VfioPreparer(host).sweep([]) == [GPU0]
    assert _on_nvidia(host)
    assert VfioPreparer(host).sweep([]) == []


def test_the_sweep_never_touches_a_gpu_another_claims_record_holds(node: SandboxNode) -> None:
    host = node.pci_host(settle_s=5.0)
    preparer = VfioPreparer(host)
    _, held = _prepare(preparer, _device(host))
    host.set_driver_override("0000:2a:00.0", "vfio-pci")  # a crash's leftover on another GPU
    assert VfioPreparer(host).sweep([held]) == ["0000:2a:00.0"]
    assert host.function(GPU0).driver == "vfio-pci" and _on_nvidia(host, "0000:2a:00.0")


def test_a_group_with_a_function_on_another_driver_is_refused_naming_it() -> None:
    with SandboxNode(profile=PROFILE, pci_tree=True, shared_iommu_groups=((GPU0, AUDIO),)) as node:
        host = node.pci_host(settle_s=5.0)
        preparer = VfioPreparer(host)
        device = _device(host)
        with pytest.raises(ClaimError) as err:
            preparer.plan(_claim(device), device, _claim(device).results, None)
        text = str(err.value)
        assert str(REF) in text and "'gpu-vfio-0'" in text and f"IOMMU group {FIRST_IOMMU_GROUP}" in text
        assert f"{AUDIO} (driver snd_hda_intel)" in text
        host.unbind(AUDIO)  # the operator frees the group: the whole group goes together
        _, record = _prepare(preparer, device)
        assert (node.root / "dev" / "vfio" / str(FIRST_IOMMU_GROUP)).exists()
        preparer.undo(REF, record)
        assert _on_nvidia(host)


def test_a_gpu_in_use_is_refused_naming_the_process_and_left_on_nvidia(node: SandboxNode) -> None:
    host = node.pci_host(settle_s=5.0)
    device = _device(host)
    with open(node.root / "dev" / f"nvidia{device.parent_minor}") as held:
        proc = subprocess.Popen(["sleep", "60"], stdin=held)
    try:
        for _ in range(500):
            if any(h.comm == "sleep" for h in host.holders(device.parent_minor or 0)):
                break
        with pytest.raises(ClaimError) as err:
            _prepare(VfioPreparer(host), device)
        assert f"sleep (pid {proc.pid})" in str(err.value) and str(REF) in str(err.value)
        assert _on_nvidia(host)
    finally:
        proc.kill()
        proc.wait()


def test_sriov_virtual_functions_and_mig_mode_are_refused(node: SandboxNode) -> None:
    host = node.pci_host(settle_s=5.0)
    device = _device(host)
    with pytest.raises(ClaimError, match="is in MIG mode"):
        VfioPreparer(host, mig_enabled=lambda uuid: uuid == device.parent_uuid).plan(
            _claim(device), device, _claim(device).results, None)
    (host.device_path(GPU0) / "sriov_numvfs").write_text("2\n")
    with pytest.raises(ClaimError, match=r"2 SR-IOV virtual function\(s\) are enabled"):
        VfioPreparer(host).plan(_claim(device), device, _claim(device).results, None)


def test_admin_access_is_refused(node: SandboxNode) -> None:
    host = node.pci_host()
    device = _device(host)
    claim = Claim(REF, (AllocationResult("vm", "gpu.nvidia.com", "gpu-node-1", device.name, admin_access=True),))
    with pytest.raises(ClaimError, match="adminAccess is not supported for VFIO devices"):
        VfioPreparer(host).plan(claim, device, claim.results, None)


def test_iommufd_edits_follow_the_backend_policy_and_the_api_device_option() -> None:
    with SandboxNode(profile=PROFILE, pci_tree=True, iommufd=True) as node:
        host = node.pci_host(settle_s=5.0)
        preparer = VfioPreparer(host)
        device = _device(host)
        plan, record = _prepare(preparer, device, _config("PreferIommuFD", True))
        assert record.data["cdev"] == "vfio0"
        def nodes(plan: Any) -> list[str]:
            return [n.path for n in (preparer.edits(REF, plan, record).device_nodes
                                     + preparer.claim_edits(REF, [plan], [record]).device_nodes)]

        assert nodes(plan) == ["/dev/vfio/devices/vfio0", "/dev/iommu"]
        legacy = preparer.plan(_claim(device), device, _claim(device).results, _config("LegacyOnly", True))
        assert nodes(legacy) == [f"/dev/vfio/{FIRST_IOMMU_GROUP}", "/dev/vfio/vfio"]
        again = DevicePlan(plan.kind, plan.device, plan.entry, plan.request_names, False, ())
        assert nodes(again) == ["/dev/vfio/devices/vfio0", "/dev/iommu"]  # re-rendered from the stored record
        preparer.undo(REF, record)


def test_the_config_accessor_reads_either_spelling_and_defaults_to_legacy_only() -> None:
    assert vfio_options(None) == ("LegacyOnly", False)
    assert vfio_options(SimpleNamespace(config=SimpleNamespace())) == ("LegacyOnly", False)  # type: ignore[arg-type]
    camel = SimpleNamespace(config={"iommu": {"backendPolicy": "PreferIommuFD", "enableAPIDevice": True}})
    assert vfio_options(camel) == ("PreferIommuFD", True)  # type: ignore[arg-type]


_APPLY_IN_CHILD = """
import sys
from pathlib import Path
from dradriver.domain.claims import AllocationResult, Claim, ClaimRef
from dradriver.domain.passthrough import VfioDevice
from dradriver.host.pci import PciHost
from dradriver.preparers.vfio import VfioPreparer
root, address, minor, uuid = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
host = PciHost(sysfs_root=root / "sys", dev_root=root, proc_root=root / "proc", process_root=Path("/proc"),
               modprobe=(str(root / "bin" / "modprobe"),), modules_root=root, settle_s=600)
device = VfioDevice(index=0, function=host.function(address), product_name="GPU", parent_minor=minor,
                    parent_uuid=uuid)
ref = ClaimRef("vms", "vm-a", "7a1c0de0-0000-4000-8000-000000000001")
claim = Claim(ref, (AllocationResult("vm", "gpu.nvidia.com", "gpu-node-1", device.name),))
preparer = VfioPreparer(host)
preparer.apply(ref, preparer.plan(claim, device, claim.results, None))
"""


@pytest.mark.parametrize(("fault", "state"), [("unbind", "nvidia"), ("bind", None), ("vfio-node", "vfio-pci")])
def test_a_plugin_sigkilled_in_the_middle_of_a_step_is_converged_by_the_next_starts_sweep(
        node: SandboxNode, fault: str, state: str | None) -> None:
    host = node.pci_host(settle_s=5.0)
    assert node.pci_bus is not None
    node.pci_bus.inject(fault, GPU0)  # the step's write is never answered: the child waits in it
    device = _device(host)
    child = subprocess.Popen([sys.executable, "-c", _APPLY_IN_CHILD, str(node.root), GPU0, str(device.parent_minor),
                              str(device.parent_uuid)])
    try:
        factories.wait_until(lambda: not (node.pci_bus.faults.exists() and "count\": 1" in
                                          node.pci_bus.faults.read_text()), f"the child reaching its {fault} step")
        factories.wait_until(lambda: host.function(GPU0).driver == state, f"the function on {state}")
    finally:
        child.kill()
        child.wait()
    assert host.function(GPU0).driver_override == "vfio-pci"
    assert VfioPreparer(host).sweep([]) == [GPU0]
    assert _on_nvidia(host) and GPU0 in _nvml_gpus()
