"""The host's PCI layer (:mod:`dradriver.host.pci`) against the PCI bus stand-in on a sysfs tree laid out as the
kernel's: reading functions and IOMMU groups, unbind / driver_override / bind / drivers_probe, module loading
through the ``modprobe`` stand-in, the vfio variant, the in-use check, and the errors of each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dradriver.host.pci import (
    GpuInUseError,
    ModuleLoadError,
    PciError,
    PciHost,
    PciSettleError,
    bar_bytes,
)
from dradriver.sandbox import standins
from dradriver.sandbox.standins.pcibus import PciBus, lay_out_driver, lay_out_function

GPU = "0000:3b:00.0"
AUDIO = "0000:3b:00.1"
GIB = 1 << 30


@dataclass
class Tree:
    root: Path
    host: PciHost
    bus: PciBus


def _tree(root: Path, *, modules: tuple[str, ...] = ("vfio-pci",)) -> Tree:
    sysfs = root / "sys"
    release = os.uname().release  # the host reads /proc (holders) and so the running kernel's release
    lay_out_driver(sysfs, "nvidia", "nvidia")
    lay_out_driver(sysfs, "snd_hda_intel", "snd_hda_intel")
    lay_out_function(sysfs, GPU, vendor=0x10DE, device=0x2330, class_code=0x030200, driver="nvidia", iommu_group=7,
                     numa_node=1, bars=(16 << 20, 0, 128 * GIB, 0, 32 << 20))
    (root / "dev" / "vfio").mkdir(parents=True)
    (root / "dev" / "vfio" / "vfio").write_text("")
    (root / "dev" / "nvidia0").write_text("")
    (root / "proc" / "sys" / "kernel").mkdir(parents=True)
    (root / "proc" / "sys" / "kernel" / "osrelease").write_text(release + "\n")
    moddir = root / "lib" / "modules" / release
    moddir.mkdir(parents=True)
    lines = []
    for module in modules:
        lines.append(f"kernel/drivers/vfio/pci/{module}.ko.zst: kernel/drivers/vfio/pci/vfio-pci-core.ko.zst "
                     "kernel/drivers/vfio/vfio.ko.zst")
    lines += ["kernel/drivers/vfio/pci/vfio-pci-core.ko.zst: kernel/drivers/vfio/vfio.ko.zst",
              "kernel/drivers/vfio/vfio.ko.zst:"]
    (moddir / "modules.dep").write_text("\n".join(lines) + "\n")
    standins.install("pcibus", root / "bin" / "modprobe")
    host = PciHost(sysfs_root=sysfs, dev_root=root, proc_root=Path("/proc"), modprobe=(str(root / "bin" / "modprobe"),),
                   modules_root=root, settle_s=1.0)
    return Tree(root, host, PciBus(sysfs, root))


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    t = _tree(tmp_path)
    t.bus.start()
    try:
        yield t
    finally:
        t.bus.stop()


def test_a_function_is_read_with_every_field_from_sysfs(tree: Tree) -> None:
    f = tree.host.function(GPU)
    assert (f.address, f.vendor_id, f.device_id, f.class_code) == (GPU, 0x10DE, 0x2330, 0x030200)
    assert (f.driver, f.driver_override, f.iommu_group, f.numa_node, f.sriov_numvfs) == ("nvidia", None, 7, 1, 0)
    assert f.bar_bytes == (16 << 20) + 128 * GIB + (32 << 20)
    assert f.pcie_root == "pci0000:3a" and f.vfio_cdev is None and f.is_nvidia_gpu
    assert [g.address for g in tree.host.gpus()] == [GPU]


def test_bar_sizes_count_memory_bars_among_the_first_six_lines_only() -> None:
    io = "0x0000000000001000 0x000000000000107f 0x0000000000000101"
    mem = "0x00000000f0000000 0x00000000f0ffffff 0x0000000000040200"
    empty = "0x0000000000000000 0x0000000000000000 0x0000000000000000"
    rom = "0x00000000f1000000 0x00000000f107ffff 0x0000000000046200"
    assert bar_bytes("\n".join([mem, io, empty, empty, empty, empty, rom])) == 16 << 20


def test_an_iommu_group_lists_every_member_function(tree: Tree) -> None:
    lay_out_function(tree.host.sysfs_root, AUDIO, vendor=0x10DE, device=0x22BA, class_code=0x040300,
                     driver="snd_hda_intel", iommu_group=7)
    group = tree.host.group_of(tree.host.function(GPU))
    assert group.number == 7
    assert [(f.address, f.driver) for f in group.functions] == [(GPU, "nvidia"), (AUDIO, "snd_hda_intel")]


def test_a_malformed_or_missing_address_is_an_error_naming_it(tree: Tree) -> None:
    with pytest.raises(PciError, match=r"'0000:3B:00.0' is not of the form"):
        tree.host.function("0000:3B:00.0")
    with pytest.raises(PciError, match=r"0000:3c:00.0: no .*/bus/pci/devices/0000:3c:00.0"):
        tree.host.function("0000:3c:00.0")


def test_a_gpu_goes_to_vfio_pci_and_back_to_nvidia(tree: Tree) -> None:
    host = tree.host
    assert not host.module_loaded("vfio-pci")
    host.load_module("vfio-pci", address=GPU)
    assert host.module_loaded("vfio_pci") and host.module_loaded("vfio")
    assert host.unbind(GPU) == "nvidia"
    host.set_driver_override(GPU, "vfio-pci")
    host.bind(GPU, "vfio-pci")
    f = host.function(GPU)
    assert (f.driver, f.driver_override, f.vfio_cdev) == ("vfio-pci", "vfio-pci", "vfio0")
    assert host.wait_group_node(7, GPU) == tree.root / "dev" / "vfio" / "7"
    host.rebind_nvidia(GPU)
    host.rebind_nvidia(GPU)  # idempotent
    f = host.function(GPU)
    assert (f.driver, f.driver_override, f.vfio_cdev) == ("nvidia", None, None)
    assert not (tree.root / "dev" / "vfio" / "7").exists()


def test_a_vfio_driver_binds_only_through_driver_override(tree: Tree) -> None:
    tree.host.load_module("vfio-pci")
    tree.host.unbind(GPU)
    with pytest.raises(PciSettleError) as err:
        tree.host.bind(GPU, "vfio-pci")
    text = str(err.value)
    assert GPU in text and "drivers/vfio-pci/bind" in text and "absent (unbound)" in text


def test_drivers_probe_honours_an_override_naming_a_driver_not_loaded(tree: Tree) -> None:
    tree.host.unbind(GPU)
    tree.host.set_driver_override(GPU, "vfio-pci")
    assert tree.host.probe(GPU) is None
    tree.host.set_driver_override(GPU, None)
    assert tree.host.probe(GPU, "nvidia") == "nvidia"


def test_the_group_node_stays_while_another_function_of_the_group_is_on_vfio(tree: Tree) -> None:
    sysfs = tree.host.sysfs_root
    lay_out_function(sysfs, AUDIO, vendor=0x10DE, device=0x22BA, class_code=0x040300, driver="snd_hda_intel",
                     iommu_group=7)
    tree.host.load_module("vfio-pci")
    for address in (GPU, AUDIO):
        tree.host.unbind(address)
        tree.host.set_driver_override(address, "vfio-pci")
        tree.host.bind(address, "vfio-pci")
    assert tree.host.function(AUDIO).vfio_cdev == "vfio1"
    tree.host.rebind_nvidia(GPU)
    assert (tree.root / "dev" / "vfio" / "7").exists()
    tree.host.set_driver_override(AUDIO, None)
    tree.host.unbind(AUDIO)
    assert not (tree.root / "dev" / "vfio" / "7").exists()


def test_a_write_nobody_serves_is_an_error_saying_nothing_answers(tmp_path: Path) -> None:
    t = _tree(tmp_path)  # the bus is not started
    with pytest.raises(PciError, match=r"0000:3b:00.0: cannot open .*drivers/nvidia/unbind for writing: nothing "
                                       r"answers"):
        t.host.unbind(GPU)


def test_an_injected_unbind_fault_is_a_settle_error_naming_function_file_and_state(tree: Tree) -> None:
    tree.bus.inject("unbind", GPU)
    with pytest.raises(PciSettleError) as err:
        tree.host.unbind(GPU)
    text = str(err.value)
    assert f"PCI function {GPU}" in text and "drivers/nvidia/unbind" in text and "a link to driver nvidia" in text
    assert tree.host.unbind(GPU) == "nvidia"  # the fault was used up


def test_a_module_the_kernel_lacks_fails_as_kmod_does(tree: Tree) -> None:
    release = re.escape(os.uname().release)
    with pytest.raises(ModuleLoadError, match=r"PCI function 0000:3b:00.0: loading module nvgrace-gpu-vfio-pci: "
                                              r".*modprobe nvgrace-gpu-vfio-pci exited 1: modprobe: FATAL: Module "
                                              rf"nvgrace-gpu-vfio-pci not found in directory /lib/modules/{release}"):
        tree.host.load_module("nvgrace-gpu-vfio-pci", address=GPU)


def test_an_injected_modprobe_fault_fails_the_load(tree: Tree) -> None:
    tree.bus.inject("modprobe", module="vfio-pci")
    with pytest.raises(ModuleLoadError, match=r"could not insert 'vfio_pci': Operation not permitted "
                                              r"\(.*/sys/module/vfio_pci missing\)"):
        tree.host.load_module("vfio-pci")
    assert not tree.host.module_loaded("vfio-pci")


def test_the_grace_variant_is_chosen_for_its_gpus_where_the_kernel_has_it(tmp_path: Path) -> None:
    grace = _tree(tmp_path / "grace", modules=("vfio-pci", "nvgrace-gpu-vfio-pci"))
    lay_out_function(grace.host.sysfs_root, "0009:01:00.0", vendor=0x10DE, device=0x2342, class_code=0x030200,
                     iommu_group=9)
    assert grace.host.vfio_variant(grace.host.function("0009:01:00.0")) == ("nvgrace-gpu-vfio-pci",
                                                                           "nvgrace_gpu_vfio_pci")
    assert grace.host.vfio_variant(grace.host.function(GPU)) == ("vfio-pci", "vfio-pci")
    plain = _tree(tmp_path / "plain")
    lay_out_function(plain.host.sysfs_root, "0009:01:00.0", vendor=0x10DE, device=0x2342, class_code=0x030200)
    assert plain.host.vfio_variant(plain.host.function("0009:01:00.0")) == ("vfio-pci", "vfio-pci")


def test_a_process_holding_the_gpu_node_is_named_by_pid_and_command(tree: Tree) -> None:
    with open(tree.root / "dev" / "nvidia0") as held:
        proc = subprocess.Popen(["sleep", "60"], stdin=held)
    try:
        with pytest.raises(GpuInUseError) as err:
            for _ in range(200):  # until the child has exec'd (its comm is then "sleep")
                holders = tree.host.holders(0)
                if any(h.comm == "sleep" for h in holders):
                    break
            tree.host.check_not_in_use(GPU, 0)
        assert f"sleep (pid {proc.pid})" in str(err.value) and GPU in str(err.value)
        assert "/dev/nvidia0" in str(err.value)
    finally:
        proc.kill()
        proc.wait()
    tree.host.check_not_in_use(GPU, 0)


def test_binding_a_driver_whose_module_is_not_loaded_is_an_error_naming_its_bind_file(tree: Tree) -> None:
    tree.host.unbind(GPU)
    with pytest.raises(PciError, match=r"0000:3b:00.0: cannot bind driver vfio-pci: .*drivers/vfio-pci/bind does "
                                       r"not exist \(its module is not loaded\)"):
        tree.host.bind(GPU, "vfio-pci")


def test_a_fault_for_every_call_stays_until_cleared(tree: Tree) -> None:
    tree.bus.inject("probe", GPU, count=-1)
    tree.host.unbind(GPU)
    for _ in range(2):
        with pytest.raises(PciSettleError, match="drivers_probe"):
            tree.host.probe(GPU, "nvidia")
    tree.bus.clear_faults()
    assert tree.host.probe(GPU, "nvidia") == "nvidia"


def test_the_bus_runs_as_a_process_until_sigterm(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "dradriver.sandbox.standins.pcibus", "--sysfs",
                             str(t.host.sysfs_root), "--dev", str(tmp_path)])
    try:
        for _ in range(500):  # until it serves the FIFOs (a writer then finds a reader)
            try:
                assert t.host.unbind(GPU) == "nvidia"
                break
            except PciError as exc:
                assert "nothing answers" in str(exc)
                time.sleep(0.02)
        assert t.host.function(GPU).driver is None
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
