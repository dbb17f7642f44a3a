"""Composition root of the kubelet plugin: builds every part from a :class:`PluginConfig` and runs them.

Start order (mirrors NVIDIA's gpu-kubelet-plugin, reference ``nvidia-dra-driver.md`` 1.1, and the Go
helper, ``kubelet-dra-protocol.md`` 4.1): plugin and CDI directories -> NVML session and device discovery ->
Kubernetes client and this Node -> device-plugin guard -> claim state (recovery) -> crash convergence ->
gRPC servers (DRA socket, then registration socket) -> ResourceSlice publisher. Stop reverses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from dradriver import DRIVER_NAME, _native
from dradriver.config import PluginConfig
from dradriver.domain import cdi, driverfiles, resourceslices
from dradriver.domain.claims import ClaimRef
from dradriver.domain.claimstate import ClaimState, ClaimStateCorruptError, ClaimStateProblem
from dradriver.domain.devices import NodeInventory
from dradriver.domain.health import DEFAULT_IGNORED_XIDS
from dradriver.driver import guard
from dradriver.driver.health import HealthService
from dradriver.driver.metrics import DriverMetrics, MetricsServer, serve_metrics
from dradriver.driver.plugin import Driver, RecoveryReport
from dradriver.errors import ConfigError
from dradriver.kube import claims as kube_claims
from dradriver.kube import client as kube_client
from dradriver.kube import errors as kube_errors
from dradriver.kube import events, nodes, version
from dradriver.kube.resourceslices import SlicePublisher
from dradriver.nvml import discovery
from dradriver.nvml.session import NvmlSession, open_session
from dradriver.server import Servers, start_servers

log = logging.getLogger(__name__)


@dataclass
class Plugin:
    """A running kubelet plugin. Create with :func:`start_plugin`; stop with :meth:`stop`."""

    config: PluginConfig
    session: NvmlSession
    inventory: NodeInventory
    client: kube_client.KubeClient
    state: ClaimState
    driver: Driver
    servers: Servers
    publisher: SlicePublisher
    guard_verdict: guard.GuardVerdict
    recovery: RecoveryReport
    state_problems: tuple[ClaimStateProblem, ...]
    health: HealthService
    metrics: DriverMetrics
    metrics_server: MetricsServer | None = None
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    _stopped: bool = False

    def desired_slices(self) -> list[dict[str, Any]]:
        """The ResourceSlices this node should have now (an empty pool when the guard refuses GPUs)."""
        inventory = self.inventory
        if self.guard_verdict.refuse:
            inventory = NodeInventory(versions=inventory.versions, gpus=())
        return resourceslices.build_resource_slices(inventory, self.config.node_name, taints=self.health.taints())

    def republish(self) -> None:
        """Hand the publisher the current desired state (coalesced, thread-safe)."""
        self.publisher.update(self.desired_slices())

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving and publishing, release NVML and the claim state (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        steps: list[tuple[str, Any]] = [
            ("publisher", self.publisher.stop),
            ("gRPC servers", lambda: self.servers.stop(grace=grace_s)),
            ("metrics server", self.metrics_server.stop if self.metrics_server is not None else None),
            ("health service", lambda: asyncio.to_thread(self.health.stop)),
            ("background tasks", self._cancel_tasks),
            ("claim state", self.state.close),
            ("NVML session", self.session.close),
            ("Kubernetes client", self.client.close),
        ]
        for what, step in steps:  # best effort: one failing step must not keep the others from running
            if step is None:
                continue
            try:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("stopping the %s failed", what)
        log.info("kubelet plugin stopped")

    async def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _ensure_dir(path: os.PathLike[str] | str, mode: int) -> None:
    os.makedirs(path, mode=mode, exist_ok=True)


def _node_info(config: PluginConfig) -> cdi.DeviceNodeInfo:
    return cdi.DeviceNodeInfo(
        dev_root=config.dev_root,
        host_root=str(config.nvidia_driver_root),
        proc_devices=config.proc_root / "devices",
        mig_minors=config.proc_root / "driver" / "nvidia-caps" / "mig-minors",
        capabilities_dir=config.proc_root / "driver" / "nvidia" / "capabilities",
    )


def _driver_edits(config: PluginConfig, driver_version: str) -> cdi.ContainerEdits:
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
    return cdi.driver_edits(files, host_root=str(config.nvidia_driver_root), hook_path=config.nvidia_cdi_hook_path)


def _report_event(client: kube_client.KubeClient, config: PluginConfig, node_uid: str, reason: str,
                  message: str) -> None:
    try:
        events.create_event(client, events.node_ref(config.node_name, node_uid), reason=reason, message=message,
                            host=config.node_name)
    except kube_errors.KubeAPIError as exc:
        log.warning("could not record Event %s: %s", reason, exc)


def _open_state(config: PluginConfig) -> tuple[ClaimState, tuple[ClaimStateProblem, ...]]:
    problems: list[ClaimStateProblem] = []

    def note(problem: ClaimStateProblem) -> None:
        problems.append(problem)
        (log.error if problem.damage else log.warning)("%s", problem)

    try:
        state = ClaimState.open(config.claim_state_path, lock_path=config.lock_path,
                                boot_id_path=config.boot_id_path, on_problem=note)
    except ClaimStateCorruptError as exc:  # recovered: readable claims kept, damaged file kept aside
        recovered = exc.state
        assert isinstance(recovered, ClaimState)
        state = recovered
    return state, tuple(problems)


def _report_task_end(task: asyncio.Task[Any]) -> None:
    """A background task must not end silently: log how it ended unless it was cancelled."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("background task %s ended: %s", task.get_name(), exc, exc_info=exc)


