"""The compute-domain daemon: one per ComputeDomain and node, wrapping ``nvidia-imex`` (``compute-domain-daemon
run|check``).

``run`` (NVIDIA's ``cmd/compute-domain-daemon/``, the IMEX daemon wrapper):

1. refuse to start without ``COMPUTE_DOMAIN_UUID`` (the daemon claim's CDI spec injects it);
2. label its own Pod ``resource.nvidia.com/computeDomain.cliqueID=<cliqueID>`` (explicitly empty on a node in
   no clique); with no clique, idle until SIGTERM;
3. render ``<imexd>/imexd.cfg`` from ``<imexd>/imexd.cfg.tmpl`` (pod IP, ``nodes.cfg`` path) and the static
   ``nodes.cfg`` of per-domain DNS names;
4. apply its entry at once, then (with ``DaemonSettings.watch``, the default; without it the 1 s poll alone)
   follow its ComputeDomainClique ``<cdUID>.<cliqueID>`` through a watch
   (:class:`CliqueWatch`, ``fieldSelector metadata.name``, from the apply's resourceVersion): each event is acted
   on at once; one GET every ``resync_s`` (60 s) while the watch is up, every ``poll_interval_s`` (1 s) while it
   is down (the poll of earlier versions, now the fallback); when the clique lacks this daemon's entry as it
   should be, send one
   server-side apply (field manager ``compute-domain-daemon/<nodeName>``) of its own ``daemons`` item
   ``{nodeName, ipAddress, cliqueID}``, the clique's labels (7.1) and its Pod as an owner reference -- so a
   daemon writes its entry once per pod (again only after the controller cleared it: node failure) and never
   conflicts with another writer; the ``index`` and the ``status`` are the controller's
   (:mod:`dradriver.computedomain.controller`: ``status`` mirrors this pod's Ready condition, i.e. the probe's
   ``check``);
   rewrite the hosts file with the name -> IP mapping of the same-clique daemons (an entry without IP or index
   maps to the unused-slot IP); start ``nvidia-imex`` once, send it SIGUSR1 when the peers' addresses change
   (only once it has installed its handler: before that SIGUSR1 kills it), and restart it when this daemon's own
   name changes (its index assigned after the start, or changed: nvidia-imex reads its own identity at start
   only); an ``nvidia-imex`` that keeps exiting is started again with a back-off (1 s doubling to 60 s), and each
   exit's cause (its last ``ERROR`` line) goes into the readiness record, the process record the probe reads,
   a condition of its clique entry (``IMEXDaemonRunning`` False/``IMEXDaemonFailed``, which the controller copies
   into ``ComputeDomain.status.nodes[]``) and a Warning Event about the ComputeDomain (:class:`ImexReporter`);
5. on SIGTERM: withdraw its fields (an apply without the item, only if the entry still has this pod's IP),
   stop ``nvidia-imex``. The controller's index reservation stays until the node runs no daemon pod.

API for in-process drivers (the bench; stable): :func:`entry_body`, :func:`apply_entry` ``(client, settings)
-> [CliqueDaemon]``, :func:`read_clique`, :func:`clique_daemons`, :func:`entry_current`,
:func:`peer_mapping` ``(settings, daemons) -> {dnsName: ip}``, :func:`withdraw_entry`, and :class:`Membership`
(``Membership(client, settings).step(observed=READ) -> (mapping, changed)``: one daemon round without
``nvidia-imex``, on a clique a watch event brought or on a GET; ``.applied`` counts writes, ``.reads`` GETs),
:class:`CliqueWatch` (``start(rv)``, ``run(stop)`` in a thread; ``wait(stop)`` / ``take()`` the newest event's
clique or :data:`READ`; ``on_event`` callback). The controller side: ``ComputeDomainController(client, settings).
reconcile_membership(uids=None)`` assigns indexes, clears failed nodes and aggregates ``status.nodes`` of the
domains in one pass (``reconcile_clique(clique, pods)``: one clique without its domain's status;
``index_applies``, ``clique_patches``, ``status_writes`` count its writes).

``check`` succeeds only when this pod's own ``nvidia-imex`` (the PID in its process record
``<imexd>/nvidia-imex.json``) runs and itself listens on the command port, and ``nvidia-imex-ctl -c
<imexd>/imexd.cfg -q`` prints exactly ``READY\\n`` (:func:`~dradriver.host.imexprocess.check_own_daemon`: another
daemon on the same address, such as a host ``nvidia-imex.service``, cannot answer for it); while ``nvidia-imex`` is
down it fails with the whole cause of its last exit; with no clique it succeeds at once. ``run`` holds the liveness
lock of its domain directory (:func:`~dradriver.host.imexchannels.hold_daemon_lock`) while it lives. Each ``check``,
the start of ``run`` (after the configs, before anything else), each exit of ``nvidia-imex`` and its end write the
readiness record ``<imexd>/daemon-readiness.json`` (:class:`~dradriver.domain.imex.DaemonRecord`: ready only from a
check that passed) for the compute-domain plugin on the same node, which reads it before the API
(:func:`record_readiness`; dradriver's own: NVIDIA's plugin reads the clique entry's ``status`` only). In-process
drivers call :func:`record_readiness` where ``check`` would run.

Differences from NVIDIA: NVIDIA's daemon inserts its entry (and picks its index) by read-modify-write of the
shared clique with conflict retries (ksigs#816: minutes of convergence from conflicts; #1418: index swaps);
here each daemon applies only its own fields, once, and the controller alone assigns indexes and copies each
daemon pod's Ready condition into its entry (NVIDIA's daemon writes its entry again at every status flip). The
clique is watched as NVIDIA's informer watches it (its events acted on at once), with a plain GET as the
resync (60 s; NVIDIA's informer resync 4 min) and as the fallback poll while the watch is down; the own Pod is
not read at all; NVIDIA's daemon sends SIGUSR1 also to a process that has not installed its handler yet (which
kills it), never restarts it for an index change, restarts a failing one every second forever and reports its
failure in the container log only; its probe asks whatever answers on the pod's command address. Only the
default gate settings (ComputeDomainCliques and IMEXDaemonsWithDNSNames on) are implemented: the status-nodes and
IP-list modes are not.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dradriver.domain import computedomains as cd
from dradriver.domain import imex
from dradriver.domain.computedomains import CliqueDaemon
from dradriver.errors import DradriverError
from dradriver.host import imexchannels
from dradriver.host.imexprocess import (
    BACKOFF_MAX_S,
    STABLE_S,
    WATCHDOG_INTERVAL_S,
    ImexExit,
    ImexProcess,
    check_own_daemon,
    write_config_file,
    write_hosts_file,
)
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kube import events, pods
from dradriver.kube.client import JSONDict, KubeClient

__all__ = ["CDI_HINT", "DAEMON_FIELD_MANAGER_PREFIX", "READ", "CliqueWatch", "DaemonError", "DaemonSettings",
           "ImexReporter", "Membership", "apply_entry", "check", "clique_daemons", "entry_body", "entry_current",
           "field_manager", "peer_mapping", "read_clique", "record_readiness", "render_configs", "run_daemon",
           "withdraw_entry"]

log = logging.getLogger(__name__)

CDI_HINT = "COMPUTE_DOMAIN_UUID is empty: is CDI enabled in your container runtime?"
DAEMON_FIELD_MANAGER_PREFIX = "compute-domain-daemon/"


class DaemonError(DradriverError):
    """The daemon cannot run: missing settings, missing template, no free index."""


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """What the daemon knows about itself (flags and environment, NVIDIA's ``cmd/compute-domain-daemon/main.go``).

    :param clique_id: ``CLIQUE_ID`` (``<clusterUUID>.<cliqueId>``; empty: the node is in no clique).
    :param max_nodes: ``MAX_NODES_PER_IMEX_DOMAIN``: slots, DNS names and lines of ``nodes.cfg``.
    :param imexd_dir: the domain directory mounted at ``/imexd`` (template in, config files out).
    :param hosts_file: the resolver's hosts file the daemon owns (the container's ``/etc/hosts``).
    :param poll_interval_s: seconds between two reads of the clique while its watch is down (the fallback).
    :param resync_s: seconds between two reads of the clique while its watch is up (a missed event is caught
        here at the latest).
    :param watch: follow the clique through a watch (:class:`CliqueWatch`, the default); False: poll every
        ``poll_interval_s`` only.
    :param watch_timeout_s: ``timeoutSeconds`` of each watch request (the watch resumes at once after it).
    """

    clique_id: str
    cd_uid: str
    cd_name: str = ""
    cd_namespace: str = ""
    node_name: str = ""
    pod_ip: str = ""
    pod_uid: str = ""
    pod_name: str = ""
    pod_namespace: str = ""
    max_nodes: int = cd.DEFAULT_MAX_NODES_PER_IMEX_DOMAIN
    imexd_dir: Path = Path("/imexd")
    hosts_file: Path = Path("/etc/hosts")
    imex_binary: str = "nvidia-imex"
    imex_ctl_binary: str = "nvidia-imex-ctl"
    poll_interval_s: float = 1.0
    resync_s: float = 60.0
    watch: bool = True
    watch_timeout_s: float = 300.0
    imex_env: dict[str, str] | None = field(default=None)
    imex_watchdog_s: float = WATCHDOG_INTERVAL_S
    imex_backoff_max_s: float = BACKOFF_MAX_S
    imex_stable_s: float = STABLE_S

    @property
    def config_path(self) -> Path:
        return self.imexd_dir / imex.CONFIG_FILE

    @property
    def clique_name(self) -> str:
        return cd.clique_object_name(self.cd_uid, self.clique_id)

    def validate(self) -> None:
        """:raises DaemonError: ``COMPUTE_DOMAIN_UUID`` missing (:data:`CDI_HINT`), or a Pod field missing, or
        ``max_nodes`` below 1."""
        if not self.cd_uid:
            raise DaemonError(CDI_HINT)
        missing = [env for env, value in (("NODE_NAME", self.node_name), ("POD_IP", self.pod_ip),
                                          ("POD_UID", self.pod_uid), ("POD_NAME", self.pod_name),
                                          ("POD_NAMESPACE", self.pod_namespace)) if not value]
        if missing:
            raise DaemonError(f"{', '.join(missing)} not set (the DaemonSet passes them from the Pod's fields)")
        if self.max_nodes < 1:
            raise DaemonError(f"MAX_NODES_PER_IMEX_DOMAIN {self.max_nodes} must be at least 1")


# -- the clique entry ----------------------------------------------------------------------------------------


def field_manager(settings: DaemonSettings) -> str:
    """The daemon's server-side-apply field manager: ``compute-domain-daemon/<nodeName>`` (one per node, so a
    replacement pod on the node takes over its predecessor's fields)."""
    return f"{DAEMON_FIELD_MANAGER_PREFIX}{settings.node_name}"


