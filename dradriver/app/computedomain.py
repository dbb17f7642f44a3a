"""The ``compute-domain.nvidia.com`` kubelet plugin (``dradriver compute-domain-kubelet-plugin``): its composition.

Steps, in order (stopped in reverse): compiled hot paths -> Kubernetes client and this Node (a bad kubeconfig
fails here, before anything on the host is touched) -> plugin and CDI directories -> NVML session (a driver that is
not available now is no error: a ``NvidiaDriverUnavailable`` Event names ``nvmlInit``'s failure) -> claim state ->
IMEX facts from procfs -> batch runner with the IMEX channel and daemon preparers, and crash convergence -> gRPC
servers, whose prepares are refused per claim while :meth:`ComputeDomainPlugin.refusal` says why (the
``readiness`` probe NOT_SERVING meanwhile) and whose unprepares are always served from the claim state ->
ResourceSlice publisher -> the driver's part (:func:`read_driver_part`, at once when the driver is available, else
when :class:`~dradriver.kubeletplugin.driverstate.DriverWatch` finds it back, without a restart): the node's fabric
(:func:`wait_for_fabric`: clique ID and fabric health from fabric info, :mod:`dradriver.nvml.fabric`; while a
GPU's registration is still in progress, strict mode with the gate ``CrashOnNVLinkFabricErrors``, the plugin logs
the state, records a ``FabricRegistrationPending`` Event on the Node and reads again with a back-off of 1 s
doubling to 30 s until the fabric manager is done; NVIDIA's plugin exits and crash-loops, its #1264), the driver
version check, IMEX facts again (channel major and count, ``fabric-imex-mgmt`` minor), the base CDI spec
``k8s.compute-domain.nvidia.com-device_base.json`` (device ``all``), the ``nvidia.com/gpu.clique`` node label
(``--gpu-clique-label-enabled``) and the ResourceSlices (pool = node name: ``channel-0`` and, driver-managed,
``daemon-0``; with ``--imex-isolation channel`` every channel of the node, in slices of at most 128 devices) ->
NVIDIA driver watch -> the fabric check every 30 s (clique re-read; a faulty fabric, registration failed or health
summary UNHEALTHY, taints every device ``compute-domain.nvidia.com/fabric-unhealthy`` NoSchedule with a
``FabricUnhealthy`` Event, so no new ComputeDomain lands on the node, NVIDIA's #626) and the 10-minute loop (label
refresh, domain directories of vanished ComputeDomains removed) -> with ``--binding-conditions``, the channels' KEP-5007
binding conditions (:mod:`dradriver.kubeletplugin.bindingconditions`; the slices' channels then carry them) ->
stale-claim cleanup.

No undo of this plugin needs the driver (a channel claim's undo removes the node label through the API, a daemon
claim's has nothing to do), so an unprepare while the driver is absent is complete: spec deleted, record removed,
label handled as on any unprepare.

A driver reloaded under the running plugin (a GPU Operator upgrade) is detected with the GPU plugin's parts
(:class:`~dradriver.kubeletplugin.driverstate.ReloadDetector`, asked by the driver watch every 5 s and at once
after the fabric check's NVML call failed with one of :data:`~dradriver.kubeletplugin.driverstate.RELOAD_HINTS`):
NVML calls failing driver-not-loaded, another driver version, another ``nvidia`` character-device major. Prepares are
then refused with the reason (readiness NOT_SERVING), a ``NvidiaDriverUnavailable`` Event names it, the fabric check
pauses (:func:`driver_away`) and the stale NVML handle is shut; unprepares are served throughout. Once NVML initialises
again, :func:`driver_back` reads the driver part anew (fabric and clique with its node label, driver version check,
IMEX facts, the base CDI spec for the new driver's files and device numbers, the ResourceSlices), rewrites the
prepared claims' CDI specs that changed (a new IMEX channel major) and records a ``NvidiaDriverAvailable`` Event.

Facts: NVIDIA's ``cmd/compute-domain-kubelet-plugin/`` (``main.go``, ``deviceinfo.go``, ``device_state.go``,
``cleanup.go``, ``cdi.go``, ``nvlib.go``) in kubernetes-sigs/dra-driver-nvidia-gpu.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from dradriver import _native
from dradriver.app import assembly
from dradriver.app.gpu import driver_edits, node_info, nvml_library
from dradriver.config import CHANNEL_NEEDS_HOST_MANAGED, PluginConfig, pre_warmed_implied
from dradriver.domain.claims import Claim
from dradriver.domain.computedomains import clique_domain_uid, fabric_taints, plugin_resource_slices
from dradriver.domain.faults import FaultKind
from dradriver.domain.featuregates import CRASH_ON_NVLINK_FABRIC_ERRORS, HOST_MANAGED_IMEX_DAEMON
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, DriverIdentity
from dradriver.domain.registry import DeviceRegistry
from dradriver.errors import DradriverError, FlagError
from dradriver.health.metrics import DriverMetrics
from dradriver.host import cdifiles, imexchannels
from dradriver.host.claimstate import ClaimState, ClaimStateProblem, read_boot_id
from dradriver.host.imexchannels import ImexNodeInfo
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE
from dradriver.host.pluginlocks import PluginLocks
from dradriver.kube.resourceslices import SlicePublisher
from dradriver.kubeletplugin import rollback
from dradriver.kubeletplugin.adoption import AdoptionReport, OwnGroups
from dradriver.kubeletplugin.basespec import BASE_SPEC_NAME, base_spec
from dradriver.kubeletplugin.bindingconditions import BindingConditionWriter
from dradriver.kubeletplugin.cdadoption import adopt_compute_domain_claims
from dradriver.kubeletplugin.devicestatus import DeviceStatusWriter, describe_channels
from dradriver.kubeletplugin.driverstate import DriverGate, DriverWatch, ReloadDetector
from dradriver.kubeletplugin.imexdomains import remove_vanished_domain_dirs
from dradriver.kubeletplugin.imexmode import check_driver_version, imex_ctl, refuse_beside_host_imex
from dradriver.kubeletplugin.lifecycle import Lifecycle
from dradriver.kubeletplugin.nodefabric import FABRIC_WAIT_BACKOFF, set_clique_label, wait_for_fabric
from dradriver.kubeletplugin.runner import BatchRunner, RecoveryReport
from dradriver.nvml import fabric
from dradriver.nvml.errors import NvmlError
from dradriver.nvml.session import NvmlSession
from dradriver.preparers.computedomain import (
    CHANNEL_KIND,
    BindingVerdict,
    ChannelPreparer,
    DaemonPreparer,
    DomainLookup,
    channel_devices,
)
from dradriver.preparers.mps import Backoff

log = logging.getLogger(__name__)

REFRESH_PERIOD_S = 600.0
"""Clique-label refresh and domain-directory cleanup period (NVIDIA: 10 minutes, with the clique re-read)."""
FABRIC_CHECK_PERIOD_S = 30.0
"""Fabric re-read period (clique ID and fabric health; dradriver's own: NVIDIA re-reads the clique every 10 minutes
and never the health)."""
FABRIC_TAINT = FaultKind.FABRIC_UNHEALTHY.value
"""Name part of the taint key on the plugin's devices when the node's fabric is faulty
(``compute-domain.nvidia.com/fabric-unhealthy``, the GPU plugin's ``gpu.nvidia.com/fabric-unhealthy``)."""
ABORTED_TTL_S = 90.0
"""How long an aborted prepare is remembered (NVIDIA: 2 x the kubelet's 45 s)."""


@dataclass
class ComputeDomainPlugin(assembly.KubeletPlugin):
    """A running ``compute-domain.nvidia.com`` kubelet plugin; create with :func:`start_compute_domain_plugin`."""

    session: NvmlSession | None = None
    imex: ImexNodeInfo | None = None
    clique_id: str = ""
    """This node's clique ID (``""``: in no clique), re-read every 30 seconds."""
    node_fabric: fabric.NodeFabric = field(default_factory=lambda: fabric.NodeFabric(""))
    """This node's fabric as last read (clique ID and faulty GPUs)."""
    refresh_task: asyncio.Task[Any] | None = None
    driver: DriverWatch | None = None
    """Whether the NVIDIA driver can be used now, and why not (:mod:`dradriver.kubeletplugin.driverstate`)."""
    driver_read: bool = False
    """This node's driver part is read (:func:`read_driver_part`: fabric, IMEX facts, base spec, clique label,
    devices published); False while the driver is absent or the fabric registration is in progress."""
    binding: BindingConditionWriter | None = None
    """The KEP-5007 binding conditions of this node's channels (``--binding-conditions``), else ``None``."""
    fabric_pending: str = ""
    """The GPUs' fabric registration states while :func:`wait_for_fabric` waits for them, else ``""``."""
    _clique_holder: list[str] = field(default_factory=lambda: [""])
    _nvml_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Held while the fabric check reads NVML and while a driver reload stops it (:func:`driver_away`), so no read
    runs on the NVML handle the driver watch shuts next."""

    def refusal(self) -> str:
        """Why prepares are refused now (``""`` when they are served): the NVLink fabric registration in progress,
        the NVIDIA driver's absence (:meth:`DriverWatch.refusal`), or the node's driver part not read yet."""
        if self.fabric_pending:
            return (f"waiting for NVLink fabric registration ({self.fabric_pending}); the plugin serves prepares "
                    "once the fabric manager is done, without a restart")
        why = self.driver.refusal() if self.driver is not None else ""
        return why or ("" if self.driver_read else "this node's NVLink fabric and IMEX facts are not read yet")

    def fabric_taints(self) -> list[dict[str, str]]:
        """The taints of every device of this node: ``<domain>/fabric-unhealthy`` NoSchedule with the reason
        (``registration-failed`` or ``unhealthy``) while the fabric is faulty, else none."""
        return fabric_taints(self.identity, self.node_fabric.reason)

    def check_fabric(self) -> fabric.NodeFabric:
        """Re-read the node's fabric and apply it (:meth:`apply_fabric`); a failure, or a registration in progress
        again, is logged and the last reading stays; an NVML failure that may be a driver reload has the driver
        watch check for one at once (:meth:`DriverWatch.suspect`). Blocking; returns the reading in force."""
        assert self.session is not None
        with self._nvml_lock:
            if not self.driver_read:  # the driver is absent or its part is being read: nothing to re-read
                return self.node_fabric
            try:
                now = fabric.assess_node(fabric.read_node_fabric(self.session),
                                         strict=self.config.feature_gates[CRASH_ON_NVLINK_FABRIC_ERRORS])
            except DradriverError as exc:
                log.error("cannot re-read this node's NVLink fabric (keeping clique %r): %s", self.clique_id, exc)
                if isinstance(exc, NvmlError) and self.driver is not None:
                    self.driver.suspect(exc.code)
                return self.node_fabric
        self.apply_fabric(now)
        return now

    def apply_fabric(self, now: fabric.NodeFabric) -> None:
        """Take a new fabric reading: a changed clique ID goes to the preparers and the node label; a fabric that
        turns faulty (or changes its fault) is logged and recorded as a ``FabricUnhealthy`` Warning Event, one that
        recovers as a ``FabricHealthy`` Normal Event; the devices' taints follow (republished)."""
        before = self.node_fabric
        self.node_fabric = now
        if now.clique_id != self.clique_id:
            log.warning("this node's NVLink clique changed from %r to %r", self.clique_id, now.clique_id)
            self.clique_id = now.clique_id
            self._clique_holder[0] = now.clique_id
            if self.config.gpu_clique_label_enabled:
                set_clique_label(self.client, self.config.node_name, now.clique_id)
        if now.message != before.message:
            if not now.healthy:
                message = (f"NVLink fabric of node {self.config.node_name} is faulty: {now.message}; its "
                           f"{self.identity.driver_name} devices are tainted {self.identity.taint_key(FABRIC_TAINT)}="
                           f"{now.reason}:NoSchedule")
                log.error("%s", message)
                assembly.report_event(self.identity, self.client, self.config, self.node_uid, "FabricUnhealthy",
                                      message)
            else:
                message = f"NVLink fabric of node {self.config.node_name} is healthy again; taints removed"
                log.info("%s", message)
                assembly.report_event(self.identity, self.client, self.config, self.node_uid, "FabricHealthy",
                                      message, type_="Normal")
            self.republish()

    def refresh(self) -> None:
        """Re-read the fabric (:meth:`check_fabric`), refresh the clique label, and remove the domain directories of
        ComputeDomains that are gone (in pre-warmed mode never this node's clique domain's: its daemon runs
        between two claims, a pod restart). Blocking."""
        self.check_fabric()
        if self.config.gpu_clique_label_enabled and self.driver_read:  # unknown clique: the label stays as it is
            set_clique_label(self.client, self.config.node_name, self.clique_id)
        keep = {clique_domain_uid(self.clique_id)} if self.config.imex_mode == "preWarmed" and self.clique_id else set()
        remove_vanished_domain_dirs(self.client, self.config, self.runner, keep=keep)


@dataclass
class DriverPart:
    """What :func:`read_driver_part` updates besides the plugin: the parts built from the node's IMEX facts."""

    registry: DeviceRegistry[dict[str, object]]
    """The plugin's devices (channels, and ``daemon-0`` driver-managed), from the IMEX channel count."""
    imex_parts: tuple[Any, ...]
    """The preparers holding the IMEX facts (``imex``)."""
    backoff: Backoff = FABRIC_WAIT_BACKOFF
    detector: ReloadDetector | None = None
    """Told the driver read (:meth:`ReloadDetector.remember`), for the driver watch's reload check."""


async def read_driver_part(plugin: ComputeDomainPlugin, connection: assembly.Connection, part: DriverPart) -> None:
    """Start step, or the NVIDIA driver's return (:class:`~dradriver.kubeletplugin.driverstate.DriverWatch`): what
    the plugin reads through the driver, with its sockets already served. The node's fabric (:func:`wait_for_fabric`),
    the driver version check (:func:`check_driver_version`), the IMEX facts (channel major and count,
    ``fabric-imex-mgmt`` minor) into the devices and preparers, the base CDI spec, the ``nvidia.com/gpu.clique``
    label (``--gpu-clique-label-enabled``), the fabric's health (:meth:`ComputeDomainPlugin.apply_fabric`), then the
    ResourceSlices; prepares are served from then on (:attr:`ComputeDomainPlugin.driver_read`).

    :raises dradriver.errors.DradriverError: as :func:`wait_for_fabric`, a driver too old for DNS-named IMEX
        daemons, the driver root not holding the driver's files, an invalid base spec.
    """
    config, identity, session = plugin.config, plugin.identity, plugin.session
    assert session is not None

    def pending(states: str) -> None:
        plugin.fabric_pending = states

    def report(reason: str, message: str) -> None:
        assembly.report_event(identity, connection.client, config, connection.node_uid, reason, message)

    node_fabric = await wait_for_fabric(config, identity, session, report=report, backoff=part.backoff,
                                        pending=pending)
    version = await asyncio.to_thread(session.driver_version)
    check_driver_version(version, config)
    imex = await asyncio.to_thread(imexchannels.read_imex_node_info, config.proc_root, config.proc_devices_path)
    plugin.imex = imex
    for preparer in part.imex_parts:
        preparer.imex = imex
    part.registry.replace(channel_devices(imex.channel_count, daemon=config.imex_mode != "hostManaged"))
    common = await asyncio.to_thread(driver_edits, config, version)
    spec = await asyncio.to_thread(base_spec, node_info(config), identity, session, imex, common)
    # Kept when the plugin stops: containers of prepared daemon claims may start while it is being upgraded.
    cdifiles.write_file_atomically(config.cdi_root / BASE_SPEC_NAME, spec)
    plugin.clique_id = plugin._clique_holder[0] = node_fabric.clique_id
    if config.gpu_clique_label_enabled:
        await asyncio.to_thread(set_clique_label, plugin.client, config.node_name, node_fabric.clique_id)
    await asyncio.to_thread(plugin.apply_fabric, node_fabric)  # a faulty fabric: logged, Event, taints
    if part.detector is not None:  # the driver a reload is told from
        await asyncio.to_thread(part.detector.remember)
    plugin.driver_read = True
    plugin.republish()
    log.info("NVIDIA driver %s: clique %s, %d IMEX channel(s); prepares are served", version,
             node_fabric.clique_id or "none", imex.channel_count)


def driver_away(plugin: ComputeDomainPlugin, connection: assembly.Connection, why: str) -> None:
    """The driver watch's ``depart``: a reload was detected under the running plugin (``why``). The fabric check
    stops using NVML (it waits for a read in progress; :attr:`ComputeDomainPlugin.driver_read` is False until the
    new driver's part is read) and a ``NvidiaDriverUnavailable`` Event names why
    (:func:`~dradriver.app.assembly.report_departure`). Prepares are refused meanwhile by the watch's reason;
    unprepares need no driver. Blocking."""
    with plugin._nvml_lock:
        plugin.driver_read = False
    assembly.report_departure(plugin.identity, plugin.config, connection, why)


async def driver_back(plugin: ComputeDomainPlugin, connection: assembly.Connection, part: DriverPart) -> None:
    """The driver watch's ``arrive``: the driver is usable again, at a start without it or after a reload. Its part
    is read again (:func:`read_driver_part`: fabric and clique, driver version, IMEX facts, the base CDI spec for the
    new driver's files and device numbers, the clique label, the ResourceSlices), then every prepared claim's CDI
    spec is rendered again with the new IMEX facts and rewritten where it changed
    (:meth:`~dradriver.kubeletplugin.runner.BatchRunner.refresh_specs`: a channel's major). After a reload a
    ``NvidiaDriverAvailable`` Event says so (:func:`~dradriver.app.assembly.report_return`).

    :raises dradriver.errors.DradriverError: as :func:`read_driver_part` (the watch logs it and tries again).
    """
    before = part.detector.version if part.detector is not None else ""
    await read_driver_part(plugin, connection, part)
    rewritten, unusable = await asyncio.to_thread(plugin.runner.refresh_specs)
    version = part.detector.version if part.detector is not None else ""
    log.info("NVIDIA driver %s back: %d prepared claim spec(s) rewritten%s", version or "(version unknown)",
             len(rewritten), f", {len(unusable)} not rendered" if unusable else "")
    if before:  # a reload under the running plugin (a start without the driver reported its own Event)
        summary = (f"clique {plugin.clique_id or 'none'}, {plugin.imex.channel_count if plugin.imex else 0} IMEX "
                   f"channel(s), base CDI spec and {len(rewritten)} prepared claim CDI spec(s) rewritten for it"
                   + (f", {len(unusable)} claim spec(s) not rendered (see the plugin's log)" if unusable else ""))
        await asyncio.to_thread(assembly.report_return, plugin.identity, plugin.config, connection,
                                version=version, before=before, summary=summary)


def on_loop(loop: asyncio.AbstractEventLoop, step: Callable[[], Coroutine[Any, Any, None]],
            ) -> tuple[Callable[[], None], Callable[[], None]]:
    """``step`` as a blocking call from another thread (the driver watch's), run on ``loop``; returns (the call,
    a cancel that ends the one in progress: the plugin stops)."""
    running: list[concurrent.futures.Future[None]] = []
    stopped = threading.Event()

    def call() -> None:
        if stopped.is_set():
            raise DradriverError("the plugin is stopping")
        future = asyncio.run_coroutine_threadsafe(step(), loop)
        running[:] = [future]
        if stopped.is_set():
            future.cancel()
        try:
            future.result()
        except concurrent.futures.CancelledError:
            raise DradriverError("the plugin is stopping") from None

    def cancel() -> None:
        stopped.set()
        for future in running:
            future.cancel()

    return call, cancel


async def adopt_nvidia_claims(identity: DriverIdentity, config: PluginConfig, connection: assembly.Connection,
                              runner: BatchRunner, clock: Callable[[], float],
                              metrics: DriverMetrics | None = None,
                              own_groups: OwnGroups | None = None) -> AdoptionReport:
    """Start step before recovery: adopt the claims NVIDIA's compute-domain plugin prepared
    (:func:`dradriver.kubeletplugin.cdadoption.adopt_compute_domain_claims`; ``own_groups``: the rollback
    checkpoint's, for the switching-back-and-forth rule), reported as the GPU plugin's
    (:func:`dradriver.app.assembly.report_adoption`)."""
    path = config.plugin_dir / CHECKPOINT_FILE
    report = await asyncio.to_thread(
        assembly.while_prepares_wait, config, adopt_compute_domain_claims, runner.state, path,
        boot_id=read_boot_id(config.boot_id_path), pool=config.node_name, driver=identity.driver_name,
        spec_of=runner.spec_path, aborted_ttl_s=ABORTED_TTL_S, clock=clock, own_groups=own_groups)
    await assembly.report_adoption(identity, config, connection, runner, path, report, metrics)
    await asyncio.to_thread(assembly.retire_adopted_checkpoint, config, path, report)
    return report


async def start_compute_domain_plugin(config: PluginConfig, identity: DriverIdentity = COMPUTE_DOMAIN_DRIVER, *,
                                      clock: Callable[[], float] = time.time,
                                      fabric_wait: Backoff = FABRIC_WAIT_BACKOFF) -> ComputeDomainPlugin:
    """Start every part of the compute-domain kubelet plugin and return it running (the steps of the module
    docstring, each a function below).

    :param clock: wall-clock seconds (Unix time) of the aborted-prepare marks and their 90 s TTL, which survive a
        restart in the claim state (tests pass their own).
    :param fabric_wait: delays between fabric reads while a registration is in progress (:func:`wait_for_fabric`).

    :raises dradriver.errors.DradriverError: a part cannot start: GPUs disagreeing on the clique, no API access (a
        bad kubeconfig fails before anything on the host is touched), a socket in use, a driver too old for
        DNS-named IMEX daemons, ``--imex-mode hostManaged`` without the gate, an ``nvmlInit`` failure other than
        the driver's absence; nothing is left running. A fabric registration in progress is waited out with the
        sockets served (:func:`wait_for_fabric`), a faulty fabric taints the devices, and an absent NVIDIA driver
        is no error: the plugin serves unprepares, refuses prepares with the reason, and reads its driver part
        (:func:`read_driver_part`) once the driver is back, without a restart.
    """
    config = _checked_config(config, identity)  # FlagError before anything on the host is touched
    implementations = _native.load_all()
    log.info("hot paths: %s", ", ".join(f"{k}={v}" for k, v in implementations.items()))
    life = Lifecycle(identity.driver_name)
    try:
        connection, session = await _open_host(life, identity, config)
        state, problems = await assembly.open_claim_state(life, identity, config, connection)
        parts = _build_runner(life, identity, config, connection, state, clock)
        recovery = await _recover(identity, config, connection, parts, problems, clock)
        publisher = assembly.make_publisher(identity, config, connection)
        await assembly.serve_metrics_step(life, config, parts.metrics)  # the chart's :8081 (request metrics)
        plugin = await _serve(life, identity, config, connection, session, parts,
                              state=state, problems=problems, recovery=recovery, publisher=publisher)
        part = _watch_driver(plugin, connection, parts, fabric_wait)
        await assembly.run_publisher(life, publisher)
        if session.available:  # else the ResourceSlices the last run published stay until the driver is back
            await read_driver_part(plugin, connection, part)
        watch = plugin.driver
        assert watch is not None
        await life.step("NVIDIA driver watch", watch.start, lambda _: asyncio.to_thread(watch.stop))
        plugin.refresh_task = await _run_refresh(life, plugin)
        if config.binding_conditions:
            plugin.binding = await _write_binding_conditions(life, plugin, parts)
        plugin.reconciler = await assembly.run_stale_claim_cleanup(life, identity, config, connection, plugin.runner)
    except BaseException:
        await life.stop(1.0)
        raise
    log.info("kubelet plugin for %s on node %s serving at %s (clique %s, IMEX %s)", identity.driver_name,
             config.node_name, config.dra_socket, plugin.clique_id or "none", config.imex_mode)
    return plugin


def _checked_config(config: PluginConfig, identity: DriverIdentity) -> PluginConfig:
    """Start step: the configuration under ``identity``'s names (sockets, plugin directory and lock follow it), its
    IMEX flags checked before anything on the host is touched.

    :raises FlagError: channel isolation without host-managed IMEX, host-managed IMEX without its gate, or
        driver-managed IMEX beside the host's ``nvidia-imex.service`` (:func:`refuse_beside_host_imex`).
    """
    if config.driver_name != identity.driver_name:
        config = dataclasses.replace(config, driver_name=identity.driver_name)
    config = pre_warmed_implied(config)
    host_managed = config.imex_mode == "hostManaged"
    if config.imex_isolation == "channel" and not host_managed and config.imex_mode != "preWarmed":
        raise FlagError(CHANNEL_NEEDS_HOST_MANAGED)
    if host_managed and not config.feature_gates[HOST_MANAGED_IMEX_DAEMON]:
        raise FlagError("--imex-mode hostManaged needs the feature gate HostManagedIMEXDaemon")
    refuse_beside_host_imex(config)
    return config


async def _open_host(life: Lifecycle, identity: DriverIdentity, config: PluginConfig,
                     ) -> tuple[assembly.Connection, NvmlSession]:
    """Start step: validate, then touch the host (:func:`~dradriver.app.assembly.open_host`: no directory is
    created before the API server answers); a driver that is not available now is reported, no error; the
    ``nvidia.com/gpu.clique`` label (set once the fabric is read) is removed at stop, except in pre-warmed mode: the
    controller's clique DaemonSet selects the node by it, so removing it would stop the node's clique daemon (and
    the IMEX of every domain there) at each plugin restart or upgrade; the next start sets it again, to the new
    clique when the tray moved."""
    connection, session = await assembly.open_host(life, identity, config, nvml_library(config))
    if not session.available:
        await assembly.report_unavailable(identity, config, connection, session)
    if config.gpu_clique_label_enabled and config.imex_mode != "preWarmed":
        life.on_stop("nvidia.com/gpu.clique label", lambda: set_clique_label(connection.client, config.node_name, ""))
    return connection, session


@dataclass
class _Parts:
    """What :func:`_build_runner` makes for the later start steps."""

    imex: ImexNodeInfo
    registry: DeviceRegistry[dict[str, object]]
    channels: ChannelPreparer
    daemons: DaemonPreparer
    runner: BatchRunner
    metrics: DriverMetrics
    checkpoint: rollback.RollbackCheckpoint | None
    clique: list[str]
    """The clique ID the preparers read (one cell, set by :meth:`ComputeDomainPlugin.apply_fabric`)."""
    plugin_ref: list[ComputeDomainPlugin]
    """The plugin once :func:`_serve` made it (the device-metadata files, refusal and slices ask it)."""
    status_writer: DeviceStatusWriter


def _build_runner(life: Lifecycle, identity: DriverIdentity, config: PluginConfig, connection: assembly.Connection,
                  state: ClaimState, clock: Callable[[], float]) -> _Parts:
    """Start step: the devices from the IMEX facts as they are now (the claims' specs rebuilt at recovery need them;
    read again with the driver's part), the channel and daemon preparers, the device status writer (KEP-4817: each
    channel's ComputeDomain), NVIDIA's rollback checkpoint (``--nvidia-checkpoint``) and the batch runner."""
    host_managed = config.imex_mode == "hostManaged"
    channel_isolation = config.imex_isolation == "channel"
    holder = [""]

    def current_clique() -> str:
        return holder[0]

    imex = imexchannels.read_imex_node_info(config.proc_root, config.proc_devices_path)
    registry: DeviceRegistry[dict[str, object]] = DeviceRegistry(
        channel_devices(imex.channel_count, daemon=not host_managed), lambda devices: devices)
    lookup = DomainLookup(connection.client, config.node_name, config.namespace, plugin_dir=config.plugin_dir)
    ask_imex_ctl = imex_ctl(config) if host_managed else None
    runner_holder: list[BatchRunner] = []

    def held_channels(exclude_uid: str) -> list[tuple[str, Any]]:
        return runner_holder[0].stored_records(CHANNEL_KIND, exclude_uid) if runner_holder else []

    pre_warmed = config.imex_mode == "preWarmed"
    channels = ChannelPreparer(lookup, identity, imex, current_clique, host_managed=host_managed,
                               pre_warmed=pre_warmed, imex_ctl=ask_imex_ctl,
                               held_channels=held_channels if channel_isolation else None)
    daemons = DaemonPreparer(lookup, identity, imex, current_clique, config.plugin_dir, clique_domains=pre_warmed)
    preparers: list[Any] = [channels] if host_managed else [channels, daemons]
    metrics = DriverMetrics(node=config.node_name, driver=identity.driver_name)
    plugin_ref: list[ComputeDomainPlugin] = []
    status_writer = DeviceStatusWriter(connection.client, driver=identity.driver_name, pool=config.node_name,
                                       describe=describe_channels)
    life.on_stop("device status writer", status_writer.close)
    checkpoint = (rollback.open_rollback_checkpoint(identity, config.plugin_dir, config.boot_id_path)
                  if config.nvidia_checkpoint else None)  # NVIDIA's, for a rollback
    runner = BatchRunner(
        identity=identity, registry=registry, state=state, checkpoint=checkpoint,
        fetch_claim=assembly.claim_fetcher(identity, connection.client, config),
        cdi_root=config.cdi_root, pool=config.node_name, preparers=preparers,
        undo_only=[daemons] if host_managed else [],  # daemon claims of before a switch to host-managed
        prepare_deadline_s=float(config.prepare_deadline_seconds), aborted_ttl_s=ABORTED_TTL_S, clock=clock,
        metrics=metrics, device_metadata=assembly.device_metadata_files(identity, config, plugin_ref),
        on_prepared=status_writer.prepared, on_unprepared=status_writer.unprepared,
        locks=PluginLocks(config.plugin_dir),
    )
    runner_holder.append(runner)
    life.on_stop("batch runner", runner.close)
    return _Parts(imex=imex, registry=registry, channels=channels, daemons=daemons, runner=runner, metrics=metrics,
                  checkpoint=checkpoint, clique=holder, plugin_ref=plugin_ref, status_writer=status_writer)


async def _recover(identity: DriverIdentity, config: PluginConfig, connection: assembly.Connection, parts: _Parts,
                   problems: tuple[ClaimStateProblem, ...], clock: Callable[[], float]) -> RecoveryReport:
    """Start step: adopt NVIDIA's claims (:func:`adopt_nvidia_claims`), converge the claim state
    (:func:`~dradriver.app.assembly.recover`), then load the rollback checkpoint with what the claim state holds."""
    adopted = await adopt_nvidia_claims(identity, config, connection, parts.runner, clock, parts.metrics,
                                        parts.checkpoint.groups_of if parts.checkpoint is not None else None)
    recovery = await assembly.recover(identity, config, connection, parts.runner, problems, parts.status_writer)
    if parts.checkpoint is not None:  # after recovery: it names what the claim state holds now
        await asyncio.to_thread(parts.checkpoint.load, parts.runner.state.claims(),
                                (*adopted.started, *adopted.unflushed, *recovery.aborted_expired))
    return recovery


async def _serve(life: Lifecycle, identity: DriverIdentity, config: PluginConfig, connection: assembly.Connection,
                 session: NvmlSession, parts: _Parts, *, state: ClaimState, problems: tuple[ClaimStateProblem, ...],
                 recovery: RecoveryReport, publisher: SlicePublisher) -> ComputeDomainPlugin:
    """Start step: the gRPC servers and the plugin they serve. Served before the driver's part is read: the
    kubelet's unprepares are answered from the claim state while the driver is absent or the fabric registration
    is in progress; prepares are refused with the reason (:meth:`ComputeDomainPlugin.refusal`; the ``readiness``
    probe NOT_SERVING meanwhile)."""
    plugin_ref = parts.plugin_ref
    host_managed = config.imex_mode == "hostManaged"
    channel_isolation = config.imex_isolation == "channel"

    def refusal() -> str:
        return plugin_ref[0].refusal() if plugin_ref else "the plugin is starting"

    servers = await assembly.serve(life, config, DriverGate(parts.runner, refusal), publisher=publisher,
                                   ready=lambda: not refusal())

    def desired() -> list[dict[str, Any]]:
        plugin = plugin_ref[0]
        count = plugin.imex.channel_count if plugin.imex is not None else 0
        return plugin_resource_slices(config.node_name, identity.driver_name, daemon=not host_managed,
                                      channels=count if channel_isolation else 1, taints=plugin.fabric_taints(),
                                      binding_conditions=config.binding_conditions)

    plugin = ComputeDomainPlugin(identity=identity, config=config, lifecycle=life, client=connection.client,
                                 node_uid=connection.node_uid, state=state, state_problems=problems,
                                 runner=parts.runner, recovery=recovery, publisher=publisher, servers=servers,
                                 desired=desired, session=session, imex=parts.imex, _clique_holder=parts.clique)
    plugin_ref.append(plugin)
    return plugin


def _watch_driver(plugin: ComputeDomainPlugin, connection: assembly.Connection, parts: _Parts,
                  fabric_wait: Backoff) -> DriverPart:
    """Start step: the plugin's NVIDIA driver watch (:attr:`ComputeDomainPlugin.driver`, started later), with the
    GPU plugin's reload check (:class:`~dradriver.kubeletplugin.driverstate.ReloadDetector`: a new driver version or
    ``nvidia`` major), :func:`driver_away` as its ``depart`` and :func:`driver_back` as its ``arrive``; returns the
    driver part they and the start read."""
    assert plugin.session is not None
    session, config = plugin.session, plugin.config
    detector = ReloadDetector(session, node_info(config).read_majors)
    part = DriverPart(parts.registry, (parts.channels, parts.daemons), fabric_wait, detector)
    arrive, cancel_arrival = on_loop(asyncio.get_running_loop(), lambda: driver_back(plugin, connection, part))
    plugin.driver = DriverWatch(session, library=lambda: nvml_library(config), arrive=arrive,
                                interrupt=cancel_arrival, reloaded=detector.check,
                                depart=lambda why: driver_away(plugin, connection, why))
    return part


async def _write_binding_conditions(life: Lifecycle, plugin: ComputeDomainPlugin, parts: _Parts,
                                    ) -> BindingConditionWriter:
    """Start step (``--binding-conditions``): the writer of the channels' KEP-5007 binding conditions
    (:mod:`dradriver.kubeletplugin.bindingconditions`), asking the channel preparer whether a claim's domain is ready
    here; while prepares are refused (driver absent, fabric not read) a claim waits."""
    def assess(claim: Claim, device: str) -> BindingVerdict:
        why = plugin.refusal()
        if why:
            return BindingVerdict("waiting", "PluginNotReady", why)
        return parts.channels.assess_binding(claim, device)

    writer = BindingConditionWriter(plugin.client, driver=plugin.identity.driver_name, pool=plugin.config.node_name,
                                    assess=assess, abandon=parts.channels.abandon_binding)
    return await life.step("binding conditions", writer.start, lambda w: asyncio.to_thread(w.stop))


async def _run_refresh(life: Lifecycle, plugin: ComputeDomainPlugin) -> asyncio.Task[Any]:
    async def loop() -> None:
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(FABRIC_CHECK_PERIOD_S)
            if time.monotonic() - last_refresh >= REFRESH_PERIOD_S:
                last_refresh = time.monotonic()
                await asyncio.to_thread(plugin.refresh)
            else:
                await asyncio.to_thread(plugin.check_fabric)

    def start() -> asyncio.Task[Any]:
        task = asyncio.create_task(loop(), name="compute-domain-refresh")
        task.add_done_callback(assembly.report_task_end)
        return task

    return await life.step("fabric check and clique refresh", start, lambda task: assembly.cancel_tasks([task]))


async def run_compute_domain_plugin(config: PluginConfig, stop: asyncio.Event) -> None:
    """Start the plugin, wait for ``stop``, then stop it. A ``stop`` during the start (while it waits for the
    NVLink fabric registration) ends the start: nothing is left running."""
    starting = asyncio.create_task(start_compute_domain_plugin(config), name="compute-domain-start")
    stopping = asyncio.create_task(stop.wait(), name="compute-domain-stop")
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        log.info("stopped while starting")
        await assembly.cancel_tasks([starting])
        return
    plugin = starting.result()
    try:
        await stop.wait()
    finally:
        await plugin.stop()
