"""``nvidia-cdi-hook``, the binary the hooks of claim CDI specs run: shipped in the image, copied to the host, checked.

The container runtime runs every ``createContainer`` hook of a CDI spec by its host path when it creates a claim's
container (``create-symlinks``, ``enable-cuda-compat``, ``update-ldcache``, ``disable-device-node-modification``:
:func:`dradriver.host.driverfiles.driver_edits`). A hook path that does not exist on the host is no error when the
spec is written, only when the container is created: the pod fails with an OCI runtime error
(nvidia-container-toolkit's ``cmd/nvidia-cdi-hook``; CDI spec, "hooks").

NVIDIA's GPU plugin (``--nvidia-cdi-hook-path``, ``NVIDIA_CDI_HOOK_PATH``, kubernetes-sigs/dra-driver-nvidia-gpu
``cmd/gpu-kubelet-plugin/main.go``): when no path is set it copies the ``/usr/bin/nvidia-cdi-hook`` of its image
(taken from NVIDIA's container-toolkit image, Apache-2.0) to ``<plugin dir>/nvidia-cdi-hook`` (0755) and specs
name that host path, so claims work on nodes without the container toolkit; when a path is set, specs name it.
dradriver does the same (:func:`install`) and, beyond NVIDIA, checks that the path specs name exists
(:class:`CdiHook`): the plugin is not ready and refuses prepares with the reason while it does not, because a
prepared claim would give a container that cannot start.

Seeing a host path from inside the plugin's container: the plugin directory is a host path mounted at the same
path (the kubelet's plugins directory), so the copy is checked where it is; a configured path under the host's
driver root (``--nvidia-driver-root``, ``/`` for a host install) is checked under the container's driver root
(``--container-driver-root``); any other configured path cannot be seen and is named in the log as unchecked.
"""

from __future__ import annotations

import filecmp
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: The copy's name in the plugin directory (NVIDIA's).
HOOK_NAME = "nvidia-cdi-hook"
#: Seconds a found hook is trusted before the next look (the readiness probe and each prepare ask).
RECHECK_S = 5.0


class CdiHookError(OSError):
    """The image's hook cannot be copied into the plugin directory (its message names both paths)."""


def install(source: Path, plugin_dir: Path) -> Path:
    """Copy ``source`` to ``<plugin_dir>/nvidia-cdi-hook`` as NVIDIA's plugin does: mode 0755, atomically (a
    temporary file in the plugin directory, then ``rename``: a container created meanwhile runs the old copy or
    the new one, never half a file); nothing is written when the copy already has the same bytes and mode.

    :returns: the copy's path (the host path specs name: the plugin directory is mounted at its host path).
    :raises CdiHookError: ``source`` is missing or unreadable, or the plugin directory is not writable.
    """
    target = plugin_dir / HOOK_NAME
    try:
        if (target.is_file() and (target.stat().st_mode & 0o777) == 0o755
                and filecmp.cmp(source, target, shallow=False)):
            return target
        fd, tmp = tempfile.mkstemp(prefix=f".{HOOK_NAME}.", dir=plugin_dir)
        try:
            with os.fdopen(fd, "wb") as out, source.open("rb") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                os.fchmod(out.fileno(), 0o755)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise CdiHookError(f"cannot copy the image's nvidia-cdi-hook {source} to {target}: "
                           f"{exc.strerror or exc}") from exc
    log.info("nvidia-cdi-hook copied from %s to %s (0755)", source, target)
    return target


def visible_path(host_path: str, *, plugin_dir: Path, host_driver_root: Path,
                 container_driver_root: Path) -> Path | None:
    """Where the host file ``host_path`` is seen from inside the plugin's container, or ``None`` when no mount
    shows it: under the plugin directory (mounted at its host path) it is itself; under the host's driver root it
    is the same relative path under the container's driver root."""
    path = Path(host_path)
    if path.is_relative_to(plugin_dir):
        return path
    if path.is_relative_to(host_driver_root):
        return container_driver_root / path.relative_to(host_driver_root)
    return None


class CdiHook:
    """The hook binary claim specs name, and whether it is there: the plugin's readiness and its prepares ask
    :meth:`refusal`, which looks again (at most every :data:`RECHECK_S` seconds once found) so a hook that appears
    later is used without a restart, and one that goes away is noticed.

    :param host_path: the host path specs name (``--nvidia-cdi-hook-path``, or the copy in the plugin directory).
    :param visible: where the plugin sees it (:func:`visible_path`); ``None``: it cannot be checked from here
        (logged once, never refused).
    :param source: the image's hook, copied again to ``host_path`` when the copy is missing (``None`` when a path
        is configured).
    :param on_missing: called with the reason each time the hook is found missing after it was there (and at the
        first look): the plugin records a Node Event. Called on the asking thread; it must not block.
    :param clock: monotonic seconds (tests).
    """

    def __init__(self, host_path: str, visible: Path | None, *, source: Path | None = None,
                 on_missing: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host_path = host_path
        self.visible = visible
        self.source = source
        self.on_missing = on_missing
        self.clock = clock
        self._lock = threading.Lock()
        self._found_at: float | None = None
        self._reason = ""
        self._missing_reported = False
        self._copied = False
        if visible is None:
            log.warning("nvidia-cdi-hook %s, which claim CDI specs name, is outside the driver root and the plugin "
                        "directory: the plugin cannot see it and does not check it (a missing hook fails container "
                        "creation)", host_path)

    def refusal(self) -> str:
        """Why claims must not be prepared now: the hook specs name is missing on the host (``""`` when it is
        there or cannot be checked). Cheap while the hook was found less than :data:`RECHECK_S` seconds ago."""
        if self.visible is None:
            return ""
        now = self.clock()
        with self._lock:
            if self._found_at is not None and now - self._found_at < RECHECK_S:
                return ""
            reason = self._look()
            if not reason:
                if self._reason:
                    log.info("nvidia-cdi-hook %s is there now: claims are prepared", self.host_path)
                self._found_at, self._reason, self._missing_reported = now, "", False
                return ""
            self._found_at, self._reason = None, reason
            report = not self._missing_reported
            self._missing_reported = True
        if report:
            log.error("%s; the plugin is not ready and refuses prepares until it is there", reason)
            if self.on_missing is not None:
                self.on_missing(reason)
        return reason

    def _look(self) -> str:
        assert self.visible is not None
        if self.source is not None and (not self._copied or not self.visible.is_file()):
            try:  # the first look refreshes the copy (an older image's); later ones restore a deleted copy
                install(self.source, self.visible.parent)
                self._copied = True
            except CdiHookError as exc:
                return (f"nvidia-cdi-hook {self.host_path}, which claim CDI specs name, is missing ({exc}); without "
                        "it the runtime cannot create the claims' containers: run an image that ships "
                        f"{self.source}, or set NVIDIA_CDI_HOOK_PATH to the host's nvidia-cdi-hook")
        if not self.visible.is_file() or not os.access(self.visible, os.X_OK):
            where = "" if str(self.visible) == self.host_path else f" (seen as {self.visible})"
            return (f"nvidia-cdi-hook {self.host_path}{where}, which claim CDI specs name, is missing or not "
                    "executable on the host; without it the runtime cannot create the claims' containers: install "
                    "the NVIDIA container toolkit there, or leave NVIDIA_CDI_HOOK_PATH empty to use the image's copy")
        return ""
