"""Preparers for the GPU plugin's static device kinds: full GPUs (``gpu-<minor>``) and MIG devices that already
exist (``gpu-<minor>-mig-<profile>-<giProfileId>-<start>``).

Preparing one of them has no side effect: the device exists, and giving it to a container is the CDI spec's
device nodes (NVIDIA's ``cmd/gpu-kubelet-plugin/cdi.go``; NVIDIA's MIG User Guide, "Device Nodes and Capabilities";
nvidia-container-toolkit's ``internal/info/proc/devices``): ``/dev/nvidia<minor>`` for a GPU, plus the GPU-instance
and compute-instance access capability nodes for a MIG device. Their undo records (version 1) are stored so every
prepared device has one, and undoing them does nothing; a MIG device's record names the instance the claim holds
(its facts), so that instance stays owned whatever the feature gates say later.
"""

from __future__ import annotations

from collections.abc import Sequence

from dradriver.domain.cdi import ContainerEdits
from dradriver.domain.claims import AllocationResult, Claim, ClaimRef, base_request_name
from dradriver.domain.configs import ConfigGroup
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.ports import DevicePlan, UndoRecord
from dradriver.host.devicenodes import DeviceNodeInfo, EditsCache, control_edits, device_edits

UNDO_VERSION = 1


class _ExistingDevicePreparer:
    """A device that exists before the claim and after it: plan = the device, apply and undo = nothing."""

    kind = ""
    side_effects = False
    device_type: type[GpuDevice] | type[MigDevice] = GpuDevice

    def __init__(self, nodes: DeviceNodeInfo, edits_cache: EditsCache | None = None) -> None:
        self.nodes = nodes
        self.edits_cache = edits_cache if edits_cache is not None else EditsCache(nodes)

    def handles(self, device: object) -> bool:
        """True for registry entries of this preparer's device type."""
        return type(device) is self.device_type

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        """The device and the requests it serves; no config of today's kinds changes how it is prepared."""
        assert isinstance(device, GpuDevice | MigDevice)
        names = tuple(dict.fromkeys(base_request_name(r.request) for r in results))
        return DevicePlan(kind=self.kind, device=device.name, entry=device, request_names=names,
                          admin_access=all(r.admin_access for r in results), results=tuple(results), group=group)

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        """Nothing to do: the device exists. Returns its undo record: ``{}`` for a full GPU; for a MIG device the
        instance the claim holds (``parentUUID``, ``giId``, ``ciId``, ``migUUID``, ``giProfileId``,
        ``placementStart``, ``placementSize``), facts other parts read to keep it (the dynamic-MIG sweep after the
        ``DynamicMIG`` gate is turned on); undoing it changes nothing."""
        device = plan.entry
        if not isinstance(device, MigDevice):
            return UndoRecord(self.kind, UNDO_VERSION, plan.device, {})
        return UndoRecord(self.kind, UNDO_VERSION, plan.device, {
            "parentUUID": device.parent.uuid, "giId": device.gi_id, "ciId": device.ci_id, "migUUID": device.uuid,
            "giProfileId": device.gi_profile_id, "placementStart": device.placement_start,
            "placementSize": device.placement_size,
        })

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        """The device nodes of the device (``/dev/nvidia<minor>``; MIG capability nodes). A full GPU's come from
        the edits cache (by UUID and minor; NVIDIA caches its per-GPU specs the same way); a MIG device's
        capability minors are read for each claim, as NVIDIA's plugin reads them.

        :raises DeviceNodeError: a major or capability minor cannot be found on this host.
        """
        device = plan.entry
        assert isinstance(device, GpuDevice | MigDevice)
        if isinstance(device, GpuDevice):
            return self.edits_cache.get(("gpu", device.uuid, device.minor),
                                        lambda: device_edits(device, self.nodes, self.nodes.read_majors()))
        return device_edits(device, self.nodes, self.nodes.read_majors())

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Nothing to undo (any version: the device existed before the claim and stays)."""

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Nothing can be left behind by a crash."""
        return []


class FullGpuPreparer(_ExistingDevicePreparer):
    """Full GPUs (:class:`~dradriver.domain.devices.GpuDevice`), kind ``gpu``."""

    kind = "gpu"
    device_type = GpuDevice


class StaticMigPreparer(_ExistingDevicePreparer):
    """MIG devices that exist when the plugin starts (:class:`~dradriver.domain.devices.MigDevice`), kind ``mig``."""

    kind = "mig"
    device_type = MigDevice


def spec_edits(nodes: DeviceNodeInfo, common: ContainerEdits | None = None) -> ContainerEdits:
    """The GPU plugin's spec-level edits: ``NVIDIA_VISIBLE_DEVICES=void``, the control nodes, then ``common``
    (the driver's user space, :func:`dradriver.host.driverfiles.driver_edits`).

    :raises DeviceNodeError: the ``nvidia`` or ``nvidia-uvm`` major is unknown.
    """
    edits = control_edits(nodes, nodes.read_majors())
    return edits + common if common is not None else edits
