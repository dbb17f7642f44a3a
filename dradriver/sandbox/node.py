"""A sandboxed GPU node for tests and ``dradriver demo``: directories, procfs fixtures, API emulator, config.

Everything the kubelet plugin touches on a real node is laid out under one short temporary root (Unix
socket paths are limited to 108 bytes): the kubelet's registrar, plugins and device-plugins directories, a
CDI root, and a ``proc`` tree holding ``devices`` (character-device majors as a driver with ``nvidia``,
``nvidia-uvm``, ``nvidia-caps`` and ``nvidia-caps-imex-channels`` loaded reports them, ``gpu-facts.md`` 5)
and ``sys/kernel/random/boot_id``. The Kubernetes API is the in-process :class:`ApiServerEmulator` with this
node's Node object; NVML is the bundled mock library with a chosen profile.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from dradriver.config import PluginConfig
from dradriver.sandbox.apiserver import ApiServerEmulator

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
"""``/proc/devices`` of a node with the NVIDIA driver loaded (majors seen on real nodes, gpu-facts.md 5)."""


@dataclass
class SandboxNode:
    """One emulated GPU node. Use as a context manager; :meth:`close` removes everything it created.

    :param profile: bundled mock NVML profile (``dradriver mock-profiles``) or a profile file path.
    :param node_name: the Node's name and the ResourceSlice pool name.
    :param api: an API emulator to use; a new one is started (and stopped on close) when ``None``.
    """

    profile: str = "gb200-nvl72-node"
    node_name: str = "gpu-node-1"
    api: ApiServerEmulator | None = None
    node_allocatable: dict[str, str] | None = None
    root: Path = field(init=False)
    _owns_api: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
        for sub in ("registry", "plugins", "device-plugins", "cdi", "proc/sys/kernel/random", "sys", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "proc" / "devices").write_text(PROC_DEVICES)
        self.set_boot_id(str(uuid.uuid4()))
        if self.api is None:
            self.api = ApiServerEmulator().start()
            self._owns_api = True
        self.api.add_node(self.node_name, allocatable=self.node_allocatable)
        self.kubeconfig = self.api.kubeconfig_path(self.root)

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
            dev_root=self.root,
            sysfs_root=self.root / "sys",
            proc_root=self.root / "proc",
            mock_profile=self.profile,
        )
        return replace(base, **overrides)

    @property
    def cdi_root(self) -> Path:
        """Where the plugin writes CDI specs."""
        return self.root / "cdi"

    def cdi_specs(self) -> list[Path]:
        """The CDI spec files present now, sorted."""
        return sorted(p for p in self.cdi_root.iterdir() if p.is_file())

    def close(self) -> None:
        """Stop the API emulator if this sandbox started it and delete the sandbox root."""
        if self._owns_api and self.api is not None:
            self.api.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SandboxNode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
