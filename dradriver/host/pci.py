"""The node's PCI functions as sysfs shows them, and the driver operations VFIO passthrough makes on them.

Reading: every ``<sysfs>/bus/pci/devices/<address>`` becomes a :class:`~dradriver.domain.passthrough.PciFunction`,
every ``<sysfs>/kernel/iommu_groups/<n>/devices/*`` an :class:`~dradriver.domain.passthrough.IommuGroup`.
Acting: unbind, ``driver_override``, bind, ``drivers_probe``, loading a kernel module through ``modprobe``, the
in-use check of a GPU, and the VFIO device nodes of a bound function. Each write opens the attribute file
``O_WRONLY|O_NONBLOCK`` (a sysfs attribute answers at once; in the sandbox the attribute is a FIFO its PCI bus
stand-in serves, and nobody serving it is ``ENXIO``, "nothing answers"), then the state is read back until it
settles or :attr:`PciHost.settle_s` passes: a state that does not settle is a :class:`PciSettleError` naming the
function, the file written and what was found.

Facts (the Linux kernel's ``Documentation/ABI/testing/sysfs-bus-pci``, ``Documentation/ABI/testing/sysfs-kernel-
iommu_groups``, ``Documentation/driver-api/vfio.rst``, ``Documentation/filesystems/sysfs.rst``,
``drivers/pci/pci-sysfs.c``, ``drivers/vfio/pci/nvgrace-gpu/main.c``; NVIDIA's
``cmd/gpu-kubelet-plugin/vfio-device.go``):

* ``vendor``, ``device``, ``class`` hold ``0x``-prefixed hex; ``numa_node`` a decimal (``-1``: none);
  ``sriov_numvfs`` the number of enabled virtual functions (absent without SR-IOV);
* ``resource`` has one line ``<start> <end> <flags>`` (hex) per resource, the first six the BARs;
  a BAR is memory when ``flags & IORESOURCE_MEM`` (``0x200``), its size ``end - start + 1`` (unused: all zero);
* ``driver`` is a link to ``bus/pci/drivers/<name>`` while a driver is bound; writing the address to that
  driver's ``unbind`` detaches it; writing it to ``bus/pci/drivers/<name>/bind`` attaches a driver, to
  ``bus/pci/drivers_probe`` lets the kernel choose one;
* ``driver_override`` reads ``(null)`` when unset; while set, only the driver of that name may bind the function,
  whatever its ID table says; writing an empty line clears it;
* ``iommu_group`` is a link to ``kernel/iommu_groups/<n>``; a VFIO group's character device is
  ``/dev/vfio/<n>``, its container ``/dev/vfio/vfio``; with the VFIO device cdev (iommufd, Linux 6.6+) a bound
  function also has ``vfio-dev/vfio<N>`` in sysfs and ``/dev/vfio/devices/vfio<N>``, the iommufd ``/dev/iommu``;
* a module is loaded when ``<sysfs>/module/<name>`` exists (``Documentation/ABI/testing/sysfs-module``; names with
  ``_`` for ``-``); NVIDIA loads one by running ``modprobe <module>`` chrooted into the host's root;
* the Grace variant ``nvgrace-gpu-vfio-pci`` (driver ``nvgrace_gpu_vfio_pci``) serves the GPUs of its ID table
  (GH200 ``0x2342``, ``0x2345`` in its first version, Linux 6.8; later kernels add ``0x2348`` and GB200
  ``0x2941``) and binds only through ``driver_override``; every other GPU takes ``vfio-pci``;
* a GPU is in use while a process holds its ``/dev/nvidia<minor>`` open: NVIDIA waits for none (``fuser``); here
  ``<proc>/<pid>/fd/*`` links are read (``proc(5)``), naming each holder's PID and ``comm``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from dradriver.domain.passthrough import NVIDIA_DRIVER, IommuGroup, PciFunction, pcie_root_of
from dradriver.errors import DradriverError

IORESOURCE_MEM = 0x200
"""``flags`` bit of a memory resource (``include/linux/ioport.h``)."""

BAR_COUNT = 6
"""Standard BARs of a type-0 header: the first six lines of ``resource``."""

VFIO_PCI = "vfio-pci"
"""The generic VFIO PCI module and driver name."""

NVGRACE_MODULE = "nvgrace-gpu-vfio-pci"
NVGRACE_DRIVER = "nvgrace_gpu_vfio_pci"
NVGRACE_DEVICE_IDS = frozenset({0x2342, 0x2345, 0x2348, 0x2941})
"""PCI device IDs of the kernel's ``nvgrace-gpu-vfio-pci`` ID table (``drivers/vfio/pci/nvgrace-gpu/main.c``)."""