def _owner(settings: DaemonSettings) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "name": settings.pod_name, "uid": settings.pod_uid}


def entry_body(settings: DaemonSettings, member: bool = True,
               conditions: Sequence[cd.DaemonCondition] = ()) -> dict[str, Any]:
    """The apply body of this daemon: the clique's name, labels (NVIDIA 7.1), its Pod as an owner reference,
    and its own ``daemons`` item ``{nodeName, ipAddress, cliqueID}`` (no ``index``, no ``status``: the
    controller's) with its ``conditions`` when it has any (:class:`~dradriver.domain.computedomains.
    DaemonCondition`: why its ``nvidia-imex`` does not run); ``member`` False: no item (the daemon withdraws,
    keeping its owner reference until its Pod is gone)."""
    body: dict[str, Any] = {
        "apiVersion": cd.API_GROUP_VERSION, "kind": cd.CLIQUE_KIND,
        "metadata": {"name": settings.clique_name, "namespace": settings.pod_namespace,
                     "labels": {cd.LABEL_COMPUTE_DOMAIN: settings.cd_uid, cd.LABEL_CLIQUE_ID: settings.clique_id},
                     "ownerReferences": [_owner(settings)]},
        "daemons": []}
    if member:
        item: dict[str, Any] = {"nodeName": settings.node_name, "ipAddress": settings.pod_ip,
                                "cliqueID": settings.clique_id}
        if conditions:
            item["conditions"] = [c.to_json() for c in conditions]
        body["daemons"] = [item]
    return body


