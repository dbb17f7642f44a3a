"""The sandbox node's PCI side (``SandboxNode(pci_tree=True)``): the profile's GPUs as PCI functions on
``nvidia`` in IOMMU groups of their own, the shared-group knob, the vfio modules its kernel has, and the
existing sysfs readers (``pcieRoot``, NUMA) still answering from the tree."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import pytest

from dradriver.nvml import mock
from dradriver.nvml.discovery import pcie_root, sysfs_numa_node
from dradriver.sandbox.node import FIRST_IOMMU_GROUP, SandboxNode
from dradriver.sandbox.standins.pcibus import PciBus, lay_out_driver


def test_each_profile_gpu_is_a_function_on_nvidia_in_its_own_iommu_group() -> None:
    with SandboxNode(profile="dgx-h100", pci_tree=True) as node:
        host = node.pci_host()
        gpus = host.gpus()
        profile = sorted(mock.resolved_gpus(mock.load_profile("dgx-h100")), key=lambda g: g["pciBusId"])
        assert [g.address for g in gpus] == [g["pciBusId"][4:].lower() for g in profile]
        for i, (fn, want) in enumerate(zip(gpus, profile, strict=True)):
            assert (fn.vendor_id, fn.device_id, fn.class_code, fn.driver) == (0x10DE, 0x2330, 0x030200, "nvidia")
            assert fn.iommu_group == FIRST_IOMMU_GROUP + i and fn.numa_node == want["numaNode"]
            assert fn.bar_bytes == (16 << 20) + want["bar1Total"] + (32 << 20)
            assert host.group_of(fn).functions == (fn,)
            sysfs = node.root / "sys"
            assert pcie_root(sysfs, fn.address) == fn.pcie_root is not None
            assert sysfs_numa_node(sysfs, fn.address) == want["numaNode"]
        assert not host.module_loaded("vfio-pci") and host.module_loaded("nvidia")
        assert (node.root / "dev" / "vfio" / "vfio").exists() and not host.iommufd_available()
        assert host.iommu_enabled() and host.vfio_variant(gpus[0]) == ("vfio-pci", "vfio-pci")
        assert os.environ[mock.SYSFS_ENV] == str(node.root / "sys")
    assert mock.SYSFS_ENV not in os.environ


def test_a_shared_group_puts_an_audio_function_or_a_second_gpu_beside_the_gpu() -> None:
    with SandboxNode(profile="dgx-h100", pci_tree=True, iommufd=True,
                     shared_iommu_groups=(("0000:18:00.0", "0000:18:00.1"), ("0000:2a:00.0", "0000:3a:00.0"))) as n:
        host = n.pci_host()
        first = host.group_of(host.function("0000:18:00.0"))
        assert [(f.address, f.driver, f.class_code) for f in first.functions] == [
            ("0000:18:00.0", "nvidia", 0x030200), ("0000:18:00.1", "snd_hda_intel", 0x040300)]
        second = host.group_of(host.function("0000:3a:00.0"))
        assert [f.address for f in second.functions] == ["0000:2a:00.0", "0000:3a:00.0"]
        assert host.iommufd_available()


def test_a_shared_group_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="names no GPU of profile dgx-h100"):
        SandboxNode(profile="dgx-h100", pci_tree=True, shared_iommu_groups=(("0000:99:00.0",),))


def test_a_grace_node_offers_the_nvgrace_variant() -> None:
    with SandboxNode(profile="gb200-nvl72-node", pci_tree=True) as node:
        host = node.pci_host()
        assert host.vfio_variant(host.gpus()[0]) == ("nvgrace-gpu-vfio-pci", "nvgrace_gpu_vfio_pci")
        host.load_module("nvgrace-gpu-vfio-pci")
        assert Path(node.root / "sys" / "bus" / "pci" / "drivers" / "nvgrace_gpu_vfio_pci" / "bind").exists()


def test_rmmod_nvidia_unbinds_the_gpus_on_nvidia_only_and_modprobe_binds_the_unbound_ones_again() -> None:
    """``SandboxNode.unload_nvidia_module`` behaves as the kernel and the driver library: every GPU on ``nvidia``
    unbound and ``sys/bus/pci/drivers/nvidia`` gone (a bind to it impossible), a GPU on ``vfio-pci`` untouched with
    its group node, ``nvmlInit`` DRIVER_NOT_LOADED; ``load_nvidia_module`` binds the unbound GPUs without a driver
    override to ``nvidia`` again and NVML lists them, not the GPU still on ``vfio-pci``."""
    from dradriver.nvml import session as nvml_session

    gpu0, gpu1 = "0000:18:00.0", "0000:2a:00.0"
    with SandboxNode(profile="dgx-h100", pci_tree=True) as node:
        host = node.pci_host(settle_s=5.0)
        host.load_module("vfio-pci")
        host.set_driver_override(gpu0, "vfio-pci")
        host.unbind(gpu0)
        host.bind(gpu0, "vfio-pci")
        node.unload_nvidia_module()
        assert not host.driver_path("nvidia").exists()
        assert not host.module_loaded("nvidia")
        assert host.function(gpu1).driver is None and host.function(gpu0).driver == "vfio-pci"
        assert (node.root / "dev" / "vfio" / str(FIRST_IOMMU_GROUP)).exists()
        session = nvml_session.open_session_or_absent(mock_profile="dgx-h100")
        assert not session.available and "Driver Not Loaded" in session.unavailable_reason
        node.load_nvidia_module()
        assert (host.driver_path("nvidia") / "bind").exists() and host.module_loaded("nvidia")
        assert [f.driver for f in host.gpus()] == ["vfio-pci"] + ["nvidia"] * 7
        assert session.init() and session.device_count() == 7
        session.close()


def test_a_driver_unloaded_and_loaded_between_two_rescans_of_the_bus_is_served_again(tmp_path: Path) -> None:
    """``modprobe -r nvidia`` then ``modprobe nvidia`` quicker than the bus stand-in looks at its FIFOs: the driver's
    ``bind`` is a new FIFO under the same path, and the bus serves it (a loaded clean-clone run found the old
    FIFO's reader kept and the new one answering nobody: "nothing answers (no reader)")."""
    sysfs = tmp_path / "sys"
    directory = lay_out_driver(sysfs, "nvidia", "nvidia")
    bus = PciBus(sysfs, tmp_path, poll_s=0.5).start()
    try:
        os.close(os.open(directory / "bind", os.O_WRONLY | os.O_NONBLOCK))  # served
        shutil.rmtree(directory)
        lay_out_driver(sysfs, "nvidia", "nvidia")  # within one poll of the bus: it saw neither change
        deadline = time.monotonic() + 10
        while True:
            try:
                os.close(os.open(directory / "bind", os.O_WRONLY | os.O_NONBLOCK))
                break
            except OSError as exc:
                assert exc.errno == errno.ENXIO and time.monotonic() < deadline, "the new bind FIFO is never served"
                time.sleep(0.05)
    finally:
        bus.stop()
