"""``DRADRIVER_MOCK_NVML_SYSFS``: the mock lists only the GPUs whose sysfs function is bound to ``nvidia``, read
at each ``nvmlInit`` as real NVML sees only what the ``nvidia`` driver holds (``ext/mocknvml/README.md``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dradriver.nvml import mock
from dradriver.sandbox.node import lay_out_pci_tree

PROFILE = "dgx-h100"


def _listed(nvml: Callable[[str | Path], Any]) -> list[tuple[str, int, str]]:
    pynvml = nvml(PROFILE)
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append((pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetMinorNumber(h),
                        pynvml.nvmlDeviceGetPciInfo(h).busId))
        return out
    finally:
        pynvml.nvmlShutdown()


def _move_driver(sysfs: Path, address: str, driver: str | None) -> None:
    real = (sysfs / "bus" / "pci" / "devices" / address).resolve()
    (real / "driver").unlink(missing_ok=True)
    if driver is not None:
        (sysfs / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(sysfs / "bus" / "pci" / "drivers" / driver, real), real / "driver")


def test_only_gpus_bound_to_nvidia_are_listed_and_come_back_with_uuid_and_minor(
        nvml: Callable[[str | Path], Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    addresses = lay_out_pci_tree(tmp_path, PROFILE)
    monkeypatch.setenv(mock.SYSFS_ENV, str(tmp_path / "sys"))
    everything = _listed(nvml)
    assert len(everything) == len(addresses) == 8
    _move_driver(tmp_path / "sys", addresses[2], "vfio-pci")
    _move_driver(tmp_path / "sys", addresses[5], None)
    listed = _listed(nvml)
    assert listed == [g for i, g in enumerate(everything) if i not in (2, 5)]
    _move_driver(tmp_path / "sys", addresses[2], "nvidia")
    _move_driver(tmp_path / "sys", addresses[5], "nvidia")
    assert _listed(nvml) == everything


def test_a_gpu_without_a_function_directory_stays_listed(
        nvml: Callable[[str | Path], Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    monkeypatch.setenv(mock.SYSFS_ENV, str(tmp_path / "sys"))
    assert len(_listed(nvml)) == 8