def clique_daemons(obj: Mapping[str, Any] | None) -> list[CliqueDaemon]:
    """The entries of a clique object (``[]`` for none); an item without ``ipAddress`` or ``index`` reads as
    ``ip_address`` ``""`` / ``index`` -1 (a reservation, or a daemon still waiting for its index)."""
    return [CliqueDaemon.from_entry(e) for e in (obj or {}).get("daemons") or ()]


def read_clique(client: KubeClient, settings: DaemonSettings) -> JSONDict | None:
    """``GET`` this daemon's clique (``None`` when it does not exist yet).

    :raises dradriver.kube.errors.KubeAPIError: after retries.
    """
    return kube_cd.get_clique(client, settings.pod_namespace, settings.clique_name)


def entry_current(obj: Mapping[str, Any] | None, settings: DaemonSettings,
                  conditions: Sequence[cd.DaemonCondition] = ()) -> bool:
    """Whether ``obj`` (the clique as read) already holds this daemon's entry with this pod IP, clique ID and
    ``conditions``, and its Pod as an owner: then :func:`apply_entry` would change nothing and is not sent."""
    if obj is None:
        return False
    owners = (obj.get("metadata") or {}).get("ownerReferences") or ()
    if not any(o.get("uid") == settings.pod_uid for o in owners):
        return False
    return any(d.node_name == settings.node_name and d.ip_address == settings.pod_ip
               and d.clique_id == settings.clique_id and d.conditions == tuple(conditions)
               for d in clique_daemons(obj))


