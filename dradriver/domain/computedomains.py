"""ComputeDomains: the names, objects and rules NVIDIA's ComputeDomain contract fixes, free of I/O.

One place for what the compute-domain kubelet plugin, the IMEX daemon wrapper and the controller share:
the custom resources (``resource.nvidia.com/v1beta1`` ``ComputeDomain`` and ``ComputeDomainClique``), their labels,
finalizer and derived object names, the opaque device configs, the clique ID format, the per-domain DNS names
of IMEX peers and the membership index rule.

Facts, from kubernetes-sigs/dra-driver-nvidia-gpu: ``cmd/compute-domain-kubelet-plugin/deviceinfo.go``
(devices), ``api/nvidia.com/resource/v1beta1/computedomainconfig.go`` (configs), ``computedomain.go`` (CRDs),
``cmd/compute-domain-kubelet-plugin/nvlib.go`` (clique ID, IMEX channels), ``cmd/compute-domain-controller/``
(object names), ``cmd/compute-domain-daemon/`` (DNS names per domain after #1448, sentinel ``127.0.0.2`` for unused
slots after #1465, index swaps #1418/#1440); ``nvmlGpuFabricInfo_t`` in ``nvml.h`` (fabric info).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dradriver.domain.faults import DeviceTaint, Effect, FaultKind
from dradriver.domain.identity import DriverIdentity
from dradriver.domain.resourceslices import MAX_DEVICES_PER_SLICE
from dradriver.errors import DradriverError

__all__ = [
    "ALLOCATION_ALL",
    "ALLOCATION_SINGLE",
    "API_GROUP",
    "API_GROUP_VERSION",
    "API_VERSION",
    "BINDING_CONDITION",
    "BINDING_FAILURE_CONDITION",
    "CHANNEL_DEVICE_CLASS",
    "CLIQUE_DAEMON_CONDITION",
    "CLIQUE_DOMAIN_NAMESPACE",
    "CLIQUE_KIND",
    "CLIQUE_PLURAL",
    "COMPUTE_DOMAIN_KIND",
    "COMPUTE_DOMAIN_PLURAL",
    "DAEMON_DEVICE_CLASS",
    "DAEMON_SERVICE_ACCOUNT",
    "DEFAULT_IMEX_CHANNEL_COUNT",
    "DEFAULT_MAX_NODES_PER_IMEX_DOMAIN",
    "DNS_NAME_PREFIX",
    "FINALIZER",
    "IMEX_DAEMON_CONDITION",
    "LABEL_CLIQUE_ID",
    "LABEL_COMPUTE_DOMAIN",
    "LABEL_TARGET",
    "NODE_CLIQUE_LABEL",
    "REASON_CLIQUE_DAEMON_NOT_READY",
    "REASON_CLIQUE_DAEMON_READY",
    "REASON_IMEX_FAILED",
    "REASON_IMEX_RUNNING",
    "REASON_NODE_LOST",
    "STATUS_NOT_READY",
    "STATUS_READY",
    "UNUSED_SLOT_IP",
    "ChannelConfig",
    "CliqueDaemon",
    "ComputeDomain",
    "ComputeDomainError",
    "DaemonCondition",
    "DaemonConfig",
    "choose_channel",
    "choose_index",
    "clique_domain_name",
    "clique_domain_uid",
    "clique_member_nodes",
    "clique_object_name",
    "clique_of",
    "daemon_object_name",
    "dns_hash",
    "dns_name",
    "dns_names",
    "domain_channel",
    "fabric_taints",
    "format_clique_id",
    "global_status",
    "parse_channel_config",
    "parse_daemon_config",
    "plugin_resource_slices",
    "unresponsive_nodes",
]

API_GROUP = "resource.nvidia.com"
API_VERSION = "v1beta1"
API_GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"
COMPUTE_DOMAIN_KIND, COMPUTE_DOMAIN_PLURAL = "ComputeDomain", "computedomains"
CLIQUE_KIND, CLIQUE_PLURAL = "ComputeDomainClique", "computedomaincliques"

LABEL_COMPUTE_DOMAIN = "resource.nvidia.com/computeDomain"
"""On nodes (value: the CD UID; set when a workload channel is prepared, the daemon DaemonSet's nodeSelector),
on daemon pods, templates, DaemonSets and clique objects."""
LABEL_CLIQUE_ID = "resource.nvidia.com/computeDomain.cliqueID"
"""On daemon pods (set by the daemon; explicitly empty on a node in no clique) and clique objects."""
LABEL_TARGET = "resource.nvidia.com/computeDomainTarget"
"""On the controller's ResourceClaimTemplates: ``Daemon`` or ``Workload``."""
FINALIZER = "resource.nvidia.com/computeDomain"
NODE_CLIQUE_LABEL = "nvidia.com/gpu.clique"
"""Node label ``<clusterUUID>.<cliqueId>`` (``--gpu-clique-label-enabled``)."""

CHANNEL_DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"
"""NVIDIA's channel class: ``type == 'channel' && id == 0`` (``IMEX_ISOLATION=domain``)."""
ISOLATED_CHANNEL_DEVICE_CLASS = "compute-domain-channel.nvidia.com"
"""dradriver's class for ``IMEX_ISOLATION=channel``: ``type == 'channel'``, any ``id`` (the workload template's
selector then names the domain's channel)."""
ANNOTATION_IMEX_CHANNEL = "resource.nvidia.com/imexChannel"
"""On a ComputeDomain in ``IMEX_ISOLATION=channel``: its IMEX channel ID (decimal), written once by the controller
and kept while the domain lives."""
DAEMON_DEVICE_CLASS = "compute-domain-daemon.nvidia.com"
DAEMON_SERVICE_ACCOUNT = "compute-domain-daemon-service-account"

DEFAULT_MAX_NODES_PER_IMEX_DOMAIN = 18
"""GB200/GB300 NVL72: 18 compute trays per NVLink domain (``MAX_NODES_PER_IMEX_DOMAIN``)."""
DEFAULT_IMEX_CHANNEL_COUNT = 2048
"""Channels 0-2047; the node's real count is read from ``/proc/driver/nvidia/params`` where present."""
UNUSED_SLOT_IP = "127.0.0.2"
"""Address ``/etc/hosts`` gives a DNS name no daemon holds (NVIDIA #1465: no DNS search-domain flood)."""
DNS_NAME_PREFIX = "compute-domain-daemon-"

ALLOCATION_SINGLE, ALLOCATION_ALL = "Single", "All"
STATUS_READY, STATUS_NOT_READY = "Ready", "NotReady"


class ComputeDomainError(DradriverError, ValueError):
    """A ComputeDomain object or config that breaks the contract; the message names the field."""


# -- derived names ---------------------------------------------------------------------------------------------


def daemon_object_name(cd_uid: str) -> str:
    """``computedomain-daemon-<cdUID>``: the daemon ResourceClaimTemplate and DaemonSet (driver namespace)."""
    return f"computedomain-daemon-{cd_uid}"


def clique_object_name(cd_uid: str, clique_id: str) -> str:
    """``<cdUID>.<cliqueID>``: the ComputeDomainClique of one domain in one clique (driver namespace)."""
    return f"{cd_uid}.{clique_id}"


def format_clique_id(cluster_uuid: bytes, clique_id: int) -> str:
    """``<clusterUUID>.<cliqueId>`` from NVML fabric info (``nvmlGpuFabricInfo_t.clusterUuid`` 16 bytes,
    ``cliqueId`` uint32); ``""`` (no clique: not MNNVL) for an all-zero cluster UUID (``nvmlGpuFabricInfo_t`` in
    ``nvml.h``).

    :raises ComputeDomainError: ``cluster_uuid`` is not 16 bytes.
    """
    if len(cluster_uuid) != 16:
        raise ComputeDomainError(f"fabric info clusterUuid has {len(cluster_uuid)} bytes, not 16")
    if not any(cluster_uuid):
        return ""
    h = cluster_uuid.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}.{clique_id}"


