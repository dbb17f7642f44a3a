"""A sandboxed GPU node for tests and ``dradriver demo``: directories, procfs fixtures, API emulator, config.

Everything the kubelet plugin touches on a real node is laid out under one short temporary root (Unix
socket paths are limited to 108 bytes): the kubelet's registrar, plugins and device-plugins directories, a
CDI root, and a ``proc`` tree holding ``devices`` (character-device majors as a driver with ``nvidia``,
``nvidia-uvm``, ``nvidia-caps`` and ``nvidia-caps-imex-channels`` loaded reports them, nvidia-container-toolkit's
``internal/info/proc/devices``) and ``sys/kernel/random/boot_id``. The Kubernetes API is the in-process
:class:`ApiServerEmulator` with this node's Node object; NVML is the bundled mock library with a chosen profile.

The root also holds ``proc/meminfo`` and, in ``driver-root/usr/bin``, the ``nvidia-cuda-mps-control`` stand-in
(:mod:`dradriver.sandbox.standins`); :meth:`SandboxNode.run_workloads` starts the Deployment controller and the
node's container runner (:mod:`dradriver.sandbox.workloads`) that run the MPS control daemon's Pod, and
:meth:`SandboxNode.mps_config` is a plugin configuration with ``MPSSupport`` on. The plugin mounts tmpfs with
the real ``mount``/``umount`` when this process may (root with ``CAP_SYS_ADMIN``; checked once per sandbox), and
with the stand-ins in ``bin/`` otherwise; :meth:`SandboxNode.close` unmounts what is left under the root.

By default the root also holds ``driver-root``, the plugin's ``--container-driver-root``, laid out like a
host with the profile's NVIDIA driver version installed (empty files with the real names, see
:func:`lay_out_driver_tree`), so claim CDI specs carry the driver mounts and hooks a real node gets. With
``driver_files=False`` it stays empty: the plugin then finds no driver files, which with the mock NVML means
specs with device nodes only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from dradriver.config import PluginConfig
from dradriver.domain.featuregates import CONSUMABLE_SHARES, MPS_SUPPORT
from dradriver.domain.shares import parse_share_mode
from dradriver.host import persistenced
from dradriver.host.driverfiles import DEFAULT_CDI_HOOK_PATH
from dradriver.host.mounts import MountCommands, mount_points
from dradriver.host.pci import NVGRACE_DEVICE_IDS, PciHost
from dradriver.nvml import mock
from dradriver.sandbox import standins
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.standins.pcibus import PciBus, lay_out_driver, lay_out_function, modprobe, unload_module
from dradriver.sandbox.workloads import Workloads

PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  5 /dev/tty
195 nvidia
195 nvidiactl
234 nvidia-caps-imex-channels
508 nvidia-uvm
511 nvidia-caps

Block devices:
  8 sd
"""
"""``/proc/devices`` of a node with the NVIDIA driver loaded (majors seen on real nodes, nvidia-container-toolkit's
``internal/info/proc/devices``)."""

PROC_MEMINFO = """MemTotal:       2113412036 kB
MemFree:        2001573316 kB
MemAvailable:   2060238520 kB
Buffers:          1020104 kB
Cached:          61236120 kB
"""
"""The head of ``/proc/meminfo`` of a 2 TiB GPU node (MPS sizes its shm tmpfs from ``MemTotal``)."""

SANDBOX_NAMESPACE = "dradriver"
SANDBOX_IMAGE = "dradriver:sandbox"
"""Namespace and image name the sandbox gives the plugin (``--namespace``, ``--image-name``)."""


