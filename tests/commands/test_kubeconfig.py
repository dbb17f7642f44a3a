"""``dradriver gpu-kubelet-plugin`` with a kubeconfig that cannot be read or parsed, or a cluster that cannot be
reached: one error line naming the file or URL and pointing at ``--kubeconfig``/``KUBECONFIG``, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dradriver.sandbox.node import SandboxNode

REPO = Path(__file__).resolve().parents[2]


def _env(sandbox: SandboxNode, kubeconfig: Path) -> dict[str, str]:
    """The plugin's environment on the sandbox node, with ``kubeconfig`` instead of the emulator's."""
    cfg = sandbox.config()
    env = {k: v for k, v in os.environ.items() if k != "DRADRIVER_MOCK_NVML_PROFILE"}
    env.update({
        "NODE_NAME": cfg.node_name,
        "KUBECONFIG": str(kubeconfig),
        "CDI_ROOT": str(cfg.cdi_root),
        "KUBELET_REGISTRAR_DIRECTORY_PATH": str(cfg.kubelet_registrar_directory_path),
        "KUBELET_PLUGINS_DIRECTORY_PATH": str(cfg.kubelet_plugins_directory_path),
        "KUBELET_DEVICE_PLUGINS_DIRECTORY_PATH": str(cfg.kubelet_device_plugins_directory_path),
        "DRIVER_ROOT_CTR_PATH": str(cfg.container_driver_root),
        "DEV_ROOT": str(cfg.dev_root),
        "SYSFS_ROOT": str(cfg.sysfs_root),
        "PROC_ROOT": str(cfg.proc_root),
        "DRADRIVER_MOCK_PROFILE": sandbox.profile,
    })
    return env


@pytest.mark.parametrize("text", [
    "apiVersion: v1\nclusters: [\n  - cluster: {server: https://x\n",  # unclosed flow collection
    "apiVersion: v1\n\tkind: Config\n",  # a tab where YAML allows none
    "clusters:\n  - name: a\n - name: b\n",  # bad indentation
])
def test_invalid_yaml_kubeconfig_is_one_error_line(sandbox: SandboxNode, tmp_path: Path, text: str) -> None:
    bad = tmp_path / "broken-kubeconfig"
    bad.write_text(text, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "dradriver", "gpu-kubelet-plugin"],
        cwd=REPO, env=_env(sandbox, bad), capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    # The start-up configuration (klog level 0, as NVIDIA's binaries log it) names the file too; the error is one.
    naming = [line for line in lines if str(bad) in line and "startup config:" not in line]
    assert len(naming) == 1, proc.stderr
    assert "cannot start the kubelet plugin" in naming[0] and "invalid YAML" in naming[0], proc.stderr


def _start_plugin(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dradriver", "gpu-kubelet-plugin"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


def _one_line_naming(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    naming = [line for line in lines if what in line and "startup config:" not in line]
    assert len(naming) == 1, proc.stderr
    assert "--kubeconfig or KUBECONFIG" in naming[0], naming[0]
    return naming[0]


@pytest.mark.parametrize("case", ["missing", "directory"])
def test_unreadable_kubeconfig_is_one_line_naming_the_file(sandbox: SandboxNode, tmp_path: Path, case: str) -> None:
    path = tmp_path / "kubeconfig"
    if case == "directory":
        path.mkdir()
    line = _one_line_naming(_start_plugin(_env(sandbox, path)), str(path))
    assert "cannot start the kubelet plugin" in line
    assert {"missing": "no such file", "directory": "Is a directory"}[case] in line


def test_unreachable_cluster_is_one_line_naming_the_url(sandbox: SandboxNode, tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(Path(sandbox.kubeconfig).read_text().replace(
            sandbox.api.url if sandbox.api else "", f"http://127.0.0.1:{port}"))
        assert f"127.0.0.1:{port}" in kubeconfig.read_text()
        line = _one_line_naming(_start_plugin(_env(sandbox, kubeconfig)), f"http://127.0.0.1:{port}")
    assert "cannot reach the Kubernetes API server" in line and str(kubeconfig) in line
    assert "Connection refused" in line


@pytest.mark.parametrize("case", ["missing", "invalid-yaml", "no-such-context", "no-such-cluster"])
def test_a_start_that_fails_on_the_kubeconfig_touches_nothing_on_the_host(sandbox: SandboxNode, tmp_path: Path,
                                                                         case: str) -> None:
    """Validate, then touch the host: a kubeconfig that cannot work fails the start before any socket, plugin
    directory or CDI directory is created (the kubelet never sees a plugin that is about to exit)."""
    path = tmp_path / "kubeconfig"
    good = Path(sandbox.kubeconfig).read_text()
    if case == "invalid-yaml":
        path.write_text("apiVersion: v1\nclusters: [\n  - cluster: {server: https://x\n")
    elif case == "no-such-context":
        data = yaml.safe_load(good)
        data["current-context"] = "elsewhere"
        path.write_text(yaml.safe_dump(data))
    elif case == "no-such-cluster":
        data = yaml.safe_load(good)
        data["clusters"][0]["name"] = "renamed"
        path.write_text(yaml.safe_dump(data))
    env = _env(sandbox, path)
    cdi_root = tmp_path / "cdi-not-yet"
    env["CDI_ROOT"] = str(cdi_root)
    registry = Path(env["KUBELET_REGISTRAR_DIRECTORY_PATH"])
    plugins = Path(env["KUBELET_PLUGINS_DIRECTORY_PATH"])
    line = _one_line_naming(_start_plugin(env), str(path))
    assert "cannot start the kubelet plugin" in line
    assert not cdi_root.exists()
    assert list(registry.iterdir()) == [] and list(plugins.iterdir()) == [], (list(registry.iterdir()),
                                                                               list(plugins.iterdir()))


def test_start_plugin_loads_the_kubeconfig_before_creating_its_directories(sandbox: SandboxNode,
                                                                           tmp_path: Path) -> None:
    """The composition (``start_plugin``, as the sandbox and the demo run it) connects first: a kubeconfig that
    cannot be loaded creates neither the plugin directory nor the CDI root."""
    import asyncio

    from dradriver.app import start_plugin
    from dradriver.errors import DradriverError

    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\n\tkind: Config\n")
    config = sandbox.config(kubeconfig=str(bad), cdi_root=tmp_path / "cdi",
                            kubelet_plugins_directory_path=tmp_path / "plugins")
    with pytest.raises(DradriverError, match="invalid YAML"):
        asyncio.run(start_plugin(config))
    assert not (tmp_path / "cdi").exists() and not (tmp_path / "plugins").exists()