DEFAULT_SETTLE_S = 10.0
"""How long a written state may take to show (seconds); a real sysfs write takes effect before it returns."""

_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
"""A root complex element of a device link's target (as :func:`dradriver.nvml.discovery.pcie_root` reads it)."""
_T = TypeVar("_T")


class PciError(DradriverError):
    """A PCI function cannot be read or changed; the message names the PCI address and the sysfs path."""


class PciSettleError(PciError):
    """A write took no effect within the bound: names the function, the file written and what was found."""


class GpuInUseError(PciError):
    """A GPU's ``/dev/nvidia<minor>`` is held open by processes (named with PID and command)."""


class NvidiaNotLoadedError(PciError):
    """A function cannot be given back to ``nvidia``: its driver is not registered (``<sysfs>/bus/pci/drivers/nvidia``
    is missing, the module is unloaded); nothing was written."""


class ModuleLoadError(PciError):
    """A kernel module could not be loaded (the ``modprobe`` command's status and output in the message)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """A process holding a device node open: its PID and ``comm`` (``"?"`` when gone meanwhile)."""

    pid: int
    comm: str

    def __str__(self) -> str:
        return f"{self.comm} (pid {self.pid})"


def _module_dir_name(module: str) -> str:
    return module.replace("-", "_")


def bar_bytes(resource: str) -> int:
    """Sum of the memory BAR sizes of a ``resource`` file's text (bytes); lines past the sixth are not BARs."""
    total = 0
    for line in resource.splitlines()[:BAR_COUNT]:
        parts = line.split()
        if len(parts) < 3:
            continue
        start, end, flags = (int(p, 16) for p in parts[:3])
        if flags & IORESOURCE_MEM and end > start:
            total += end - start + 1
    return total


