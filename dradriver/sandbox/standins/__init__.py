"""Stand-ins for the node programs the plugin and its workloads run, installed into a sandbox.

Each module here is a standard-library-only script that behaves as the real program does for what the driver
uses: ``nvidia_cuda_mps_control`` (NVIDIA's MPS control tool), ``nvidia_cdi_hook`` (the container toolkit's hook
that claim CDI specs run), ``nvidia_persistenced`` (the persistence daemon holding the GPUs open),
``nvidia_imex`` and ``nvidia_imex_ctl`` (the IMEX
daemon and its query tool: real TCP handshakes between emulated nodes on loopback addresses), ``mount``
(``mount``/``umount`` for tmpfs) and ``pcibus`` (the kernel's PCI bus serving a sandbox sysfs tree's ``bind``/
``unbind``/``drivers_probe`` FIFOs; installed as ``modprobe`` it is the ``modprobe`` stand-in).
:func:`install` copies one to a path with this interpreter on its ``#!`` line (with ``-S``: no ``site``
start-up, a third of the interpreter's start time).
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path


def install(script: str, target: Path) -> Path:
    """Write the stand-in ``script`` (module name in this package) to ``target`` as an executable (0755).
    ``mount`` also gets its (empty) mount table ``mountinfo`` beside it.

    :returns: ``target``.
    """
    source = resources.files(__name__).joinpath(f"{script}.py").read_text()
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    target.write_text(f"#!{sys.executable} -S\n{source}")  # -S: standard library only, no site start-up cost
    target.chmod(0o755)
    if script == "mount":
        (target.parent / "mountinfo").touch()
    return target
