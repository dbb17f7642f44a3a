"""What ``status.devices[].data`` says of each device kind (:mod:`dradriver.kubeletplugin.devicestatus`)."""

from __future__ import annotations

from dradriver.domain.ports import UndoRecord
from dradriver.kubeletplugin.devicestatus import device_data, gpu_describer
from tests.factories import gpu_device, vfio_for

GPU = gpu_device(0)
(VFIO,) = vfio_for(GPU)


def test_a_vfio_device_reports_its_uuid_pci_address_parent_and_iommu_group() -> None:
    assert device_data(VFIO) == {"uuid": VFIO.uuid, "pciBusID": "0000:01:00.0", "parentUUID": GPU.uuid,
                                 "iommuGroup": 1}


def test_the_describer_names_a_vfio_device_once_whatever_steps_its_preparer_recorded() -> None:
    registry = {VFIO.name: VFIO, GPU.name: GPU}
    describe = gpu_describer(registry.get, mps_namespace="gpu-system")
    records = [UndoRecord("vfio", 1, VFIO.name, {"step": "unbind"}), UndoRecord("vfio", 1, VFIO.name, {"step": "bind"})]
    assert describe(records) == {VFIO.name: device_data(VFIO)}
