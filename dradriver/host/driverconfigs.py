"""Reading this node's driver config profile from the profiles directory (NVIDIA's ``/available-configs``).

The profile is chosen by the node label ``nvidia.com/dra-driver-gpu.config`` or ``--default-config``
(:func:`dradriver.domain.driverconfig.select_profile`); its file ``<directory>/<profile>`` is decoded strictly
(:func:`dradriver.domain.driverconfig.decode_driver_config`). Source: kubernetes-sigs/dra-driver-nvidia-gpu
``cmd/gpu-kubelet-plugin/driverconfig.go`` (``resolveDriverConfigFromDirectory``), ksigs#1067.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dradriver.domain.driverconfig import (
    EVERYTHING,
    DriverConfigError,
    NodePolicy,
    decode_driver_config,
    policy_of,
    select_profile,
)


def load_profile(directory: Path, profile: str, source: str = "default") -> NodePolicy:
    """The policy of profile ``profile``: ``<directory>/<profile>`` read and decoded.

    :param source: where the name came from (``label`` or ``default``), kept in the policy for its messages.
    :raises DriverConfigError: no such profile (no file of that name: the error lists the profiles there), an
        unreadable file, or an invalid one (the error names the file and the field).
    """
    path = directory / profile
    where = f"driver config profile {profile!r} ({path})"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        try:
            known = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith(".."))
        except OSError:
            known = []
        listed = ", ".join(known) if known else "none"
        raise DriverConfigError(where, "", f"unknown profile: no such file in {directory} (profiles there: "
                                           f"{listed})") from None
    except OSError as exc:
        raise DriverConfigError(where, "", f"cannot be read: {exc.strerror or exc}") from None
    return policy_of(profile, source, decode_driver_config(text, where))


def resolve(labels: Mapping[str, str], directory: Path, default: str) -> NodePolicy:
    """The policy a Node with ``labels`` asks for: the label's profile, else ``default``'s, else
    :data:`~dradriver.domain.driverconfig.EVERYTHING`.

    :raises DriverConfigError: an empty label, a name that is no profile name, an unknown profile, or an
        invalid profile file.
    """
    profile, source = select_profile(labels, default)
    if not profile:
        return EVERYTHING
    return load_profile(directory, profile, source)
