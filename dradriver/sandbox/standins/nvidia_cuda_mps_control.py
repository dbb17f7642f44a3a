"""Stand-in for NVIDIA's ``nvidia-cuda-mps-control``, installed into the sandbox's driver root (``usr/bin``).

Standard library only: the sandbox copies this file with a ``#!<python>`` line and runs it as the binary.
It behaves as the real tool does for what the MPS control daemon Deployment uses (CUDA MPS documentation,
"nvidia-cuda-mps-control"):

* ``nvidia-cuda-mps-control -d [-M]`` starts the control daemon in the background and returns: the daemon
  detaches (double fork, new session), creates ``control`` (its socket) and ``control_lock`` in
  ``$CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``), and logs to ``control.log`` in
  ``$CUDA_MPS_LOG_DIRECTORY`` (default ``/var/log/nvidia-mps``). A second ``-d`` while one runs fails with
  "An instance of this daemon is already running". ``-M`` is recorded as multi-user mode. ``-f`` runs it in
  the foreground.
* ``nvidia-cuda-mps-control`` without options is the client: it reads commands from stdin, one per line, sends
  each to the daemon and prints the answer. Without a daemon it fails ("Cannot find MPS control daemon").
* commands: ``set_default_active_thread_percentage <0-100>`` (prints the value as a float),
  ``get_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit <device> <limit>`` (device:
  a UUID or an index into ``CUDA_VISIBLE_DEVICES``; limit like ``1024M`` or ``2G``),
  ``get_default_device_pinned_mem_limit <device>``, ``get_server_list`` (no servers: no client ever connects
  in the sandbox), ``quit`` (the daemon removes its files and exits). Anything else: "Invalid command".

The daemon's state (``CUDA_VISIBLE_DEVICES`` it started with, multi-user, the defaults set) is also written to
``$CUDA_MPS_PIPE_DIRECTORY/.standin-state.json`` after every change, for tests to read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

STATE_FILE = ".standin-state.json"
_LIMIT = re.compile(r"^([0-9]+)([MG])$")


def _dirs() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")
    return pipe, logs


def _log(logs: Path, text: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    with open(logs / "control.log", "a", encoding="utf-8") as out:
        out.write(f"[{stamp}.{int(time.time() * 1000) % 1000:03d} Control {os.getpid()}] {text}\n")


@contextlib.contextmanager
def _in_dir(path: Path) -> Any:
    """Unix socket paths are limited to 108 bytes: bind and connect relative to the pipe directory."""
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


class Daemon:
    def __init__(self, pipe: Path, logs: Path, multi_user: bool) -> None:
        self.pipe, self.logs = pipe, logs
        devices = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        self.state: dict[str, Any] = {"pid": os.getpid(), "visibleDevices": devices, "multiUser": multi_user,
                                      "defaultActiveThreadPercentage": 100.0, "defaultPinnedMemLimits": {}}

    def save(self) -> None:
        temp = self.pipe / (STATE_FILE + ".tmp")
        temp.write_text(json.dumps(self.state, sort_keys=True))
        os.replace(temp, self.pipe / STATE_FILE)

    def device(self, key: str) -> str | None:
        devices = self.state["visibleDevices"]
        if key in devices:
            return key
        if key.isdigit() and int(key) < len(devices):
            return str(devices[int(key)])
        return None

    def handle(self, line: str) -> tuple[str, bool]:
        words = line.split()
        if not words:
            return "", False
        command, args = words[0], words[1:]
        _log(self.logs, f"Accepting connection... {line}")
        if command == "quit":
            return "", True
        if command == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                return f"Invalid value {args[0]}", False
            if not 0 <= value <= 100:
                return f"Invalid value {args[0]}", False
            self.state["defaultActiveThreadPercentage"] = value
            self.save()
            return f"{value:.1f}", False
        if command == "get_default_active_thread_percentage" and not args:
            return f"{self.state['defaultActiveThreadPercentage']:.1f}", False
        if command == "set_default_device_pinned_mem_limit" and len(args) == 2:
            uuid = self.device(args[0])
            if uuid is None:
                return f"Invalid device {args[0]}", False
            if not _LIMIT.match(args[1]):
                return f"Invalid memory limit {args[1]}", False
            self.state["defaultPinnedMemLimits"][uuid] = args[1]
            self.save()
            return "", False
        if command == "get_default_device_pinned_mem_limit" and len(args) == 1:
            uuid = self.device(args[0])
            if uuid is None:
                return f"Invalid device {args[0]}", False
            return str(self.state["defaultPinnedMemLimits"].get(uuid, "0M")), False
        if command == "get_server_list" and not args:
            return "", False
        return f"Invalid command {line}", False

    def serve(self, ready_fd: int | None) -> None:
        with _in_dir(self.pipe):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with contextlib.suppress(FileNotFoundError):
                os.unlink("control")
            server.bind("control")
        server.listen(16)
        (self.pipe / "control_lock").touch()
        self.save()
        _log(self.logs, f"Starting control daemon using socket {self.pipe / 'control'}")
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
        stop = False

        def terminate(_signo: int, _frame: object) -> None:
            nonlocal stop
            stop = True
            server.close()

        signal.signal(signal.SIGTERM, terminate)
        try:
            while not stop:
                try:
                    conn, _ = server.accept()
                except OSError:
                    break
                with conn:
                    data = b""
                    while not data.endswith(b"\n"):
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    answer, stop = self.handle(data.decode(errors="replace").strip())
                    conn.sendall((answer + "\n").encode() if answer else b"")
        finally:
            _log(self.logs, "Exit")
            for name in ("control", "control_lock", STATE_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.pipe / name)


def _running(pipe: Path) -> bool:
    try:
        _send(pipe, "get_server_list")
    except OSError:
        return False
    return True


def _send(pipe: Path, line: str) -> str:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with client, _in_dir(pipe):
        client.connect("control")
        client.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := client.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def _start(pipe: Path, logs: Path, multi_user: bool, foreground: bool) -> int:
    for path in (pipe, logs):
        if not path.is_dir():
            print(f"Cannot access directory {path}: No such file or directory", file=sys.stderr)
            return 1
    if _running(pipe):
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    if foreground:
        Daemon(pipe, logs, multi_user).serve(None)
        return 0
    read_fd, write_fd = os.pipe()
    if os.fork() > 0:
        os.close(write_fd)
        ok = os.read(read_fd, 1)
        os.close(read_fd)
        return 0 if ok == b"1" else 1
    os.close(read_fd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        Daemon(pipe, logs, multi_user).serve(write_fd)
    finally:
        os._exit(0)


def main(argv: list[str]) -> int:
    pipe, logs = _dirs()
    options = set(argv)
    if options - {"-d", "-f", "-M"}:
        print(f"Unknown option {sorted(options - {'-d', '-f', '-M'})[0]}", file=sys.stderr)
        return 1
    if "-d" in options or "-f" in options:
        return _start(pipe, logs, "-M" in options, "-f" in options)
    status = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = _send(pipe, line.strip())
        except OSError:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        if answer.strip():
            print(answer.strip())
        if answer.startswith("Invalid"):
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
