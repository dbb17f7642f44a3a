"""A sandbox node with Fabric Manager: the mock ``libnvfm.so.1`` in its driver root, an NVSwitch device under its
``proc`` and the Fabric Manager stand-in on the driver root's default socket (the HGX 8-GPU table of the
``dgx-h100`` mock NVML profile), its activation state in ``<root>/fm-state.json``."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

from dradriver.nvml import mock
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.standins.nv_fabricmanager import FabricManager, mock_library_path, table_from_profile
from tests.factories import DEVICE_CLASS


def fm_state(node: SandboxNode) -> Path:
    """The stand-in's state file."""
    return node.root / "fm-state.json"


def active_partitions(node: SandboxNode) -> set[int]:
    """The partition IDs active now."""
    path = fm_state(node)
    return {int(i) for i in json.loads(path.read_text()).get("active", [])} if path.exists() else set()


@contextlib.contextmanager
def fm_node(_directory: Path | None = None, *, pci_tree: bool = False) -> Iterator[SandboxNode]:
    """A DGX H100 sandbox node with the GPU DeviceClass and Fabric Manager running."""
    with SandboxNode(profile="dgx-h100", pci_tree=pci_tree) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        library = node.driver_root / "usr" / "lib64" / "libnvfm.so.1"
        library.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(mock_library_path(), library)  # a link out of the root is not followed
        switches = node.root / "proc" / "driver" / "nvidia-nvswitch" / "devices"
        switches.mkdir(parents=True)
        (switches / "0000:05:00.0").write_text("")
        table = table_from_profile(json.loads(mock.profile_path("dgx-h100").read_text()))
        with FabricManager(node.driver_root / "run" / "nvidia-fabricmanager" / "socket", table, fm_state(node)):
            yield node
