"""The ``gpu.nvidia.com`` kubelet plugin (``dradriver gpu-kubelet-plugin``): its composition, nothing else.

Steps, in order (stopped in reverse): compiled hot paths -> plugin and CDI directories -> NVML session ->
device discovery into the device registry -> the driver's user space for CDI specs -> Kubernetes client and
this Node -> device-plugin guard -> claim state -> batch runner with the full-GPU and static-MIG preparers
and the sharing steps (MPS control daemons with the ``MPSSupport`` gate), and crash convergence -> health
monitor -> metrics endpoint -> gRPC servers -> ResourceSlice publisher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from dradriver import _native
from dradriver.app import assembly
from dradriver.config import PluginConfig
from dradriver.domain import cdi, configs, mps, resourceslices
from dradriver.domain.devices import DeviceIndex, NodeInventory
from dradriver.domain.faults import DEFAULT_IGNORED_XIDS
from dradriver.domain.identity import GPU_DRIVER, DriverIdentity
from dradriver.domain.ports import SharingStep
from dradriver.domain.registry import DeviceRegistry
from dradriver.errors import FlagError
from dradriver.health.metrics import DriverMetrics, MetricsServer, serve_metrics
from dradriver.health.monitor import HealthMonitor
from dradriver.host import driverfiles
from dradriver.host.devicenodes import DeviceNodeInfo
from dradriver.host.nvidiasmi import find_nvidia_smi
from dradriver.kube import errors as kube_errors
from dradriver.kube import version
from dradriver.kube.client import KubeClient
from dradriver.kubeletplugin import guard
from dradriver.kubeletplugin.lifecycle import Lifecycle
from dradriver.kubeletplugin.runner import BatchRunner
from dradriver.nvml import discovery, settings
from dradriver.nvml.session import NvmlSession, open_session
from dradriver.preparers import gpu as gpu_preparers
from dradriver.preparers.gpu import FullGpuPreparer, StaticMigPreparer
from dradriver.preparers.mps import ControlDaemons, MpsSharing
from dradriver.preparers.sharing import default_steps

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
    mps_daemons: ControlDaemons | None = None
    """The MPS control daemons of the ``MPS`` sharing step (``None`` without the MPSSupport gate)."""

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
                                    hook_path=config.nvidia_cdi_hook_path)


def control_daemons(config: PluginConfig, client: KubeClient, session: NvmlSession) -> ControlDaemons:
    """The node's MPS control daemons: Deployments in ``--namespace`` running ``--image-name``, directories under
    ``<plugin dir>/mps``, compute mode through NVML (``dradriver.nvml.settings``), shm sized from
    ``<proc root>/meminfo``."""
    placement = mps.DaemonPlacement(
        namespace=config.namespace, node_name=config.node_name, image=config.image_name,
        driver_root=str(config.nvidia_driver_root), directory="",
        shm_in_driver_root=(config.container_driver_root / "dev" / "shm").is_dir(),
        feature_gates=config.feature_gates.render(), service_account=config.service_account_name,
        pull_secrets=config.image_pull_secrets, pull_policy=config.image_pull_policy)

    def set_compute_mode(uuid: str, mode: str) -> None:
        settings.set_compute_mode(session, uuid, settings.ComputeMode[mode])

    return ControlDaemons(root=config.mps_root, client=client, placement=placement,
                          set_compute_mode=set_compute_mode, meminfo=config.proc_root / "meminfo",
                          mounts=config.mounts)


def supports_informational_taints(client: KubeClient) -> bool:
    """DeviceTaint effect ``None`` exists from Kubernetes 1.35; older servers get no informational taints."""
    try:
        return version.server_version(client) >= (1, 35)
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot read the API server version (%s); informational taints disabled", exc)
        return False


def discover(session: NvmlSession, config: PluginConfig) -> NodeInventory:
    """This node's GPUs, MIG devices and clique, logged."""
    inventory = discovery.discover(session, sysfs_root=config.sysfs_root)
    for failure in inventory.failures:
        log.error("GPU %d left out: %s", failure.index, failure.reason)
    log.info("discovered %d GPU(s), %d MIG device(s), %d allocatable device(s)%s", len(inventory.gpus),
             len(inventory.migs), len(inventory.allocatable()),
             f", clique {inventory.clique.id}" if inventory.clique else "")
    return inventory