def dns_hash(cd_uid: str) -> str:
    """Ten hex digits derived from the CD UID (sha256), so two domains never share a peer name: a pod IP
    reused by another domain's daemon resolves under a different name and fails the IMEX handshake
    (NVIDIA #1447/#1448 names peers ``compute-domain-daemon-<hash>-NNNN``)."""
    return hashlib.sha256(cd_uid.encode()).hexdigest()[:10]


def dns_name(cd_uid: str, index: int) -> str:
    """``compute-domain-daemon-<hash>-<index:04d>``: the name the IMEX peer in slot ``index`` is known by."""
    return f"{DNS_NAME_PREFIX}{dns_hash(cd_uid)}-{index:04d}"


def dns_names(cd_uid: str, max_nodes: int) -> list[str]:
    """Every slot's name, ``0 .. max_nodes-1``: the static ``nodes.cfg`` of DNS-name mode."""
    return [dns_name(cd_uid, i) for i in range(max_nodes)]


# -- opaque configs (NVIDIA's ``api/nvidia.com/resource/v1beta1/computedomainconfig.go``)
# -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """``ComputeDomainChannelConfig``: ``domainID`` (the CD UID, required), ``allocationMode`` (``Single``:
    channel 0 only, the default; ``All``: every channel of the node)."""

    domain_id: str
    allocation_mode: str = ALLOCATION_SINGLE


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """``ComputeDomainDaemonConfig``: ``domainID`` (the CD UID, required)."""

    domain_id: str


def _check_kind(raw: Mapping[str, Any], kind: str, where: str) -> None:
    if raw.get("apiVersion") != API_GROUP_VERSION:
        raise ComputeDomainError(f"{where}.apiVersion: {raw.get('apiVersion')!r} is not {API_GROUP_VERSION!r}")
    if raw.get("kind") != kind:
        raise ComputeDomainError(f"{where}.kind: {raw.get('kind')!r} is not {kind!r}")
    unknown = sorted(set(raw) - {"apiVersion", "kind", "domainID", "allocationMode"})
    if unknown:
        raise ComputeDomainError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")


def _domain_id(raw: Mapping[str, Any], where: str) -> str:
    value = raw.get("domainID")
    if not isinstance(value, str) or not value:
        raise ComputeDomainError(f"{where}.domainID: required (the ComputeDomain's UID)")
    return value


def parse_channel_config(raw: Mapping[str, Any], where: str = "config") -> ChannelConfig:
    """Decode a ``ComputeDomainChannelConfig`` (strict: unknown fields are refused as NVIDIA's strict decoder does).

    :param where: the field path for errors, e.g. ``status.allocation.devices.config[0].opaque.parameters``.
    :raises ComputeDomainError: wrong kind, missing ``domainID``, bad ``allocationMode``.
    """
    _check_kind(raw, "ComputeDomainChannelConfig", where)
    mode = raw.get("allocationMode", ALLOCATION_SINGLE) or ALLOCATION_SINGLE
    if mode not in (ALLOCATION_SINGLE, ALLOCATION_ALL):
        raise ComputeDomainError(f"{where}.allocationMode: {mode!r} is not one of 'Single', 'All'")
    return ChannelConfig(domain_id=_domain_id(raw, where), allocation_mode=str(mode))


def parse_daemon_config(raw: Mapping[str, Any], where: str = "config") -> DaemonConfig:
    """Decode a ``ComputeDomainDaemonConfig``.

    :raises ComputeDomainError: wrong kind, missing ``domainID``, an ``allocationMode`` (not a daemon field).
    """
    _check_kind(raw, "ComputeDomainDaemonConfig", where)
    if "allocationMode" in raw:
        raise ComputeDomainError(f"{where}: unknown field(s) 'allocationMode'")
    return DaemonConfig(domain_id=_domain_id(raw, where))


# -- objects -------------------------------------------------------------------------------------------------------


CLIQUE_DOMAIN_NAMESPACE = uuid.UUID("6f1c4e8a-2b0d-5a7e-9c1f-3d5e7a9b0c2d")
"""The UUID namespace the pre-warmed clique IMEX domains' IDs are derived in (dradriver's own constant)."""


def clique_domain_uid(clique_id: str) -> str:
    """The IMEX domain ID of clique ``clique_id`` in the pre-warmed IMEX mode (``--imex-mode preWarmed``): a UUID
    (version 5, name ``clique_id``), the same on every node and controller, used where a driver-managed domain
    uses its ComputeDomain's UID: the clique daemons' DaemonSet and daemon template ``computedomain-daemon-<id>``,
    their pods' label, the ComputeDomainClique ``<id>.<cliqueID>`` and the domain directory."""
    return str(uuid.uuid5(CLIQUE_DOMAIN_NAMESPACE, clique_id))


