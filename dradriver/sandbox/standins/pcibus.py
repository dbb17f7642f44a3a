"""Stand-in for the kernel's PCI bus in a sandbox sysfs tree: it serves the ``bind``/``unbind``/``drivers_probe``
attribute files, made FIFOs, as the kernel answers the real ones. Standard library only.

The tree (:func:`lay_out_function`, :func:`lay_out_driver`) is the kernel's layout
(``Documentation/ABI/testing/sysfs-bus-pci``, ``Documentation/ABI/testing/sysfs-kernel-iommu_groups``):
``devices/pci<dom>:<bus>/<dom>:<bus>:00.0/<address>`` holds a function's attributes, ``bus/pci/devices/<address>``
links to it, ``driver`` links to ``bus/pci/drivers/<name>`` (which links back by address), ``iommu_group`` to
``kernel/iommu_groups/<n>`` (whose ``devices`` links to each member). A writer that finds no reader on a FIFO gets
``ENXIO``: the bus is not running.

Rules it applies (the kernel's ``drivers/pci/pci-driver.c``, ``drivers/base/bus.c``, ``drivers/vfio/group.c``):

* ``drivers/<d>/unbind <address>``: detaches ``<d>`` when it is the bound driver, else nothing;
* ``drivers/<d>/bind <address>``: attaches ``<d>`` when the function is unbound and ``<d>`` matches: its
  ``driver_override`` names ``<d>`` or, without an override, ``<d>``'s ID table takes the function (``nvidia``:
  an NVIDIA display function; ``snd_hda_intel``: an HD audio function; the VFIO drivers: none without an
  override, ``nvgrace_gpu_vfio_pci`` binds only through one); a driver exists only while its module is loaded
  (its directory is made by the ``modprobe`` stand-in);
* ``drivers_probe <address>``: an unbound function gets the override's driver if loaded, else the first loaded
  driver whose table matches; with an override naming a driver not loaded it stays unbound;
* the first function of an IOMMU group bound to a VFIO driver makes ``dev/vfio/<group>`` (a regular file, as the
  sandbox makes its other device nodes), the last one leaving removes it; a function bound to a VFIO driver gets
  ``vfio-dev/vfio<N>`` (the VFIO device cdev, Linux 6.6+) and, on a host with ``dev/iommu``,
  ``dev/vfio/devices/vfio<N>``.

Faults, per operation and address, from the JSON file ``faults`` (default ``<sysfs>/../pcibus-faults.json``;
:meth:`PciBus.inject` appends to it; the ``modprobe`` stand-in reads the same file): a list of objects
``{"op": <op>, "address": <address or "*">, "count": <n, -1 for every call>}`` with ``op`` one of
``"bind"``, ``"unbind"``, ``"probe"`` (the write is consumed and nothing changes: the state never settles),
``"vfio-node"`` (the bind happens but ``dev/vfio/<group>`` is not made), or ``"modprobe"`` with ``"module"`` in
place of ``"address"`` (``modprobe`` exits 1, "could not insert"). A fault with a ``count`` is used up call by call.

Run as a thread (:class:`PciBus` ``start``/``stop``) or a process:
``python -m dradriver.sandbox.standins.pcibus --sysfs <root>/sys --dev <root> [--faults FILE]`` (until SIGTERM).

Installed as ``<root>/bin/modprobe`` (:func:`dradriver.sandbox.standins.install`) the same file is the
``modprobe`` stand-in, acting on the sandbox ``<root>`` above its directory: ``modprobe <module>`` loads a module
the running kernel has (listed in ``<root>/lib/modules/<release>/modules.dep``, ``<release>`` from
``<root>/proc/sys/kernel/osrelease``) with the modules it depends on there: ``sys/module/<name>`` (``-`` read as
``_``) and, for a PCI driver module, ``sys/bus/pci/drivers/<driver>`` with its FIFOs, then attaches the driver to
every unbound function it takes (the kernel's ``driver_attach`` at ``pci_register_driver``: its ``driver_override``
names the driver or, without one, its ID table matches), so ``modprobe nvidia`` gives the unbound GPUs back to
``nvidia``; a module already loaded is done (exit 0); one not listed fails as kmod does: "modprobe: FATAL: Module
<m> not found in directory /lib/modules/<release>", exit 1. ``modprobe -r <module>`` unloads it as ``rmmod`` does
(``pci_unregister_driver``): every function bound to its driver is unbound (a function on another driver, a GPU on
``vfio-pci`` while ``nvidia`` goes, is untouched), ``sys/bus/pci/drivers/<driver>`` and ``sys/module/<name>`` go
(the modules it depends on stay); a module not loaded is done (exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import selectors
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path

VFIO_DRIVERS = ("vfio-pci", "nvgrace_gpu_vfio_pci")
MEM_BAR = 0x00040200  # IORESOURCE_MEM | IORESOURCE_PREFETCH, as 64-bit BARs show
FAULTS_NAME = "pcibus-faults.json"


def default_faults(sysfs: Path) -> Path:
    """``<sysfs>/../pcibus-faults.json``."""
    return Path(sysfs).parent / FAULTS_NAME


def _matches(driver: str, vendor: int, class_code: int) -> bool:
    """``driver``'s ID table takes a function without an override."""
    if driver == "nvidia":
        return vendor == 0x10DE and class_code >> 16 == 0x03
    if driver == "snd_hda_intel":
        return class_code >> 8 == 0x0403
    return False


