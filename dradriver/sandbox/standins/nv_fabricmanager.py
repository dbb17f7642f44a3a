"""Stand-in for NVIDIA's Fabric Manager daemon (``nv-fabricmanager``) in the shared NVSwitch virtualization mode,
as the Fabric Manager SDK (``libnvfm.so.1``) sees it.

Standard library only. It serves the line protocol of the mock SDK library (``ext/mocknvfm/``, documented in its
README) on a Unix socket, as the real daemon serves its API on ``FM_CMD_UNIX_SOCKET_PATH`` (NVIDIA Fabric Manager
User Guide, "Fabric Manager Domain Socket Interface"). Behaviour, from ``nv_fm_agent.h`` (the return codes each
call documents) and the guide's "Shared NVSwitch Virtualization Model":

* the partition table: every supported partition with its GPUs' physical (module) IDs, UUIDs and PCI bus IDs;
  by default the HGX 8-GPU table of :data:`HGX8_PARTITIONS` over the GPUs of a mock NVML profile (matched by
  ``moduleId``), or any table read from a JSON file (:func:`load_table`);
* activating a partition that is active, or one that shares a GPU with an active partition: ``FM_ST_IN_USE``;
  an unknown partition ID: ``FM_ST_BADPARAM``; a GPU of the partition not ready for activation (the guide: the
  hypervisor must hand FM GPUs no one uses; which code FM returns is not documented, the stand-in answers
  ``FM_ST_GENERIC_ERROR``): see :meth:`FabricManager.set_gpu_ready`;
* deactivating a partition that is not active: ``FM_ST_UNINITIALIZED`` ("specified partition is not activated");
  unknown ID: ``FM_ST_BADPARAM``;
* while FM initialises (:meth:`FabricManager.set_initializing`) every partition call answers ``FM_ST_NOT_CONFIGURED``;
* the set of active partitions is kept in a state file (JSON ``{"active": [ids]}``, replaced atomically), so it
  survives a restart of the daemon and, of course, of any client;
* FM down = no daemon listening: the socket file is removed at stop, so ``fmConnect`` answers
  ``FM_ST_CONNECTION_NOT_VALID``;
* faults per call (:meth:`FabricManager.inject`, or the ``FAULT`` line): the next ``count`` calls of an operation
  (``connect``, ``list``, ``activate``, ``deactivate``, ``setactive``) answer a given ``fmReturn_t`` or, with
  ``drop``, close the connection without an answer (the library then reports ``FM_ST_CONNECTION_NOT_VALID``), or
  with ``hang``, answer nothing for :attr:`FabricManager.hang_s` seconds (past the client's ``timeoutMs``: the
  library reports ``FM_ST_TIMEOUT``).

Run: ``python -m dradriver.sandbox.standins.nv_fabricmanager --socket PATH (--profile NAME|FILE | --table FILE)
[--state FILE]``; or in-process with :class:`FabricManager` (tests).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import socketserver
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FM_ST_SUCCESS = 0
FM_ST_BADPARAM = -1
FM_ST_GENERIC_ERROR = -2
FM_ST_UNINITIALIZED = -4
FM_ST_IN_USE = -7
FM_ST_NOT_CONFIGURED = -8
FM_MAX_FABRIC_PARTITIONS = 64
"""``nv_fm_types.h``."""

OPERATIONS = ("connect", "list", "activate", "deactivate", "setactive")
DROP = "drop"
HANG = "hang"

HGX8_PARTITIONS: tuple[tuple[int, tuple[int, ...]], ...] = (
    (0, (1, 2, 3, 4, 5, 6, 7, 8)),
    (1, (1, 2, 3, 4)),
    (2, (5, 6, 7, 8)),
    (3, (1, 3)),
    (4, (2, 4)),
    (5, (5, 7)),
    (6, (6, 8)),
    *((6 + m, (m,)) for m in range(1, 9)),
)
"""Default shared NVSwitch partitions of an HGX 8-GPU baseboard, (partition ID, GPU module IDs): 0 all eight, 1 and
2 the two halves, 3-6 the pairs 1+3, 2+4, 5+7, 6+8, 7-14 one GPU each (module 1..8). The DGX/HGX H100 table of the
NVIDIA Fabric Manager User Guide ("Shared NVSwitch Virtualization Model", default partitions; the guide's change
log: "Updated Shared NVSwitch 2 GPU partitions for DGX H100 and HGX H100"), as koordinator-sh/koordinator also
encodes it (Go package ``unified``, ``H100PartitionTables``/``H800PartitionTables``). The stand-in uses it for
every 8-GPU profile (H200 and B200 boards: same layout assumed, not confirmed by a public table; A100's pairs may
differ); a table read with :func:`load_table` replaces it."""


@dataclass(frozen=True, slots=True)
class FmGpu:
    """One GPU of the table: ``physical_id`` (module ID), ``uuid``, ``pci_bus_id`` as FM reports them."""

    physical_id: int
    uuid: str
    pci_bus_id: str
    nvlinks: int = 18
    max_nvlinks: int = 18
    line_rate_mbps: int = 0


@dataclass(frozen=True, slots=True)
class FmPartition:
    """One supported partition: ``partition_id`` and its GPUs."""

    partition_id: int
    gpus: tuple[FmGpu, ...]

    @property
    def module_ids(self) -> frozenset[int]:
        return frozenset(g.physical_id for g in self.gpus)


def table_from_profile(profile: dict[str, Any]) -> list[FmPartition]:
    """:data:`HGX8_PARTITIONS` over the GPUs of a mock NVML profile (``gpus[].moduleId``, ``uuid``, ``pciBusId``).

    :raises ValueError: the profile has no GPU with each of module IDs 1-8.
    """
    by_module = {int(g["moduleId"]): g for g in profile.get("gpus", []) if "moduleId" in g}
    missing = sorted(set(range(1, 9)) - set(by_module))
    if missing:
        raise ValueError(f"profile has no GPU with module ID(s) {missing}: not an HGX 8-GPU board")
    links = 12 if any("a100" in str(g.get("model", "")) for g in by_module.values()) else 18
    gpus = {m: FmGpu(m, str(g["uuid"]), str(g["pciBusId"]), links, links) for m, g in by_module.items()}
    return [FmPartition(pid, tuple(gpus[m] for m in mods)) for pid, mods in HGX8_PARTITIONS]


def load_table(path: Path) -> list[FmPartition]:
    """A table from JSON: ``{"partitions": [{"id": 0, "gpus": [{"physicalId": 1, "uuid": "GPU-...", "pciBusId":
    "00000000:18:00.0"}, ...]}, ...]}``.

    :raises ValueError: malformed (names the entry), duplicate IDs, more than ``FM_MAX_FABRIC_PARTITIONS``.
    """
    data = json.loads(path.read_text())
    table: list[FmPartition] = []
    for i, p in enumerate(data.get("partitions", [])):
        try:
            gpus = tuple(FmGpu(int(g["physicalId"]), str(g.get("uuid", f"GPU-mock-{g['physicalId']}")),
                               str(g.get("pciBusId", "")), int(g.get("numNvLinksAvailable", 18)),
                               int(g.get("maxNumNvLinks", 18)), int(g.get("nvlinkLineRateMBps", 0)))
                         for g in p["gpus"])
            table.append(FmPartition(int(p["id"]), gpus))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: partitions[{i}]: {exc!r}") from exc
    if len({p.partition_id for p in table}) != len(table):
        raise ValueError(f"{path}: duplicate partition IDs")
    if len(table) > FM_MAX_FABRIC_PARTITIONS:
        raise ValueError(f"{path}: more than {FM_MAX_FABRIC_PARTITIONS} partitions")
    return table


class FabricManager:
    """The daemon: a threaded Unix-socket server over a partition table and an activation state.

    :param socket_path: where to listen (the parent directory is created).
    :param table: the supported partitions.
    :param state_path: the state file; read at start when present (the active set survives a restart).
    """

    def __init__(self, socket_path: Path, table: list[FmPartition], state_path: Path | None = None) -> None:
        self.socket_path = Path(socket_path)
        self.table = {p.partition_id: p for p in table}
        self.state_path = state_path
        self._lock = threading.Lock()
        self.active: set[int] = set()
        self.busy_gpus: set[int] = set()
        self.initializing = False
        self.faults: dict[str, list[tuple[int | str, int]]] = {}
        self.calls: list[str] = []
        """Every request line answered, in order (tests read it)."""
        if state_path is not None and state_path.exists():
            self.active = {int(i) for i in json.loads(state_path.read_text()).get("active", [])}
        self.hang_s = 10.0
        """How long a :data:`HANG` fault keeps a call unanswered (or until :meth:`stop`)."""
        self._stopping = threading.Event()
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None

    # ---- control -------------------------------------------------------------------------------------------

    def inject(self, operation: str, rc: int | str, count: int = 1) -> None:
        """The next ``count`` calls (-1: every call) of ``operation`` answer ``rc`` (an ``fmReturn_t``, or
        :data:`DROP`: close the connection without answering; :data:`HANG`: answer nothing for :attr:`hang_s`).

        :raises ValueError: unknown operation.
        """
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r} (known: {', '.join(OPERATIONS)})")
        with self._lock:
            self.faults.setdefault(operation, []).append((rc, count))

    def set_gpu_ready(self, module_id: int, ready: bool) -> None:
        """Mark a GPU (by module ID) ready or not for activation (not ready: its partitions answer
        ``FM_ST_GENERIC_ERROR`` on activate)."""
        with self._lock:
            (self.busy_gpus.discard if ready else self.busy_gpus.add)(module_id)

    def set_initializing(self, initializing: bool) -> None:
        """While FM initialises, partition calls answer ``FM_ST_NOT_CONFIGURED``."""
        with self._lock:
            self.initializing = initializing

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> FabricManager:
        """Listen and serve in a background thread; returns ``self``."""
        self._stopping.clear()
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_symlink():
            self.socket_path.unlink()
        manager = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for raw in self.rfile:
                    answer = manager.answer(raw.decode(errors="replace").strip())
                    if answer == HANG:
                        manager._stopping.wait(manager.hang_s)
                        return
                    if answer is None:
                        return
                    self.wfile.write(answer.encode())
                    self.wfile.flush()

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        self._server = Server(str(self.socket_path), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="nv-fabricmanager", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and remove the socket (FM down)."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.socket_path.exists():
            self.socket_path.unlink()

    def __enter__(self) -> FabricManager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- protocol ------------------------------------------------------------------------------------------

    def answer(self, line: str) -> str | None:
        """The answer to one request line (with its trailing newline), or ``None`` to close the connection."""
        with self._lock:
            self.calls.append(line)
            if not line.split():
                return f"{FM_ST_BADPARAM}\n"
            verb, *args = line.split()
            op = {"HELLO": "connect", "LIST": "list", "ACTIVATE": "activate", "DEACTIVATE": "deactivate",
                  "SETACTIVE": "setactive"}.get(verb)
            if op is not None:
                fault = self._take_fault(op)
                if fault == DROP:
                    return None
                if fault == HANG:
                    return HANG
                if fault is not None:
                    return f"{fault}\n" if op != "list" else f"{fault} 0 0\n"
            if verb == "HELLO":
                return "0\n"
            if verb == "FAULT":  # FAULT <operation> <rc|drop> [count]
                rc: int | str = args[1] if args[1] in (DROP, HANG) else int(args[1])
                self.faults.setdefault(args[0], []).append((rc, int(args[2]) if len(args) > 2 else 1))
                return "0\n"
            if verb == "GPUREADY":  # GPUREADY <module> 0|1
                (self.busy_gpus.discard if args[1] == "1" else self.busy_gpus.add)(int(args[0]))
                return "0\n"
            if op is not None and self.initializing:
                return f"{FM_ST_NOT_CONFIGURED}\n" if op != "list" else f"{FM_ST_NOT_CONFIGURED} 0 0\n"
            if verb == "LIST":
                return self._list()
            if verb == "ACTIVATE":
                return f"{self._activate(int(args[0]))}\n"
            if verb == "DEACTIVATE":
                return f"{self._deactivate(int(args[0]))}\n"
            if verb == "SETACTIVE":
                ids = {int(a) for a in args[1:]}
                if any(i not in self.table for i in ids):
                    return f"{FM_ST_BADPARAM}\n"
                self.active = ids
                self._save()
                return "0\n"
            return f"{FM_ST_BADPARAM}\n"

    def _take_fault(self, op: str) -> int | str | None:
        queue = self.faults.get(op)
        if not queue:
            return None
        rc, count = queue[0]
        if count > 0:
            if count == 1:
                queue.pop(0)
            else:
                queue[0] = (rc, count - 1)
        return rc

    def _list(self) -> str:
        lines = [f"0 {len(self.table)} {FM_MAX_FABRIC_PARTITIONS}"]
        for pid in sorted(self.table):
            p = self.table[pid]
            lines.append(f"P {pid} {int(pid in self.active)} {len(p.gpus)}")
            lines.extend(f"G {g.physical_id} {g.uuid or '-'} {g.pci_bus_id or '-'} {g.nvlinks} {g.max_nvlinks} "
                         f"{g.line_rate_mbps}" for g in p.gpus)
        return "\n".join(lines) + "\n"

    def _activate(self, pid: int) -> int:
        partition = self.table.get(pid)
        if partition is None:
            return FM_ST_BADPARAM
        if pid in self.active:
            return FM_ST_IN_USE
        if any(self.table[a].module_ids & partition.module_ids for a in self.active):
            return FM_ST_IN_USE
        if partition.module_ids & self.busy_gpus:
            return FM_ST_GENERIC_ERROR
        self.active.add(pid)
        self._save()
        return FM_ST_SUCCESS

    def _deactivate(self, pid: int) -> int:
        if pid not in self.table:
            return FM_ST_BADPARAM
        if pid not in self.active:
            return FM_ST_UNINITIALIZED
        self.active.discard(pid)
        self._save()
        return FM_ST_SUCCESS

    def _save(self) -> None:
        if self.state_path is None:
            return
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"active": sorted(self.active)}) + "\n")
        os.replace(tmp, self.state_path)


def control(socket_path: Path, line: str, timeout_s: float = 5.0) -> str:
    """Send one line (``FAULT activate -7 1``, ``GPUREADY 3 0``) to a running daemon; returns its answer line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(socket_path))
        sock.sendall(line.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.decode().strip()


def mock_library_path() -> Path:
    """The mock ``libnvfm.so.1`` built from ``ext/mocknvfm`` (``dradriver/host/_mock/libnvfm.so.1``)."""
    import dradriver.host

    return Path(dradriver.host.__file__).parent / "_mock" / "libnvfm.so.1"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nv-fabricmanager", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="mock NVML profile name or JSON file (its GPUs' module IDs)")
    source.add_argument("--table", type=Path, help="partition table JSON file")
    parser.add_argument("--state", type=Path)
    args = parser.parse_args(argv)
    if args.table is not None:
        table = load_table(args.table)
    else:
        path = Path(args.profile)
        if not path.exists():
            path = Path(__file__).resolve().parents[2] / "nvml" / "profiles" / f"{args.profile}.json"
        table = table_from_profile(json.loads(path.read_text()))
    done = threading.Event()  # handlers first: a SIGTERM right after the socket appears still stops it cleanly
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    manager = FabricManager(args.socket, table, args.state).start()
    done.wait()
    manager.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
