"""The ``gpu.nvidia.com`` kubelet plugin (``dradriver gpu-kubelet-plugin``): its composition, nothing else.

Steps, in order (stopped in reverse): compiled hot paths -> Kubernetes client and this Node (a bad kubeconfig
fails here, before anything on the host is touched) -> plugin and CDI directories -> NVML session -> device
discovery into the device registry -> the driver's user space for CDI specs -> the CDI hook they name (copied from
the image, checked: :func:`dradriver.app.driverstate.check_cdi_hook`) -> device-plugin guard -> per-node
device policy (:mod:`dradriver.app.nodepolicy`, its Node watch after the publisher) -> claim state -> batch
runner with the consumable-share (when
``--consumable-shares`` is on), full-GPU and static-MIG preparers (and, with the ``DynamicMIG`` gate, the
dynamic-MIG preparer over every eligible GPU's placements) and the sharing steps (MPS control daemons with the
``MPSSupport`` gate), and crash convergence -> health monitor -> metrics endpoint -> gRPC servers ->
ResourceSlice publisher -> NVIDIA driver watch. Without a usable driver (not loaded, no ``libnvidia-ml.so.1``)
the plugin starts all the same with no devices: it unprepares, refuses prepares with the reason, and reads the
devices once the driver is back (:mod:`dradriver.app.driverstate`); a driver reloaded under the running plugin is
detected and handled the same way, the prepared claims' CDI specs then rewritten for the new driver's files.
The ``gpu-kubelet-plugin`` command serves the gRPC sockets first instead
(:mod:`dradriver.server.deferred`, ``start_plugin(early=...)``): the kubelet registers the plugin within
~0.2 s of process start and claims it sends meanwhile wait until the runner is attached at the servers' place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dradriver import _native
from dradriver.app import assembly, driverstate, nodepolicy
from dradriver.app.devicestatus import DeviceStatusWriter, gpu_describer
from dradriver.app.driverstate import DriverGate, DriverWatch, ReloadDetector
from dradriver.config import PluginConfig
from dradriver.domain import cdi, configs, mps, nodeallocatable, partitions, pools
from dradriver.domain.devices import DeviceIndex, DriverVersions, NodeInventory
from dradriver.domain.faults import DEFAULT_IGNORED_XIDS
from dradriver.domain.featuregates import DYNAMIC_MIG, MPS_SUPPORT
from dradriver.domain.identity import GPU_DRIVER, DriverIdentity
from dradriver.domain.migplacements import MigPlacement, dynamic_index
from dradriver.domain.ports import SharingStep
from dradriver.domain.registry import DeviceRegistry
from dradriver.health.metrics import DriverMetrics, MetricsServer
from dradriver.health.monitor import HealthMonitor
from dradriver.host import driverfiles
from dradriver.host.claimstate import ClaimState
from dradriver.host.devicenodes import DeviceNodeInfo, EditsCache
from dradriver.host.nvidiasmi import find_nvidia_smi
from dradriver.kube import errors as kube_errors
from dradriver.kube import version
from dradriver.kube.client import KubeClient
from dradriver.kubeletplugin import guard, rollback
from dradriver.kubeletplugin.adoption import GpuAdoption
from dradriver.kubeletplugin.lifecycle import Lifecycle
from dradriver.kubeletplugin.payload import read_payload
from dradriver.kubeletplugin.runner import BatchRunner, all_undo_records
from dradriver.nvml import discovery
from dradriver.nvml import settings as nvml_settings
from dradriver.nvml.mig import MigControl
from dradriver.nvml.session import NvmlSession
from dradriver.preparers import gpu as gpu_preparers
from dradriver.preparers.dynamicmig import KIND as DYNAMIC_MIG_KIND
from dradriver.preparers.dynamicmig import DynamicMigPreparer
from dradriver.preparers.gpu import FullGpuPreparer, StaticMigPreparer
from dradriver.preparers.mps import ControlDaemons, MpsSharing
from dradriver.preparers.shares import ShareDaemons, SharedDevicePreparer
from dradriver.preparers.sharing import TimeSlicing, default_steps
from dradriver.server.deferred import EarlyServers

log = logging.getLogger(__name__)


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
    """Whether the NVIDIA driver can be used now, and why not (:mod:`dradriver.app.driverstate`)."""
    node_policy: nodepolicy.NodePolicyWatch | None = None
    """The per-node device policy (gate ``PerNodeGPUConfig``; :mod:`dradriver.app.nodepolicy`)."""

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
                driver_root: driverfiles.DriverRootEdits | None = None) -> tuple[NodeInventory, cdi.ContainerEdits]:
    """What the plugin needs from an available driver: this node's devices (:func:`discover`) and the spec-level
    edits of the driver's user space (:func:`driver_edits`; through ``driver_root``, which watches them from then
    on, when given), at start or when a driver that was absent is back.

    :raises driverfiles.DriverFilesError: the driver root does not hold the driver NVML reports.
    :raises dradriver.nvml.errors.NvmlError: discovery failed.
    """
    inventory = discover(session, config)
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


class DeviceRefresher:
    """Re-reads this node's devices after dynamic MIG created or destroyed instances and replaces the device
    registry (the health monitor and the ResourceSlice publisher are its subscribers).

    A call only marks the devices stale and returns (it runs on the prepare path); one background thread re-reads
    while changes keep coming, so a burst of prepares costs one or two discoveries and the snapshot installed
    last is never older than the last change.
    """

    RETRIES = 3
    """Discoveries per refresh while a GPU of the previous snapshot is left out (a transient read error)."""
    RETRY_DELAY_S = 0.05

    def __init__(self, session: NvmlSession, config: PluginConfig, registry: DeviceRegistry[NodeInventory],
                 mig_control: MigControl | None = None, *, placements: bool = True) -> None:
        self.session, self.config, self.registry = session, config, registry
        self.mig_control = mig_control
        self.with_placements = placements
        """False with the ``DynamicMIG`` gate off (a claim of before the gate was turned off destroyed its
        instance): the devices are re-read as discovered, without placements."""
        self._lock = threading.Lock()
        self._stale = False
        self._thread: threading.Thread | None = None
        self._placements: dict[str, list[MigPlacement]] | None = None
        self.refreshes = 0
        """Discoveries run so far."""

    def __call__(self) -> None:
        """Mark the devices stale; a background thread re-reads them."""
        with self._lock:
            self._stale = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="device-refresh", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._stale:
                    self._thread = None
                    return
                self._stale = False
            try:
                self.refresh()
            except Exception:  # retried at the next change; the registry keeps the last good snapshot
                log.exception("re-reading devices after a MIG change failed")

    def refresh(self) -> None:
        """Discover again now (on this thread) and replace the registry's snapshot.

        A GPU's placements never change while it is present, so they are enumerated once per GPU UUID (the
        first snapshot's, or at the first refresh that sees a new GPU) and re-parented to the GPU's new entry:
        a refresh costs a plain discovery, not ~20 NVML profile queries per GPU.
        """
        inventory = self._discover()
        if not self.with_placements:
            self.registry.replace(inventory)
            self.refreshes += 1
            log.info("devices read again after a MIG change with DynamicMIG off: %d GPU(s), %d MIG device(s)",
                     len(inventory.gpus), len(inventory.migs))
            return
        cache = self._placements
        if cache is None:
            cache = self._placements = {}
            for placement in self.registry.snapshot.placements:
                cache.setdefault(placement.parent.uuid, []).append(placement)
        placements: list[MigPlacement] = []
        for gpu in inventory.gpus:
            if gpu.uuid not in cache:
                cache[gpu.uuid] = (discovery.mig_placements(self.session, gpu)
                                   if discovery.is_dynamic_mig_capable(gpu) else [])
            placements.extend(dataclasses.replace(p, parent=gpu) for p in cache[gpu.uuid])
        self.registry.replace(dataclasses.replace(inventory, placements=tuple(placements)))
        self.refreshes += 1

    def _discover(self) -> NodeInventory:
        """Discover with every known GPU's MIG lock held, so no instance of ours is half created or destroyed
        while it is read; a GPU of the previous snapshot that is left out (another NVML client changing MIG at
        that moment: its GPU instance exists before its compute instance) is read again after a short delay,
        up to :attr:`RETRIES` times, before the snapshot without it is installed."""
        before = {gpu.uuid for gpu in self.registry.snapshot.gpus}
        for attempt in range(self.RETRIES + 1):
            with self.mig_control.hold(before) if self.mig_control is not None else contextlib.nullcontext():
                self.session.forget_mig_handles()
                inventory = discovery.discover(self.session, sysfs_root=self.config.sysfs_root)
            missing = before - {gpu.uuid for gpu in inventory.gpus}
            if not missing or attempt == self.RETRIES:
                return inventory
            log.info("re-reading devices: %d GPU(s) of the last snapshot left out (%s); retrying",
                     len(missing), ", ".join(sorted(missing)))
            time.sleep(self.RETRY_DELAY_S * (attempt + 1))
        raise AssertionError("unreachable")

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no refresh is pending or running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                thread = self._thread
            if thread is None:
                return True
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return False

    def close(self) -> None:
        """Wait for a refresh in progress (the NVML session closes after this)."""
        with self._lock:
            thread, self._stale = self._thread, False
        if thread is not None:
            thread.join(timeout=10)


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
    1.35, split from 1.35; ``nvidia-dra-driver.md`` 2.1). Unknown: 1.34's combined layout, logged."""
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
    life = Lifecycle(identity.driver_name)
    # Validate, then touch the host (assembly.open_host): no directory is created before the API server answers.
    try:
        connection, session = await assembly.open_host(life, identity, config, nvml_library(config))
        dynamic_mig = config.feature_gates.dynamic_mig
        mig_control = MigControl(session) if dynamic_mig else None
        # the driver's files, found again when the driver root changes under the same version
        driver_root = driverfiles.DriverRootEdits(config.container_driver_root,
                                                  lambda version: driver_edits(config, version))
        if session.available:
            inventory, _ = await asyncio.to_thread(read_driver, session, config, driver_root)
        else:  # no devices and no driver files until the driver is back (DriverWatch)
            await driverstate.report_unavailable(identity, config, connection, session)
            inventory = NodeInventory(versions=DriverVersions("", 0), gpus=())
        registry: DeviceRegistry[NodeInventory] = DeviceRegistry(
            inventory, dynamic_index if dynamic_mig else (lambda inv: DeviceIndex.build(inv).by_name))
        hook_refusal = await life.step("CDI hook", lambda: driverstate.check_cdi_hook(
            identity, config, connection, named=lambda: bool(driver_root.edits.hooks)))
        verdict = guard.check_device_plugin(config, connection.node)
        if verdict.refuse:
            log.error("%s", verdict.reason)
            await asyncio.to_thread(assembly.report_event, identity, connection.client, config, connection.node_uid,
                                    "DevicePluginDetected", verdict.reason)
        elif verdict.reason:
            log.warning("%s", verdict.reason)
        node_policy = await nodepolicy.open_node_policy(identity, config, connection)
        state, problems = await assembly.open_claim_state(life, identity, config, connection)

        metrics = DriverMetrics(node=config.node_name, driver=identity.driver_name)
        nodes = node_info(config)
        edits_cache = EditsCache(nodes)  # the spec-level and each full GPU's edits, while /proc/devices is unchanged
        detector = ReloadDetector(session, nodes.read_majors)
        watch = DriverWatch(session, library=lambda: nvml_library(config), arrive=lambda: driver_back(),
                            reloaded=detector.check, depart=lambda why: driver_away(why))
        preparers: tuple[Any, ...] = (FullGpuPreparer(nodes, edits_cache), StaticMigPreparer(nodes, edits_cache))
        status_writer = DeviceStatusWriter(connection.client, driver=identity.driver_name, pool=config.node_name,
                                           describe=gpu_describer(registry.get, mps_namespace=config.namespace))
        life.on_stop("device status writer", status_writer.close)
        refresh: DeviceRefresher | None = None
        # Every kind that may have written an undo record is registered: with its gate off a part only undoes
        # (claims prepared while the gate was on are unprepared by the kind stored with them).
        undo_only: list[Any] = []
        gates_off: list[tuple[str, str]] = []  # (gate, record kind) of each undo-only part
        if mig_control is not None:
            refresh = DeviceRefresher(session, config, registry, mig_control)
            life.on_stop("device refresher", refresh.close)
            preparers += (DynamicMigPreparer(mig_control, nodes, lambda: registry.snapshot.gpus, on_change=refresh),)
        else:
            reread = DeviceRefresher(session, config, registry, placements=False)
            life.on_stop("device refresher", reread.close)
            undo_only.append(DynamicMigPreparer(MigControl(session), nodes, lambda: registry.snapshot.gpus,
                                                on_change=reread))
            gates_off.append((DYNAMIC_MIG, DYNAMIC_MIG_KIND))
        steps: list[SharingStep] = list(default_steps(session,
                                                      lambda: find_nvidia_smi(config.container_driver_root)))
        daemons = None
        if config.feature_gates.mps_support:
            daemons = control_daemons(config, connection.client, session)
            steps.append(MpsSharing(daemons))
        else:
            undo_only.append(MpsSharing(control_daemons(config, connection.client, session)))
            gates_off.append((MPS_SUPPORT, MpsSharing.kind))
        shares = SharedDevicePreparer(config.consumable_shares, nodes,
                                      ShareDaemons(control_daemons(config, connection.client, session, shares=True)),
                                      stored_records=lambda: all_undo_records(state))
        plugin_ref: list[GpuPlugin] = []
        checkpoint = (rollback.open_rollback_checkpoint(identity, config.plugin_dir, config.boot_id_path, registry)
                      if config.nvidia_checkpoint else None)
        runner = BatchRunner(
            identity=identity, registry=registry, state=state, checkpoint=checkpoint,
            fetch_claim=assembly.claim_fetcher(identity, connection.client, config),
            cdi_root=config.cdi_root, pool=config.node_name,
            preparers=(shares, *preparers), sharing=steps, undo_only=undo_only,
            select_configs=lambda claim, devices: configs.select_configs(claim, devices, config.feature_gates),
            spec_edits=lambda: spec_level_edits(edits_cache, nodes, registry, driver_root),
            metrics=metrics, prepare_deadline_s=float(config.prepare_deadline_seconds),
            on_prepared=status_writer.prepared, on_unprepared=status_writer.unprepared,
            driver_unavailable=lambda: watch.departing() or devices_unknown(session, registry),
            driver_kinds=(DYNAMIC_MIG_KIND, TimeSlicing.kind),
            device_metadata=assembly.device_metadata_files(identity, config, plugin_ref),
            refuse_device=node_policy.refusal,
        )
        life.on_stop("batch runner", runner.close)
        await assembly.adopt_nvidia(identity, config, connection, runner,
                                    GpuAdoption(config.node_name, registry.get), metrics)
        recovery = await assembly.recover(identity, config, connection, runner, problems)
        await asyncio.to_thread(report_undo_only, state, gates_off)
        if checkpoint is not None:  # after recovery: it names what the claim state holds now
            await asyncio.to_thread(checkpoint.load, state.claims())
        publisher = assembly.make_publisher(
            identity, config, connection, on_error=lambda exc: metrics.count_publish_error(type(exc).__name__),
            on_publish=lambda result: metrics.observe_publish() if result.wrote else None)
        informational = await asyncio.to_thread(supports_informational_taints, connection.client)
        layout = slice_layout_version(await asyncio.to_thread(read_server_version, connection.client), dynamic_mig)
        partition_cache = partitions.PartitionCache()
        if session.available:
            await asyncio.to_thread(detector.remember)

        def nvml_failed(code: int) -> None:
            metrics.count_nvml_error(code)
            watch.suspect(code)  # a failure that may be a driver reload is checked at once

        health = HealthMonitor(
            registry.snapshot,
            pool_name=config.node_name,
            session=session,
            taint_domain=identity.taint_domain,
            ignored_xids=DEFAULT_IGNORED_XIDS | set(config.additional_xids_to_ignore),
            informational_taints=informational,
            on_taints_changed=lambda _taints: plugin_ref[0].republish() if plugin_ref else None,
            on_nvml_error=nvml_failed,
        )
        registry.subscribe(health.replace_inventory)
        metrics.attach_devices(health, claim_of=lambda device: runner.prepared_devices().get(device),
                               dcgm_compatible=config.dcgm_compatible)
        if session.available:
            await life.step("health monitor", lambda: asyncio.to_thread(health.start),
                            lambda _: asyncio.to_thread(health.stop))
        else:  # started by the driver's return
            life.on_stop("health monitor", lambda: asyncio.to_thread(health.stop))

        def driver_away(why: str) -> None:
            # A reload under the running plugin: nothing may use the stale NVML handle the watch shuts next.
            health.stop()
            edits_cache.clear()
            assembly.report_event(identity, connection.client, config, connection.node_uid, "NvidiaDriverUnavailable",
                                  f"NVIDIA driver went away ({why}); claims are unprepared, prepares wait for it "
                                  "and are served once it is loaded again, without a restart")

        def driver_back() -> None:
            before = detector.version
            edits_cache.clear()
            inventory, _ = read_driver(session, config, driver_root)
            registry.replace(inventory)  # the health monitor, the publisher (below) and the refresher follow
            detector.remember()
            health.start()
            undone, swept = runner.resume_undo()
            rewritten, unusable = runner.refresh_specs()  # prepared claims' specs name the new driver's files
            log.info("NVIDIA driver %s back: %d GPU(s); %d kept undo(s) done%s; %d prepared claim spec(s) rewritten",
                     inventory.versions.driver, len(inventory.gpus), len(undone),
                     f", swept {', '.join(swept)}" if swept else "", len(rewritten))
            if before:  # a reload under the running plugin (a start without the driver reported its own Event)
                assembly.report_event(
                    identity, connection.client, config, connection.node_uid, "NvidiaDriverAvailable",
                    f"NVIDIA driver {inventory.versions.driver} loaded again (was {before}): {len(inventory.gpus)} "
                    f"GPU(s), {len(rewritten)} prepared claim CDI spec(s) rewritten for its files"
                    + (f", {len(unusable)} claim(s) refused (a claim whose devices are other GPUs now has its CDI spec"
                       " withdrawn; see the plugin's log)" if unusable else ""),
                    type_="Normal")

        refusal = driverstate.first_refusal(watch.refusal, hook_refusal)
        gate = DriverGate(runner, refusal)
        metrics_server = await assembly.serve_metrics_step(life, config, metrics)
        if early is None:
            servers = await assembly.serve(life, config, gate, health_source=health, publisher=publisher,
                                           ready=lambda: not refusal())
        else:
            servers = await assembly.attach_early(life, early, gate, health_source=health, publisher=publisher,
                                                  ready=lambda: not refusal())

        def desired() -> list[dict[str, Any]]:
            inventory = registry.snapshot
            if verdict.refuse:  # an empty pool: the device plugin owns the GPUs
                inventory = NodeInventory(versions=inventory.versions, gpus=())
            slices = pools.build_resource_slices(inventory, config.node_name, driver=identity.driver_name,
                                                          taints=health.taints(), server_version=layout,
                                                          cache=partition_cache, shares=config.consumable_shares,
                                                          advertised=node_policy.policy.advertised)
            nodeallocatable.apply_overhead(slices, config.node_allocatable_overhead)  # KEP-5517, gate-checked
            return slices

        plugin = GpuPlugin(identity=identity, config=config, lifecycle=life, client=connection.client,
                           node_uid=connection.node_uid, state=state, state_problems=problems, runner=runner,
                           recovery=recovery, publisher=publisher, servers=servers, desired=desired,
                           session=session, registry=registry, guard_verdict=verdict, health=health,
                           metrics=metrics, metrics_server=metrics_server, refresher=refresh,
                           status_writer=status_writer, mps_daemons=daemons, node_policy=node_policy)
        plugin_ref.append(plugin)
        last_desired: list[list[dict[str, Any]]] = []

        def republish_if_changed(_inventory: NodeInventory) -> None:
            # Dynamic MIG replaces the registry at every instance change, yet the pool usually stays the same
            # (placements are published whether or not an instance exists): comparing is far cheaper than the
            # publisher's copy of an unchanged desired state.
            slices = plugin.desired_slices()
            if last_desired and last_desired[0] == slices:
                return
            last_desired[:] = [slices]
            plugin.publisher.update(slices)

        registry.subscribe(republish_if_changed)
        await assembly.run_publisher(life, publisher)
        await nodepolicy.watch_node_policy(life, node_policy, plugin.republish)
        if session.available:
            plugin.republish()
        # else: the node's ResourceSlices stay as the last run published them until the driver's devices are read
        await life.step("NVIDIA driver watch", watch.start, lambda _: asyncio.to_thread(watch.stop))
        plugin.driver = watch
        plugin.reconciler = await assembly.run_stale_claim_cleanup(life, identity, config, connection, runner,
                                                                   count=metrics.count_stale_claim)
    except BaseException:
        await life.stop(1.0)
        raise
    log.info("kubelet plugin for %s on node %s serving at %s", identity.driver_name, config.node_name,
             config.dra_socket)
    return plugin


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
