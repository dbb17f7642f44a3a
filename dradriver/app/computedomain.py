"""The ``compute-domain.nvidia.com`` kubelet plugin (``dradriver compute-domain-kubelet-plugin``): its composition.

Steps, in order (stopped in reverse): compiled hot paths -> Kubernetes client and this Node (a bad kubeconfig
fails here, before anything on the host is touched) -> plugin and CDI directories -> NVML session (a driver that is
not available now is no error: a ``NvidiaDriverUnavailable`` Event names ``nvmlInit``'s failure) -> claim state ->
IMEX facts from procfs -> batch runner with the IMEX channel and daemon preparers, and crash convergence -> gRPC
servers, whose prepares are refused per claim while :meth:`ComputeDomainPlugin.refusal` says why (the
``readiness`` probe NOT_SERVING meanwhile) and whose unprepares are always served from the claim state ->
ResourceSlice publisher -> the driver's part (:func:`read_driver_part`, at once when the driver is available, else
when :class:`~dradriver.app.driverstate.DriverWatch` finds it back, without a restart): the node's fabric
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
refresh, domain directories of vanished ComputeDomains removed) -> stale-claim cleanup.

No undo of this plugin needs the driver (a channel claim's undo removes the node label through the API, a daemon
claim's has nothing to do), so an unprepare while the driver is absent is complete: spec deleted, record removed,
label handled as on any unprepare.

Facts: ``nvidia-dra-driver.md`` 1.2, 2.7, 4.8, 4.9, 5.2, 7.2; ``nvidia-dra-driver-updates.md`` 2c.
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
from dradriver.app import assembly, driverstate
from dradriver.app.devicestatus import DeviceStatusWriter, describe_channels
from dradriver.app.driverstate import DriverGate, DriverWatch
from dradriver.app.gpu import driver_edits, node_info, nvml_library
from dradriver.config import CHANNEL_NEEDS_HOST_MANAGED, PluginConfig
from dradriver.domain import cdi
from dradriver.domain.computedomains import NODE_CLIQUE_LABEL, fabric_taints, plugin_resource_slices
from dradriver.domain.faults import FaultKind
from dradriver.domain.featuregates import CRASH_ON_NVLINK_FABRIC_ERRORS, HOST_MANAGED_IMEX_DAEMON
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, DriverIdentity
from dradriver.domain.registry import DeviceRegistry
from dradriver.errors import DradriverError, FlagError
from dradriver.health.metrics import DriverMetrics
from dradriver.host import cdifiles, devicenodes, imexchannels, imexservice
from dradriver.host.claimstate import read_boot_id
from dradriver.host.imexchannels import ImexNodeInfo
from dradriver.host.nvcheckpointfile import CHECKPOINT_FILE
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kubeletplugin import rollback
from dradriver.kubeletplugin.adoption import AdoptionReport, OwnGroups
from dradriver.kubeletplugin.cdadoption import adopt_compute_domain_claims
from dradriver.kubeletplugin.lifecycle import Lifecycle
from dradriver.kubeletplugin.runner import BatchRunner
from dradriver.nvml import fabric
from dradriver.nvml.session import NvmlSession
from dradriver.preparers.computedomain import (
    CHANNEL_KIND,
    ChannelPreparer,
    DaemonPreparer,
    DomainLookup,
    channel_devices,
)
from dradriver.preparers.mps import Backoff

log = logging.getLogger(__name__)

BASE_SPEC_NAME = "k8s.compute-domain.nvidia.com-device_base.json"
"""The base spec's file (NVIDIA writes ``..._base.yaml``; dradriver's specs are JSON, ``cdi.md`` 2.5)."""
REFRESH_PERIOD_S = 600.0
"""Clique-label refresh and domain-directory cleanup period (NVIDIA: 10 minutes, with the clique re-read)."""
FABRIC_CHECK_PERIOD_S = 30.0
"""Fabric re-read period (clique ID and fabric health; dradriver's own: NVIDIA re-reads the clique every 10 minutes
and never the health)."""
FABRIC_WAIT_BACKOFF = Backoff(initial_s=1.0, max_s=30.0, jitter=0.1)
"""Delays between fabric reads while a GPU's registration is in progress at start: 1 s doubling to 30 s."""
FABRIC_TAINT = FaultKind.FABRIC_UNHEALTHY.value
"""Name part of the taint key on the plugin's devices when the node's fabric is faulty
(``compute-domain.nvidia.com/fabric-unhealthy``, the GPU plugin's ``gpu.nvidia.com/fabric-unhealthy``)."""
ABORTED_TTL_S = 90.0
"""How long an aborted prepare is remembered (NVIDIA: 2 x the kubelet's 45 s)."""
DNS_NAMES_MIN_DRIVER = "570.158.01"
"""``IMEXDaemonsWithDNSNamesMinDriverVersion``: driver-managed IMEX with DNS names needs this driver or newer."""


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
    """Whether the NVIDIA driver can be used now, and why not (:mod:`dradriver.app.driverstate`)."""
    driver_read: bool = False
    """This node's driver part is read (:func:`read_driver_part`: fabric, IMEX facts, base spec, clique label,
    devices published); False while the driver is absent or the fabric registration is in progress."""
    fabric_pending: str = ""
    """The GPUs' fabric registration states while :func:`wait_for_fabric` waits for them, else ``""``."""
    _clique_holder: list[str] = field(default_factory=lambda: [""])

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
        again, is logged and the last reading stays. Blocking; returns the reading in force."""
        assert self.session is not None
        if not self.driver_read:  # the driver is absent or the start's read is in progress: nothing to re-read
            return self.node_fabric
        try:
            now = fabric.assess_node(fabric.read_node_fabric(self.session),
                                     strict=self.config.feature_gates[CRASH_ON_NVLINK_FABRIC_ERRORS])
        except DradriverError as exc:
            log.error("cannot re-read this node's NVLink fabric (keeping clique %r): %s", self.clique_id, exc)
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
        ComputeDomains that are gone. Blocking."""
        self.check_fabric()
        if self.config.gpu_clique_label_enabled and self.driver_read:  # unknown clique: the label stays as it is
            set_clique_label(self.client, self.config.node_name, self.clique_id)
        remove_vanished_domain_dirs(self.client, self.config, self.runner)