def apply_entry(client: KubeClient, settings: DaemonSettings) -> list[CliqueDaemon]:
    """Server-side apply this daemon's entry under :func:`field_manager`, creating the clique when missing;
    returns the clique's entries after the write.

    One request, no read first, never a conflict: the API merges the item into the ``daemons`` list-map by
    ``nodeName`` and leaves every other field alone (other daemons' items, the controller's ``index`` and ``status``).
    ``force``: after the controller cleared this node's fields (node failure), re-applying takes them back.

    :raises dradriver.kube.errors.KubeAPIError: after retries.
    """
    return clique_daemons(_apply(client, settings))


def _apply(client: KubeClient, settings: DaemonSettings,
           conditions: Sequence[cd.DaemonCondition] = ()) -> JSONDict | None:
    """:func:`apply_entry`'s request; returns the clique as the apply answered it."""
    return kube_cd.apply_clique(client, settings.pod_namespace, settings.clique_name,
                                entry_body(settings, conditions=conditions), field_manager=field_manager(settings),
                                force=True)


def withdraw_entry(client: KubeClient, settings: DaemonSettings) -> bool:
    """Give up this daemon's fields of its entry (an apply without the item), if the entry still carries this
    pod's IP (a replacement pod on the node that applied meanwhile keeps its entry; NVIDIA removes by pod IP).
    The controller's ``index`` stays: the node's next daemon gets the same index and DNS name; the controller
    drops the reservation once the node runs no daemon pod of the domain.

    :returns: whether an apply was sent.
    :raises dradriver.kube.errors.KubeAPIError: after retries.
    """
    obj = read_clique(client, settings)
    if not any(d.node_name == settings.node_name and d.ip_address == settings.pod_ip for d in clique_daemons(obj)):
        return False
    kube_cd.apply_clique(client, settings.pod_namespace, settings.clique_name, entry_body(settings, member=False),
                         field_manager=field_manager(settings), force=True)
    log.info("clique %s/%s: withdrew the entry of node %s (%s)", settings.pod_namespace, settings.clique_name,
             settings.node_name, settings.pod_ip)
    return True


def peer_mapping(settings: DaemonSettings, daemons: Iterable[CliqueDaemon]) -> dict[str, str]:
    """DNS name -> IP for every slot (:func:`~dradriver.domain.imex.dns_mapping`): an entry without
    ``ipAddress`` (a reservation) or without an index yet maps nowhere, i.e. its slot is the unused-slot IP."""
    return imex.dns_mapping(settings.cd_uid, daemons, settings.clique_id, settings.max_nodes)


class _Read:
    """The type of :data:`READ`."""

    def __repr__(self) -> str:
        return "READ"


#: What :meth:`CliqueWatch.wait` / :meth:`CliqueWatch.take` answer when no event brought a newer clique: the
#: daemon reads the clique itself (one GET) -- the poll fallback and the periodic resync.
READ = _Read()


def _rv(obj: Mapping[str, Any] | None) -> int | None:
    """``metadata.resourceVersion`` as a number (None when absent or not a number: then never compared)."""
    try:
        return int(str(((obj or {}).get("metadata") or {}).get("resourceVersion") or ""))
    except ValueError:
        return None


