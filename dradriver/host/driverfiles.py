"""The NVIDIA driver's user-space files a GPU container needs, found under a driver root.

What is looked for is what nvidia-container-toolkit mounts in its ``nvml`` mode (nvidia-container-toolkit's
``pkg/nvcdi``; NVIDIA's GPU plugin puts exactly these common edits at spec level of every claim spec,
``cmd/gpu-kubelet-plugin/cdi.go``):

* driver libraries: every ``*.so.<driver version>`` in the directories holding ``libcuda.so.<version>`` and
  in their ``vdpau/`` subdirectory (libcuda, libnvidia-ml, libnvidia-ptxjitcompiler, libnvidia-nvvm,
  libnvidia-gpucomp, libnvidia-allocator, libnvidia-cfg, libnvidia-opencl, libnvidia-encode, libnvcuvid,
  libnvidia-opticalflow, libGLX_nvidia, libEGL_nvidia, libvdpau_nvidia, ...), the legacy
  ``libnvidia-nvvm70.so.*`` and the separately versioned EGL platform libraries (``libnvidia-egl-gbm``,
  ``-wayland``, ``-wayland2``, ``-xcb``, ``-xlib``);
* the symlinks a container's loader needs (``libcuda.so`` -> ``libcuda.so.1``, ``libGLX_indirect.so.0``,
  ``libnvidia-opticalflow.so``, and every SONAME or ``.so`` link the host has for a mounted library);
* binaries ``nvidia-smi``, ``nvidia-debugdump``, ``nvidia-persistenced``, ``nvidia-cuda-mps-control``,
  ``nvidia-cuda-mps-server``, ``nvidia-imex``, ``nvidia-imex-ctl`` and ``nvidia-xconfig`` (first hit on the
  toolkit's ``PATH``);
* IPC endpoints: ``nvidia-persistenced/socket`` and ``nvidia-fabricmanager/socket`` under ``/run`` (then
  ``/var/run``) and the MPS pipe directory ``/tmp/nvidia-mps``;
* GSP firmware ``nvidia/<version>/gsp*.bin`` in the kernel's firmware search path;
* graphics configuration files (glvnd, EGL platform, Vulkan, OpenCL ICD, X.Org) and the X.Org driver
  modules ``nvidia_drv.so`` and ``libglxserver_nvidia.so.<version>``.

Every path is reported as the container sees it ("inside the driver root as seen from ``/``"); symlinks are
followed inside the root, an absolute link target meaning root + target, as a chroot would. Only :mod:`os`
touches files here.

A missing optional file is skipped. A missing ``libcuda.so.<version>`` or ``libnvidia-ml.so.<version>``
means the root is not the driver installation NVML reported, and is an error.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver.domain.cdi import ContainerEdits, Hook, Mount
from dradriver.errors import DradriverError

log = logging.getLogger(__name__)

#: Where nvidia-container-toolkit installs its hook binary on the host (nvidia-container-toolkit's
#: ``cmd/nvidia-cdi-hook``); the plugin's ``--nvidia-cdi-hook-path`` default.
DEFAULT_CDI_HOOK_PATH = "/usr/bin/nvidia-cdi-hook"
#: Library directories searched for ``libcuda.so.<version>``, in order (Debian multiarch, RPM, generic).
LIBRARY_DIRS: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib",
    "/lib",
)
#: The toolkit's executable search path (``/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``).
BINARY_DIRS: tuple[str, ...] = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
BINARIES: tuple[str, ...] = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
    "nvidia-xconfig",
)
#: Sockets looked up under ``/run`` then ``/var/run``.
IPC_SOCKETS: tuple[str, ...] = ("nvidia-persistenced/socket", "nvidia-fabricmanager/socket")
MPS_PIPE_DIR = "/tmp/nvidia-mps"
#: Separately versioned EGL platform libraries (glob patterns on the file name).
GRAPHICS_LIBRARIES: tuple[str, ...] = (
    "libnvidia-egl-gbm.so.*.*",
    "libnvidia-egl-wayland.so.*.*",
    "libnvidia-egl-wayland2.so.*.*",
    "libnvidia-egl-xcb.so.*.*",
    "libnvidia-egl-xlib.so.*.*",
)
LEGACY_NVVM = "libnvidia-nvvm70.so.*"
#: Graphics configuration files: (preferred location, fallback location).
GRAPHICS_CONFIGS: tuple[tuple[str, ...], ...] = (
    ("/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "/etc/glvnd/egl_vendor.d/10_nvidia.json"),
    ("/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
     "/etc/egl/egl_external_platform.d/15_nvidia_gbm.json"),
    ("/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
     "/etc/egl/egl_external_platform.d/10_nvidia_wayland.json"),
    ("/usr/share/egl/egl_external_platform.d/09_nvidia_wayland2.json",
     "/etc/egl/egl_external_platform.d/09_nvidia_wayland2.json"),
    ("/usr/share/egl/egl_external_platform.d/20_nvidia_xcb.json",
     "/etc/egl/egl_external_platform.d/20_nvidia_xcb.json"),
    ("/usr/share/egl/egl_external_platform.d/20_nvidia_xlib.json",
     "/etc/egl/egl_external_platform.d/20_nvidia_xlib.json"),
    ("/usr/share/nvidia/nvoptix.bin",),
    ("/usr/share/X11/xorg.conf.d/10-nvidia.conf",),
    ("/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf",),
    ("/etc/OpenCL/vendors/nvidia.icd",),
    ("/etc/vulkan/icd.d/nvidia_icd.json", "/etc/vulkan/icd.d/nvidia_icd.x86_64.json",
     "/etc/vulkan/icd.d/nvidia_icd.aarch64.json", "/usr/share/vulkan/icd.d/nvidia_icd.json",
     "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json", "/usr/share/vulkan/icd.d/nvidia_icd.aarch64.json"),
    ("/etc/vulkan/icd.d/nvidia_layers.json", "/usr/share/vulkan/icd.d/nvidia_layers.json"),
    ("/etc/vulkan/implicit_layer.d/nvidia_layers.json", "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json"),
)
#: Firmware search path after the ``firmware_class.path`` module parameter (``{release}`` = ``uname -r``).
FIRMWARE_DIRS: tuple[str, ...] = (
    "/lib/firmware/updates/{release}",
    "/lib/firmware/updates",
    "/lib/firmware/{release}",
    "/lib/firmware",
)
_MAX_LINKS = 40
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]*")


class DriverFilesError(DradriverError):
    """The driver root does not hold the driver NVML reported (no ``libcuda.so.<ver>`` or ``libnvidia-ml``)."""


@dataclass(frozen=True, slots=True)
class DriverFile:
    """One file to mount: ``path`` in the container, ``source`` its canonical path in the driver root.

    Both are absolute paths "as seen from ``/`` of the driver root"; they differ only when the file was
    found through a symlink (a binary on ``PATH`` linking elsewhere).
    """

    path: str
    source: str


@dataclass(frozen=True, slots=True)
class DriverFiles:
    """What :func:`discover_driver_files` found; every path relative to the driver root, starting with ``/``.

    :param version: the driver version searched for (``nvmlSystemGetDriverVersion``, e.g. ``"580.105.08"``).
    :param root: the directory searched (the driver root as this process sees it), for messages.
    :param libraries: driver and graphics libraries, sorted.
    :param libcuda_dirs: directories holding ``libcuda.so.<version>`` (``NVIDIA_CTK_LIBCUDA_DIR``).
    :param links: ``(target, link)`` pairs for the ``create-symlinks`` hook, ``link`` absolute.
    :param binaries: executables, in :data:`BINARIES` order.
    :param ipc: sockets and the MPS pipe directory.
    :param firmware: GSP firmware files, sorted.
    :param graphics: configuration files and X.Org modules.
    """

    version: str
    root: str
    libraries: tuple[str, ...] = ()
    libcuda_dirs: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    binaries: tuple[DriverFile, ...] = ()
    ipc: tuple[DriverFile, ...] = ()
    firmware: tuple[str, ...] = ()
    graphics: tuple[DriverFile, ...] = ()

    @property
    def found(self) -> bool:
        """True when the driver's libraries were found (an empty result has no libraries)."""
        return bool(self.libraries)

    @property
    def library_dirs(self) -> tuple[str, ...]:
        """Directories of :attr:`libraries`, each once, in first-seen order (``update-ldcache --folder``)."""
        seen: dict[str, None] = {}
        for lib in self.libraries:
            seen.setdefault(os.path.dirname(lib), None)
        return tuple(seen)

    def count(self) -> int:
        """How many files (libraries, binaries, IPC endpoints, firmware, graphics files) were found."""
        return len(self.libraries) + len(self.binaries) + len(self.ipc) + len(self.firmware) + len(self.graphics)


