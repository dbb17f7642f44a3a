"""Stand-in for NVIDIA's persistence daemon, ``nvidia-persistenced``, as a node's driver container runs it.
Standard library only (NVML through :mod:`ctypes`).

What the real daemon does that matters here (NVIDIA's "Driver Persistence" guide,
docs.nvidia.com/deploy/driver-persistence, and the ``nvidia-persistenced(1)`` manual): at start it puts every GPU
in persistence mode by holding its device file ``/dev/nvidia<minor>`` open (``fuser`` names it
``nvidia-persiste``, the 15 characters of a process name); it listens on
``/var/run/nvidia-persistenced/socket``, where ``nvidia-smi -pm 0|1`` asks it to release or re-open one GPU; at
exit it closes them and removes the socket.

Here: ``nvidia-persistenced --dev-root DIR --sysfs DIR [--nvml LIB] [--faults FILE]``, installed as
``<driver root>/usr/bin/nvidia-persistenced`` (:func:`dradriver.sandbox.standins.install`), listens on
``<driver root>/run/nvidia-persistenced/socket`` (whatever was at that path is replaced; the socket is removed at
exit, SIGTERM or SIGINT). The GPUs are the PCI functions bound to ``nvidia`` in the sandbox sysfs
(``<sysfs>/bus/pci/drivers/nvidia/<address>``), each one's minor from NVML (``nvmlDeviceGetHandleByPciBusId_v2``,
``nvmlDeviceGetMinorNumber``, NVML initialised for each lookup since GPUs come and go between drivers); it holds
``<dev root>/dev/nvidia<minor>`` open for each. A request is one line ``pm <PCI bus id> <0|1>``; the answer one
line: ``ok changed``, ``ok already`` (the GPU was in that state) or ``error <reason>`` (a GPU not on ``nvidia``,
an NVML failure).

Faults, from the JSON file ``--faults`` (a list of ``{"op": "pm0-unanswered", "address": <address or "*">,
"count": <n, -1 for every call>}``): ``pm0-unanswered`` releases the GPU as ``pm 0`` asks and then never answers
(the connection is held until the daemon exits), so a caller can be killed right after persistence went off.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

SOCKET = "run/nvidia-persistenced/socket"
"""The daemon's socket under the driver root (``dradriver.host.persistenced.SOCKET``)."""

NVML_SUCCESS = 0


def normalise(bus_id: str) -> str:
    """A PCI bus id in any form NVML prints (``00000000:18:00.0``) as sysfs names it (``0000:18:00.0``)."""
    domain, bus, rest = bus_id.strip().lower().split(":", 2)
    device, function = rest.split(".", 1)
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"


class Daemon:
    """The daemon's state: the device files it holds open, by PCI address.

    :param dev_root: the root of ``dev/nvidia<minor>``.
    :param sysfs: the sandbox sysfs (``bus/pci/drivers/nvidia``).
    :param nvml: the NVML library to load (``libnvidia-ml.so.1``: the loader's search).
    :param faults: the faults file (see the module text).
    """

    def __init__(self, dev_root: Path, sysfs: Path, nvml: str, faults: Path | None) -> None:
        self.dev_root = dev_root
        self.sysfs = sysfs
        self.faults = faults
        self.lib = ctypes.CDLL(nvml)
        self.held: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def on_nvidia(self) -> list[str]:
        """Addresses bound to ``nvidia`` now."""
        directory = self.sysfs / "bus" / "pci" / "drivers" / "nvidia"
        try:
            return sorted(e.name for e in os.scandir(directory) if e.name.count(":") == 2)
        except OSError:
            return []

    def minor(self, address: str) -> int:
        """The minor number NVML reports for ``address``.

        :raises RuntimeError: NVML failed (its code in the message).
        """
        code = self.lib.nvmlInit_v2()
        if code != NVML_SUCCESS:
            raise RuntimeError(f"nvmlInit failed ({code})")
        try:
            handle = ctypes.c_void_p()
            code = self.lib.nvmlDeviceGetHandleByPciBusId_v2(address.encode(), ctypes.byref(handle))
            if code != NVML_SUCCESS:
                raise RuntimeError(f"GPU {address} not found by NVML ({code})")
            minor = ctypes.c_uint()
            code = self.lib.nvmlDeviceGetMinorNumber(handle, ctypes.byref(minor))
            if code != NVML_SUCCESS:
                raise RuntimeError(f"minor number of GPU {address} not known ({code})")
            return int(minor.value)
        finally:
            self.lib.nvmlShutdown()

    def hold(self, address: str) -> bool:
        """Open the GPU's device file (persistence on); False if it was held already."""
        with self.lock:
            if address in self.held:
                return False
            if address not in self.on_nvidia():
                raise RuntimeError(f"GPU {address} is not bound to nvidia")
            self.held[address] = os.open(self.dev_root / "dev" / f"nvidia{self.minor(address)}", os.O_RDONLY)
            return True

    def release(self, address: str) -> bool:
        """Close the GPU's device file (persistence off); False if it was not held."""
        with self.lock:
            fd = self.held.pop(address, None)
        if fd is None:
            return False
        os.close(fd)
        return True

    def take_fault(self, op: str, address: str) -> bool:
        """Use up one matching fault of the faults file; True if found."""
        if self.faults is None or not self.faults.exists():
            return False
        try:
            faults = json.loads(self.faults.read_text() or "[]")
        except ValueError:
            return False
        for fault in faults:
            count = fault.get("count", 1)
            if fault.get("op") == op and fault.get("address", "*") in ("*", address) and count != 0:
                if count > 0:
                    fault["count"] = count - 1
                self.faults.write_text(json.dumps([f for f in faults if f.get("count", 1) != 0]))
                return True
        return False

    def answer(self, line: str) -> str | None:
        """The answer to one request line; ``None``: do not answer (a fault)."""
        parts = line.split()
        if len(parts) != 3 or parts[0] != "pm" or parts[2] not in ("0", "1"):
            return f"error bad request {line.strip()!r}"
        try:
            address = normalise(parts[1])
        except ValueError:
            return f"error bad PCI bus id {parts[1]!r}"
        try:
            changed = self.hold(address) if parts[2] == "1" else self.release(address)
        except (OSError, RuntimeError) as exc:
            return f"error {exc}"
        if parts[2] == "0" and self.take_fault("pm0-unanswered", address):
            return None
        return "ok changed" if changed else "ok already"

    def serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            reply = self.answer(data.decode())
            if reply is None:
                self.stopping.wait()
                return
            conn.sendall(reply.encode() + b"\n")

    def close(self) -> None:
        with self.lock:
            fds, self.held = list(self.held.values()), {}
        for fd in fds:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvidia-persistenced")
    parser.add_argument("--dev-root", type=Path, required=True)
    parser.add_argument("--sysfs", type=Path, required=True)
    parser.add_argument("--nvml", default="libnvidia-ml.so.1")
    parser.add_argument("--faults", type=Path, default=None)
    args = parser.parse_args(argv)
    root = Path(os.path.abspath(__file__)).parents[2]  # <driver root>/usr/bin/nvidia-persistenced
    path = root / SOCKET
    daemon = Daemon(args.dev_root, args.sysfs, args.nvml, args.faults)
    for address in daemon.on_nvidia():
        try:
            daemon.hold(address)
        except (OSError, RuntimeError) as exc:
            print(f"nvidia-persistenced: {exc}", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)

    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=daemon.serve, args=(conn,), daemon=True).start()
    except SystemExit:
        pass
    finally:
        daemon.stopping.set()
        server.close()
        path.unlink(missing_ok=True)
        daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
