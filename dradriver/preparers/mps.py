"""MPS control daemons on this node (:class:`ControlDaemons`) and the ``MPS`` sharing step (:class:`MpsSharing`).

:class:`ControlDaemons` is the reusable part: start a daemon for a set of devices and wait until it is ready,
stop it, give workloads its CDI edits, and sweep daemons no stored claim knows. The ``MPS`` sharing step uses
one daemon per config group per claim (NVIDIA's contract, :mod:`dradriver.domain.mps`); the consumable-shares
work uses one per shared GPU through the same component (``ControlDaemon.claim_uid`` is then the GPU's key).

Start, in this order, so that every side effect is findable from what was written before it:

1. ``<root>/<id>/{pipe,shm,log}`` (0755) and ``<root>/<id>/daemon.json`` (the :class:`ControlDaemon`, written
   atomically): stop and sweep work from this file alone;
2. tmpfs on ``shm`` (``rw,nosuid,nodev,noexec,relatime,size=<MemTotal/2>``, :mod:`dradriver.host.mounts`);
3. compute mode ``EXCLUSIVE_PROCESS`` on the full GPUs;
4. the Deployment (an existing one of that name is kept, as NVIDIA does);
5. readiness polled with bounded exponential backoff (50 ms doubling to 250 ms, 10 % jitter; NVIDIA: 1 s
   doubling to 10 s, four retries) until the caller's deadline (the kubelet's, passed down by the batch
   runner). Time spent here is kept per daemon in :attr:`ControlDaemons.wait_s` (for ``bench/``).

A start that fails undoes everything it did (stop) before raising. Stop: delete the Deployment (foreground
propagation, NotFound ok), wait (bounded) until no Pod of it is left so nothing holds the directories, set the
GPUs' compute mode back to ``DEFAULT``, unmount ``shm``, remove the directory; a missing directory is a
finished stop (idempotent).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver.domain import mps
from dradriver.domain.cdi import ContainerEdits
from dradriver.domain.claims import ClaimRef
from dradriver.domain.configs import MPS, ConfigGroup
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.ports import UndoRecord
from dradriver.errors import DradriverError
from dradriver.host.mounts import MountCommands
from dradriver.kube import deployments
from dradriver.kube.client import KubeClient

log = logging.getLogger(__name__)

RECORD = "daemon.json"
EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"
DEFAULT = "DEFAULT"
DEFAULT_WAIT_S = 30.0
"""Readiness wait when the caller gives no deadline, seconds."""
STOP_WAIT_S = 10.0
"""Longest a stop waits for the daemon's Pod to go before unmounting, seconds."""

SetComputeMode = Callable[[str, str], None]
"""``(GPU UUID, "DEFAULT" | "EXCLUSIVE_PROCESS")``; raises ``DradriverError`` when NVML refuses."""


class MpsDaemonError(DradriverError):
    """A control daemon could not be started or stopped; the message names the daemon and the step."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Readiness polling delays: ``initial_s`` doubling up to ``max_s``, plus up to ``jitter`` of each."""

    initial_s: float = 0.05
    max_s: float = 0.25
    jitter: float = 0.1

    def delays(self) -> Iterable[float]:
        """An endless sequence of delays, seconds."""
        delay = self.initial_s
        while True:
            yield delay * (1.0 + random.uniform(0.0, self.jitter))
            delay = min(self.max_s, delay * 2)