@dataclass
class Membership:
    """The daemon's side of membership, usable without ``nvidia-imex`` (the bench drives it in-process): the
    first :meth:`step` applies the entry without reading first (the apply answers with the clique); each later
    one looks at the clique -- the one a watch event brought (:class:`CliqueWatch`), else one GET -- and applies
    again only when the entry is missing or differs (the controller cleared it after a node failure, or the
    clique was recreated); it returns the peer mapping and whether it changed since the previous step.

    :param applied: the apply requests sent so far.
    :param reads: the GETs of the clique sent so far.
    :param clique: the newest clique object seen (the apply's answer, a GET or a watch event; None: none yet, or
        deleted).
    """

    client: KubeClient
    settings: DaemonSettings
    mapping: dict[str, str] | None = None
    applied: int = 0
    reads: int = 0
    clique: JSONDict | None = None
    conditions: tuple[cd.DaemonCondition, ...] = ()
    """This daemon's conditions, part of every apply of its entry (:meth:`report` sets them)."""

    def report(self, conditions: Sequence[cd.DaemonCondition]) -> None:
        """Set this daemon's entry's conditions and apply the entry now (a failed apply is logged; the next
        :meth:`step` applies them again, as its entry then differs).

        Called from the daemon's reporter thread while :meth:`step` runs in the main loop: both send the whole
        item (an apply is idempotent), the newest conditions win.
        """
        self.conditions = tuple(conditions)
        try:
            _apply(self.client, self.settings, self.conditions)
            self.applied += 1
        except kube_errors.KubeAPIError as exc:
            log.warning("cannot write the condition of node %s into clique %s/%s: %s", self.settings.node_name,
                        self.settings.pod_namespace, self.settings.clique_name, exc)

    @property
    def resource_version(self) -> str:
        """The resourceVersion of :attr:`clique` (``""``: none): where a watch of the clique starts."""
        return str(((self.clique or {}).get("metadata") or {}).get("resourceVersion") or "")

    def step(self, observed: JSONDict | _Read | None = READ) -> tuple[dict[str, str], bool]:
        """One round, on the clique ``observed`` by a watch event (``None``: the event was its deletion), or on a
        fresh GET (:data:`READ`). An observed object older than one already seen (a lower resourceVersion: the
        daemon's own apply answered after the event was sent) is not acted on.

        :returns: (mapping, changed): ``changed`` is False on the first round (nothing to reload yet).
        :raises dradriver.kube.errors.KubeAPIError: after retries.
        """
        obj: JSONDict | None
        if self.applied == 0:
            obj = None
        elif isinstance(observed, _Read):
            obj = read_clique(self.client, self.settings)
            self.reads += 1
        else:
            obj = observed
            seen, new_rv = _rv(self.clique), _rv(obj) if obj is not None else None
            if seen is not None and new_rv is not None and new_rv < seen:
                obj = self.clique  # a stale event: the apply's answer is newer
        if entry_current(obj, self.settings, self.conditions):
            self.clique = obj
            daemons = clique_daemons(obj)
        else:
            self.clique = _apply(self.client, self.settings, self.conditions)
            daemons = clique_daemons(self.clique)
            self.applied += 1
            mine = next((d for d in daemons if d.node_name == self.settings.node_name), None)
            log.info("clique %s/%s: applied the entry of node %s (%s, index %s)", self.settings.pod_namespace,
                     self.settings.clique_name, self.settings.node_name, self.settings.pod_ip,
                     "pending" if mine is None or mine.index < 0 else mine.index)
        new = peer_mapping(self.settings, daemons)
        changed = self.mapping is not None and imex.membership_change(self.mapping, new).changed
        self.mapping = new
        return new, changed


