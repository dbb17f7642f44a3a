"""CDI specs for prepared claims of ``gpu.nvidia.com``: content, names, and crash-safe files.

Facts (reference ``cdi.md`` sections 1.4, 2.5, 5.1 and 6; ``nvidia-dra-driver.md`` 5.1; ``gpu-facts.md`` 3.2,
4.3 and 5):

* one transient spec per claim, kind ``k8s.gpu.nvidia.com/claim``, file
  ``<cdiRoot>/k8s.gpu.nvidia.com-claim_<claimUID>.json``;
* one CDI device per prepared device, named ``<claimUID>-<device name>``; the kubelet receives the
  fully-qualified ID ``k8s.gpu.nvidia.com/claim=<claimUID>-<device name>``;
* spec-level edits: env ``NVIDIA_VISIBLE_DEVICES=void`` (keeps the legacy NVIDIA runtime hook from injecting
  devices a second time) and the control nodes ``/dev/nvidiactl`` (``nvidia`` major, minor 255),
  ``/dev/nvidia-uvm`` and ``/dev/nvidia-uvm-tools`` (``nvidia-uvm`` major, minors 0 and 1), plus
  ``/dev/nvidia-modeset`` (minor 254) when the host has it;
* plus, passed in as ``common``, the driver's user space as nvidia-container-toolkit's ``nvml`` mode mounts it
  (libraries, binaries, IPC sockets, GSP firmware, graphics files, ``nvidia-cdi-hook`` hooks and
  ``NVIDIA_CTK_LIBCUDA_DIR``; :func:`driver_edits` over :mod:`dradriver.domain.driverfiles`, ``cdi.md`` 4.6-4.9);
* a full GPU gets ``/dev/nvidia<minor>``; a MIG device gets its parent's node plus the two capability nodes
  ``/dev/nvidia-caps/nvidia-cap<minor>`` for its GPU-instance and compute-instance access capabilities;
* every node is fully specified (``type: c``, major, minor, fileMode) so the runtime can create it even
  where the host node is missing; ``hostPath`` is written only when the host root is not ``/``;
* ``cdiVersion`` is the lowest the content needs (computed by the renderer, ``cdi.md`` 1.4);
* files are written to a temp name without a ``.json`` suffix in the same directory, fsync'd, renamed and
  the directory fsync'd, with mode 0644.

Rendering goes through ``dradriver._native.load("cdispec")`` (the compiled renderer, or its pure-Python
twin under ``DRADRIVER_NO_EXTENSIONS=1``). Only :mod:`os` touches files here.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver import _native
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.driverfiles import DEFAULT_CDI_HOOK_PATH, DriverFiles
from dradriver.errors import DradriverError

VENDOR = "k8s.gpu.nvidia.com"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
#: What NVIDIA's driver sets so the legacy runtime hook injects nothing itself (``cdi.md`` 4.6, 5.1).
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"
SPEC_FILE_MODE = 0o644
#: Mode of ``/dev/nvidia*`` nodes as the driver creates them, used when the host node cannot be stat'ed.
DEFAULT_NODE_MODE = 0o666
#: Mode of MIG access capability nodes (``DeviceFileMode`` 292) when no capability file says otherwise.
DEFAULT_CAP_MODE = 0o444
NVIDIACTL_MINOR = 255
MODESET_MINOR = 254
UVM_MINOR = 0
UVM_TOOLS_MINOR = 1

_UID = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")


class CdiSpecError(DradriverError):
    """A claim's CDI spec cannot be built or written; the message names the claim and the cause."""