#: Libraries the NVIDIA installer puts next to libcuda, versioned with the driver: name -> SONAME suffix
#: (``""`` for none). The installer also adds a development link ``<name>.so`` for those marked with ``+``.
DRIVER_LIBRARIES: dict[str, str] = {
    "libcuda+": "1",
    "libnvidia-ml+": "1",
    "libnvidia-ptxjitcompiler+": "1",
    "libnvidia-nvvm+": "4",
    "libnvidia-gpucomp": "",
    "libnvidia-allocator+": "1",
    "libnvidia-cfg+": "1",
    "libnvidia-opencl": "1",
    "libnvidia-encode+": "1",
    "libnvcuvid+": "1",
    "libnvidia-opticalflow": "1",
    "libnvidia-fbc+": "1",
    "libnvidia-glcore": "",
    "libnvidia-glsi": "",
    "libnvidia-tls": "",
    "libnvidia-eglcore": "",
    "libnvidia-glvkspirv": "",
    "libnvidia-rtcore": "",
    "libnvoptix": "1",
    "libGLX_nvidia": "0",
    "libEGL_nvidia": "0",
    "libGLESv2_nvidia": "2",
    "libGLESv1_CM_nvidia": "1",
}
DRIVER_BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
                   "nvidia-cuda-mps-server")
GRAPHICS_CONFIG_FILES = ("usr/share/glvnd/egl_vendor.d/10_nvidia.json",
                         "usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
                         "etc/vulkan/icd.d/nvidia_icd.json", "etc/OpenCL/vendors/nvidia.icd")


def lay_out_driver_tree(root: Path, version: str, *, arch: str = "x86_64") -> Path:
    """Create, under ``root``, the files of NVIDIA driver ``version`` as its installer lays them out; return root.

    Empty files with the real names: the driver libraries (``<lib>.so.<version>`` plus SONAME and
    development links) in ``usr/lib/<arch>-linux-gnu`` and its ``vdpau/``, two EGL platform libraries,
    the binaries in ``usr/bin``, the nvidia-persistenced socket in ``run``, GSP firmware in
    ``lib/firmware/nvidia/<version>`` and graphics configuration files. Existing files are kept.

    :param arch: ``x86_64`` or ``aarch64`` (the Debian multiarch directory name).
    """
    libdir = root / "usr" / "lib" / f"{arch}-linux-gnu"
    (libdir / "vdpau").mkdir(parents=True, exist_ok=True)

    def touch(path: Path, mode: int = 0o644) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=mode, exist_ok=True)

    def link(path: Path, target: str) -> None:
        if not path.is_symlink():
            path.symlink_to(target)

    for key, soname in DRIVER_LIBRARIES.items():
        name = key.rstrip("+")
        real = f"{name}.so.{version}"
        touch(libdir / real)
        if soname:
            link(libdir / f"{name}.so.{soname}", real)
        if key.endswith("+"):
            link(libdir / f"{name}.so", f"{name}.so.{soname}")
    touch(libdir / "vdpau" / f"libvdpau_nvidia.so.{version}")
    link(libdir / "vdpau" / "libvdpau_nvidia.so.1", f"libvdpau_nvidia.so.{version}")
    for name, platform_version in (("libnvidia-egl-wayland", "1.1.19"), ("libnvidia-egl-gbm", "1.1.2")):
        touch(libdir / f"{name}.so.{platform_version}")
        link(libdir / f"{name}.so.1", f"{name}.so.{platform_version}")
    for binary in DRIVER_BINARIES:
        touch(root / "usr" / "bin" / binary, 0o755)
    touch(root / "run" / "nvidia-persistenced" / "socket")
    for firmware in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        touch(root / "lib" / "firmware" / "nvidia" / version / firmware)
    for config in GRAPHICS_CONFIG_FILES:
        touch(root / config)
    return root


