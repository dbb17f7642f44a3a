"""The device-plugin guard against real Unix sockets in a temporary kubelet device-plugins directory."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.config import PluginConfig
from dradriver.kubeletplugin.guard import check_device_plugin, device_plugin_resources, find_device_plugin_sockets


@pytest.fixture
def plugins_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    return directory


def _config(directory: Path, *, ignore: bool = False) -> PluginConfig:
    return PluginConfig(
        node_name="gpu-node-1",
        kubelet_device_plugins_directory_path=directory,
        ignore_device_plugin=ignore,
    )


@pytest.fixture
def serving_socket(plugins_dir: Path) -> Iterator[Path]:
    """A listening Unix socket named as NVIDIA's device plugin names its socket for ``nvidia.com/gpu``."""
    path = plugins_dir / "nvidia-gpu.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    try:
        yield path
    finally:
        server.close()


def _node(allocatable: dict[str, str]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "gpu-node-1"},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", **allocatable}},
    }


def test_clean_node_proceeds(plugins_dir: Path) -> None:
    # The kubelet's own socket and other vendors' plugins are not NVIDIA's device plugin.
    kubelet = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    kubelet.bind(str(plugins_dir / "kubelet.sock"))
    (plugins_dir / "kubelet_internal_checkpoint").write_text("{}")
    try:
        verdict = check_device_plugin(_config(plugins_dir), _node({"nvidia.com/hostdev": "4"}))
    finally:
        kubelet.close()
    assert verdict.refuse is False
    assert verdict.reason == ""
    assert not verdict.found


def test_missing_directory_and_no_node_proceeds(tmp_path: Path) -> None:
    verdict = check_device_plugin(_config(tmp_path / "absent"), None)
    assert verdict.refuse is False
    assert verdict.sockets == ()


def test_device_plugin_socket_refuses(plugins_dir: Path, serving_socket: Path) -> None:
    verdict = check_device_plugin(_config(plugins_dir), _node({}))
    assert verdict.refuse is True
    assert verdict.sockets == (serving_socket,)
    assert str(serving_socket) in verdict.reason
    assert "serving" in verdict.reason
    assert "gpu-node-1" in verdict.reason
    assert "DRADRIVER_IGNORE_DEVICE_PLUGIN" in verdict.reason


def test_override_proceeds_but_still_reports(plugins_dir: Path, serving_socket: Path) -> None:
    verdict = check_device_plugin(_config(plugins_dir, ignore=True), None)
    assert verdict.refuse is False
    assert verdict.found
    assert str(serving_socket) in verdict.reason
    assert "anyway" in verdict.reason


def test_stale_socket_still_refuses_and_says_stale(plugins_dir: Path) -> None:
    # Bound but never listening: what a crashed device plugin leaves behind.
    path = plugins_dir / "nvidia-mig-1g.10gb.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    try:
        verdict = check_device_plugin(_config(plugins_dir), None)
    finally:
        sock.close()
    assert verdict.refuse is True
    assert "stale" in verdict.reason


def test_regular_file_with_socket_name_is_not_a_socket(plugins_dir: Path) -> None:
    (plugins_dir / "nvidia-gpu.sock").write_text("")
    assert find_device_plugin_sockets(plugins_dir) == ()
    assert check_device_plugin(_config(plugins_dir), None).refuse is False


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb"])
def test_node_allocatable_refuses(plugins_dir: Path, name: str) -> None:
    verdict = check_device_plugin(_config(plugins_dir), _node({name: "4"}))
    assert verdict.refuse is True
    assert verdict.resources == {name: "4"}
    assert f"{name}=4" in verdict.reason


def test_zero_allocatable_proceeds(plugins_dir: Path) -> None:
    # After the device plugin is removed the kubelet keeps the resource with allocatable 0.
    verdict = check_device_plugin(_config(plugins_dir), _node({"nvidia.com/gpu": "0"}))
    assert verdict.refuse is False


def test_malformed_node_does_not_raise(plugins_dir: Path) -> None:
    assert device_plugin_resources({"status": None}) == {}
    assert device_plugin_resources({}) == {}
    assert device_plugin_resources({"status": {"allocatable": {"nvidia.com/gpu": "bogus"}}}) == {
        "nvidia.com/gpu": "bogus"
    }