def _fifo(path: Path) -> None:
    if not path.exists():
        os.mkfifo(path, 0o200)


def lay_out_bus(sysfs: Path) -> None:
    """``bus/pci/devices``, ``bus/pci/drivers``, the ``drivers_probe`` FIFO and ``kernel/iommu_groups``."""
    for sub in ("bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups", "module"):
        (sysfs / sub).mkdir(parents=True, exist_ok=True)
    _fifo(sysfs / "bus" / "pci" / "drivers_probe")


def lay_out_driver(sysfs: Path, driver: str, module: str) -> Path:
    """A loaded driver: ``module/<module>`` (``initstate`` live) and ``bus/pci/drivers/<driver>`` with its
    ``bind``/``unbind`` FIFOs and ``module`` link. Returns the driver directory."""
    lay_out_bus(sysfs)
    mod = sysfs / "module" / module.replace("-", "_")
    mod.mkdir(parents=True, exist_ok=True)
    (mod / "initstate").write_text("live\n")
    directory = sysfs / "bus" / "pci" / "drivers" / driver
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("bind", "unbind"):
        _fifo(directory / name)
    if not os.path.lexists(directory / "module"):
        os.symlink(os.path.relpath(mod, directory), directory / "module")
    return directory


def lay_out_function(sysfs: Path, address: str, *, vendor: int, device: int, class_code: int,
                     driver: str | None = None, iommu_group: int | None = None, numa_node: int = -1,
                     bars: tuple[int, ...] = (), sriov_numvfs: int | None = None) -> Path:
    """One PCI function under ``devices/pci<dom>:<bus-1>/<dom>:<bus-1>:00.0/<address>`` (the root port one bus
    up), linked from ``bus/pci/devices``; attributes ``vendor``, ``device``, ``class``, ``numa_node``,
    ``driver_override`` (``(null)``), ``resource`` (``bars``: sizes in bytes of memory BARs 0, 1, ... ; ``0`` an
    unused BAR), ``sriov_numvfs`` when given; ``driver`` bound (its directory must exist, see
    :func:`lay_out_driver`); ``iommu_group`` membership. Returns the function's directory."""
    lay_out_bus(sysfs)
    domain, bus, _ = address.split(":", 2)
    rc = f"pci{domain}:{max(int(bus, 16) - 1, 0):02x}"
    real = sysfs / "devices" / rc / f"{rc[3:]}:00.0" / address
    real.mkdir(parents=True, exist_ok=True)
    (real / "vendor").write_text(f"0x{vendor:04x}\n")
    (real / "device").write_text(f"0x{device:04x}\n")
    (real / "class").write_text(f"0x{class_code:06x}\n")
    (real / "numa_node").write_text(f"{numa_node}\n")
    (real / "driver_override").write_text("(null)\n")
    lines, start = [], 0x2000_0000_0000 + (int(bus, 16) << 40)  # apart even for 256 GiB BARs
    for size in (*bars, *([0] * 13))[:13]:
        if size:
            lines.append(f"0x{start:016x} 0x{start + size - 1:016x} 0x{MEM_BAR:016x}")
            start += size
        else:
            lines.append(f"0x{0:016x} 0x{0:016x} 0x{0:016x}")
    (real / "resource").write_text("\n".join(lines) + "\n")
    if sriov_numvfs is not None:
        (real / "sriov_numvfs").write_text(f"{sriov_numvfs}\n")
    link = sysfs / "bus" / "pci" / "devices" / address
    if not os.path.lexists(link):
        os.symlink(os.path.relpath(real, link.parent), link)
    if iommu_group is not None:
        group = sysfs / "kernel" / "iommu_groups" / str(iommu_group) / "devices"
        group.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(group / address):
            os.symlink(os.path.relpath(real, group), group / address)
        if not os.path.lexists(real / "iommu_group"):
            os.symlink(os.path.relpath(group.parent, real), real / "iommu_group")
    if driver is not None:
        _attach(sysfs, real, address, driver)
    return real