class DeviceNodeError(CdiSpecError):
    """A device node's major or minor number cannot be found (``/proc/devices``, mig-minors, stat)."""


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """One CDI ``DeviceNode`` (``cdi.md`` 1.1). ``""``/``0``/``None`` leave a field out of the JSON.

    :param file_mode: permission bits, e.g. ``0o666``.
    """

    path: str
    host_path: str = ""
    type: str = ""
    major: int = 0
    minor: int = 0
    file_mode: int | None = None
    permissions: str = ""
    uid: int | None = None
    gid: int | None = None

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(path, hostPath, type, major, minor, fileMode, permissions, uid, gid)``."""
        return (
            self.path,
            self.host_path,
            self.type,
            self.major,
            self.minor,
            self.file_mode,
            self.permissions,
            self.uid,
            self.gid,
        )


@dataclass(frozen=True, slots=True)
class Mount:
    """One CDI ``Mount``: ``host_path`` into the container at ``container_path``."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str = ""

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(hostPath, containerPath, options, type)``."""
        return (self.host_path, self.container_path, self.options, self.type)


@dataclass(frozen=True, slots=True)
class Hook:
    """One CDI ``Hook``; ``timeout`` in seconds."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(hookName, path, args, env, timeout)``."""
        return (self.hook_name, self.path, self.args, self.env, self.timeout)


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    """CDI ``containerEdits`` (the subset NVIDIA GPU specs use, plus ``additionalGids``)."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    hooks: tuple[Hook, ...] = ()
    mounts: tuple[Mount, ...] = ()
    additional_gids: tuple[int, ...] = ()

    def __add__(self, other: ContainerEdits) -> ContainerEdits:
        return ContainerEdits(
            self.env + other.env,
            self.device_nodes + other.device_nodes,
            self.hooks + other.hooks,
            self.mounts + other.mounts,
            self.additional_gids + other.additional_gids,
        )

    def record(self) -> tuple[object, ...]:
        """The renderer's record ``(env, deviceNodes, netDevices, hooks, mounts, additionalGids)``."""
        return (
            self.env,
            tuple(n.record() for n in self.device_nodes),
            (),
            tuple(h.record() for h in self.hooks),
            tuple(m.record() for m in self.mounts),
            self.additional_gids,
        )


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
        """``(minor, file mode)`` of the GI (``ci=None``) or CI access capability (``gpu-facts.md`` 3.2).

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


# ---------------------------------------------------------------------------------------------------------
# Names


def check_claim_uid(claim_uid: str) -> str:
    """Return ``claim_uid`` if it is safe in file and device names (``[0-9A-Za-z][0-9A-Za-z._-]*``).

    :raises CdiSpecError: otherwise.
    """
    if not isinstance(claim_uid, str) or not _UID.fullmatch(claim_uid):
        raise CdiSpecError(f"claim UID {claim_uid!r} is not usable in CDI names")
    return claim_uid


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    """Unqualified CDI device name ``<claimUID>-<device name>``."""
    return f"{claim_uid}-{device_name}"


def cdi_device_id(claim_uid: str, device_name: str) -> str:
    """Fully-qualified CDI device ID ``k8s.gpu.nvidia.com/claim=<claimUID>-<device name>``."""
    return f"{KIND}={claim_uid}-{device_name}"


def claim_spec_name(claim_uid: str) -> str:
    """Spec file name ``k8s.gpu.nvidia.com-claim_<claimUID>.json`` (``GenerateTransientSpecName``)."""
    return f"{VENDOR}-{CLASS}_{check_claim_uid(claim_uid).replace('/', '_')}.json"


def claim_spec_path(cdi_root: Path | str, claim_uid: str) -> Path:
    """``<cdi_root>/k8s.gpu.nvidia.com-claim_<claimUID>.json``."""
    return Path(cdi_root) / claim_spec_name(claim_uid)


# ---------------------------------------------------------------------------------------------------------
# Content


def _char_node(info: DeviceNodeInfo, path: str, major: int, minor: int, default_mode: int) -> DeviceNode:
    st = info.stat_node(path)
    mode = stat.S_IMODE(st.st_mode) if st is not None else default_mode
    return DeviceNode(path, info.host_path(path), "c", major, minor, mode, "rwm")


def control_edits(info: DeviceNodeInfo, majors: Mapping[str, int]) -> ContainerEdits:
    """Spec-level edits: ``NVIDIA_VISIBLE_DEVICES=void`` and the control nodes (``gpu-facts.md`` 5).

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
    nodes (``cdi.md`` 5.1).

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