class CliqueWatch:
    """This daemon's clique followed through a watch (``fieldSelector metadata.name=<clique>``, the clique's
    labels), run by :meth:`run` in a thread of its own: each event keeps the object it carries (``None`` after
    ``DELETED``) and wakes :meth:`wait`, so an index or a status the controller writes reaches the daemon at once
    instead of at its next poll.

    The watch resumes from the last resourceVersion it saw (first: the one :meth:`start` gives, the daemon's
    own apply's); after 410 ``Expired`` it watches again from ``""`` (the current clique comes as ``ADDED``);
    after any other failure (an API error, or anything unexpected such as a malformed event: the thread never
    dies while the watch is taken for up, which would leave the daemon reading only every ``resync_s``) it is
    down and retried every ``retry_s``. While it is down (from a failure until an
    event arrives or a watch request ends cleanly) :meth:`wait` answers :data:`READ` every ``poll_s``: the daemon
    polls as it did before the watch; while it is up, every ``resync_s`` (a periodic GET catches a missed event).

    :param on_event: called after each event, outside the lock (the bench wakes its node agent with it).
    :param events: events received so far.
    """

    def __init__(self, client: KubeClient, settings: DaemonSettings, *, on_event: Callable[[], None] | None = None,
                 retry_s: float | None = None) -> None:
        self.client = client
        self.settings = settings
        self.on_event = on_event
        self.retry_s = settings.poll_interval_s if retry_s is None else retry_s
        self.events = 0
        self._cond = threading.Condition()
        self._rv = ""
        self._obj: JSONDict | None = None
        self._fresh = False  # an event not taken yet
        self._up = False

    @property
    def up(self) -> bool:
        """Whether the watch is taken for up (then the daemon reads the clique only every ``resync_s``)."""
        with self._cond:
            return self._up

    def start(self, resource_version: str) -> None:
        """Where the watch starts (before :meth:`run`): after ``resource_version``, the newest state the daemon
        already has; the watch is taken for up from here."""
        with self._cond:
            self._rv = resource_version
            self._up = True

    def pending(self) -> bool:
        """Whether an event arrived that :meth:`take` / :meth:`wait` has not handed out yet."""
        with self._cond:
            return self._fresh

    def take(self) -> JSONDict | _Read | None:
        """The clique of the newest event not handed out yet (``None``: deleted), else :data:`READ`."""
        with self._cond:
            if not self._fresh:
                return READ
            self._fresh = False
            return self._obj

    def period_s(self) -> float:
        """Seconds between two reads without an event: ``resync_s`` while the watch is up, else ``poll_s``."""
        return self.settings.resync_s if self.up else self.settings.poll_interval_s

    def wait(self, stop: threading.Event) -> JSONDict | _Read | None:
        """Block until an event arrives (its clique, ``None``: deleted), :meth:`period_s` passes (:data:`READ`)
        or ``stop`` is set (:data:`READ`)."""
        started = time.monotonic()
        with self._cond:
            while not self._fresh:
                left = started + (self.settings.resync_s if self._up else self.settings.poll_interval_s) \
                    - time.monotonic()
                if left <= 0 or stop.is_set():
                    return READ
                self._cond.wait(min(left, 0.25))  # stop is an Event: look at it four times a second
            self._fresh = False
            return self._obj

    def _event(self, obj: JSONDict | None, rv: str, *, carries: bool) -> None:
        with self._cond:
            self._rv = rv or self._rv
            self._up = True
            if carries:
                self._obj = obj
                self._fresh = True
                self.events += 1
            self._cond.notify_all()
        if carries and self.on_event is not None:
            self.on_event()

    def run(self, stop: threading.Event) -> None:
        """Watch until ``stop`` is set (checked at each event and each watch request's end)."""
        settings = self.settings
        selector = f"metadata.name={settings.clique_name}"
        while not stop.is_set():
            with self._cond:
                rv = self._rv
            try:
                for event in kube_cd.watch_cliques(self.client, settings.pod_namespace, "", rv,
                                                   settings.watch_timeout_s, field_selector=selector):
                    if stop.is_set():
                        return
                    kind = event.get("type")
                    obj = event.get("object") or {}
                    if kind == "ERROR":
                        raise kube_errors.KubeGoneError(f"WATCH computedomaincliques {selector}",
                                                        reason=str(obj.get("reason") or "Expired"),
                                                        message=str(obj.get("message") or ""))
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
                    self._event(None if kind == "DELETED" else obj, rv, carries=kind != "BOOKMARK")
                with self._cond:  # a watch request that ended cleanly: the watch works
                    self._up = True
            except kube_errors.KubeGoneError:
                with self._cond:
                    self._rv = ""
            except Exception as exc:  # an API failure, or anything else: the thread must not die with _up set
                if isinstance(exc, kube_errors.KubeAPIError):
                    log.warning("watch on clique %s/%s failed: %s; polling every %gs until it works again",
                                settings.pod_namespace, settings.clique_name, exc, settings.poll_interval_s)
                else:
                    log.error("watch on clique %s/%s failed unexpectedly; polling every %gs until it works again",
                              settings.pod_namespace, settings.clique_name, settings.poll_interval_s, exc_info=exc)
                with self._cond:
                    self._up = False
                    self._cond.notify_all()
                stop.wait(self.retry_s)


# -- run and check -----------------------------------------------------------------------------------------------


def render_configs(settings: DaemonSettings) -> None:
    """Write ``imexd.cfg`` (from ``imexd.cfg.tmpl``) and the static ``nodes.cfg`` into the domain directory.

    :raises DaemonError: the template is missing (the daemon claim was not prepared by a compute-domain plugin).
    """
    template_path = settings.imexd_dir / imex.CONFIG_TEMPLATE_FILE
    try:
        template = template_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DaemonError(f"{template_path} is missing: the daemon claim's Prepare puts it there") from None
    nodes_path = settings.imexd_dir / imex.NODES_FILE
    write_config_file(settings.config_path,
                      imex.render_imexd_config(template, pod_ip=settings.pod_ip, nodes_config=str(nodes_path)))
    write_config_file(nodes_path, imex.render_nodes_config(settings.cd_uid, settings.max_nodes))


