"""A multi-node sandbox: one API emulator, N emulated GB200 NVL72 nodes in racks, a kubelet and container runner
per node, a DaemonSet controller and a scheduler that places Pods across the nodes.

What a cluster does around the compute-domain driver (NVIDIA's
``cmd/compute-domain-controller/`` and ``cmd/compute-domain-daemon/``), reduced to what the
driver relies on:

* **Nodes**: each :class:`EmulatedNode` is a :class:`~dradriver.sandbox.node.SandboxNode` (its own root with the
  kubelet directories, CDI root and ``proc`` tree) on the shared API emulator, with the mock NVML view of one
  compute tray of its rack (:func:`dradriver.nvml.mock.rack_node_profile`: rack 1 = ``gb200-nvl72-rack-a``,
  clique 2; rack 2 = ``gb200-nvl72-rack-b``, clique 7) and its own loopback address ``127.<net>.<rack>.<tray+1>``
  (every node shares this host's network namespace; ``<net>`` is chosen per cluster so two clusters on one host
  do not meet). The mock NVML library serves one profile per process, so each node's kubelet plugin is its own
  process (:meth:`MultiNodeCluster.start_plugin`): ``python -m dradriver compute-domain-kubelet-plugin`` with that
  node's flags as environment twins, logging to ``<node root>/plugin.log``. A workload that also asks for GPUs
  (``deploy/examples/compute-domain-job.yaml``) needs each node's ``gpu-kubelet-plugin`` beside it
  (:meth:`MultiNodeCluster.start_gpu_plugins`: it publishes the tray's four GPUs and prepares their claims;
  ``<node root>/gpu-plugin.log``).
* **Scheduler** (one thread with the controllers): a Pod without ``spec.nodeName`` gets its claims from their
  templates (the resourceclaim controller's naming, :func:`dradriver.sandbox.cluster.create_claim_from_template`)
  and is bound to the first node, by name, that passes ``nodeSelector``, required node affinity (``In``,
  ``NotIn``, ``Exists``, ``DoesNotExist``), taints (``NoSchedule``/``NoExecute`` need a toleration), required pod
  affinity and anti-affinity (label selectors over Pods in the same ``topologyKey`` domain) and on which the
  allocator (:func:`dradriver.sandbox.scheduler.allocate`) fits its claims. Pods already bound (DaemonSet Pods)
  get their claims allocated on their node. With ``binding_conditions`` (the scheduler's gate
  ``DRADeviceBindingConditions``, KEP-5007) a Pod whose devices carry binding conditions waits in PreBind
  (:func:`dradriver.sandbox.scheduler.prebind`, checked every pass) and is bound once they are all True; a failure
  condition or ``binding_timeout_s`` unreserves its claims (:func:`~dradriver.sandbox.scheduler.unreserve`:
  deallocated) and the Pod is scheduled again after a back-off.
* **DaemonSet controller**: for every ``apps/v1`` DaemonSet not being deleted, one Pod (``<ds>-<5 random>``,
  owned by the DaemonSet, ``spec.nodeName`` set, as the controller's node affinity pins it, labelled
  ``controller-revision-hash`` and ``pod-template-generation``) on each node that matches the template's node
  selection and tolerates the node's taints; a Pod whose node stops matching is deleted, a deleted one recreated
  once it is gone (kube-controller-manager creates it as soon as the old one is terminating; here the old one's
  containers, an ``nvidia-imex`` holding the node's one IMEX session, have stopped first). A change of the pod
  template is rolled out as ``spec.updateStrategy`` says (:mod:`dradriver.sandbox.daemonsets`: ``RollingUpdate``
  with ``maxUnavailable`` 1 and ``maxSurge`` 0 by default, one node at a time, the next old Pod deleted once the
  new one is available; ``OnDelete``). ``status`` counts (``currentNumberScheduled``, ``numberReady``,
  ``updatedNumberScheduled``, ``numberAvailable``, ``numberUnavailable``, ``observedGeneration``) kept current.
  Deleting the DaemonSet deletes its Pods through the API emulator's garbage collector.
* **Kubelet** (a thread per node): registers the node's plugins from its registrar directory (real gRPC,
  :class:`~dradriver.sandbox.kubelet.SyncKubeletEmulator`), prepares the claims of each bound Pod once they are
  allocated (one NodePrepareResources call per Pod and driver, each to the plugin of the drivers in the claim's
  allocation results, on worker threads: a channel prepare waits inside the plugin for the node's IMEX daemon,
  whose Pod this same kubelet must start meanwhile), and unprepares claims no Pod on the node uses any more.
  The CDI device IDs a Pod got are resolved against the node's CDI specs
  (:func:`cdi_edits`): environment, mounts and device nodes.
* **Container runner** (:class:`NodeRuntime`, the node's container runtime on top of
  :class:`~dradriver.sandbox.workloads.Workloads`): DaemonSet Pods run as local processes once their claims are
  prepared, with the CDI environment (``CLIQUE_ID``, ``COMPUTE_DOMAIN_*``), ``valueFrom.fieldRef`` variables
  (``NODE_NAME``, ``POD_IP``, ``POD_NAME``, ``POD_NAMESPACE``, ``POD_UID``), ``$(VAR)`` expansion, each CDI mount's
  container path mapped to its host path (``/imexd`` to the daemon claim's domain directory, also passed as
  ``DRADRIVER_IMEXD_DIR``), a hosts file of the Pod's own (``DRADRIVER_HOSTS_FILE``), the node's
  ``fabric-imex-mgmt`` capability when the CDI edits give the device (``DRADRIVER_FABRIC_IMEX_MGMT``: one
  ``nvidia-imex`` per node holds the IMEX session, :func:`fabric_imex_mgmt`), and ``PATH`` starting with
  the node's ``bin/``: ``compute-domain-daemon`` (this checkout's ``dradriver compute-domain-daemon``),
  ``nvidia-imex`` and ``nvidia-imex-ctl`` (the stand-ins). Exec probes (``compute-domain-daemon check``) drive the
  Pod's ``Ready`` condition. While :attr:`EmulatedNode.pulling` is set the runner starts no new container, as
  while a kubelet pulls an image (the images are never pulled here). Other Pods (a user's workload) run no
  process: once their claims are prepared they are reported Running and :attr:`EmulatedNode.pod_devices` records
  what the runtime would have given them.

* **Node heartbeat and failure**: each kubelet renews its Node's Lease ``kube-node-lease/<node>``
  (``spec.renewTime``, ``leaseDurationSeconds`` 40) every ``lease_renew_s`` from a heartbeat thread apart from
  its Pod sync, as a kubelet does every 10 s.
  :meth:`MultiNodeCluster.kill_node` makes a node stop answering without any clean-up: its kubelet loop stops
  (no heartbeat, no Pod status, no prepares) and every process of the node -- its kubelet plugin and its
  containers (IMEX daemons and their ``nvidia-imex``) -- is frozen with SIGSTOP, so nothing leaves, withdraws or
  reports; :meth:`MultiNodeCluster.heal_node` resumes them (SIGCONT) and the kubelet loop, as after a healed
  network partition or a node that hung.

Timing: probes and back-offs are scaled by ``time_scale``; the loops poll every ``interval_s``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from dradriver.allocator.allocation import AllocationError
from dradriver.config import CHANNEL_NEEDS_HOST_MANAGED, COMPUTE_DOMAIN_PLUGIN_FLAGS, Flag, PluginConfig
from dradriver.domain.claims import ClaimRef, ClaimResult
from dradriver.domain.featuregates import HOST_MANAGED_IMEX_DAEMON, FeatureGates
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, GPU_DRIVER
from dradriver.errors import DradriverError
from dradriver.nvml import mock
from dradriver.sandbox import daemonsets, scheduler, standins
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.apiserver.errors import ApiStatusError
from dradriver.sandbox.cluster import create_claim_from_template, plugin_environment
from dradriver.sandbox.kubelet import KubeletError, SyncKubeletEmulator, SyncPluginConnection
from dradriver.sandbox.node import SANDBOX_IMAGE, SANDBOX_NAMESPACE, SandboxNode
from dradriver.sandbox.workloads import BASE_PATH, Workloads

log = logging.getLogger(__name__)

JSONDict = dict[str, Any]
RACK_PROFILES = {1: "gb200-nvl72-rack-a", 2: "gb200-nvl72-rack-b"}
"""Rack number -> bundled rack profile (``ext/mocknvml/README.md``, "GB200 NVL72 racks")."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
RACK_LABEL = "sandbox.dradriver.io/rack"
"""Node label the sandbox sets: the node's rack number (``1``, ``2``)."""
REPO_ROOT = Path(__file__).resolve().parents[2]
_UNSCHEDULABLE_EFFECTS = ("NoSchedule", "NoExecute")
NODE_LEASE_NAMESPACE = "kube-node-lease"
NODE_LEASE_DURATION_S = 40
"""``leaseDurationSeconds`` of the node Leases (the kubelet's ``nodeLeaseDurationSeconds`` default)."""
PREPARE_BACKOFF_S, PREPARE_BACKOFF_MAX_S = 0.2, 5.0
"""Retry delay of a Pod's prepare after a failure: doubling from 0.2 s to 5 s (a kubelet backs off too)."""


class MultiNodeError(DradriverError):
    """The multi-node sandbox cannot do what was asked (a node that does not exist, a plugin that died)."""


