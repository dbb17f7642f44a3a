"""The ``gpu.nvidia.com`` kubelet plugin (``dradriver gpu-kubelet-plugin``): its composition, nothing else.

Steps, in order (stopped in reverse): compiled hot paths -> Kubernetes client and this Node (a bad kubeconfig
fails here, before anything on the host is touched) -> plugin and CDI directories -> NVML session -> device
discovery into the device registry -> the driver's user space for CDI specs -> the CDI hook they name (copied from
the image, checked: :func:`dradriver.app.assembly.check_cdi_hook`) -> device-plugin guard -> per-node
device policy (:mod:`dradriver.kubeletplugin.nodepolicy`, its Node watch after the publisher) -> claim state -> batch
runner with the consumable-share (when
``--consumable-shares`` is on), full-GPU and static-MIG preparers (and, with the ``DynamicMIG`` gate, the
dynamic-MIG preparer over every eligible GPU's placements; with ``PassthroughSupport`` the VFIO preparer, its
``gpu-vfio-<index>`` devices read from the PCI functions at each discovery, NVML initialised anew and the pool
republished, the sibling withdrawn, after each GPU moved between drivers) and the sharing steps (MPS control daemons
with the ``MPSSupport`` gate), the Fabric Manager partition step (``FabricManagerPartitioning``, where Fabric
Manager is detected), and crash convergence -> health monitor -> metrics endpoint -> gRPC servers ->
ResourceSlice publisher -> NVIDIA driver watch. Without a usable driver (not loaded, no ``libnvidia-ml.so.1``)
the plugin starts all the same with no devices: it unprepares, refuses prepares with the reason, and reads the
devices once the driver is back (:mod:`dradriver.kubeletplugin.driverstate`); a driver reloaded under the running plugin
is detected and handled the same way, the prepared claims' CDI specs then rewritten for the new driver's files.
The ``gpu-kubelet-plugin`` command serves the gRPC sockets first instead
(:mod:`dradriver.server.deferred`, ``start_plugin(early=...)``): the kubelet registers the plugin within
~0.2 s of process start and claims it sends meanwhile wait until the runner is attached at the servers' place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dradriver import _native
from dradriver.app import assembly
from dradriver.config import PluginConfig
from dradriver.domain import cdi, configs, mps, nodeallocatable, partitions, pools
from dradriver.domain.claims import ClaimRef
from dradriver.domain.devices import DeviceIndex, DriverVersions, NodeInventory
from dradriver.domain.faults import DEFAULT_IGNORED_XIDS
from dradriver.domain.featuregates import DYNAMIC_MIG, FABRIC_MANAGER_PARTITIONING, MPS_SUPPORT, PASSTHROUGH_SUPPORT
from dradriver.domain.fmpartitions import with_partitions
from dradriver.domain.identity import GPU_DRIVER, DriverIdentity
from dradriver.domain.migplacements import dynamic_index
from dradriver.domain.passthrough import vfio_devices
from dradriver.domain.ports import ClaimStep, SharingStep, UndoRecord
from dradriver.domain.registry import DeviceRegistry
from dradriver.errors import DradriverError
from dradriver.health.metrics import DriverMetrics, MetricsServer
from dradriver.health.monitor import HealthMonitor
from dradriver.host import driverfiles, persistenced
from dradriver.host import fabricmanager as fabric
from dradriver.host.claimstate import ClaimState, ClaimStateProblem
from dradriver.host.devicenodes import DeviceNodeInfo, EditsCache, read_identities
from dradriver.host.nvidiasmi import NvidiaSmi, find_nvidia_smi
from dradriver.host.pci import PciError, PciHost
from dradriver.host.pluginlocks import PluginLocks
from dradriver.kube import errors as kube_errors
from dradriver.kube import nodes as kube_nodes
from dradriver.kube import version
from dradriver.kube.client import KubeClient
from dradriver.kube.resourceslices import SlicePublisher
from dradriver.kubeletplugin import driverstate, guard, rollback
from dradriver.kubeletplugin.adoption import GpuAdoption
from dradriver.kubeletplugin.devicestatus import DeviceStatusWriter, gpu_describer
from dradriver.kubeletplugin.driverstate import DriverGate, DriverWatch, ReloadDetector
from dradriver.kubeletplugin.lifecycle import Lifecycle
from dradriver.kubeletplugin.nodepolicy import NodePolicyWatch
from dradriver.kubeletplugin.payload import read_payload
from dradriver.kubeletplugin.refresher import DeviceRefresher
from dradriver.kubeletplugin.runner import BatchRunner, RecoveryReport, all_undo_records
from dradriver.nvml import discovery
from dradriver.nvml import settings as nvml_settings
from dradriver.nvml.errors import NvmlError
from dradriver.nvml.mig import MigControl
from dradriver.nvml.session import NvmlSession
from dradriver.preparers import gpu as gpu_preparers
from dradriver.preparers.dynamicmig import KIND as DYNAMIC_MIG_KIND
from dradriver.preparers.dynamicmig import DynamicMigPreparer
from dradriver.preparers.fabricpartition import KIND as FM_PARTITION_KIND
from dradriver.preparers.fabricpartition import FabricPartitionStep
from dradriver.preparers.gpu import FullGpuPreparer, StaticMigPreparer
from dradriver.preparers.mps import ControlDaemons, MpsSharing
from dradriver.preparers.shares import ShareDaemons, SharedDevicePreparer
from dradriver.preparers.sharing import TimeSlicing, default_steps
from dradriver.preparers.vfio import KIND as VFIO_KIND
from dradriver.preparers.vfio import VfioPreparer
from dradriver.server import Servers
from dradriver.server.deferred import EarlyServers

log = logging.getLogger(__name__)

PASSTHROUGH_EVENT_WAIT_MS = 200
"""With ``PassthroughSupport``: the health monitor's NVML event wait (``nvmlEventSetWait`` timeout, ms). Every GPU
swap between ``nvidia`` and ``vfio-pci`` re-initialises NVML between two batches of the runner, with the monitor
stopped, and a stop waits for the event wait in progress to time out: at 1000 ms an unprepare right after a VFIO
prepare waited about a second. Five wake-ups a second cost nothing measurable."""


@dataclass
class GpuPlugin(assembly.KubeletPlugin):
    """A running ``gpu.nvidia.com`` kubelet plugin. Create with :func:`start_plugin`; stop with ``stop()``."""

    session: NvmlSession | None = None
    registry: DeviceRegistry[NodeInventory] | None = None
    guard_verdict: guard.GuardVerdict = field(default_factory=lambda: guard.GuardVerdict(False, ""))
    health: HealthMonitor | None = None
    metrics: DriverMetrics | None = None
    metrics_server: MetricsServer | None = None
    refresher: DeviceRefresher | None = None
    """With the ``DynamicMIG`` gate: re-reads the devices after MIG changes."""
    status_writer: DeviceStatusWriter | None = None
    """Publishes every prepared device's identity in ``ResourceClaim.status.devices`` (KEP-4817)."""
    mps_daemons: ControlDaemons | None = None
    """The MPS control daemons of the ``MPS`` sharing step (``None`` without the MPSSupport gate)."""
    driver: DriverWatch | None = None
    """Whether the NVIDIA driver can be used now, and why not (:mod:`dradriver.kubeletplugin.driverstate`)."""
    node_policy: NodePolicyWatch | None = None
    """The per-node device policy (gate ``PerNodeGPUConfig``; :mod:`dradriver.kubeletplugin.nodepolicy`)."""

    @property
    def inventory(self) -> NodeInventory:
        """This node's devices now (the device registry's snapshot)."""
        assert self.registry is not None
        return self.registry.snapshot


