"""The compute-domain plugin's device preparers: IMEX channels and IMEX daemons (``compute-domain.nvidia.com``).

Facts: NVIDIA's ``cmd/compute-domain-kubelet-plugin/`` ``deviceinfo.go`` (devices), ``device_state.go`` and
``computedomain.go`` (prepare/unprepare of channel and daemon claims), ``cdi.go`` (CDI);
``api/nvidia.com/resource/v1beta1/computedomainconfig.go`` (configs).

Channel claim (driver-managed IMEX): the claim's ``ComputeDomainChannelConfig`` names the ComputeDomain by UID
(``domainID``); it must exist and be in the claim's namespace (a permanent per-claim error otherwise). The node gets
the label ``resource.nvidia.com/computeDomain=<cdUID>`` (the domain's daemon DaemonSet selects nodes by it; a node
labelled for another domain refuses the claim: one domain per node). When the node is in an NVLink clique, the
prepare then waits for this node's entry in the ComputeDomainClique ``<cdUID>.<cliqueID>`` (driver namespace) to be
``Ready``: a not-ready daemon raises :class:`~dradriver.domain.ports.NotReadyYet` and the batch runner retries with
backoff inside the kubelet's deadline (the label stays meanwhile, so the daemon pod can be scheduled). This node's
daemon's readiness record in its domain directory (:class:`~dradriver.domain.imex.DaemonRecord`, written by every
probe of dradriver's daemon) is read before the API: a current record answers alone (a not-ready one makes a retry
read nothing else), and it is the waiting claim's ready hint, so the runner retries within
:data:`~dradriver.kubeletplugin.runner.HINT_POLL_S` of the probe that passed rather than at its pause's end. A daemon
that writes no record (NVIDIA's image) is read through the API only, as before. ``Single``
gives channel 0, ``All`` every channel of the node (count from ``/proc/driver/nvidia/params``): an ``All`` claim also
holds ``channel-1 .. channel-<n-1>`` in the claim state, and its CDI spec is rendered by the compiled generator
(``render_channel_spec``) as ONE CDI device ``<claimUID>-channel-0`` whose edits hold every channel's node, so
the kubelet gets one CDI ID (NVIDIA's form, NVIDIA's ``cmd/compute-domain-kubelet-plugin/cdi.go``). A node in no clique:
success, no device edits, no spec, no CDI IDs. Unprepare removes the label only when it still names this domain.

Binding conditions (``--binding-conditions``, KEP-5007): :meth:`ChannelPreparer.assess_binding` asks the same
readiness before the pod is bound (labelling the node driver-managed, so the daemon starts), for
:mod:`dradriver.kubeletplugin.bindingconditions` to set the channel's ``ComputeDomainReady`` or ``ComputeDomainFailed``
condition; the prepare of a claim bound that way finds its daemon ready and does not wait.

Host-managed IMEX (``--imex-mode hostManaged``): the allocated channel is given, no label, readiness is the host
daemon's ``nvidia-imex-ctl -q`` answer (on a node in a clique); daemon claims are refused.

Pre-warmed IMEX (``--imex-mode preWarmed``, dradriver's): channel isolation as below, no label, and readiness is
that of this node's clique daemon -- the long-lived daemon pod of the controller's DaemonSet for this node's clique,
whose IMEX domain ID is :func:`~dradriver.domain.computedomains.clique_domain_uid` of the clique -- read exactly as
a driver-managed domain's daemon is (:meth:`DomainLookup.daemon_readiness`: its readiness record, else its
ComputeDomainClique entry and pod). A daemon claim may name that clique domain instead of a ComputeDomain.

Channel isolation (``--imex-isolation channel``, host-managed only): the node publishes all its channels and the
controller gives each ComputeDomain its own channel ID (annotation ``resource.nvidia.com/imexChannel``, written into
the workload template's CEL selector). The prepare refuses, per claim, an allocated channel that is not the
domain's (a domain without an ID yet is retried as not ready), an ``All`` claim (it would hold every channel), and a
channel that a prepared claim of another domain holds on this node (read from the claim state, so it holds across
plugin restarts). The record keeps domain -> channel; the CDI spec gives the container that channel's node only.

Daemon claim: exactly one ``daemon`` device with a ``ComputeDomainDaemonConfig``; the domain directory
``<plugin dir>/domains/<cdUID>/`` with ``imexd.cfg.tmpl`` is made, and the edits give the daemon container the env
``CLIQUE_ID``, ``COMPUTE_DOMAIN_UUID``, ``COMPUTE_DOMAIN_NAME``, ``COMPUTE_DOMAIN_NAMESPACE``, the directory at
``/imexd`` (``rw,nosuid,nodev,bind``) and, in a clique, the ``fabric-imex-mgmt`` capability node. Its CDI IDs are the
base spec's ``k8s.compute-domain.nvidia.com/device=all`` and the claim device. The directory outlives the claim (it
is removed once the domain is gone, by the plugin's periodic cleanup), as NVIDIA's.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dradriver.domain import cdi, devicemetadata
from dradriver.domain.cdi import ContainerEdits, DeviceNode, DeviceNodeError, Mount
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef
from dradriver.domain.computedomains import (
    ALLOCATION_ALL,
    ANNOTATION_IMEX_CHANNEL,
    IMEX_DAEMON_CONDITION,
    LABEL_COMPUTE_DOMAIN,
    REASON_IMEX_FAILED,
    STATUS_READY,
    CliqueDaemon,
    ComputeDomainError,
    clique_domain_name,
    clique_domain_uid,
    clique_object_name,
    domain_channel,
    parse_channel_config,
    parse_daemon_config,
    ready_daemons,
)
from dradriver.domain.configs import ConfigGroup
from dradriver.domain.identity import DriverIdentity
from dradriver.domain.imex import DaemonRecord
from dradriver.domain.ports import DevicePlan, NotReadyYet, UndoRecord
from dradriver.host import imexchannels
from dradriver.host.imexchannels import ImexNodeInfo
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import nodes as kube_nodes
from dradriver.kube.client import KubeClient
from dradriver.kube.deployments import list_pods

log = logging.getLogger(__name__)

__all__ = [
    "CHANNEL_KIND",
    "DAEMON_KIND",
    "BindingVerdict",
    "ChannelPreparer",
    "DaemonPreparer",
    "DomainLookup",
    "ImexChannel",
    "ImexDaemon",
    "channel_devices",
]

CHANNEL_KIND = "imex-channel"
DAEMON_KIND = "imex-daemon"
CHANNEL_PREFIX = "channel-"
DAEMON_NAME = "daemon-0"
DAEMON_MOUNT = "/imexd"
DAEMON_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
CHANNEL_NODE_MODE = 0o666


@dataclass(frozen=True, slots=True)
class ImexChannel:
    """Device ``channel-<id>`` of the node (``type=channel``); only ``channel-0`` is published."""

    name: str
    id: int


@dataclass(frozen=True, slots=True)
class ImexDaemon:
    """Device ``daemon-0`` (``type=daemon``), published in driver-managed mode only."""

    name: str = DAEMON_NAME
    id: int = 0


def channel_devices(count: int, *, daemon: bool) -> dict[str, object]:
    """Every device of the node by name: ``channel-0 .. channel-<count-1>`` and (``daemon``) ``daemon-0``."""
    out: dict[str, object] = {f"{CHANNEL_PREFIX}{i}": ImexChannel(f"{CHANNEL_PREFIX}{i}", i) for i in range(count)}
    if daemon:
        out[DAEMON_NAME] = ImexDaemon()
    return out


@dataclass(frozen=True, slots=True)
class _Config:
    params: Mapping[str, Any]
    where: str


def _config_for(claim: Claim, result: AllocationResult, kind: str) -> _Config:
    """The opaque config that applies to ``result`` (the last matching entry: class configs come first, then the
    claim's, as the API lists them), decoded later by the caller.

    :raises ClaimError: no config of ours applies (``domainID`` is required).
    """
    request = result.request.split("/", 1)[0]
    chosen: _Config | None = None
    for pos, entry in enumerate(claim.configs):
        index = claim.config_indices[pos] if pos < len(claim.config_indices) else pos
        requests = entry.get("requests") or []
        if isinstance(requests, list) and requests and request not in requests and result.request not in requests:
            continue
        opaque = entry.get("opaque")
        params = opaque.get("parameters") if isinstance(opaque, Mapping) else None
        where = f"status.allocation.devices.config[{index}].opaque.parameters"
        if not isinstance(params, Mapping):
            raise ClaimError(claim.ref, f"{where}: not an object")
        chosen = _Config(params, where)
    if chosen is None:
        raise ClaimError(claim.ref, f"request {request!r} (device {result.device!r}): no {kind} in "
                                    "status.allocation.devices.config (its domainID names the ComputeDomain)")
    return chosen


@dataclass(frozen=True, slots=True)
class DaemonReadiness:
    """What :meth:`DomainLookup.daemon_readiness` found.

    :ivar clique: the ComputeDomainClique object's name (``<cdUID>.<cliqueID>``).
    :ivar entry: this node's entry in it, or ``None``.
    :ivar ready: the daemon is ready for a workload.
    :ivar seen: why not (``""`` when ready), for the claim's error.
    :ivar local: the answer is this node's daemon's readiness record (no API read; ``entry`` is then ``None``).
    """

    clique: str
    entry: CliqueDaemon | None
    ready: bool
    seen: str = ""
    local: bool = False


class DomainLookup:
    """ComputeDomains and cliques through the API, and this node's daemons' readiness records, for both preparers.

    :param client: the plugin's API client.
    :param node_name: this node.
    :param namespace: the driver namespace (where ComputeDomainCliques live).
    :param plugin_dir: ``<kubelet plugins dir>/compute-domain.nvidia.com`` (the domain directories, where this
        node's daemons write their readiness records); ``None``: the API only.
    :param clock: Unix seconds (the records' ``writtenAt`` is the node's clock).
    """

    def __init__(self, client: KubeClient, node_name: str, namespace: str, *, plugin_dir: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.node_name = node_name
        self.namespace = namespace
        self.plugin_dir = plugin_dir
        self.clock = clock

    def local_record(self, cd_uid: str) -> DaemonRecord | None:
        """This node's daemon's readiness record for the domain ``cd_uid`` when it speaks for the daemon now
        (:class:`~dradriver.domain.imex.DaemonRecord`: this node's, written within
        :data:`~dradriver.domain.imex.READINESS_MAX_AGE_S`); ``None``: no plugin directory, no record (a daemon
        not started yet, or one that writes none, such as NVIDIA's image), a stale one, or a ``ready`` one whose
        daemon no longer holds its liveness lock (:func:`~dradriver.host.imexchannels.daemon_alive`)."""
        if self.plugin_dir is None:
            return None
        try:
            directory = imexchannels.domain_dir(self.plugin_dir, cd_uid)
        except imexchannels.ImexError:
            return None
        record = imexchannels.read_readiness(directory)
        if record is None or record.node_name != self.node_name or not record.current(self.clock()):
            return None
        if record.ready and not imexchannels.daemon_alive(directory):
            return None  # its daemon was killed after its last probe: the API decides
        return record

    def domain(self, ref: ClaimRef, uid: str, where: str) -> Mapping[str, Any]:
        """The ComputeDomain whose UID is ``uid``.

        :raises ClaimError: none has it (names ``<where>.domainID``).
        :raises dradriver.kube.errors.KubeAPIError: the API failed.
        """
        obj = kube_cd.find_compute_domain(self.client, uid)
        if obj is None:
            raise ClaimError(ref, f"{where}.domainID: no ComputeDomain has UID {uid!r}")
        return obj

    def node_label(self) -> str | None:
        """This node's ``resource.nvidia.com/computeDomain`` label (``None``: not set)."""
        return kube_nodes.get_node(self.client, self.node_name).labels.get(LABEL_COMPUTE_DOMAIN)

    def daemon_readiness(self, cd_uid: str, clique_id: str) -> DaemonReadiness:
        """Whether this node's IMEX daemon of the domain ``cd_uid`` is ready for a workload: its clique entry is a
        member (has its ``ipAddress`` and index) and its ``status`` is ``Ready``, or, while that status (the
        controller's copy of the daemon pod's Ready condition) still lags, the daemon pod with the entry's IP on
        this node is Ready itself (:func:`~dradriver.domain.computedomains.ready_daemons`, the rule the controller
        copies). Reading the source spares a joining node one controller round trip (issue 14); the pod is read
        only when the entry is a member and not yet ``Ready``.

        This node's daemon's readiness record (:meth:`local_record`) is read first and, when current, is the
        answer: the probe that turns the pod Ready writes it, so a ready record spares the reads of the clique
        and the pod, and a not-ready one spares a waiting claim any API read at all. Without a current record
        the API decides as above.

        :raises dradriver.kube.errors.KubeAPIError: the API failed.
        """
        record = self.local_record(cd_uid)
        name = clique_object_name(cd_uid, clique_id)
        if record is not None:
            if record.ready:
                return DaemonReadiness(name, None, True, local=True)
            return DaemonReadiness(name, None, False, f"its daemon pod's probe says not ready "
                                                      f"({record.detail or 'no detail'}; readiness record written "
                                                      f"{max(0.0, record.age_s(self.clock())):.1f} s ago)",
                                   local=True)
        name, entry = self.daemon_entry(cd_uid, clique_id)
        if entry is None:
            return DaemonReadiness(name, None, False, "no entry for this node")
        if not entry.member:
            return DaemonReadiness(name, entry, False,
                                   "the entry has no ipAddress (its daemon withdrew or its node was cleared)")
        if entry.status == STATUS_READY:
            return DaemonReadiness(name, entry, True)
        pods = list_pods(self.client, self.namespace, f"{LABEL_COMPUTE_DOMAIN}={cd_uid}",
                         field_selector=f"spec.nodeName={self.node_name}")
        if (self.node_name, entry.ip_address) in ready_daemons(pods):
            return DaemonReadiness(name, entry, True)
        failed = [c for c in entry.conditions if c.type == IMEX_DAEMON_CONDITION and c.status == "False"]
        why = f"; {failed[0].reason}: {failed[0].message}" if failed else ""  # the daemon's own report, whole
        return DaemonReadiness(name, entry, False, f"status {entry.status or 'not set yet'}, and its daemon pod "
                                                   f"({entry.ip_address}) is not Ready{why}")

    def daemon_entry(self, cd_uid: str, clique_id: str) -> tuple[str, CliqueDaemon | None]:
        """(clique object name, this node's daemon entry or ``None``)."""
        name = clique_object_name(cd_uid, clique_id)
        obj = kube_cd.get_clique(self.client, self.namespace, name)
        if obj is None:
            return name, None
        for raw in obj.get("daemons") or ():
            entry = CliqueDaemon.from_entry(raw)
            if entry.node_name == self.node_name:
                return name, entry
        return name, None


@dataclass(frozen=True, slots=True)
class BindingVerdict:
    """Whether an allocated channel's ComputeDomain is ready on this node (:meth:`ChannelPreparer.assess_binding`),
    for its KEP-5007 binding conditions.

    :ivar state: ``ready`` (set the binding condition), ``waiting`` (not yet; look again), ``failed`` (set the
        failure condition: it cannot become ready here).
    :ivar reason: UpperCamelCase condition reason (``DomainReady``, ``IMEXDaemonFailed``, ...).
    :ivar message: why, naming the claim, the domain and the node.
    """

    state: str
    reason: str
    message: str


def _meta(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def domain_metadata(ref: ClaimRef, plan: DevicePlan, record: UndoRecord | None) -> dict[str, Any]:
    """The ComputeDomain of a channel or daemon (KEP-5304 device metadata, ``DeviceMetadata`` gate; the runner's
    optional ``metadata_attributes`` part), from its undo record."""
    return devicemetadata.compute_domain_attributes(record.data if record is not None else None)


class ChannelPreparer:
    """IMEX channel claims (see the module docstring). Implements
    :class:`~dradriver.domain.ports.DevicePreparer` and the runner's optional parts
    (:class:`~dradriver.domain.ports.ClaimSpecPreparer`).

    :param lookup: API access.
    :param identity: the plugin's names (CDI kind).
    :param imex: the node's IMEX facts (channel major and count).
    :param clique_id: this node's clique ID now (``""``: in no clique).
    :param host_managed: ``--imex-mode hostManaged``.
    :param pre_warmed: ``--imex-mode preWarmed``: the node's clique daemon serves every domain (needs
        ``held_channels``).
    :param imex_ctl: host-managed readiness: returns ``(ready, output)`` (``nvidia-imex-ctl -q``).
    :param held_channels: channel isolation (host-managed): the channel records of the node's other prepared claims
        as ``(claim UID, record)`` for a claim UID to leave out (the runner's ``stored_records``, read while
        planning); ``None``: domain isolation.
    """

    kind = CHANNEL_KIND
    side_effects = True
    apply_takes_deadline = True

    def __init__(self, lookup: DomainLookup, identity: DriverIdentity, imex: ImexNodeInfo,
                 clique_id: Callable[[], str], *, host_managed: bool = False, pre_warmed: bool = False,
                 imex_ctl: Callable[[], tuple[bool, str]] | None = None,
                 held_channels: Callable[[str], Sequence[tuple[str, UndoRecord]]] | None = None) -> None:
        if held_channels is not None and not (host_managed or pre_warmed):
            raise ValueError("channel isolation needs host-managed or pre-warmed IMEX")
        if pre_warmed and held_channels is None:
            raise ValueError("pre-warmed IMEX isolates domains by channel: held_channels is required")
        self.pre_warmed = pre_warmed
        self.lookup = lookup
        self.identity = identity
        self.imex = imex
        self.clique_id = clique_id
        self.host_managed = host_managed
        self.imex_ctl = imex_ctl
        self.held_channels = held_channels
        self._pending: dict[str, str] = {}
        """Claim UID -> CD UID of claims whose last attempt labelled the node and is waiting for the daemon: the
        label stays for the next attempt, and goes when the claim is unprepared before it ever completed (kept in
        memory only: after a restart the controller's stale-label sweep removes such a label)."""
        self._pending_lock = threading.Lock()

    def handles(self, device: object) -> bool:
        return isinstance(device, ImexChannel)

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        assert isinstance(device, ImexChannel)
        config = _config_for(claim, results[0], "ComputeDomainChannelConfig")
        try:
            parsed = parse_channel_config(config.params, config.where)
        except ComputeDomainError as exc:
            raise ClaimError(claim.ref, str(exc)) from None
        if self.held_channels is not None and parsed.allocation_mode == ALLOCATION_ALL:
            raise ClaimError(claim.ref, f"{config.where}.allocationMode: 'All' would give every IMEX channel of the "
                                        "node, which --imex-isolation channel forbids (use 'Single')")
        if self.host_managed or self.pre_warmed:
            first = device.id  # the allocated channel
        else:
            first = 0  # NVIDIA: a driver-managed channel claim is always channel 0
        count = self.imex.channel_count
        if parsed.allocation_mode == ALLOCATION_ALL:
            channels = [first, *(i for i in range(count) if i != first)]
        else:
            channels = [first]
        if device.id != first:
            raise ClaimError(claim.ref, f"device {device.name!r}: driver-managed IMEX gives channel 0 only "
                                        f"(allocate {CHANNEL_PREFIX}0)")
        clique = self.clique_id()
        details = {"domain": parsed.domain_id, "mode": parsed.allocation_mode, "where": config.where,
                   "channels": channels, "clique": clique}
        if self.held_channels is not None:
            # read here, in the planning phase (the claim state's lock is held by the planning thread; the apply
            # runs on worker threads while it is held)
            details["held"] = [(uid, dict(record.data or {})) for uid, record in self.held_channels(claim.ref.uid)]
        return DevicePlan(self.kind, device.name, device, tuple(sorted({r.request.split("/", 1)[0] for r in results})),
                          all(r.admin_access for r in results), tuple(results), group, details)

    # -- runner's optional parts ---------------------------------------------------------------------------------
    def holds(self, plan: DevicePlan) -> list[str]:
        """The further channels an ``All`` claim holds (recorded in the claim state, not answered)."""
        return [f"{CHANNEL_PREFIX}{i}" for i in plan.details["channels"][1:]]

    def cdi_device_ids(self, ref: ClaimRef, plan: DevicePlan) -> tuple[str, ...]:
        """The claim device ``<claimUID>-<allocated device>`` (one ID, also for an ``All`` claim: its device holds
        every channel's node, as NVIDIA's, 5.2); none at all on a node in no clique (nothing is injected)."""
        if not plan.details["clique"]:
            return ()
        return (self.identity.cdi.device_id(ref.uid, plan.device),)

    def render_spec(self, ref: ClaimRef, plans: Sequence[DevicePlan], records: Sequence[UndoRecord],
                    spec_edits: ContainerEdits) -> bytes:
        """The claim's spec through the compiled channel-spec generator: one device ``<claimUID>-<allocated
        device>`` with the node of every channel the claim holds (1, or all of the node's for ``All``); ``b""`` (no
        spec) in no clique.

        :raises DeviceNodeError: the channel major is unknown (no ``nvidia-caps-imex-channels`` line).
        """
        record = next((r for r in records if r.kind == self.kind), None)
        data = record.data if record is not None else plans[0].details
        device = record.target if record is not None else plans[0].device
        if not data.get("clique"):
            return b""
        channels = [int(c) for c in data["channels"]]
        major = self._major()
        try:
            return cdi.render_imex_channel_spec(major, channels, kind=self.identity.cdi.kind,
                                                device_name=f"{ref.uid}-{device}", common=spec_edits)
        except cdi.CdiSpecError as exc:
            raise ClaimError(ref, str(exc)) from exc

    def _major(self) -> int:
        if self.imex.channel_major is None:
            raise DeviceNodeError(f"no '{imexchannels.CHANNEL_DEVICE_NAME}' line in /proc/devices: the IMEX channel "
                                  "devices' major is unknown (is the NVIDIA driver's IMEX support loaded?)")
        return self.imex.channel_major

    # -- protocol -----------------------------------------------------------------------------------------------
    def _record_ready(self, cd_uid: str) -> bool:
        """The ready hint of a waiting claim: this node's daemon's readiness record says ready."""
        record = self.lookup.local_record(cd_uid)
        return record is not None and record.ready

    def apply(self, claim: ClaimRef, plan: DevicePlan, *, deadline: float | None = None) -> UndoRecord:
        uid = str(plan.details["domain"])
        where = str(plan.details["where"])
        clique = str(plan.details["clique"])
        hint = functools.partial(self._record_ready, uid)
        with self._pending_lock:
            waiting = self._pending.get(claim.uid) == uid
        if waiting and clique and not self.host_managed:
            # A retry of a claim that already found its domain and labelled the node: while this node's daemon
            # says it is not ready, the answer is the same without reading the domain, the node or the clique.
            record = self.lookup.local_record(uid)
            if record is not None and not record.ready:
                raise NotReadyYet(claim, f"the IMEX daemon of ComputeDomain UID {uid} on node "
                                         f"{self.lookup.node_name} is not Ready yet (its readiness record, written "
                                         f"{max(0.0, record.age_s(self.lookup.clock())):.1f} s ago: "
                                         f"{record.detail or 'not ready'})", ready_hint=hint)
        obj = self.lookup.domain(claim, uid, where)
        namespace, name = _meta(obj)
        if namespace != claim.namespace:
            raise ClaimError(claim, f"{where}.domainID: ComputeDomain {namespace}/{name} (UID {uid}) is not in the "
                                    f"claim's namespace {claim.namespace!r}")
        data: dict[str, Any] = {"domain": uid, "namespace": namespace, "name": name, "mode": plan.details["mode"],
                                "channels": list(plan.details["channels"]), "clique": clique, "label": False}
        if self.host_managed:
            if self.held_channels is not None:
                data["channel"] = self._check_isolated(claim, plan, obj)
            if clique and self.imex_ctl is not None:
                ready, output = self.imex_ctl()
                if not ready:
                    raise NotReadyYet(claim, f"the host's IMEX daemon is not ready (nvidia-imex-ctl -q: {output})")
            return UndoRecord(self.kind, 1, plan.device, data)
        if self.pre_warmed:
            data["channel"] = self._check_isolated(claim, plan, obj)
            if clique:
                self._clique_daemon_ready(claim, clique, namespace, name)
            return UndoRecord(self.kind, 1, plan.device, data)
        current = self.lookup.node_label()
        if current is not None and current != uid:
            raise ClaimError(claim, f"node {self.lookup.node_name} is labelled {LABEL_COMPUTE_DOMAIN}={current}: it "
                                    f"serves another ComputeDomain, and a node serves one ComputeDomain at a time "
                                    f"(ComputeDomain {namespace}/{name}, UID {uid}, must wait until that one's "
                                    "workload leaves the node)")
        if current is None:
            kube_cd.set_node_label(self.lookup.client, self.lookup.node_name, LABEL_COMPUTE_DOMAIN, uid)
            log.info("node %s labelled %s=%s for claim %s", self.lookup.node_name, LABEL_COMPUTE_DOMAIN, uid, claim)
        data["label"] = True
        if clique:
            found = self.lookup.daemon_readiness(uid, clique)
            if not found.ready:
                with self._pending_lock:
                    self._pending[claim.uid] = uid
                raise NotReadyYet(claim, f"the IMEX daemon of ComputeDomain {namespace}/{name} on node "
                                         f"{self.lookup.node_name} is not Ready yet (ComputeDomainClique "
                                         f"{self.lookup.namespace}/{found.clique}: {found.seen})",
                                  ready_hint=hint)
        with self._pending_lock:
            self._pending.pop(claim.uid, None)
        return UndoRecord(self.kind, 1, plan.device, data)

    def assess_binding(self, claim: Claim, device: str) -> BindingVerdict:
        """Whether the ComputeDomain of ``claim``'s channel ``device`` (allocated on this node, not bound yet) is
        ready here, so its binding condition can be set (``--binding-conditions``, KEP-5007): what the prepare would
        wait for, asked before the pod is bound. Driver-managed, the node is labelled for the domain first (as the
        prepare labels it), so the domain's DaemonSet puts its IMEX daemon here; the label is kept for the prepare
        and removed by :meth:`abandon_binding` if the claim is given up. Ready: this node's daemon is
        (:meth:`DomainLookup.daemon_readiness`), or the host's (host-managed: ``nvidia-imex-ctl -q``), or the node
        is in no clique. Failed: the config or the domain is wrong (the prepare would refuse the claim), the node
        serves another domain, or this node's daemon reports ``IMEXDaemonRunning=False`` with reason
        ``IMEXDaemonFailed`` (its ``nvidia-imex`` keeps exiting). Channel isolation's checks stay in the prepare.

        :raises dradriver.kube.errors.KubeAPIError: the API failed (ask again later).
        """
        result = next((r for r in claim.results if r.device == device), None)
        if result is None:
            return BindingVerdict("failed", "NotAllocated", f"claim {claim.ref}: device {device!r} is not allocated "
                                                            f"to node {self.lookup.node_name}")
        try:
            config = _config_for(claim, result, "ComputeDomainChannelConfig")
            parsed = parse_channel_config(config.params, config.where)
            obj = self.lookup.domain(claim.ref, parsed.domain_id, config.where)
        except (ClaimError, ComputeDomainError) as exc:
            return BindingVerdict("failed", "InvalidChannelClaim", str(exc))
        namespace, name = _meta(obj)
        uid = parsed.domain_id
        if namespace != claim.ref.namespace:
            return BindingVerdict("failed", "InvalidChannelClaim",
                                  f"claim {claim.ref}: {config.where}.domainID: ComputeDomain {namespace}/{name} "
                                  f"(UID {uid}) is not in the claim's namespace")
        where = f"ComputeDomain {namespace}/{name} on node {self.lookup.node_name}"
        clique = self.clique_id()
        if self.host_managed:
            if clique and self.imex_ctl is not None:
                ready, output = self.imex_ctl()
                if not ready:
                    return BindingVerdict("waiting", "IMEXDaemonNotReady", f"{where}: the host's IMEX daemon is not "
                                                                           f"ready (nvidia-imex-ctl -q: {output})")
            return BindingVerdict("ready", "DomainReady", f"{where}: the host's IMEX daemon is ready")
        if self.pre_warmed:  # the clique's daemon serves every domain: no node label, nothing to start
            if not clique:
                return BindingVerdict("ready", "DomainReady", f"{where}: the node is in no NVLink clique (no IMEX "
                                                              "daemon to wait for)")
            found = self.lookup.daemon_readiness(clique_domain_uid(clique), clique)
            if found.ready:
                return BindingVerdict("ready", "DomainReady", f"{where}: the pre-warmed IMEX daemon of clique {clique} "
                                                              "is Ready")
            return BindingVerdict("waiting", "IMEXDaemonNotReady",
                                  f"{where}: the pre-warmed IMEX daemon of clique {clique} is not Ready yet "
                                  f"(ComputeDomainClique {self.lookup.namespace}/{found.clique}: {found.seen})")
        current = self.lookup.node_label()
        if current is not None and current != uid:
            return BindingVerdict("failed", "NodeServesAnotherDomain",
                                  f"{where}: the node is labelled {LABEL_COMPUTE_DOMAIN}={current} and serves that "
                                  "ComputeDomain (one ComputeDomain per node at a time)")
        if current is None:
            kube_cd.set_node_label(self.lookup.client, self.lookup.node_name, LABEL_COMPUTE_DOMAIN, uid)
            log.info("node %s labelled %s=%s for claim %s (binding conditions)", self.lookup.node_name,
                     LABEL_COMPUTE_DOMAIN, uid, claim.ref)
        with self._pending_lock:
            self._pending[claim.ref.uid] = uid
        if not clique:
            return BindingVerdict("ready", "DomainReady", f"{where}: the node is in no NVLink clique (no IMEX daemon "
                                                          "to wait for)")
        found = self.lookup.daemon_readiness(uid, clique)
        if found.ready:
            return BindingVerdict("ready", "DomainReady", f"{where}: its IMEX daemon is Ready")
        _, entry = self.lookup.daemon_entry(uid, clique)
        failed = [c for c in (entry.conditions if entry is not None else ())
                  if c.type == IMEX_DAEMON_CONDITION and c.status == "False" and c.reason == REASON_IMEX_FAILED]
        if failed:
            return BindingVerdict("failed", REASON_IMEX_FAILED, f"{where}: its IMEX daemon failed: {failed[0].message}")
        return BindingVerdict("waiting", "IMEXDaemonNotReady",
                              f"{where}: its IMEX daemon is not Ready yet (ComputeDomainClique "
                              f"{self.lookup.namespace}/{found.clique}: {found.seen})")

    def abandon_binding(self, ref: ClaimRef) -> None:
        """A claim :meth:`assess_binding` labelled the node for was deallocated or deleted before it was prepared
        here (its binding failed or timed out): remove the label as for a claim unprepared before it ever was
        (:meth:`unprepared_unknown`)."""
        self.unprepared_unknown(ref)

    def _clique_daemon_ready(self, claim: ClaimRef, clique: str, namespace: str, name: str) -> None:
        """Pre-warmed mode: return when this node's clique daemon is ready (the same rule as a driver-managed
        domain's daemon, for the clique's IMEX domain).

        :raises NotReadyYet: it is not (names the clique, its ComputeDomainClique and what was seen; the
            daemon's readiness record is the ready hint).
        """
        clique_uid = clique_domain_uid(clique)
        found = self.lookup.daemon_readiness(clique_uid, clique)
        if not found.ready:
            raise NotReadyYet(claim, f"the pre-warmed IMEX daemon of clique {clique} on node {self.lookup.node_name} "
                                     f"is not Ready (ComputeDomain {namespace}/{name}; ComputeDomainClique "
                                     f"{self.lookup.namespace}/{found.clique}: {found.seen})",
                              ready_hint=functools.partial(self._record_ready, clique_uid))

    def _check_isolated(self, claim: ClaimRef, plan: DevicePlan, obj: Mapping[str, Any]) -> int:
        """Channel isolation: the allocated channel must be the domain's and no other domain's prepared claim on
        this node may hold it; returns the channel.

        :raises NotReadyYet: the domain has no channel yet (the controller writes it before the template).
        :raises ClaimError: another channel, or one another domain holds (names the claim, the field, the holder).
        """
        assert self.held_channels is not None
        namespace, name = _meta(obj)
        uid = str(plan.details["domain"])
        try:
            want = domain_channel(obj)
        except ComputeDomainError as exc:
            raise ClaimError(claim, str(exc)) from exc
        if want is None:
            raise NotReadyYet(claim, f"ComputeDomain {namespace}/{name} has no IMEX channel yet (annotation "
                                     f"{ANNOTATION_IMEX_CHANNEL}, written by the controller)")
        got = plan.entry.id if isinstance(plan.entry, ImexChannel) else -1
        if got != want:
            raise ClaimError(claim, f"status.allocation.devices.results: device {plan.device!r} is not the IMEX "
                                    f"channel of ComputeDomain {namespace}/{name} ({CHANNEL_PREFIX}{want}, annotation "
                                    f"{ANNOTATION_IMEX_CHANNEL}); --imex-isolation channel gives a domain's pods "
                                    "its own channel only")
        for other_uid, data in plan.details.get("held") or ():
            if str(data.get("domain") or "") != uid and want in {int(c) for c in data.get("channels") or ()}:
                raise ClaimError(claim, f"status.allocation.devices.results: device {plan.device!r} (IMEX channel "
                                        f"{want}) is held on node {self.lookup.node_name} by prepared claim "
                                        f"{other_uid} of ComputeDomain {data.get('namespace')}/{data.get('name')}; "
                                        f"one channel serves one domain")
        return want

    metadata_attributes = staticmethod(domain_metadata)

    def unprepared_unknown(self, ref: ClaimRef) -> None:
        """A claim that never completed was unprepared: remove the label its waiting attempts kept (only when it
        still names that claim's domain)."""
        with self._pending_lock:
            uid = self._pending.pop(ref.uid, None)
        if uid is not None and kube_cd.set_node_label(self.lookup.client, self.lookup.node_name, LABEL_COMPUTE_DOMAIN,
                                                      None, only_if=uid):
            log.info("node %s: label %s=%s removed (claim %s unprepared before it was ever prepared)",
                     self.lookup.node_name, LABEL_COMPUTE_DOMAIN, uid, ref)

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        data = record.data or plan.details
        if not data.get("clique"):
            return ContainerEdits()
        major = self._major()
        return ContainerEdits(device_nodes=tuple(
            DeviceNode(f"{cdi_channel_dir()}{int(i)}", "", "c", major, int(i), CHANNEL_NODE_MODE)
            for i in data["channels"]))

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Remove the node label when this claim set or kept it and it still names this claim's domain."""
        if not record.data.get("label"):
            return
        uid = str(record.data.get("domain") or "")
        if kube_cd.set_node_label(self.lookup.client, self.lookup.node_name, LABEL_COMPUTE_DOMAIN, None, only_if=uid):
            log.info("node %s: label %s=%s removed (claim %s unprepared)", self.lookup.node_name,
                     LABEL_COMPUTE_DOMAIN, uid, claim)

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        """Nothing to sweep: a label no record knows may belong to a prepare the kubelet is still retrying (it is
        removed by the unprepare of the domain's channel claim or by the controller once the domain is gone)."""
        return []


def cdi_channel_dir() -> str:
    """``/dev/nvidia-caps-imex-channels/channel`` (the compiled generator's constant)."""
    from dradriver import _native

    return str(_native.load("cdispec").IMEX_CHANNEL_DIR)


class DaemonPreparer:
    """IMEX daemon claims (see the module docstring).

    :param lookup: API access.
    :param identity: the plugin's names (CDI kind; the base spec's kind is ``<vendor>/device``).
    :param imex: the node's IMEX facts (``fabric-imex-mgmt`` minor, ``nvidia-caps`` major).
    :param clique_id: this node's clique ID now.
    :param plugin_dir: ``<kubelet plugins dir>/compute-domain.nvidia.com`` (host path, also the daemon's mount).
    :param clique_domains: pre-warmed mode: a claim may name this node's clique's IMEX domain
        (:func:`~dradriver.domain.computedomains.clique_domain_uid`) instead of a ComputeDomain.
    """

    kind = DAEMON_KIND
    side_effects = True

    def __init__(self, lookup: DomainLookup, identity: DriverIdentity, imex: ImexNodeInfo,
                 clique_id: Callable[[], str], plugin_dir: Path, *, clique_domains: bool = False) -> None:
        self.clique_domains = clique_domains
        self.lookup = lookup
        self.identity = identity
        self.imex = imex
        self.clique_id = clique_id
        self.plugin_dir = plugin_dir

    @property
    def base_device_id(self) -> str:
        """``k8s.compute-domain.nvidia.com/device=all``: the base spec's device."""
        return f"{self.identity.cdi.vendor}/device=all"

    def handles(self, device: object) -> bool:
        return isinstance(device, ImexDaemon)

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        assert isinstance(device, ImexDaemon)
        daemons = {r.device for r in claim.results if r.device.startswith("daemon-")}
        if len(daemons) != 1:
            raise ClaimError(claim.ref, f"status.allocation.devices.results: a daemon claim has exactly one daemon "
                                        f"device, not {len(daemons)}")
        config = _config_for(claim, results[0], "ComputeDomainDaemonConfig")
        try:
            parsed = parse_daemon_config(config.params, config.where)
        except ComputeDomainError as exc:
            raise ClaimError(claim.ref, str(exc)) from None
        details = {"domain": parsed.domain_id, "where": config.where}
        return DevicePlan(self.kind, device.name, device, tuple(sorted({r.request.split("/", 1)[0] for r in results})),
                          all(r.admin_access for r in results), tuple(results), group, details)

    def cdi_device_ids(self, ref: ClaimRef, plan: DevicePlan) -> tuple[str, ...]:
        return (self.base_device_id, self.identity.cdi.device_id(ref.uid, plan.device))

    metadata_attributes = staticmethod(domain_metadata)

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        uid = str(plan.details["domain"])
        clique = self.clique_id()
        if self.clique_domains and clique and uid == clique_domain_uid(clique):
            namespace, name = self.lookup.namespace, clique_domain_name(clique)
        else:
            namespace, name = _meta(self.lookup.domain(claim, uid, str(plan.details["where"])))
        if clique:
            self._cap_node()  # a missing capability fails before anything is written
        try:
            path, created = imexchannels.ensure_domain_dir(self.plugin_dir, uid)
        except imexchannels.ImexError as exc:
            raise ClaimError(claim, str(exc)) from exc
        if created:
            log.info("claim %s: IMEX domain directory %s created", claim, path)
        return UndoRecord(self.kind, 1, plan.device, {"domain": uid, "namespace": namespace, "name": name,
                                                      "clique": clique, "dir": str(path)})

    def _cap_node(self) -> DeviceNode:
        minor, major = self.imex.fabric_imex_mgmt_minor, self.imex.caps_major
        if minor is None:
            raise DeviceNodeError("no /proc/driver/nvidia/capabilities/fabric-imex-mgmt: the fabric-imex-mgmt "
                                  "capability's minor is unknown")
        if major is None:
            raise DeviceNodeError(f"no '{imexchannels.CAPS_DEVICE_NAME}' line in /proc/devices")
        return DeviceNode(self.imex.fabric_imex_mgmt_path, "", "c", major, minor)

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        data = record.data
        env = (f"CLIQUE_ID={data.get('clique', '')}", f"COMPUTE_DOMAIN_UUID={data.get('domain', '')}",
               f"COMPUTE_DOMAIN_NAME={data.get('name', '')}", f"COMPUTE_DOMAIN_NAMESPACE={data.get('namespace', '')}")
        mounts = (Mount(str(data.get("dir", "")), DAEMON_MOUNT, DAEMON_MOUNT_OPTIONS),)
        nodes = (self._cap_node(),) if data.get("clique") else ()
        return ContainerEdits(env=env, device_nodes=nodes, mounts=mounts)

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        """Nothing: the domain directory stays until its ComputeDomain is gone (as NVIDIA's)."""

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        return []
