"""The ``compute-domain.nvidia.com`` kubelet plugin (``dradriver compute-domain-kubelet-plugin``): its composition.

Steps, in order (stopped in reverse): compiled hot paths -> plugin and CDI directories -> NVML session -> the
node's clique ID from fabric info (strict rules with the gate ``CrashOnNVLinkFabricErrors``: a registration still
in progress stops the start-up) -> IMEX facts (channel major and count, ``fabric-imex-mgmt`` minor) -> the base CDI
spec ``k8s.compute-domain.nvidia.com-device_base.json`` (device ``all``) -> Kubernetes client and this Node ->
``nvidia.com/gpu.clique`` node label (``--gpu-clique-label-enabled``) -> claim state -> batch runner with the IMEX
channel and daemon preparers, and crash convergence -> gRPC servers -> ResourceSlice publisher (pool = node name:
``channel-0`` and, driver-managed, ``daemon-0``; with ``--imex-isolation channel`` every channel of the node, in
slices of at most 128 devices) -> the 10-minute loop (clique re-read and label
refresh, domain directories of vanished ComputeDomains removed) -> stale-claim cleanup.

Facts: ``nvidia-dra-driver.md`` 1.2, 2.7, 4.8, 4.9, 5.2, 7.2; ``nvidia-dra-driver-updates.md`` 2c.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dradriver import _native
from dradriver.app import assembly
from dradriver.app.gpu import driver_edits, node_info, nvml_library
from dradriver.config import CHANNEL_NEEDS_HOST_MANAGED, PluginConfig
from dradriver.domain import cdi
from dradriver.domain.computedomains import NODE_CLIQUE_LABEL, plugin_resource_slices
from dradriver.domain.featuregates import CRASH_ON_NVLINK_FABRIC_ERRORS, HOST_MANAGED_IMEX_DAEMON
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, DriverIdentity
from dradriver.domain.registry import DeviceRegistry
from dradriver.errors import DradriverError, FlagError
from dradriver.health.metrics import DriverMetrics
from dradriver.host import cdifiles, devicenodes, imexchannels, imexservice
from dradriver.host.imexchannels import ImexNodeInfo
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kubeletplugin.lifecycle import Lifecycle
from dradriver.kubeletplugin.runner import BatchRunner
from dradriver.nvml import fabric
from dradriver.nvml.session import NvmlSession, open_session
from dradriver.preparers.computedomain import (
    CHANNEL_KIND,
    ChannelPreparer,
    DaemonPreparer,
    DomainLookup,
    channel_devices,
)

log = logging.getLogger(__name__)

BASE_SPEC_NAME = "k8s.compute-domain.nvidia.com-device_base.json"
"""The base spec's file (NVIDIA writes ``..._base.yaml``; dradriver's specs are JSON, ``cdi.md`` 2.5)."""
REFRESH_PERIOD_S = 600.0
"""Clique re-read and domain-directory cleanup period (NVIDIA: 10 minutes)."""
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
    """This node's clique ID (``""``: in no clique), re-read every 10 minutes."""
    refresh_task: asyncio.Task[Any] | None = None
    _clique_holder: list[str] = field(default_factory=lambda: [""])

    def refresh(self) -> None:
        """Re-read the clique ID (a failure is logged; the last value stays), refresh the clique label, and remove
        the domain directories of ComputeDomains that are gone. Blocking."""
        assert self.session is not None
        try:
            now = fabric.clique_id(fabric.read_node_fabric(self.session),
                                   strict=self.config.feature_gates[CRASH_ON_NVLINK_FABRIC_ERRORS])
        except DradriverError as exc:
            log.error("cannot re-read this node's NVLink clique: %s", exc)
            now = self.clique_id
        if now != self.clique_id:
            log.warning("this node's NVLink clique changed from %r to %r", self.clique_id, now)
            self.clique_id = now
            self._clique_holder[0] = now
        if self.config.gpu_clique_label_enabled:
            set_clique_label(self.client, self.config.node_name, now)
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


