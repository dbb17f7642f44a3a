"""The driver's spec-level edits watched through the driver root (``host.driverfiles.DriverRootEdits``): found
once, found again when the directory holding ``libcuda.so.<version>`` is another one or its entries changed, at
one ``stat`` per look while nothing changed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain.cdi import ContainerEdits
from dradriver.host import driverfiles
from dradriver.host.driverfiles import DriverFilesError, DriverRootEdits, discover_driver_files
from tests.driverfiles.trees import VERSION, X86, build, ubuntu_x86_64


class Finder:
    """Finds the files as the plugin does (``discover_driver_files`` + ``driver_edits``), counting the searches."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.searches = 0

    def __call__(self, version: str) -> ContainerEdits:
        self.searches += 1
        return driverfiles.driver_edits(discover_driver_files(self.root, version, kernel_release="k"))


def _libraries(edits: ContainerEdits) -> set[str]:
    return {os.path.basename(m.container_path) for m in edits.mounts if ".so" in m.container_path}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return build(tmp_path / "driver-root", ubuntu_x86_64())


def test_the_edits_are_found_once_and_served_while_the_library_directory_is_unchanged(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    find = Finder(root)
    watch = DriverRootEdits(root, find)
    edits = watch.read(VERSION)
    assert find.searches == 1 and "libcuda.so." + VERSION in _libraries(edits)
    stats: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        stats.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(driverfiles.os, "stat", counting_stat)
    stamp, again = watch.current()
    assert again is edits and stamp is not None and find.searches == 1
    assert stats == [str(root / X86.lstrip("/"))]  # one stat: the directory holding libcuda.so.<version>
    assert watch.current() == (stamp, edits) and find.searches == 1


def test_a_rebuilt_driver_root_at_the_same_version_is_found_again(root: Path) -> None:
    """A driver container replaced by a rebuilt one: another directory at the same path, with other files."""
    find = Finder(root)
    watch = DriverRootEdits(root, find)
    watch.read(VERSION)
    stamp, edits = watch.current()
    gone, added = "libnvidia-egl-wayland.so.1.1.19", "libnvidia-egl-xcb.so.1.0.1"
    assert gone in _libraries(edits)
    rebuilt = root.with_name("rebuilt")
    shutil.copytree(root, rebuilt, symlinks=True)
    (rebuilt / X86.lstrip("/") / gone).unlink()
    (rebuilt / X86.lstrip("/") / "libnvidia-egl-wayland.so.1").unlink()
    (rebuilt / X86.lstrip("/") / added).write_text("")
    root.rename(root.with_name("old"))
    rebuilt.rename(root)
    new_stamp, new_edits = watch.current()
    assert find.searches == 2 and new_stamp != stamp
    assert added in _libraries(new_edits) and gone not in _libraries(new_edits)
    assert watch.current() == (new_stamp, new_edits) and find.searches == 2  # watched from then on


def test_a_library_added_beside_the_others_is_found_again(root: Path) -> None:
    find = Finder(root)
    watch = DriverRootEdits(root, find)
    watch.read(VERSION)
    stamp, _ = watch.current()
    (root / X86.lstrip("/") / "libnvidia-egl-xcb.so.1.0.1").write_text("")
    new_stamp, edits = watch.current()
    assert new_stamp != stamp and find.searches == 2 and "libnvidia-egl-xcb.so.1.0.1" in _libraries(edits)


def test_a_driver_root_caught_half_replaced_fails_and_is_tried_again(root: Path) -> None:
    """While the files are being swapped (libcuda missing) the search fails; the next look tries again."""
    find = Finder(root)
    watch = DriverRootEdits(root, find)
    edits = watch.read(VERSION)
    aside = root.with_name("aside")
    root.rename(aside)
    with pytest.raises(DriverFilesError, match=f"libcuda.so.{VERSION} not found"):
        watch.current()
    assert watch.edits is edits  # kept meanwhile
    aside.rename(root)  # the same directory back: its stamp is the one the edits were found at
    assert watch.current()[1] is edits and find.searches == 2


def test_without_driver_files_nothing_is_watched(tmp_path: Path) -> None:
    """The mock NVML's nodes have no driver files: empty edits, and no stat per look."""
    watch = DriverRootEdits(tmp_path, lambda version: ContainerEdits())
    assert watch.read(VERSION) == ContainerEdits()
    assert watch.current() == (None, ContainerEdits())