#: Options of library, binary, firmware and configuration mounts (toolkit ``discover.Mounts``).
READ_ONLY_MOUNT_OPTIONS: tuple[str, ...] = ("ro", "nosuid", "nodev", "rbind", "rprivate")
#: Options of IPC mounts: sockets and the MPS pipe directory (``cdi.md`` 4.6).
IPC_MOUNT_OPTIONS: tuple[str, ...] = ("nosuid", "nodev", "rbind", "rprivate", "noexec")
#: Environment of every toolkit hook (``cdi.md`` 4.6).
HOOK_ENV: tuple[str, ...] = ("NVIDIA_CTK_DEBUG=false",)
LIBCUDA_DIR_ENV = "NVIDIA_CTK_LIBCUDA_DIR"


def cdi_hook(hook_path: str, subcommand: str, *args: str) -> Hook:
    """A ``createContainer`` hook running ``nvidia-cdi-hook <subcommand> <args>`` (``cdi.md`` 4.7).

    ``args[0]`` is ``nvidia-cdi-hook``, or ``nvidia-ctk hook`` when ``hook_path`` names ``nvidia-ctk``.
    """
    ctk = os.path.basename(hook_path) == "nvidia-ctk"
    argv0: tuple[str, ...] = ("nvidia-ctk", "hook") if ctk else ("nvidia-cdi-hook",)
    return Hook("createContainer", hook_path, (*argv0, subcommand, *args), HOOK_ENV)


def _mount_depth_order(mount: Mount) -> tuple[int, str]:
    return (mount.container_path.rstrip("/").count("/"), mount.container_path)


def driver_edits(
    files: DriverFiles,
    *,
    host_root: str = "/",
    hook_path: str = DEFAULT_CDI_HOOK_PATH,
) -> ContainerEdits:
    """Spec-level edits that give a container the driver's user space: toolkit ``nvml`` mode (``cdi.md`` 4.6,
    4.7, 4.9; NVIDIA's GPU plugin, ``cdi.md`` 5.1).

    * mounts of :class:`DriverFiles` (libraries, binaries, firmware, graphics files with
      :data:`READ_ONLY_MOUNT_OPTIONS`; IPC endpoints with :data:`IPC_MOUNT_OPTIONS`), sorted by path depth then
      path; ``containerPath`` is the path inside the driver root, ``hostPath`` is ``host_root`` + the file's
      canonical path there (the toolkit's root transform);
    * hooks in the toolkit's order: ``create-symlinks`` (``--link target::link``), ``enable-cuda-compat
      --host-driver-version=<ver>``, ``update-ldcache --folder <dir>``..., ``disable-device-node-modification``;
    * env ``NVIDIA_CTK_LIBCUDA_DIR=<dirs holding libcuda, ':'-joined>``.

    Hooks do not change the minimum ``cdiVersion`` (``cdi.md`` 1.4).

    :param files: what :func:`dradriver.domain.driverfiles.discover_driver_files` found.
    :param host_root: the host path of the driver root (``--nvidia-driver-root``), ``/`` for a host install.
    :param hook_path: host path of ``nvidia-cdi-hook`` (``--nvidia-cdi-hook-path``).
    :returns: empty edits when ``files`` holds no libraries (no driver on this node, e.g. mock NVML): hooks
        without libraries would only add a dependency on a hook binary that may be missing.
    """
    if not files.found:
        return ContainerEdits()
    root = host_root.rstrip("/")

    def mount(path: str, source: str, options: tuple[str, ...]) -> Mount:
        return Mount(root + source, path, options)

    mounts = [mount(p, p, READ_ONLY_MOUNT_OPTIONS) for p in files.libraries]
    mounts += [mount(f.path, f.source, READ_ONLY_MOUNT_OPTIONS) for f in files.binaries]
    mounts += [mount(f.path, f.source, IPC_MOUNT_OPTIONS) for f in files.ipc]
    mounts += [mount(p, p, READ_ONLY_MOUNT_OPTIONS) for p in files.firmware]
    mounts += [mount(f.path, f.source, READ_ONLY_MOUNT_OPTIONS) for f in files.graphics]
    mounts.sort(key=_mount_depth_order)
    hooks: list[Hook] = []
    if files.links:
        link_args = [arg for target, link in files.links for arg in ("--link", f"{target}::{link}")]
        hooks.append(cdi_hook(hook_path, "create-symlinks", *link_args))
    hooks.append(cdi_hook(hook_path, "enable-cuda-compat", f"--host-driver-version={files.version}"))
    folders = [arg for d in files.library_dirs for arg in ("--folder", d)]
    hooks.append(cdi_hook(hook_path, "update-ldcache", *folders))
    hooks.append(cdi_hook(hook_path, "disable-device-node-modification"))
    env = (f"{LIBCUDA_DIR_ENV}={':'.join(files.libcuda_dirs)}",)
    return ContainerEdits(env=env, hooks=tuple(hooks), mounts=tuple(mounts))


