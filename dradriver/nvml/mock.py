"""Locate the bundled mock ``libnvidia-ml.so.1`` and its node profiles (test infrastructure, stdlib only).

The mock is a C shared library built from ``ext/mocknvml/`` by the README setup command
(``python -m pip install -e '.[test]'``); it exports the NVML entry points with the layouts of the official
``nvml.h`` and reads the node it pretends to be from a JSON profile named by :data:`PROFILE_ENV`, at every
``nvmlInit``. The profile format is documented in ``ext/mocknvml/README.md``.

How code under test reaches the mock unchanged: load the library once with the global flag **before** pynvml
initialises::

    import ctypes, os
    from dradriver.nvml import mock
    lib = mock.activate("dgx-a100")                 # sets DRADRIVER_MOCK_NVML_PROFILE, returns the path
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # SONAME libnvidia-ml.so.1 is now loaded
    import pynvml; pynvml.nvmlInit()                # pynvml's CDLL("libnvidia-ml.so.1") finds it by SONAME

The dynamic loader matches a later ``dlopen("libnvidia-ml.so.1")`` against the SONAME of an already loaded
object, so pynvml (ctypes) and Cython code (``dlopen`` in cuda.bindings) both get the mock without a library
path. A subprocess can instead be given ``LD_LIBRARY_PATH=<library_path().parent>``: the file there is named
``libnvidia-ml.so.1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dradriver.errors import DradriverError

PROFILE_ENV = "DRADRIVER_MOCK_NVML_PROFILE"
"""Environment variable holding the absolute path of the profile the mock reads at ``nvmlInit``."""

CONTROL_ENV = "DRADRIVER_MOCK_NVML_CONTROL"
"""Optional environment variable naming a control file: the mock applies each line appended to it (see
``ext/mocknvml/README.md``, "Runtime control"), so a test can drive a mock loaded by another process."""

STATE_ENV = "DRADRIVER_MOCK_NVML_STATE"
"""Optional environment variable naming the mock's MIG state file: MIG modes, GPU/compute instances and their
processes, rewritten after every change and re-read when another process changed it, so processes sharing it
see one set of GPUs (and instances outlive a SIGKILL, as on real hardware). See ``ext/mocknvml/README.md``."""

PROC_ROOT_ENV = "DRADRIVER_MOCK_NVML_PROC_ROOT"
"""Optional environment variable naming a procfs root: the mock writes ``driver/nvidia-caps/mig-minors`` there
at init and keeps ``driver/nvidia/capabilities/gpu<minor>/mig/gi<g>[/ci<c>]/access`` in step with the instances."""

SYSFS_ENV = "DRADRIVER_MOCK_NVML_SYSFS"
"""Optional environment variable naming a sysfs root: ``nvmlInit`` then lists only the profile GPUs whose
``<root>/bus/pci/devices/<address>/driver`` link ends in ``/nvidia`` (a GPU without a function directory there
stays listed), as real NVML sees only the GPUs the ``nvidia`` driver holds. See ``ext/mocknvml/README.md``."""

LIBRARY_NAME = "libnvidia-ml.so.1"
SETUP_COMMAND = "python -m pip install -e '.[test]'"

_PACKAGE_DIR = Path(__file__).resolve().parent
_LIBRARY_DIR = _PACKAGE_DIR / "_mock"
_PROFILE_DIR = _PACKAGE_DIR / "profiles"


class MockNvmlError(DradriverError):
    """The mock NVML library or a mock profile cannot be used (not built, unknown name, unreadable file)."""


def library_path() -> Path:
    """Return the path of the built mock ``libnvidia-ml.so.1`` (``dradriver/nvml/_mock/``).

    :raises MockNvmlError: the library has not been built; the message names the setup command.
    """
    path = _LIBRARY_DIR / LIBRARY_NAME
    if not path.is_file():
        raise MockNvmlError(
            f"the mock NVML library {path} is not built; run the setup command from the repository root: "
            f"{SETUP_COMMAND}"
        )
    return path


def profile_names() -> list[str]:
    """Return the names of the bundled node profiles (``dradriver/nvml/profiles/<name>.json``), sorted."""
    return sorted(p.stem for p in _PROFILE_DIR.glob("*.json"))


def profile_path(name_or_path: str) -> Path:
    """Resolve a bundled profile name (``dgx-a100``) or the path of an existing profile file.

    :returns: an absolute path.
    :raises MockNvmlError: neither a bundled name nor an existing file; the message lists the bundled names.
    """
    bundled = _PROFILE_DIR / f"{name_or_path}.json"
    if "/" not in name_or_path and bundled.is_file():
        return bundled
    candidate = Path(name_or_path).expanduser()
    if candidate.is_file():
        return candidate.resolve()
    raise MockNvmlError(
        f"unknown mock NVML profile {name_or_path!r}: not a bundled profile and not a file; "
        f"bundled profiles: {', '.join(profile_names())}"
    )


def activate(name_or_path: str) -> Path:
    """Point the mock at a profile (sets :data:`PROFILE_ENV` in ``os.environ``) and return :func:`library_path`.

    The mock re-reads the profile at the next ``nvmlInit``, so a process can switch profiles between an
    ``nvmlShutdown`` and the following init.

    :raises MockNvmlError: unknown profile, or the library is not built.
    """
    path = profile_path(name_or_path)
    lib = library_path()
    os.environ[PROFILE_ENV] = str(path)
    return lib


def load_profile(name_or_path: str) -> dict[str, Any]:
    """Return the parsed JSON of a profile, for tests that compare what NVML reports with the profile.

    :raises MockNvmlError: unknown profile or invalid JSON.
    """
    path = profile_path(name_or_path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MockNvmlError(f"cannot read mock NVML profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise MockNvmlError(f"mock NVML profile {path}: top level must be a JSON object")
    return data


def resolved_gpus(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the profile's GPUs with their model's keys merged in (a GPU's own keys win), in index order.

    This is the view the mock library itself uses: a key missing from a GPU object is looked up in
    ``profile["models"][gpu["model"]]``.
    """
    models: dict[str, Any] = profile.get("models", {})
    out = []
    for gpu in profile.get("gpus", []):
        merged = dict(models.get(gpu.get("model", ""), {}))
        merged.update(gpu)
        out.append(merged)
    return out