def set_clique_label(client: Any, node: str, clique: str) -> None:
    """Set ``nvidia.com/gpu.clique=<clique>`` (removed when ``clique`` is empty); failures are logged."""
    try:
        kube_cd.set_node_label(client, node, NODE_CLIQUE_LABEL, clique or None)
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot set node label %s: %s", NODE_CLIQUE_LABEL, exc)


def remove_vanished_domain_dirs(client: Any, config: PluginConfig, runner: BatchRunner) -> list[str]:
    """Remove ``<plugin dir>/domains/<cdUID>`` of every ComputeDomain that no longer exists and that no stored
    daemon claim names (NVIDIA's 10-minute loop); returns the removed UIDs."""
    held = {str(r.data.get("domain")) for _uid, r in runner.stored_records("imex-daemon", "")}
    removed: list[str] = []
    try:
        existing = {str((i.get("metadata") or {}).get("uid")) for i in
                    kube_cd.list_compute_domains(client).get("items") or ()}
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot list ComputeDomains for the domain-directory cleanup: %s", exc)
        return removed
    for uid in imexchannels.domain_dirs(config.plugin_dir):
        if uid in existing or uid in held:
            continue
        try:
            if imexchannels.remove_domain_dir(config.plugin_dir, uid):
                removed.append(uid)
                log.info("removed IMEX domain directory of ComputeDomain %s (gone)", uid)
        except imexchannels.ImexError as exc:
            log.warning("%s", exc)
    return removed