async def start_plugin(config: PluginConfig, identity: DriverIdentity = GPU_DRIVER) -> GpuPlugin:
    """Start every part of the GPU kubelet plugin and return it running.

    :param identity: the plugin's names; tests run a second identity beside the default one.
    :raises dradriver.errors.DradriverError: a part cannot start (no NVML library, no API access, socket in
        use by a live plugin, unreadable newer claim-state format); nothing is left running.
    """
    if config.driver_name != identity.driver_name:  # sockets, plugin directory and lock follow the identity
        config = dataclasses.replace(config, driver_name=identity.driver_name)
    implementations = _native.load_all()  # a missing compiled module fails here, loudly, not at first use
    log.info("hot paths: %s", ", ".join(f"{k}={v}" for k, v in implementations.items()))
    life = Lifecycle(identity.driver_name)
    assembly.ensure_dir(config.plugin_dir, 0o750)
    assembly.ensure_dir(config.cdi_root, 0o755)
    session = await life.step("NVML session", lambda: open_session(nvml_library(config), config.mock_profile),
                              lambda s: s.close())
    try:
        registry: DeviceRegistry[NodeInventory] = DeviceRegistry(discover(session, config),
                                                                 lambda inv: DeviceIndex.build(inv).by_name)
        common = await asyncio.to_thread(driver_edits, config, registry.snapshot.versions.driver)
        connection = await assembly.connect(life, identity, config)
        verdict = guard.check_device_plugin(config, connection.node)
        if verdict.refuse:
            log.error("%s", verdict.reason)
            await asyncio.to_thread(assembly.report_event, identity, connection.client, config, connection.node_uid,
                                    "DevicePluginDetected", verdict.reason)
        elif verdict.reason:
            log.warning("%s", verdict.reason)
        state, problems = await assembly.open_claim_state(life, identity, config, connection)

        metrics = DriverMetrics(node=config.node_name, driver=identity.driver_name)
        nodes = node_info(config)
        steps: list[SharingStep] = list(default_steps(session,
                                                      lambda: find_nvidia_smi(config.container_driver_root)))
        daemons = None
        if config.feature_gates.mps_support:
            daemons = control_daemons(config, connection.client, session)
            steps.append(MpsSharing(daemons))
        runner = BatchRunner(
            identity=identity, registry=registry, state=state,
            fetch_claim=assembly.claim_fetcher(identity, connection.client, config),
            cdi_root=config.cdi_root, pool=config.node_name,
            preparers=(FullGpuPreparer(nodes), StaticMigPreparer(nodes)), sharing=steps,
            select_configs=lambda claim, devices: configs.select_configs(claim, devices, config.feature_gates),
            spec_edits=lambda: gpu_preparers.spec_edits(nodes, common),
            metrics=metrics, prepare_deadline_s=float(config.prepare_deadline_seconds),
        )
        life.on_stop("batch runner", runner.close)
        recovery = await assembly.recover(identity, config, connection, runner, problems)
        publisher = assembly.make_publisher(
            identity, config, connection, on_error=lambda exc: metrics.count_publish_error(type(exc).__name__),
            on_publish=lambda result: metrics.observe_publish() if result.wrote else None)
        informational = await asyncio.to_thread(supports_informational_taints, connection.client)
        plugin_ref: list[GpuPlugin] = []
        health = HealthMonitor(
            registry.snapshot,
            pool_name=config.node_name,
            session=session,
            taint_domain=identity.taint_domain,
            ignored_xids=DEFAULT_IGNORED_XIDS | set(config.additional_xids_to_ignore),
            informational_taints=informational,
            on_taints_changed=lambda _taints: plugin_ref[0].republish() if plugin_ref else None,
            on_nvml_error=metrics.count_nvml_error,
        )
        registry.subscribe(health.replace_inventory)
        metrics.attach_devices(health, claim_of=lambda device: runner.prepared_devices().get(device),
                               dcgm_compatible=config.dcgm_compatible)
        await life.step("health monitor", lambda: asyncio.to_thread(health.start),
                        lambda _: asyncio.to_thread(health.stop))
        metrics_server = None
        if config.http_endpoint and not config.metrics_path:  # NVIDIA: "disabled if empty"
            log.info("metrics server off: --metrics-path (env METRICS_PATH) is empty")
        elif config.http_endpoint:  # bound before the kubelet can see us, so a taken port fails cleanly
            def bind() -> MetricsServer:
                try:
                    return serve_metrics(metrics.registry, config.http_endpoint, config.metrics_path,
                                         dcgm_compatible=config.dcgm_compatible)
                except OSError as exc:
                    raise FlagError(f"cannot serve metrics on {config.http_endpoint!r}: {exc}") from exc
            metrics_server = await life.step("metrics server", bind, lambda server: server.stop())
        servers = await assembly.serve(life, config, runner, health_source=health, publisher=publisher)

        def desired() -> list[dict[str, Any]]:
            inventory = registry.snapshot
            if verdict.refuse:  # an empty pool: the device plugin owns the GPUs
                inventory = NodeInventory(versions=inventory.versions, gpus=())
            return resourceslices.build_resource_slices(inventory, config.node_name, driver=identity.driver_name,
                                                        taints=health.taints())

        plugin = GpuPlugin(identity=identity, config=config, lifecycle=life, client=connection.client,
                           node_uid=connection.node_uid, state=state, state_problems=problems, runner=runner,
                           recovery=recovery, publisher=publisher, servers=servers, desired=desired,
                           session=session, registry=registry, guard_verdict=verdict, health=health,
                           metrics=metrics, metrics_server=metrics_server, mps_daemons=daemons)
        plugin_ref.append(plugin)
        registry.subscribe(lambda _inventory: plugin.republish())
        await assembly.run_publisher(life, publisher)
        plugin.republish()
        plugin.reconciler = await assembly.run_stale_claim_cleanup(life, identity, config, connection, runner,
                                                                   count=metrics.count_stale_claim)
    except BaseException:
        await life.stop(1.0)
        raise
    log.info("kubelet plugin for %s on node %s serving at %s", identity.driver_name, config.node_name,
             config.dra_socket)
    return plugin


async def run_plugin(config: PluginConfig, stop: asyncio.Event) -> None:
    """Start the plugin, wait for ``stop``, then stop it."""
    plugin = await start_plugin(config)
    try:
        await stop.wait()
    finally:
        await plugin.stop()