def clique_domain_name(clique_id: str) -> str:
    """``imex-clique-<first 8 hex digits of its ID>``: the name the clique daemons report as
    ``COMPUTE_DOMAIN_NAME`` (in their logs and Events)."""
    return f"imex-clique-{clique_domain_uid(clique_id)[:8]}"


CLIQUE_DAEMON_CONDITION = "CliqueDaemonReady"
"""Pre-warmed mode: the condition type of a ``status.nodes[]`` entry saying whether the clique's IMEX daemon on
that node serves the domain (dradriver's own)."""
REASON_CLIQUE_DAEMON_READY = "CliqueDaemonReady"
"""Condition reason (and Normal Event reason) of a node whose clique daemon is Ready (again)."""
REASON_CLIQUE_DAEMON_NOT_READY = "CliqueDaemonNotReady"
"""Condition reason (and Warning Event reason) of a node whose clique daemon is not Ready (restarting, failed,
not scheduled)."""
REASON_NODE_LOST = "NodeNotAnswering"
"""Condition reason (and Warning Event reason) of a domain node whose Lease or Ready condition says it is gone."""


IMEX_DAEMON_CONDITION = "IMEXDaemonRunning"
"""The condition type of a daemon entry saying whether its ``nvidia-imex`` runs (dradriver's own)."""
REASON_IMEX_FAILED = "IMEXDaemonFailed"
"""Condition reason (and Event reason) of a daemon whose ``nvidia-imex`` keeps exiting."""
REASON_IMEX_RUNNING = "IMEXDaemonRunning"
"""Condition reason (and Event reason) of a daemon whose ``nvidia-imex`` runs again after failures."""


