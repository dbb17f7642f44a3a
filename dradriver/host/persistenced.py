"""NVIDIA's persistence daemon, ``nvidia-persistenced``, as VFIO passthrough meets it: it holds every GPU in
persistence mode open (``/dev/nvidia<minor>``), so a GPU is taken from ``nvidia`` only after persistence mode is
turned off for it, and turned on again once it is back.

Facts (NVIDIA's ``cmd/gpu-kubelet-plugin/vfio-device.go``; NVIDIA's "Driver Persistence" guide,
docs.nvidia.com/deploy/driver-persistence, and the ``nvidia-persistenced(1)`` manual):

* the daemon listens on ``/var/run/nvidia-persistenced/socket`` (``/run`` on current distributions); under the
  GPU Operator it runs in the driver container, whose root the plugin sees at ``--container-driver-root``, so the
  socket is :data:`SOCKET` under that root; NVIDIA's plugin turns persistence off only when that socket exists;
* while it runs, ``nvidia-smi -pm 0|1`` asks the daemon to release or re-open the GPU (without it the tool sets the
  driver's legacy persistence mode, "Enabled Legacy persistence mode for GPU ...").

A path at :data:`SOCKET` that is not a socket (a driver tree copied without the daemon) means the daemon is not
running there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SOCKET = "run/nvidia-persistenced/socket"
"""The daemon's socket, relative to the driver root (NVIDIA's ``cmd/gpu-kubelet-plugin/vfio-device.go``:
``<container driver root>/run/nvidia-persistenced/socket``)."""


def socket_path(driver_root: Path) -> Path:
    """:data:`SOCKET` under ``driver_root``."""
    return driver_root / SOCKET


def daemon_running(driver_root: Path) -> bool:
    """A Unix socket is at :data:`SOCKET` under ``driver_root`` (``--container-driver-root``): the daemon is
    listening there. A missing path or one of another type is False."""
    try:
        return stat.S_ISSOCK(os.stat(socket_path(driver_root)).st_mode)
    except OSError:
        return False
