"""The parts every kubelet plugin is assembled from, as lifecycle steps (shared by the GPU and compute-domain
binaries).

Start order (NVIDIA's kubelet plugins, ``cmd/gpu-kubelet-plugin/main.go``, and the Go helper,
``kubeletplugin/draplugin.go``): plugin and CDI directories -> the device kind's own parts (NVML, discovery)
-> Kubernetes client and this Node -> claim state (recovery) -> crash convergence -> gRPC servers (DRA socket,
then registration socket) -> ResourceSlice publisher. :class:`~dradriver.kubeletplugin.lifecycle.Lifecycle`
stops them in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.config import PluginConfig
from dradriver.domain import devicemetadata
from dradriver.domain.claims import Claim, ClaimRef
from dradriver.domain.identity import DriverIdentity
from dradriver.domain.ports import ClaimPreparer
from dradriver.errors import FlagError
from dradriver.health.metrics import DriverMetrics, MetricsServer, serve_metrics
from dradriver.host import nvcheckpointfile
from dradriver.host.cdihook import CdiHook, visible_path
from dradriver.host.claimstate import ClaimState, ClaimStateCorruptError, ClaimStateProblem, ProblemKind, read_boot_id
from dradriver.host.devicemetadata import DeviceMetadataFiles
from dradriver.host.pluginlocks import PluginLocks
from dradriver.kube import claims as kube_claims
from dradriver.kube import client as kube_client
from dradriver.kube import errors as kube_errors
from dradriver.kube import events, nodes, ratelimit
from dradriver.kube.resourceslices import PublishResult, SlicePublisher
from dradriver.kubeletplugin import adoption as adoption_module
from dradriver.kubeletplugin.adoption import AdoptionReport, GpuAdoption
from dradriver.kubeletplugin.devicestatus import DeviceStatusWriter
from dradriver.kubeletplugin.lifecycle import Lifecycle
from dradriver.kubeletplugin.payload import encode_payload
from dradriver.kubeletplugin.reconcile import Cleanup, StaleClaimReconciler
from dradriver.kubeletplugin.runner import FETCH_WORKERS, BatchRunner, RecoveryReport
from dradriver.nvml.session import NvmlSession, open_session_or_absent
from dradriver.server import Servers, start_servers
from dradriver.server.deferred import EarlyServers
from dradriver.server.healthstream import HealthSource
from dradriver.server.sockets import DRA_WORKERS

log = logging.getLogger(__name__)


@dataclass
class KubeletPlugin:
    """What every running kubelet plugin has; the device kind's composition adds its own parts.

    Stop with :meth:`stop` (the lifecycle, newest step first).
    """

    identity: DriverIdentity
    config: PluginConfig
    lifecycle: Lifecycle
    client: kube_client.KubeClient
    node_uid: str
    state: ClaimState
    state_problems: tuple[ClaimStateProblem, ...]
    runner: BatchRunner
    recovery: RecoveryReport
    publisher: SlicePublisher
    servers: Servers
    desired: Callable[[], list[dict[str, Any]]] = field(default=lambda: [])
    reconciler: StaleClaimReconciler | None = None
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    def desired_slices(self) -> list[dict[str, Any]]:
        """The ResourceSlices this node should have now."""
        return self.desired()

    def republish(self) -> None:
        """Hand the publisher the current desired state (coalesced, thread-safe)."""
        self.publisher.update(self.desired_slices())

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving and publishing, release every part (idempotent)."""
        if self.lifecycle.stopped:
            return
        await self.lifecycle.stop(grace_s)
        log.info("kubelet plugin for %s stopped", self.identity.driver_name)


def ensure_dir(path: os.PathLike[str] | str, mode: int) -> None:
    """``mkdir -p`` with ``mode`` for the directories created."""
    os.makedirs(path, mode=mode, exist_ok=True)


def report_event(identity: DriverIdentity, client: kube_client.KubeClient, config: PluginConfig, node_uid: str,
                 reason: str, message: str, *, type_: str = "Warning") -> None:
    """An Event about this Node, ``Warning`` unless ``type_`` is ``Normal`` (best effort: a failure is logged)."""
    try:
        events.create_event(client, events.node_ref(config.node_name, node_uid), reason=reason, message=message,
                            type_=type_, component=identity.component, host=config.node_name)
    except kube_errors.KubeAPIError as exc:
        log.warning("could not record Event %s: %s", reason, exc)


