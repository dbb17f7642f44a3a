"""Emulated IMEX nodes for the tests: a directory per node with its ``imexd.cfg``, ``nodes.cfg`` and hosts
file, the ``nvidia-imex`` stand-in run on the node's own loopback address, ``nvidia-imex-ctl`` to query it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path

from dradriver.domain import imex
from dradriver.sandbox import standins


def loopback_prefix() -> str:
    """``127.a.b``: a /24 of loopback addresses unlikely to be used by a test running beside this one; ``b`` from
    100 up, above any rack number of an emulated cluster's ``127.<net>.<rack>.<tray>`` (dradriver.sandbox.multinode)."""
    return f"127.{random.randint(100, 250)}.{random.randint(100, 250)}"


def install_tools(bin_dir: Path) -> Path:
    standins.install("nvidia_imex", bin_dir / "nvidia-imex")
    standins.install("nvidia_imex_ctl", bin_dir / "nvidia-imex-ctl")
    return bin_dir


def template() -> str:
    return resources.files("dradriver").joinpath("templates/compute-domain-daemon-config.tmpl.cfg").read_text()


class ImexNode:
    """One emulated node: ``root/<name>/`` holds ``imexd.cfg``, ``nodes.cfg``, ``hosts`` and ``imex.log``."""

    def __init__(self, root: Path, name: str, ip: str, bin_dir: Path) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name, self.ip, self.bin_dir = name, ip, bin_dir
        self.config = self.dir / "imexd.cfg"
        self.nodes = self.dir / "nodes.cfg"
        self.hosts = self.dir / "hosts"
        self.log_path = self.dir / "imex.log"
        self.config.write_text(imex.render_imexd_config(template(), pod_ip=ip, nodes_config=str(self.nodes)))
        self.proc: subprocess.Popen[bytes] | None = None

    def write(self, nodes: Iterable[str], hosts: Mapping[str, str]) -> None:
        self.nodes.write_text("".join(f"{n}\n" for n in nodes))
        self.hosts.write_text("127.0.0.1\tlocalhost\n" + "".join(f"{ip}\t{n}\n" for n, ip in hosts.items()))

    def start(self, **extra_env: str) -> None:
        env = {**os.environ, "DRADRIVER_HOSTS_FILE": str(self.hosts), **extra_env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(self.bin_dir / "nvidia-imex"), "-c", str(self.config)], env=env,
                                         stdout=log, stderr=log)

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR1)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin_dir / "nvidia-imex-ctl"), "-c", str(self.config), *args],
                              capture_output=True, text=True, timeout=20, check=False)

    def state(self) -> str:
        return self.ctl("-q").stdout

    def ready(self) -> bool:
        return self.state() == "READY\n"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {text!r} not logged; log:\n{self.log()}")
            time.sleep(0.02)