RACK_TRAYS = 18
"""Compute trays (Kubernetes nodes) of a GB200 NVL72 rack (NVIDIA's GB200 NVL72 documentation)."""

FABRIC_STATE_IN_PROGRESS, FABRIC_STATE_COMPLETED = 2, 3
"""``nvmlGpuFabricState_t`` values (``nvmlGpuFabricInfo_t`` in ``nvml.h``)."""


def rack_node_profile(rack: str, tray: int, directory: Path, *, fabric_state: int | None = None,
                      fabric_status: int | None = None) -> Path:
    """Write the view of one compute tray of a bundled rack profile and return its path (for :data:`PROFILE_ENV`).

    A rack profile (``gb200-nvl72-rack-a``, ``gb200-nvl72-rack-b``) is an ordinary profile of tray 00 plus a
    ``rack`` object whose ``trays`` list gives every tray's GPU identities (``uuid``, ``serial``, ``pciBusId``),
    generated by ``ext/mocknvml/make_profiles.py``. The mock serves one profile per process, so each emulated node
    of a rack gets its own file: tray ``tray``'s identities, the rack's shared fabric info (cluster UUID and clique
    ID), optionally with ``fabric_state`` (0-3) / ``fabric_status`` (an ``nvmlReturn_t``) replaced on every GPU.
    The file is ``<directory>/<rack>-tray-<NN>.json``.

    :param rack: a bundled rack profile name or a path to one.
    :param tray: ``0 .. len(rack.trays)-1``.
    :raises MockNvmlError: not a rack profile, or ``tray`` out of range.
    """
    profile = load_profile(rack)
    layout = profile.get("rack")
    if not isinstance(layout, dict) or not isinstance(layout.get("trays"), list):
        raise MockNvmlError(f"mock NVML profile {rack!r} is not a rack profile (no rack.trays list)")
    trays: list[Any] = layout["trays"]
    if not 0 <= tray < len(trays):
        raise MockNvmlError(f"rack profile {rack!r} has trays 0..{len(trays) - 1}, not {tray}")
    gpus = profile["gpus"]
    if len(trays[tray]) != len(gpus):
        raise MockNvmlError(f"rack profile {rack!r}: tray {tray} lists {len(trays[tray])} GPUs, tray 0 {len(gpus)}")
    for gpu, identity in zip(gpus, trays[tray], strict=True):
        gpu.update(identity)
        fabric = dict(gpu.get("fabric") or {})
        if fabric_state is not None:
            fabric["state"] = fabric_state
        if fabric_status is not None:
            fabric["status"] = fabric_status
        gpu["fabric"] = fabric
    name = str(layout.get("name") or Path(rack).stem)
    profile["description"] = f"{name} tray {tray:02d} of {len(trays)} (derived from {Path(rack).stem})"
    profile["rack"] = {"name": name, "number": layout.get("number"), "tray": tray}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-tray-{tray:02d}.json"
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return path.resolve()