def node_info(config: PluginConfig) -> DeviceNodeInfo:
    """Where device nodes are read from and where the runtime finds them on the host.

    NVIDIA's rule: the device nodes live under the driver root only when ``<driver root>/dev`` exists (a driver
    container); otherwise (a host install, GKE's ``/home/kubernetes/bin/nvidia``, Talos) they are the host's own
    ``/dev``, read under ``--dev-root``. ``hostPath`` is written only in the first case, as driver root + path, so
    every ``hostPath`` of a spec names a node that exists.
    """
    in_driver_root = str(config.nvidia_driver_root) != "/" and (config.container_driver_root / "dev").is_dir()
    return DeviceNodeInfo(
        dev_root=config.container_driver_root if in_driver_root else config.dev_root,
        host_root=str(config.nvidia_driver_root) if in_driver_root else "/",
        proc_devices=config.proc_devices_path,
        mig_minors=config.proc_root / "driver" / "nvidia-caps" / "mig-minors",
        capabilities_dir=config.proc_root / "driver" / "nvidia" / "capabilities",
    )


def nvml_library(config: PluginConfig) -> str:
    """The NVML library to load: ``--nvml-library``; else, as NVIDIA's plugin does, ``libnvidia-ml.so.1`` under the
    container's driver root (``--container-driver-root``, where NVIDIA's chart mounts the driver); else ``""`` (the
    loader's search path). With ``--mock-profile`` the bundled mock decides and this returns ``--nvml-library``."""
    if config.nvml_library or config.mock_profile:
        return config.nvml_library
    found = driverfiles.find_nvml_library(config.container_driver_root)
    if found is None:
        return ""
    log.info("NVML library %s (under the driver root %s)", found, config.container_driver_root)
    return str(found)


def driver_edits(config: PluginConfig, driver_version: str) -> cdi.ContainerEdits:
    """Spec-level edits giving containers the driver's user space, found once (they change only with the driver).

    With a real driver a root without ``libcuda.so.<version>`` is an error; with the mock NVML
    (``--mock-profile``) it means no driver files, and claim specs carry device nodes only.

    :raises driverfiles.DriverFilesError: the driver root does not hold driver ``driver_version``.
    """
    files = driverfiles.discover_driver_files(
        config.container_driver_root, driver_version,
        firmware_path=driverfiles.read_firmware_path(config.sysfs_root), require=not config.mock_profile)
    if not files.found:
        log.info("no files of NVIDIA driver %s under %s (mock NVML): claim CDI specs carry device nodes only",
                 driver_version, config.container_driver_root)
        return cdi.ContainerEdits()
    log.info("NVIDIA driver %s: %d file(s) under %s mounted into claim containers from %s", driver_version,
             files.count(), config.container_driver_root, config.nvidia_driver_root)
    return driverfiles.driver_edits(files, host_root=str(config.nvidia_driver_root),
                                    hook_path=config.cdi_hook_path)


def read_driver(session: NvmlSession, config: PluginConfig,
                driver_root: driverfiles.DriverRootEdits | None = None,
                extend: Callable[[NodeInventory], NodeInventory] | None = None,
                ) -> tuple[NodeInventory, cdi.ContainerEdits]:
    """What the plugin needs from an available driver: this node's devices (:func:`discover`, then ``extend``:
    :meth:`HostDevices.extend`) and the spec-level edits of the driver's user space (:func:`driver_edits`; through
    ``driver_root``, which watches them from then on, when given), at start or when a driver that was absent is
    back.

    :raises driverfiles.DriverFilesError: the driver root does not hold the driver NVML reports.
    :raises dradriver.nvml.errors.NvmlError: discovery failed.
    """
    inventory = discover(session, config)
    if extend is not None:
        inventory = extend(inventory)
    if config.feature_gates.dynamic_mig:  # the gate on: every eligible GPU offers its placements
        log.info("DynamicMIG: %d MIG placement(s) on %d GPU(s)", len(inventory.placements),
                 len({p.parent.uuid for p in inventory.placements}))
    version = inventory.versions.driver
    return inventory, driver_root.read(version) if driver_root is not None else driver_edits(config, version)


def spec_level_edits(cache: EditsCache, nodes: DeviceNodeInfo, registry: DeviceRegistry[NodeInventory],
                     driver_root: driverfiles.DriverRootEdits) -> cdi.ContainerEdits:
    """The spec-level edits of every claim spec (control nodes, the driver's user space), reused while the driver
    version, ``/proc/devices`` and the driver root's stamp are what they were computed from (one ``stat`` and one
    read of ``/proc/devices`` per spec).

    :raises DeviceNodeError: a control node's major is unknown.
    :raises driverfiles.DriverFilesError: the driver root changed and does not hold the driver.
    """
    stamp, common = driver_root.current()
    return cache.get(("spec", registry.snapshot.versions.driver, stamp),
                     lambda: gpu_preparers.spec_edits(nodes, common))