def check_driver_version(version: str, config: PluginConfig) -> None:
    """NVIDIA's start-up check: driver-managed IMEX with DNS names needs driver >= 570.158.01.

    :raises FlagError: the driver is older (names both versions).
    """
    if config.imex_mode != "driverManaged":
        return
    try:
        too_old = _version_tuple(version) < _version_tuple(DNS_NAMES_MIN_DRIVER)
    except ValueError:
        log.warning("cannot compare NVIDIA driver version %r with %s", version, DNS_NAMES_MIN_DRIVER)
        return
    if too_old:
        raise FlagError(f"NVIDIA driver {version} is older than {DNS_NAMES_MIN_DRIVER}, which IMEX daemons with DNS "
                        "names (gate IMEXDaemonsWithDNSNames) need")


def refuse_beside_host_imex(config: PluginConfig) -> None:
    """Driver-managed IMEX on a node whose host runs ``nvidia-imex.service`` cannot work: the host's daemon holds
    the node's only IMEX session, so each daemon pod's ``nvidia-imex`` fails to start, and a probe that asked any
    daemon on the node would find the host's READY (:mod:`dradriver.host.imexservice`). Checked at start, before
    anything on the host is touched; an enabled but stopped service (it starts at the next boot) is a warning.

    :raises FlagError: the service runs (names it, the file that says so, and both ways out).
    """
    if config.imex_mode != "driverManaged":
        return
    found = imexservice.find_host_imex_service(config.container_driver_root)
    if found is None:
        return
    unit = imexservice.IMEX_SERVICE
    if found.active:
        raise FlagError(
            f"the host runs {unit} (systemd: {found.evidence} under the driver root {config.container_driver_root}): "
            "it holds this node's only IMEX session, so the IMEX daemons of ComputeDomains cannot start with "
            "--imex-mode (env IMEX_MODE) driverManaged. Either stop and disable it on the host (systemctl disable "
            f"--now {unit}), or let it serve IMEX: IMEX_MODE=hostManaged with the feature gate "
            "HostManagedIMEXDaemon=true (chart: resources.computeDomains.imex.mode: hostManaged)")
    log.warning("%s is enabled on the host (%s) but not running: it will take this node's IMEX session at the next "
                "boot, and driver-managed ComputeDomains will then fail here; disable it (systemctl disable %s) or "
                "use IMEX_MODE=hostManaged", unit, ", ".join(found.enabled), unit)


def _version_tuple(text: str) -> tuple[int, ...]:
    """``570.158.01`` -> ``(570, 158, 1)``; :raises ValueError: not dotted integers."""
    return tuple(int(part) for part in text.strip().split("."))


def base_spec(config: PluginConfig, identity: DriverIdentity, session: NvmlSession, imex: ImexNodeInfo,
              common: cdi.ContainerEdits) -> bytes:
    """The base spec: kind ``<vendor>/device``, one device ``all`` with the control nodes, every GPU's
    ``/dev/nvidia<minor>``, the ``fabric-imex-mgmt`` capability and the channel nodes present on the node, plus the
    driver's user space (``nvidia-imex``, ``nvidia-imex-ctl`` among the binaries) and ``NVIDIA_VISIBLE_DEVICES=void``
    (NVIDIA's "management" mode, ``nvidia-dra-driver.md`` 5.2).

    :raises dradriver.domain.cdi.CdiSpecError: the spec breaks a CDI rule.
    """
    info = node_info(config)
    majors = info.read_majors()
    edits = devicenodes.control_edits(info, majors)
    nvidia = info.major(majors, ("nvidia", "nvidia-frontend", "nvidiactl"), "/dev/nvidiactl")
    nodes: list[cdi.DeviceNode] = []
    for minor in fabric.gpu_minors(session):
        nodes.append(cdi.DeviceNode(f"/dev/nvidia{minor}", info.host_path(f"/dev/nvidia{minor}"), "c", nvidia, minor))
    if imex.fabric_imex_mgmt_minor is not None and imex.caps_major is not None:
        path = imex.fabric_imex_mgmt_path
        nodes.append(cdi.DeviceNode(path, info.host_path(path), "c", imex.caps_major, imex.fabric_imex_mgmt_minor))
    if imex.channel_major is not None:
        for n in range(imex.channel_count):
            path = f"/dev/nvidia-caps-imex-channels/channel{n}"
            if info.stat_node(path) is not None:
                nodes.append(cdi.DeviceNode(path, info.host_path(path), "c", imex.channel_major, n, 0o666))
    edits = edits + cdi.ContainerEdits(device_nodes=tuple(nodes)) + common
    renderer = _native.load("cdispec")
    try:
        data: bytes = renderer.render_spec(f"{identity.cdi.vendor}/device", [("all", edits.record())], None)
    except (TypeError, ValueError) as exc:
        raise cdi.CdiSpecError(f"base CDI spec: {exc}") from exc
    return data