# ------------------------------------------------------------------------------------------------ CDI resolution
@dataclass
class CdiEdits:
    """What a container runtime applies for a list of CDI device IDs (the ``containerEdits`` of each device and
    of its spec): ``env`` (name -> value), ``mounts`` (container path, host path), ``device_nodes`` (the entries
    as written: ``path``, ``type``, ``major``, ``minor``, ``fileMode``)."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str]] = field(default_factory=list)
    device_nodes: list[JSONDict] = field(default_factory=list)
    device_ids: list[str] = field(default_factory=list)

    def device_paths(self) -> list[str]:
        """The container paths of :attr:`device_nodes`, in order."""
        return [str(n.get("path", "")) for n in self.device_nodes]


def _load_spec(path: Path) -> JSONDict | None:
    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def cdi_edits(cdi_root: Path, device_ids: Iterable[str]) -> CdiEdits:
    """Resolve fully qualified CDI device IDs (``<vendor>/<class>=<name>``) against the spec files in ``cdi_root``
    (``*.json``/``*.yaml``), as a CDI-enabled runtime does: each named device's ``containerEdits`` plus its spec's
    top-level ``containerEdits`` (once per spec).

    :raises MultiNodeError: an ID no spec defines (the runtime would refuse to create the container).
    """
    specs = [s for p in sorted(cdi_root.glob("*")) if p.suffix in (".json", ".yaml") and (s := _load_spec(p))]
    out = CdiEdits()
    used: set[int] = set()
    for device_id in device_ids:
        kind, _, name = device_id.partition("=")
        for index, spec in enumerate(specs):
            if spec.get("kind") != kind:
                continue
            device = next((d for d in spec.get("devices") or [] if d.get("name") == name), None)
            if device is None:
                continue
            edits = [device.get("containerEdits") or {}]
            if index not in used:
                used.add(index)
                edits.insert(0, spec.get("containerEdits") or {})
            for edit in edits:
                for entry in edit.get("env") or []:
                    key, _, value = str(entry).partition("=")
                    out.env[key] = value
                for mount in edit.get("mounts") or []:
                    out.mounts.append((str(mount["containerPath"]), str(mount["hostPath"])))
                out.device_nodes.extend(dict(n) for n in edit.get("deviceNodes") or [])
            out.device_ids.append(device_id)
            break
        else:
            raise MultiNodeError(f"CDI device {device_id!r} is not defined by any spec in {cdi_root}")
    return out


# -------------------------------------------------------------------------------------------- selection rules
def _match_expressions(labels: Mapping[str, str], expressions: Iterable[Mapping[str, Any]]) -> bool:
    for e in expressions:
        key, op, values = str(e.get("key", "")), str(e.get("operator", "")), [str(v) for v in e.get("values") or []]
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def label_selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A ``metav1.LabelSelector`` (``matchLabels`` and ``matchExpressions``) against ``labels``; an empty or
    missing selector matches everything."""
    if not selector:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return _match_expressions(labels, selector.get("matchExpressions") or [])


def node_matches(pod_spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """The Pod's ``nodeSelector``, required node affinity and tolerations against the Node (not pod affinity)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if terms and not any(_match_expressions(labels, t.get("matchExpressions") or []) for t in terms):
        return False
    tolerations = pod_spec.get("tolerations") or []
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") not in _UNSCHEDULABLE_EFFECTS:
            continue
        if not any(_tolerates(t, taint) for t in tolerations):
            return False
    return True


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration.get("key") == taint.get("key")
    return toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", "")


def pod_affinity_allows(pod: Mapping[str, Any], node: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                        nodes: Mapping[str, Mapping[str, Any]]) -> bool:
    """Required pod affinity and anti-affinity of ``pod`` for ``node``, given the bound ``pods`` and all
    ``nodes`` by name. Affinity with no matching Pod anywhere is allowed when the Pod matches its own term (the
    first Pod of a group, as kube-scheduler allows)."""
    affinity = (pod.get("spec") or {}).get("affinity") or {}
    namespace = (pod.get("metadata") or {}).get("namespace", "default")
    node_labels = (node.get("metadata") or {}).get("labels") or {}

    def peers(term: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        spaces = term.get("namespaces") or [namespace]
        return [p for p in pods if (p.get("metadata") or {}).get("namespace", "default") in spaces
                and label_selector_matches(term.get("labelSelector"), (p.get("metadata") or {}).get("labels") or {})
                and not (p.get("metadata") or {}).get("deletionTimestamp")]

    def same_domain(term: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
        key = str(term.get("topologyKey", HOSTNAME_LABEL))
        other_node = nodes.get(str((other.get("spec") or {}).get("nodeName", "")))
        if other_node is None or key not in node_labels:
            return False
        return ((other_node.get("metadata") or {}).get("labels") or {}).get(key) == node_labels[key]

    for term in (affinity.get("podAntiAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or []:
        if any(same_domain(term, p) for p in peers(term)):
            return False
    for term in (affinity.get("podAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or []:
        matching = peers(term)
        if matching:
            if not any(same_domain(term, p) for p in matching):
                return False
        elif not label_selector_matches(term.get("labelSelector"), (pod.get("metadata") or {}).get("labels") or {}):
            return False
    return True


def _owner_uid(obj: Mapping[str, Any], kind: str) -> str:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == kind and ref.get("controller"):
            return str(ref.get("uid", ""))
    return ""


def _ref_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


# ------------------------------------------------------------------------------------------------------ nodes
@dataclass
class EmulatedNode:
    """One node of the multi-node sandbox (module docstring).

    :param name: Node name (``rack<r>-node<NN>``) and the plugin's pool name.
    :param rack: rack number (1, 2).
    :param tray: compute tray in the rack (0-17): which tray's GPUs the mock serves.
    :param ip: the node's (and its Pods') loopback address.
    """

    name: str
    rack: int
    tray: int
    ip: str
    sandbox: SandboxNode
    profile: Path
    plugin: subprocess.Popen[bytes] | None = None
    gpu_plugin: subprocess.Popen[bytes] | None = None
    """The node's ``gpu-kubelet-plugin`` (:meth:`MultiNodeCluster.start_gpu_plugin`), when started."""
    kubelet: SyncKubeletEmulator | None = None
    runtime: NodeRuntime | None = None
    host_imex: subprocess.Popen[bytes] | None = None
    """Host-managed IMEX: the host's own ``nvidia-imex`` (:meth:`MultiNodeCluster.start_host_imex`)."""
    prepared: dict[str, ClaimRef] = field(default_factory=dict)
    """Claim UID -> claim, for the claims prepared on this node."""
    pod_devices: dict[str, CdiEdits] = field(default_factory=dict)
    """``<namespace>/<pod>`` -> the CDI edits of the Pod's prepared claims (what the runtime gives it)."""
    prepare_errors: dict[str, str] = field(default_factory=dict)
    """``<namespace>/<pod>`` -> the last NodePrepareResources error of the Pod's claims."""
    pulling: bool = False
    """While True the node's container runtime starts no new container, as while a kubelet pulls a Pod's image
    (a node that just joined, a daemon image being upgraded): new DaemonSet Pods stay ``Pending`` after their
    claims are prepared; containers already running are not touched."""

    @property
    def root(self) -> Path:
        """The node's sandbox root."""
        return self.sandbox.root

    @property
    def bin_dir(self) -> Path:
        """Programs the node's containers find first on ``PATH``."""
        return self.root / "bin"

    @property
    def plugin_log(self) -> Path:
        """The compute-domain kubelet plugin's output."""
        return self.root / "plugin.log"

    @property
    def gpu_plugin_log(self) -> Path:
        """The GPU kubelet plugin's output."""
        return self.root / "gpu-plugin.log"

    def labels(self) -> dict[str, str]:
        """The Node object's labels now."""
        api = self.sandbox.api
        assert api is not None
        node = api.get("Node", self.name) or {}
        return dict((node.get("metadata") or {}).get("labels") or {})


def _install_node_tools(bin_dir: Path) -> None:
    """``compute-domain-daemon`` (this checkout's), ``nvidia-imex`` and ``nvidia-imex-ctl`` (the stand-ins)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    daemon = bin_dir / "compute-domain-daemon"
    daemon.write_text(f'#!/bin/sh\nexec {sys.executable} -m dradriver compute-domain-daemon "$@"\n')
    daemon.chmod(0o755)
    standins.install("nvidia_imex", bin_dir / "nvidia-imex")
    standins.install("nvidia_imex_ctl", bin_dir / "nvidia-imex-ctl")


IMEX_CHANNEL_COUNT = 2048
"""``ImexChannelCount`` the emulated driver reports (NVIDIA's ``cmd/compute-domain-kubelet-plugin/nvlib.go``: channels
0-2047)."""
FABRIC_IMEX_MGMT_MINOR = 1
"""Minor of the ``fabric-imex-mgmt`` capability on the emulated nodes (inferred: no capture gives the number)."""


FABRIC_IMEX_MGMT_PREFIX = "/dev/nvidia-caps/nvidia-cap"
IMEX_SESSION_ENV = "DRADRIVER_FABRIC_IMEX_MGMT"
"""Where the ``nvidia-imex`` stand-in takes its node's one IMEX session (its docstring)."""
IMEX_UNIT_INVOCATION = Path("run") / "systemd" / "units" / "invocation:nvidia-imex.service"
"""The link systemd keeps while ``nvidia-imex.service`` is active (:mod:`dradriver.host.imexservice`)."""