def _attach(sysfs: Path, real: Path, address: str, driver: str) -> None:
    directory = sysfs / "bus" / "pci" / "drivers" / driver
    os.symlink(os.path.relpath(directory, real), real / "driver")
    with contextlib.suppress(FileExistsError):
        os.symlink(os.path.relpath(real, directory), directory / address)


def _load_faults(path: Path) -> list[dict[str, object]]:
    try:
        data = json.loads(path.read_text() or "[]")
    except (OSError, ValueError):
        return []
    return [f for f in data if isinstance(f, dict)] if isinstance(data, list) else []


def take_fault(path: Path, op: str, subject: str) -> bool:
    """Use up one matching fault of ``path`` (``op`` and ``address``/``module`` equal or ``"*"``); True if found."""
    lock = path.with_suffix(".lock")
    with open(lock, "a") as held:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)
        faults = _load_faults(path)
        key = "module" if op == "modprobe" else "address"
        for fault in faults:
            count = fault.get("count", 1)
            if fault.get("op") == op and fault.get(key, "*") in ("*", subject) and count != 0:
                if isinstance(count, int) and count > 0:
                    fault["count"] = count - 1
                path.write_text(json.dumps([f for f in faults if f.get("count", 1) != 0]))
                return True
    return False


class PciBus:
    """The PCI bus "kernel" of one sandbox tree.

    :param sysfs: the sandbox's sysfs root.
    :param dev_root: the root holding ``dev/`` (``dev/vfio/<group>`` is made there).
    :param faults: the faults file (see the module text).
    :param poll_s: how often new driver directories are looked for.
    """

    def __init__(self, sysfs: Path, dev_root: Path, *, faults: Path | None = None, poll_s: float = 0.02) -> None:
        self.sysfs = Path(sysfs)
        self.dev_root = Path(dev_root)
        self.faults = faults if faults is not None else default_faults(self.sysfs)
        self.poll_s = poll_s
        self.handled = 0
        """Writes handled so far (each line of a FIFO)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: dict[Path, tuple[int, int]] = {}
        self._selector = selectors.DefaultSelector()
        lay_out_bus(self.sysfs)

    # -- faults -----------------------------------------------------------------------------------------------

    def inject(self, op: str, address: str = "*", *, count: int = 1, module: str | None = None) -> None:
        """Append a fault (see the module text) to the faults file."""
        faults = _load_faults(self.faults)
        entry: dict[str, object] = {"op": op, "count": count}
        if op == "modprobe":
            entry["module"] = module or "*"
        else:
            entry["address"] = address
        faults.append(entry)
        self.faults.write_text(json.dumps(faults))

    def clear_faults(self) -> None:
        """Remove every fault."""
        self.faults.unlink(missing_ok=True)

    # -- serving ----------------------------------------------------------------------------------------------

    def start(self) -> PciBus:
        """Serve the FIFOs in a daemon thread until :meth:`stop`."""
        self._rescan()
        self._thread = threading.Thread(target=self._run, name="pcibus", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; later writes find no reader (``ENXIO``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for path in list(self._fds):
            self._close(path)

    def _fifos(self) -> list[Path]:
        drivers = self.sysfs / "bus" / "pci" / "drivers"
        found = [self.sysfs / "bus" / "pci" / "drivers_probe"]
        with contextlib.suppress(OSError):
            for entry in os.scandir(drivers):
                found += [drivers / entry.name / "bind", drivers / entry.name / "unbind"]
        return [p for p in found if _is_fifo(p)]

    def _rescan(self) -> None:
        """Serve the FIFOs there now: a FIFO made again under the same path (a driver's module unloaded and loaded
        between two rescans: ``modprobe -r nvidia`` then ``modprobe nvidia``) is another inode, and the old one's
        reader serves no writer of the new one, so it is reopened."""
        present = set(self._fifos())
        for path in list(self._fds):
            if path not in present or not _same_inode(path, self._fds[path][0]):
                self._close(path)
        for path in present - set(self._fds):
            reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            keeper = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # no EOF when a writer closes
            self._fds[path] = (reader, keeper)
            self._selector.register(reader, selectors.EVENT_READ, path)

    def _close(self, path: Path) -> None:
        reader, keeper = self._fds.pop(path)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(reader)
        os.close(reader)
        os.close(keeper)

    def _run(self) -> None:
        pending: dict[Path, bytes] = {}
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=self.poll_s):
                path: Path = key.data
                try:
                    chunk = os.read(key.fd, 4096)
                except OSError as exc:
                    if exc.errno == errno.EAGAIN:
                        continue
                    raise
                buffer = pending.get(path, b"") + chunk
                *lines, rest = buffer.split(b"\n")
                pending[path] = rest
                for line in lines:
                    self._handle(path, line.decode(errors="replace").strip())
            self._rescan()

    # -- the kernel's rules -----------------------------------------------------------------------------------

    def _real(self, address: str) -> Path | None:
        link = self.sysfs / "bus" / "pci" / "devices" / address
        return link.resolve() if os.path.lexists(link) else None

    @staticmethod
    def _driver(real: Path) -> str | None:
        try:
            return os.path.basename(os.readlink(real / "driver"))
        except OSError:
            return None

    def _handle(self, path: Path, address: str) -> None:
        self.handled += 1
        real = self._real(address) if address else None
        if real is None:
            return  # the kernel answers ENODEV
        if path.name == "drivers_probe":
            if not take_fault(self.faults, "probe", address):
                self._probe(real, address)
        elif path.name == "unbind":
            if not take_fault(self.faults, "unbind", address) and self._driver(real) == path.parent.name:
                self._detach(real, address)
        elif path.name == "bind" and not take_fault(self.faults, "bind", address):
            self._bind(real, address, path.parent.name)

    def _loaded(self, driver: str) -> bool:
        return (self.sysfs / "bus" / "pci" / "drivers" / driver / "bind").exists()

    def _takes(self, real: Path, driver: str) -> bool:
        override = (real / "driver_override").read_text().strip()
        if override not in ("", "(null)"):
            return override == driver
        return _matches(driver, int((real / "vendor").read_text(), 16), int((real / "class").read_text(), 16))

    def _bind(self, real: Path, address: str, driver: str) -> None:
        if self._driver(real) is not None or not self._loaded(driver) or not self._takes(real, driver):
            return  # EBUSY / ENODEV
        if driver in VFIO_DRIVERS:  # the driver's probe registers the VFIO device before the link appears
            self._vfio_attached(real, address)
        _attach(self.sysfs, real, address, driver)

    def attach_unbound(self, driver: str) -> list[str]:
        """The kernel's ``driver_attach`` when ``driver`` registers: every unbound function it takes is bound to
        it (in address order). Returns their addresses."""
        attached: list[str] = []
        listing = self.sysfs / "bus" / "pci" / "devices"
        with contextlib.suppress(OSError):
            for address in sorted(e.name for e in os.scandir(listing)):
                real = self._real(address)
                if real is not None and self._driver(real) is None and self._takes(real, driver):
                    self._bind(real, address, driver)
                    if self._driver(real) == driver:
                        attached.append(address)
        return attached

    def _probe(self, real: Path, address: str) -> None:
        if self._driver(real) is not None:
            return
        drivers = self.sysfs / "bus" / "pci" / "drivers"
        with contextlib.suppress(OSError):
            for name in sorted(e.name for e in os.scandir(drivers)):
                if self._loaded(name) and self._takes(real, name):
                    self._bind(real, address, name)
                    return

    def _detach(self, real: Path, address: str) -> None:
        driver = self._driver(real)
        if driver in VFIO_DRIVERS:  # the driver's remove unregisters the VFIO device before the link goes
            self._vfio_detached(real)
        (real / "driver").unlink()
        if driver is None:
            return
        with contextlib.suppress(OSError):
            (self.sysfs / "bus" / "pci" / "drivers" / driver / address).unlink()

    def _group(self, real: Path) -> str | None:
        try:
            return os.path.basename(os.readlink(real / "iommu_group"))
        except OSError:
            return None

    def _group_on_vfio(self, group: str, leaving: Path) -> bool:
        """Another function of ``group`` than ``leaving`` is on a VFIO driver."""
        members = self.sysfs / "kernel" / "iommu_groups" / group / "devices"
        with contextlib.suppress(OSError):
            return any(self._driver(m) in VFIO_DRIVERS for e in os.scandir(members)
                       if (m := (members / e.name).resolve()) != leaving)
        return False

    def _vfio_attached(self, real: Path, address: str) -> None:
        used: set[str] = set()
        listing = self.sysfs / "bus" / "pci" / "devices"
        for entry in os.scandir(listing):
            with contextlib.suppress(OSError):
                used.update(os.listdir(listing / entry.name / "vfio-dev"))
        number = next(n for n in range(4096) if f"vfio{n}" not in used)
        (real / "vfio-dev" / f"vfio{number}").mkdir(parents=True, exist_ok=True)
        dev = self.dev_root / "dev"
        if os.path.lexists(dev / "iommu"):
            (dev / "vfio" / "devices").mkdir(parents=True, exist_ok=True)
            (dev / "vfio" / "devices" / f"vfio{number}").write_text("")
        group = self._group(real)
        if group is not None and not (dev / "vfio" / group).exists():
            if take_fault(self.faults, "vfio-node", address):
                return
            (dev / "vfio").mkdir(parents=True, exist_ok=True)
            (dev / "vfio" / group).write_text("")

    def _vfio_detached(self, real: Path) -> None:
        dev = self.dev_root / "dev"
        with contextlib.suppress(OSError):
            for entry in os.scandir(real / "vfio-dev"):
                (dev / "vfio" / "devices" / entry.name).unlink(missing_ok=True)
                os.rmdir(entry.path)
            os.rmdir(real / "vfio-dev")
        group = self._group(real)
        if group is not None and not self._group_on_vfio(group, real):
            (dev / "vfio" / group).unlink(missing_ok=True)


def _is_fifo(path: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


MODULE_DRIVERS = {"vfio_pci": "vfio-pci", "nvgrace_gpu_vfio_pci": "nvgrace_gpu_vfio_pci", "nvidia": "nvidia",
                  "snd_hda_intel": "snd_hda_intel"}
"""PCI driver each module registers (``pci_driver.name``: ``vfio-pci`` for ``vfio_pci``, ``KBUILD_MODNAME``
for the others)."""


def modprobe(root: Path, args: list[str]) -> int:
    """The ``modprobe`` stand-in on the sandbox ``root`` (see the module text); returns the exit status."""
    names = [a for a in args if not a.startswith("-")]
    if len(names) != 1:
        print("modprobe: ERROR: this stand-in takes one module name", file=sys.stderr)
        return 1
    module = names[0].replace("-", "_")
    sysfs = root / "sys"
    if any(a in ("-r", "--remove") for a in args):
        unload_module(root, module)
        return 0
    if (sysfs / "module" / module).is_dir():
        return 0
    release = (root / "proc" / "sys" / "kernel" / "osrelease").read_text().strip()
    deps: dict[str, list[str]] = {}
    with contextlib.suppress(OSError):
        for line in (root / "lib" / "modules" / release / "modules.dep").read_text().splitlines():
            head, _, tail = line.partition(":")
            deps[_ko_name(head)] = [_ko_name(d) for d in tail.split()]
    if module not in deps:
        print(f"modprobe: FATAL: Module {names[0]} not found in directory /lib/modules/{release}", file=sys.stderr)
        return 1
    if take_fault(default_faults(sysfs), "modprobe", names[0]) or take_fault(default_faults(sysfs), "modprobe",
                                                                               module):
        print(f"modprobe: ERROR: could not insert '{module}': Operation not permitted", file=sys.stderr)
        return 1
    registered: list[Path] = []
    for name in [*reversed(deps[module]), module]:
        if name in MODULE_DRIVERS:
            lay_out_driver(sysfs, MODULE_DRIVERS[name], name)
            registered.append(sysfs / "bus" / "pci" / "drivers" / MODULE_DRIVERS[name])
        else:
            (sysfs / "module" / name).mkdir(parents=True, exist_ok=True)
            (sysfs / "module" / name / "initstate").write_text("live\n")
    bus = PciBus(sysfs, root)
    for driver in registered:
        _wait_served(driver / "bind", driver / "unbind")
        bus.attach_unbound(driver.name)
    return 0


def unload_module(root: Path, module: str) -> list[str]:
    """``rmmod <module>`` on the sandbox ``root``: the functions bound to its PCI driver unbound, the driver's
    directory and ``sys/module/<module>`` removed (nothing when it is not loaded). Returns the addresses unbound."""
    sysfs = root / "sys"
    module = module.replace("-", "_")
    unbound: list[str] = []
    driver = MODULE_DRIVERS.get(module)
    directory = sysfs / "bus" / "pci" / "drivers" / driver if driver is not None else None
    if directory is not None and directory.is_dir():
        bus = PciBus(sysfs, root)
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            real = bus._real(entry.name)
            if real is not None and bus._driver(real) == driver:
                bus._detach(real, entry.name)
                unbound.append(entry.name)
        for entry in os.scandir(directory):
            os.unlink(entry.path)  # the bind/unbind FIFOs, the module link, links of functions gone meanwhile
        directory.rmdir()
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(sysfs / "module" / module)
    return unbound


def _same_inode(path: Path, fd: int) -> bool:
    """``path`` is still the file ``fd`` was opened from."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    opened = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)