def _supports_informational_taints(client: kube_client.KubeClient) -> bool:
    """DeviceTaint effect ``None`` exists from Kubernetes 1.35; older servers get no informational taints."""
    try:
        return version.server_version(client) >= (1, 35)
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot read the API server version (%s); informational taints disabled", exc)
        return False


async def start_plugin(config: PluginConfig) -> Plugin:
    """Start every part of the kubelet plugin and return it running.

    :raises dradriver.errors.DradriverError: a part cannot start (no NVML library, no API access, socket in
        use by a live plugin, unreadable newer claim-state format); nothing is left running.
    """
    implementations = _native.load_all()  # a missing compiled module fails here, loudly, not at first use
    log.info("hot paths: %s", ", ".join(f"{k}={v}" for k, v in implementations.items()))
    _ensure_dir(config.plugin_dir, 0o750)
    _ensure_dir(config.cdi_root, 0o755)
    session = open_session(config.nvml_library, config.mock_profile)
    async_cleanup: list[Any] = []
    stack = contextlib.ExitStack()
    stack.callback(session.close)
    try:
        inventory = discovery.discover(session, sysfs_root=config.sysfs_root)
        for failure in inventory.failures:
            log.error("GPU %d left out: %s", failure.index, failure.reason)
        log.info("discovered %d GPU(s), %d MIG device(s), %d allocatable device(s)%s", len(inventory.gpus),
                 len(inventory.migs), len(inventory.allocatable()),
                 f", clique {inventory.clique.id}" if inventory.clique else "")
        common = await asyncio.to_thread(_driver_edits, config, inventory.versions.driver)
        client = kube_client.open_client(config.kubeconfig)
        stack.callback(client.close)
        node_obj: dict[str, Any] | None = None
        node_uid = ""
        try:
            node = await asyncio.to_thread(nodes.get_node, client, config.node_name)
            node_obj, node_uid = dict(node.raw), node.uid
        except kube_errors.KubeAPIError as exc:
            log.warning("cannot read Node %s (%s); the device-plugin guard checks sockets only", config.node_name, exc)
        verdict = guard.check_device_plugin(config, node_obj)
        if verdict.refuse:
            log.error("%s", verdict.reason)
            await asyncio.to_thread(_report_event, client, config, node_uid, "DevicePluginDetected", verdict.reason)
        elif verdict.reason:
            log.warning("%s", verdict.reason)
        state, problems = await asyncio.to_thread(_open_state, config)
        stack.callback(state.close)
        for problem in problems:
            if problem.damage:
                await asyncio.to_thread(_report_event, client, config, node_uid, "ClaimStateCorrupt", str(problem))

        def fetch(ref: ClaimRef) -> Any:
            return kube_claims.fetch_claim(client, ref, driver=DRIVER_NAME, pool=config.node_name)

        metrics = DriverMetrics(node=config.node_name)
        driver = Driver(inventory=inventory, state=state, fetch_claim=fetch, cdi_root=config.cdi_root,
                        node_info=_node_info(config), pool=config.node_name, metrics=metrics,
                        common=common)
        damaged = any(p.damage for p in problems)
        recovery = await asyncio.to_thread(lambda: driver.recover(state_damaged=damaged))

        def publish_error(exc: Exception) -> None:
            metrics.count_publish_error(type(exc).__name__)
            log.warning("ResourceSlice publish failed: %s", exc)

        publisher = SlicePublisher(client, driver=DRIVER_NAME, node_name=config.node_name, node_uid=node_uid,
                                   on_error=publish_error,
                                   on_publish=lambda result: metrics.observe_publish() if result.wrote else None)
        informational = await asyncio.to_thread(_supports_informational_taints, client)
        plugin_ref: list[Plugin] = []
        health = HealthService(
            inventory,
            pool_name=config.node_name,
            session=session,
            ignored_xids=DEFAULT_IGNORED_XIDS | set(config.additional_xids_to_ignore),
            informational_taints=informational,
            on_taints_changed=lambda _taints: plugin_ref[0].republish() if plugin_ref else None,
            on_nvml_error=metrics.count_nvml_error,
        )
        metrics.attach_devices(health, claim_of=lambda device: driver.prepared_devices().get(device))
        await asyncio.to_thread(health.start)
        stack.callback(health.stop)
        metrics_server = None
        if config.http_endpoint:  # bound before the kubelet can see us, so a taken port fails cleanly
            try:
                metrics_server = serve_metrics(metrics.registry, config.http_endpoint, config.metrics_path)
            except OSError as exc:
                raise ConfigError(f"cannot serve metrics on {config.http_endpoint!r}: {exc}") from exc
            stack.callback(metrics_server.stop)
        servers = await start_servers(config, driver, health_source=health)
        async_cleanup.append(lambda: servers.stop(grace=1.0))
        plugin = Plugin(config=config, session=session, inventory=inventory, client=client, state=state,
                        driver=driver, servers=servers, publisher=publisher, guard_verdict=verdict,
                        recovery=recovery, state_problems=problems, health=health, metrics=metrics,
                        metrics_server=metrics_server)
        plugin_ref.append(plugin)
        task = asyncio.create_task(publisher.run(), name="resourceslice-publisher")
        task.add_done_callback(_report_task_end)
        plugin._tasks.append(task)
        plugin.republish()
    except BaseException:
        for cleanup in reversed(async_cleanup):
            with contextlib.suppress(Exception):
                await cleanup()
        stack.close()
        raise
    stack.pop_all()
    log.info("kubelet plugin for %s on node %s serving at %s", DRIVER_NAME, config.node_name, config.dra_socket)
    return plugin


async def run_plugin(config: PluginConfig, stop: asyncio.Event) -> None:
    """Start the plugin, wait for ``stop``, then stop it."""
    plugin = await start_plugin(config)
    try:
        await stop.wait()
    finally:
        await plugin.stop()