async def wait_for_fabric(config: PluginConfig, identity: DriverIdentity, session: NvmlSession,
                          connection: assembly.Connection, *, backoff: Backoff = FABRIC_WAIT_BACKOFF,
                          pending: Callable[[str], None] = lambda _states: None) -> fabric.NodeFabric:
    """Read the node's fabric; while a GPU's registration is in progress (strict mode,
    :class:`~dradriver.nvml.fabric.FabricPendingError`), read again after each of ``backoff``'s delays.

    While it waits: ``pending`` gets the GPUs' states (``""`` once the wait ends: the plugin, already serving,
    refuses prepares naming them and answers the ``readiness`` probe NOT_SERVING; unprepares are served); each read
    logs them; a ``FabricRegistrationPending`` Warning Event on the Node names them (again when they change).

    :returns: the reading.
    :raises dradriver.nvml.fabric.FabricError: GPUs disagree on the clique.
    :raises dradriver.nvml.errors.NvmlError: fabric info cannot be read.
    """
    strict = config.feature_gates[CRASH_ON_NVLINK_FABRIC_ERRORS]
    delays = iter(backoff.delays())
    reported = ""
    started = time.monotonic()
    try:
        while True:
            gpus = await asyncio.to_thread(fabric.read_node_fabric, session)
            try:
                node = fabric.assess_node(gpus, strict=strict)
            except fabric.FabricPendingError as exc:
                delay = next(delays)
                pending(str(exc))
                log.warning("waiting for NVLink fabric registration, not ready meanwhile: %s; reading again in %.1f s",
                            exc, delay)
                if str(exc) != reported:
                    reported = str(exc)
                    await asyncio.to_thread(
                        assembly.report_event, identity, connection.client, config, connection.node_uid,
                        "FabricRegistrationPending", f"{identity.driver_name} kubelet plugin waits for the NVLink "
                        f"fabric manager to register this node's GPUs (not ready meanwhile): {exc}")
                await asyncio.sleep(delay)
                continue
            log.info("NVLink clique of node %s: %s (%d GPU(s), %s mode)%s", config.node_name,
                     node.clique_id or "none (not MNNVL)", len(gpus), "strict" if strict else "legacy",
                     f"; fabric registration done after {time.monotonic() - started:.1f} s" if reported else "")
            return node
    finally:
        pending("")


@dataclass
class DriverPart:
    """What :func:`read_driver_part` updates besides the plugin: the parts built from the node's IMEX facts."""

    registry: DeviceRegistry[dict[str, object]]
    """The plugin's devices (channels, and ``daemon-0`` driver-managed), from the IMEX channel count."""
    imex_parts: tuple[Any, ...]
    """The preparers holding the IMEX facts (``imex``)."""
    backoff: Backoff = FABRIC_WAIT_BACKOFF