@dataclass(frozen=True, slots=True)
class DaemonCondition:
    """A condition of one daemon entry (the shape of ``metav1.Condition`` without ``observedGeneration``): written
    by the daemon into its clique entry and copied by the controller into ``ComputeDomain.status.nodes[]``, so
    ``kubectl describe computedomain`` shows why a node's daemon is not ready (dradriver's own: NVIDIA's entries
    carry ``status`` only).

    :param type: :data:`IMEX_DAEMON_CONDITION`.
    :param status: ``"True"`` or ``"False"``.
    :param reason: UpperCamelCase, e.g. :data:`REASON_IMEX_FAILED`.
    :param message: the whole cause (``nvidia-imex``'s own error line), never cut.
    :param last_transition_time: RFC 3339, when ``status`` last changed.
    """

    type: str
    status: str
    reason: str
    message: str
    last_transition_time: str

    def to_json(self) -> dict[str, str]:
        """The item of a ``conditions`` list."""
        return {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message,
                "lastTransitionTime": self.last_transition_time}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> DaemonCondition:
        """From a ``conditions`` item (missing keys read as ``""``)."""
        return cls(type=str(raw.get("type") or ""), status=str(raw.get("status") or ""),
                   reason=str(raw.get("reason") or ""), message=str(raw.get("message") or ""),
                   last_transition_time=str(raw.get("lastTransitionTime") or ""))


