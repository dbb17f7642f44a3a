"""NVIDIA's own ``gpu-kubelet-plugin`` as a peer on a sandbox node: for benchmarks against it and for tests that
hand a node from one driver to the other (a switch or a rollback).

The binary and NVIDIA's mock NVML are built from NVIDIA's public sources (kubernetes-sigs/dra-driver-nvidia-gpu,
NVIDIA/k8s-test-infra ``pkg/gpu/mocknvml``); the folder that holds them is named by the environment variable
``DRADRIVER_NVIDIA_PEERS`` (:func:`peer_paths`; dradriver knows no default place), and :func:`peer_missing` says
why they cannot run, for a skip reason. Running NVIDIA's
plugin without a GPU needs a fake driver root (the mock library, an empty ``libcuda.so.<driver version>``,
``nvidia-smi`` and ``nvidia-cdi-hook`` stand-ins, ``/dev/nvidia*`` character devices: CAP_MKNOD), a
``proc/devices`` file (``ALT_PROC_DEVICES_PATH``), the sandbox's kubeconfig and raised client rate limits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NVIDIA_PROFILE", "PEERS_VARIABLE", "PEER_GPUS", "Side", "nvidia_side", "peer_missing", "peer_paths"]

PEERS_VARIABLE = "DRADRIVER_NVIDIA_PEERS"
"""The environment variable naming the folder with NVIDIA's peer binaries: ``bin/gpu-kubelet-plugin`` (NVIDIA's
plugin) and ``mocknvml/`` (NVIDIA's mock ``libnvidia-ml.so.1`` and its ``configs/``)."""
NVIDIA_PROFILE = "mock-nvml-config-h100.yaml"
"""NVIDIA's mock node matching dradriver's ``dgx-h100`` profile: 8 H100 GPUs, ``gpu-0`` .. ``gpu-7``."""
PEER_GPUS = 8


SOCKET_PATH_MAX = 107
"""Longest Unix socket path the kernel binds (``sun_path`` is 108 bytes with its NUL, unix(7)); a longer one fails
with ``bind: invalid argument`` in NVIDIA's plugin."""

REGISTRATION_SOCKET = "gpu.nvidia.com-reg.sock"
"""NVIDIA's registration socket in its registrar directory (``<driver>-reg.sock``)."""


@dataclass
class Side:
    """How to start one plugin on a sandbox node: ``argv``, environment, and the directories it uses."""

    name: str
    argv: list[str]
    env: dict[str, str]
    registrar: Path
    cleanup: list[Path] = field(default_factory=list)


def peer_paths(environ: Mapping[str, str] = os.environ) -> tuple[Path | None, Path | None]:
    """``(plugin binary, mock NVML folder)`` under the folder ``DRADRIVER_NVIDIA_PEERS`` names in ``environ``:
    ``<folder>/bin/gpu-kubelet-plugin`` and ``<folder>/mocknvml``; ``(None, None)`` when it is unset or empty."""
    folder = environ.get(PEERS_VARIABLE, "")
    if not folder:
        return None, None
    return Path(folder) / "bin" / "gpu-kubelet-plugin", Path(folder) / "mocknvml"


def peer_missing(binary: Path | None = None, mock_dir: Path | None = None) -> str:
    """Why NVIDIA's plugin cannot run here (``""`` when it can): no ``DRADRIVER_NVIDIA_PEERS`` to find it by (when
    ``binary`` or ``mock_dir`` is not given), the binary or its mock NVML is absent, or this process cannot create
    device nodes (CAP_MKNOD)."""
    if binary is None or mock_dir is None:
        if not os.environ.get(PEERS_VARIABLE):
            return f"{PEERS_VARIABLE} is not set (the folder with NVIDIA's bin/gpu-kubelet-plugin and mocknvml/)"
        found_binary, found_mock = peer_paths()
        binary, mock_dir = binary or found_binary, mock_dir or found_mock
    if binary is None or not binary.exists():
        return f"NVIDIA's plugin binary not found ({binary})"
    if mock_dir is None or not (mock_dir / "libnvidia-ml.so.1").exists():
        return f"NVIDIA's mock NVML not found ({mock_dir})"
    if os.geteuid() != 0:
        return "NVIDIA's plugin needs /dev/nvidia* device nodes in its fake driver root: mknod needs root"
    return ""


def nvidia_side(node: Any, binary: Path, mock_dir: Path, work: Path, cdi_root: Path | None = None,
                plugins_dir: Path | None = None, profile: str = NVIDIA_PROFILE,
                extra_args: Sequence[str] = (), registrar: Path | None = None) -> Side:
    """NVIDIA's ``gpu-kubelet-plugin`` on ``node`` with NVIDIA's mock NVML (its node ``profile``, a file of its
    ``configs/``): a fake driver root under ``work``, the registrar directory ``registrar``, the CDI root
    ``cdi_root`` and the kubelet plugins directory ``plugins_dir`` (defaults under ``work``, the registrar's under
    ``/tmp`` when that path would be too long for its socket; pass the node's own to run on dradriver's
    directories, as a switch between the drivers does), the sandbox's kubeconfig, and raised client rate limits;
    ``extra_args`` are added to its flags (``--feature-gates=TimeSlicingSettings=true``)."""
    root = work / "nvidia-driver-root"
    lib = root / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True, exist_ok=True)
    shutil.copy2(mock_dir / "libnvidia-ml.so.1", lib / "libnvidia-ml.so.1")
    with contextlib.suppress(FileExistsError):
        (lib / "libnvidia-ml.so").symlink_to("libnvidia-ml.so.1")
    config_file = mock_dir / "configs" / profile
    version = _mock_driver_version(config_file)
    (lib / f"libcuda.so.{version}").touch()
    (root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    smi = root / "usr" / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    nodes = {f"nvidia{i}": (195, i) for i in range(PEER_GPUS)}
    nodes.update({"nvidiactl": (195, 255), "nvidia-uvm": (510, 0), "nvidia-uvm-tools": (510, 1)})
    for name, (major, minor) in nodes.items():  # device nodes the spec edits name (needs CAP_MKNOD)
        if not (dev / name).exists():
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    hook = root / "usr" / "bin" / "nvidia-cdi-hook"  # only named in the specs it writes, never run here
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    own_registrar = registrar is None
    if registrar is None:
        registrar = work / "nvidia-registry"
        if len(os.fsencode(registrar / REGISTRATION_SOCKET)) > SOCKET_PATH_MAX:  # a deep pytest tmp_path, say
            registrar = Path(tempfile.mkdtemp(prefix="nvreg-", dir="/tmp"))
    plugins = plugins_dir if plugins_dir is not None else work / "nvidia-plugins"
    cdi = cdi_root if cdi_root is not None else work / "nvidia-cdi"
    for d in (registrar, plugins, cdi):
        d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({
        "LD_LIBRARY_PATH": str(lib),
        "MOCK_NVML_CONFIG": str(config_file),
        "ALT_PROC_DEVICES_PATH": str(Path(node.root) / "proc" / "devices"),
        "KUBECONFIG": str(node.kubeconfig),
        "NODE_NAME": node.node_name,
        "KUBE_FEATURE_WatchListClient": env.get("KUBE_FEATURE_WatchListClient", "true"),
    })
    argv = [str(binary), f"--node-name={node.node_name}", f"--kubeconfig={node.kubeconfig}",
            f"--nvidia-driver-root={root}", f"--container-driver-root={root}", f"--cdi-root={cdi}",
            f"--kubelet-registrar-directory-path={registrar}", f"--kubelet-plugins-directory-path={plugins}",
            f"--nvidia-cdi-hook-path={hook}", "--healthcheck-port=-1", "--image-name=nvidia/dra:bench",
            "--namespace=default",
            "--kube-api-qps=1000", "--kube-api-burst=1000", "-v=0", *extra_args]
    owned = [root, *([registrar] if own_registrar else []), *([plugins] if plugins_dir is None else []),
             *([cdi] if cdi_root is None else [])]
    return Side("nvidia", argv, env, registrar, owned)


def _mock_driver_version(config_file: Path) -> str:
    for line in config_file.read_text().splitlines():
        key, _, value = line.strip().partition(":")
        if key in ("driver_version", "driverVersion"):
            return value.strip().strip("\"'")
    return "550.54.15"