async def read_driver_part(plugin: ComputeDomainPlugin, connection: assembly.Connection, part: DriverPart) -> None:
    """Start step, or the NVIDIA driver's return (:class:`~dradriver.app.driverstate.DriverWatch`): what the plugin
    reads through the driver, with its sockets already served. The node's fabric (:func:`wait_for_fabric`), the
    driver version check (:func:`check_driver_version`), the IMEX facts (channel major and count,
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

    node_fabric = await wait_for_fabric(config, identity, session, connection, backoff=part.backoff, pending=pending)
    version = await asyncio.to_thread(session.driver_version)
    check_driver_version(version, config)
    imex = await asyncio.to_thread(imexchannels.read_imex_node_info, config.proc_root, config.proc_devices_path)
    plugin.imex = imex
    for preparer in part.imex_parts:
        preparer.imex = imex
    part.registry.replace(channel_devices(imex.channel_count, daemon=config.imex_mode != "hostManaged"))
    common = await asyncio.to_thread(driver_edits, config, version)
    spec = await asyncio.to_thread(base_spec, config, identity, session, imex, common)
    # Kept when the plugin stops: containers of prepared daemon claims may start while it is being upgraded.
    cdifiles.write_file_atomically(config.cdi_root / BASE_SPEC_NAME, spec)
    plugin.clique_id = plugin._clique_holder[0] = node_fabric.clique_id
    if config.gpu_clique_label_enabled:
        await asyncio.to_thread(set_clique_label, plugin.client, config.node_name, node_fabric.clique_id)
    await asyncio.to_thread(plugin.apply_fabric, node_fabric)  # a faulty fabric: logged, Event, taints
    plugin.driver_read = True
    plugin.republish()
    log.info("NVIDIA driver %s: clique %s, %d IMEX channel(s); prepares are served", version,
             node_fabric.clique_id or "none", imex.channel_count)


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
        adopt_compute_domain_claims, runner.state, path, boot_id=read_boot_id(config.boot_id_path),
        pool=config.node_name, driver=identity.driver_name, spec_of=runner.spec_path, aborted_ttl_s=ABORTED_TTL_S,
        clock=clock, own_groups=own_groups)
    await assembly.report_adoption(identity, config, connection, runner, path, report, metrics)
    return report


async def start_compute_domain_plugin(config: PluginConfig, identity: DriverIdentity = COMPUTE_DOMAIN_DRIVER, *,
                                      clock: Callable[[], float] = time.time,
                                      fabric_wait: Backoff = FABRIC_WAIT_BACKOFF) -> ComputeDomainPlugin:
    """Start every part of the compute-domain kubelet plugin and return it running.

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
    if config.driver_name != identity.driver_name:
        config = dataclasses.replace(config, driver_name=identity.driver_name)
    host_managed = config.imex_mode == "hostManaged"
    channel_isolation = config.imex_isolation == "channel"
    if channel_isolation and not host_managed:
        raise FlagError(CHANNEL_NEEDS_HOST_MANAGED)
    if host_managed and not config.feature_gates[HOST_MANAGED_IMEX_DAEMON]:
        raise FlagError("--imex-mode hostManaged needs the feature gate HostManagedIMEXDaemon")
    refuse_beside_host_imex(config)  # FlagError before anything on the host is touched
    implementations = _native.load_all()
    log.info("hot paths: %s", ", ".join(f"{k}={v}" for k, v in implementations.items()))
    life = Lifecycle(identity.driver_name)
    try:
        # Validate, then touch the host (assembly.open_host): no directory is created before the API server answers.
        connection, session = await assembly.open_host(life, identity, config, nvml_library(config))
        if not session.available:
            await driverstate.report_unavailable(identity, config, connection, session)
        if config.gpu_clique_label_enabled:  # set once the fabric is read (read_driver_part)
            life.on_stop("nvidia.com/gpu.clique label",
                         lambda: set_clique_label(connection.client, config.node_name, ""))
        state, problems = await assembly.open_claim_state(life, identity, config, connection)
        holder = [""]

        def current_clique() -> str:
            return holder[0]

        # The procfs facts as they are now (the claims' specs rebuilt at recovery need them); read again with the
        # driver's part.
        imex = imexchannels.read_imex_node_info(config.proc_root, config.proc_devices_path)
        registry: DeviceRegistry[dict[str, object]] = DeviceRegistry(
            channel_devices(imex.channel_count, daemon=not host_managed), lambda devices: devices)
        lookup = DomainLookup(connection.client, config.node_name, config.namespace, plugin_dir=config.plugin_dir)
        imex_ctl = _imex_ctl(config) if host_managed else None
        runner_holder: list[BatchRunner] = []

        def held_channels(exclude_uid: str) -> list[tuple[str, Any]]:
            return runner_holder[0].stored_records(CHANNEL_KIND, exclude_uid) if runner_holder else []

        channels = ChannelPreparer(lookup, identity, imex, current_clique, host_managed=host_managed,
                                   imex_ctl=imex_ctl, held_channels=held_channels if channel_isolation else None)
        daemons = DaemonPreparer(lookup, identity, imex, current_clique, config.plugin_dir)
        preparers: list[Any] = [channels] if host_managed else [channels, daemons]
        metrics = DriverMetrics(node=config.node_name, driver=identity.driver_name)
        plugin_ref: list[ComputeDomainPlugin] = []
        status_writer = DeviceStatusWriter(connection.client, driver=identity.driver_name, pool=config.node_name,
                                           describe=describe_channels)  # KEP-4817: each channel's ComputeDomain
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
        )
        runner_holder.append(runner)
        life.on_stop("batch runner", runner.close)
        adopted = await adopt_nvidia_claims(identity, config, connection, runner, clock, metrics,
                                            checkpoint.groups_of if checkpoint is not None else None)
        recovery = await assembly.recover(identity, config, connection, runner, problems)
        if checkpoint is not None:  # after recovery: it names what the claim state holds now
            await asyncio.to_thread(checkpoint.load, state.claims(), (*adopted.started, *recovery.aborted_expired))
        publisher = assembly.make_publisher(identity, config, connection)
        await assembly.serve_metrics_step(life, config, metrics)  # the chart's :8081 (request metrics)

        def refusal() -> str:
            return plugin_ref[0].refusal() if plugin_ref else "the plugin is starting"

        # Served before the driver's part is read: the kubelet's unprepares are answered from the claim state while
        # the driver is absent or the fabric registration is in progress; prepares are refused with the reason.
        servers = await assembly.serve(life, config, DriverGate(runner, refusal), publisher=publisher,
                                       ready=lambda: not refusal())

        def desired() -> list[dict[str, Any]]:
            plugin = plugin_ref[0]
            count = plugin.imex.channel_count if plugin.imex is not None else 0
            return plugin_resource_slices(config.node_name, identity.driver_name, daemon=not host_managed,
                                          channels=count if channel_isolation else 1, taints=plugin.fabric_taints())

        plugin = ComputeDomainPlugin(identity=identity, config=config, lifecycle=life, client=connection.client,
                                     node_uid=connection.node_uid, state=state, state_problems=problems,
                                     runner=runner, recovery=recovery, publisher=publisher, servers=servers,
                                     desired=desired, session=session, imex=imex, _clique_holder=holder)
        part = DriverPart(registry, (channels, daemons), fabric_wait)
        arrive, cancel_arrival = on_loop(asyncio.get_running_loop(), lambda: read_driver_part(plugin, connection, part))
        plugin.driver = DriverWatch(session, library=lambda: nvml_library(config), arrive=arrive,
                                    interrupt=cancel_arrival)
        plugin_ref.append(plugin)
        await assembly.run_publisher(life, publisher)
        if session.available:  # else the ResourceSlices the last run published stay until the driver is back
            await read_driver_part(plugin, connection, part)
        watch = plugin.driver
        await life.step("NVIDIA driver watch", watch.start, lambda _: asyncio.to_thread(watch.stop))
        plugin.refresh_task = await _run_refresh(life, plugin)
        plugin.reconciler = await assembly.run_stale_claim_cleanup(life, identity, config, connection, runner)
    except BaseException:
        await life.stop(1.0)
        raise
    log.info("kubelet plugin for %s on node %s serving at %s (clique %s, IMEX %s)", identity.driver_name,
             config.node_name, config.dra_socket, plugin.clique_id or "none", config.imex_mode)
    return plugin


def _imex_ctl(config: PluginConfig) -> Callable[[], tuple[bool, str]]:
    binary = imexchannels_binary(config)

    def ask() -> tuple[bool, str]:
        return imexchannels.imex_ctl_ready(binary, config.imex_host_socket_path)

    return ask


def imexchannels_binary(config: PluginConfig) -> Any:
    """``<container driver root>/usr/bin/nvidia-imex-ctl`` (where NVIDIA's chroot finds it)."""
    return config.container_driver_root / "usr" / "bin" / "nvidia-imex-ctl"


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
