"""Device-node numbers of NVIDIA devices on this host, and the CDI edits that expose them (reads ``/proc`` and
``/dev``).

Facts (NVIDIA's MIG User Guide, "Device Nodes and Capabilities"; nvidia-container-toolkit's
``internal/info/proc/devices``; NVIDIA's ``cmd/gpu-kubelet-plugin/cdi.go``): the control nodes ``/dev/nvidiactl``
(``nvidia`` major, minor 255), ``/dev/nvidia-uvm`` and ``/dev/nvidia-uvm-tools`` (``nvidia-uvm`` major, minors 0 and 1),
plus ``/dev/nvidia-modeset`` (minor 254) when the host has it; a full GPU gets ``/dev/nvidia<minor>``; a MIG device
gets its parent's node plus the two capability nodes ``/dev/nvidia-caps/nvidia-cap<minor>`` for its
GPU-instance and compute-instance access capabilities.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver.domain.cdi import (
    DEFAULT_CAP_MODE,
    DEFAULT_NODE_MODE,
    VISIBLE_DEVICES_VOID,
    ContainerEdits,
    DeviceNode,
    DeviceNodeError,
)
from dradriver.domain.devices import GpuDevice, MigDevice

NVIDIACTL_MINOR = 255
MODESET_MINOR = 254
UVM_MINOR = 0
UVM_TOOLS_MINOR = 1
EDITS_TTL_S = 300.0
"""How long :class:`EditsCache` reuses computed edits, seconds: NVIDIA's plugin caches its nvcdi common edits and
its per-GPU device specs for 5 minutes (NVIDIA's ``cmd/gpu-kubelet-plugin/cdi.go``)."""


@dataclass(frozen=True, slots=True)
class DeviceNodeInfo:
    """Where device-node numbers come from on this node; tests point every path at fixture files.

    :param dev_root: root under which ``/dev`` nodes are stat'ed (``--dev-root``).
    :param host_root: host path under which the runtime finds ``/dev`` (``/`` normally, the NVIDIA driver
        root when a driver container created the nodes); written as ``hostPath`` when not ``/``.
    :param proc_devices: a ``/proc/devices``-format file (``<major> <name>`` under ``Character devices:``).
    :param mig_minors: ``/proc/driver/nvidia-caps/mig-minors`` (lines ``<capability> <minor>``).
    :param capabilities_dir: ``/proc/driver/nvidia/capabilities`` (files with ``DeviceFileMinor`` and
        ``DeviceFileMode``), preferred over ``mig_minors`` like NVIDIA's driver does.
    """

    dev_root: Path = Path("/")
    host_root: str = "/"
    proc_devices: Path = Path("/proc/devices")
    mig_minors: Path = Path("/proc/driver/nvidia-caps/mig-minors")
    capabilities_dir: Path = Path("/proc/driver/nvidia/capabilities")

    def read_majors(self) -> dict[str, int]:
        """Character-device majors by name from :attr:`proc_devices`; ``{}`` when the file is absent."""
        try:
            text = _read_text(self.proc_devices)
        except FileNotFoundError:
            return {}
        majors: dict[str, int] = {}
        section = ""
        for line in text.splitlines():
            line = line.strip()
            if line.endswith(":"):
                section = line
                continue
            if section != "Character devices:" or not line:
                continue
            number, _, name = line.partition(" ")
            if number.isdigit() and name:
                majors.setdefault(name.strip(), int(number))
        return majors

    def host_path(self, path: str) -> str:
        """``hostPath`` for a container ``path``: ``""`` when the host root is ``/``, else root + path."""
        root = self.host_root.rstrip("/")
        return root + path if root else ""

    def stat_node(self, path: str) -> os.stat_result | None:
        """``stat`` of ``dev_root`` + ``path`` if it is a character device, else ``None``."""
        try:
            st = os.stat(os.path.join(str(self.dev_root), path.lstrip("/")))
        except OSError:
            return None
        return st if stat.S_ISCHR(st.st_mode) else None

    def major(self, majors: Mapping[str, int], names: Sequence[str], node: str) -> int:
        """The major of the first of ``names`` in ``majors``, else the major of the host node ``node``.

        :raises DeviceNodeError: neither source knows it.
        """
        for name in names:
            if name in majors:
                return majors[name]
        st = self.stat_node(node)
        if st is not None:
            return os.major(st.st_rdev)
        raise DeviceNodeError(
            f"no major number for {node}: no {' or '.join(repr(n) for n in names)} line in "
            f"{self.proc_devices} and no character device at {self.dev_root}{node}"
        )

    def mig_cap(self, parent_minor: int, gi: int, ci: int | None) -> tuple[int, int]:
        """``(minor, file mode)`` of the GI (``ci=None``) or CI access capability (NVIDIA's MIG User Guide, "Device
        Nodes and Capabilities").

        Sources in order: ``capabilities_dir/gpu<m>/mig/gi<gi>[/ci<ci>]/access``, the ``mig_minors`` line
        ``gpu<m>/gi<gi>[/ci<ci>]/access <minor>``, then the formula ``3 + 135*gpu + 9*gi`` (GI) and
        ``4 + 135*gpu + 9*gi + ci`` (CI), valid for 32 GPUs x 15 GIs x 8 CIs.

        :raises DeviceNodeError: outside the formula's range and in no file.
        """
        rel = f"gpu{parent_minor}/mig/gi{gi}" + (f"/ci{ci}" if ci is not None else "") + "/access"
        try:
            fields = _parse_capability(_read_text(self.capabilities_dir / rel))
            if "DeviceFileMinor" in fields:
                return fields["DeviceFileMinor"], fields.get("DeviceFileMode", DEFAULT_CAP_MODE)
        except FileNotFoundError:
            pass
        name = f"gpu{parent_minor}/gi{gi}" + (f"/ci{ci}" if ci is not None else "") + "/access"
        try:
            for line in _read_text(self.mig_minors).splitlines():
                cap, _, number = line.strip().rpartition(" ")
                if cap == name and number.isdigit():
                    return int(number), DEFAULT_CAP_MODE
        except FileNotFoundError:
            pass
        if 0 <= parent_minor < 32 and 0 <= gi < 15 and (ci is None or 0 <= ci < 8):
            formula = 3 + 135 * parent_minor + 9 * gi + (0 if ci is None else 1 + ci)
            return formula, DEFAULT_CAP_MODE
        raise DeviceNodeError(f"no minor number for MIG capability {name}: not in {self.mig_minors}")


class EditsCache:
    """CDI edits computed from ``/proc`` and ``/dev`` (majors, control nodes, a full GPU's node), reused per key
    as NVIDIA's plugin reuses its nvcdi specs, while what they were computed from is unchanged.

    An entry is valid while the text of ``nodes.proc_devices`` (the character-device majors: ``nvidia``,
    ``nvidia-uvm``, ``nvidia-caps``) is the text it was computed with, and for at most :data:`EDITS_TTL_S`
    (the node modes ``stat`` gave). So a one-claim prepare reads ``/proc/devices`` (one small read of procfs)
    but stats no control node; once a driver module is unloaded or reloaded (``nvidia-uvm`` gone from
    ``/proc/devices``, or a new major) the edits are computed again, and fail as they would on a fresh node,
    instead of handing containers nodes that no longer exist. The caller's key carries the other sources (a
    GPU's UUID and minor; for the spec-level edits the driver version and the driver root's stamp,
    :meth:`dradriver.host.driverfiles.DriverRootEdits.current`). What fails to compute is not kept (the
    next claim tries again). Shared by worker threads: two that miss at once both compute, and either answer is
    kept (they are equal).

    :param nodes: where the majors are read; ``None``: entries are checked against nothing but their age.
    :param ttl_s: seconds an entry is reused at most.
    :param clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, nodes: DeviceNodeInfo | None = None, *, ttl_s: float = EDITS_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = nodes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[Hashable, tuple[float, str, ContainerEdits]] = {}

    def _basis(self) -> str:
        """What the entries depend on beside their key: the text of ``/proc/devices`` (``""`` when absent)."""
        if self.nodes is None:
            return ""
        try:
            return _read_text(self.nodes.proc_devices)
        except FileNotFoundError:
            return ""

    def get(self, key: Hashable, make: Callable[[], ContainerEdits]) -> ContainerEdits:
        """The edits kept for ``key`` while fresh and computed from today's majors, else ``make()`` (kept from
        now on with today's majors).

        :raises DeviceNodeError: what ``make`` raises.
        """
        now = self._clock()
        basis = self._basis()
        hit = self._entries.get(key)
        if hit is not None and now < hit[0] and hit[1] == basis:
            return hit[2]
        edits = make()
        self._entries[key] = (now + self.ttl_s, basis, edits)
        return edits

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()


FileIdentity = tuple[int, int, int]
"""``(st_dev, st_ino, st_rdev)`` of a file: which file it is (a file made again at the same path has another
inode) and, for a device node, which device it opens. The ctime is left out: a ``chmod`` changes it."""


def read_identities(paths: Sequence[Path]) -> dict[str, FileIdentity]:
    """The :data:`FileIdentity` of each of ``paths`` that exists now (any file type, symlinks followed), by path.

    Used to notice a reloaded NVIDIA kernel module whose character-device major stayed the same: loading it
    again re-creates ``/dev/nvidiactl`` (``nvidia-modprobe``, or the driver container's ``nvidia-smi``) and
    ``/sys/module/nvidia`` (the kernel makes a new ``/sys/module/<name>`` directory at each load of a module,
    kernel ``Documentation/ABI/testing/sysfs-module``, and kernfs numbers inodes cyclically, so it gets another).
    """
    out: dict[str, FileIdentity] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        out[str(path)] = (st.st_dev, st.st_ino, st.st_rdev)
    return out


def _read_text(path: Path) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _parse_capability(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if value.isdigit():
            out[key.strip()] = int(value)
    return out


def _char_node(info: DeviceNodeInfo, path: str, major: int, minor: int, default_mode: int) -> DeviceNode:
    st = info.stat_node(path)
    mode = stat.S_IMODE(st.st_mode) if st is not None else default_mode
    return DeviceNode(path, info.host_path(path), "c", major, minor, mode, "rwm")


def control_edits(info: DeviceNodeInfo, majors: Mapping[str, int]) -> ContainerEdits:
    """Spec-level edits: ``NVIDIA_VISIBLE_DEVICES=void`` and the control nodes (nvidia-container-toolkit's
    ``internal/info/proc/devices``).

    :raises DeviceNodeError: the ``nvidia`` or ``nvidia-uvm`` major is unknown.
    """
    nvidia = info.major(majors, ("nvidia", "nvidia-frontend", "nvidiactl"), "/dev/nvidiactl")
    uvm = info.major(majors, ("nvidia-uvm",), "/dev/nvidia-uvm")
    nodes = [
        _char_node(info, "/dev/nvidiactl", nvidia, NVIDIACTL_MINOR, DEFAULT_NODE_MODE),
        _char_node(info, "/dev/nvidia-uvm", uvm, UVM_MINOR, DEFAULT_NODE_MODE),
        _char_node(info, "/dev/nvidia-uvm-tools", uvm, UVM_TOOLS_MINOR, DEFAULT_NODE_MODE),
    ]
    if info.stat_node("/dev/nvidia-modeset") is not None:
        nodes.append(_char_node(info, "/dev/nvidia-modeset", nvidia, MODESET_MINOR, DEFAULT_NODE_MODE))
    return ContainerEdits(env=(VISIBLE_DEVICES_VOID,), device_nodes=tuple(nodes))


def device_edits(device: GpuDevice | MigDevice, info: DeviceNodeInfo, majors: Mapping[str, int]) -> ContainerEdits:
    """Per-device edits: ``/dev/nvidia<minor>``; for MIG the parent's node plus the GI and CI capability
    nodes (NVIDIA's ``cmd/gpu-kubelet-plugin/cdi.go``).

    :raises DeviceNodeError: a major or capability minor cannot be found.
    """
    gpu = device.parent if isinstance(device, MigDevice) else device
    nvidia = info.major(majors, ("nvidia", "nvidia-frontend"), f"/dev/nvidia{gpu.minor}")
    nodes = [_char_node(info, f"/dev/nvidia{gpu.minor}", nvidia, gpu.minor, DEFAULT_NODE_MODE)]
    if isinstance(device, MigDevice):
        for ci in (None, device.ci_id):
            minor, mode = info.mig_cap(gpu.minor, device.gi_id, ci)
            path = f"/dev/nvidia-caps/nvidia-cap{minor}"
            caps = info.major(majors, ("nvidia-caps",), path)
            nodes.append(DeviceNode(path, info.host_path(path), "c", caps, minor, mode))
    return ContainerEdits(device_nodes=tuple(nodes))


def mig_instance_edits(info: DeviceNodeInfo, majors: Mapping[str, int], parent_minor: int, gi_id: int,
                       ci_id: int) -> ContainerEdits:
    """Edits of a MIG device known by its parent minor and GI/CI ids (dynamic MIG, from the undo record alone):
    ``/dev/nvidia<parent minor>`` plus the GI and CI access capability nodes (NVIDIA's
    ``cmd/gpu-kubelet-plugin/cdi.go``, NVIDIA's MIG User Guide, "Device Nodes and Capabilities"), exactly what
    :func:`device_edits` gives an existing MIG device.

    :raises DeviceNodeError: a major or capability minor cannot be found.
    """
    nvidia = info.major(majors, ("nvidia", "nvidia-frontend"), f"/dev/nvidia{parent_minor}")
    nodes = [_char_node(info, f"/dev/nvidia{parent_minor}", nvidia, parent_minor, DEFAULT_NODE_MODE)]
    for ci in (None, ci_id):
        minor, mode = info.mig_cap(parent_minor, gi_id, ci)
        path = f"/dev/nvidia-caps/nvidia-cap{minor}"
        caps = info.major(majors, ("nvidia-caps",), path)
        nodes.append(DeviceNode(path, info.host_path(path), "c", caps, minor, mode))
    return ContainerEdits(device_nodes=tuple(nodes))