@dataclass(frozen=True, slots=True)
class CliqueDaemon:
    """One IMEX daemon's membership entry: ``ComputeDomainClique.daemons[]`` (list-map key ``nodeName``) or
    ``ComputeDomain.status.nodes[]`` (key ``name``).

    :param index: the slot, ``0 .. maxNodesPerIMEXDomain-1``; ``-1`` for a daemon on a node in no clique.
    :param conditions: the daemon's own report (:class:`DaemonCondition`; empty: none written).
    """

    node_name: str
    ip_address: str
    clique_id: str
    index: int
    status: str = STATUS_NOT_READY
    conditions: tuple[DaemonCondition, ...] = ()

    @property
    def member(self) -> bool:
        """Whether a daemon holds this entry (its ``ipAddress`` is set); an entry with only ``nodeName`` and
        ``index`` is the controller's index reservation for a node whose daemon left or failed."""
        return bool(self.ip_address)

    def to_clique_entry(self) -> dict[str, Any]:
        """The ``daemons[]`` item of a ComputeDomainClique."""
        entry: dict[str, Any] = {"nodeName": self.node_name, "ipAddress": self.ip_address,
                                 "cliqueID": self.clique_id, "index": self.index, "status": self.status}
        if self.conditions:
            entry["conditions"] = [c.to_json() for c in self.conditions]
        return entry

    def to_status_node(self) -> dict[str, Any]:
        """The ``status.nodes[]`` item of a ComputeDomain."""
        node: dict[str, Any] = {"name": self.node_name, "ipAddress": self.ip_address, "cliqueID": self.clique_id,
                                "index": self.index, "status": self.status}
        if self.conditions:
            node["conditions"] = [c.to_json() for c in self.conditions]
        return node

    @classmethod
    def from_entry(cls, raw: Mapping[str, Any]) -> CliqueDaemon:
        """From either item shape (``nodeName`` or ``name``)."""
        return cls(node_name=str(raw.get("nodeName") or raw.get("name") or ""),
                   ip_address=str(raw.get("ipAddress") or ""), clique_id=str(raw.get("cliqueID") or ""),
                   index=int(raw.get("index", -1)), status=str(raw.get("status") or STATUS_NOT_READY),
                   conditions=tuple(DaemonCondition.from_json(c) for c in raw.get("conditions") or ()
                                    if isinstance(c, Mapping)))


@dataclass(frozen=True, slots=True)
class ComputeDomain:
    """The fields of a ``ComputeDomain`` the driver reads (NVIDIA's
    ``api/nvidia.com/resource/v1beta1/computedomain.go``)."""

    name: str
    namespace: str
    uid: str
    num_nodes: int = 0
    template_name: str = ""
    allocation_mode: str = ALLOCATION_SINGLE
    status: str = STATUS_NOT_READY
    nodes: tuple[CliqueDaemon, ...] = ()
    deleting: bool = False
    finalizers: tuple[str, ...] = field(default=())

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> ComputeDomain:
        """From the API's JSON.

        :raises ComputeDomainError: ``spec.channel.resourceClaimTemplate.name`` missing.
        """
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        channel = spec.get("channel") or {}
        template = str((channel.get("resourceClaimTemplate") or {}).get("name") or "")
        where = f"ComputeDomain {meta.get('namespace', '')}/{meta.get('name', '')}"
        if not template:
            raise ComputeDomainError(f"{where}: spec.channel.resourceClaimTemplate.name is required")
        return cls(name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")),
                   uid=str(meta.get("uid", "")), num_nodes=int(spec.get("numNodes") or 0), template_name=template,
                   allocation_mode=str(channel.get("allocationMode") or ALLOCATION_SINGLE),
                   status=str(status.get("status") or STATUS_NOT_READY),
                   nodes=tuple(CliqueDaemon.from_entry(n) for n in status.get("nodes") or ()),
                   deleting=bool(meta.get("deletionTimestamp")),
                   finalizers=tuple(str(f) for f in meta.get("finalizers") or ()))