def devices_unknown(session: NvmlSession, registry: DeviceRegistry[NodeInventory]) -> str:
    """Why the device registry does not hold the driver's devices now (``""`` when it does): NVML is not
    available, or a driver that came back is available but its devices are not read yet (the registry's snapshot
    has no driver version until they are)."""
    if not session.available:
        return session.unavailable_reason or "NVML session closed"
    return "" if registry.snapshot.versions.driver else "the NVIDIA driver's devices are not read yet"


def report_undo_only(state: ClaimState, gates_off: Sequence[tuple[str, str]]) -> None:
    """Log, for each feature gate that is off while prepared claims hold undo records of its kind (claims prepared
    while it was on), how many claims: their part is registered to undo only (``BatchRunner(undo_only=...)``).

    :param gates_off: ``(gate name, record kind)`` of each undo-only part.
    """
    if not gates_off:
        return
    held: dict[str, int] = {}
    for record in state.claims().values():
        try:
            kinds = {undo.kind for undo in read_payload(record.payload).undo}
        except ValueError:  # logged by the runner's readers
            continue
        for kind in kinds:
            held[kind] = held.get(kind, 0) + 1
    for gate, kind in gates_off:
        if held.get(kind):
            log.info("%s is off: %d prepared claim(s) hold %s undo records from when it was on; each is undone "
                     "when the kubelet unprepares it (no new one is prepared)", gate, held[kind], kind)


def read_server_version(client: KubeClient) -> tuple[int, int] | None:
    """``(major, minor)`` of the API server, or ``None`` (warned) when ``GET /version`` fails."""
    try:
        return version.server_version(client)
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot read the API server version (%s)", exc)
        return None


def slice_layout_version(server: tuple[int, int] | None, dynamic_mig: bool) -> tuple[int, int]:
    """The Kubernetes version whose ResourceSlice rules the pool follows (dynamic MIG: combined layout before
    1.35, split from 1.35; NVIDIA's ``cmd/gpu-kubelet-plugin/driver.go``). Unknown: 1.34's combined layout, logged."""
    if server is None:
        if dynamic_mig:
            log.warning("API server version unknown: dynamic MIG slices use the Kubernetes 1.34 layout")
        return (1, 34)
    return server


def control_daemons(config: PluginConfig, client: KubeClient, session: NvmlSession, *, shares: bool = False
                    ) -> ControlDaemons:
    """The node's MPS control daemons: Deployments in ``--namespace`` running ``--image-name``, directories under
    ``<plugin dir>/mps`` (``<plugin dir>/mps-shares`` and Deployment kind label ``share`` for the daemons of
    consumable shares, so neither sweep touches the other's), compute mode through NVML
    (``dradriver.nvml.settings``), shm sized from ``<proc root>/meminfo``."""
    placement = mps.DaemonPlacement(
        namespace=config.namespace, node_name=config.node_name, image=config.image_name,
        driver_root=str(config.nvidia_driver_root), directory="",
        shm_in_driver_root=(config.container_driver_root / "dev" / "shm").is_dir(),
        feature_gates=config.feature_gates.render(), service_account=config.service_account_name,
        pull_secrets=config.image_pull_secrets, pull_policy=config.image_pull_policy,
        kind="share" if shares else "claim")

    def set_compute_mode(uuid: str, mode: str) -> None:
        nvml_settings.set_compute_mode(session, uuid, nvml_settings.ComputeMode[mode])

    return ControlDaemons(root=config.plugin_dir / "mps-shares" if shares else config.mps_root, client=client,
                          placement=placement, set_compute_mode=set_compute_mode,
                          meminfo=config.proc_root / "meminfo", mounts=config.mounts)


def supports_informational_taints(client: KubeClient) -> bool:
    """DeviceTaint effect ``None`` exists from Kubernetes 1.35; older servers get no informational taints."""
    try:
        return version.server_version(client) >= (1, 35)
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot read the API server version (%s); informational taints disabled", exc)
        return False


def discover(session: NvmlSession, config: PluginConfig) -> NodeInventory:
    """This node's GPUs, MIG devices and clique (and, with the ``DynamicMIG`` gate, MIG placements), logged."""
    inventory = discovery.discover(session, sysfs_root=config.sysfs_root,
                                   dynamic_mig=config.feature_gates.dynamic_mig)
    for failure in inventory.failures:
        log.error("GPU %d left out: %s", failure.index, failure.reason)
    log.info("discovered %d GPU(s), %d MIG device(s), %d allocatable device(s)%s", len(inventory.gpus),
             len(inventory.migs), len(inventory.allocatable()),
             f", clique {inventory.clique.id}" if inventory.clique else "")
    return inventory


def pci_host(config: PluginConfig) -> PciHost:
    """The node's PCI side for VFIO passthrough: ``--sysfs-root``, ``--dev-root``, ``--proc-root``, and modules
    loaded by ``chroot <--host-root> modprobe`` (NVIDIA's ``cmd/gpu-kubelet-plugin/vfio-device.go``; the
    ``DRADRIVER_MODPROBE`` command instead when set), whose installed modules are read under ``--host-root``."""
    return PciHost(sysfs_root=config.sysfs_root, dev_root=config.dev_root, proc_root=config.proc_root,
                   modprobe=config.modprobe or ("chroot", str(config.host_root), "modprobe"),
                   modules_root=config.host_root)


def check_passthrough_host(config: PluginConfig, host: PciHost) -> None:
    """The start requirements of the ``PassthroughSupport`` gate, as NVIDIA's plugin checks them
    (``cmd/gpu-kubelet-plugin/vfio-device.go``): the host's ``/`` mounted at ``--host-root`` (``modprobe`` runs
    chrooted there), and the IOMMU on (``<sysfs>/kernel/iommu_groups`` not empty; the kernel's
    ``Documentation/ABI/testing/sysfs-kernel-iommu_groups``).

    :raises DradriverError: naming the path that is missing or empty.
    """
    if not config.host_root.is_dir():
        raise DradriverError(f"PassthroughSupport: --host-root {config.host_root} does not exist (the host's / must "
                             "be mounted there: kernel modules are loaded by chroot into it)")
    if not host.iommu_enabled():
        raise DradriverError(f"PassthroughSupport: {host.sysfs_root / 'kernel' / 'iommu_groups'} is missing or empty: "
                             "the IOMMU is off on this node (enable it in the firmware and on the kernel command line, "
                             "e.g. intel_iommu=on or amd_iommu=on), or turn the gate off")


