"""Where the plugin loads NVML from: ``--nvml-library``, else ``libnvidia-ml.so.1`` under the container's driver
root (as NVIDIA's plugin and prestart script look for it), else the loader's search path."""

from __future__ import annotations

from pathlib import Path

from dradriver.app.gpu import nvml_library
from dradriver.config import PluginConfig
from dradriver.host.driverfiles import find_nvml_library


def _lib(root: Path, directory: str, name: str = "libnvidia-ml.so.580.105.08") -> Path:
    path = root / directory.lstrip("/") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF")
    return path


def test_search_order_follows_nvidia(tmp_path: Path) -> None:
    assert find_nvml_library(tmp_path) is None
    debian = _lib(tmp_path, "usr/lib/x86_64-linux-gnu", "libnvidia-ml.so.1")
    assert find_nvml_library(tmp_path) == debian
    rpm = _lib(tmp_path, "usr/lib64", "libnvidia-ml.so.1")
    assert find_nvml_library(tmp_path) == rpm  # usr/lib64 comes first


def test_absolute_link_inside_a_driver_container_root_resolves_in_the_root(tmp_path: Path) -> None:
    real = _lib(tmp_path, "usr/lib/aarch64-linux-gnu")
    link = tmp_path / "usr" / "lib" / "aarch64-linux-gnu" / "libnvidia-ml.so.1"
    link.symlink_to("/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.580.105.08")  # absolute: the root's own /
    assert find_nvml_library(tmp_path) == real


def test_dangling_link_is_not_a_library(tmp_path: Path) -> None:
    link = tmp_path / "usr" / "lib64" / "libnvidia-ml.so.1"
    link.parent.mkdir(parents=True)
    link.symlink_to("libnvidia-ml.so.999")
    assert find_nvml_library(tmp_path) is None


def test_plugin_choice(tmp_path: Path) -> None:
    base = PluginConfig(node_name="n", container_driver_root=tmp_path)
    assert nvml_library(base) == ""  # nothing under the root: the loader's search path
    found = _lib(tmp_path, "usr/lib64", "libnvidia-ml.so.1")
    assert nvml_library(base) == str(found)
    named = PluginConfig(node_name="n", container_driver_root=tmp_path, nvml_library="/opt/nvml/libnvidia-ml.so.1")
    assert nvml_library(named) == "/opt/nvml/libnvidia-ml.so.1"
    mocked = PluginConfig(node_name="n", container_driver_root=tmp_path, mock_profile="dgx-h100")
    assert nvml_library(mocked) == ""  # the bundled mock decides