async def start_compute_domain_plugin(config: PluginConfig, identity: DriverIdentity = COMPUTE_DOMAIN_DRIVER, *,
                                      clock: Callable[[], float] = time.time) -> ComputeDomainPlugin:
    """Start every part of the compute-domain kubelet plugin and return it running.

    :param clock: wall-clock seconds (Unix time) of the aborted-prepare marks and their 90 s TTL, which survive a
        restart in the claim state (tests pass their own).

    :raises dradriver.errors.DradriverError: a part cannot start: no NVML, a fabric registration not completed or a
        fabric error (strict mode), GPUs disagreeing on the clique, no API access, a socket in use, a driver too old
        for DNS-named IMEX daemons, ``--imex-mode hostManaged`` without the gate; nothing is left running.
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
    assembly.ensure_dir(config.plugin_dir, 0o750)
    assembly.ensure_dir(config.cdi_root, 0o755)
    session = await life.step("NVML session", lambda: open_session(nvml_library(config), config.mock_profile),
                              lambda s: s.close())
    try:
        strict = config.feature_gates[CRASH_ON_NVLINK_FABRIC_ERRORS]
        gpus = await asyncio.to_thread(fabric.read_node_fabric, session)
        clique = fabric.clique_id(gpus, strict=strict)
        log.info("NVLink clique of node %s: %s (%d GPU(s), %s mode)", config.node_name, clique or "none (not MNNVL)",
                 len(gpus), "strict" if strict else "legacy")
        version = session.driver_version()
        check_driver_version(version, config)
        imex = imexchannels.read_imex_node_info(config.proc_root, config.proc_devices_path)
        common = await asyncio.to_thread(driver_edits, config, version)
        spec = await asyncio.to_thread(base_spec, config, identity, session, imex, common)
        # Kept when the plugin stops: containers of prepared daemon claims may start while it is being upgraded.
        cdifiles.write_file_atomically(config.cdi_root / BASE_SPEC_NAME, spec)
        connection = await assembly.connect(life, identity, config)
        if config.gpu_clique_label_enabled:
            await asyncio.to_thread(set_clique_label, connection.client, config.node_name, clique)
            life.on_stop("nvidia.com/gpu.clique label",
                         lambda: set_clique_label(connection.client, config.node_name, ""))
        state, problems = await assembly.open_claim_state(life, identity, config, connection)
        holder = [clique]

        def current_clique() -> str:
            return holder[0]

        registry: DeviceRegistry[dict[str, object]] = DeviceRegistry(
            channel_devices(imex.channel_count, daemon=not host_managed), lambda devices: devices)
        lookup = DomainLookup(connection.client, config.node_name, config.namespace, plugin_dir=config.plugin_dir)
        imex_ctl = _imex_ctl(config) if host_managed else None
        runner_holder: list[BatchRunner] = []

        def held_channels(exclude_uid: str) -> list[tuple[str, Any]]:
            return runner_holder[0].stored_records(CHANNEL_KIND, exclude_uid) if runner_holder else []

        preparers: list[Any] = [ChannelPreparer(lookup, identity, imex, current_clique, host_managed=host_managed,
                                                imex_ctl=imex_ctl,
                                                held_channels=held_channels if channel_isolation else None)]
        if not host_managed:
            preparers.append(DaemonPreparer(lookup, identity, imex, current_clique, config.plugin_dir))
        metrics = DriverMetrics(node=config.node_name, driver=identity.driver_name)
        runner = BatchRunner(
            identity=identity, registry=registry, state=state,
            fetch_claim=assembly.claim_fetcher(identity, connection.client, config),
            cdi_root=config.cdi_root, pool=config.node_name, preparers=preparers,
            prepare_deadline_s=float(config.prepare_deadline_seconds), aborted_ttl_s=ABORTED_TTL_S, clock=clock,
            metrics=metrics,
        )
        runner_holder.append(runner)
        life.on_stop("batch runner", runner.close)
        recovery = await assembly.recover(identity, config, connection, runner, problems)
        publisher = assembly.make_publisher(identity, config, connection)
        await assembly.serve_metrics_step(life, config, metrics)  # the chart's :8081 (request metrics)
        servers = await assembly.serve(life, config, runner, publisher=publisher)
        slices = plugin_resource_slices(config.node_name, identity.driver_name, daemon=not host_managed,
                                        channels=imex.channel_count if channel_isolation else 1)
        plugin = ComputeDomainPlugin(identity=identity, config=config, lifecycle=life, client=connection.client,
                                     node_uid=connection.node_uid, state=state, state_problems=problems,
                                     runner=runner, recovery=recovery, publisher=publisher, servers=servers,
                                     desired=lambda: list(slices), session=session, imex=imex, clique_id=clique,
                                     _clique_holder=holder)
        await assembly.run_publisher(life, publisher)
        plugin.republish()
        plugin.refresh_task = await _run_refresh(life, plugin)
        plugin.reconciler = await assembly.run_stale_claim_cleanup(life, identity, config, connection, runner)
    except BaseException:
        await life.stop(1.0)
        raise
    log.info("kubelet plugin for %s on node %s serving at %s (clique %s, IMEX %s)", identity.driver_name,
             config.node_name, config.dra_socket, clique or "none", config.imex_mode)
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
        while True:
            await asyncio.sleep(REFRESH_PERIOD_S)
            await asyncio.to_thread(plugin.refresh)

    def start() -> asyncio.Task[Any]:
        task = asyncio.create_task(loop(), name="compute-domain-refresh")
        task.add_done_callback(assembly.report_task_end)
        return task

    return await life.step("clique refresh", start, lambda task: assembly.cancel_tasks([task]))


async def run_compute_domain_plugin(config: PluginConfig, stop: asyncio.Event) -> None:
    """Start the plugin, wait for ``stop``, then stop it."""
    plugin = await start_compute_domain_plugin(config)
    try:
        await stop.wait()
    finally:
        await plugin.stop()