def known_vfio_parents(records: Iterable[UndoRecord]) -> dict[str, tuple[int, str]]:
    """PCI address -> (minor, GPU UUID) of each GPU a stored VFIO undo record says it passed through (the GPU has
    left NVML; its ``gpu-vfio-<index>`` keeps its sibling ``gpu-<minor>``)."""
    out: dict[str, tuple[int, str]] = {}
    for record in records:
        if record.kind != VFIO_KIND:
            continue
        address, minor, uuid = (record.data.get(k) for k in ("address", "minor", "uuid"))
        if isinstance(address, str) and isinstance(minor, int) and isinstance(uuid, str):
            out[address] = (minor, uuid)
    return out


@dataclass
class HostDevices:
    """What the host adds to NVML's devices at each discovery: each GPU's Fabric Manager partition IDs
    (``FabricManagerPartitioning``, only where Fabric Manager is detected: :func:`dradriver.host.fabricmanager.
    open_client`) and the ``gpu-vfio-<index>`` devices from the PCI functions (``PassthroughSupport``).

    :param pci: the PCI side (``None``: no VFIO devices).
    :param fm: the Fabric Manager client (``None``: no partitions).
    :param known: the parents the stored VFIO undo records know (:func:`known_vfio_parents`).
    :param last: the registry's snapshot before this discovery: a GPU on vfio keeps the parent, module ID and
        partitions it had while NVML listed it.
    """

    pci: PciHost | None = None
    fm: fabric.FabricManagerClient | None = None
    known: Callable[[], Mapping[str, tuple[int, str]]] = dict
    last: Callable[[], NodeInventory | None] = lambda: None

    def extend(self, inventory: NodeInventory) -> NodeInventory:
        """``inventory`` with partitions and VFIO devices. Fabric Manager or sysfs failing is logged, and the
        devices are published without what it would give."""
        if self.fm is not None:
            try:
                inventory = with_partitions(inventory, self.fm.partitions())
            except fabric.FabricManagerError as exc:
                log.error("Fabric Manager partitions not read (GPUs published without partition<N>): %s", exc)
        if self.pci is None:
            return inventory
        try:
            functions = self.pci.functions()
        except PciError as exc:
            log.error("PCI functions not read (no VFIO devices published): %s", exc)
            return dataclasses.replace(inventory, vfio=())
        last = self.last()
        parents: dict[str, tuple[int, str]] = {}
        module_ids: dict[str, int] = {}
        partitions: dict[str, dict[int, int]] = {}
        for before in (last.vfio if last is not None else ()):
            address = before.function.address
            if before.parent_minor is not None and before.parent_uuid is not None:
                parents[address] = (before.parent_minor, before.parent_uuid)
            if before.module_id is not None:
                module_ids[address] = before.module_id
            if before.partitions:
                partitions[address] = dict(before.partitions)
        parents.update(self.known())
        for gpu in inventory.gpus:
            if gpu.module_id is not None:
                module_ids[gpu.pci_bus_id] = gpu.module_id
            partitions[gpu.pci_bus_id] = dict(gpu.partitions)
        vfio = vfio_devices(functions, inventory.gpus, iommufd=self.pci.iommufd_available(), module_ids=module_ids,
                            partitions=partitions, known_parents=parents)
        return dataclasses.replace(inventory, vfio=vfio)


async def open_node_policy(identity: DriverIdentity, config: PluginConfig,
                           connection: assembly.Connection) -> NodePolicyWatch:
    """Start step: the policy the Node read at start asks for (:class:`NodePolicyWatch`, not watching yet)."""
    labels = kube_nodes.Node.from_object(connection.node).labels if connection.node is not None else None

    def report(reason: str, message: str, type_: str) -> None:
        assembly.report_event(identity, connection.client, config, connection.node_uid, reason, message, type_=type_)

    return await asyncio.to_thread(NodePolicyWatch, connection.client, config, labels, report=report)


async def watch_node_policy(life: Lifecycle, watch: NodePolicyWatch, on_change: Callable[[], None]) -> None:
    """Start step: watch the Node and call ``on_change`` (republish) after each policy change; stopped on stop."""
    watch.on_change = on_change
    await life.step("node device policy watch", watch.start, lambda _: asyncio.to_thread(watch.stop))


async def start_plugin(config: PluginConfig, identity: DriverIdentity = GPU_DRIVER, *,
                       early: EarlyServers | None = None) -> GpuPlugin:
    """Start every part of the GPU kubelet plugin and return it running.

    :param identity: the plugin's names; tests run a second identity beside the default one.
    :param early: servers already serving this config's sockets (:func:`dradriver.server.deferred.start_early`):
        the claims waiting on them are handed to the runner where the servers would otherwise start. On a
        failed start they are left to the caller (:func:`run_plugin` fails and stops them).
    :raises dradriver.errors.DradriverError: a part cannot start (no API access, socket in use by a live plugin,
        unreadable newer claim-state format, an ``nvmlInit`` failure other than the driver's absence); nothing is
        left running. A driver that is absent is no error (see the module docstring).
    """
    if config.driver_name != identity.driver_name:  # sockets, plugin directory and lock follow the identity
        config = dataclasses.replace(config, driver_name=identity.driver_name)
    implementations = _native.load_all()  # a missing compiled module fails here, loudly, not at first use
    log.info("hot paths: %s", ", ".join(f"{k}={v}" for k, v in implementations.items()))
    start = _GpuStart(identity, config, Lifecycle(identity.driver_name))
    try:
        await start.read_devices()
        await start.check_cdi_hook()
        await start.check_device_plugin()
        await start.open_node_policy()
        await start.open_claim_state()
        start.build_runner()
        await start.converge()
        await start.make_publisher()
        await start.remember_driver()
        await start.start_health()
        await start.serve(early)
        plugin = start.assemble()
        await start.publish(plugin)
        await start.watch_driver(plugin)
        await start.clean_stale_claims(plugin)
    except BaseException:
        await start.life.stop(1.0)
        raise
    log.info("kubelet plugin for %s on node %s serving at %s", identity.driver_name, config.node_name,
             config.dra_socket)
    return plugin