class ControlDaemons:
    """The MPS control daemons of this node.

    :param root: ``<plugins dir>/gpu.nvidia.com/mps`` as the plugin sees it (the same path on the host: the
        plugins directory is mounted at its host path).
    :param client: the API client (Deployments and Pods in ``placement``'s namespace).
    :param placement: namespace, node, image, driver root; ``directory`` is ignored (each daemon's own).
    :param set_compute_mode: sets a GPU's compute mode through NVML.
    :param meminfo: ``<proc root>/meminfo``: half its ``MemTotal`` sizes each shm tmpfs.
    :param mounts: how tmpfs is mounted (the real commands, or the sandbox's stand-ins).
    """

    def __init__(self, *, root: Path, client: KubeClient, placement: mps.DaemonPlacement,
                 set_compute_mode: SetComputeMode, meminfo: Path, mounts: MountCommands | None = None,
                 backoff: Backoff | None = None, stop_wait_s: float = STOP_WAIT_S) -> None:
        self.root = root
        self.client = client
        self.placement = placement
        self.set_compute_mode = set_compute_mode
        self.meminfo = meminfo
        self.mounts = mounts or MountCommands()
        self.backoff = backoff or Backoff()
        self.stop_wait_s = stop_wait_s
        self.wait_s: dict[str, float] = {}
        """Daemon ID -> seconds its latest start spent waiting for the Deployment to become ready."""

    # ------------------------------------------------------------------------------------------- paths
    def directory(self, daemon_id: str) -> Path:
        """``<root>/<id>``."""
        return self.root / daemon_id

    def edits(self, daemon_id: str) -> ContainerEdits:
        """The workload's CDI edits for the daemon ``daemon_id`` (pipe directory env, ``/dev/shm`` and pipe
        bind mounts)."""
        return mps.workload_edits(str(self.directory(daemon_id)))

    def known(self) -> list[str]:
        """IDs of the daemons with a directory here, sorted."""
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def read(self, daemon_id: str) -> mps.ControlDaemon | None:
        """The stored record of ``daemon_id``; ``None`` when its directory or record is gone.

        :raises MpsDaemonError: the record is unreadable.
        """
        try:
            raw = json.loads((self.directory(daemon_id) / RECORD).read_text())
            return mps.ControlDaemon.from_json(raw)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            raise MpsDaemonError(f"MPS control daemon {daemon_id}: unreadable {RECORD}: {exc}") from exc

    # ------------------------------------------------------------------------------------------- start
    def start(self, daemon: mps.ControlDaemon, *, deadline: float | None = None) -> None:
        """Start ``daemon`` and return once it is ready (module docstring).

        :param deadline: ``time.monotonic()`` value by which it must be ready (``None``: 30 s from now).
        :raises MpsDaemonError: a step failed or the daemon was not ready by the deadline; everything this
            start did is undone first.
        """
        if deadline is None:
            deadline = time.monotonic() + DEFAULT_WAIT_S
        try:
            self._start(daemon, deadline)
        except BaseException as exc:
            try:
                self.stop(daemon.daemon_id)
            except Exception as undo_exc:  # kept on disk: the next stop or the start-up sweep finishes it
                log.error("MPS control daemon %s: undo after a failed start failed: %s", daemon.daemon_id, undo_exc)
            if isinstance(exc, MpsDaemonError):
                raise
            if isinstance(exc, DradriverError):
                raise MpsDaemonError(f"MPS control daemon {daemon.deployment}: {exc}") from exc
            raise

    def _start(self, daemon: mps.ControlDaemon, deadline: float) -> None:
        directory = self.directory(daemon.daemon_id)
        for sub in (mps.PIPE_DIR, mps.SHM_DIR, mps.LOG_DIR):
            (directory / sub).mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(directory / sub, 0o755)
        temp = directory / f".{RECORD}.tmp"
        temp.write_text(json.dumps(daemon.to_json(), sort_keys=True))
        os.replace(temp, directory / RECORD)
        try:
            meminfo: str | None = self.meminfo.read_text()
        except OSError:
            meminfo = None
        self.mounts.mount_tmpfs(directory / mps.SHM_DIR, mps.tmpfs_options(mps.shm_size(meminfo)))
        for uuid in daemon.gpu_uuids:
            self.set_compute_mode(uuid, EXCLUSIVE_PROCESS)
        placement = dataclasses.replace(self.placement, directory=str(directory))
        manifest = mps.deployment_manifest(daemon, placement)
        if deployments.create_deployment(self.client, manifest) is None:
            log.info("MPS control daemon Deployment %s/%s exists already; waiting for it", placement.namespace,
                     daemon.deployment)
        self._wait_ready(daemon, deadline)

    def _wait_ready(self, daemon: mps.ControlDaemon, deadline: float) -> None:
        namespace, name = self.placement.namespace, daemon.deployment
        began = time.monotonic()
        reason = "not checked"
        try:
            for delay in self.backoff.delays():
                deployment = deployments.get_deployment(self.client, namespace, name)
                pods = deployments.list_pods(self.client, namespace, f"{mps.LABEL_APP}={name}") \
                    if deployment is not None else []
                reason = mps.readiness(deployment, pods)
                if not reason:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(delay, left))
        finally:
            self.wait_s[daemon.daemon_id] = time.monotonic() - began
        raise MpsDaemonError(f"MPS control daemon Deployment {namespace}/{name} not ready within "
                             f"{self.wait_s[daemon.daemon_id]:.1f} s: {reason}")

    # -------------------------------------------------------------------------------------------- stop
    def stop(self, daemon_id: str, gpu_uuids: Sequence[str] = ()) -> bool:
        """Stop the daemon ``daemon_id``; False when there was nothing to stop (its directory is gone).
        ``gpu_uuids``: the full GPUs whose compute mode goes back to DEFAULT when the directory holds no
        ``daemon.json`` (a daemon NVIDIA's plugin started: same ID, Deployment name and directories, no record).

        :raises MpsDaemonError: a step failed; what is left stays recorded on disk for the retry.
        """
        directory = self.directory(daemon_id)
        if not directory.exists():
            return False
        daemon = self.read(daemon_id)
        name = mps.deployment_name(daemon_id)
        namespace = self.placement.namespace
        try:
            deployments.delete_deployment(self.client, namespace, name)
            self._wait_gone(name)
            for uuid in daemon.gpu_uuids if daemon is not None else gpu_uuids:
                self.set_compute_mode(uuid, DEFAULT)
            self.mounts.unmount(directory / mps.SHM_DIR)
        except DradriverError as exc:
            raise MpsDaemonError(f"MPS control daemon {name}: stop: {exc}") from exc
        shutil.rmtree(directory, ignore_errors=True)
        self.wait_s.pop(daemon_id, None)
        if directory.exists():
            raise MpsDaemonError(f"MPS control daemon {name}: cannot remove {directory}")
        return True

    def _wait_gone(self, name: str) -> None:
        """Until no Pod of the Deployment is left (foreground deletion), at most :attr:`stop_wait_s`."""
        end = time.monotonic() + self.stop_wait_s
        for delay in self.backoff.delays():
            if not deployments.list_pods(self.client, self.placement.namespace, f"{mps.LABEL_APP}={name}"):
                return
            if time.monotonic() >= end:
                log.warning("MPS control daemon %s: its Pod is still terminating after %.0f s; cleaning up anyway",
                            name, self.stop_wait_s)
                return
            time.sleep(delay)

    def sweep(self, keep: Iterable[str]) -> list[str]:
        """Stop every daemon with a directory here whose ID is not in ``keep``, and delete Deployments of this
        node no directory explains; returns the IDs stopped (at start: what a crash left half-made)."""
        wanted = set(keep)
        stopped: list[str] = []
        for daemon_id in self.known():
            if daemon_id in wanted:
                continue
            try:
                if self.stop(daemon_id):
                    stopped.append(daemon_id)
            except DradriverError as exc:
                log.error("MPS control daemon %s no claim knows: stop failed: %s", daemon_id, exc)
        try:
            stray = deployments.list_deployments(self.client, self.placement.namespace,
                                                 f"{mps.LABEL_NODE}={self.placement.node_name},"
                                                 f"{mps.LABEL_KIND}={self.placement.kind}")
        except DradriverError as exc:
            log.error("cannot list MPS control daemon Deployments: %s", exc)
            return stopped
        for item in stray:
            name = str(item["metadata"]["name"])
            daemon_id = name.removeprefix(mps.DEPLOYMENT_PREFIX)
            if daemon_id in wanted or self.directory(daemon_id).exists():
                continue
            try:
                deployments.delete_deployment(self.client, self.placement.namespace, name)
                stopped.append(daemon_id)
            except DradriverError as exc:
                log.error("MPS control daemon Deployment %s no claim knows: delete failed: %s", name, exc)
        return stopped


