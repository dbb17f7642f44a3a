"""A host ``nvidia-imex`` systemd service, seen from the compute-domain plugin's mount of the driver root.

The IMEX package registers ``nvidia-imex.service`` (NVIDIA IMEX guide, "Getting Started with IMEX": "register the
service as a systemd service called nvidia-imex"); GB200 VM images with the IMEX packages preinstalled ship it
(Crusoe's "Setting up IMEX" guide runs ``systemctl enable nvidia-imex``; AWS ParallelCluster installs and configures
it), while Bottlerocket ships it inactive (bottlerocket-os/bottlerocket-kernel-kit#428). The driver serves one IMEX
daemon per node, so while it runs the IMEX daemon pods of driver-managed ComputeDomains cannot start; NVIDIA's
ComputeDomain prerequisites tell the operator to disable it (NVIDIA/cloud-native-docs#400, #502) or to run the
driver host-managed (kubernetes-sigs/dra-driver-nvidia-gpu#1236).

Where it is seen: with pre-installed drivers the driver root (``NVIDIA_DRIVER_ROOT`` ``/``, mounted read-only and
recursively at ``DRIVER_ROOT_CTR_PATH`` ``/driver-root``) is the host's root, which holds systemd's files:

* active: ``run/systemd/units/invocation:nvidia-imex.service``, the link systemd keeps for each started unit
  while it is active (``src/core/unit.c``, ``unit_export_invocation_id``; journald reads it);
* enabled: ``etc/systemd/system/<target>.wants/nvidia-imex.service`` (``systemctl enable`` makes it, ``disable``
  removes it; systemd.unit(5) ``[Install] WantedBy=``).

With a driver container (the GPU Operator's ``/run/nvidia/driver``) the driver root holds no systemd state, and
nothing is seen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

__all__ = ["IMEX_SERVICE", "HostImexService", "find_host_imex_service"]

log = logging.getLogger(__name__)

IMEX_SERVICE = "nvidia-imex.service"


@dataclass(frozen=True, slots=True)
class HostImexService:
    """What the host root says about :data:`IMEX_SERVICE`.

    :param active: the unit runs now (its ``invocation:`` link exists).
    :param enabled: the ``*.wants`` links that start it at boot (host paths, ``/etc/systemd/system/...``).
    :param evidence: the file that says it is active, as a host path (``""`` when it is not active).
    """

    active: bool
    enabled: tuple[str, ...]
    evidence: str = ""


def find_host_imex_service(root: Path) -> HostImexService | None:
    """Look for :data:`IMEX_SERVICE` under ``root`` (the host's root as mounted, module docstring).

    :returns: ``None`` when it is neither active nor enabled (or ``root`` holds no systemd state).
    """
    invocation = Path("run") / "systemd" / "units" / f"invocation:{IMEX_SERVICE}"
    active = (root / invocation).is_symlink() or (root / invocation).exists()
    enabled: list[str] = []
    try:
        for wants in sorted((root / "etc" / "systemd" / "system").glob("*.wants")):
            link = wants / IMEX_SERVICE  # a link into /usr/lib/systemd/system (dangling when seen from elsewhere)
            if link.is_symlink() or link.exists():
                enabled.append("/" + str(link.relative_to(root)))
    except OSError as exc:
        log.debug("cannot list %s: %s", root / "etc" / "systemd" / "system", exc)
    if not active and not enabled:
        return None
    return HostImexService(active=active, enabled=tuple(enabled), evidence=f"/{invocation}" if active else "")
