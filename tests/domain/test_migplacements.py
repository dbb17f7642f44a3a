"""Dynamic-MIG device names (``nvidia-dra-driver-updates.md`` 2b): format and parse are inverses."""

from __future__ import annotations

import pytest

from dradriver.domain.devices import GpuDevice
from dradriver.domain.migplacements import (
    MigPlacement,
    PlacementName,
    format_placement_device_name,
    parse_placement_device_name,
)


@pytest.mark.parametrize(("parts", "name"), [
    ((0, "1g.18gb", 19, 3), "gpu-0-mig-1g18gb-19-3"),
    ((7, "1g.10gb+me", 20, 6), "gpu-7-mig-1g10gb-me-20-6"),
    ((12, "3g.71gb", 9, 4), "gpu-12-mig-3g71gb-9-4"),
    ((1, "1g.24gb-me", 47, 0), "gpu-1-mig-1g24gb-me-47-0"),
])
def test_format_and_parse_round_trip(parts: tuple[int, str, int, int], name: str) -> None:
    assert format_placement_device_name(*parts) == name
    parsed = parse_placement_device_name(name)
    assert parsed == PlacementName(parts[0], name.split("-mig-")[1].rsplit("-", 2)[0], parts[2], parts[3])


@pytest.mark.parametrize("name", ["gpu-0", "gpu-0-mig-1g18gb-19", "channel-3", "gpu-x-mig-1g-1-2", ""])
def test_parse_rejects_other_names(name: str) -> None:
    assert parse_placement_device_name(name) is None


def test_format_rejects_bad_parts() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        format_placement_device_name(0, "1g.18gb", -1, 0)
    with pytest.raises(ValueError, match="no characters"):
        format_placement_device_name(0, "..", 19, 0)


def test_placement_entry_name_and_overlap() -> None:
    gpu = GpuDevice(index=0, minor=3, uuid="GPU-1", product_name="H200", brand="Nvidia", architecture="Hopper",
                    cuda_compute_capability=(9, 0), memory_bytes=None, pci_bus_id="0000:07:00.0")
    one = MigPlacement(gpu, "1g.18gb", 0, 19, 0, 2, 1, 18 << 30)
    three = MigPlacement(gpu, "3g.71gb", 2, 9, 2, 0, 4, 71 << 30)
    four = MigPlacement(gpu, "3g.71gb", 2, 9, 2, 4, 4, 71 << 30)
    assert one.name == "gpu-3-mig-1g18gb-19-2" and list(three.memory_slices) == [0, 1, 2, 3]
    assert one.overlaps(three) and three.overlaps(one) and not one.overlaps(four) and not three.overlaps(four)