class _GpuStart:
    """The GPU plugin's parts while :func:`start_plugin` assembles them: one method per start step, in the order
    the steps run (each sets the parts it makes; the lifecycle stops them in reverse), and the driver watch's
    ``depart`` and ``arrive`` (:meth:`driver_away`, :meth:`driver_back`)."""

    connection: assembly.Connection
    session: NvmlSession
    mig_control: MigControl | None
    registry: DeviceRegistry[NodeInventory]
    driver_root: driverfiles.DriverRootEdits
    """The spec-level edits of the driver's user space, found again when a driver that was absent comes back or the
    driver root changes under the same version."""
    hook_refusal: Callable[[], str]
    verdict: guard.GuardVerdict
    node_policy: NodePolicyWatch
    state: ClaimState
    problems: tuple[ClaimStateProblem, ...]
    metrics: DriverMetrics
    nodes: DeviceNodeInfo
    edits_cache: EditsCache
    detector: ReloadDetector
    watch: DriverWatch
    status_writer: DeviceStatusWriter
    refresher: DeviceRefresher | None
    mps_daemons: ControlDaemons | None
    checkpoint: rollback.RollbackCheckpoint | None
    runner: BatchRunner
    recovery: RecoveryReport
    publisher: SlicePublisher
    layout: tuple[int, int]
    informational: bool
    health: HealthMonitor
    refusal: Callable[[], str]
    metrics_server: MetricsServer | None
    servers: Servers
    host_devices: HostDevices
    pci: PciHost
    fm: fabric.FabricManagerClient | None
    swaps: DeviceRefresher
    """Re-reads the devices with NVML initialised anew after VFIO passthrough moved a GPU between drivers."""

    def __init__(self, identity: DriverIdentity, config: PluginConfig, life: Lifecycle) -> None:
        self.identity, self.config, self.life = identity, config, life
        self.plugin_ref: list[GpuPlugin] = []
        self.partition_cache = partitions.PartitionCache()
        self._last_desired: list[list[dict[str, Any]]] = []

    async def read_devices(self) -> None:
        """Validate, then touch the host (:func:`assembly.open_host`: no directory is created before the API server
        answers), then read the driver's devices and files into the device registry (none while it is absent)."""
        identity, config = self.identity, self.config
        self.connection, session = await assembly.open_host(self.life, identity, config, nvml_library(config))
        self.session = session
        dynamic_mig = config.feature_gates.dynamic_mig
        self.mig_control = MigControl(session) if dynamic_mig else None
        self.host_devices = await asyncio.to_thread(self._host_devices)
        # the driver's files, found again when the driver root changes under the same version
        self.driver_root = driverfiles.DriverRootEdits(config.container_driver_root,
                                                       lambda version: driver_edits(config, version))
        if session.available:
            inventory, _ = await asyncio.to_thread(read_driver, session, config, self.driver_root,
                                                   self.host_devices.extend)
        else:  # no devices and no driver files until the driver is back (DriverWatch)
            await assembly.report_unavailable(identity, config, self.connection, session)
            inventory = NodeInventory(versions=DriverVersions("", 0), gpus=())
        self.registry = DeviceRegistry(
            inventory, dynamic_index if dynamic_mig else (lambda inv: DeviceIndex.build(inv).by_name))
        registry = self.registry
        self.host_devices.last = lambda: registry.snapshot

    def _host_devices(self) -> HostDevices:
        """The PCI side (``PassthroughSupport``: its start requirements checked first) and the Fabric Manager
        client (``FabricManagerPartitioning``, when Fabric Manager is detected) discovery extends NVML's devices
        with.

        :raises DradriverError: :func:`check_passthrough_host`.
        """
        config = self.config
        gates = config.feature_gates
        self.pci = pci_host(config)
        if gates.passthrough_support:
            check_passthrough_host(config, self.pci)
        self.fm = fabric.open_client(config.container_driver_root, proc_root=config.proc_root,
                                     sysfs_root=config.sysfs_root, environ=os.environ)
        if gates.fabric_manager_partitioning and self.fm is None:
            log.info("FabricManagerPartitioning: no NVSwitch fabric under %s or no libnvfm.so.1 under %s: GPUs are "
                     "published without partitions and claims activate none", config.proc_root,
                     config.container_driver_root)
        return HostDevices(pci=self.pci if gates.passthrough_support else None,
                           fm=self.fm if gates.fabric_manager_partitioning else None)

    async def check_cdi_hook(self) -> None:
        """The CDI hook the claim specs name (:func:`assembly.check_cdi_hook`)."""
        self.hook_refusal = await self.life.step("CDI hook", lambda: assembly.check_cdi_hook(
            self.identity, self.config, self.connection, named=lambda: bool(self.driver_root.edits.hooks)))

    async def check_device_plugin(self) -> None:
        """The device-plugin guard: an empty pool (and a ``DevicePluginDetected`` Event) while NVIDIA's device plugin
        owns the GPUs."""
        self.verdict = verdict = guard.check_device_plugin(self.config, self.connection.node)
        if verdict.refuse:
            log.error("%s", verdict.reason)
            await asyncio.to_thread(assembly.report_event, self.identity, self.connection.client, self.config,
                                    self.connection.node_uid, "DevicePluginDetected", verdict.reason)
        elif verdict.reason:
            log.warning("%s", verdict.reason)

    async def open_node_policy(self) -> None:
        """The per-node device policy the Node asks for (watched once the publisher runs)."""
        self.node_policy = await open_node_policy(self.identity, self.config, self.connection)

    async def open_claim_state(self) -> None:
        """The claim state (:func:`assembly.open_claim_state`)."""
        self.state, self.problems = await assembly.open_claim_state(self.life, self.identity, self.config,
                                                                    self.connection)
        state = self.state
        self.host_devices.known = lambda: known_vfio_parents(all_undo_records(state))
        if self.host_devices.pci is not None and self.session.available:  # GPUs on vfio get their stored parents
            self.registry.replace(await asyncio.to_thread(self.host_devices.extend, self.registry.snapshot))

    def build_runner(self) -> None:
        """The batch runner over the device preparers and sharing steps, with the driver watch it asks, the device
        status writer it reports to and the rollback checkpoint it keeps."""
        identity, config, registry, session = self.identity, self.config, self.registry, self.session
        self.metrics = DriverMetrics(node=config.node_name, driver=identity.driver_name)
        self.nodes = node_info(config)
        # The spec-level and each full GPU's edits, while /proc/devices is unchanged.
        self.edits_cache = EditsCache(self.nodes)
        module_files = (self.nodes.dev_root / "dev" / "nvidiactl",
                        self.config.sysfs_root / "module" / ReloadDetector.MODULE)
        self.detector = ReloadDetector(session, self.nodes.read_majors, lambda: read_identities(module_files))
        self.watch = watch = DriverWatch(session, library=lambda: nvml_library(config), arrive=self.driver_back,
                                         reloaded=self.detector.check, depart=self.driver_away)
        self.status_writer = DeviceStatusWriter(
            self.connection.client, driver=identity.driver_name, pool=config.node_name,
            describe=gpu_describer(registry.get, mps_namespace=config.namespace))
        self.life.on_stop("device status writer", self.status_writer.close)
        # Every kind that may have written an undo record is registered: with its gate off a part only undoes
        # (claims prepared while the gate was on are unprepared by the kind stored with them).
        undo_only: list[Any] = []
        self.gates_off: list[tuple[str, str]] = []  # (gate, record kind) of each undo-only part
        preparers = self._device_preparers(undo_only)
        steps = self._sharing_steps(undo_only)
        claim_steps = self._claim_steps(undo_only)
        shares = SharedDevicePreparer(
            config.consumable_shares, self.nodes,
            ShareDaemons(control_daemons(config, self.connection.client, session, shares=True)),
            stored_records=lambda: all_undo_records(self.state))
        self.checkpoint = (rollback.open_rollback_checkpoint(identity, config.plugin_dir, config.boot_id_path,
                                                             registry)
                           if config.nvidia_checkpoint else None)
        self.runner = BatchRunner(
            identity=identity, registry=registry, state=self.state, checkpoint=self.checkpoint,
            fetch_claim=assembly.claim_fetcher(identity, self.connection.client, config),
            cdi_root=config.cdi_root, pool=config.node_name,
            preparers=(shares, *preparers), sharing=steps, undo_only=undo_only,
            select_configs=lambda claim, devices: configs.select_configs(claim, devices, config.feature_gates),
            spec_edits=lambda: spec_level_edits(self.edits_cache, self.nodes, registry, self.driver_root),
            metrics=self.metrics, prepare_deadline_s=float(config.prepare_deadline_seconds),
            on_prepared=self._prepared, on_unprepared=self._unprepared,
            driver_unavailable=lambda: watch.departing() or devices_unknown(session, registry),
            driver_kinds=(DYNAMIC_MIG_KIND, TimeSlicing.kind),
            device_metadata=assembly.device_metadata_files(identity, config, self.plugin_ref),
            refuse_device=self.node_policy.refusal,
            claim_steps=claim_steps,
            sibling_of=self._sibling_of if config.feature_gates.passthrough_support else None,
            locks=PluginLocks(config.plugin_dir),
        )
        self.life.on_stop("batch runner", self.runner.close)

    def _claim_steps(self, undo_only: list[Any]) -> tuple[ClaimStep, ...]:
        """The Fabric Manager partition step (``FabricManagerPartitioning`` with Fabric Manager detected; undo only
        without the gate, where Fabric Manager is detected)."""
        if self.fm is None:
            return ()
        step = FabricPartitionStep(self.fm)
        if self.config.feature_gates.fabric_manager_partitioning:
            return (step,)
        undo_only.append(step)
        self.gates_off.append((FABRIC_MANAGER_PARTITIONING, FM_PARTITION_KIND))
        return ()

    def _sibling_of(self, name: str) -> str | None:
        """The other device of the same GPU (``gpu-<minor>`` <-> ``gpu-vfio-<index>``), from the registry now."""
        for device in self.registry.snapshot.vfio:
            if device.name == name:
                return device.sibling
            if device.sibling == name:
                return device.name
        return None

    def _mig_enabled(self, uuid: str) -> bool:
        """The GPU's current MIG mode from NVML (a GPU NVML does not list now is not in MIG mode)."""
        try:
            return MigControl(self.session).mig_mode(uuid)[0] == 1
        except NvmlError:
            return False

    def _prepared(self, ref: ClaimRef, records: Sequence[UndoRecord]) -> None:
        self.status_writer.prepared(ref, records)
        if any(r.kind == VFIO_KIND for r in records):
            self._held_changed()

    def _unprepared(self, ref: ClaimRef, records: Sequence[UndoRecord]) -> None:
        self.status_writer.unprepared(ref, records)
        if any(r.kind == VFIO_KIND for r in records):
            self._held_changed()

    def _held_changed(self) -> None:
        """After a VFIO claim was prepared or unprepared: the health monitor's passed-through GPUs and the pool's
        withdrawn siblings follow the devices the runner's claims hold now."""
        held = self.runner.prepared_devices()
        health: HealthMonitor | None = getattr(self, "health", None)
        if health is not None:
            health.set_held(held)
        if self.plugin_ref and getattr(self, "publisher", None) is not None:
            self._republish_if_changed(self.plugin_ref[0])

    @contextlib.contextmanager
    def _nvml_reopened(self) -> Iterator[None]:
        """Around the discovery after VFIO passthrough moved a GPU between drivers: between two batches of the
        runner, the health monitor stopped (its NVML handles die with the initialisation), NVML initialised anew
        (it lists the GPUs the ``nvidia`` driver holds at ``nvmlInit``, :meth:`NvmlSession.reinit`); then the
        monitor restarted over the new devices and the withdrawn siblings republished."""
        health: HealthMonitor | None = getattr(self, "health", None)
        with self.runner.between_batches():
            running = health is not None and health.running
            if health is not None and running:
                health.stop(end_streams=False)  # the kubelet's health streams stay open across the swap
            try:
                self.session.reinit(nvml_library(self.config))
                yield
            finally:
                if health is not None and running and self.session.available:
                    health.start()
        self._held_changed()

    def _device_preparers(self, undo_only: list[Any]) -> tuple[Any, ...]:
        """Full GPUs and static MIG devices, dynamic MIG with its device refresher and VFIO passthrough with its
        own (each undo only without its gate)."""
        session, registry, nodes, extend = self.session, self.registry, self.nodes, self.host_devices.extend
        preparers: tuple[Any, ...] = (FullGpuPreparer(nodes, self.edits_cache),
                                      StaticMigPreparer(nodes, self.edits_cache))
        self.refresher = None
        if self.mig_control is not None:
            self.refresher = refresh = DeviceRefresher(session, self.config, registry, self.mig_control,
                                                       extend=extend)
            self.life.on_stop("device refresher", refresh.close)
            preparers += (DynamicMigPreparer(self.mig_control, nodes, lambda: registry.snapshot.gpus,
                                             on_change=refresh),)
        else:
            reread = DeviceRefresher(session, self.config, registry, placements=False, extend=extend)
            self.life.on_stop("device refresher", reread.close)
            undo_only.append(DynamicMigPreparer(MigControl(session), nodes, lambda: registry.snapshot.gpus,
                                                on_change=reread))
            self.gates_off.append((DYNAMIC_MIG, DYNAMIC_MIG_KIND))
        # A GPU moved between nvidia and vfio: NVML enumerates anew, the devices are read again and republished.
        self.swaps = swaps = DeviceRefresher(session, self.config, registry, placements=False, extend=extend,
                                             reopen=self._nvml_reopened)  # stopped before the health monitor
        # nvidia-persistenced of the driver root holds GPUs open: persistence off before a swap, on after
        root = self.config.container_driver_root

        def daemon() -> bool:
            return persistenced.daemon_running(root)

        def tool() -> NvidiaSmi:
            return find_nvidia_smi(root)

        if self.config.feature_gates.passthrough_support:
            preparers += (VfioPreparer(self.pci, mig_enabled=self._mig_enabled, on_change=swaps,
                                       persistenced=daemon, nvidia_smi=tool),)
        else:
            undo_only.append(VfioPreparer(self.pci, on_change=swaps, persistenced=daemon, nvidia_smi=tool))
            self.gates_off.append((PASSTHROUGH_SUPPORT, VFIO_KIND))
        return preparers

    def _sharing_steps(self, undo_only: list[Any]) -> list[SharingStep]:
        """Exclusive use and time-slicing, and MPS with the ``MPSSupport`` gate (undo only without it)."""
        config, client, session = self.config, self.connection.client, self.session
        steps: list[SharingStep] = list(default_steps(session,
                                                      lambda: find_nvidia_smi(config.container_driver_root)))
        self.mps_daemons = None
        if config.feature_gates.mps_support:
            self.mps_daemons = control_daemons(config, client, session)
            steps.append(MpsSharing(self.mps_daemons))
        else:
            undo_only.append(MpsSharing(control_daemons(config, client, session)))
            self.gates_off.append((MPS_SUPPORT, MpsSharing.kind))
        return steps

    async def converge(self) -> None:
        """Adopt NVIDIA's claims, recover from a crash, then load the rollback checkpoint (it names what the claim
        state holds after recovery)."""
        adopted = await assembly.adopt_nvidia(
            self.identity, self.config, self.connection, self.runner,
            GpuAdoption(self.config.node_name, self.registry.get, self.identity.driver_name), self.metrics,
            self.checkpoint.groups_of if self.checkpoint is not None else None)
        self.recovery = await assembly.recover(self.identity, self.config, self.connection, self.runner,
                                               self.problems, self.status_writer)
        await asyncio.to_thread(report_undo_only, self.state, self.gates_off)
        if self.checkpoint is not None:
            await asyncio.to_thread(self.checkpoint.load, self.state.claims(), (*adopted.started, *adopted.unflushed))

    async def make_publisher(self) -> None:
        """The ResourceSlice publisher (not running yet), and what the API server's version decides: informational
        taints, the slice layout."""
        metrics = self.metrics
        self.publisher = assembly.make_publisher(
            self.identity, self.config, self.connection,
            on_error=lambda exc: metrics.count_publish_error(type(exc).__name__),
            on_publish=lambda result: metrics.observe_publish() if result.wrote else None)
        client = self.connection.client
        self.informational = await asyncio.to_thread(supports_informational_taints, client)
        self.layout = slice_layout_version(await asyncio.to_thread(read_server_version, client),
                                           self.config.feature_gates.dynamic_mig)

    async def remember_driver(self) -> None:
        """The driver in use, for the reload check (nothing while it is absent)."""
        if self.session.available:
            await asyncio.to_thread(self.detector.remember)

    async def start_health(self) -> None:
        """The health monitor, following the device registry (started by the driver's return while it is absent)."""
        config = self.config
        self.health = health = HealthMonitor(
            self.registry.snapshot,
            pool_name=config.node_name,
            session=self.session,
            taint_domain=self.identity.taint_domain,
            ignored_xids=DEFAULT_IGNORED_XIDS | set(config.additional_xids_to_ignore),
            informational_taints=self.informational,
            on_taints_changed=lambda _taints: self.plugin_ref[0].republish() if self.plugin_ref else None,
            on_nvml_error=self._nvml_failed,
            wait_timeout_ms=PASSTHROUGH_EVENT_WAIT_MS if config.feature_gates.passthrough_support else 1000,
        )
        self.registry.subscribe(health.replace_inventory)
        self.metrics.attach_devices(health, claim_of=lambda device: self.runner.prepared_devices().get(device),
                                    dcgm_compatible=config.dcgm_compatible)
        await asyncio.to_thread(self.swaps.wait_idle)  # a re-read after the start-up sweep re-initialises NVML
        if self.session.available:
            await self.life.step("health monitor", lambda: asyncio.to_thread(health.start),
                                 lambda _: asyncio.to_thread(health.stop))
        else:  # started by the driver's return
            self.life.on_stop("health monitor", lambda: asyncio.to_thread(health.stop))
        self.life.on_stop("VFIO device refresher", self.swaps.close)  # stopped before the monitor it restarts

    def _nvml_failed(self, code: int) -> None:
        self.metrics.count_nvml_error(code)
        self.watch.suspect(code)  # a failure that may be a driver reload is checked at once

    def driver_away(self, why: str) -> None:
        """The watch's ``depart``: a reload under the running plugin; nothing may use the stale NVML handle the
        watch shuts next."""
        self.metrics.count_driver_reload()
        self.health.stop()
        self.edits_cache.clear()
        assembly.report_departure(self.identity, self.config, self.connection, why)

    def driver_back(self) -> None:
        """The watch's ``arrive``: read the devices and files of the driver that is back, publish them, start the
        health monitor, run the kept undo and rewrite the prepared claims' specs for the driver's files."""
        before = self.detector.version
        self.edits_cache.clear()
        inventory, _ = read_driver(self.session, self.config, self.driver_root, self.host_devices.extend)
        self.registry.replace(inventory)  # the health monitor, the publisher and the refresher follow
        self.detector.remember()
        self.health.start()
        undone, swept = self.runner.resume_undo()
        rewritten, unusable = self.runner.refresh_specs()  # prepared claims' specs name the new driver's files
        log.info("NVIDIA driver %s back: %d GPU(s); %d kept undo(s) done%s; %d prepared claim spec(s) rewritten",
                 inventory.versions.driver, len(inventory.gpus), len(undone),
                 f", swept {', '.join(swept)}" if swept else "", len(rewritten))
        if before:  # a reload under the running plugin (a start without the driver reported its own Event)
            assembly.report_return(
                self.identity, self.config, self.connection, version=inventory.versions.driver, before=before,
                summary=f"{len(inventory.gpus)} GPU(s), {len(rewritten)} prepared claim CDI spec(s) rewritten for "
                "its files" + (f", {len(unusable)} claim(s) refused (a claim whose devices are other GPUs now has "
                               "its CDI spec withdrawn; see the plugin's log)" if unusable else ""))

    async def serve(self, early: EarlyServers | None) -> None:
        """The metrics endpoint, then the gRPC servers (or the early ones attached to the runner), serving prepares
        through the gate that refuses them while the driver or the CDI hook is missing."""
        self.metrics.watch_driver(lambda: not self.watch.reason())
        self.refusal = refusal = driverstate.first_refusal(self.watch.refusal, self.hook_refusal)
        gate = DriverGate(self.runner, refusal)
        self.metrics_server = await assembly.serve_metrics_step(self.life, self.config, self.metrics)
        if early is None:
            self.servers = await assembly.serve(self.life, self.config, gate, health_source=self.health,
                                                publisher=self.publisher, ready=lambda: not refusal())
        else:
            self.servers = await assembly.attach_early(self.life, early, gate, health_source=self.health,
                                                       publisher=self.publisher, ready=lambda: not refusal())

    def desired(self) -> list[dict[str, Any]]:
        """The node's ResourceSlices now: the registry's devices under the health taints, the node policy, the
        device-plugin guard (an empty pool while the device plugin owns the GPUs) and the KEP-5517 overhead."""
        config = self.config
        inventory = self.registry.snapshot
        if self.verdict.refuse:  # an empty pool: the device plugin owns the GPUs
            inventory = NodeInventory(versions=inventory.versions, gpus=())
        slices = pools.build_resource_slices(inventory, config.node_name, driver=self.identity.driver_name,
                                             taints=self.health.taints(), server_version=self.layout,
                                             cache=self.partition_cache, shares=config.consumable_shares,
                                             advertised=self.node_policy.policy.advertised,
                                             held=self.runner.prepared_devices(),
                                             fabric_partitions=config.feature_gates.fabric_manager_partitioning)
        nodeallocatable.apply_overhead(slices, config.node_allocatable_overhead)  # KEP-5517, gate-checked
        return slices

    def assemble(self) -> GpuPlugin:
        """The running plugin, from its parts."""
        plugin = GpuPlugin(identity=self.identity, config=self.config, lifecycle=self.life,
                           client=self.connection.client, node_uid=self.connection.node_uid, state=self.state,
                           state_problems=self.problems, runner=self.runner, recovery=self.recovery,
                           publisher=self.publisher, servers=self.servers, desired=self.desired,
                           session=self.session, registry=self.registry, guard_verdict=self.verdict,
                           health=self.health, metrics=self.metrics, metrics_server=self.metrics_server,
                           refresher=self.refresher, status_writer=self.status_writer,
                           mps_daemons=self.mps_daemons, node_policy=self.node_policy)
        self.plugin_ref.append(plugin)
        return plugin

    async def publish(self, plugin: GpuPlugin) -> None:
        """Run the publisher, republish at each change of the devices or the node policy, and publish now (while the
        driver is absent the node's ResourceSlices stay as the last run published them until its devices are
        read)."""
        self.registry.subscribe(lambda _inventory: self._republish_if_changed(plugin))
        await assembly.run_publisher(self.life, self.publisher)
        await watch_node_policy(self.life, self.node_policy, plugin.republish)
        if self.session.available:
            plugin.republish()

    def _republish_if_changed(self, plugin: GpuPlugin) -> None:
        # Dynamic MIG replaces the registry at every instance change, yet the pool usually stays the same
        # (placements are published whether or not an instance exists): comparing is far cheaper than the
        # publisher's copy of an unchanged desired state.
        slices = plugin.desired_slices()
        if self._last_desired and self._last_desired[0] == slices:
            return
        self._last_desired[:] = [slices]
        plugin.publisher.update(slices)

    async def watch_driver(self, plugin: GpuPlugin) -> None:
        """The NVIDIA driver watch: its return and a reload under the running plugin."""
        await self.life.step("NVIDIA driver watch", self.watch.start, lambda _: asyncio.to_thread(self.watch.stop))
        plugin.driver = self.watch

    async def clean_stale_claims(self, plugin: GpuPlugin) -> None:
        """The stale-claim cleanup (:func:`assembly.run_stale_claim_cleanup`)."""
        plugin.reconciler = await assembly.run_stale_claim_cleanup(self.life, self.identity, self.config,
                                                                   self.connection, self.runner,
                                                                   count=self.metrics.count_stale_claim)


async def run_plugin(config: PluginConfig, stop: asyncio.Event, *, early: EarlyServers | None = None,
                     on_started: Callable[[], None] | None = None) -> None:
    """Start the plugin, wait for ``stop``, then stop it.

    :param early: see :func:`start_plugin`; when the start fails, their waiting calls get the failure and
        they are stopped before the error propagates.
    :param on_started: called once the plugin runs (the command ends its start-up tuning there).
    """
    try:
        plugin = await start_plugin(config, early=early)
    except BaseException as exc:
        if early is not None:
            early.readiness.fail(exc)
            await early.servers.stop(grace=1.0)  # the waiting calls are answered with the failure
        raise
    if on_started is not None:
        on_started()
    try:
        await stop.wait()
    finally:
        await plugin.stop()
