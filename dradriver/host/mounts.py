"""Mounting and unmounting tmpfs on the node, through ``mount(8)`` and ``umount(8)``.

The MPS control daemon's ``shm`` directory is a tmpfs (NVIDIA's ``cmd/gpu-kubelet-plugin/sharing.go``). The
plugin runs the system's ``mount``/``umount`` (its container is privileged, with the plugins directory mounted
``Bidirectional`` so the mount reaches the host) and reads whether a path is a mount point from
``/proc/self/mountinfo`` (``proc(5)``). Both commands and the mountinfo file are settable, so the sandbox can
hand the plugin stand-ins that behave like the real commands where a real mount is not permitted
(:mod:`dradriver.sandbox.mounts`).

Unmounting is idempotent, like ``mount-utils``' ``CleanupMountPoint``: a path that is not mounted is done.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from dradriver.errors import DradriverError

MOUNT_TIMEOUT_S = 10.0


class MountError(DradriverError):
    """``mount``/``umount`` failed; the message carries the command's own output."""


def _unescape(field: str) -> str:
    """Octal escapes of ``/proc/self/mountinfo`` (``\\040`` for a space)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str) -> list[str]:
    """The mount points (field 5) of a ``mountinfo`` text, in order."""
    points: list[str] = []
    for line in mountinfo.splitlines():
        parts = line.split()
        if len(parts) >= 5:
            points.append(_unescape(parts[4]))
    return points


@dataclass(frozen=True, slots=True)
class MountCommands:
    """How the plugin mounts: the two commands and the mountinfo file that shows the result.

    :param mount: the ``mount`` executable (name looked up on ``PATH``, or a path).
    :param umount: the ``umount`` executable.
    :param mountinfo: the file listing this mount namespace's mounts.
    """

    mount: str = "mount"
    umount: str = "umount"
    mountinfo: Path = Path("/proc/self/mountinfo")

    def is_mounted(self, target: Path) -> bool:
        """``target`` is a mount point now.

        :raises MountError: the mountinfo file cannot be read.
        """
        try:
            text = self.mountinfo.read_text()
        except OSError as exc:
            raise MountError(f"cannot read {self.mountinfo}: {exc}") from exc
        return str(target) in mount_points(text)

    def mount_tmpfs(self, target: Path, options: str) -> None:
        """``mount -t tmpfs -o <options> tmpfs <target>``; nothing when it is mounted already.

        :raises MountError: the command failed (its stderr in the message) or did not finish in 10 s.
        """
        if self.is_mounted(target):
            return
        self._run((self.mount, "-t", "tmpfs", "-o", options, "tmpfs", str(target)), f"mount tmpfs on {target}")

    def unmount(self, target: Path) -> None:
        """``umount <target>`` if it is mounted (idempotent).

        :raises MountError: the command failed (e.g. ``target is busy``).
        """
        if not self.is_mounted(target):
            return
        self._run((self.umount, str(target)), f"unmount {target}")

    @staticmethod
    def _run(argv: tuple[str, ...], what: str) -> None:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MountError(f"{what}: {exc}") from exc
        if done.returncode != 0:
            output = " ".join((done.stderr or done.stdout).split())
            raise MountError(f"{what}: {argv[0]} exited {done.returncode}: {output}")
