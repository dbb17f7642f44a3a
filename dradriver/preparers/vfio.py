"""The VFIO passthrough device preparer (``PassthroughSupport`` gate): a ``gpu-vfio-<index>`` device's GPU taken
from ``nvidia`` and bound to its vfio driver at prepare, given back to ``nvidia`` at unprepare.

Facts (NVIDIA's ``cmd/gpu-kubelet-plugin/vfio-device.go`` and ``vfio-cdi.go``; the Linux kernel's
``Documentation/driver-api/vfio.rst`` and ``Documentation/ABI/testing/sysfs-bus-pci``; the host side is
:mod:`dradriver.host.pci`):

* persistence: where ``nvidia-persistenced`` runs (its socket under the driver root,
  :mod:`dradriver.host.persistenced`) it holds every GPU in persistence mode open; a GPU on ``nvidia`` then has
  persistence mode turned off (``nvidia-smi -i <address> -pm 0``) before the in-use check, and on again after the
  rebind to ``nvidia`` at unprepare (NVIDIA enables it there unconditionally; here only when this prepare turned it
  off, as the record says, and the daemon still runs: a daemon that starts later enables every GPU itself);
* prepare loads the best vfio module variant (``nvgrace-gpu-vfio-pci`` on Grace GPUs where the kernel has it, else
  ``vfio-pci``), refuses a GPU bound to anything but ``nvidia`` or its vfio driver, one with SR-IOV virtual
  functions, and one a process holds open; then unbinds it and binds the vfio driver through
  ``driver_override``; a GPU already on its vfio driver is left as it is;
* the IOMMU group is the unit a VM gets (``/dev/vfio/<group>``): every other function of the group must be
  unbound or on a VFIO driver already, else the claim is refused naming each function and its driver;
* unprepare gives the GPU back to ``nvidia`` (override cleared, vfio driver unbound, ``nvidia`` bound), where NVML
  finds it again with its UUID and minor; while the ``nvidia`` module is unloaded (a driver upgrade) the GPU stays
  on its vfio driver and the give-back is kept until the module is back (:meth:`VfioPreparer.undo`);
* CDI edits: ``/dev/vfio/<group>`` (legacy), or ``/dev/vfio/devices/vfio<N>`` when the claim's VfioDeviceConfig
  says ``iommu.backendPolicy: PreferIommuFD`` and the host has iommufd (``/dev/iommu``) and the device cdev; with
  ``iommu.enableAPIDevice`` the API device, ``/dev/iommu`` (iommufd) or ``/dev/vfio/vfio`` (legacy); and
  ``NVIDIA_VISIBLE_DEVICES=void``.

Steps and crash safety. The batch runner records the claim PREPARE_STARTED with its device names before
:meth:`VfioPreparer.apply` runs. Turning persistence off comes before every sysfs write; a refusal or failure
before the first write turns it on again before the claim's error is raised, so a refused claim leaves the GPU as
it was. A SIGKILL after persistence went off and before the first write leaves the GPU on ``nvidia`` with
persistence off: nothing marks it, so it stays off until a later VFIO claim of that GPU is unprepared (its prepare
finds it off, ``nvidia-smi`` says "already Disabled", and its record says disabled) or the daemon restarts. The
apply's first write is ``driver_override`` (while the GPU is still on
``nvidia``, where it changes nothing): from then on the override naming a vfio driver marks the function as ours,
so a SIGKILL between any two writes (override set; unbound; bound but the group node not seen; bound but the
record not stored) leaves a function :meth:`VfioPreparer.sweep` finds and gives back to ``nvidia`` at the next
start, unless a stored record holds it. A step that fails after the first write raises
:class:`~dradriver.domain.ports.PartiallyApplied` with the record of the steps done; its undo (the same as a
complete one's) is idempotent. The undo record (kind ``vfio``) holds the facts: ``address``, ``iommuGroup``,
``originalDriver``, ``vfioDriver``, ``vfioModule``, ``minor`` and ``uuid`` of the GPU (``None`` when not known),
``cdev`` (``vfio<N>`` or ``None``), ``steps`` (the writes done, in order) and, since layout 2, ``persistence``
(``"disabled"`` when this prepare turned persistence mode off; absent otherwise, and in every layout-1 record: then
there is nothing to turn on again). An older reader ignores ``persistence`` and leaves persistence off after its
undo (the GPU works; the daemon's next start enables it), so ``reader`` stays 1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dradriver.domain.cdi import VISIBLE_DEVICES_VOID, ContainerEdits, DeviceNode
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef, base_request_name
from dradriver.domain.configs import ConfigGroup
from dradriver.domain.passthrough import NVIDIA_DRIVER, VFIO_DRIVERS, PciFunction, VfioDevice
from dradriver.domain.ports import DevicePlan, PartiallyApplied, UndoRecord
from dradriver.errors import DradriverError
from dradriver.host.nvidiasmi import NvidiaSmi, NvidiaSmiError
from dradriver.host.pci import GpuInUseError, NvidiaNotLoadedError, PciError, PciHost

log = logging.getLogger(__name__)

KIND = "vfio"
UNDO_VERSION = 2
"""Layout 2 added the optional ``persistence`` fact (layout-1 records are undone the same, without it)."""

PERSISTENCE_DISABLED = "disabled"
"""The ``persistence`` fact of a record whose prepare turned persistence mode off."""

LEGACY_ONLY = "LegacyOnly"
PREFER_IOMMUFD = "PreferIommuFD"
"""``iommu.backendPolicy`` values of NVIDIA's VfioDeviceConfig (``api/.../vfiodeviceconfig.go``, ``iommu.go``);
``LegacyOnly`` is the default."""


def _field(obj: object, *names: str) -> Any:
    for name in names:
        if isinstance(obj, Mapping) and name in obj:
            return obj[name]
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def vfio_options(group: ConfigGroup | None) -> tuple[str, bool]:
    """(``iommu.backendPolicy``, ``iommu.enableAPIDevice``) of a claim's VFIO config group; defaults
    (``LegacyOnly``, ``False``) when the group or a field is absent.

    The decoded ``VfioDeviceConfig`` is read by attribute or key, snake or camel case (``iommu.backend_policy`` /
    ``backendPolicy``, ``iommu.enable_api_device`` / ``enableAPIDevice``), with an enum's ``value`` taken as its
    text: the decoder lives in :mod:`dradriver.domain.configs`."""
    config = None if group is None else group.config
    iommu = _field(config, "iommu") if config is not None else None
    if iommu is None:
        return LEGACY_ONLY, False
    policy = _field(iommu, "backend_policy", "backendPolicy")
    policy = getattr(policy, "value", policy)
    api = _field(iommu, "enable_api_device", "enableAPIDevice")
    return (str(policy) if policy else LEGACY_ONLY), bool(api)


class VfioPreparer:
    """Prepares :class:`~dradriver.domain.passthrough.VfioDevice` entries; kind ``vfio``.

    :param host: the node's PCI side.
    :param mig_enabled: GPU UUID -> its MIG mode is on (NVML); ``None``: not checked.
    :param on_change: called after a GPU moved between ``nvidia`` and vfio (the plugin re-discovers and republishes).
    :param persistenced: ``nvidia-persistenced`` runs now (:func:`dradriver.host.persistenced.daemon_running` on the
        driver root); ``None``: never.
    :param nvidia_smi: returns the driver root's ``nvidia-smi`` (called at first use; a node without it fails a VFIO
        claim only where the daemon runs).
    """

    kind = KIND
    side_effects = True

    def __init__(self, host: PciHost, *, mig_enabled: Callable[[str], bool] | None = None,
                 on_change: Callable[[], None] | None = None, persistenced: Callable[[], bool] | None = None,
                 nvidia_smi: Callable[[], NvidiaSmi] | None = None) -> None:
        self.host = host
        self.mig_enabled = mig_enabled
        self.on_change = on_change
        self.persistenced = persistenced
        self._find_nvidia_smi = nvidia_smi
        self._nvidia_smi: NvidiaSmi | None = None

    # -- plan -------------------------------------------------------------------------------------------------

    def handles(self, device: object) -> bool:
        """True for VFIO devices."""
        return isinstance(device, VfioDevice)

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        """The device, its config's IOMMU options and the requests it serves. Reads the function's IOMMU group
        from sysfs (a few small files) so a claim that cannot be prepared is refused before anything is recorded.

        :raises ClaimError: adminAccess; the GPU is in MIG mode, has SR-IOV virtual functions, or shares its IOMMU
            group with a function neither unbound nor on a VFIO driver (each named with its driver).
        """
        assert isinstance(device, VfioDevice)
        names = tuple(dict.fromkeys(base_request_name(r.request) for r in results))
        if any(r.admin_access for r in results):
            raise ClaimError(claim.ref, f"device {device.name!r}: adminAccess is not supported for VFIO devices "
                                        "(a passed-through GPU belongs to one VM)")
        self.check(claim.ref, device)
        policy, api = vfio_options(group)
        return DevicePlan(kind=self.kind, device=device.name, entry=device, request_names=names,
                          admin_access=False, results=tuple(results), group=group,
                          details={"backendPolicy": policy, "enableAPIDevice": api})

    def check(self, ref: ClaimRef, device: VfioDevice) -> PciFunction:
        """The refusals of :meth:`plan`, on the function as sysfs shows it now; returns it.

        :raises ClaimError: as :meth:`plan` (also when the function cannot be read).
        """
        address = device.function.address
        where = f"device {device.name!r} (PCI function {address})"
        try:
            function = self.host.function(address)
            group = self.host.group_of(function)
        except PciError as exc:
            raise ClaimError(ref, f"{where}: {exc}") from exc
        if device.parent_uuid is not None and self.mig_enabled is not None and self.mig_enabled(device.parent_uuid):
            raise ClaimError(ref, f"{where}: GPU {device.parent_uuid} is in MIG mode; a GPU is passed through "
                                  "whole, with MIG mode off")
        if function.sriov_numvfs:
            raise ClaimError(ref, f"{where}: {function.sriov_numvfs} SR-IOV virtual function(s) are enabled "
                                  f"({self.host.device_path(address) / 'sriov_numvfs'}); passthrough needs 0")
        if function.driver not in (None, NVIDIA_DRIVER, *VFIO_DRIVERS):
            raise ClaimError(ref, f"{where}: bound to driver {function.driver!r}, neither {NVIDIA_DRIVER} nor a "
                                  "VFIO driver; it is not taken from it")
        others = [f for f in group.functions if f.address != address and f.driver is not None and not f.on_vfio]
        if others:
            listed = ", ".join(f"{f.address} (driver {f.driver})" for f in others)
            raise ClaimError(ref, f"{where}: IOMMU group {group.number} also holds {listed}; every function of "
                                  "the group must be unbound or on a VFIO driver before the group can be passed "
                                  "through")
        return function

    # -- apply ------------------------------------------------------------------------------------------------

    def _record(self, device: VfioDevice, facts: dict[str, Any]) -> UndoRecord:
        return UndoRecord(self.kind, UNDO_VERSION, device.name, dict(facts))

    # -- persistence ------------------------------------------------------------------------------------------

    def _daemon_running(self) -> bool:
        return self.persistenced is not None and self.persistenced()

    def _set_persistence(self, address: str, enabled: bool) -> str:
        """``nvidia-smi -i <address> -pm 1|0``.

        :raises NvidiaSmiError: the tool is missing under the driver root, or failed.
        """
        if self._nvidia_smi is None:
            if self._find_nvidia_smi is None:
                raise NvidiaSmiError("no nvidia-smi is configured")
            self._nvidia_smi = self._find_nvidia_smi()
        return self._nvidia_smi.set_persistence_mode(address, enabled)

    def _persistence_back(self, claim: ClaimRef, address: str) -> str:
        """Persistence on again after a refusal before the first write; ``""`` or a note for the claim's error."""
        try:
            self._set_persistence(address, True)
        except NvidiaSmiError as exc:
            log.warning("claim %s: persistence mode of GPU %s stays off: %s", claim, address, exc)
            return f" (persistence mode could not be turned on again: {exc})"
        return ""

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        """Bind the GPU to its vfio driver: check, load the module, turn persistence mode off where
        ``nvidia-persistenced`` runs, refuse a GPU in use, set ``driver_override``, unbind from ``nvidia``, bind,
        wait for ``/dev/vfio/<group>``.

        :raises ClaimError: a refusal of :meth:`check`; persistence mode could not be turned off (``nvidia-smi``'s
            command line, status and output; nothing was changed); the GPU is in use (the processes named;
            persistence turned on again first).
        :raises DradriverError: the module could not be loaded (nothing was changed).
        :raises PartiallyApplied: a step after the first write failed; its record undoes what was done.
        """
        device = plan.entry
        assert isinstance(device, VfioDevice)
        function = self.check(claim, device)
        address = function.address
        module, driver = self.host.vfio_variant(function)
        assert function.iommu_group is not None  # check() read its group
        facts: dict[str, Any] = {
            "address": address, "iommuGroup": function.iommu_group, "originalDriver": function.driver,
            "vfioDriver": driver, "vfioModule": module, "minor": device.parent_minor, "uuid": device.parent_uuid,
            "cdev": function.vfio_cdev, "steps": [],
            "backendPolicy": plan.details.get("backendPolicy", LEGACY_ONLY),
            "enableAPIDevice": bool(plan.details.get("enableAPIDevice")),
        }
        if function.driver == driver and function.driver_override == driver:
            self.host.wait_group_node(function.iommu_group, address)
            return self._record(device, facts)  # already passed through (a retried prepare): nothing to do
        self.host.load_module(module, address=address)
        if function.driver == NVIDIA_DRIVER and self._daemon_running():
            try:
                self._set_persistence(address, False)
            except NvidiaSmiError as exc:
                raise ClaimError(claim, f"device {device.name!r} (PCI function {address}): turning persistence mode "
                                        f"off for nvidia-persistenced failed, nothing was changed: {exc}") from exc
            facts["persistence"] = PERSISTENCE_DISABLED
        try:
            if device.parent_minor is not None and function.driver == NVIDIA_DRIVER:
                self.host.check_not_in_use(address, device.parent_minor)
        except GpuInUseError as exc:
            note = self._persistence_back(claim, address) if "persistence" in facts else ""
            raise ClaimError(claim, f"device {device.name!r}: {exc}{note}") from exc
        except BaseException:
            if "persistence" in facts:
                self._persistence_back(claim, address)
            raise
        steps: list[str] = facts["steps"]
        try:
            self.host.set_driver_override(address, driver)
            steps.append("override")
            if function.driver not in (None, driver):
                self.host.unbind(address)
                steps.append("unbind")
            self.host.bind(address, driver)
            steps.append("bind")
            self.host.wait_group_node(function.iommu_group, address)
            steps.append("groupNode")
            facts["cdev"] = self.host.vfio_cdev(address)
        except DradriverError as exc:
            raise PartiallyApplied(claim, f"device {device.name!r}: {exc}", self._record(device, facts)) from exc
        finally:
            if steps and self.on_change is not None:
                self.on_change()
        log.info("claim %s: GPU %s (%s) bound to %s", claim, address, device.parent_uuid or "uuid unknown", driver)
        return self._record(device, facts)

    # -- edits ------------------------------------------------------------------------------------------------

    def _node(self, path: str) -> DeviceNode:
        root = str(self.host.dev_root).rstrip("/")
        return DeviceNode(path, root + path if root else "")

    def _options(self, plan: DevicePlan, record: UndoRecord) -> tuple[bool, bool]:
        """(iommufd, API device) of a prepared device: the plan's config, else (a spec rendered again from the claim
        state has no plan details) what the record stored at apply."""
        policy = plan.details.get("backendPolicy", record.data.get("backendPolicy"))
        api = plan.details.get("enableAPIDevice", record.data.get("enableAPIDevice"))
        cdev = record.data.get("cdev")
        iommufd = policy == PREFER_IOMMUFD and isinstance(cdev, str) and self.host.iommufd_available()
        return iommufd, bool(api)

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        """The device's node: ``/dev/vfio/<group>``, or ``/dev/vfio/devices/vfio<N>`` (iommufd). The env and the
        API device are the claim's, once: :meth:`claim_edits`.

        :raises UndoRecordFactError: the record lacks the group.
        """
        group = record.fact("iommuGroup", int)
        iommufd, _ = self._options(plan, record)
        cdev = record.fact("cdev", str, default=None)
        return ContainerEdits(device_nodes=(
            self._node(f"/dev/vfio/devices/{cdev}" if iommufd else f"/dev/vfio/{group}"),))

    def claim_edits(self, claim: ClaimRef, plans: Sequence[DevicePlan],
                    records: Sequence[UndoRecord]) -> ContainerEdits:
        """The spec-level edits of a claim's VFIO devices, in place of the driver's user space (NVIDIA's
        ``cmd/gpu-kubelet-plugin/vfio-cdi.go``: the VFIO common edits replace the spec-level ones):
        ``NVIDIA_VISIBLE_DEVICES=void`` and, when a device's config has ``iommu.enableAPIDevice``, the API device
        (``/dev/iommu`` with iommufd, else ``/dev/vfio/vfio``), each once however many devices the claim has."""
        by_target = {r.target: r for r in records if r.kind == self.kind}
        nodes: dict[str, DeviceNode] = {}
        for plan in plans:
            record = by_target.get(plan.device) or UndoRecord(self.kind, 0, plan.device)
            iommufd, api = self._options(plan, record)
            if api:
                path = "/dev/iommu" if iommufd else "/dev/vfio/vfio"
                nodes.setdefault(path, self._node(path))
        return ContainerEdits(env=(VISIBLE_DEVICES_VOID,), device_nodes=tuple(nodes.values()))

    # -- undo -------------------------------------------------------------------------------------------------

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Give the function back to ``nvidia`` (override cleared, vfio driver unbound, ``nvidia`` bound), then,
        when the record says its prepare turned persistence mode off (``"persistence": "disabled"``) and
        ``nvidia-persistenced`` runs, turn it on again (``nvidia-smi -i <address> -pm 1``; "already Enabled" is
        success). Idempotent: a function on ``nvidia`` without override, or one no longer on the bus, is given back
        already (persistence is still turned on again for the former).

        A failing ``nvidia-smi`` here is logged as a warning, not raised: the GPU is back on ``nvidia`` and usable,
        which is what the claim's undo owes; raising would keep the claim recorded and its ``gpu-<minor>`` sibling
        withdrawn on every retry of the kubelet for a setting that only costs start-up latency, and
        nvidia-persistenced turns persistence on for every GPU at its own next start. Without the daemon
        persistence is left off (turning it on then would set the driver's legacy mode, which the node did not
        have).

        While the ``nvidia`` kernel module is unloaded (a driver upgrade: ``sys/bus/pci/drivers/nvidia`` is gone, a
        bind to it cannot happen) the give-back is refused before any write, so the GPU stays on its vfio driver,
        the state the record describes, rather than on no driver: the runner keeps the record with the released
        claim while the plugin knows the driver is away and runs it once the driver is back
        (:meth:`~dradriver.kubeletplugin.runner.BatchRunner.resume_undo`); before the plugin has noticed, the
        unprepare fails naming the claim and the reason, and the kubelet's retry is kept so.

        :raises NvidiaNotLoadedError: ``nvidia`` is not loaded (nothing written, nothing re-read).
        :raises PciError: a step failed (the claim stays recorded; the undo is retried).
        """
        address = record.fact("address", str)
        if not self.host.device_path(address).exists():
            log.warning("claim %s: PCI function %s of %s is gone from the bus; nothing to give back", claim,
                        address, record.target)
            return
        function = self.host.function(address)
        if function.driver != NVIDIA_DRIVER or function.driver_override is not None:
            written = True
            try:
                self.host.rebind_nvidia(address)
            except NvidiaNotLoadedError:
                written = False
                raise
            finally:
                if written and self.on_change is not None:
                    self.on_change()
            log.info("claim %s: GPU %s (%s) given back to %s", claim, address,
                     record.fact("uuid", str, default="uuid unknown"), NVIDIA_DRIVER)
        if record.data.get("persistence") != PERSISTENCE_DISABLED:
            return
        if not self._daemon_running():
            log.info("claim %s: nvidia-persistenced is not running; persistence mode of GPU %s is left off (the "
                     "daemon enables it at its start)", claim, address)
            return
        try:
            self._set_persistence(address, True)
        except NvidiaSmiError as exc:
            log.warning("claim %s: GPU %s is back on %s but persistence mode could not be turned on again (run "
                        "nvidia-smi -i %s -pm 1 on the node): %s", claim, address, NVIDIA_DRIVER, address, exc)

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Give back to ``nvidia`` every NVIDIA GPU function whose ``driver_override`` names a VFIO driver (the
        mark :meth:`apply` sets first) and that no stored record holds; returns their addresses.

        :raises PciError: a function could not be given back.
        """
        held = {r.data.get("address") for r in known}
        removed: list[str] = []
        for function in self.host.gpus():
            if function.address in held or function.driver_override not in VFIO_DRIVERS:
                continue
            if function.driver not in (None, *VFIO_DRIVERS, NVIDIA_DRIVER):
                continue
            self.host.rebind_nvidia(function.address)
            removed.append(function.address)
        if removed and self.on_change is not None:
            self.on_change()
        return removed