class ImexReporter:
    """Makes what happens to this daemon's ``nvidia-imex`` visible (issue: the reason was only in the container's
    log): its callbacks from :class:`~dradriver.host.imexprocess.ImexProcess` write the process record (what the
    probe asks first, :func:`~dradriver.host.imexprocess.check_own_daemon`) and the readiness record (what the
    plugin's waiting workload prepare reports) at once, and, on a worker thread of their own (API requests never
    hold the watchdog up), the entry's condition (:class:`~dradriver.domain.computedomains.DaemonCondition`, which
    the controller copies into ``ComputeDomain.status.nodes[]``) and an Event about the ComputeDomain:
    ``Warning IMEXDaemonFailed`` at the first exit of a failure streak, when the cause changes and at the 2nd, 4th,
    8th ... exit; ``Normal IMEXDaemonRunning`` when it runs again.

    :param events: Events written so far.
    """

    def __init__(self, client: KubeClient, settings: DaemonSettings, membership: Membership,
                 clock: Callable[[], float] = time.time) -> None:
        self.client, self.settings, self.membership, self.clock = client, settings, membership, clock
        self.events = 0
        self._failure = ""
        self._cause = ""
        self._since = ""
        self._pid = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="imex-report")
        self._closed = False

    def write_process(self, pid: int, failure: str) -> None:
        """Write the process record now (a failure to write is logged)."""
        try:
            imexchannels.write_process_record(self.settings.imexd_dir, imex.ImexProcessRecord(
                self.settings.pod_uid, pid, failure, self.clock()))
        except imexchannels.ImexError as exc:
            log.warning("%s", exc)

    def started(self, pid: int) -> None:
        """A process started (``on_start``; the process's lock is held: local files only)."""
        self._pid = pid
        self.write_process(pid, self._failure)

    def exited(self, exited: ImexExit) -> None:
        """An unexpected exit (``on_exit``)."""
        reason = exited.reason()
        self._pid = 0
        self._failure = reason
        self.write_process(0, reason)
        record_readiness(self.settings, False, reason, self.clock)
        tell = exited.failures == 1 or exited.cause != self._cause or exited.failures & (exited.failures - 1) == 0
        self._cause = exited.cause
        if exited.failures == 1 or not self._since:
            self._since = _now_rfc3339()
        self._submit("False", cd.REASON_IMEX_FAILED, reason, "Warning" if tell else "")

    def recovered(self) -> None:
        """A process started after failures has run long enough (``on_recovered``)."""
        failure, self._failure, self._cause = self._failure, "", ""
        self._since = _now_rfc3339()
        self.write_process(self._pid, "")
        message = f"nvidia-imex runs again (pid {self._pid}); it had failed: {failure}"
        self._submit("True", cd.REASON_IMEX_RUNNING, message, "Normal")

    def _submit(self, status: str, reason: str, message: str, event_type: str) -> None:
        if self._closed:
            return
        try:
            self._pool.submit(self._publish, status, reason, message, event_type)
        except RuntimeError:  # closed meanwhile
            pass

    def _publish(self, status: str, reason: str, message: str, event_type: str) -> None:
        self.membership.report([cd.DaemonCondition(cd.IMEX_DAEMON_CONDITION, status, reason, message, self._since)])
        if not event_type:
            return
        about = events.ObjectRef(kind=cd.COMPUTE_DOMAIN_KIND, name=self.settings.cd_name,
                                 namespace=self.settings.cd_namespace, uid=self.settings.cd_uid,
                                 api_version=cd.API_GROUP_VERSION)
        try:
            events.create_event(self.client, about, reason=reason, type_=event_type,
                                message=f"IMEX daemon on node {self.settings.node_name}: {message}",
                                component="compute-domain-daemon", host=self.settings.node_name)
            self.events += 1
        except kube_errors.KubeAPIError as exc:
            log.warning("cannot record an Event about ComputeDomain %s/%s: %s", self.settings.cd_namespace,
                        self.settings.cd_name, exc)

    def close(self) -> None:
        """Finish the reports in flight; later ones are not sent (the local records still are)."""
        self._closed = True
        self._pool.shutdown(wait=True)