#: Where NVIDIA's prestart script and plugin look for ``libnvidia-ml.so.1`` under a driver root, in order
#: (NVIDIA's chart, ``templates/kubeletplugin.yaml``, and ``cmd/gpu-kubelet-plugin/nvlib.go``).
NVML_LIBRARY_DIRS: tuple[str, ...] = (
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
)
NVML_LIBRARY = "libnvidia-ml.so.1"


def find_nvml_library(driver_root: Path | str) -> Path | None:
    """``libnvidia-ml.so.1`` under ``driver_root`` (the container's view of the driver root), or ``None``.

    Links are followed inside the root (:func:`resolve_in_root`), so a driver container's absolute links work.

    :returns: the file's path as this process opens it (``<driver_root>/usr/lib/x86_64-linux-gnu/...``).
    """
    return find_driver_library(driver_root, NVML_LIBRARY)


def find_driver_library(driver_root: Path | str, name: str) -> Path | None:
    """The library file ``name`` (``libnvidia-ml.so.1``, ``libnvfm.so.1``) in the first of
    :data:`NVML_LIBRARY_DIRS` under ``driver_root`` that has it, links followed inside the root; ``None`` when
    absent."""
    base = os.fspath(driver_root)
    for directory in NVML_LIBRARY_DIRS:
        resolved = resolve_in_root(base, f"{directory}/{name}")
        if resolved is not None and _is_file(base, resolved):
            return Path(_host(base, resolved))
    return None


