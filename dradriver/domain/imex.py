"""The IMEX daemon's files and membership rules, free of I/O: ``imexd.cfg``, ``nodes.cfg``, the hosts-file
section, the clique entry changes and the name -> address mapping whose change the daemon signals.

Facts: NVIDIA's ``cmd/compute-domain-daemon/`` (daemon behaviour: config keys, static ``nodes.cfg`` of DNS names, hosts
lines ``<ip>\\t<name>``, lowest free index, removal by pod IP), ``cmd/compute-domain-controller/`` (per-domain
hashed names after #1448, sentinel ``127.0.0.2`` for unused slots after #1465). Names and the index rule are
:mod:`dradriver.domain.computedomains`'.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dradriver.domain.computedomains import (
    DNS_NAME_PREFIX,
    STATUS_NOT_READY,
    UNUSED_SLOT_IP,
    CliqueDaemon,
    choose_index,
    dns_name,
    dns_names,
)

__all__ = [
    "CONFIG_FILE",
    "CONFIG_TEMPLATE_FILE",
    "HOSTS_HEADER",
    "LIVENESS_FILE",
    "NODES_FILE",
    "PROCESS_FILE",
    "READINESS_FILE",
    "READINESS_MAX_AGE_S",
    "DaemonRecord",
    "ImexProcessRecord",
    "MembershipChange",
    "assign_indexes",
    "dns_mapping",
    "membership_change",
    "own_name",
    "remove_entry",
    "render_hosts",
    "render_imexd_config",
    "render_nodes_config",
    "upsert_entry",
]

CONFIG_TEMPLATE_FILE = "imexd.cfg.tmpl"
"""The template the daemon claim's Prepare copies into the domain directory (mounted at ``/imexd``)."""
CONFIG_FILE = "imexd.cfg"
NODES_FILE = "nodes.cfg"
HOSTS_HEADER = "# IMEX peers of this ComputeDomain (written by compute-domain-daemon; edits are overwritten)"
READINESS_FILE = "daemon-readiness.json"
"""The daemon's readiness record in the domain directory (:class:`DaemonRecord`; dradriver's own, NVIDIA has none)."""
LIVENESS_FILE = "daemon.lock"
"""The file in the domain directory on which a running daemon holds an exclusive ``flock`` (dradriver's own): the
kernel drops it when the daemon's process ends, however it ends, so a ``ready`` record of a daemon that was killed
counts for nothing even while it is young."""
PROCESS_FILE = "nvidia-imex.json"
"""The daemon's record of its own ``nvidia-imex`` process in the domain directory (:class:`ImexProcessRecord`;
dradriver's own)."""
READINESS_MAX_AGE_S = 30.0
"""A record older than this (seconds: three periods of the daemon pod's 10 s readiness probe, which rewrites it)
says nothing: its daemon stopped probing, and the plugin asks the API instead."""