def _now_rfc3339() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_daemon(settings: DaemonSettings, client: KubeClient, stop: threading.Event) -> int:
    """Run until ``stop`` is set; returns the exit status (0 after a clean stop).

    ``nvidia-imex`` is started once; a change of the peers' addresses gets ``SIGUSR1``
    (:meth:`~dradriver.host.imexprocess.ImexProcess.reload`), a change of this daemon's own DNS name (its index:
    assigned after the start, or changed) a restart (nvidia-imex reads its own node identity at start only,
    :func:`~dradriver.domain.imex.own_name`). Its failures are reported by :class:`ImexReporter`.

    :raises DaemonError: bad settings (:meth:`DaemonSettings.validate`), missing template, no free index.
    :raises dradriver.kube.errors.KubeAPIError: labelling the own Pod failed.
    """
    settings.validate()
    pods.set_pod_label(client, settings.pod_namespace, settings.pod_name, cd.LABEL_CLIQUE_ID, settings.clique_id)
    if not settings.clique_id:
        log.info("node %s is in no NVLink clique: idle until terminated", settings.node_name)
        stop.wait()
        return 0
    render_configs(settings)
    try:  # held while this process lives: a ready record of ours counts only while it is held
        liveness: int | None = imexchannels.hold_daemon_lock(settings.imexd_dir)
    except imexchannels.ImexError as exc:
        log.warning("%s (the plugin on this node then asks the API whether this daemon is ready)", exc)
        liveness = None
    record_readiness(settings, False, "starting: nvidia-imex not started yet")
    env = dict(os.environ) if settings.imex_env is None else dict(settings.imex_env)
    env["DRADRIVER_HOSTS_FILE"] = str(settings.hosts_file)  # the stand-in's resolver; the real daemon's is libc's
    membership = Membership(client, settings)
    reporter = ImexReporter(client, settings, membership)
    reporter.write_process(0, "")  # a record an earlier pod left says nothing about this one's process
    names: dict[str, str | None] = {"hosts": None, "process": None}  # own DNS name: in the hosts file, at start

    def on_start(pid: int) -> None:
        names["process"] = names["hosts"]
        reporter.started(pid)

    process = ImexProcess([settings.imex_binary, "-c", str(settings.config_path)], env=env, on_start=on_start,
                          on_exit=reporter.exited, on_recovered=reporter.recovered,
                          watchdog_interval_s=settings.imex_watchdog_s, backoff_max_s=settings.imex_backoff_max_s,
                          stable_s=settings.imex_stable_s)
    watch = CliqueWatch(client, settings) if settings.watch else None
    observed: JSONDict | _Read | None = READ
    started = False
    try:
        while not stop.is_set():
            try:
                before = membership.mapping
                new, changed = membership.step(observed)
            except kube_errors.KubeAPIError as exc:
                log.warning("cannot read or apply the clique entry: %s", exc)
                observed = READ
                stop.wait(settings.poll_interval_s)
                continue
            if watch is not None and not started:  # from the first apply's answer on: no event is missed
                watch.start(membership.resource_version)
                threading.Thread(target=watch.run, args=(stop,), name="clique-watch", daemon=True).start()
            current = settings.hosts_file.read_text(encoding="utf-8") if settings.hosts_file.exists() else ""
            if write_hosts_file(settings.hosts_file, imex.render_hosts(current, new)):
                log.info("wrote %s: %d of %d IMEX peer names in use", settings.hosts_file,
                         sum(ip != cd.UNUSED_SLOT_IP for ip in new.values()), len(new))
            names["hosts"] = imex.own_name(new, settings.pod_ip)
            if not started:
                process.ensure_started()  # once; the watchdog restarts it after an unexpected exit
                started = True
            elif names["hosts"] != names["process"] and process.pid is not None:
                process.restart(f"this daemon's IMEX node name changed from {names['process']!r} to "
                                f"{names['hosts']!r} (its index); nvidia-imex reads it at start only")
            elif changed and before is not None:
                change = imex.membership_change(before, new)
                log.info("IMEX peers changed (added %s, removed %s, moved %s)", list(change.added),
                         list(change.removed), list(change.moved))
                process.reload()
            if watch is None:
                stop.wait(settings.poll_interval_s)
                observed = READ
            else:
                observed = watch.wait(stop)
    finally:
        reporter.close()  # no report after the withdrawal (it would apply the entry again)
        try:
            withdraw_entry(client, settings)
        except kube_errors.KubeAPIError as exc:
            log.warning("cannot withdraw the clique entry: %s", exc)
        record_readiness(settings, False, "stopped")
        process.stop()
        reporter.write_process(0, "stopped")
        if liveness is not None:
            os.close(liveness)
    return 0


def record_readiness(settings: DaemonSettings, ready: bool, detail: str = "",
                     clock: Callable[[], float] = time.time) -> None:
    """Write this daemon's readiness record into its domain directory (module docstring;
    :func:`~dradriver.host.imexchannels.record_readiness`); a record that cannot be written is logged, never fatal
    (the plugin then asks the API, whose answer is the pod's Ready condition)."""
    problem = imexchannels.record_readiness(settings.imexd_dir, node_name=settings.node_name, pod_uid=settings.pod_uid,
                                            pod_ip=settings.pod_ip, ready=ready, detail=detail, clock=clock)
    if problem:
        log.warning("%s", problem)


def check(settings: DaemonSettings, timeout_s: float = 10.0) -> tuple[bool, str]:
    """The probe: this pod's own ``nvidia-imex`` runs and ``nvidia-imex-ctl -c <imexd.cfg> -q`` prints exactly
    ``READY\\n`` (:func:`~dradriver.host.imexprocess.check_own_daemon`); no clique: success. The answer is also
    written as the readiness record (:func:`record_readiness`).

    :returns: (ok, what was printed or why it failed: while ``nvidia-imex`` is down, the whole cause).
    """
    if not settings.clique_id:
        return True, "no clique: nothing to check"
    ok, output = check_own_daemon(settings.imexd_dir, settings.imex_ctl_binary, settings.config_path,
                                  pod_uid=settings.pod_uid, timeout_s=timeout_s)
    record_readiness(settings, ok, output.strip())
    return ok, output
