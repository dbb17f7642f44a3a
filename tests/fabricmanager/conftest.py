"""Fixtures: a driver root holding the mock ``libnvfm.so.1``, the Fabric Manager stand-in on the root's default
socket (HGX 8-GPU table over the ``dgx-h100`` mock NVML profile), and a proc root with an NVSwitch device."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.host.fabricmanager import FabricManagerClient, open_client
from dradriver.nvml import mock
from dradriver.sandbox.standins.nv_fabricmanager import FabricManager, mock_library_path, table_from_profile


@pytest.fixture
def driver_root(tmp_path: Path) -> Path:
    root = tmp_path / "dr"  # short: a Unix socket path has at most 107 bytes
    (root / "usr" / "lib64").mkdir(parents=True)
    shutil.copy(mock_library_path(), root / "usr" / "lib64" / "libnvfm.so.1")  # a link out of the root is not followed
    return root


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia-nvswitch" / "devices").mkdir(parents=True)
    (proc / "driver" / "nvidia-nvswitch" / "devices" / "0000:05:00.0").write_text("")
    return proc


@pytest.fixture
def fm(driver_root: Path, tmp_path: Path) -> Iterator[FabricManager]:
    table = table_from_profile(json.loads(mock.profile_path("dgx-h100").read_text()))
    daemon = FabricManager(driver_root / "run" / "nvidia-fabricmanager" / "socket", table, tmp_path / "fm-state.json")
    with daemon:
        yield daemon


@pytest.fixture
def client(driver_root: Path, proc_root: Path, tmp_path: Path, fm: FabricManager) -> FabricManagerClient:
    made = open_client(driver_root, proc_root=proc_root, sysfs_root=tmp_path / "sys", environ={}, timeout_ms=2000)
    assert made is not None
    return made