@dataclass(frozen=True, slots=True)
class DaemonRecord:
    """What this node's IMEX daemon last found when probed, written by the daemon into its domain directory
    (``/imexd/daemon-readiness.json`` in its container, ``<plugin dir>/domains/<cdUID>/`` on the host) at its start
    (not ready), at each probe (``compute-domain-daemon check``: the startup probe every 1 s, then the readiness
    probe every 10 s; NVIDIA's ``cmd/compute-domain-controller/``) and when it stops (not ready). The compute-domain
    plugin, on the same node, reads it before the API (issue 14): a workload's channel prepare learns that its
    daemon is Ready when the probe that turns the pod Ready passes, without a read of the clique or the pod, and
    a not-ready daemon costs the waiting claim nothing but this file. A ``ready`` record counts only while its
    daemon holds the lock on :data:`LIVENESS_FILE` (a daemon killed after its last probe leaves a young ``ready``
    record behind; its lock is gone with its process).

    :param node_name: the daemon's node (``NODE_NAME``).
    :param pod_uid: its pod (``POD_UID``): a new pod's record replaces an old one's.
    :param pod_ip: its pod IP (``POD_IP``, its clique entry's ``ipAddress``).
    :param ready: ``nvidia-imex-ctl -q`` printed ``READY`` (the probe passed).
    :param written_s: when, Unix seconds (the node's clock: the plugin reads it on the same node).
    :param detail: what the probe printed, or why the daemon is not ready.
    """

    node_name: str
    pod_uid: str
    pod_ip: str
    ready: bool
    written_s: float
    detail: str = ""

    def to_json(self) -> bytes:
        """The file's content (one JSON object, keys ``nodeName``, ``podUID``, ``podIP``, ``ready``,
        ``writtenAt``, ``detail``)."""
        return json.dumps({"nodeName": self.node_name, "podUID": self.pod_uid, "podIP": self.pod_ip,
                           "ready": self.ready, "writtenAt": self.written_s, "detail": self.detail},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> DaemonRecord:
        """Parse :meth:`to_json`'s output.

        :raises ValueError: not such an object (names the field).
        """
        obj = _json_object(data)
        for key, kind in (("nodeName", str), ("podUID", str), ("podIP", str), ("ready", bool)):
            if not isinstance(obj.get(key), kind):
                raise ValueError(f"{key}: missing or not a {kind.__name__}")
        written = obj.get("writtenAt")
        if isinstance(written, bool) or not isinstance(written, (int, float)):
            raise ValueError("writtenAt: missing or not a number")
        return cls(obj["nodeName"], obj["podUID"], obj["podIP"], obj["ready"], float(written),
                   str(obj.get("detail") or ""))

    def age_s(self, now_s: float) -> float:
        """Seconds since it was written (negative when the clock went back)."""
        return now_s - self.written_s

    def current(self, now_s: float, max_age_s: float = READINESS_MAX_AGE_S) -> bool:
        """Whether it still speaks for its daemon: written within ``max_age_s`` of ``now_s`` (either way: a clock
        that jumped makes it stale, not eternal)."""
        return abs(self.age_s(now_s)) <= max_age_s


@dataclass(frozen=True, slots=True)
class ImexProcessRecord:
    """The ``nvidia-imex`` process a daemon started, written by ``compute-domain-daemon run`` into its domain
    directory at each start and exit of the process, read by its probe (``compute-domain-daemon check``) so that
    the probe asks only this pod's own ``nvidia-imex`` (another daemon answering on the same address, such as a
    host ``nvidia-imex.service``, does not make the pod Ready) and reports why it is down.

    :param pod_uid: the daemon's pod (``POD_UID``).
    :param pid: the running process (0: none runs now).
    :param failure: why it does not run (the whole cause, e.g. its last ``ERROR`` line); ``""``: nothing failed.
    :param written_s: when, Unix seconds.
    """

    pod_uid: str
    pid: int
    failure: str
    written_s: float

    def to_json(self) -> bytes:
        """The file's content (keys ``podUID``, ``pid``, ``failure``, ``writtenAt``)."""
        return json.dumps({"podUID": self.pod_uid, "pid": self.pid, "failure": self.failure,
                           "writtenAt": self.written_s}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> ImexProcessRecord:
        """Parse :meth:`to_json`'s output.

        :raises ValueError: not such an object (names the field).
        """
        obj = _json_object(data)
        for key, kinds in (("podUID", (str,)), ("pid", (int,)), ("failure", (str,)), ("writtenAt", (int, float))):
            if isinstance(obj.get(key), bool) or not isinstance(obj.get(key), kinds):
                raise ValueError(f"{key}: missing or not a {kinds[0].__name__}")
        return cls(obj["podUID"], obj["pid"], obj["failure"], float(obj["writtenAt"]))


def _json_object(data: bytes | str) -> dict[str, Any]:
    """One JSON object. :raises ValueError: not JSON, or not an object."""
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def own_name(mapping: Mapping[str, str], ip: str) -> str | None:
    """The DNS name (slot) that ``mapping`` (:func:`dns_mapping`) gives the daemon at ``ip``: the first one mapped
    to it, ``None`` when none is (its index is not assigned yet). ``nvidia-imex`` learns its own node identity at
    start only: a change of this name needs a restart, ``SIGUSR1`` does not apply it."""
    return next((name for name, address in mapping.items() if address == ip), None)


def render_imexd_config(template: str, *, pod_ip: str, nodes_config: str,
                        overrides: Mapping[str, str] | None = None) -> str:
    """``imexd.cfg`` from the template text: ``IMEX_CMD_BIND_INTERFACE_IP=<pod_ip>``,
    ``IMEX_NODE_CONFIG_FILE=<nodes_config>`` and any ``overrides`` (``KEY -> value``) replace the value of
    their ``KEY=`` line, or are appended when the template lacks the key; comments and other lines are kept.

    :param pod_ip: the daemon pod's IP (``POD_IP``).
    :param nodes_config: the path of ``nodes.cfg`` as the daemon sees it (``/imexd/nodes.cfg``).
    """
    values = {"IMEX_CMD_BIND_INTERFACE_IP": pod_ip, "IMEX_NODE_CONFIG_FILE": nodes_config, **(overrides or {})}
    out: list[str] = []
    seen: set[str] = set()
    for line in template.splitlines():
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else ""
        if key in values:
            out.append(f"{key}={values[key]}")
            seen.add(key)
        else:
            out.append(line)
    out.extend(f"{key}={value}" for key, value in values.items() if key not in seen)
    return "\n".join(out) + "\n"


def render_nodes_config(cd_uid: str, max_nodes: int) -> str:
    """The static ``nodes.cfg`` of DNS-name mode: one name per slot ``0 .. max_nodes-1``
    (:func:`~dradriver.domain.computedomains.dns_names`), one per line."""
    return "".join(f"{name}\n" for name in dns_names(cd_uid, max_nodes))


def dns_mapping(cd_uid: str, daemons: Iterable[CliqueDaemon], clique_id: str, max_nodes: int) -> dict[str, str]:
    """Name -> address for every slot ``0 .. max_nodes-1``: the IP of the same-clique daemon holding that
    index, :data:`~dradriver.domain.computedomains.UNUSED_SLOT_IP` for a slot no daemon holds (and for an
    entry without an IP yet). Daemons of other cliques and indexes outside the range are ignored."""
    mapping = {name: UNUSED_SLOT_IP for name in dns_names(cd_uid, max_nodes)}
    for daemon in daemons:
        if daemon.clique_id == clique_id and 0 <= daemon.index < max_nodes and daemon.ip_address:
            mapping[dns_name(cd_uid, daemon.index)] = daemon.ip_address
    return mapping


def render_hosts(current: str, mapping: Mapping[str, str]) -> str:
    """The hosts file with this domain's section replaced: every line containing
    :data:`~dradriver.domain.computedomains.DNS_NAME_PREFIX` (any domain's old names) and the old header are
    dropped, then :data:`HOSTS_HEADER` and ``<ip>\\t<name>`` per ``mapping`` entry (slot order) are appended."""
    kept = [line for line in current.splitlines() if DNS_NAME_PREFIX not in line and line != HOSTS_HEADER]
    while kept and not kept[-1].strip():
        kept.pop()
    lines = [*kept, "", HOSTS_HEADER] if kept else [HOSTS_HEADER]
    lines.extend(f"{ip}\t{name}" for name, ip in mapping.items())
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """How a name -> address mapping changed: names that gained an address (from the sentinel or absent),
    names that lost theirs, and names whose address moved (a daemon restarted with a new pod IP)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    moved: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether ``nvidia-imex`` must re-read its peers (SIGUSR1)."""
        return bool(self.added or self.removed or self.moved)


def membership_change(old: Mapping[str, str], new: Mapping[str, str]) -> MembershipChange:
    """Compare two mappings from :func:`dns_mapping`; the sentinel counts as no address."""
    def live(mapping: Mapping[str, str]) -> dict[str, str]:
        return {name: ip for name, ip in mapping.items() if ip and ip != UNUSED_SLOT_IP}

    before, after = live(old), live(new)
    return MembershipChange(
        added=tuple(sorted(set(after) - set(before))),
        removed=tuple(sorted(set(before) - set(after))),
        moved=tuple(sorted(n for n in set(before) & set(after) if before[n] != after[n])),
    )


def upsert_entry(daemons: Sequence[CliqueDaemon], *, node_name: str, ip_address: str, clique_id: str,
                 max_nodes: int, status: str = STATUS_NOT_READY) -> tuple[list[CliqueDaemon], CliqueDaemon]:
    """The entry list with this node's daemon inserted or updated, and that entry.

    The index is :func:`~dradriver.domain.computedomains.choose_index`'s: the node keeps the index it holds
    (a restarted daemon keeps its DNS name), a new node gets the lowest free one; no other entry changes.
    A new entry starts ``NotReady`` unless ``status`` says otherwise; an existing one takes the new IP and
    ``status``.

    :raises dradriver.domain.computedomains.ComputeDomainError: no free index below ``max_nodes``.
    """
    index = choose_index(daemons, node_name, max_nodes)
    entry = CliqueDaemon(node_name=node_name, ip_address=ip_address, clique_id=clique_id, index=index,
                         status=status)
    out: list[CliqueDaemon] = []
    placed = False
    for daemon in daemons:
        if daemon.node_name == node_name:
            if not placed:
                out.append(replace(entry))
                placed = True
            continue
        out.append(daemon)
    if not placed:
        out.append(entry)
    return out, entry


def remove_entry(daemons: Sequence[CliqueDaemon], *, node_name: str, ip_address: str) -> list[CliqueDaemon]:
    """The entry list without this daemon's entry: the one of ``node_name`` with ``ip_address`` (NVIDIA removes
    by pod IP, so a stopping old pod never removes the entry its replacement on the same node already wrote)."""
    return [d for d in daemons if not (d.node_name == node_name and d.ip_address == ip_address)]


def assign_indexes(daemons: Sequence[CliqueDaemon], max_nodes: int) -> dict[str, int]:
    """Node name -> index for every entry of a clique that holds or can get one: an entry keeps the index it has
    (never moved, never swapped: NVIDIA ksigs#1418/#1440), entries without one (``index`` -1: a daemon joined and
    the controller has not answered yet) take the lowest free indexes in node-name order. Entries left over when
    all ``max_nodes`` slots are held are absent from the answer (they wait for a slot to be released).

    Indexes outside ``0 .. max_nodes-1`` and a second entry holding an index already held are treated as no
    index (the lowest free one is given instead).
    """
    out: dict[str, int] = {}
    taken: set[int] = set()
    waiting: list[str] = []
    for daemon in daemons:
        if 0 <= daemon.index < max_nodes and daemon.index not in taken:
            out[daemon.node_name] = daemon.index
            taken.add(daemon.index)
        else:
            waiting.append(daemon.node_name)
    free = (i for i in range(max_nodes) if i not in taken)
    for node_name in sorted(set(waiting) - set(out)):
        index = next(free, None)
        if index is None:
            break
        out[node_name] = index
    return out
