"""IMEX on this node: channel device numbers, the channel count, the fabric-imex-mgmt capability, the per-domain
directories of the compute-domain plugin, and the host-managed IMEX daemon's readiness query.

Facts (NVIDIA's ``cmd/compute-domain-kubelet-plugin/deviceinfo.go``, ``device_state.go``, ``nvlib.go``):

* channel ``N`` is the character device ``/dev/nvidia-caps-imex-channels/channel<N>``, major = the number of the
  ``nvidia-caps-imex-channels`` line of ``/proc/devices`` (exact name match: the ``nvidia-caps`` major is another
  line, dra-driver#304; ``--alt-proc-devices-path`` replaces the file), minor ``N``;
* the channel count is the driver's ``ImexChannelCount`` module parameter, shown as the line
  ``ImexChannelCount: <n>`` of ``/proc/driver/nvidia/params`` (NVIDIA's plugin hard-codes 2048, the default of the
  parameter, with a TODO to read it; dradriver reads it and falls back to 2048, logged, when it cannot);
* the ``fabric-imex-mgmt`` capability is ``/dev/nvidia-caps/nvidia-cap<minor>`` (major of ``nvidia-caps``), minor
  from the ``DeviceFileMinor:`` line of ``/proc/driver/nvidia/capabilities/fabric-imex-mgmt``;
* a daemon claim's domain directory is ``<plugin dir>/domains/<cdUID>/`` holding ``imexd.cfg.tmpl``, a copy of the
  packaged ``compute-domain-daemon-config.tmpl.cfg``, and (dradriver's daemon) its readiness record
  (:class:`~dradriver.domain.imex.DaemonRecord`, :func:`write_readiness` / :func:`read_readiness`) and its
  liveness lock (:func:`hold_daemon_lock` / :func:`daemon_alive`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dradriver.domain.computedomains import DEFAULT_IMEX_CHANNEL_COUNT
from dradriver.domain.imex import LIVENESS_FILE, PROCESS_FILE, READINESS_FILE, DaemonRecord, ImexProcessRecord
from dradriver.errors import DradriverError
from dradriver.host.devicenodes import DeviceNodeInfo

log = logging.getLogger(__name__)

__all__ = [
    "CAPS_DEVICE_NAME",
    "CHANNEL_DEVICE_NAME",
    "TEMPLATE_NAME",
    "ImexError",
    "ImexNodeInfo",
    "daemon_alive",
    "domain_dir",
    "domain_dirs",
    "ensure_domain_dir",
    "hold_daemon_lock",
    "imex_ctl_ready",
    "read_channel_count",
    "read_fabric_imex_mgmt_minor",
    "read_imex_node_info",
    "read_process_record",
    "read_readiness",
    "record_readiness",
    "remove_domain_dir",
    "write_process_record",
    "write_readiness",
]

CHANNEL_DEVICE_NAME = "nvidia-caps-imex-channels"
CAPS_DEVICE_NAME = "nvidia-caps"
TEMPLATE_NAME = "imexd.cfg.tmpl"
PARAMS_KEY = "ImexChannelCount"
FABRIC_IMEX_MGMT_NODE = "/dev/nvidia-caps/nvidia-cap{minor}"


class ImexError(DradriverError):
    """An IMEX fact of this node cannot be read or a domain directory cannot be made; the message names the file."""


@dataclass(frozen=True, slots=True)
class ImexNodeInfo:
    """What the compute-domain plugin reads about IMEX at start.

    :param channel_major: major of the channel devices; ``None`` when ``/proc/devices`` has no such line (the
        driver's IMEX support is not loaded: a channel claim on a node in a clique then fails naming the file).
    :param channel_count: channels ``0 .. channel_count-1``.
    :param count_source: where the count came from (the params line, or why the default was taken).
    :param caps_major: major of ``nvidia-caps`` (the ``fabric-imex-mgmt`` node); ``None`` when absent.
    :param fabric_imex_mgmt_minor: minor of ``fabric-imex-mgmt``; ``None`` when the capability file is absent.
    """

    channel_major: int | None
    channel_count: int
    count_source: str
    caps_major: int | None
    fabric_imex_mgmt_minor: int | None

    @property
    def fabric_imex_mgmt_path(self) -> str:
        """``/dev/nvidia-caps/nvidia-cap<minor>`` (``""`` when the minor is unknown)."""
        minor = self.fabric_imex_mgmt_minor
        return "" if minor is None else FABRIC_IMEX_MGMT_NODE.format(minor=minor)


def read_channel_count(proc_root: Path) -> tuple[int, str]:
    """``(count, source)`` from ``<proc root>/driver/nvidia/params``; ``(2048, reason)`` when the file or its
    ``ImexChannelCount:`` line is absent or unreadable (the reason is logged by the caller)."""
    path = proc_root / "driver" / "nvidia" / "params"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return DEFAULT_IMEX_CHANNEL_COUNT, f"{path} unreadable ({reason}); default {DEFAULT_IMEX_CHANNEL_COUNT}"
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == PARAMS_KEY:
            value = value.strip()
            if value.isdigit() and 0 < int(value) <= DEFAULT_IMEX_CHANNEL_COUNT:
                return int(value), f"{path}: {PARAMS_KEY}: {value}"
            return DEFAULT_IMEX_CHANNEL_COUNT, (f"{path}: {PARAMS_KEY} {value!r} is not a count in 1-2048; default "
                                                f"{DEFAULT_IMEX_CHANNEL_COUNT}")
    return DEFAULT_IMEX_CHANNEL_COUNT, f"{path} has no {PARAMS_KEY} line; default {DEFAULT_IMEX_CHANNEL_COUNT}"


def read_fabric_imex_mgmt_minor(proc_root: Path) -> int | None:
    """The ``DeviceFileMinor:`` of ``<proc root>/driver/nvidia/capabilities/fabric-imex-mgmt``; ``None`` when absent.

    :raises ImexError: the file exists but has no readable ``DeviceFileMinor`` line.
    """
    path = proc_root / "driver" / "nvidia" / "capabilities" / "fabric-imex-mgmt"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ImexError(f"cannot read {path}: {exc}") from exc
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "DeviceFileMinor" and value.strip().isdigit():
            return int(value.strip())
    raise ImexError(f"{path} has no 'DeviceFileMinor: <n>' line")


def read_imex_node_info(proc_root: Path, proc_devices: Path) -> ImexNodeInfo:
    """Every IMEX fact of the node (see :class:`ImexNodeInfo`); the count's source is logged.

    :param proc_devices: ``<proc root>/devices`` or ``--alt-proc-devices-path``.
    :raises ImexError: the fabric-imex-mgmt capability file is malformed.
    """
    majors = DeviceNodeInfo(proc_devices=proc_devices).read_majors()
    count, source = read_channel_count(proc_root)
    if "default" in source:
        log.warning("IMEX channel count %d (%s)", count, source)
    else:
        log.info("IMEX channel count %d (%s)", count, source)
    return ImexNodeInfo(channel_major=majors.get(CHANNEL_DEVICE_NAME), channel_count=count, count_source=source,
                        caps_major=majors.get(CAPS_DEVICE_NAME),
                        fabric_imex_mgmt_minor=read_fabric_imex_mgmt_minor(proc_root))


# -- domain directories ------------------------------------------------------------------------------------------


def domain_dir(plugin_dir: Path, cd_uid: str) -> Path:
    """``<plugin dir>/domains/<cdUID>`` (a path; nothing is read).

    :raises ImexError: ``cd_uid`` is not a plain name (it becomes a directory name).
    """
    if not cd_uid or "/" in cd_uid or cd_uid in (".", "..") or "\0" in cd_uid:
        raise ImexError(f"ComputeDomain UID {cd_uid!r} cannot name a directory")
    return plugin_dir / "domains" / cd_uid


def template_text() -> bytes:
    """The packaged IMEX daemon config template (``dradriver/templates/compute-domain-daemon-config.tmpl.cfg``)."""
    return (resources.files("dradriver") / "templates" / "compute-domain-daemon-config.tmpl.cfg").read_bytes()


def ensure_domain_dir(plugin_dir: Path, cd_uid: str) -> tuple[Path, bool]:
    """Create ``<plugin dir>/domains/<cdUID>/`` (mode 0755) and write ``imexd.cfg.tmpl`` in it (atomically);
    returns the directory and whether it was created now.

    :raises ImexError: the directory or file cannot be written (names the path).
    """
    path = domain_dir(plugin_dir, cd_uid)
    created = not path.is_dir()
    try:
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
        target = path / TEMPLATE_NAME
        temp = path / f".{TEMPLATE_NAME}.tmp"
        temp.write_bytes(template_text())
        os.chmod(temp, 0o644)
        os.replace(temp, target)
    except OSError as exc:
        raise ImexError(f"cannot prepare IMEX domain directory {path}: {exc}") from exc
    return path, created


def write_readiness(directory: Path, record: DaemonRecord) -> None:
    """Replace ``<directory>/daemon-readiness.json`` with ``record`` (:func:`_replace_file`). Not synced: after a
    crash of the node the daemon's next probe writes it again, and a record older than
    :data:`~dradriver.domain.imex.READINESS_MAX_AGE_S` counts for nothing.

    :param directory: the domain directory (``/imexd`` in the daemon's container).
    :raises ImexError: it cannot be written (names the path).
    """
    _replace_file(directory / READINESS_FILE, record.to_json(), "readiness record")


def write_process_record(directory: Path, record: ImexProcessRecord) -> None:
    """Replace ``<directory>/nvidia-imex.json`` (:class:`~dradriver.domain.imex.ImexProcessRecord`) with
    ``record`` (:func:`_replace_file`).

    :raises ImexError: it cannot be written (names the path).
    """
    _replace_file(directory / PROCESS_FILE, record.to_json(), "process record")


def read_process_record(directory: Path) -> ImexProcessRecord | None:
    """The daemon's record of its ``nvidia-imex`` in ``directory``, or ``None`` when there is none or it cannot
    be read or parsed (logged at debug)."""
    path = directory / PROCESS_FILE
    try:
        return ImexProcessRecord.from_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.debug("%s: %s", path, exc)
        return None


def _replace_file(target: Path, data: bytes, what: str) -> None:
    """Replace ``target`` with ``data`` (mode 0644) through a temp file renamed over it: a reader sees the old
    content or the new one, never part of one.

    :raises ImexError: it cannot be written (names ``what`` and the path).
    """
    temp = target.parent / f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        temp.write_bytes(data)
        os.chmod(temp, 0o644)
        os.replace(temp, target)
    except OSError as exc:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass
        raise ImexError(f"cannot write the IMEX daemon's {what} {target}: {exc}") from exc


def record_readiness(directory: Path, *, node_name: str, pod_uid: str, pod_ip: str, ready: bool, detail: str = "",
                     clock: Callable[[], float] = time.time) -> str:
    """Write a daemon's readiness record now (:func:`write_readiness`); returns ``""``, or why it could not be
    written (the caller logs it: a record is advice to the plugin, never a reason for the daemon or its probe to
    fail)."""
    try:
        write_readiness(directory, DaemonRecord(node_name, pod_uid, pod_ip, ready, clock(), detail.strip()))
    except ImexError as exc:
        return str(exc)
    return ""


def read_readiness(directory: Path) -> DaemonRecord | None:
    """The readiness record in ``directory`` (a domain directory), or ``None`` when there is none or it cannot be
    read or parsed (logged at debug: the caller then asks the API, as for a daemon that writes none)."""
    path = directory / READINESS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return None
    try:
        return DaemonRecord.from_json(data)
    except ValueError as exc:
        log.debug("%s: %s", path, exc)
        return None


def hold_daemon_lock(directory: Path) -> int:
    """Take the running daemon's exclusive ``flock`` on ``<directory>/daemon.lock`` (made when missing) and return
    its file descriptor: held until it is closed or the process ends (:data:`~dradriver.domain.imex.LIVENESS_FILE`).
    Waits while a plugin tests the lock (a moment) or while a previous daemon of this directory still runs.

    :raises ImexError: the file cannot be opened or locked (names the path).
    """
    path = directory / LIVENESS_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ImexError(f"cannot open the IMEX daemon's liveness lock {path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        os.close(fd)
        raise ImexError(f"cannot lock the IMEX daemon's liveness lock {path}: {exc}") from exc
    return fd


def daemon_alive(directory: Path) -> bool:
    """Whether a daemon holds the lock of :func:`hold_daemon_lock` in ``directory`` now (a shared lock cannot be
    had); ``False`` when the file is missing or unlocked. Never waits."""
    try:
        fd = os.open(directory / LIVENESS_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        log.debug("cannot test %s: %s", directory / LIVENESS_FILE, exc)
        return False
    finally:
        os.close(fd)  # also drops the shared lock, if it was taken
    return False


def remove_domain_dir(plugin_dir: Path, cd_uid: str) -> bool:
    """Remove a domain directory and what the daemon wrote in it; False when it was already gone.

    :raises ImexError: it could not be removed.
    """
    path = domain_dir(plugin_dir, cd_uid)
    if not path.exists():
        return False
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise ImexError(f"cannot remove IMEX domain directory {path}: {exc}") from exc
    return True


def domain_dirs(plugin_dir: Path) -> list[str]:
    """The CD UIDs that have a domain directory, sorted."""
    try:
        return sorted(p.name for p in (plugin_dir / "domains").iterdir() if p.is_dir())
    except FileNotFoundError:
        return []


# -- host-managed IMEX -------------------------------------------------------------------------------------------


def imex_ctl_ready(binary: Path, socket_path: str, *, timeout_s: float = 10.0) -> tuple[bool, str]:
    """Ask the host's IMEX daemon whether it is ready: ``<binary> -q --u=<socket>``; ready when the output
    contains ``READY`` (NVIDIA's host-managed check, ``cmd/compute-domain-kubelet-plugin/device_state.go``). NVIDIA runs
    it chrooted into the driver root; dradriver runs the driver root's binary itself (no chroot, so it also runs
    unprivileged).

    :returns: ``(ready, what it printed or why it could not run)``.
    """
    try:
        done = subprocess.run((str(binary), "-q", f"--u={socket_path}"), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except FileNotFoundError:
        return False, f"{binary} not found"
    except subprocess.TimeoutExpired:
        return False, f"{binary} -q did not answer within {timeout_s:.0f} s"
    except OSError as exc:
        return False, f"{binary} cannot run: {exc}"
    output = (done.stdout + done.stderr).strip()
    return "READY" in done.stdout, output or f"exit status {done.returncode}, no output"