def install_driver_tools(root: Path, version: str, *, arch: str = "x86_64") -> Path:
    """Make the driver tree under ``root`` usable by a client of NVML; return the ``nvidia-smi`` path.

    * ``usr/lib/<arch>-linux-gnu/libnvidia-ml.so.<version>`` becomes a copy of the bundled mock library
      (:func:`dradriver.nvml.mock.library_path`), so ``LD_PRELOAD`` of the root's ``libnvidia-ml.so.1``
      (NVIDIA's rule for running ``nvidia-smi`` from a driver root, ``cmd/gpu-kubelet-plugin/sharing.go``) loads
      the mock;
    * ``usr/bin/nvidia-smi`` becomes the stand-in :mod:`dradriver.sandbox.nvidia_smi`, run by this
      interpreter (``#!`` line), which needs only pynvml.

    :raises dradriver.nvml.mock.MockNvmlError: the mock library is not built.
    """
    libdir = root / "usr" / "lib" / f"{arch}-linux-gnu"
    libdir.mkdir(parents=True, exist_ok=True)
    real = libdir / f"libnvidia-ml.so.{version}"
    real.unlink(missing_ok=True)
    shutil.copyfile(mock.library_path(), real)
    real.chmod(0o755)
    soname = libdir / "libnvidia-ml.so.1"
    if not soname.is_symlink():
        soname.unlink(missing_ok=True)
        soname.symlink_to(real.name)
    from dradriver.sandbox import nvidia_smi

    tool = root / "usr" / "bin" / "nvidia-smi"
    tool.parent.mkdir(parents=True, exist_ok=True)
    tool.unlink(missing_ok=True)
    tool.write_text(f"#!{sys.executable}\n" + Path(nvidia_smi.__file__).read_text())
    tool.chmod(0o755)
    return tool


SANDBOX_KERNEL = "6.8.0-dradriver-sandbox"
"""``proc/sys/kernel/osrelease`` of a sandbox with a PCI tree (its ``lib/modules/<release>`` lists the vfio
modules)."""

AUDIO_FUNCTION = (0x10DE, 0x22BA, 0x040300, "snd_hda_intel")
"""An NVIDIA HD audio function (vendor, device, class, driver), the usual other member of a GPU's IOMMU group."""

FIRST_IOMMU_GROUP = 16
"""IOMMU group number of the first GPU (by PCI address) of a sandbox PCI tree; the next ones count up."""


