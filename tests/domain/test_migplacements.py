"""Dynamic-MIG device names (``nvidia-dra-driver-updates.md`` 2b): format and parse are inverses."""

from __future__ import annotations

import pytest

from dradriver.domain.devices import (
    GpuDevice,
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


def _gpu(minor: int, arch: str = "Hopper", *, mig: bool = False, bus: str | None = None) -> GpuDevice:
    return GpuDevice(index=minor, minor=minor, uuid=f"GPU-{minor}", product_name="H200", brand="Nvidia",
                     architecture=arch, cuda_compute_capability=(9, 0), memory_bytes=None,
                     pci_bus_id=bus or f"0000:{minor + 7:02x}:00.0", mig_capable=True, mig_enabled=mig)


def test_dynamic_allocatable_order_and_eligibility() -> None:
    from dradriver.domain.devices import DriverVersions, MigDevice, NodeInventory
    from dradriver.domain.migplacements import dynamic_allocatable, dynamic_index, instance_ids, published_devices

    hopper, ampere_on, ampere_off = _gpu(0), _gpu(1, "Ampere", mig=True), _gpu(2, "Ampere")
    places = (MigPlacement(hopper, "3g.71gb", 2, 9, 2, 4, 4, 71 << 30),
              MigPlacement(hopper, "1g.18gb", 0, 19, 0, 0, 1, 18 << 30),
              MigPlacement(ampere_on, "1g.5gb", 0, 19, 0, 6, 1, 5 << 30))
    created = MigDevice(parent=hopper, uuid="MIG-1", profile="1g.18gb", gi_profile_id=19, ci_profile_id=0, gi_id=7,
                        ci_id=0, placement_start=0, placement_size=1, memory_bytes=18 << 30, multiprocessors=16,
                        copy_engines=1, decoders=1, encoders=0, jpeg_engines=1, ofa_engines=0)
    inventory = NodeInventory(versions=DriverVersions("580", 13000), gpus=(ampere_off, ampere_on, hopper),
                              migs=(created,), placements=places)
    names = [d.name for d in dynamic_allocatable(inventory)]
    # PCI order; Hopper: full GPU then its placements by name; Ampere in MIG mode: placements only; Ampere off: GPU
    assert names == ["gpu-0", "gpu-0-mig-1g18gb-19-0", "gpu-0-mig-3g71gb-9-4", "gpu-1-mig-1g5gb-19-6", "gpu-2"]
    assert isinstance(dynamic_index(inventory)["gpu-0-mig-1g18gb-19-0"], MigPlacement)  # never the instance
    assert instance_ids(inventory) == {"gpu-0-mig-1g18gb-19-0": ("GPU-0", 7, 0, "MIG-1")}
    assert [d.name for d in published_devices(inventory)] == names
    plain = NodeInventory(versions=inventory.versions, gpus=(ampere_off,))
    assert [d.name for d in published_devices(plain)] == ["gpu-2"]


def test_health_tracker_attributes_mig_events_to_the_placement() -> None:
    from dradriver.domain.devices import DriverVersions, MigDevice, NodeInventory
    from dradriver.domain.faults import FaultKind, HealthEvent, HealthTracker

    hopper = _gpu(0)
    places = (MigPlacement(hopper, "1g.18gb", 0, 19, 0, 0, 1, 18 << 30),
              MigPlacement(hopper, "1g.18gb", 0, 19, 0, 1, 1, 18 << 30))
    created = MigDevice(parent=hopper, uuid="MIG-1", profile="1g.18gb", gi_profile_id=19, ci_profile_id=0, gi_id=8,
                        ci_id=0, placement_start=1, placement_size=1, memory_bytes=18 << 30, multiprocessors=16,
                        copy_engines=1, decoders=1, encoders=0, jpeg_engines=1, ofa_engines=0)
    inventory = NodeInventory(versions=DriverVersions("580", 13000), gpus=(hopper,), migs=(created,),
                              placements=places)
    tracker = HealthTracker(inventory)
    scoped = HealthEvent(kind=FaultKind.XID, gpu_uuid="GPU-0", xid=63, gi_id=8, ci_id=0, time=1.0)
    assert tracker.devices_for(scoped) == ["gpu-0-mig-1g18gb-19-1"]
    wide = HealthEvent(kind=FaultKind.XID, gpu_uuid="GPU-0", xid=63, time=1.0)
    assert sorted(tracker.devices_for(wide)) == ["gpu-0", "gpu-0-mig-1g18gb-19-0", "gpu-0-mig-1g18gb-19-1"]