def render_claim_spec(
    claim_uid: str,
    devices: Iterable[GpuDevice | MigDevice],
    *,
    node_info: DeviceNodeInfo | None = None,
    common: ContainerEdits | None = None,
    extra_edits: Mapping[str, ContainerEdits] | None = None,
) -> bytes:
    """The claim's spec as compact JSON bytes (deterministic for the same inputs and host state).

    :param devices: the prepared devices, in the order the allocation result lists them.
    :param common: edits appended to the spec-level edits (e.g. driver-library mounts and hooks).
    :param extra_edits: per DRA device name, edits appended to that device (e.g. MPS env and mounts).
    :raises CdiSpecError: bad claim UID, duplicate device, unknown device number, or content the CDI rules
        reject; the message names the claim.
    """
    check_claim_uid(claim_uid)
    info = node_info or DeviceNodeInfo()
    extras = extra_edits or {}
    try:
        majors = info.read_majors()
        spec_edits = control_edits(info, majors) + (common or ContainerEdits())
        records = []
        for device in devices:
            edits = device_edits(device, info, majors)
            if device.name in extras:
                edits = edits + extras[device.name]
            records.append((cdi_device_name(claim_uid, device.name), edits.record()))
        renderer = _native.load("cdispec")
        data: bytes = renderer.render_spec(KIND, records, spec_edits.record())
        return data
    except DeviceNodeError as exc:
        raise DeviceNodeError(f"claim {claim_uid}: CDI spec: {exc}") from exc
    except (TypeError, ValueError, OSError) as exc:
        raise CdiSpecError(f"claim {claim_uid}: CDI spec: {exc}") from exc


def render_imex_channel_spec(
    major: int,
    channels: Sequence[int] | range = range(2048),
    *,
    kind: str = "nvidia.com/imex-channel",
    name_prefix: str = "",
    host_root: str = "",
    file_mode: int | None = DEFAULT_NODE_MODE,
) -> bytes:
    """A bulk spec with one device per IMEX channel (``cdi.md`` 4.5 and 5.3; ``gpu-facts.md`` 4.3).

    The defaults give the toolkit's ``nvidia.com/imex-channel`` spec with bare channel numbers as names; the
    compute-domain plugin form is ``kind="k8s.compute-domain.nvidia.com/claim"``,
    ``name_prefix="<claimUID>-channel-"``.

    :param major: the ``nvidia-caps-imex-channels`` line of ``/proc/devices``.
    :raises CdiSpecError: a channel outside ``[0, 2047]``, a duplicate, or an invalid kind or name.
    """
    renderer = _native.load("cdispec")
    try:
        data: bytes = renderer.render_channel_spec(
            kind,
            channels,
            major,
            name_prefix,
            file_mode,
            host_root,
            ((VISIBLE_DEVICES_VOID,), (), (), (), (), ()),
        )
        return data
    except (TypeError, ValueError) as exc:
        raise CdiSpecError(f"IMEX channel spec: {exc}") from exc


# ---------------------------------------------------------------------------------------------------------
# Files