# -- rules -------------------------------------------------------------------------------------------------------


def choose_index(daemons: Iterable[CliqueDaemon], node_name: str, max_nodes: int) -> int:
    """The slot for ``node_name``'s daemon: the one it already holds (stable across daemon restarts), else
    the lowest slot no other entry holds (gap filling; NVIDIA 7.4). Two daemons never swap: an entry keeps its
    index until it is removed.

    :raises ComputeDomainError: every slot below ``max_nodes`` is taken (names ``max_nodes``).
    """
    taken: set[int] = set()
    for daemon in daemons:
        if daemon.node_name == node_name and 0 <= daemon.index < max_nodes:
            return daemon.index
        taken.add(daemon.index)
    for index in range(max_nodes):
        if index not in taken:
            return index
    raise ComputeDomainError(f"no free IMEX daemon index for node {node_name!r}: all {max_nodes} slots below "
                             "MAX_NODES_PER_IMEX_DOMAIN are taken")


def global_status(num_nodes: int, nodes: Iterable[CliqueDaemon]) -> str:
    """``Ready`` iff every listed node is ``Ready``; with no node listed, ``Ready`` only when ``num_nodes`` is 0.

    Elastic domains (issue 14; NVIDIA ksigs#364/#368 ask to drop ``numNodes``): ``spec.numNodes`` is advisory
    and no longer gates a domain whose members are all Ready (NVIDIA's ``calculateGlobalStatus``, 7.3, also
    required ``len(nodes) >= numNodes``); it still keeps a domain nobody joined yet ``NotReady``, and stays
    visible in the spec next to ``len(status.nodes)``."""
    listed = list(nodes)
    if not listed:
        return STATUS_READY if num_nodes <= 0 else STATUS_NOT_READY
    return STATUS_NOT_READY if any(n.status != STATUS_READY for n in listed) else STATUS_READY


def _rfc3339_s(value: object) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def unresponsive_nodes(leases: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]], *, now_s: float,
                       grace_s: float) -> set[str]:
    """Names of the Nodes whose kubelet stopped answering: the node's Lease in ``kube-node-lease`` (named after
    the node) was last renewed (``spec.renewTime``, else ``acquireTime``) more than ``grace_s`` seconds before
    ``now_s`` (Unix seconds), or the Node's ``Ready`` condition is ``False`` or ``Unknown`` (what the node
    lifecycle controller sets after ``--node-monitor-grace-period``, 40 s before Kubernetes 1.32, 50 s since).
    A Node with neither a Lease nor a Ready condition is not judged.
    """
    out: set[str] = set()
    for lease in leases:
        name = str((lease.get("metadata") or {}).get("name") or "")
        spec = lease.get("spec") or {}
        renewed = _rfc3339_s(spec.get("renewTime")) or _rfc3339_s(spec.get("acquireTime"))
        if name and renewed is not None and now_s - renewed > grace_s:
            out.add(name)
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        for cond in (node.get("status") or {}).get("conditions") or ():
            if cond.get("type") == "Ready" and cond.get("status") in ("False", "Unknown") and name:
                out.add(name)
    return out


def clique_of(clique: Mapping[str, Any]) -> str:
    """The clique ID of a ComputeDomainClique object: its label :data:`LABEL_CLIQUE_ID`, else the part of its name
    ``<cdUID>.<cliqueID>`` after the CD UID (a clique ID holds a dot itself: ``<clusterUUID>.<cliqueId>``)."""
    meta = clique.get("metadata") or {}
    labels = meta.get("labels") or {}
    if LABEL_CLIQUE_ID in labels:
        return str(labels[LABEL_CLIQUE_ID])
    return str(meta.get("name") or "").partition(".")[2]


