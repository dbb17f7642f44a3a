"""VFIO devices from PCI functions and NVML GPUs (``dradriver.domain.passthrough.vfio_devices``), the sibling rule
(``withdrawn``), and what the inventory and its index make of them."""

from __future__ import annotations

from dradriver.domain.devices import DeviceIndex, DeviceType, DriverVersions, NodeInventory
from dradriver.domain.passthrough import passed_through, sibling_conflicts, vfio_devices, vfio_uuid, withdrawn
from tests.factories import gpu_device, gpu_function, vfio_for

VERSIONS = DriverVersions(driver="570.148.08", cuda_driver=12080)


def test_one_vfio_device_per_nvidia_gpu_function_in_address_order_with_its_nvml_sibling() -> None:
    gpus = [gpu_device(3, pci_bus_id="0000:41:00.0"), gpu_device(0, pci_bus_id="0000:07:00.0")]
    bridge = gpu_function(0x10, vendor_id=0x8086, class_code=0x060400)
    audio = gpu_function(0x42, class_code=0x040300)
    functions = [gpu_function(0x41), bridge, audio, gpu_function(0x07)]
    devices = vfio_devices(functions, gpus, iommufd=True)
    assert [(d.name, d.function.address, d.sibling, d.parent_uuid) for d in devices] == [
        ("gpu-vfio-0", "0000:07:00.0", "gpu-0", gpus[1].uuid),
        ("gpu-vfio-1", "0000:41:00.0", "gpu-3", gpus[0].uuid),
    ]
    assert all(d.iommufd and d.product_name == "NVIDIA A100-SXM4-40GB" for d in devices)
    assert devices[0].uuid == vfio_uuid("0000:07:00.0")


def test_a_gpu_in_mig_mode_has_no_vfio_device_and_the_others_keep_their_index() -> None:
    gpus = [gpu_device(0, pci_bus_id="0000:07:00.0", mig=True), gpu_device(1, pci_bus_id="0000:08:00.0")]
    devices = vfio_devices([gpu_function(7), gpu_function(8)], gpus, iommufd=False)
    assert [(d.name, d.sibling) for d in devices] == [("gpu-vfio-1", "gpu-1")]


def test_a_function_already_on_vfio_keeps_the_parent_its_claim_recorded() -> None:
    on_vfio = gpu_function(7, driver="vfio-pci")
    unknown = gpu_function(9, driver="vfio-pci")
    devices = vfio_devices([on_vfio, unknown], [], iommufd=False,
                           known_parents={"0000:07:00.0": (4, "GPU-aaaa")})
    assert [(d.name, d.parent_minor, d.parent_uuid, d.sibling) for d in devices] == [
        ("gpu-vfio-0", 4, "GPU-aaaa", "gpu-4"), ("gpu-vfio-1", None, None, None)]
    assert devices[0].product_name == "NVIDIA PCI device 0x2330"


def test_module_ids_and_partitions_are_taken_by_pci_address() -> None:
    (device,) = vfio_devices([gpu_function(7)], [gpu_device(0, pci_bus_id="0000:07:00.0")], iommufd=False,
                             module_ids={"0000:07:00.0": 5}, partitions={"0000:07:00.0": {1: 4, 8: 0}})
    assert (device.module_id, device.partitions) == (5, {1: 4, 8: 0})


def test_a_held_device_withdraws_its_sibling_either_way() -> None:
    gpus = (gpu_device(0), gpu_device(1))
    vfio = vfio_for(*gpus)
    assert withdrawn(vfio, {"gpu-vfio-0"}) == {"gpu-0"}
    assert withdrawn(vfio, {"gpu-1"}) == {"gpu-vfio-1"}
    assert withdrawn(vfio, set()) == frozenset()
    assert [d.name for d in passed_through(vfio, {"gpu-vfio-1", "gpu-0"})] == ["gpu-vfio-1"]


def test_the_inventory_index_finds_vfio_devices_and_their_type_is_vfio() -> None:
    gpus = (gpu_device(0),)
    inventory = NodeInventory(versions=VERSIONS, gpus=gpus, vfio=vfio_for(*gpus))
    index = DeviceIndex.build(inventory).by_name
    assert sorted(index) == ["gpu-0", "gpu-vfio-0"]
    assert DeviceType.of(index["gpu-vfio-0"]) is DeviceType.VFIO
    assert DeviceType.of(index["gpu-0"]) is DeviceType.GPU
    assert inventory.find("gpu-vfio-0") is inventory.vfio[0]
    assert [d.name for d in inventory.allocatable()] == ["gpu-0"]


def test_a_device_whose_sibling_is_held_or_asked_for_too_conflicts_at_prepare() -> None:
    vfio = vfio_for(gpu_device(0), gpu_device(1))
    assert sibling_conflicts(vfio, {"gpu-0"}, ["gpu-vfio-0", "gpu-vfio-1"]) == [("gpu-vfio-0", "gpu-0")]
    assert sibling_conflicts(vfio, {"gpu-vfio-1"}, ["gpu-1"]) == [("gpu-1", "gpu-vfio-1")]
    assert sibling_conflicts(vfio, set(), ["gpu-0", "gpu-vfio-0", "gpu-vfio-1"]) == [("gpu-0", "gpu-vfio-0")]
    assert sibling_conflicts(vfio, {"gpu-vfio-0"}, ["gpu-1"]) == []  # another GPU's sibling