def sync_directory(directory: Path | str) -> None:
    """``fsync`` a directory, making renames and unlinks in it durable.

    :raises OSError: the directory cannot be opened.
    """
    dir_fd = os.open(str(directory), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_file_atomically(path: Path, data: bytes, *, mode: int = SPEC_FILE_MODE, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data`` so readers see the old file or the whole new one, never a part.

    Writes ``.<name>.tmp-<random>`` in the same directory (a name CDI consumers ignore), fsyncs it, renames
    it over ``path`` and fsyncs the directory (``sync_dir=False`` leaves that to the caller, who then calls
    :func:`sync_directory` once for several files). On failure the temp file is removed and ``path`` is
    untouched.

    :raises OSError: the directory is missing or not writable, or the disk is full.
    """
    directory = str(path.parent)
    tmp = os.path.join(directory, f".{path.name}.tmp-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have cleared bits
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if sync_dir:
        sync_directory(directory)


def remove_stale_temp_files(cdi_root: Path | str, claim_uid: str | None = None) -> int:
    """Remove temp files a crashed writer left for this claim's spec (every claim's when ``claim_uid`` is
    ``None``); return how many. Lists the directory: O(files in the CDI root)."""
    prefix = f".{claim_spec_name(claim_uid)}.tmp-" if claim_uid is not None else f".{VENDOR}-{CLASS}_"
    removed = 0
    try:
        names = os.listdir(cdi_root)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(prefix) and ".tmp-" in name:
            try:
                os.unlink(os.path.join(cdi_root, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def write_claim_spec(
    cdi_root: Path | str,
    claim_uid: str,
    devices: Iterable[GpuDevice | MigDevice],
    *,
    node_info: DeviceNodeInfo | None = None,
    common: ContainerEdits | None = None,
    extra_edits: Mapping[str, ContainerEdits] | None = None,
    sync_dir: bool = True,
    clean_temp: bool = True,
) -> Path:
    """Render the claim's spec and write it atomically with mode 0644; return the file's path.

    ``sync_dir=False``: the caller fsyncs the CDI root itself (:func:`sync_directory`) before relying on it.
    ``clean_temp=False``: skip the per-claim temp-file sweep (a directory listing); callers that sweep once at
    start (:func:`remove_stale_temp_files` without a claim UID) keep each write O(1).

    Idempotent: writing again replaces the file. A ``.yaml`` spec for the same claim (as NVIDIA's own plugin
    writes) is removed afterwards, because the same device defined in two files of one directory makes
    consumers drop it (``cdi.md`` 2.6). Temp files a crashed earlier write left behind are removed first.

    :raises CdiSpecError: the content cannot be built, or the file cannot be written.
    """
    data = render_claim_spec(claim_uid, devices, node_info=node_info, common=common, extra_edits=extra_edits)
    path = claim_spec_path(cdi_root, claim_uid)
    try:
        if clean_temp:
            remove_stale_temp_files(cdi_root, claim_uid)
        write_file_atomically(path, data, sync_dir=sync_dir)
        _unlink(path.with_suffix(".yaml"))
    except OSError as exc:
        raise CdiSpecError(f"claim {claim_uid}: cannot write CDI spec {path}: {exc}") from exc
    return path


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def delete_claim_spec(cdi_root: Path | str, claim_uid: str, *, clean_temp: bool = True) -> bool:
    """Remove the claim's spec (and a ``.yaml`` twin or leftover temp files); True if a spec existed.

    A missing file is not an error (unprepare may run twice). ``clean_temp=False`` as for
    :func:`write_claim_spec`.

    :raises CdiSpecError: the file exists but cannot be removed.
    """
    path = claim_spec_path(cdi_root, claim_uid)
    try:
        found = _unlink(path)
        found = _unlink(path.with_suffix(".yaml")) or found
        if clean_temp:
            remove_stale_temp_files(cdi_root, claim_uid)
    except OSError as exc:
        raise CdiSpecError(f"claim {claim_uid}: cannot delete CDI spec {path}: {exc}") from exc
    return found