def clique_member_nodes(pods: Iterable[Mapping[str, Any]], clique_id: str) -> set[str]:
    """``spec.nodeName`` of the daemon pods (of one domain) that belong to the clique ``clique_id``: the pod's label
    :data:`LABEL_CLIQUE_ID` is ``clique_id``, or the pod has no such label yet (its daemon labels its pod before it
    writes an entry, so where it belongs is not known yet and its node's entry is kept until it is).

    The nodes whose entries a ComputeDomainClique keeps: an entry is matched by domain (the pods given) and clique,
    not by node alone, so a node moved to another NVLink clique (a tray moved between racks, a fabric re-registered
    under another clique) leaves the old clique's entry and index reservation, and the old clique's peers drop its
    address (NVIDIA PR #1453: "clique cleanup matches daemon pods by CD UID and clique label")."""
    out: set[str] = set()
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        if node and (LABEL_CLIQUE_ID not in labels or str(labels[LABEL_CLIQUE_ID]) == clique_id):
            out.add(node)
    return out


def ready_daemons(pods: Iterable[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """``(spec.nodeName, status.podIP)`` of the daemon pods whose ``Ready`` condition is ``True`` and that are not
    being deleted (no ``metadata.deletionTimestamp``): the daemons whose IMEX daemon is ready, since a daemon pod's
    startup and readiness probes run ``compute-domain-daemon check`` (NVIDIA's ``cmd/compute-domain-daemon/``). The one
    rule behind a clique entry's ``status`` (the controller writes it) and the channel prepare's readiness check
    (which reads it at its source when the entry's copy lags)."""
    return {(str((pod.get("spec") or {}).get("nodeName") or ""), str((pod.get("status") or {}).get("podIP") or ""))
            for pod in pods if not (pod.get("metadata") or {}).get("deletionTimestamp") and pod_ready(pod)}


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The Pod's ``status.conditions`` has ``Ready`` = ``True``."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or ())


def domain_channel(obj: Mapping[str, Any]) -> int | None:
    """The IMEX channel ID the controller gave the ComputeDomain ``obj`` (annotation
    :data:`ANNOTATION_IMEX_CHANNEL`); ``None`` when it has none yet.

    :raises ComputeDomainError: the annotation is not a decimal integer in ``1 .. 2047`` (names the domain and
        the annotation).
    """
    meta = obj.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(ANNOTATION_IMEX_CHANNEL)
    if raw is None:
        return None
    text = str(raw)
    if not text.isdigit() or not 1 <= int(text) < DEFAULT_IMEX_CHANNEL_COUNT:
        raise ComputeDomainError(f"ComputeDomain {meta.get('namespace', '')}/{meta.get('name', '')}: "
                                 f"metadata.annotations[{ANNOTATION_IMEX_CHANNEL!r}] is {text!r}, not a channel ID "
                                 f"in 1..{DEFAULT_IMEX_CHANNEL_COUNT - 1}")
    return int(text)


def choose_channel(taken: Iterable[int], count: int = DEFAULT_IMEX_CHANNEL_COUNT) -> int:
    """The lowest channel ID in ``1 .. count-1`` not in ``taken`` (the IDs of the live ComputeDomains).

    Channel 0 is never given: it is the channel of ``IMEX_ISOLATION=domain`` and of host processes outside
    Kubernetes (a Slurm job, a test), so an isolated domain never shares it. The choice depends only on
    ``taken``: a restarted controller chooses as the old one would have.

    :raises ComputeDomainError: every channel is taken (names the count).
    """
    used = set(taken)
    for channel in range(1, count):
        if channel not in used:
            return channel
    raise ComputeDomainError(f"no free IMEX channel: all {count - 1} channels 1..{count - 1} belong to live "
                             "ComputeDomains (IMEX_ISOLATION=channel gives each domain its own)")


BINDING_CONDITION = "ComputeDomainReady"
"""KEP-5007 binding condition of an IMEX channel (``--binding-conditions``): set True in the claim's
``status.devices[]`` entry of the channel by the node's plugin once the ComputeDomain is ready on that node."""
BINDING_FAILURE_CONDITION = "ComputeDomainFailed"
"""KEP-5007 binding failure condition of an IMEX channel: set True (with the reason) when the domain cannot become
ready on the node; the scheduler then unreserves the claim and schedules the pod again."""


def fabric_taints(identity: DriverIdentity, reason: str) -> list[dict[str, str]]:
    """The taints the compute-domain plugin puts on every device of its node: ``<taint domain>/fabric-unhealthy``
    ``NoSchedule`` with ``reason`` (``registration-failed`` or ``unhealthy``) while the node's NVLink fabric is
    faulty, none when ``reason`` is empty (healthy). Shape: ``resource.k8s.io/v1`` DeviceTaint dicts."""
    if not reason:
        return []
    return [DeviceTaint(identity.taint_key(FaultKind.FABRIC_UNHEALTHY.value), reason, Effect.NO_SCHEDULE).to_api()]


def plugin_resource_slices(node_name: str, driver: str, *, daemon: bool, channels: int = 1,
                           api_version: str = "resource.k8s.io/v1", generation: int = 1,
                           taints: Sequence[Mapping[str, str]] = (),
                           binding_conditions: bool = False) -> list[dict[str, Any]]:
    """The compute-domain kubelet plugin's ResourceSlices, one pool named after the node: devices
    ``channel-0 .. channel-<channels-1>`` (``type=channel``, ``id=<n>``) and, unless ``daemon`` is False
    (host-managed IMEX), ``daemon-0`` (``type=daemon``, ``id=0``); no capacities (NVIDIA's
    ``cmd/compute-domain-kubelet-plugin/deviceinfo.go``). Every device carries ``taints`` (``resource.k8s.io/v1``
    DeviceTaint dicts; the node's NVLink fabric is faulty).

    NVIDIA publishes ``channel-0`` only (``channels=1``, one slice); ``IMEX_ISOLATION=channel`` publishes every
    channel of the node (2048 by default), cut into slices of at most :data:`MAX_DEVICES_PER_SLICE` devices
    (``spec.pool.resourceSliceCount`` counts them).

    ``binding_conditions`` (``--binding-conditions``, KEP-5007): every channel also carries
    ``bindingConditions: [ComputeDomainReady]``, ``bindingFailureConditions: [ComputeDomainFailed]`` and
    ``bindsToNode: true`` (:data:`BINDING_CONDITION`, :data:`BINDING_FAILURE_CONDITION`); the daemon device never
    does (its pod is what makes the domain ready).

    :raises ComputeDomainError: ``channels`` is below 1.
    """
    if channels < 1:
        raise ComputeDomainError(f"the node publishes at least channel 0, not {channels} channels")
    devices: list[dict[str, Any]] = [
        {"name": f"channel-{n}", "attributes": {"type": {"string": "channel"}, "id": {"int": n}}}
        for n in range(channels)]
    if binding_conditions:
        for device in devices:
            device.update({"bindingConditions": [BINDING_CONDITION],
                           "bindingFailureConditions": [BINDING_FAILURE_CONDITION], "bindsToNode": True})
    if daemon:
        devices.append({"name": "daemon-0", "attributes": {"type": {"string": "daemon"}, "id": {"int": 0}}})
    if taints:
        for device in devices:
            device["taints"] = [dict(t) for t in taints]
    chunks = [devices[i:i + MAX_DEVICES_PER_SLICE] for i in range(0, len(devices), MAX_DEVICES_PER_SLICE)]
    return [{"apiVersion": api_version, "kind": "ResourceSlice",
             "metadata": {"generateName": f"{node_name}-{driver}-"},
             "spec": {"driver": driver, "nodeName": node_name,
                      "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
                      "devices": chunk}}
            for chunk in chunks]