def _uuid(device: object) -> str:
    if isinstance(device, GpuDevice | MigDevice):
        return device.uuid
    raise MpsDaemonError(f"MPS needs GPUs or MIG devices, not {type(device).__name__}")


class MpsSharing:
    """The ``MPS`` strategy: one control daemon per config group per claim (NVIDIA's
    ``cmd/gpu-kubelet-plugin/sharing.go``).

    Undo record (kind ``mps``, version 1): ``{"id": <daemon ID>, "devices": [<DRA device names>]}``, and
    ``"gpus": [<full GPU UUIDs>]`` for a daemon adopted from NVIDIA's checkpoint (its directory has no
    ``daemon.json`` saying which GPUs' compute mode to reset; :mod:`dradriver.kubeletplugin.adoption`).
    """

    kind = "mps"
    strategy: str | None = MPS
    side_effects = True
    UNDO_VERSION = 1

    def __init__(self, daemons: ControlDaemons) -> None:
        self.daemons = daemons

    def daemon_for(self, claim: ClaimRef, group: ConfigGroup, devices: Sequence[object]) -> mps.ControlDaemon:
        """The daemon a group needs (ID from the claim UID and the devices' UUIDs; settings from its plan).

        :raises MpsDaemonError: the group has no MPS plan or a device is neither a GPU nor a MIG device.
        """
        plan = group.plan.mps
        if plan is None:
            raise MpsDaemonError(f"claim {claim}: {group.entry.parameters_at}.sharing: no MPS plan")
        uuids = tuple(sorted(_uuid(d) for d in devices))
        gpus = tuple(sorted(d.uuid for d in devices if isinstance(d, GpuDevice)))
        return mps.ControlDaemon(mps.control_daemon_id(claim.uid, uuids), claim.uid, uuids, gpus,
                                 plan.active_thread_percentage, plan.pinned_memory_limits, plan.multi_user)

    def apply(self, claim: ClaimRef, group: ConfigGroup, devices: Sequence[object], *,
              deadline: float | None = None) -> UndoRecord:
        """Start the group's daemon and wait until it is ready, by ``deadline`` (``time.monotonic()``).

        :raises MpsDaemonError: it could not be started or was not ready in time (nothing left behind).
        """
        daemon = self.daemon_for(claim, group, devices)
        try:
            self.daemons.start(daemon, deadline=deadline)
        except MpsDaemonError as exc:
            raise MpsDaemonError(f"claim {claim}: {group.entry.parameters_at}.sharing: {exc}") from exc
        return UndoRecord(self.kind, self.UNDO_VERSION, ",".join(group.devices),
                          {"id": daemon.daemon_id, "devices": list(group.devices)})

    def edits(self, claim: ClaimRef, record: UndoRecord) -> Mapping[str, ContainerEdits]:
        """Every device of the group gets the daemon's workload edits."""
        daemon_id = str(record.data.get("id", ""))
        return {str(name): self.daemons.edits(daemon_id) for name in record.data.get("devices", [])}

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Stop the daemon (idempotent).

        :raises MpsDaemonError: a stop step failed (retried by the next unprepare or start).
        """
        daemon_id = str(record.data.get("id", ""))
        if daemon_id and self.daemons.stop(daemon_id, [str(u) for u in record.fact("gpus", list, [])]):
            log.info("claim %s: stopped MPS control daemon %s/%s of %s", claim, self.daemons.placement.namespace,
                     mps.deployment_name(daemon_id), record.target)

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """At start: stop daemons no stored record names (a crash between start and storing the record)."""
        return self.daemons.sweep(str(r.data.get("id", "")) for r in known)