def fabric_imex_mgmt(node: EmulatedNode) -> Path:
    """Node ``node``'s ``fabric-imex-mgmt`` capability device (``<root>/dev/nvidia-caps/nvidia-cap<minor>``): every
    ``nvidia-imex`` of the node, the host's and each daemon pod's, opens it, and only one holds it at a time."""
    path = node.root / f"dev{FABRIC_IMEX_MGMT_PREFIX[4:]}{FABRIC_IMEX_MGMT_MINOR}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _write_imex_proc(proc: Path) -> None:
    """What the NVIDIA driver shows about IMEX under ``/proc``: ``driver/nvidia/params`` with the channel count and
    ``driver/nvidia/capabilities/fabric-imex-mgmt`` with the capability's device minor."""
    params = proc / "driver" / "nvidia" / "params"
    params.parent.mkdir(parents=True, exist_ok=True)
    params.write_text(f"ImexChannelCount: {IMEX_CHANNEL_COUNT}\n")
    cap = proc / "driver" / "nvidia" / "capabilities" / "fabric-imex-mgmt"
    cap.parent.mkdir(parents=True, exist_ok=True)
    cap.write_text(f"DeviceFileMinor: {FABRIC_IMEX_MGMT_MINOR}\nDeviceFileMode: 256\nDeviceFileModify: 1\n")


def flag_environment(flags: Sequence[Flag], config: PluginConfig) -> dict[str, str]:
    """The environment twins of ``flags`` that give a plugin ``config`` (the explicit feature gates only)."""
    env: dict[str, str] = {}
    for flag in flags:
        if not hasattr(config, flag.dest):
            continue
        value = getattr(config, flag.dest)
        if isinstance(value, FeatureGates):
            env[flag.env] = ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(value.explicit.items()))
        elif isinstance(value, bool):
            env[flag.env] = "true" if value else "false"
        elif isinstance(value, tuple):
            env[flag.env] = ",".join(str(v) for v in value)
        elif value is not None:
            env[flag.env] = str(value)
    return env


# -------------------------------------------------------------------------------------------------- runtime
class NodeRuntime(Workloads):
    """The container runtime of one emulated node: runs its DaemonSet Pods once their claims are prepared, with
    the CDI edits, field references, hosts file and tools described in the module docstring."""

    def __init__(self, cluster: MultiNodeCluster, node: EmulatedNode, *, time_scale: float,
                 interval_s: float) -> None:
        assert node.sandbox.api is not None
        super().__init__(node.sandbox.api, node.name, node.root / "pods", time_scale=time_scale,
                         interval_s=interval_s, say=cluster.say)
        self.cluster = cluster
        self.node = node

    def reconcile(self) -> None:
        """One pass of this node's container runner (the DaemonSet controller is cluster-wide)."""
        self._reconcile_pods()

    def runs(self, pod: JSONDict) -> bool:
        return bool(_owner_uid(pod, "DaemonSet"))

    def can_start(self, pod: JSONDict) -> bool:
        return _ref_key(pod) in self.node.pod_devices and not self.node.pulling

    def extra_mounts(self, pod: JSONDict, container: JSONDict) -> list[tuple[str, str]]:
        edits = self.node.pod_devices.get(_ref_key(pod), CdiEdits())
        return [(c.rstrip("/") or "/", h) for c, h in edits.mounts]

    def container_env(self, pod: JSONDict, container: JSONDict, directory: Path) -> dict[str, str]:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        edits = self.node.pod_devices.get(_ref_key(pod), CdiEdits())
        hosts = directory / "hosts"
        if not hosts.exists():
            hosts.write_text(f"127.0.0.1\tlocalhost\n{self.node.ip}\t{meta['name']}\n")
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace", "default"),
                  "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
                  "status.podIP": self.node.ip, "status.hostIP": self.node.ip,
                  "spec.serviceAccountName": spec.get("serviceAccountName", "default")}
        env = {"PATH": f"{self.node.bin_dir}:{self.node.sandbox.driver_root / 'usr' / 'bin'}:{BASE_PATH}",
               "PYTHONPATH": str(REPO_ROOT), "HOME": str(directory), "KUBECONFIG": self.node.sandbox.kubeconfig,
               "DRADRIVER_HOSTS_FILE": str(hosts), "DRADRIVER_POLL_INTERVAL_SECONDS": str(self.cluster.daemon_poll_s),
               **edits.env}
        imexd = dict(edits.mounts).get("/imexd")
        if imexd:
            env["DRADRIVER_IMEXD_DIR"] = imexd
        for device in edits.device_nodes:  # the fabric-imex-mgmt capability: the node's one IMEX session
            if str(device.get("path", "")).startswith(FABRIC_IMEX_MGMT_PREFIX):
                env[IMEX_SESSION_ENV] = str(fabric_imex_mgmt(self.node))
        for item in container.get("env") or []:
            ref = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if ref in fields:
                env[str(item["name"])] = str(fields[ref])
        return env

    def status_extra(self, pod: JSONDict) -> JSONDict:
        return {"hostIP": self.node.ip, "podIP": self.node.ip, "podIPs": [{"ip": self.node.ip}]}


# -------------------------------------------------------------------------------------------------- cluster
@dataclass
class _PodPrepare:
    refs: list[ClaimRef]
    future: concurrent.futures.Future[dict[str, ClaimResult]]


NET_LOCK_PORT = 49999
"""The port of the socket that reserves a cluster's ``127.<net>.0.0/16`` on this host (see :func:`_reserve_net`)."""


def _reserve_net() -> tuple[socket.socket, int]:
    """Pick the second octet of the loopback network a cluster's nodes get addresses in (``127.<net>.<rack>.<tray
    + 1>``) and hold it: a TCP socket bound, without ``SO_REUSEADDR``, to ``127.<net>.0.1:49999`` (no node has a
    rack 0) stays bound until :meth:`MultiNodeCluster.close`, so a cluster in another process (two test runs at
    once) cannot take the same network and find its ``nvidia-imex`` port (50000) in use.

    :returns: the bound socket and ``net`` (100-250).
    :raises MultiNodeError: every network of the range is held.
    """
    nets = list(range(100, 251))
    random.shuffle(nets)
    for net in nets:
        lock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lock.bind((f"127.{net}.0.1", NET_LOCK_PORT))
        except OSError:
            lock.close()
            continue
        return lock, net
    raise MultiNodeError("every loopback network 127.100-250.0.0/16 is held by another emulated cluster")