# ---------------------------------------------------------------------------------------------------------
# Paths inside a root


def resolve_in_root(root: Path | str, path: str) -> str | None:
    """Canonical form of ``path`` inside ``root``, following symlinks as a chroot to ``root`` would.

    An absolute link target restarts at ``root``; ``..`` never climbs above it.

    :returns: an absolute path as seen from ``root`` (``"/usr/lib64/libcuda.so.1"``), or ``None`` when a
        component is missing, unreadable, or the links loop (more than 40).
    """
    base = os.fspath(root)
    pending = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        host = os.path.join(base, *done, part)
        try:
            st = os.lstat(host)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return None
            try:
                target = os.readlink(host)
            except OSError:
                return None
            if target.startswith("/"):
                done = []
            pending = [p for p in target.split("/") if p] + pending
            continue
        done.append(part)
    return "/" + "/".join(done)


def _host(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _is_file(root: str, path: str) -> bool:
    try:
        return not stat.S_ISDIR(os.stat(_host(root, path)).st_mode)
    except OSError:
        return False


def _is_dir(root: str, path: str) -> bool:
    return os.path.isdir(_host(root, path))


def _list(root: str, directory: str) -> list[str]:
    try:
        return sorted(os.listdir(_host(root, directory)))
    except OSError:
        return []


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _canonical_dirs(root: str, dirs: Sequence[str]) -> list[str]:
    out: list[str] = []
    for d in dirs:
        canonical = resolve_in_root(root, d)
        if canonical is not None and _is_dir(root, canonical) and canonical not in out:
            out.append(canonical)
    return out


def _find(root: str, directory: str, pattern: str) -> list[str]:
    """Canonical paths of files in ``directory`` whose names match the glob ``pattern``, sorted by name."""
    out: list[str] = []
    for name in _list(root, directory):
        if fnmatch.fnmatchcase(name, pattern):
            canonical = resolve_in_root(root, f"{directory.rstrip('/')}/{name}")
            if canonical is not None and _is_file(root, canonical):
                out.append(canonical)
    return out


def _first(root: str, candidates: Iterable[str]) -> DriverFile | None:
    for candidate in candidates:
        canonical = resolve_in_root(root, candidate)
        if canonical is not None and os.path.exists(_host(root, canonical)):
            return DriverFile(candidate, canonical)
    return None


# ---------------------------------------------------------------------------------------------------------
# Discovery


def _library_stem(name: str) -> str:
    return name.split(".so", 1)[0]


def _links(root: str, version: str, libcuda_dirs: Sequence[str], libraries: Sequence[str]) -> list[tuple[str, str]]:
    """The ``create-symlinks`` pairs (nvidia-container-toolkit's ``cmd/nvidia-cdi-hook``), explicit ones first, then the
    host's own links."""
    pairs: list[tuple[str, str]] = []
    for d in libcuda_dirs:
        pairs.append(("libcuda.so.1", f"{d}/libcuda.so"))
        if f"{d}/libGLX_nvidia.so.{version}" in libraries:
            pairs.append((f"libGLX_nvidia.so.{version}", f"{d}/libGLX_indirect.so.0"))
        if f"{d}/libnvidia-opticalflow.so.{version}" in libraries:
            pairs.append(("libnvidia-opticalflow.so.1", f"{d}/libnvidia-opticalflow.so"))
    by_dir: dict[str, set[str]] = {}
    for lib in libraries:
        by_dir.setdefault(os.path.dirname(lib), set()).add(lib)
    for d, libs in by_dir.items():
        for name in _list(root, d):
            link = f"{d}/{name}"
            if link in libs or not os.path.islink(_host(root, link)):
                continue
            resolved = resolve_in_root(root, link)
            if resolved not in libs:
                continue
            lib_name = os.path.basename(resolved)
            if not re.fullmatch(re.escape(_library_stem(lib_name)) + r"\.so(\.[0-9]+)*", name):
                continue  # only SONAME (lib.so.N) and development (lib.so) links
            raw = os.readlink(_host(root, link))
            target = raw if "/" not in raw else lib_name
            pairs.append((target, link))
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for target, link in pairs:
        if link not in seen:
            seen.add(link)
            out.append((target, link))
    return out


def _firmware(root: str, version: str, kernel_release: str, firmware_path: str) -> list[str]:
    dirs = [firmware_path] if firmware_path else []
    dirs += [d.format(release=kernel_release) for d in FIRMWARE_DIRS]
    found: list[str] = []
    for d in _canonical_dirs(root, dirs):
        for path in _find(root, f"{d}/nvidia/{version}", "gsp*.bin"):
            if path not in found:
                found.append(path)
    return sorted(found)


def _xorg_modules(root: str, version: str, dirs: Sequence[str]) -> list[DriverFile]:
    out: list[DriverFile] = []
    for d in dirs:
        for rel in ("xorg/modules/drivers/nvidia_drv.so", f"xorg/modules/extensions/libglxserver_nvidia.so.{version}"):
            hit = _first(root, (f"{d}/{rel}",))
            if hit is not None and hit.source not in {f.source for f in out}:
                out.append(hit)
    return out


def discover_driver_files(
    root: Path | str,
    version: str,
    *,
    library_dirs: Sequence[str] = LIBRARY_DIRS,
    kernel_release: str | None = None,
    firmware_path: str = "",
    require: bool = True,
) -> DriverFiles:
    """Find the driver's user-space files for ``version`` under ``root`` (nvidia-container-toolkit's ``pkg/nvcdi``).

    :param root: the driver root as this process sees it (``--container-driver-root``, e.g. ``/driver-root``).
    :param version: the driver version NVML reports (``DriverVersions.driver``), e.g. ``"580.105.08"``.
    :param library_dirs: where to look for ``libcuda.so.<version>``; defaults to :data:`LIBRARY_DIRS`.
    :param kernel_release: ``uname -r`` for the firmware search path; defaults to this kernel's.
    :param firmware_path: the ``firmware_class.path`` module parameter (searched first when not empty).
    :param require: when False, a root without ``libcuda.so.<version>`` gives an empty result instead of an
        error (mock NVML nodes have no driver files).
    :raises DriverFilesError: ``libcuda.so.<version>`` or ``libnvidia-ml.so.<version>`` is missing (and
        ``require``), or ``version`` is not a version string.
    """
    base = os.fspath(root)
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise DriverFilesError(f"driver version {version!r} from NVML is not usable to find the driver's files")
    dirs = _canonical_dirs(base, library_dirs)
    libcuda_dirs = [d for d in dirs if _is_file(base, f"{d}/libcuda.so.{version}")]
    if not libcuda_dirs:
        if not require:
            return DriverFiles(version=version, root=base)
        raise DriverFilesError(
            f"libcuda.so.{version} not found under driver root {base} (searched {', '.join(library_dirs)}): "
            f"--container-driver-root (DRIVER_ROOT_CTR_PATH) must be where the host's --nvidia-driver-root "
            f"(NVIDIA_DRIVER_ROOT) is mounted, and that root must hold driver {version}"
        )
    libraries: list[str] = []
    for d in libcuda_dirs:
        for sub in (d, f"{d}/vdpau"):
            libraries += _find(base, sub, f"*.so.{version}")
        libraries += _find(base, d, LEGACY_NVVM)
        for pattern in GRAPHICS_LIBRARIES:
            libraries += _find(base, d, pattern)
    libraries = sorted(_unique(libraries))
    if not any(os.path.basename(lib) == f"libnvidia-ml.so.{version}" for lib in libraries):
        raise DriverFilesError(
            f"libnvidia-ml.so.{version} not found next to libcuda.so.{version} in {', '.join(libcuda_dirs)} "
            f"under driver root {base}: the driver installation is incomplete or of another version"
        )
    binaries = [
        hit for hit in (_first(base, (f"{d}/{name}" for d in BINARY_DIRS)) for name in BINARIES) if hit is not None
    ]
    ipc = [hit for hit in (_first(base, (f"/run/{s}", f"/var/run/{s}")) for s in IPC_SOCKETS) if hit is not None]
    mps = resolve_in_root(base, MPS_PIPE_DIR)
    if mps is not None and _is_dir(base, mps):
        ipc.append(DriverFile(MPS_PIPE_DIR, mps))
    graphics = [hit for hit in (_first(base, candidates) for candidates in GRAPHICS_CONFIGS) if hit is not None]
    graphics += _xorg_modules(base, version, _unique(dirs + _canonical_dirs(base, ("/usr/lib", "/usr/lib64"))))
    release = kernel_release if kernel_release is not None else os.uname().release
    return DriverFiles(
        version=version,
        root=base,
        libraries=tuple(libraries),
        libcuda_dirs=tuple(libcuda_dirs),
        links=tuple(_links(base, version, libcuda_dirs, libraries)),
        binaries=tuple(binaries),
        ipc=tuple(ipc),
        firmware=tuple(_firmware(base, version, release, firmware_path)),
        graphics=tuple(graphics),
    )


def read_firmware_path(sysfs_root: Path | str) -> str:
    """The ``firmware_class.path`` module parameter (``<sysfs>/module/firmware_class/parameters/path``).

    :returns: the configured directory, or ``""`` when unset or unreadable.
    """
    try:
        with open(os.path.join(os.fspath(sysfs_root), "module/firmware_class/parameters/path"),
                  encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------
# As CDI edits

#: Options of library, binary, firmware and configuration mounts (toolkit ``discover.Mounts``).
READ_ONLY_MOUNT_OPTIONS: tuple[str, ...] = ("ro", "nosuid", "nodev", "rbind", "rprivate")
#: Options of IPC mounts: sockets and the MPS pipe directory (nvidia-container-toolkit's ``pkg/nvcdi`` (nvml mode)).
IPC_MOUNT_OPTIONS: tuple[str, ...] = ("nosuid", "nodev", "rbind", "rprivate", "noexec")
#: Environment of every toolkit hook (nvidia-container-toolkit's ``pkg/nvcdi`` (nvml mode)).
HOOK_ENV: tuple[str, ...] = ("NVIDIA_CTK_DEBUG=false",)
LIBCUDA_DIR_ENV = "NVIDIA_CTK_LIBCUDA_DIR"


def cdi_hook(hook_path: str, subcommand: str, *args: str) -> Hook:
    """A ``createContainer`` hook running ``nvidia-cdi-hook <subcommand> <args>`` (nvidia-container-toolkit's
    ``cmd/nvidia-cdi-hook``).

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
    """Spec-level edits that give a container the driver's user space: toolkit ``nvml`` mode (nvidia-container-toolkit's
    ``pkg/nvcdi`` and ``cmd/nvidia-cdi-hook``; NVIDIA's GPU plugin, ``cmd/gpu-kubelet-plugin/cdi.go``).

    * mounts of :class:`DriverFiles` (libraries, binaries, firmware, graphics files with
      :data:`READ_ONLY_MOUNT_OPTIONS`; IPC endpoints with :data:`IPC_MOUNT_OPTIONS`), sorted by path depth then
      path; ``containerPath`` is the path inside the driver root, ``hostPath`` is ``host_root`` + the file's
      canonical path there (the toolkit's root transform);
    * hooks in the toolkit's order: ``create-symlinks`` (``--link target::link``), ``enable-cuda-compat
      --host-driver-version=<ver>``, ``update-ldcache --folder <dir>``..., ``disable-device-node-modification``;
    * env ``NVIDIA_CTK_LIBCUDA_DIR=<dirs holding libcuda, ':'-joined>``.

    Hooks do not change the minimum ``cdiVersion`` (the CDI library's ``specs-go/version.go``).

    :param files: what :func:`dradriver.host.driverfiles.discover_driver_files` found.
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


# ---------------------------------------------------------------------------------------------------------
# Found again when the driver root changes under the same version


DirectoryStamp = tuple[int, int, int]
"""``(st_dev, st_ino, st_mtime_ns)`` of a directory (:func:`directory_stamp`)."""


def directory_stamp(path: str) -> DirectoryStamp | None:
    """What tells a directory apart from another one at the same path, and from itself before an entry was added,
    removed or renamed in it: its device and inode (another mount, or a directory moved into place) and its
    modification time (POSIX: an entry's creation, removal or rename updates its directory's ``st_mtime``).
    One ``stat(2)``; ``None`` when it cannot be stat'ed. A file rewritten in place keeps its directory's stamp; a
    mount names it by path, so a container created afterwards gets the new content anyway."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def libcuda_directory(root: Path | str, version: str, library_dirs: Sequence[str] = LIBRARY_DIRS) -> str | None:
    """The first directory holding ``libcuda.so.<version>`` under ``root``, as this process opens it (the one
    :func:`discover_driver_files` finds first, next to ``libnvidia-ml.so.<version>``); ``None`` when none does."""
    base = os.fspath(root)
    for directory in _canonical_dirs(base, library_dirs):
        if _is_file(base, f"{directory}/libcuda.so.{version}"):
            return _host(base, directory)
    return None


class DriverRootEdits:
    """The spec-level edits of the driver's user space (:func:`driver_edits`), found again when the driver
    root's files change under the same driver version (a driver container replaced by a rebuilt one; NVIDIA's
    plugin builds its CDI specs from the driver root the same way: kubernetes-sigs/dra-driver-nvidia-gpu
    ``cmd/gpu-kubelet-plugin/cdi.go``).

    The driver root is watched through the directory holding ``libcuda.so.<version>`` (:func:`libcuda_directory`),
    by its :func:`directory_stamp`: a driver container replaced by another is another mount (another device and
    inode), and libraries added, removed or replaced by a rename change the directory's modification time.
    :meth:`current` costs that one ``stat`` while nothing changed; when the stamp differs the files are found
    again (the directory's stamp taken before the search, so a change during it is seen by the next call).
    Without driver files (no libcuda there, the mock NVML's nodes) nothing is stat'ed. Shared by worker threads.

    :param root: the driver root as this process sees it (``--container-driver-root``).
    :param find: finds the files of a driver version and builds their edits; raises
        :class:`DriverFilesError` when the root does not hold that driver.
    """

    def __init__(self, root: Path | str, find: Callable[[str], ContainerEdits]) -> None:
        self.root = os.fspath(root)
        self._find = find
        self._lock = threading.Lock()
        self._found: tuple[str, str | None, DirectoryStamp | None, ContainerEdits] = ("", None, None, ContainerEdits())
        """``(driver version, watched directory, its stamp when the edits were found, edits)``, replaced whole."""

    @property
    def edits(self) -> ContainerEdits:
        """The edits found last (not checked against the driver root)."""
        return self._found[3]

    def read(self, version: str) -> ContainerEdits:
        """Find the files of driver ``version`` now (at start, or when the driver is back) and watch them.

        :raises DriverFilesError: the driver root does not hold driver ``version``.
        """
        with self._lock:
            return self._read(version)

    def _read(self, version: str) -> ContainerEdits:
        directory = libcuda_directory(self.root, version) if version else None
        stamp = directory_stamp(directory) if directory is not None else None
        edits = self._find(version)
        self._found = (version, directory, stamp, edits)
        return edits

    def current(self) -> tuple[DirectoryStamp | None, ContainerEdits]:
        """The edits of the driver root as it is now, with the stamp they were found at (part of a cache key:
        edits built from these are valid while it is the same).

        :raises DriverFilesError: the driver root changed and no longer holds the driver (the next call tries
            again; the edits found before are kept meanwhile).
        """
        found = self._found
        version, directory, stamp, edits = found
        if directory is None or directory_stamp(directory) == stamp:
            return stamp, edits
        with self._lock:
            if self._found is found:  # not found again by another thread meanwhile
                log.info("the driver root %s changed under NVIDIA driver %s (%s is another directory now, or its "
                         "files changed): finding the driver's files again", self.root, version, directory)
                self._read(version)
            return self._found[2], self._found[3]