@dataclass
class PciHost:
    """The PCI side of a node: sysfs, ``/dev/vfio``, procfs and the ``modprobe`` command.

    :param sysfs_root: root of sysfs (``--sysfs-root``).
    :param dev_root: root under which ``dev/vfio`` and ``dev/nvidia<minor>`` are (``--dev-root``).
    :param proc_root: procfs (``--proc-root``): the running kernel's ``sys/kernel/osrelease``.
    :param process_root: the procfs whose ``<pid>/fd`` links are scanned for holders of a GPU's device node
        (``None``: :attr:`proc_root`; the host's PID namespace must be visible there).
    :param modprobe: the command a module name is appended to (NVIDIA: ``chroot <host root> modprobe``).
    :param modules_root: the host's ``lib/modules`` tree holder (the host root): whether a module is installed
        is read from ``<modules_root>/lib/modules/<osrelease>/modules.dep`` (``<proc>/sys/kernel/osrelease``).
    :param settle_s: bound on a written state showing in sysfs (seconds).
    :param poll_s: pause between two reads of a state that has not settled yet.
    :param timeout_s: bound on one ``modprobe`` run.
    """

    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/")
    proc_root: Path = Path("/proc")
    process_root: Path | None = None
    modprobe: tuple[str, ...] = ("chroot", "/host-root", "modprobe")
    modules_root: Path = Path("/host-root")
    settle_s: float = DEFAULT_SETTLE_S
    poll_s: float = 0.02
    timeout_s: float = 60.0
    _sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    # -- paths ------------------------------------------------------------------------------------------------

    def device_path(self, address: str) -> Path:
        """``<sysfs>/bus/pci/devices/<address>``."""
        return self.sysfs_root / "bus" / "pci" / "devices" / address

    def driver_path(self, driver: str) -> Path:
        """``<sysfs>/bus/pci/drivers/<driver>``."""
        return self.sysfs_root / "bus" / "pci" / "drivers" / driver

    def vfio_group_node(self, group: int) -> Path:
        """``<dev root>/dev/vfio/<group>``, the VFIO group's character device."""
        return self.dev_root / "dev" / "vfio" / str(group)

    def vfio_api_node(self, iommufd: bool) -> Path:
        """The VFIO API device: ``<dev root>/dev/iommu`` (iommufd) or ``<dev root>/dev/vfio/vfio`` (legacy)."""
        return self.dev_root / "dev" / ("iommu" if iommufd else "vfio/vfio")

    def iommufd_available(self) -> bool:
        """The host has ``/dev/iommu`` (NVIDIA's ``iommuFDEnabled``)."""
        return os.path.lexists(self.dev_root / "dev" / "iommu")

    def iommu_enabled(self) -> bool:
        """``<sysfs>/kernel/iommu_groups`` exists and is not empty (NVIDIA's start-up requirement)."""
        with contextlib.suppress(OSError):
            return any(os.scandir(self.sysfs_root / "kernel" / "iommu_groups"))
        return False

    # -- reading ----------------------------------------------------------------------------------------------

    def _read(self, address: str, name: str, default: str | None = None) -> str:
        path = self.device_path(address) / name
        try:
            return path.read_text().strip()
        except OSError as exc:
            if default is not None and exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return default
            raise PciError(f"PCI function {address}: cannot read {path}: {exc.strerror or exc}") from exc

    def _link_name(self, path: Path) -> str | None:
        try:
            return os.path.basename(os.readlink(path))
        except OSError:
            return None

    def function(self, address: str) -> PciFunction:
        """The function ``address`` (``dddd:bb:dd.f``, lowercase) as sysfs shows it now.

        :raises PciError: the address is malformed, the function is absent or an attribute unreadable.
        """
        if not _ADDRESS.match(address):
            raise PciError(f"PCI address {address!r} is not of the form dddd:bb:dd.f (lowercase hex), "
                           f"as under {self.device_path('')}")
        path = self.device_path(address)
        if not path.is_dir():
            raise PciError(f"PCI function {address}: no {path}")

        def number(name: str, base: int, default: str | None = None) -> int:
            text = self._read(address, name, default)
            try:
                return int(text, base)
            except ValueError as exc:
                raise PciError(f"PCI function {address}: {path / name} holds {text!r}, not a number") from exc

        override = self._read(address, "driver_override", "(null)")
        group = self._link_name(path / "iommu_group")
        numa = number("numa_node", 10, "-1")
        return PciFunction(
            address=address,
            vendor_id=number("vendor", 16),
            device_id=number("device", 16),
            class_code=number("class", 16),
            driver=self._link_name(path / "driver"),
            driver_override=None if override in ("", "(null)") else override,
            iommu_group=int(group) if group is not None and group.isdigit() else None,
            numa_node=numa if numa >= 0 else None,
            sriov_numvfs=number("sriov_numvfs", 10, "0"),
            bar_bytes=bar_bytes(self._read(address, "resource", "")),
            vfio_cdev=self.vfio_cdev(address),
            pcie_root=self._pcie_root(path),
        )

    @staticmethod
    def _pcie_root(path: Path) -> str | None:
        try:
            return pcie_root_of(os.readlink(path))
        except OSError:
            return None

    def vfio_cdev(self, address: str) -> str | None:
        """The function's ``vfio-dev/vfio<N>`` entry name, ``None`` when it has none (not on VFIO, or a kernel
        without the VFIO device cdev)."""
        with contextlib.suppress(OSError):
            names = sorted(e.name for e in os.scandir(self.device_path(address) / "vfio-dev")
                           if e.name.startswith("vfio"))
            return names[0] if names else None
        return None

    def functions(self) -> list[PciFunction]:
        """Every function of the bus, by address.

        :raises PciError: an attribute of a present function cannot be read.
        """
        try:
            names = sorted(e.name for e in os.scandir(self.device_path("").parent / "devices"))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise PciError(f"cannot list {self.device_path('')}: {exc}") from exc
        return [self.function(name) for name in names if _ADDRESS.match(name)]

    def gpus(self) -> list[PciFunction]:
        """The NVIDIA GPU functions (:attr:`~dradriver.domain.passthrough.PciFunction.is_nvidia_gpu`), by
        address: the order NVIDIA numbers ``gpu-vfio-<index>`` in."""
        return [f for f in self.functions() if f.is_nvidia_gpu]

    def iommu_group(self, number: int) -> IommuGroup:
        """The group ``number`` with every function in ``<sysfs>/kernel/iommu_groups/<number>/devices``.

        :raises PciError: the group does not exist or a member cannot be read.
        """
        path = self.sysfs_root / "kernel" / "iommu_groups" / str(number) / "devices"
        try:
            names = sorted(e.name for e in os.scandir(path))
        except OSError as exc:
            raise PciError(f"IOMMU group {number}: cannot list {path}: {exc.strerror or exc}") from exc
        return IommuGroup(number, tuple(self.function(n) for n in names if _ADDRESS.match(n)))

    def group_of(self, function: PciFunction) -> IommuGroup:
        """The IOMMU group of ``function``.

        :raises PciError: the function has no IOMMU group (IOMMU off) or the group cannot be read.
        """
        if function.iommu_group is None:
            raise PciError(f"PCI function {function.address}: no IOMMU group "
                           f"({self.device_path(function.address) / 'iommu_group'} is missing: IOMMU off?)")
        return self.iommu_group(function.iommu_group)

    # -- modules ----------------------------------------------------------------------------------------------

    def module_loaded(self, module: str) -> bool:
        """``<sysfs>/module/<module>`` exists (``-`` read as ``_``)."""
        return (self.sysfs_root / "module" / _module_dir_name(module)).is_dir()

    def module_installed(self, module: str) -> bool:
        """The host's ``modules.dep`` of the running kernel lists ``<module>.ko`` (any compression), or it is
        loaded already (built in, or loaded by hand)."""
        if self.module_loaded(module):
            return True
        try:
            release = (self.proc_root / "sys" / "kernel" / "osrelease").read_text().strip()
            dep = (self.modules_root / "lib" / "modules" / release / "modules.dep").read_text()
        except OSError:
            return False
        wanted = {module, _module_dir_name(module)}
        for line in dep.splitlines():
            name = os.path.basename(line.split(":", 1)[0])
            if name.split(".ko", 1)[0] in wanted:
                return True
        return False

    def load_module(self, module: str, *, address: str = "") -> None:
        """Run ``<modprobe> <module>`` unless it is loaded; then it must be loaded.

        :param address: the function it is loaded for (named in errors).
        :raises ModuleLoadError: the command failed, timed out, or the module is still not in sysfs.
        """
        if self.module_loaded(module):
            return
        argv = [*self.modprobe, module]
        shown = " ".join(argv)
        where = self.sysfs_root / "module" / _module_dir_name(module)
        subject = f"PCI function {address}: " if address else ""
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModuleLoadError(f"{subject}loading module {module} ({shown}): {exc}; {where} missing") from exc
        if done.returncode != 0:
            output = " ".join((done.stderr or done.stdout or "").split()) or "(no output)"
            raise ModuleLoadError(f"{subject}loading module {module}: {shown} exited {done.returncode}: {output} "
                                  f"({where} missing)")
        self._settle(lambda: self.module_loaded(module) or None, address or module, f"{shown}",
                     lambda: f"{where} missing")

    def vfio_variant(self, function: PciFunction) -> tuple[str, str]:
        """(module, driver) to bind ``function`` for passthrough: ``nvgrace-gpu-vfio-pci`` for a GPU of its ID
        table when the host's kernel has that module, else ``vfio-pci``."""
        if function.device_id in NVGRACE_DEVICE_IDS and self.module_installed(NVGRACE_MODULE):
            return NVGRACE_MODULE, NVGRACE_DRIVER
        return VFIO_PCI, VFIO_PCI

    # -- writing ----------------------------------------------------------------------------------------------

    def _write(self, path: Path, text: str, address: str) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_TRUNC)  # O_TRUNC: a plain test file too
        except OSError as exc:
            why = "nothing answers (no reader)" if exc.errno == errno.ENXIO else (exc.strerror or str(exc))
            raise PciError(f"PCI function {address}: cannot open {path} for writing: {why}") from exc
        try:
            os.write(fd, text.encode())
        except OSError as exc:
            raise PciError(f"PCI function {address}: writing {text.strip()!r} to {path}: "
                           f"{exc.strerror or exc}") from exc
        finally:
            os.close(fd)

    def _settle(self, check: Callable[[], _T | None], address: str, written: str,
                found: Callable[[], str]) -> _T:
        deadline = time.monotonic() + self.settle_s
        while True:
            value = check()
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise PciSettleError(f"PCI function {address}: after {written} the state did not settle within "
                                     f"{self.settle_s:g} s: {found()}")
            self._sleep(self.poll_s)

    def _driver_now(self, address: str) -> str | None:
        return self._link_name(self.device_path(address) / "driver")

    def _found(self, address: str) -> Callable[[], str]:
        def describe() -> str:
            link = self.device_path(address) / "driver"
            driver = self._driver_now(address)
            return f"{link} is {'absent (unbound)' if driver is None else f'a link to driver {driver}'}"
        return describe

    def unbind(self, address: str) -> str | None:
        """Detach the bound driver (write the address to ``<device>/driver/unbind``); nothing when unbound.

        :returns: the driver it was bound to, ``None`` when it was unbound.
        :raises PciError: the write failed; :class:`PciSettleError` the ``driver`` link stayed.
        """
        driver = self._driver_now(address)
        if driver is None:
            return None
        path = self.driver_path(driver) / "unbind"
        self._write(path, address + "\n", address)
        self._settle(lambda: True if self._driver_now(address) is None else None, address,
                     f"writing {address} to {path}", self._found(address))
        return driver

    def set_driver_override(self, address: str, driver: str | None) -> None:
        """Write ``driver`` to ``driver_override`` (``None``: clear it) and read it back.

        :raises PciError: the write failed; :class:`PciSettleError` the file shows another value.
        """
        path = self.device_path(address) / "driver_override"
        self._write(path, (driver or "") + "\n", address)
        want = driver or "(null)"

        def current() -> str:
            try:
                text = path.read_text().strip()
            except OSError as exc:
                return f"unreadable: {exc}"
            return text or "(null)"

        self._settle(lambda: True if current() == want else None, address,
                     f"writing {driver or '(empty)'!r} to {path}", lambda: f"{path} holds {current()!r}")

    def bind(self, address: str, driver: str) -> None:
        """Attach ``driver`` (write the address to ``<sysfs>/bus/pci/drivers/<driver>/bind``) and wait for it.

        :raises PciError: the driver is not loaded or the write failed; :class:`PciSettleError` the function
            is not bound to ``driver`` within the bound.
        """
        if self._driver_now(address) == driver:
            return
        path = self.driver_path(driver) / "bind"
        if not os.path.lexists(path):
            raise PciError(f"PCI function {address}: cannot bind driver {driver}: {path} does not exist "
                           "(its module is not loaded)")
        self._write(path, address + "\n", address)
        self.wait_driver(address, driver, f"writing {address} to {path}")

    def probe(self, address: str, expect: str | None = None) -> str | None:
        """Let the kernel choose a driver (write the address to ``<sysfs>/bus/pci/drivers_probe``).

        :param expect: the driver it must end up with (waited for); ``None``: any, not waited for.
        :returns: the driver bound afterwards.
        :raises PciError: the write failed; :class:`PciSettleError` ``expect`` did not bind.
        """
        if expect is not None and self._driver_now(address) == expect:
            return expect
        path = self.sysfs_root / "bus" / "pci" / "drivers_probe"
        self._write(path, address + "\n", address)
        if expect is not None:
            self.wait_driver(address, expect, f"writing {address} to {path}")
        return self._driver_now(address)

    def wait_driver(self, address: str, driver: str, written: str) -> None:
        """Wait until ``address`` is bound to ``driver``.

        :raises PciSettleError: it is not, within :attr:`settle_s`.
        """
        self._settle(lambda: True if self._driver_now(address) == driver else None, address, written,
                     self._found(address))

    def wait_group_node(self, group: int, address: str) -> Path:
        """Wait for ``/dev/vfio/<group>``; returns its path.

        :raises PciSettleError: it does not appear within :attr:`settle_s`.
        """
        node = self.vfio_group_node(group)
        return self._settle(lambda: node if os.path.lexists(node) else None, address,
                            f"binding to VFIO (IOMMU group {group})", lambda: f"{node} does not exist")

    def nvidia_loaded(self) -> bool:
        """The ``nvidia`` PCI driver is registered: ``<sysfs>/bus/pci/drivers/nvidia/bind`` exists. ``rmmod nvidia``
        (a driver upgrade) unbinds every function on it and removes the directory; a function on a VFIO driver is
        untouched (the kernel's ``pci_unregister_driver``)."""
        return os.path.lexists(self.driver_path(NVIDIA_DRIVER) / "bind")

    def rebind_nvidia(self, address: str) -> None:
        """Give ``address`` back to ``nvidia``: clear ``driver_override``, unbind a driver other than ``nvidia``,
        then bind ``nvidia`` and wait for it. Idempotent: a function on ``nvidia`` is left as it is (its override
        cleared).

        While ``nvidia`` is not loaded (:meth:`nvidia_loaded`) nothing is written: binding it is a write to its
        ``bind`` file, which does not exist then, and unbinding the VFIO driver alone would leave the function on
        no driver, its ``/dev/vfio/<group>`` gone, in a state no undo record describes. It stays where it is.

        :raises NvidiaNotLoadedError: ``nvidia`` is not loaded (the function is on another driver or none).
        :raises PciError: as the steps.
        """
        function = self.function(address)
        if function.driver != NVIDIA_DRIVER and not self.nvidia_loaded():
            where = f"on {function.driver}" if function.driver is not None else "unbound"
            raise NvidiaNotLoadedError(
                f"PCI function {address}: cannot give it back to {NVIDIA_DRIVER}: the {NVIDIA_DRIVER} driver is not "
                f"loaded ({self.driver_path(NVIDIA_DRIVER)} does not exist: its kernel module is unloaded); it stays "
                f"{where} until the module is loaded again")
        if function.driver_override is not None:
            self.set_driver_override(address, None)
        if function.driver == NVIDIA_DRIVER:
            return
        self.unbind(address)
        self.bind(address, NVIDIA_DRIVER)

    # -- in use -----------------------------------------------------------------------------------------------

    def holders(self, minor: int) -> list[Holder]:
        """Processes holding ``/dev/nvidia<minor>`` open (an fd link to ``/dev/nvidia<minor>`` or to
        ``<dev root>/dev/nvidia<minor>``), by PID; this process is left out."""
        targets = {f"/dev/nvidia{minor}", os.path.normpath(f"{self.dev_root}/dev/nvidia{minor}")}
        found: list[Holder] = []
        procfs = self.proc_root if self.process_root is None else self.process_root
        try:
            pids = sorted(int(e.name) for e in os.scandir(procfs) if e.name.isdigit())
        except OSError:
            return []
        me = os.getpid()
        for pid in pids:
            if pid == me:
                continue
            fd_dir = procfs / str(pid) / "fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd_dir / fd)
                except OSError:
                    continue
                if target in targets:
                    try:
                        comm = (procfs / str(pid) / "comm").read_text().strip()
                    except OSError:
                        comm = "?"
                    found.append(Holder(pid, comm))
                    break
        return found

    def check_not_in_use(self, address: str, minor: int) -> None:
        """Refuse a GPU whose device node is open.

        :raises GpuInUseError: names each holder, the GPU's device node and address.
        """
        holders = self.holders(minor)
        if holders:
            raise GpuInUseError(f"PCI function {address} ({self.device_path(address)}): GPU /dev/nvidia{minor} is "
                                f"in use by {', '.join(str(h) for h in holders)}; it is not taken from them")

