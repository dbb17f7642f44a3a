"""What the compute-domain plugin's IMEX mode (``--imex-mode``) needs of this node, checked at start: a driver new
enough for DNS-named IMEX daemons, no host ``nvidia-imex.service`` beside driver-managed daemons, and, host-managed,
the host daemon's answer to ``nvidia-imex-ctl -q``.

NVIDIA's constant ``IMEXDaemonsWithDNSNamesMinDriverVersion`` and its start-up check are in
``cmd/compute-domain-kubelet-plugin/main.go`` (kubernetes-sigs/dra-driver-nvidia-gpu).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from dradriver.config import PluginConfig
from dradriver.errors import FlagError
from dradriver.host import imexchannels, imexservice

log = logging.getLogger(__name__)

DNS_NAMES_MIN_DRIVER = "570.158.01"
"""``IMEXDaemonsWithDNSNamesMinDriverVersion``: driver-managed IMEX with DNS names needs this driver or newer."""


def check_driver_version(version: str, config: PluginConfig) -> None:
    """NVIDIA's start-up check: driver-managed IMEX with DNS names needs driver >= 570.158.01.

    :raises FlagError: the driver is older (names both versions).
    """
    if config.imex_mode == "hostManaged":  # driver-managed and pre-warmed run nvidia-imex in daemon pods
        return
    try:
        too_old = _version_tuple(version) < _version_tuple(DNS_NAMES_MIN_DRIVER)
    except ValueError:
        log.warning("cannot compare NVIDIA driver version %r with %s", version, DNS_NAMES_MIN_DRIVER)
        return
    if too_old:
        raise FlagError(f"NVIDIA driver {version} is older than {DNS_NAMES_MIN_DRIVER}, which IMEX daemons with DNS "
                        "names (gate IMEXDaemonsWithDNSNames) need")


def refuse_beside_host_imex(config: PluginConfig) -> None:
    """Driver-managed IMEX on a node whose host runs ``nvidia-imex.service`` cannot work: the host's daemon holds
    the node's only IMEX session, so each daemon pod's ``nvidia-imex`` fails to start, and a probe that asked any
    daemon on the node would find the host's READY (:mod:`dradriver.host.imexservice`). Checked at start, before
    anything on the host is touched; an enabled but stopped service (it starts at the next boot) is a warning.

    :raises FlagError: the service runs (names it, the file that says so, and both ways out).
    """
    if config.imex_mode != "driverManaged":
        return
    found = imexservice.find_host_imex_service(config.container_driver_root)
    if found is None:
        return
    unit = imexservice.IMEX_SERVICE
    if found.active:
        raise FlagError(
            f"the host runs {unit} (systemd: {found.evidence} under the driver root {config.container_driver_root}): "
            "it holds this node's only IMEX session, so the IMEX daemons of ComputeDomains cannot start with "
            f"--imex-mode (env IMEX_MODE) {config.imex_mode}. Either stop and disable it on the host "
            f"(systemctl disable --now {unit}), or let it serve IMEX: IMEX_MODE=hostManaged with the feature gate "
            "HostManagedIMEXDaemon=true (chart: resources.computeDomains.imex.mode: hostManaged)")
    log.warning("%s is enabled on the host (%s) but not running: it will take this node's IMEX session at the next "
                "boot, and driver-managed ComputeDomains will then fail here; disable it (systemctl disable %s) or "
                "use IMEX_MODE=hostManaged", unit, ", ".join(found.enabled), unit)


def _version_tuple(text: str) -> tuple[int, ...]:
    """``570.158.01`` -> ``(570, 158, 1)``; :raises ValueError: not dotted integers."""
    return tuple(int(part) for part in text.strip().split("."))


def imex_ctl(config: PluginConfig) -> Callable[[], tuple[bool, str]]:
    """Host-managed IMEX: the channel preparer's readiness ask, ``nvidia-imex-ctl -q`` against
    ``--imex-host-socket-path`` (:func:`dradriver.host.imexchannels.imex_ctl_ready`: ready, and what it answered)."""
    binary = imexchannels_binary(config)

    def ask() -> tuple[bool, str]:
        return imexchannels.imex_ctl_ready(binary, config.imex_host_socket_path)

    return ask


def imexchannels_binary(config: PluginConfig) -> Path:
    """``<container driver root>/usr/bin/nvidia-imex-ctl`` (where NVIDIA's chroot finds it)."""
    return config.container_driver_root / "usr" / "bin" / "nvidia-imex-ctl"
