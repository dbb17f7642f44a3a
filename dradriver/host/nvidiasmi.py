"""Running the driver root's ``nvidia-smi`` the way NVIDIA's GPU plugin does.

Rule (NVIDIA's ``cmd/gpu-kubelet-plugin/sharing.go``, ``device_state.go`` and the init container's check in NVIDIA's
chart, ``templates/kubeletplugin.yaml``): the binary is the first ``nvidia-smi`` found under the driver root in
``opt/bin``, ``usr/bin``, ``usr/sbin``, ``bin``, ``sbin``; it runs with this process's environment and
``LD_PRELOAD`` prepended with the driver root's ``libnvidia-ml.so.1`` (first found in ``usr/lib64``,
``usr/lib/x86_64-linux-gnu``, ``usr/lib/aarch64-linux-gnu``, ``lib64``, ``lib/x86_64-linux-gnu``,
``lib/aarch64-linux-gnu``), so the tool talks to the driver installation of that root whatever the plugin
container's own library path says. Any non-zero exit is an error carrying the exit status and output.

dradriver uses it where NVML has no public call: the compute time-slice
(``nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>``), and persistence mode around VFIO passthrough
(``nvidia-smi -i <PCI bus id> -pm 0|1``, NVIDIA's ``cmd/gpu-kubelet-plugin/vfio-device.go``: with
nvidia-persistenced running the tool asks the daemon, which NVML's legacy ``nvmlDeviceSetPersistenceMode`` does
not; a separate process also holds no NVML handle across the driver swap); compute mode goes through NVML
(:mod:`dradriver.nvml.settings`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver.errors import DradriverError

BINARY_DIRS = ("opt/bin", "usr/bin", "usr/sbin", "bin", "sbin")
"""Where ``nvidia-smi`` is looked for under the driver root, in order."""

LIBRARY_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib64",
                "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")
"""Where ``libnvidia-ml.so.1`` is looked for under the driver root, in order."""

DEFAULT_TIMEOUT_S = 30.0
"""Upper bound of one ``nvidia-smi`` run (seconds); the kubelet's prepare deadline is longer."""


class NvidiaSmiError(DradriverError):
    """``nvidia-smi`` is missing, could not run, timed out or exited non-zero.

    :ivar returncode: the exit status (``None`` when it did not run to an exit).
    :ivar output: what it printed (stdout and stderr together), stripped.
    """

    def __init__(self, message: str, *, returncode: int | None = None, output: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.output = output


@dataclass(frozen=True, slots=True)
class NvidiaSmi:
    """The driver root's ``nvidia-smi`` and the library it is run with.

    :param binary: path of ``nvidia-smi`` as this process sees it.
    :param library: path of the root's ``libnvidia-ml.so.1``, put first in ``LD_PRELOAD``.
    :param timeout_s: per-run time limit in seconds.
    """

    binary: Path
    library: Path
    timeout_s: float = DEFAULT_TIMEOUT_S

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``LD_PRELOAD`` prepended with the library."""
        env = dict(os.environ if base is None else base)
        previous = env.get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = f"{self.library}:{previous}" if previous else str(self.library)
        return env

    def run(self, args: Sequence[str]) -> str:
        """Run ``nvidia-smi <args>``; return its output.

        :raises NvidiaSmiError: it could not start, ran past :attr:`timeout_s`, or exited non-zero (the
            message holds the command line, the status and the output).
        """
        command = [str(self.binary), *args]
        shown = " ".join(command)
        try:
            done = subprocess.run(command, env=self.environment(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=self.timeout_s, check=False, text=True)
        except subprocess.TimeoutExpired as exc:
            raise NvidiaSmiError(f"{shown}: no exit within {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise NvidiaSmiError(f"{shown}: cannot run: {exc}") from exc
        output = (done.stdout or "").strip()
        if done.returncode != 0:
            raise NvidiaSmiError(f"{shown}: exit status {done.returncode}: {output or '(no output)'}",
                                 returncode=done.returncode, output=output)
        return output

    def set_timeslice(self, uuid: str, value: int) -> str:
        """``nvidia-smi compute-policy -i <uuid> --set-timeslice <value>`` (0 DEFAULT .. 3 LONG).

        :raises ValueError: ``value`` is not 0-3.
        :raises NvidiaSmiError: as :meth:`run`.
        """
        if value not in (0, 1, 2, 3):
            raise ValueError(f"time-slice value {value} is not 0-3")
        return self.run(["compute-policy", "-i", uuid, "--set-timeslice", str(value)])

    def set_persistence_mode(self, pci_bus_id: str, enabled: bool) -> str:
        """``nvidia-smi -i <pci_bus_id> -pm 1|0``: persistence mode of one GPU on or off (the tool prints
        ``Disabled persistence mode for GPU <bus id>.`` / ``Persistence mode is already Disabled ...`` and ``All
        done.``; setting it needs root).

        :param pci_bus_id: the GPU's PCI address (``0000:18:00.0``; any form ``nvidia-smi -i`` takes).
        :raises NvidiaSmiError: as :meth:`run`.
        """
        return self.run(["-i", pci_bus_id, "-pm", "1" if enabled else "0"])


def find_nvidia_smi(driver_root: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> NvidiaSmi:
    """The ``nvidia-smi`` and ``libnvidia-ml.so.1`` under ``driver_root`` (``--container-driver-root``).

    :raises NvidiaSmiError: either is missing; the message lists where they were looked for.
    """
    binary = next((p for d in BINARY_DIRS if os.access(p := driver_root / d / "nvidia-smi", os.X_OK)), None)
    if binary is None:
        raise NvidiaSmiError(f"no executable nvidia-smi under the driver root {driver_root} "
                             f"(looked in {', '.join(BINARY_DIRS)})")
    library = next((p for d in LIBRARY_DIRS if (p := driver_root / d / "libnvidia-ml.so.1").exists()), None)
    if library is None:
        raise NvidiaSmiError(f"no libnvidia-ml.so.1 under the driver root {driver_root} "
                             f"(looked in {', '.join(LIBRARY_DIRS)})")
    return NvidiaSmi(binary, library, timeout_s)