def pci_address(bus_id: str) -> str:
    """A profile's ``pciBusId`` (``00000000:18:00.0``) as sysfs names the function: ``dddd:bb:dd.f`` lowercase."""
    domain, rest = bus_id.lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def lay_out_pci_tree(root: Path, profile: str, *, shared_iommu_groups: Sequence[Sequence[str]] = (),
                     iommufd: bool = False) -> list[str]:
    """The PCI side of the node under ``root`` (``sys``, ``dev``, ``proc``, ``lib/modules``); returns the GPU
    addresses in PCI order.

    Each profile GPU is a function at its ``pciBusId`` (vendor ``0x10de``, the device ID of NVML's ``pciDeviceId``,
    class ``0x030200``, bound to ``nvidia``, its NUMA node, BARs 16 MiB / ``bar1Total`` (64-bit) / 32 MiB) in an
    IOMMU group of its own (:data:`FIRST_IOMMU_GROUP` onwards), with ``dev/nvidia<minor>`` (a regular file);
    ``shared_iommu_groups`` lists address sets that share one group (the group of their first GPU); an address
    there that is no GPU becomes an NVIDIA HD audio function (:data:`AUDIO_FUNCTION`). The ``nvidia`` and
    ``snd_hda_intel`` modules are loaded, no vfio module yet; ``lib/modules/<release>/modules.dep`` lists
    ``vfio-pci`` (and ``nvgrace-gpu-vfio-pci`` when a GPU is of its ID table); ``dev/vfio/vfio`` exists, and
    ``dev/iommu`` with ``iommufd``.
    """
    sysfs = root / "sys"
    (root / "dev").mkdir(parents=True, exist_ok=True)
    gpus = sorted(mock.resolved_gpus(mock.load_profile(profile)), key=lambda g: pci_address(g["pciBusId"]))
    lay_out_driver(sysfs, "nvidia", "nvidia")
    lay_out_driver(sysfs, AUDIO_FUNCTION[3], AUDIO_FUNCTION[3])
    groups = {pci_address(g["pciBusId"]): FIRST_IOMMU_GROUP + i for i, g in enumerate(gpus)}
    for members in shared_iommu_groups:
        number = next((groups[a] for a in members if a in groups), None)
        if number is None:
            raise ValueError(f"shared IOMMU group {list(members)} names no GPU of profile {profile}")
        for address in members:
            groups[address] = number
    device_ids: set[int] = set()
    for gpu in gpus:
        address = pci_address(gpu["pciBusId"])
        device_id = (int(gpu.get("pciDeviceId", 0x233010DE)) >> 16) & 0xFFFF
        device_ids.add(device_id)
        lay_out_function(sysfs, address, vendor=0x10DE, device=device_id, class_code=0x030200, driver="nvidia",
                         iommu_group=groups[address], numa_node=int(gpu.get("numaNode", -1)),
                         bars=(16 << 20, int(gpu.get("bar1Total", 256 << 20)), 0, 32 << 20))
        if "minorNumber" in gpu:
            (root / "dev" / f"nvidia{gpu['minorNumber']}").write_text("")
    for address, number in groups.items():
        if not (sysfs / "bus" / "pci" / "devices" / address).exists():
            vendor, device, class_code, driver = AUDIO_FUNCTION
            lay_out_function(sysfs, address, vendor=vendor, device=device, class_code=class_code, driver=driver,
                             iommu_group=number, bars=(16 << 10,))
    (root / "dev" / "vfio").mkdir(parents=True, exist_ok=True)
    (root / "dev" / "vfio" / "vfio").write_text("")
    if iommufd:
        (root / "dev" / "iommu").write_text("")
    (root / "proc" / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "sys" / "kernel" / "osrelease").write_text(SANDBOX_KERNEL + "\n")
    modules = root / "lib" / "modules" / SANDBOX_KERNEL
    modules.mkdir(parents=True, exist_ok=True)
    core = "kernel/drivers/vfio/pci/vfio-pci-core.ko.zst"
    lines = [f"kernel/drivers/vfio/pci/vfio-pci.ko.zst: {core} kernel/drivers/vfio/vfio.ko.zst"]
    if device_ids & NVGRACE_DEVICE_IDS:
        lines.append(f"kernel/drivers/vfio/pci/nvgrace-gpu/nvgrace-gpu-vfio-pci.ko.zst: {core} "
                     "kernel/drivers/vfio/vfio.ko.zst")
    lines += [f"{core}: kernel/drivers/vfio/vfio.ko.zst", "kernel/drivers/vfio/vfio.ko.zst:",
              "kernel/drivers/gpu/nvidia.ko:", "kernel/sound/pci/hda/snd-hda-intel.ko.zst:"]
    (modules / "modules.dep").write_text("\n".join(lines) + "\n")
    return [pci_address(g["pciBusId"]) for g in gpus]


def _profile_driver_version(profile: str) -> str:
    """The ``system.driverVersion`` of a mock NVML profile; ``""`` when the profile cannot be read (the
    plugin then reports the bad profile itself)."""
    try:
        version = mock.load_profile(profile).get("system", {}).get("driverVersion", "")
    except mock.MockNvmlError:
        return ""
    return version if isinstance(version, str) else ""