class MultiNodeCluster:
    """N emulated nodes in racks on one API emulator, with the controllers of the module docstring.

    Use as a context manager: :meth:`start` begins the loops (plugins are started separately with
    :meth:`start_plugins`), :meth:`close` stops every process and removes every node root.

    :param racks: nodes per rack, e.g. ``(2, 2)``: rack 1 with trays 0-1, rack 2 with trays 0-1.
    :param api: an API emulator to use; a new one when ``None`` (stopped on close).
    :param time_scale: factor on probe periods and back-offs of the container runner.
    :param interval_s: poll interval of the loops, seconds.
    :param say: progress lines.
    :param plugin_overrides: extra :class:`PluginConfig` fields for every node's plugin.
    :param fabric: rack number -> ``(state, status)`` to report instead of COMPLETED/SUCCESS on that rack's GPUs.
    :param daemon_poll_s: the IMEX daemons' poll interval (``DRADRIVER_POLL_INTERVAL_SECONDS``), seconds.
    :param namespace: the driver namespace (plugins' and controller's ``NAMESPACE``): daemon DaemonSets, their
        templates and the ComputeDomainCliques live there.
    :param lease_renew_s: how often each kubelet renews its node Lease, seconds (a kubelet: 10 s).
    :param host_imex: host-managed IMEX (``IMEX_MODE=hostManaged``, gate ``HostManagedIMEXDaemon``, for plugins and
        controller): each node runs the host's own ``nvidia-imex`` (:meth:`start_host_imex`, as its systemd unit
        would) whose ``nodes.cfg`` lists every node of its rack; no daemon DaemonSets.
    :param channel_isolation: ``IMEX_ISOLATION=channel`` (needs ``host_imex``): each ComputeDomain its own IMEX
        channel, so several domains share a node.
    :param binding_conditions: KEP-5007 on: the scheduler's gate ``DRADeviceBindingConditions`` and every plugin's
        ``BINDING_CONDITIONS=true`` (module docstring, "Scheduler").
    :param binding_timeout_s: the scheduler's ``bindingTimeout``, seconds.
    :param pre_warmed: pre-warmed IMEX (``IMEX_MODE=preWarmed`` for plugins and controller): the controller's
        DaemonSet per rack clique runs an IMEX daemon pod on every node before any ComputeDomain exists, each
        domain its own channel.
    """

    def __init__(self, racks: Sequence[int] = (2, 2), *, api: ApiServerEmulator | None = None,
                 time_scale: float = 0.1, interval_s: float = 0.05, say: Callable[[str], None] | None = None,
                 plugin_overrides: Mapping[str, Any] | None = None,
                 fabric: Mapping[int, tuple[int, int]] | None = None, daemon_poll_s: float = 0.2,
                 namespace: str = SANDBOX_NAMESPACE, lease_renew_s: float = 0.2, host_imex: bool = False,
                 channel_isolation: bool = False, binding_conditions: bool = False,
                 binding_timeout_s: float = scheduler.BINDING_TIMEOUT_S, pre_warmed: bool = False) -> None:
        if not racks or any(n < 1 or n > mock.RACK_TRAYS for n in racks) or len(racks) > len(RACK_PROFILES):
            raise MultiNodeError(f"racks must list 1..{len(RACK_PROFILES)} racks of 1..{mock.RACK_TRAYS} nodes, "
                                 f"not {list(racks)}")
        if channel_isolation and not host_imex:
            raise MultiNodeError("channel isolation needs host-managed IMEX (host_imex=True): "
                                 + CHANNEL_NEEDS_HOST_MANAGED)
        if pre_warmed and host_imex:
            raise MultiNodeError("pre-warmed and host-managed IMEX are two different modes: choose one")
        self.host_imex, self.channel_isolation, self.pre_warmed = host_imex, channel_isolation, pre_warmed
        self._owns_api = api is None
        self.api = api if api is not None else ApiServerEmulator().start()
        self.time_scale, self.interval_s, self.daemon_poll_s = time_scale, interval_s, daemon_poll_s
        self.say = say or (lambda text: log.info("%s", text))
        self.namespace = namespace
        self.lease_renew_s = lease_renew_s
        self.killed: set[str] = set()
        """Names of the nodes :meth:`kill_node` stopped (until :meth:`heal_node`)."""
        self._renewed: dict[str, float] = {}  # node -> monotonic time of its last Lease renewal
        self.binding_conditions, self.binding_timeout_s = binding_conditions, binding_timeout_s
        self.plugin_overrides = {"namespace": namespace, **({"binding_conditions": True} if binding_conditions else {}),
                                 **(plugin_overrides or {})}
        self._binding: dict[str, str] = {}  # pod key -> the node it waits in PreBind for
        self._schedule_at: dict[str, float] = {}  # pod key -> monotonic time of its next scheduling attempt
        self.controllers: list[subprocess.Popen[bytes]] = []
        self._net_lock, self.net = _reserve_net()
        self.nodes: dict[str, EmulatedNode] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=4 * sum(racks) + 2,
                                                               thread_name_prefix="kubelet-prepare")
        self._inflight: dict[str, dict[str, _PodPrepare]] = {}
        self._last_error: dict[str, str] = {}
        self._cdi_ids: dict[str, list[str]] = {}  # claim UID -> the CDI device IDs its prepare returned
        self._drivers: dict[str, tuple[str, ...]] = {}  # claim UID -> the drivers of its allocation results
        self._backoff: dict[str, float] = {}  # pod key -> the last retry delay after a failed prepare, seconds
        self._retry_at: dict[str, float] = {}  # pod key -> monotonic time of the next prepare
        self._ready_since: dict[str, float] = {}  # DaemonSet Pod UID -> monotonic time it was first seen Ready
        try:
            for rack, count in enumerate(racks, start=1):
                for tray in range(count):
                    state, status = (fabric or {}).get(rack, (None, None))
                    self._add_node(rack, tray, fabric_state=state, fabric_status=status)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ set-up
    def _add_node(self, rack: int, tray: int, *, fabric_state: int | None, fabric_status: int | None) -> None:
        name = f"rack{rack}-node{tray:02d}"
        sandbox = SandboxNode(profile=RACK_PROFILES[rack], node_name=name, api=self.api)  # driver version
        profile = mock.rack_node_profile(RACK_PROFILES[rack], tray, sandbox.root / "nvml",
                                         fabric_state=fabric_state, fabric_status=fabric_status)
        sandbox.profile = str(profile)
        node = EmulatedNode(name, rack, tray, f"127.{self.net}.{rack}.{tray + 1}", sandbox, profile)
        _install_node_tools(node.bin_dir)
        _write_imex_proc(sandbox.root / "proc")
        obj = self.api.get("Node", name)
        assert obj is not None
        obj["metadata"].setdefault("labels", {}).update({HOSTNAME_LABEL: name, RACK_LABEL: str(rack)})
        obj.setdefault("status", {})["addresses"] = [{"type": "InternalIP", "address": node.ip},
                                                     {"type": "Hostname", "address": name}]
        self.api.update(obj)
        node.kubelet = SyncKubeletEmulator(sandbox.config().kubelet_registrar_directory_path)
        node.runtime = NodeRuntime(self, node, time_scale=self.time_scale, interval_s=self.interval_s)
        self.nodes[name] = node
        self._inflight[name] = {}

    def install_compute_domains(self) -> None:
        """Create what ``deploy/`` installs for ComputeDomains: the ComputeDomain and ComputeDomainClique CRDs and
        the DeviceClasses (``compute-domain-default-channel.nvidia.com``, ``compute-domain-daemon.nvidia.com``
        beside the GPU ones)."""
        from importlib import resources

        self.api.install_crds()
        text = resources.files("dradriver.sandbox").joinpath("manifests", "deviceclasses.yaml").read_text()
        for obj in yaml.safe_load_all(text):
            if obj and self.api.get("DeviceClass", obj["metadata"]["name"]) is None:
                self.api.create(obj)

    def node(self, name: str) -> EmulatedNode:
        """The node called ``name``.

        :raises MultiNodeError: no such node.
        """
        try:
            return self.nodes[name]
        except KeyError:
            raise MultiNodeError(f"no node {name!r}; nodes: {', '.join(self.nodes)}") from None

    def rack_nodes(self, rack: int) -> list[EmulatedNode]:
        """The nodes of rack ``rack``, by tray."""
        return [n for n in self.nodes.values() if n.rack == rack]

    def plugin_config(self, node: EmulatedNode) -> PluginConfig:
        """The compute-domain kubelet plugin's configuration on ``node``."""
        from dataclasses import replace

        config = node.sandbox.config(driver_name=COMPUTE_DOMAIN_DRIVER.driver_name, mock_profile=str(node.profile))
        if self.host_imex:
            config = replace(config, imex_mode="hostManaged",
                             imex_isolation="channel" if self.channel_isolation else "domain",
                             imex_host_socket_path=str(self.host_imex_socket(node)),
                             feature_gates=config.feature_gates.with_gates(**{HOST_MANAGED_IMEX_DAEMON: True}))
        if self.pre_warmed:
            config = replace(config, imex_mode="preWarmed", imex_isolation="channel", gpu_clique_label_enabled=True)
        return replace(config, **self.plugin_overrides)

    # ------------------------------------------------------------------------------------------ host IMEX
    @staticmethod
    def host_imex_socket(node: EmulatedNode) -> Path:
        """The Unix socket of node ``node``'s host IMEX command service (``IMEX_CMD_UNIX_DOMAIN_PATH``; NVIDIA's
        host default ``/etc/nvidia-imex/imex_ctrl.sock``), which its plugin's ``nvidia-imex-ctl -q`` asks."""
        return node.root / "host-imex" / "imex_ctrl.sock"

    def start_host_imex(self, *, timeout_s: float = 60.0) -> None:
        """Host-managed IMEX: start on each node the host's ``nvidia-imex`` (the stand-in of the node's driver
        root, as the host's ``nvidia-imex.service`` would run it) with ``<root>/host-imex/config.cfg`` (peers on
        ``<node ip>:50000``, command service on its Unix socket, :meth:`host_imex_socket`) and a static
        ``nodes_config.cfg`` listing every node of its rack (one NVL72 rack, one clique: the operator's file),
        holding the node's IMEX session (:func:`fabric_imex_mgmt`) and marked active as systemd marks the unit
        (:data:`IMEX_UNIT_INVOCATION` in the driver root, which a driver-managed plugin refuses to start beside);
        wait until each answers ``nvidia-imex-ctl -q`` with ``READY``.

        :raises MultiNodeError: not a host-managed cluster, a daemon exited, or not ready in ``timeout_s``.
        """
        if not self.host_imex:
            raise MultiNodeError("start_host_imex: this cluster runs driver-managed IMEX (host_imex=False)")
        for node in self.nodes.values():
            if node.host_imex is not None and node.host_imex.poll() is None:
                continue
            conf = node.root / "host-imex"
            conf.mkdir(exist_ok=True)
            (conf / "nodes_config.cfg").write_text("".join(f"{n.ip}\n" for n in self.rack_nodes(node.rack)))
            (conf / "hosts").write_text(f"127.0.0.1\tlocalhost\n{node.ip}\t{node.name}\n")
            (conf / "config.cfg").write_text(
                f"SERVER_PORT=50000\nBIND_INTERFACE_IP={node.ip}\nIMEX_CMD_ENABLED=1\nIMEX_CMD_PORT=50005\n"
                f"IMEX_CMD_BIND_INTERFACE_IP={node.ip}\nIMEX_CMD_UNIX_DOMAIN_PATH={self.host_imex_socket(node)}\n"
                f"IMEX_NODE_CONFIG_FILE={conf / 'nodes_config.cfg'}\nLOG_FILE_NAME={conf / 'nvidia-imex.log'}\n")
            binary = node.sandbox.driver_root / "usr" / "bin" / "nvidia-imex"
            node.host_imex = subprocess.Popen([str(binary), "-c", str(conf / "config.cfg")],
                                              env={**os.environ, "DRADRIVER_HOSTS_FILE": str(conf / "hosts"),
                                                   IMEX_SESSION_ENV: str(fabric_imex_mgmt(node))},
                                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, start_new_session=True)
            link = node.sandbox.driver_root / IMEX_UNIT_INVOCATION  # as systemd marks the active unit
            link.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.symlink(f"{node.host_imex.pid:032x}", link)
            self.say(f"node {node.name}: host nvidia-imex started (pid {node.host_imex.pid}), nodes.cfg: rack "
                     f"{node.rack}")
        for node in self.nodes.values():
            self.wait_for(f"node {node.name}: host nvidia-imex READY", functools.partial(self._host_imex_ready, node),
                          timeout_s=timeout_s)

    def host_imex_state(self, node: EmulatedNode) -> str:
        """What ``nvidia-imex-ctl -q -u <socket>`` prints for node ``node``'s host IMEX daemon, stripped."""
        ctl = node.sandbox.driver_root / "usr" / "bin" / "nvidia-imex-ctl"
        done = subprocess.run([str(ctl), "-q", f"--u={self.host_imex_socket(node)}"], capture_output=True, text=True,
                              timeout=30, check=False)
        return done.stdout.strip()

    def _host_imex_ready(self, node: EmulatedNode) -> bool:
        if node.host_imex is not None and node.host_imex.poll() is not None:
            raise MultiNodeError(f"node {node.name}: host nvidia-imex exited {node.host_imex.returncode}")
        return self.host_imex_state(node) == "READY"

    def start_plugin(self, name: str, *, extra_env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``dradriver compute-domain-kubelet-plugin`` for node ``name`` (a process of its own, since the
        mock NVML serves one profile per process) and return it; output goes to :attr:`EmulatedNode.plugin_log`."""
        node = self.node(name)
        env = {**os.environ, **flag_environment(COMPUTE_DOMAIN_PLUGIN_FLAGS, self.plugin_config(node)),
               "PYTHONPATH": str(REPO_ROOT), mock.CONTROL_ENV: str(node.sandbox.nvml_control),
               "LD_LIBRARY_PATH": str(mock.library_path().parent), **(extra_env or {})}
        with open(node.plugin_log, "ab") as out:
            node.plugin = subprocess.Popen([sys.executable, "-m", "dradriver", "compute-domain-kubelet-plugin"],
                                           env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        self.say(f"node {name}: compute-domain kubelet plugin started (pid {node.plugin.pid})")
        return node.plugin

    def start_plugins(self, *, timeout_s: float = 60.0) -> None:
        """Start every node's plugin and wait until each has registered with its node's kubelet.

        :raises MultiNodeError: a plugin exited or did not register in ``timeout_s``; the message holds its log.
        """
        for name in self.nodes:
            self.start_plugin(name)
        for node in self.nodes.values():
            self.wait_for_plugin(node.name, timeout_s=timeout_s)

    def wait_for_plugin(self, name: str, *, timeout_s: float = 60.0) -> SyncPluginConnection:
        """Wait until node ``name``'s plugin is registered (real gRPC GetInfo) and return the connection.

        :raises MultiNodeError: the process exited or did not register in ``timeout_s``.
        """
        node = self.node(name)
        assert node.kubelet is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if node.plugin is not None and node.plugin.poll() is not None:
                raise MultiNodeError(f"node {name}: plugin exited {node.plugin.returncode}:\n{self._tail(node)}")
            node.kubelet.scan()
            with contextlib.suppress(KubeletError):
                return node.kubelet.plugin(COMPUTE_DOMAIN_DRIVER.driver_name)
            if time.monotonic() > deadline:
                raise MultiNodeError(f"node {name}: plugin not registered after {timeout_s} s:\n{self._tail(node)}")
            time.sleep(0.05)

    def start_gpu_plugin(self, name: str) -> subprocess.Popen[bytes]:
        """Start ``dradriver gpu-kubelet-plugin`` for node ``name`` on the node's tray of GPUs (its own process, the
        mock NVML's profile the node's) and return it; output goes to :attr:`EmulatedNode.gpu_plugin_log`."""
        from dataclasses import replace

        node = self.node(name)
        config = replace(node.sandbox.config(mock_profile=str(node.profile)), **self.plugin_overrides)
        env = {**os.environ, **plugin_environment(config), "PYTHONPATH": str(REPO_ROOT),
               mock.CONTROL_ENV: str(node.sandbox.nvml_control), "LD_LIBRARY_PATH": str(mock.library_path().parent)}
        with open(node.gpu_plugin_log, "ab") as out:
            node.gpu_plugin = subprocess.Popen([sys.executable, "-m", "dradriver", "gpu-kubelet-plugin"], env=env,
                                               stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True)
        self.say(f"node {name}: GPU kubelet plugin started (pid {node.gpu_plugin.pid})")
        return node.gpu_plugin

    def start_gpu_plugins(self, *, timeout_s: float = 60.0) -> None:
        """Start every node's GPU kubelet plugin and wait until each has registered with its node's kubelet.

        :raises MultiNodeError: a plugin exited or did not register in ``timeout_s``; the message holds its log.
        """
        for name in self.nodes:
            self.start_gpu_plugin(name)
        for node in self.nodes.values():
            assert node.kubelet is not None
            deadline = time.monotonic() + timeout_s
            while True:
                if node.gpu_plugin is not None and node.gpu_plugin.poll() is not None:
                    raise MultiNodeError(f"node {node.name}: GPU plugin exited {node.gpu_plugin.returncode}:\n"
                                         f"{self._tail(node, log_file=node.gpu_plugin_log)}")
                node.kubelet.scan()
                with contextlib.suppress(KubeletError):
                    node.kubelet.plugin(GPU_DRIVER.driver_name)
                    break
                if time.monotonic() > deadline:
                    raise MultiNodeError(f"node {node.name}: GPU plugin not registered after {timeout_s} s:\n"
                                         f"{self._tail(node, log_file=node.gpu_plugin_log)}")
                time.sleep(0.05)

    @staticmethod
    def _tail(node: EmulatedNode, lines: int = 40, *, log_file: Path | None = None) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((log_file or node.plugin_log).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop_plugin(self, name: str, *, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Send ``sig`` to node ``name``'s plugin and wait for it; returns its exit code."""
        node = self.node(name)
        if node.plugin is None:
            return None
        if node.plugin.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                node.plugin.send_signal(sig)
            try:
                node.plugin.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                node.plugin.kill()
                node.plugin.wait(timeout=10)
        code = node.plugin.returncode
        node.plugin = None
        return code

    # ------------------------------------------------------------------------------------------ controller
    @property
    def kubeconfig(self) -> str:
        """A kubeconfig for the cluster's API emulator (the first node's)."""
        return next(iter(self.nodes.values())).sandbox.kubeconfig

    def start_controller(self, *, extra_env: Mapping[str, str] | None = None,
                         log_name: str = "controller.log") -> subprocess.Popen[bytes]:
        """Start ``dradriver compute-domain-controller`` (driver namespace :attr:`namespace`, image
        :data:`~dradriver.sandbox.node.SANDBOX_IMAGE`) as a process of its own; output to ``<first node root>/
        <log_name>``. Several may run (leader election, with ``extra_env``)."""
        first = next(iter(self.nodes.values()))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KUBECONFIG": self.kubeconfig, "NAMESPACE": self.namespace,
               "IMAGE_NAME": SANDBOX_IMAGE, "LOG_VERBOSITY_CD_DAEMON": "4", **(extra_env or {})}
        if self.host_imex:
            gates = ",".join(g for g in (env.get("FEATURE_GATES", ""), f"{HOST_MANAGED_IMEX_DAEMON}=true") if g)
            env.update({"IMEX_MODE": "hostManaged", "IMEX_ISOLATION": "channel" if self.channel_isolation else "domain",
                        "FEATURE_GATES": gates})
        if self.pre_warmed:
            env.update({"IMEX_MODE": "preWarmed", "IMEX_ISOLATION": "channel"})
        with open(first.root / log_name, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "dradriver", "compute-domain-controller"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.controllers.append(proc)
        self.say(f"compute-domain controller started (pid {proc.pid})")
        return proc

    def controller_log(self, log_name: str = "controller.log") -> str:
        """The controller's output so far."""
        with contextlib.suppress(OSError):
            return (next(iter(self.nodes.values())).root / log_name).read_text(errors="replace")
        return ""

    def stop_controllers(self, *, sig: int = signal.SIGTERM) -> None:
        """Stop every controller process started here."""
        for proc in self.controllers:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.controllers.clear()

    # ------------------------------------------------------------------------------------------- loops
    def start(self) -> MultiNodeCluster:
        """Start the controller thread (scheduler, DaemonSet controller) and each node's kubelet thread; a
        cluster already started is left as it is (``with MultiNodeCluster(...)`` starts it: a second set of
        loops would run every node's pods twice and race on the runtime's state)."""
        if any(t.is_alive() for t in self._threads):
            return self
        self._stop.clear()
        threads = [threading.Thread(target=self._loop, args=(self.reconcile_control_plane,), daemon=True,
                                    name="sandbox-control-plane")]
        for node in self.nodes.values():
            threads.append(threading.Thread(target=self._loop, args=(lambda n=node: self.reconcile_node(n),),
                                            daemon=True, name=f"sandbox-kubelet-{node.name}"))
        threads.append(threading.Thread(target=self._heartbeat_loop, daemon=True, name="sandbox-node-leases"))
        for t in threads:
            t.start()
        self._threads = threads
        return self

    def _loop(self, body: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                body()
            except Exception:  # one bad object must not end the loop; the next pass retries
                log.exception("multi-node sandbox: reconcile failed")
            self._stop.wait(self.interval_s)

    def reconcile_control_plane(self) -> None:
        """One pass of the DaemonSet controller and the scheduler."""
        self._reconcile_daemonsets()
        self._schedule()

    # ----------------------------------------------------------------------------------- DaemonSets
    def _node_objects(self) -> dict[str, JSONDict]:
        return {n["metadata"]["name"]: n for n in self.api.objects("Node") if n["metadata"]["name"] in self.nodes}

    def _reconcile_daemonsets(self) -> None:
        pods = self.api.objects("Pod")
        nodes = self._node_objects()
        now = time.monotonic()
        seen: set[str] = set()
        for ds in self.api.objects("DaemonSet"):
            meta = ds["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            template = (ds.get("spec") or {}).get("template") or {}
            spec = template.get("spec") or {}
            owned = sorted((p for p in pods if _owner_uid(p, "DaemonSet") == meta["uid"]),
                           key=lambda p: (str(p["metadata"].get("creationTimestamp", "")),
                                          int(p["metadata"].get("resourceVersion") or 0)))
            wanted = sorted(n for n, obj in nodes.items() if node_matches(spec, obj))
            by_node: dict[str, list[JSONDict]] = {}
            for p in owned:
                by_node.setdefault(str((p.get("spec") or {}).get("nodeName", "")), []).append(p)
            try:
                strategy = daemonsets.update_strategy(ds, len(wanted))
            except ValueError as exc:
                self._report(f"daemonset/{meta['namespace']}/{meta['name']}", str(exc))
                continue
            live = {n: [p for p in by_node.get(n, []) if not p["metadata"].get("deletionTimestamp")] for n in wanted}
            ready = {str(p["metadata"]["name"]): _pod_ready(p) for p in owned}
            for p in owned:  # Ready since (this controller's clock): available after minReadySeconds
                uid = str(p["metadata"]["uid"])
                seen.add(uid)
                if ready[str(p["metadata"]["name"])]:
                    self._ready_since.setdefault(uid, now)
                else:
                    self._ready_since.pop(uid, None)
            available = {str(p["metadata"]["name"]): ready[str(p["metadata"]["name"])]
                         and now - self._ready_since.get(str(p["metadata"]["uid"]), now) >= strategy.min_ready_s
                         for p in owned}
            plan = daemonsets.rolling_update(ds, live, strategy=strategy, ready=ready, available=available)
            for node_name in wanted:
                if not by_node.get(node_name):  # none at all: a Pod still terminating is waited for (docstring)
                    self._create_daemon_pod(ds, node_name)
                elif strategy.max_surge == 0 and len(live[node_name]) > 1:  # more than one: all but the oldest go
                    for extra in live[node_name][1:]:
                        self._delete_daemon_pod(ds, extra, "more than one Pod on its node")
            for node_name in plan.surge:
                self._create_daemon_pod(ds, node_name)
            for p in owned:
                if p["metadata"]["name"] in plan.delete:
                    self._delete_daemon_pod(ds, p, "rolling update: its template is not the DaemonSet's")
            for node_name, node_pods in by_node.items():
                if node_name not in wanted:
                    for p in node_pods:
                        if not p["metadata"].get("deletionTimestamp"):
                            self._delete_daemon_pod(ds, p, f"node {node_name} no longer matches")
            status = {"desiredNumberScheduled": len(wanted), "currentNumberScheduled": len(plan.scheduled),
                      "numberReady": len(plan.ready), "numberMisscheduled": 0,
                      "updatedNumberScheduled": len(plan.updated), "numberAvailable": len(plan.available),
                      "numberUnavailable": len(wanted) - len(plan.available),
                      "observedGeneration": meta.get("generation", 1)}
            if {k: (ds.get("status") or {}).get(k) for k in status} != status:
                ds["status"] = {**(ds.get("status") or {}), **status}
                with contextlib.suppress(ApiStatusError):
                    self.api.update(ds, subresource="status")
        for uid in set(self._ready_since) - seen:
            del self._ready_since[uid]

    def _delete_daemon_pod(self, ds: JSONDict, pod: JSONDict, why: str) -> None:
        meta = ds["metadata"]
        self.say(f"DaemonSet {meta['namespace']}/{meta['name']}: deleting Pod {pod['metadata']['name']} on "
                 f"{(pod.get('spec') or {}).get('nodeName', '')}: {why}")
        with contextlib.suppress(ApiStatusError):
            self.api.delete("Pod", pod["metadata"]["name"], pod["metadata"]["namespace"])

    def _create_daemon_pod(self, ds: JSONDict, node_name: str) -> None:
        meta, template = ds["metadata"], ds["spec"]["template"]
        labels = {**((template.get("metadata") or {}).get("labels") or {}),
                  daemonsets.LABEL_REVISION_HASH: daemonsets.revision_hash(template),
                  daemonsets.LABEL_TEMPLATE_GENERATION: str(meta.get("generation", 1))}
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": f"{meta['name'][:57]}-{secrets.token_hex(3)[:5]}", "namespace": meta["namespace"],
                "labels": labels,
                "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": meta["name"],
                                     "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": {**json.loads(json.dumps(template.get("spec") or {})), "nodeName": node_name},
            "status": {"phase": "Pending"},
        }
        created = self.api.create(pod)
        self.say(f"DaemonSet {meta['namespace']}/{meta['name']}: created Pod {created['metadata']['name']} on "
                 f"{node_name} (revision {labels[daemonsets.LABEL_REVISION_HASH]})")

    # ------------------------------------------------------------------------------------ scheduling
    def _schedule(self) -> None:
        pods = self.api.objects("Pod")
        nodes = self._node_objects()
        bound = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            key = _ref_key(pod)
            try:
                names = self._pod_claim_names(pod)
                if names is None:
                    continue
                node_name = (pod.get("spec") or {}).get("nodeName")
                claims = [self.api.get("ResourceClaim", n, meta.get("namespace", "default")) for n in names]
                pod_ref = {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}
                if node_name and all(c is not None and pod_ref in (c.get("status") or {}).get("reservedFor", [])
                                     for c in claims):
                    continue
                if node_name:
                    self._allocate(pod, names, str(node_name))
                    continue
                if key in self._binding:
                    if self._prebind(pod, names, self._binding[key]):
                        bound.append({**pod, "spec": {**pod["spec"], "nodeName": self._binding.pop(key)}})
                    continue
                if time.monotonic() < self._schedule_at.get(key, 0.0):
                    continue
                reasons = []
                for candidate in sorted(nodes):
                    if not node_matches(pod.get("spec") or {}, nodes[candidate]):
                        reasons.append(f"{candidate}: node selection")
                        continue
                    if not pod_affinity_allows(pod, nodes[candidate], bound, nodes):
                        reasons.append(f"{candidate}: pod affinity")
                        continue
                    try:
                        self._allocate(pod, names, candidate)
                    except AllocationError as exc:
                        reasons.append(f"{candidate}: {exc}")
                        continue
                    if self.binding_conditions:
                        self._binding[key] = candidate
                        if self._prebind(pod, names, candidate):
                            del self._binding[key]
                            bound.append({**pod, "spec": {**pod["spec"], "nodeName": candidate}})
                        break
                    if self._bind(pod, candidate):
                        bound.append({**pod, "spec": {**pod["spec"], "nodeName": candidate}})
                    break
                else:
                    self._report(key, f"pod {key} pending: " + ("; ".join(reasons) or "no nodes"))
            except (AllocationError, ApiStatusError) as exc:
                self._report(key, f"pod {key}: {exc}")

    def _prebind(self, pod: JSONDict, names: list[str], node_name: str) -> bool:
        """PreBind of a Pod whose claims are allocated and reserved on ``node_name``: bind it once every binding
        condition is True (True: bound); on a failure or the timeout, unreserve (its claims deallocated) and try
        the Pod again after :data:`PREPARE_BACKOFF_S`."""
        meta = pod["metadata"]
        ns, key = meta.get("namespace", "default"), _ref_key(pod)
        refs = [(ns, n) for n in names]
        outcome = scheduler.prebind(self.api, refs, timeout_s=self.binding_timeout_s)
        if outcome.state == "ready":
            return self._bind(pod, node_name)
        if outcome.state == "waiting":
            self._report(key, f"pod {key} waits in PreBind on {node_name}: {outcome.message}")
            return False
        self._binding.pop(key, None)
        scheduler.unreserve(self.api, refs, {"resource": "pods", "name": meta["name"], "uid": meta["uid"]})
        self._schedule_at[key] = time.monotonic() + PREPARE_BACKOFF_S
        self._report(key, f"pod {key} not bound to {node_name} ({outcome.state}): {outcome.message}; its claims are "
                          "deallocated and it is scheduled again")
        return False

    def _report(self, key: str, message: str) -> None:
        if self._last_error.get(key) != message:
            self._last_error[key] = message
            self.say(f"! scheduler: {message}")

    def _pod_claim_names(self, pod: JSONDict) -> list[str] | None:
        """The Pod's claim names, creating claims from templates; None while a template is missing."""
        meta = pod["metadata"]
        ns = meta.get("namespace", "default")
        statuses = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get(
            "resourceClaimStatuses") or []}
        names: list[str] = []
        changed = False
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            if entry.get("resourceClaimName"):
                names.append(str(entry["resourceClaimName"]))
                continue
            if entry["name"] not in statuses:
                try:
                    claim = create_claim_from_template(self.api, pod, entry)
                except AllocationError as exc:
                    self._report(_ref_key(pod), str(exc))
                    return None
                self.say(f"resourceclaim controller: created claim {ns}/{claim['metadata']['name']} from template "
                         f"{entry['resourceClaimTemplateName']}")
                statuses[entry["name"]] = claim["metadata"]["name"]
                changed = True
            names.append(str(statuses[entry["name"]]))
        if changed:
            fresh = self.api.get("Pod", meta["name"], ns)
            if fresh is None:
                return None
            fresh.setdefault("status", {})["resourceClaimStatuses"] = [
                {"name": k, "resourceClaimName": v} for k, v in statuses.items()]
            self.api.update(fresh, subresource="status")
        return names

    def _allocate(self, pod: JSONDict, names: list[str], node_name: str) -> None:
        meta = pod["metadata"]
        ns = meta.get("namespace", "default")
        pod_ref = {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}
        allocated = scheduler.allocate(self.api, [(ns, n) for n in names], node_name=node_name, reserved_for=[pod_ref],
                                       binding_conditions=self.binding_conditions)
        devices = [f"{r['pool']}/{r['device']}" for c in allocated
                   for r in c["status"]["allocation"]["devices"]["results"]]
        if devices:
            self.say(f"scheduler: pod {ns}/{meta['name']} claims allocated on {node_name}: {', '.join(devices)}")

    def _bind(self, pod: JSONDict, node_name: str) -> bool:
        fresh = self.api.get("Pod", pod["metadata"]["name"], pod["metadata"].get("namespace", "default"))
        if fresh is None or fresh["spec"].get("nodeName"):
            return False
        fresh["spec"]["nodeName"] = node_name
        try:
            self.api.update(fresh)
        except ApiStatusError:
            return False
        self.say(f"scheduler: pod {_ref_key(fresh)} -> node {node_name}")
        return True

    # ------------------------------------------------------------------------------------------ kubelet
    def reconcile_node(self, node: EmulatedNode) -> None:
        """One pass of ``node``'s kubelet: prepare claims of its bound Pods, report workload Pods running, run the
        container runner, unprepare claims no Pod uses."""
        assert node.kubelet is not None and node.runtime is not None
        if node.name in self.killed:
            return  # a dead node's kubelet does nothing
        plugins = self._plugins(node)
        inflight = self._inflight[node.name]
        in_use: set[str] = set()
        live: set[str] = set()
        for pod in self.api.objects("Pod"):
            meta, spec = pod["metadata"], pod.get("spec") or {}
            if spec.get("nodeName") != node.name:
                continue
            key = _ref_key(pod)
            live.add(key)
            refs = self._prepared_refs(pod)
            if refs is None:
                continue
            if meta.get("deletionTimestamp") and not node.runtime.runs(pod):
                self._finish_deletion(pod)
                continue
            in_use.update(r.uid for r in refs)
            if meta.get("deletionTimestamp"):
                continue  # the runner stops its containers; claims stay prepared until the Pod is gone
            todo = [r for r in refs if r.uid not in node.prepared]
            job = inflight.get(key)
            if job is not None and job.future.done():
                del inflight[key]
                self._collect(node, pod, job)
                todo = [r for r in refs if r.uid not in node.prepared]
            elif job is not None:
                continue
            if todo and all(d in plugins for r in todo for d in self._drivers_of(r)):
                if time.monotonic() < self._retry_at.get(key, 0.0):
                    continue  # the kubelet backs off after a failed prepare
                inflight[key] = _PodPrepare(todo, self._executor.submit(self._prepare, plugins, todo))
                continue
            if not todo and key not in node.pod_devices:
                self._record_devices(node, pod, refs)
        for key in set(node.pod_devices) - live:
            del node.pod_devices[key]
        for key in set(inflight) - live:
            del inflight[key]
        node.runtime.reconcile()
        gone = [ref for uid, ref in node.prepared.items() if uid not in in_use
                and all(d in plugins for d in self._drivers_of(ref))]
        if gone:
            try:
                errors = self._unprepare(plugins, gone)
            except KubeletError as exc:
                self.say(f"! kubelet {node.name}: unprepare: {exc}")
                return
            for ref in gone:
                if errors.get(ref.uid):
                    self.say(f"! kubelet {node.name}: unprepare {ref.namespace}/{ref.name}: {errors[ref.uid]}")
                    continue
                del node.prepared[ref.uid]
                self.say(f"kubelet {node.name}: claim {ref.namespace}/{ref.name} unprepared")
                claim = self.api.get("ResourceClaim", ref.name, ref.namespace)
                if claim is not None and _owner_uid(claim, "Pod") and not self._owner_alive(claim):
                    with contextlib.suppress(ApiStatusError):
                        self.api.delete("ResourceClaim", ref.name, ref.namespace)

    def _plugins(self, node: EmulatedNode) -> dict[str, SyncPluginConnection]:
        """Driver name -> the connection of each plugin registered with ``node``'s kubelet now."""
        assert node.kubelet is not None
        out: dict[str, SyncPluginConnection] = {}
        with contextlib.suppress(KubeletError):
            node.kubelet.scan()
        for driver in (COMPUTE_DOMAIN_DRIVER.driver_name, GPU_DRIVER.driver_name):
            with contextlib.suppress(KubeletError):
                out[driver] = node.kubelet.plugin(driver)
        return out

    def _drivers_of(self, ref: ClaimRef) -> tuple[str, ...]:
        return self._drivers.get(ref.uid) or (COMPUTE_DOMAIN_DRIVER.driver_name,)

    def _by_driver(self, refs: Iterable[ClaimRef]) -> dict[str, list[ClaimRef]]:
        out: dict[str, list[ClaimRef]] = {}
        for ref in refs:
            for driver in self._drivers_of(ref):
                out.setdefault(driver, []).append(ref)
        return out

    def _prepare(self, plugins: Mapping[str, SyncPluginConnection], refs: list[ClaimRef]) -> dict[str, ClaimResult]:
        """NodePrepareResources of ``refs``, one call per driver (as the kubelet calls each claim's drivers);
        a claim of several drivers gets their devices and errors together."""
        out: dict[str, ClaimResult] = {}
        for driver, group in self._by_driver(refs).items():
            for uid, result in plugins[driver].prepare(group).items():
                had = out.get(uid)
                out[uid] = result if had is None else ClaimResult(
                    devices=had.devices + result.devices, error="; ".join(e for e in (had.error, result.error) if e))
        return out

    def _unprepare(self, plugins: Mapping[str, SyncPluginConnection], refs: list[ClaimRef]) -> dict[str, str]:
        """NodeUnprepareResources of ``refs``, one call per driver; claim UID -> its errors (``""``: none)."""
        out: dict[str, str] = {}
        for driver, group in self._by_driver(refs).items():
            for uid, error in plugins[driver].unprepare(group).items():
                out[uid] = "; ".join(e for e in (out.get(uid, ""), error) if e)
        return out

    # ------------------------------------------------------------------------------- heartbeat, failure
    def renew_node_lease(self, name: str, *, force: bool = False) -> None:
        """Renew (create when missing) the Lease ``kube-node-lease/<name>`` if ``lease_renew_s`` passed since the
        last renewal, or when ``force``."""
        clock = time.monotonic()
        if not force and clock - self._renewed.get(name, float("-inf")) < self.lease_renew_s:
            return
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # a MicroTime
        lease = self.api.get("Lease", name, NODE_LEASE_NAMESPACE)
        try:
            if lease is None:
                self.api.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                 "metadata": {"name": name, "namespace": NODE_LEASE_NAMESPACE},
                                 "spec": {"holderIdentity": name, "leaseDurationSeconds": NODE_LEASE_DURATION_S,
                                          "renewTime": stamp}})
            else:
                lease.setdefault("spec", {})["renewTime"] = stamp
                self.api.update(lease)
        except ApiStatusError:
            return  # raced with itself: renewed on the next pass
        self._renewed[name] = clock

    def _heartbeat_loop(self) -> None:
        """The kubelets' heartbeats (a kubelet renews its Lease apart from its Pod sync, so a slow prepare never
        delays it): every ``lease_renew_s``, each node not killed renews its Lease."""
        while not self._stop.wait(self.lease_renew_s):
            for name in list(self.nodes):
                if name not in self.killed:
                    try:
                        self.renew_node_lease(name, force=True)
                    except Exception:  # the next beat retries
                        log.exception("multi-node sandbox: renewing the Lease of node %s failed", name)

    def _node_pids(self, node: EmulatedNode) -> list[int]:
        pids: list[int] = []
        for plugin in (node.plugin, node.gpu_plugin):
            if plugin is not None and plugin.poll() is None:
                pids.append(plugin.pid)
        if node.runtime is not None:
            pids += node.runtime.container_pids()
        if node.host_imex is not None and node.host_imex.poll() is None:
            pids.append(node.host_imex.pid)
        return pids

    def kill_node(self, name: str) -> list[int]:
        """Make node ``name`` stop answering (module docstring): its kubelet stops (no Lease renewal), its
        plugin and containers are frozen (SIGSTOP); returns the frozen process IDs.

        :raises MultiNodeError: no such node.
        """
        node = self.node(name)
        self.killed.add(name)
        pids = self._node_pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        self.say(f"node {name} killed: kubelet stopped, {len(pids)} processes frozen")
        return pids

    def heal_node(self, name: str) -> list[int]:
        """Bring a node :meth:`kill_node` stopped back: its processes resume (SIGCONT), its kubelet renews the
        Lease at once and runs again; returns the resumed process IDs.

        :raises MultiNodeError: no such node.
        """
        node = self.node(name)
        pids = self._node_pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.killed.discard(name)
        self.renew_node_lease(name, force=True)
        self.say(f"node {name} healed: {len(pids)} processes resumed")
        return pids

    def _owner_alive(self, claim: JSONDict) -> bool:
        uid = _owner_uid(claim, "Pod")
        return any(p["metadata"]["uid"] == uid for p in self.api.objects("Pod", claim["metadata"]["namespace"]))

    def _prepared_refs(self, pod: JSONDict) -> list[ClaimRef] | None:
        """The Pod's claims once all are allocated and reserved for it; None before."""
        meta = pod["metadata"]
        ns = meta.get("namespace", "default")
        statuses = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get(
            "resourceClaimStatuses") or []}
        refs = []
        pod_ref = {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            name = entry.get("resourceClaimName") or statuses.get(entry["name"])
            claim = self.api.get("ResourceClaim", name, ns) if name else None
            if claim is None or pod_ref not in (claim.get("status") or {}).get("reservedFor", []):
                return None
            results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
            self._drivers[claim["metadata"]["uid"]] = tuple(sorted({str(r["driver"]) for r in results or ()}))
            refs.append(ClaimRef(ns, claim["metadata"]["name"], claim["metadata"]["uid"]))
        return refs

    def _collect(self, node: EmulatedNode, pod: JSONDict, job: _PodPrepare) -> None:
        key = _ref_key(pod)
        try:
            answer = job.future.result()
        except KubeletError as exc:
            self._prepare_failed(node, pod, str(exc))
            return
        failures = []
        for ref in job.refs:
            result = answer[ref.uid]
            if result.error:
                failures.append(f"{ref.namespace}/{ref.name}: {result.error}")
                continue
            node.prepared[ref.uid] = ref
            ids = [i for d in result.devices for i in d.cdi_device_ids]
            self.say(f"kubelet {node.name}: pod {key} claim {ref.name} prepared: {', '.join(ids) or '(no devices)'}")
            self._cdi_ids[ref.uid] = ids
        if failures:
            self._prepare_failed(node, pod, "; ".join(failures))
        else:
            node.prepare_errors.pop(key, None)
            self._backoff.pop(key, None)
            self._retry_at.pop(key, None)

    def _prepare_failed(self, node: EmulatedNode, pod: JSONDict, message: str) -> None:
        key = _ref_key(pod)
        delay = min(PREPARE_BACKOFF_MAX_S, self._backoff.get(key, PREPARE_BACKOFF_S / 2) * 2)
        self._backoff[key] = delay
        self._retry_at[key] = time.monotonic() + delay
        if node.prepare_errors.get(key) != message:
            node.prepare_errors[key] = message
            self.say(f"! kubelet {node.name}: prepare for pod {key}: {message}")

    def _record_devices(self, node: EmulatedNode, pod: JSONDict, refs: list[ClaimRef]) -> None:
        ids = [i for r in refs for i in self._cdi_ids.get(r.uid, [])]
        try:
            edits = cdi_edits(node.sandbox.cdi_root, ids)
        except MultiNodeError as exc:
            self._prepare_failed(node, pod, str(exc))
            return
        node.pod_devices[_ref_key(pod)] = edits
        assert node.runtime is not None
        if not node.runtime.runs(pod):
            self._mark_running(pod)

    def _mark_running(self, pod: JSONDict) -> None:
        fresh = self.api.get("Pod", pod["metadata"]["name"], pod["metadata"].get("namespace", "default"))
        if fresh is None or (fresh.get("status") or {}).get("phase") == "Running":
            return
        node = self.nodes[fresh["spec"]["nodeName"]]
        st = fresh.setdefault("status", {})
        st.update(phase="Running", hostIP=node.ip, podIP=node.ip, podIPs=[{"ip": node.ip}])
        st["conditions"] = [{"type": t, "status": "True"} for t in
                            ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        st["containerStatuses"] = [{"name": c.get("name", ""), "ready": True, "started": True, "restartCount": 0,
                                    "image": c.get("image", ""), "state": {"running": {}}}
                                   for c in fresh["spec"].get("containers") or []]
        with contextlib.suppress(ApiStatusError):
            self.api.update(fresh, subresource="status")
            self.say(f"kubelet {node.name}: pod {_ref_key(fresh)} running")

    def _finish_deletion(self, pod: JSONDict) -> None:
        """A workload Pod (no process) being deleted: nothing to stop; drop finalizers so it goes."""
        meta = pod["metadata"]
        if meta.get("finalizers"):
            meta["finalizers"] = []
            with contextlib.suppress(ApiStatusError):
                self.api.update(pod)

    # ------------------------------------------------------------------------------------------ queries
    def wait_for(self, what: str, predicate: Callable[[], Any], *, timeout_s: float = 60.0) -> Any:
        """Poll ``predicate`` until it returns a truthy value and return it.

        :raises MultiNodeError: ``timeout_s`` passed; the message names ``what`` and the last plugin errors.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                errors = {k: v for n in self.nodes.values() for k, v in n.prepare_errors.items()}
                raise MultiNodeError(f"timed out after {timeout_s} s waiting for {what}; prepare errors: {errors}; "
                                     f"scheduler: {self._last_error}")
            time.sleep(0.05)

    def pod_node(self, name: str, namespace: str = "default") -> EmulatedNode | None:
        """The node Pod ``namespace/name`` is bound to, if any."""
        pod = self.api.get("Pod", name, namespace)
        node_name = ((pod or {}).get("spec") or {}).get("nodeName")
        return self.nodes.get(str(node_name)) if node_name else None

    def force_delete_pod(self, name: str, namespace: str = "default") -> None:
        """``kubectl delete pod --force --grace-period=0``: the Pod object goes at once (finalizers dropped); its
        node's runner then stops the containers it was running (SIGTERM, SIGKILL after the grace period)."""
        pod = self.api.get("Pod", name, namespace)
        if pod is None:
            return
        if pod["metadata"].get("finalizers"):
            pod["metadata"]["finalizers"] = []
            self.api.update(pod)
        with contextlib.suppress(ApiStatusError):
            self.api.delete("Pod", name, namespace)

    def pod_running(self, name: str, namespace: str = "default") -> bool:
        """Pod ``namespace/name`` exists, is Running and Ready."""
        pod = self.api.get("Pod", name, namespace)
        return pod is not None and (pod.get("status") or {}).get("phase") == "Running" and _pod_ready(pod)

    def claim_state(self, name: str) -> dict[str, str]:
        """Claim UID -> state of every claim in node ``name``'s compute-domain plugin's claim state (read through
        :class:`~dradriver.host.claimstate.ClaimState` as a second instance does, under the node-wide lock)."""
        from dradriver.host.claimstate import ClaimState

        node = self.node(name)
        config = self.plugin_config(node)
        path = config.plugin_dir / COMPUTE_DOMAIN_DRIVER.state_file
        if not path.exists():
            return {}
        state = ClaimState.open(path, lock_path=config.lock_path,
                                boot_id_path=node.root / "proc" / "sys" / "kernel" / "random" / "boot_id")
        try:
            return {uid: str(getattr(record, "state", "")) for uid, record in state.claims().items()}
        finally:
            state.close()

    def claim_specs(self, name: str) -> list[str]:
        """The per-claim CDI spec files on node ``name`` (the base spec ``..._base`` excluded)."""
        return [p.name for p in self.node(name).sandbox.cdi_specs() if "claim" in p.name]

    def compute_domain_leftovers(self, cd_uid: str) -> dict[str, list[str]]:
        """What still refers to ComputeDomain ``cd_uid`` anywhere: node labels, ResourceClaimTemplates,
        DaemonSets, ComputeDomainCliques, daemon Pods (by the ``resource.nvidia.com/computeDomain`` label or the
        derived names), and on every node the per-claim CDI specs and claim-state entries. Empty lists: gone."""
        from dradriver.domain import computedomains as cd

        def labelled(kind: str) -> list[str]:
            out = []
            for obj in self.api.objects(kind):
                meta = obj["metadata"]
                if (meta.get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN) == cd_uid or \
                        meta["name"] == cd.daemon_object_name(cd_uid):
                    out.append(f"{meta.get('namespace', '')}/{meta['name']}")
            return out

        return {
            "node labels": [n for n, node in self.nodes.items()
                            if node.labels().get(cd.LABEL_COMPUTE_DOMAIN) == cd_uid],
            "resource claim templates": labelled("ResourceClaimTemplate"),
            "daemonsets": labelled("DaemonSet"),
            "cliques": labelled(cd.CLIQUE_KIND),
            "daemon pods": labelled("Pod"),
            "cdi specs": [f"{n}:{f}" for n in self.nodes for f in self.claim_specs(n)],
            "claim state": [f"{n}:{uid}" for n in self.nodes for uid in self.claim_state(n)],
        }

    # ------------------------------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        """Stop the loops (processes keep running)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    def close(self) -> None:
        """Stop the loops, every container, every plugin, the kubelets and (when owned) the API emulator; remove
        the node roots. Idempotent."""
        self.stop()
        self.stop_controllers()
        for name in list(self.killed):  # frozen processes cannot act on SIGTERM
            with contextlib.suppress(MultiNodeError):
                self.heal_node(name)
        for node in self.nodes.values():  # every plugin told at once (each takes a while), then each waited for
            for plugin in (node.plugin, node.gpu_plugin):
                if plugin is not None and plugin.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        plugin.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            if node.runtime is not None:
                node.runtime.stop()
        for name in list(self.nodes):
            self.stop_plugin(name, timeout_s=10)
        for node in self.nodes.values():
            if node.gpu_plugin is not None:
                try:
                    node.gpu_plugin.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.gpu_plugin.kill()
                    node.gpu_plugin.wait(timeout=10)
        for node in self.nodes.values():
            if node.host_imex is not None and node.host_imex.poll() is None:
                node.host_imex.terminate()
                try:
                    node.host_imex.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.host_imex.kill()
                    node.host_imex.wait(timeout=10)
            (node.sandbox.driver_root / IMEX_UNIT_INVOCATION).unlink(missing_ok=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for node in reversed(list(self.nodes.values())):
            if node.kubelet is not None:
                with contextlib.suppress(Exception):
                    node.kubelet.close()
            node.sandbox.close()
        self.nodes.clear()
        if self._owns_api:
            self.api.stop()
        self._net_lock.close()

    def __enter__(self) -> MultiNodeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