def open_state(config: PluginConfig, identity: DriverIdentity) -> tuple[ClaimState, tuple[ClaimStateProblem, ...]]:
    """Open the claim state; damage is recovered (readable claims kept, damaged file kept aside) and reported."""
    problems: list[ClaimStateProblem] = []

    def note(problem: ClaimStateProblem) -> None:
        problems.append(problem)
        (log.error if problem.damage else log.warning)("%s", problem)

    try:
        state = ClaimState.open(config.plugin_dir / identity.state_file, lock_path=config.lock_path,
                                boot_id_path=config.boot_id_path, on_problem=note)
    except ClaimStateCorruptError as exc:
        recovered = exc.state
        assert isinstance(recovered, ClaimState)
        state = recovered
    return state, tuple(problems)


def report_task_end(task: asyncio.Task[Any]) -> None:
    """A background task must not end silently: log how it ended unless it was cancelled."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("background task %s ended: %s", task.get_name(), exc, exc_info=exc)


async def cancel_tasks(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait for them to end."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


@dataclass
class Connection:
    """The API client and this Node, as the start steps found them."""

    client: kube_client.KubeClient
    node: dict[str, Any] | None
    node_uid: str


KUBE_CONNECTIONS = DRA_WORKERS + FETCH_WORKERS + 8
"""Connections a kubelet plugin's API client keeps open (:func:`~dradriver.kube.client.open_client` ``pool_size``):
every DRA server thread (a one-claim prepare GETs from it) and every claim-fetch thread may send a request at once,
plus the ResourceSlice watch and publisher, events and the stale-claim sweep. The library's default (5 per CPU) is
10 on a 2-CPU node, where a burst of pod starts would open connections and throw them away after one request."""


async def connect(lifecycle: Lifecycle, identity: DriverIdentity, config: PluginConfig) -> Connection:
    """Start step: the Kubernetes client (closed on stop) and this Node (``None`` when it cannot be read)."""
    limiter = ratelimit.rate_limiter(config.kube_api_qps, config.kube_api_burst)
    client = await lifecycle.step("Kubernetes client",
                                  lambda: kube_client.open_client(config.kubeconfig, user_agent=identity.user_agent,
                                                                  rate_limit=limiter, pool_size=KUBE_CONNECTIONS),
                                  lambda c: c.close())
    await asyncio.to_thread(kube_client.check_reachable, client, config.kubeconfig)
    node_obj: dict[str, Any] | None = None
    node_uid = ""
    try:
        node = await asyncio.to_thread(nodes.get_node, client, config.node_name)
        node_obj, node_uid = dict(node.raw), node.uid
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot read Node %s (%s)", config.node_name, exc)
    return Connection(client, node_obj, node_uid)


async def open_host(lifecycle: Lifecycle, identity: DriverIdentity, config: PluginConfig,
                    nvml_library: str) -> tuple[Connection, NvmlSession]:
    """Start steps every kubelet plugin begins with. Validate, then touch the host: the kubeconfig is loaded and the
    API server reached (:func:`connect`) before the plugin and CDI directories are created (a bad kubeconfig leaves
    nothing behind); then the NVML session from ``nvml_library`` (closed on stop), which is not initialised when
    the NVIDIA driver is absent (:func:`dradriver.nvml.session.open_session_or_absent`).

    :raises dradriver.errors.DradriverError: no API access, or an ``nvmlInit`` failure other than the driver's
        absence.
    """
    connection = await connect(lifecycle, identity, config)
    ensure_dir(config.plugin_dir, 0o750)
    ensure_dir(config.cdi_root, 0o755)
    session = await lifecycle.step("NVML session",
                                   lambda: open_session_or_absent(nvml_library, config.mock_profile),
                                   lambda s: s.close())
    return connection, session


async def open_claim_state(lifecycle: Lifecycle, identity: DriverIdentity, config: PluginConfig,
                           connection: Connection) -> tuple[ClaimState, tuple[ClaimStateProblem, ...]]:
    """Start step: the claim state (closed on stop); damage becomes a ``ClaimStateCorrupt`` Warning Event."""
    state, problems = await lifecycle.step("claim state", lambda: asyncio.to_thread(open_state, config, identity),
                                           lambda opened: opened[0].close())
    for problem in problems:
        if problem.damage:
            await asyncio.to_thread(report_event, identity, connection.client, config, connection.node_uid,
                                    "ClaimStateCorrupt", str(problem))
    return state, problems


async def adopt_nvidia(identity: DriverIdentity, config: PluginConfig, connection: Connection, runner: BatchRunner,
                       adoption: GpuAdoption, metrics: DriverMetrics | None,
                       own_groups: adoption_module.OwnGroups | None = None) -> AdoptionReport:
    """Start step before :func:`recover`: adopt the claims NVIDIA's plugin prepared
    (:func:`dradriver.kubeletplugin.adoption.adopt_nvidia_claims`; ``own_groups``: the rollback checkpoint's, for
    the switching-back-and-forth rule), reported by :func:`report_adoption`."""
    path = config.plugin_dir / nvcheckpointfile.CHECKPOINT_FILE
    report = await asyncio.to_thread(
        while_prepares_wait, config, adoption_module.adopt_nvidia_claims, runner.state, path,
        boot_id=read_boot_id(config.boot_id_path), adoption=adoption, encode_payload=encode_payload,
        spec_of=runner.spec_path, own_groups=own_groups)
    await report_adoption(identity, config, connection, runner, path, report, metrics)
    await asyncio.to_thread(retire_adopted_checkpoint, config, path, report)
    return report


def while_prepares_wait(config: PluginConfig, adopt: Callable[..., AdoptionReport], *args: Any,
                        **kwargs: Any) -> AdoptionReport:
    """Blocking (call it in a thread): ``adopt(*args, **kwargs)`` with ``<plugin dir>/pu.lock`` held
    (:mod:`dradriver.host.pluginlocks`), so a prepare or unprepare NVIDIA's plugin still has in flight on the node (a
    switch: its pod terminating while this one starts) finishes, and writes its checkpoint, before the checkpoint is
    read; and none begins while its claims are adopted.

    :raises PluginLockTimeout: ``pu.lock`` still held after its bound (the start step fails, naming the lock and its
        holder; the plugin is restarted and tries again).
    """
    with PluginLocks(config.plugin_dir).prepare():
        return adopt(*args, **kwargs)


def retire_adopted_checkpoint(config: PluginConfig, path: Path, report: AdoptionReport) -> None:
    """With ``--nvidia-checkpoint=false`` dradriver writes no checkpoint, so NVIDIA's file, left as it is, would
    name the claims adopted from it at every later start, also once dradriver has unprepared them (they would be
    adopted again, their specs rewritten, their devices held by nobody's claim). Once claims were adopted from it
    (``report.adopted`` or ``report.started``), the file is kept aside as ``checkpoint.json.adopted-<UTC>`` for a
    person to read. With the checkpoint kept (the default) dradriver's own rewrite already names what is true.
    A failure to rename is logged (the next start adopts nothing it holds: those claims are in the claim state)."""
    if config.nvidia_checkpoint or not (report.adopted or report.started):
        return
    try:
        with PluginLocks(config.plugin_dir).checkpoint():
            aside = nvcheckpointfile.keep_aside(path, "adopted")
    except OSError as exc:  # PluginLockTimeout included
        log.warning("cannot keep NVIDIA's checkpoint %s aside after adopting its claims: %s", path, exc)
        return
    log.info("NVIDIA's checkpoint %s: its claims are adopted and --nvidia-checkpoint=false keeps none, so it is kept "
             "aside as %s", path, aside)


async def report_adoption(identity: DriverIdentity, config: PluginConfig, connection: Connection,
                          runner: BatchRunner, path: Path, report: AdoptionReport,
                          metrics: DriverMetrics | None) -> None:
    """What either kubelet plugin's adoption of NVIDIA's checkpoint ``path`` did, told the operator: a Normal
    ``ClaimAdopted`` Event per adopted claim and the ``dradriver_adopted_claims_total`` metric; a Warning
    ``ClaimNotAdopted`` Event per claim that could not be adopted (a device another claim holds: the plugin starts
    and serves anyway); a damaged or unknown-version checkpoint is a ``NvidiaCheckpointUnusable`` Warning Event
    (its claims are then kept from their CDI specs by recovery). Events go to the Node object."""
    async def event(reason: str, message: str, type_: str = "Warning") -> None:
        await asyncio.to_thread(report_event, identity, connection.client, config, connection.node_uid, reason,
                                message, type_=type_)

    if report.problem:
        await event("NvidiaCheckpointUnusable", f"NVIDIA's checkpoint {path} is not used: {report.problem}; its "
                                                "claims are kept from their CDI specs")
    for uid in report.adopted:
        record = runner.state.get(uid)
        who = adoption_module.describe_claim(uid, None, record.namespace, record.name) if record else uid
        await event("ClaimAdopted", f"claim {who} prepared by NVIDIA's plugin is held and will be unprepared by "
                                    "dradriver (from NVIDIA's checkpoint)", "Normal")
    for uid, why in report.refused:
        await event("ClaimNotAdopted", f"claim {uid} in NVIDIA's checkpoint {path} is not adopted: {why}; its entry "
                                       "is kept for NVIDIA's plugin and its CDI spec is left to recovery")
    if metrics is not None:
        metrics.count_adopted_claims(adoption_module.SOURCE, len(report.adopted))


async def recover(identity: DriverIdentity, config: PluginConfig, connection: Connection, runner: BatchRunner,
                  problems: Sequence[ClaimStateProblem], status_writer: DeviceStatusWriter) -> RecoveryReport:
    """Start-up convergence (:meth:`BatchRunner.recover`) with what opening the claim state found; when the CDI
    specs show damage the claim state did not report, a ``ClaimStateCorrupt`` Warning Event says why. Then the
    device status of every claim still prepared is queued for a check (:meth:`DeviceStatusWriter.requeue`: a write
    the last run had pending died with it)."""
    damaged = any(p.damage for p in problems)
    torn = any(p.kind is ProblemKind.TORN_TAIL for p in problems)
    rebooted = any(p.kind is ProblemKind.BOOT_ID_CHANGED for p in problems)
    report = await asyncio.to_thread(lambda: runner.recover(state_damaged=damaged, torn_tail=torn,
                                                            rebooted=rebooted))
    await asyncio.to_thread(lambda: status_writer.requeue(runner.prepared_claims()))
    if report.damage:
        await asyncio.to_thread(report_event, identity, connection.client, config, connection.node_uid,
                                "ClaimStateCorrupt", f"claim state {runner.state.path}: {report.damage}; "
                                f"{len(report.adopted)} claim(s) adopted from their CDI specs")
    return report


def device_metadata_files(identity: DriverIdentity, config: PluginConfig,
                          plugins: Sequence[KubeletPlugin]) -> DeviceMetadataFiles | None:
    """The KEP-5304 device metadata writer with the ``DeviceMetadata`` feature gate on, else ``None``.

    The attributes come from the ResourceSlices the plugin publishes now (``plugins``: the plugin once it exists; a
    claim prepared before, during start-up, gets only the attributes its device adds at run time).
    """
    if not config.feature_gates.device_metadata:
        return None

    def published() -> dict[str, devicemetadata.Attributes]:
        return devicemetadata.published_attributes(plugins[0].desired_slices()) if plugins else {}

    return DeviceMetadataFiles(config.plugin_dir, identity.driver_name, config.node_name, published)


def claim_fetcher(identity: DriverIdentity, client: kube_client.KubeClient,
                  config: PluginConfig) -> Callable[[ClaimRef, float], Claim]:
    """The blocking claim GET + reduction for this plugin's driver and this node's pool, within a time limit
    (:data:`dradriver.kubeletplugin.runner.FetchClaim`)."""

    def fetch(ref: ClaimRef, timeout_s: float) -> Claim:
        return kube_claims.fetch_claim(client, ref, driver=identity.driver_name, pool=config.node_name,
                                       timeout_s=timeout_s)

    return fetch


def make_publisher(identity: DriverIdentity, config: PluginConfig, connection: Connection, *,
                   on_error: Callable[[Exception], None] | None = None,
                   on_publish: Callable[[PublishResult], None] | None = None) -> SlicePublisher:
    """The ResourceSlice publisher of this node's pool."""

    def publish_error(exc: Exception) -> None:
        if on_error is not None:
            on_error(exc)
        log.warning("ResourceSlice publish failed: %s", exc)

    return SlicePublisher(connection.client, driver=identity.driver_name, node_name=config.node_name,
                          node_uid=connection.node_uid, on_error=publish_error, on_publish=on_publish)


async def serve(lifecycle: Lifecycle, config: PluginConfig, runner: ClaimPreparer, *,
                health_source: HealthSource | None = None, publisher: SlicePublisher | None = None,
                ready: Callable[[], bool] | None = None) -> Servers:
    """Start step: the DRA socket, the probe and the registration socket; on stop, in-flight calls get the
    lifecycle's ``grace_s``. The probe's ``readiness`` service follows ``publisher.in_sync`` (and ``ready()``)."""
    ready = _readiness(publisher, ready)
    return await lifecycle.step("gRPC servers",
                                lambda: start_servers(config, runner, health_source=health_source, ready=ready),
                                lambda servers: servers.stop(grace=lifecycle.grace_s))


def _readiness(publisher: SlicePublisher | None, ready: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """The probe's ``readiness`` verdict: ``ready()`` (when given) and the publisher in sync (when there is one)."""
    if publisher is None:
        return ready
    if ready is None:
        return lambda: publisher.in_sync
    return lambda: ready() and publisher.in_sync


async def attach_early(lifecycle: Lifecycle, early: EarlyServers, runner: ClaimPreparer, *,
                       health_source: HealthSource | None = None, publisher: SlicePublisher | None = None,
                       ready: Callable[[], bool] | None = None) -> Servers:
    """Start step for servers already serving (:func:`dradriver.server.deferred.start_early`): hand the calls
    waiting on them to ``runner`` and ``health_source``; the probe's ``readiness`` follows ``publisher.in_sync``
    (and ``ready()``). Stopped at the same place in the order as :func:`serve`'s servers."""

    def attach() -> Servers:
        early.readiness.attach(runner, health_source=health_source, ready=_readiness(publisher, ready))
        return early.servers

    return await lifecycle.step("gRPC servers (served early)", attach,
                                lambda servers: servers.stop(grace=lifecycle.grace_s))


async def run_publisher(lifecycle: Lifecycle, publisher: SlicePublisher) -> asyncio.Task[Any]:
    """Start step: the publisher's background task (stopped, then cancelled, on stop)."""

    def start() -> asyncio.Task[Any]:
        task = asyncio.create_task(publisher.run(), name="resourceslice-publisher")
        task.add_done_callback(report_task_end)
        return task

    async def stop(task: asyncio.Task[Any]) -> None:
        try:
            publisher.stop()
        finally:
            await cancel_tasks([task])

    return await lifecycle.step("ResourceSlice publisher", start, stop)


def _reason_label(reason: str) -> str:
    word = reason.split(":", 1)[0].split(" ", 1)[0]
    return {"gone": "gone", "replaced": "replaced"}.get(word, "unallocated")


async def run_stale_claim_cleanup(lifecycle: Lifecycle, identity: DriverIdentity, config: PluginConfig,
                                  connection: Connection, runner: BatchRunner, *,
                                  count: Callable[[str], None] | None = None) -> StaleClaimReconciler | None:
    """Start step: the stale-claim cleanup (``--stale-claim-grace-seconds``; 0 disables it), which logs, counts
    and writes a ``StaleClaimUnprepared`` Warning Event for each claim it unprepares."""
    if config.stale_claim_grace_seconds <= 0:
        return None

    def standing(ref: ClaimRef) -> str:
        return kube_claims.claim_standing(connection.client, ref, driver=identity.driver_name,
                                          pool=config.node_name)

    def cleaned(cleanup: Cleanup) -> None:
        if count is not None and not cleanup.error:
            count(_reason_label(cleanup.reason))
        outcome = "unprepared" if not cleanup.error else f"unprepare failed ({cleanup.error})"
        report_event(identity, connection.client, config, connection.node_uid, "StaleClaimUnprepared",
                     f"claim {cleanup.ref}: {cleanup.reason}; {outcome}")

    reconciler = StaleClaimReconciler(runner, standing, grace_s=float(config.stale_claim_grace_seconds),
                                      period_s=min(60.0, max(1.0, config.stale_claim_grace_seconds / 2)),
                                      on_cleanup=cleaned)

    def start() -> asyncio.Task[Any]:
        task = asyncio.create_task(reconciler.run(), name="stale-claim-cleanup")
        task.add_done_callback(report_task_end)
        return task

    await lifecycle.step("stale-claim cleanup", start, lambda task: cancel_tasks([task]))
    return reconciler


async def serve_metrics_step(life: Lifecycle, config: PluginConfig, metrics: DriverMetrics) -> MetricsServer | None:
    """Serve ``metrics`` on ``--http-endpoint`` at ``--metrics-path`` as a lifecycle step (stopped with the plugin);
    ``None`` when the endpoint is empty, or the path is (NVIDIA: "disabled if empty", ``pkg/metrics/``).
    Bound before the kubelet can see the plugin, so a port in use fails the start cleanly.

    :raises FlagError: the endpoint cannot be bound (names it).
    """
    if not config.http_endpoint:
        return None
    if not config.metrics_path:
        log.info("metrics server off: --metrics-path (env METRICS_PATH) is empty")
        return None

    def bind() -> MetricsServer:
        try:
            return serve_metrics(metrics.registry, config.http_endpoint, config.metrics_path,
                                 dcgm_compatible=config.dcgm_compatible)
        except OSError as exc:
            raise FlagError(f"cannot serve metrics on {config.http_endpoint!r}: {exc}") from exc

    server: MetricsServer = await life.step("metrics server", bind, lambda server: server.stop())
    return server


async def report_unavailable(identity: DriverIdentity, config: PluginConfig, connection: Connection,
                             session: NvmlSession) -> None:
    """At a start without a usable driver: log it and record a ``NvidiaDriverUnavailable`` Warning Event on the
    Node naming ``nvmlInit``'s failure (:attr:`NvmlSession.unavailable_reason`)."""
    log.error("NVIDIA driver not available: %s; unprepares are served, prepares wait for the driver",
              session.unavailable_reason)
    await asyncio.to_thread(report_event, identity, connection.client, config, connection.node_uid,
                            "NvidiaDriverUnavailable", f"NVIDIA driver not available: {session.unavailable_reason}; "
                            "claims are unprepared, prepares wait for it")


def report_departure(identity: DriverIdentity, config: PluginConfig, connection: Connection, why: str) -> None:
    """A reload detected under the running plugin (a :class:`~dradriver.kubeletplugin.driverstate.DriverWatch`'s
    ``depart``): a ``NvidiaDriverUnavailable`` Warning Event on the Node naming ``why``
    (:meth:`~dradriver.kubeletplugin.driverstate.ReloadDetector.check`). Blocking (one API call; a failure is logged
    by :func:`report_event`)."""
    report_event(identity, connection.client, config, connection.node_uid, "NvidiaDriverUnavailable",
                 f"NVIDIA driver went away ({why}); claims are unprepared, prepares wait for it and are "
                 "served once it is loaded again, without a restart")


def report_return(identity: DriverIdentity, config: PluginConfig, connection: Connection, *,
                  version: str, before: str, summary: str) -> None:
    """The driver of a reload is back and read (the watch's ``arrive`` after a :func:`report_departure`): a
    ``NvidiaDriverAvailable`` Normal Event on the Node, ``NVIDIA driver <version> loaded again (was <before>):
    <summary>`` (``summary``: what the plugin read and rewrote). Blocking."""
    report_event(identity, connection.client, config, connection.node_uid, "NvidiaDriverAvailable",
                 f"NVIDIA driver {version} loaded again (was {before}): {summary}", type_="Normal")


async def check_cdi_hook(identity: DriverIdentity, config: PluginConfig, connection: Connection, *,
                         named: Callable[[], bool]) -> Callable[[], str]:
    """Start step: the ``nvidia-cdi-hook`` that claim specs name (:mod:`dradriver.host.cdihook`), looked at now
    and at each later ask while specs name a hook (``named()``: the driver's files were found, so the spec-level
    edits carry hooks; with none, e.g. the mock NVML without driver files, nothing depends on it).

    With no ``--nvidia-cdi-hook-path`` the image's hook is copied to ``<plugin dir>/nvidia-cdi-hook`` at the first
    look, as NVIDIA's plugin does. While the hook is missing the plugin is not ready and refuses prepares (the
    returned refusal, combined by :func:`~dradriver.kubeletplugin.driverstate.first_refusal`): a claim prepared
    then would give a container that cannot be created. Each time it is found missing a ``NvidiaCdiHookMissing``
    Warning Event on the Node says why; once it is there (installed on the host, or a fixed image) the plugin
    serves without a restart.

    :returns: why prepares are refused for the hook now (``""``: it is there, cannot be checked, or is not named).
    """
    def report(reason: str) -> None:  # called on a probe or prepare thread: the API call runs on its own
        threading.Thread(target=report_event, name="cdi-hook-event", daemon=True,
                         args=(identity, connection.client, config, connection.node_uid, "NvidiaCdiHookMissing",
                               reason)).start()

    visible = visible_path(config.cdi_hook_path, plugin_dir=config.plugin_dir,
                           host_driver_root=config.nvidia_driver_root,
                           container_driver_root=config.container_driver_root)
    hook = CdiHook(config.cdi_hook_path, visible, on_missing=report,
                   source=None if config.nvidia_cdi_hook_path else config.image_cdi_hook)

    def refusal() -> str:
        return hook.refusal() if named() else ""

    await asyncio.to_thread(refusal)
    return refusal