def _wait_served(*fifos: Path, timeout_s: float = 5.0) -> bool:
    """Wait until the bus stand-in reads each of ``fifos`` (a non-blocking open for writing succeeds), so that, as
    with the kernel, a driver's ``bind`` file answers once ``modprobe`` has returned; ``False`` when no bus serves
    them within ``timeout_s`` (the bind then fails with "nothing answers", as it should without a bus)."""
    deadline = time.monotonic() + timeout_s
    for fifo in fifos:
        while True:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                break
            except OSError as exc:
                if exc.errno != errno.ENXIO or time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)
    return True


def _ko_name(path: str) -> str:
    return os.path.basename(path).split(".ko", 1)[0].replace("-", "_")


def main(argv: list[str] | None = None) -> int:
    if Path(sys.argv[0]).name == "modprobe":
        return modprobe(Path(sys.argv[0]).resolve().parent.parent, sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pcibus", description="PCI bus stand-in for a sandbox sysfs tree")
    parser.add_argument("--sysfs", required=True, type=Path)
    parser.add_argument("--dev", required=True, type=Path, help="root holding dev/ (dev/vfio is made there)")
    parser.add_argument("--faults", type=Path, default=None)
    args = parser.parse_args(argv)
    bus = PciBus(args.sysfs, args.dev, faults=args.faults).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    bus.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