@dataclass
class SandboxNode:
    """One emulated GPU node. Use as a context manager; :meth:`close` removes everything it created.

    :param profile: bundled mock NVML profile (``dradriver mock-profiles``) or a profile file path.
    :param node_name: the Node's name and the ResourceSlice pool name.
    :param api: an API emulator to use; a new one is started (and stopped on close) when ``None``.
    :param driver_files: lay out the profile's driver files under :attr:`driver_root`
        (:func:`lay_out_driver_tree`) with a working ``nvidia-smi`` and ``libnvidia-ml.so.1``
        (:func:`install_driver_tools`); when False the driver root stays empty.
    :param mount_standins: give the plugin the ``mount``/``umount`` stand-ins even where real mounts work.
    :param persistenced: run the ``nvidia-persistenced`` stand-in of the driver root (with ``pci_tree``; as the GPU
        Operator's driver container does): it holds ``dev/nvidia<minor>`` of every GPU on ``nvidia`` open and
        listens on ``<driver root>/run/nvidia-persistenced/socket``; its ``proc`` entry is linked into the node's
        ``proc`` so the plugin sees it among the holders of a GPU. Stopped at :meth:`close`.

    NVML settings are node state shared by every process on the node (the plugin, ``nvidia-smi``, tests): while
    the sandbox is open, :data:`dradriver.nvml.mock.CONTROL_ENV` names :attr:`nvml_control`, the mock's control
    file, which the mock appends each setting to and every process replays (``ext/mocknvml/README.md``). The
    variable is read at the first ``nvmlInit`` of a process, so open NVML sessions after the sandbox; the
    previous value is restored at :meth:`close`.
    :param mig_state: give the mock NVML a MIG state file under the root and this node's ``proc`` tree
        (``DRADRIVER_MOCK_NVML_STATE``/``..._PROC_ROOT`` in this process's environment until :meth:`close`):
        MIG instances created by one process (a plugin that is killed) are seen by the next, and the MIG
        capability files and ``mig-minors`` appear under ``proc/driver`` as on a node. For dynamic MIG.
    """

    profile: str = "gb200-nvl72-node"
    node_name: str = "gpu-node-1"
    api: ApiServerEmulator | None = None
    node_allocatable: dict[str, str] | None = None
    driver_files: bool = True
    mig_state: bool = False
    mount_standins: bool = False
    pci_tree: bool = False
    shared_iommu_groups: tuple[tuple[str, ...], ...] = ()
    iommufd: bool = False
    persistenced: bool = False
    root: Path = field(init=False)
    persistence_daemon: subprocess.Popen[bytes] | None = field(init=False, default=None)
    pci_bus: PciBus | None = field(init=False, default=None)
    _owns_api: bool = field(init=False, default=False)
    workloads: Workloads | None = field(init=False, default=None)
    mounts: MountCommands = field(init=False, default_factory=MountCommands)
    _saved_control: str | None = field(init=False, default=None)
    _saved_env: dict[str, str | None] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
        for sub in ("registry", "plugins", "device-plugins", "cdi", "proc/sys/kernel/random", "sys", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "proc" / "devices").write_text(PROC_DEVICES)
        (self.root / "proc" / "meminfo").write_text(PROC_MEMINFO)
        self.reload_kernel_module()
        self.driver_root.mkdir()
        version = _profile_driver_version(self.profile) if self.driver_files else ""
        if version:
            lay_out_driver_tree(self.driver_root, version)
            install_driver_tools(self.driver_root, version)
            standins.install("nvidia_cuda_mps_control", self.driver_root / "usr" / "bin" / "nvidia-cuda-mps-control")
            standins.install("nvidia_imex", self.driver_root / "usr" / "bin" / "nvidia-imex")
            standins.install("nvidia_imex_ctl", self.driver_root / "usr" / "bin" / "nvidia-imex-ctl")
            # the host's container toolkit, which the hooks of claim specs name (NVIDIA_CDI_HOOK_PATH, see config)
            standins.install("nvidia_cdi_hook", self.driver_root / DEFAULT_CDI_HOOK_PATH.lstrip("/"))
        standins.install("nvidia_cdi_hook", self.image_cdi_hook)  # the image's copy (NVIDIA_CDI_HOOK_PATH empty)
        self.mounts = self._mount_commands()
        self.nvml_control.touch()
        self._saved_control = os.environ.get(mock.CONTROL_ENV)
        os.environ[mock.CONTROL_ENV] = str(self.nvml_control)
        self.set_boot_id(str(uuid.uuid4()))
        if self.mig_state:
            env = {mock.STATE_ENV: str(self.mig_state_path), mock.PROC_ROOT_ENV: str(self.root / "proc")}
            for key, value in env.items():
                self._saved_env[key] = os.environ.get(key)
                os.environ[key] = value
        if self.pci_tree:
            try:
                lay_out_pci_tree(self.root, self.profile, shared_iommu_groups=self.shared_iommu_groups,
                                 iommufd=self.iommufd)
            except BaseException:
                self.close()
                raise
            standins.install("pcibus", self.root / "bin" / "modprobe")
            self.pci_bus = PciBus(self.root / "sys", self.root).start()
            self._saved_env[mock.SYSFS_ENV] = os.environ.get(mock.SYSFS_ENV)
            os.environ[mock.SYSFS_ENV] = str(self.root / "sys")
        if self.persistenced:
            try:
                self.start_persistenced()
            except BaseException:
                self.close()
                raise
        if self.api is None:
            self.api = ApiServerEmulator().start()
            self._owns_api = True
        self.api.add_node(self.node_name, allocatable=self.node_allocatable)
        self.kubeconfig = self.api.kubeconfig_path(self.root)

    def _mount_commands(self) -> MountCommands:
        """The real commands when a tmpfs mount works here, else the stand-ins in ``bin/``."""
        probe = self.root / ".mount-probe"
        probe.mkdir()
        real = MountCommands()
        try:
            if self.mount_standins:
                raise OSError("stand-ins asked for")
            done = subprocess.run(("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)),
                                  capture_output=True, timeout=10, check=False)
            if done.returncode == 0:
                real.unmount(probe)
                return real
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            with contextlib.suppress(OSError):
                probe.rmdir()
        bin_dir = self.root / "bin"
        standins.install("mount", bin_dir / "mount")
        standins.install("mount", bin_dir / "umount")
        return MountCommands(str(bin_dir / "mount"), str(bin_dir / "umount"), bin_dir / "mountinfo")

    @property
    def real_mounts(self) -> bool:
        """The plugin mounts for real here (not through the stand-ins)."""
        return self.mounts == MountCommands()

    def run_workloads(self, *, time_scale: float = 0.05) -> Workloads:
        """Start the Deployment controller and container runner of this node (stopped by :meth:`close`).

        :param time_scale: factor on probe periods and back-offs (``0.05``: a 1 s probe period runs every 50 ms).
        """
        if self.workloads is None:
            assert self.api is not None
            self.workloads = Workloads(self.api, self.node_name, self.root / "pods", time_scale=time_scale).start()
        return self.workloads

    def mps_config(self, **overrides: Any) -> PluginConfig:
        """:meth:`config` with ``MPSSupport`` on, the sandbox's namespace and image, and the driver root's host
        path set to :attr:`driver_root` (the daemon's Pod mounts it, and runs its ``nvidia-cuda-mps-control``)."""
        base = self.config(feature_gates=self.config().feature_gates.with_gates(**{MPS_SUPPORT: True}),
                           namespace=SANDBOX_NAMESPACE, image_name=SANDBOX_IMAGE, nvidia_driver_root=self.driver_root)
        return replace(base, **overrides)

    def shares_config(self, mode: str = "memory", **overrides: Any) -> PluginConfig:
        """:meth:`config` with ``ConsumableShares`` on and ``--consumable-shares=<mode>``, the sandbox's namespace
        and image, and the driver root's host path set to :attr:`driver_root` (each shared GPU's MPS control
        daemon Pod mounts it and runs its ``nvidia-cuda-mps-control``)."""
        base = self.config(feature_gates=self.config().feature_gates.with_gates(**{CONSUMABLE_SHARES: True}),
                           consumable_shares=parse_share_mode(mode), namespace=SANDBOX_NAMESPACE,
                           image_name=SANDBOX_IMAGE, nvidia_driver_root=self.driver_root)
        return replace(base, **overrides)

    def reload_kernel_module(self) -> None:
        """Load the ``nvidia`` kernel module again, as the host sees it: ``dev/nvidiactl`` and ``sys/module/nvidia``
        under the root are made again, each a new file (another inode) at the same path, while ``proc/devices``
        keeps the major and NVML the version (a same-version reload). The node is a regular file here (making a
        character device needs CAP_MKNOD); the plugin's reload check compares which file is there, not its kind.
        Also the first load, when the sandbox is made."""
        for path, directory in ((self.root / "dev" / "nvidiactl", False),
                                (self.root / "sys" / "module" / "nvidia", True)):
            path.parent.mkdir(parents=True, exist_ok=True)
            fresh = path.with_name(path.name + ".new")
            if directory:
                fresh.mkdir()
                (fresh / "initstate").write_text("live\n")
                if path.exists():
                    old = path.with_name(path.name + ".old")
                    path.rename(old)
                    shutil.rmtree(old)
            else:
                fresh.write_text("")
            fresh.rename(path)  # made while the old one still existed: another inode

    def unload_nvidia_module(self) -> None:
        """``rmmod nvidia`` under whatever runs on the node (a driver upgrade): the mock NVML's ``driver unloaded``
        (every NVML call of a running process fails DRIVER_NOT_LOADED, an ``nvmlInit`` too), then, with
        ``pci_tree``, the ``modprobe -r nvidia`` of the PCI bus stand-in (every GPU on ``nvidia`` unbound, a GPU on
        a VFIO driver untouched, ``sys/bus/pci/drivers/nvidia`` gone); ``sys/module/nvidia`` goes either way."""
        with self.nvml_control.open("a") as control:
            control.write("driver unloaded\n")
        if self.pci_tree:
            unload_module(self.root, "nvidia")
        shutil.rmtree(self.root / "sys" / "module" / "nvidia", ignore_errors=True)

    def load_nvidia_module(self) -> None:
        """``modprobe nvidia`` after :meth:`unload_nvidia_module`: with ``pci_tree`` the stand-in's load first
        (``sys/bus/pci/drivers/nvidia`` made, every unbound GPU without a driver override bound to it), the module's
        files made again (:meth:`reload_kernel_module`), then the mock NVML's ``driver loaded`` (the next
        ``nvmlInit`` lists the GPUs on ``nvidia`` then)."""
        if self.pci_tree and modprobe(self.root, ["nvidia"]) != 0:
            raise RuntimeError(f"the modprobe stand-in could not load nvidia on {self.root}")
        self.reload_kernel_module()
        with self.nvml_control.open("a") as control:
            control.write("driver loaded\n")

    @property
    def persistenced_faults(self) -> Path:
        """The faults file of the ``nvidia-persistenced`` stand-in
        (:mod:`dradriver.sandbox.standins.nvidia_persistenced`)."""
        return self.root / "persistenced-faults.json"

    def start_persistenced(self, *, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
        """Start the ``nvidia-persistenced`` stand-in (see ``persistenced``); returns once it listens.

        :raises RuntimeError: the node has no PCI tree or driver files, or the daemon exited or did not listen
            within ``timeout_s``.
        """
        if not self.pci_tree or not self.driver_files:
            raise RuntimeError("nvidia-persistenced needs a sandbox with pci_tree and driver_files")
        binary = standins.install("nvidia_persistenced", self.driver_root / "usr" / "bin" / "nvidia-persistenced")
        env = dict(os.environ)
        env[mock.PROFILE_ENV] = str(mock.profile_path(self.profile))
        library = self.driver_root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvidia-ml.so.1"
        proc = subprocess.Popen([str(binary), "--dev-root", str(self.root), "--sysfs", str(self.root / "sys"),
                                 "--nvml", str(library), "--faults", str(self.persistenced_faults)], env=env,
                                stdin=subprocess.DEVNULL)
        self.persistence_daemon = proc
        (self.root / "proc" / str(proc.pid)).symlink_to(f"/proc/{proc.pid}")  # the plugin's --proc-root shows it
        socket_path = persistenced.socket_path(self.driver_root)
        deadline = time.monotonic() + timeout_s
        while not persistenced.daemon_running(self.driver_root):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop_persistenced()
                raise RuntimeError(f"nvidia-persistenced stand-in did not listen on {socket_path}")
            time.sleep(0.02)
        return proc

    def stop_persistenced(self) -> None:
        """Stop the ``nvidia-persistenced`` stand-in (SIGTERM; it closes the GPUs and removes its socket)."""
        proc, self.persistence_daemon = self.persistence_daemon, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        (self.root / "proc" / str(proc.pid)).unlink(missing_ok=True)

    def pci_host(self, **overrides: Any) -> PciHost:
        """The host PCI layer on this node (with ``pci_tree``): its ``sys``, ``dev``, ``proc`` (holders of a GPU's
        node are looked for among this machine's processes, ``/proc``), the ``modprobe`` stand-in and the
        sandbox's ``lib/modules``; keyword arguments override fields (``settle_s``)."""
        base = PciHost(sysfs_root=self.root / "sys", dev_root=self.root, proc_root=self.root / "proc",
                       process_root=Path("/proc"), modprobe=(str(self.root / "bin" / "modprobe"),),
                       modules_root=self.root)
        return replace(base, **overrides)

    def set_boot_id(self, boot_id: str) -> None:
        """Write ``proc/sys/kernel/random/boot_id`` (a new value simulates a reboot)."""
        (self.root / "proc" / "sys" / "kernel" / "random" / "boot_id").write_text(boot_id + "\n")

    def config(self, **overrides: Any) -> PluginConfig:
        """The :class:`PluginConfig` of a kubelet plugin on this node; keyword arguments override fields."""
        base = PluginConfig(
            node_name=self.node_name,
            kubeconfig=self.kubeconfig,
            cdi_root=self.root / "cdi",
            kubelet_registrar_directory_path=self.root / "registry",
            kubelet_plugins_directory_path=self.root / "plugins",
            kubelet_device_plugins_directory_path=self.root / "device-plugins",
            container_driver_root=self.driver_root,
            dev_root=self.root,
            sysfs_root=self.root / "sys",
            proc_root=self.root / "proc",
            mock_profile=self.profile,
            mounts=self.mounts,
            nvidia_cdi_hook_path=DEFAULT_CDI_HOOK_PATH,  # a host with the toolkit: the stand-in under the driver root
            image_cdi_hook=self.image_cdi_hook,
        )
        if self.pci_tree:  # the host root holds lib/modules; modules are loaded by the modprobe stand-in
            base = replace(base, host_root=self.root, modprobe=(str(self.root / "bin" / "modprobe"),))
        return replace(base, **overrides)

    @property
    def image_cdi_hook(self) -> Path:
        """The ``nvidia-cdi-hook`` of the plugin's image (the stand-in), copied into the plugin directory when
        ``nvidia_cdi_hook_path`` is empty."""
        return self.root / "image" / "usr" / "bin" / "nvidia-cdi-hook"

    @property
    def mig_state_path(self) -> Path:
        """The mock NVML's MIG state file (with ``mig_state``)."""
        return self.root / "nvml-mig-state"

    @property
    def driver_root(self) -> Path:
        """The plugin's ``--container-driver-root`` (the host's driver root is ``/``)."""
        return self.root / "driver-root"

    @property
    def nvml_control(self) -> Path:
        """The mock NVML control file of this node (settings applied by any process land here)."""
        return self.root / "nvml-control"

    @property
    def nvidia_smi(self) -> Path:
        """The driver root's ``nvidia-smi`` (the stand-in, see :func:`install_driver_tools`)."""
        return self.driver_root / "usr" / "bin" / "nvidia-smi"

    @property
    def cdi_root(self) -> Path:
        """Where the plugin writes CDI specs."""
        return self.root / "cdi"

    def cdi_specs(self) -> list[Path]:
        """The CDI spec files present now, sorted."""
        return sorted(p for p in self.cdi_root.iterdir() if p.is_file())

    def close(self) -> None:
        """Stop the workloads, unmount what is left mounted under the root, stop the API emulator if this sandbox
        started it, and delete the sandbox root."""
        if self.workloads is not None:
            self.workloads.stop()
            self.workloads = None
        self.stop_persistenced()
        if self.pci_bus is not None:
            self.pci_bus.stop()
            self.pci_bus = None
        with contextlib.suppress(OSError):
            for point in reversed(mount_points(self.mounts.mountinfo.read_text())):
                if point.startswith(f"{self.root}/"):
                    with contextlib.suppress(Exception):
                        self.mounts.unmount(Path(point))
        if self._owns_api and self.api is not None:
            self.api.stop()
        if os.environ.get(mock.CONTROL_ENV) == str(self.nvml_control):
            if self._saved_control is None:
                os.environ.pop(mock.CONTROL_ENV, None)
            else:
                os.environ[mock.CONTROL_ENV] = self._saved_control
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SandboxNode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
