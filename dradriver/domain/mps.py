"""MPS control daemons, pure part: NVIDIA's naming, host layout, Deployment, readiness rule and workload edits.

Facts from NVIDIA's driver (``cmd/gpu-kubelet-plugin/sharing.go``, ``cdi.go``;
``cmd/gpu-kubelet-plugin/sharing.go`` and ``templates/mps-control-daemon.tmpl.yaml`` there):

* one control daemon per config group per claim; its ID is ``<claim UID>-<first 5 hex digits of
  sha256(sorted device UUIDs joined by ",")>`` (full GPUs and static MIG devices of the group), its Deployment
  ``mps-control-daemon-<id>`` in the plugin's namespace (``--namespace``);
* host directories ``<plugins dir>/gpu.nvidia.com/mps/<id>/{pipe,shm,log}`` (mode 0755); ``shm`` is a tmpfs
  mounted ``rw,nosuid,nodev,noexec,relatime,size=<half of MemTotal from /proc/meminfo, unit kept>`` (``65536k``
  when MemTotal cannot be read);
* the Deployment: one replica, ``nodeName`` pinned, ``hostPID``, privileged, the plugin's image; its container
  starts ``nvidia-cuda-mps-control -d`` (``-M`` for multi-user), sends the default active thread percentage and
  the per-device pinned-memory limits, writes the startup marker ``startup complete`` to
  ``<log dir>/startup.log`` and follows ``control.log``; a startup probe ``cat``s the marker every second. The
  commands run ``chroot /driver-root`` when the driver root has a shell, else directly with ``PATH`` and
  ``LD_LIBRARY_PATH`` under ``/driver-root`` (GKE's COS driver root has no shell);
* ready = ``status.readyReplicas == 1``, exactly one Pod matching the selector, with exactly one container
  status, and that container ready;
* the workload's CDI edits, per device of the group: ``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps`` and bind
  mounts ``/dev/shm`` <- the shm directory and ``/tmp/nvidia-mps`` <- the pipe directory
  (``rw,nosuid,nodev,bind``). Like NVIDIA, the log directory is not given to workloads (only the daemon
  writes there).

The script and manifest text are this project's own; only the names, paths, commands and rules above are
NVIDIA's contract.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dradriver.domain.cdi import ContainerEdits, Mount

JSONDict = dict[str, Any]

MPS_DIR = "mps"
"""Name of the directory under the plugin directory (``<plugins dir>/gpu.nvidia.com/mps``)."""
PIPE_DIR, SHM_DIR, LOG_DIR = "pipe", "shm", "log"
DEPLOYMENT_PREFIX = "mps-control-daemon-"
CONTAINER_NAME = "mps-control-daemon"
CONTAINER_DRIVER_ROOT = "/driver-root"
"""Where the daemon's container sees the host's driver root."""
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
"""``CUDA_MPS_PIPE_DIRECTORY`` inside a workload container, and the daemon's own default (chroot mode)."""
CONTAINER_LOG_DIR = "/var/log/nvidia-mps"
"""The daemon's default ``CUDA_MPS_LOG_DIRECTORY`` (chroot mode)."""
STARTUP_MARKER = "startup complete"
STARTUP_LOG = "startup.log"
CONTROL_LOG = "control.log"
TMPFS_OPTIONS = ("rw", "nosuid", "nodev", "noexec", "relatime")
FALLBACK_SHM_SIZE = "65536k"
WORKLOAD_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
LABEL_APP = "app"
LABEL_CLAIM = "resource.nvidia.com/mps-claim-uid"
LABEL_NODE = "resource.nvidia.com/mps-node"
LABEL_KIND = "resource.nvidia.com/mps-kind"
"""Our own labels beside NVIDIA's ``app: <name>`` selector label: which claim and node a daemon serves, and which
component manages it (``claim``: the MPS sharing step; used to find daemons no stored claim knows)."""

_MEMTOTAL = re.compile(r"^MemTotal:\s+(\d+)\s*(\S*)\s*$", re.MULTILINE)


def control_daemon_id(claim_uid: str, uuids: Sequence[str]) -> str:
    """NVIDIA's daemon ID: ``<claim UID>-<sha256(",".join(sorted(uuids)))[:5]>``.

    :param uuids: the group's full-GPU and MIG-device UUIDs, any order.
    """
    digest = hashlib.sha256(",".join(sorted(uuids)).encode()).hexdigest()
    return f"{claim_uid}-{digest[:5]}"


def deployment_name(daemon_id: str) -> str:
    """``mps-control-daemon-<id>``."""
    return DEPLOYMENT_PREFIX + daemon_id


def shm_size(meminfo: str | None) -> str:
    """tmpfs ``size=`` for the shm directory: half of ``MemTotal`` with its unit kept (``16314612 kB`` ->
    ``8157306k``, the unit lower-cased as mount options take it), or ``65536k`` when ``meminfo`` is ``None`` or
    has no parsable ``MemTotal`` line (NVIDIA's fallback)."""
    if meminfo is None:
        return FALLBACK_SHM_SIZE
    match = _MEMTOTAL.search(meminfo)
    if match is None:
        return FALLBACK_SHM_SIZE
    value, unit = int(match.group(1)), match.group(2)
    unit = {"kB": "k", "KB": "k", "kb": "k", "": ""}.get(unit, unit[:1].lower())
    return f"{value // 2}{unit}"


def tmpfs_options(size: str) -> str:
    """``rw,nosuid,nodev,noexec,relatime,size=<size>``."""
    return ",".join((*TMPFS_OPTIONS, f"size={size}"))


@dataclass(frozen=True, slots=True)
class ControlDaemon:
    """One MPS control daemon: what it serves and how it is configured.

    :param daemon_id: :func:`control_daemon_id` of the claim and devices.
    :param claim_uid: the claim it serves (label ``resource.nvidia.com/mps-claim-uid``; the shares component sets
        the GPU's own key here).
    :param uuids: sorted UUIDs of every device the daemon serves (``CUDA_VISIBLE_DEVICES``).
    :param gpu_uuids: sorted UUIDs of the full GPUs among them (their compute mode becomes EXCLUSIVE_PROCESS;
        MIG devices have none of their own).
    :param active_thread_percentage: ``set_default_active_thread_percentage`` value, percent; ``None``: not sent.
    :param pinned_memory_limits: (UUID, ``"<n>M"``) pairs for ``set_default_device_pinned_mem_limit``.
    :param multi_user: start the daemon with ``-M``.
    """

    daemon_id: str
    claim_uid: str
    uuids: tuple[str, ...]
    gpu_uuids: tuple[str, ...]
    active_thread_percentage: int | None = None
    pinned_memory_limits: tuple[tuple[str, str], ...] = ()
    multi_user: bool = False

    @property
    def deployment(self) -> str:
        """The Deployment's name."""
        return deployment_name(self.daemon_id)

    def to_json(self) -> JSONDict:
        """The form stored in the daemon's directory and in undo records."""
        return {"id": self.daemon_id, "claim": self.claim_uid, "uuids": list(self.uuids),
                "gpus": list(self.gpu_uuids), "threads": self.active_thread_percentage,
                "pinned": [list(p) for p in self.pinned_memory_limits], "multiUser": self.multi_user}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ControlDaemon:
        """Inverse of :meth:`to_json`.

        :raises ValueError: a field is missing or of the wrong type.
        """
        try:
            threads = raw.get("threads")
            daemon = cls(str(raw["id"]), str(raw["claim"]), tuple(str(u) for u in raw["uuids"]),
                         tuple(str(u) for u in raw["gpus"]), None if threads is None else int(threads),
                         tuple((str(u), str(v)) for u, v in raw.get("pinned", [])), bool(raw.get("multiUser")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"MPS control daemon record {dict(raw)!r}: {exc}") from None
        if not daemon.daemon_id or "/" in daemon.daemon_id or daemon.daemon_id.startswith("."):
            raise ValueError(f"MPS control daemon record: bad id {daemon.daemon_id!r}")
        return daemon


@dataclass(frozen=True, slots=True)
class DaemonPlacement:
    """Where and as what the daemon's Deployment runs.

    :param namespace: the plugin's namespace (``--namespace``).
    :param node_name: this node (``spec.template.spec.nodeName``).
    :param image: the plugin's image (``--image-name``).
    :param driver_root: host path of the driver root (``--nvidia-driver-root``), mounted at ``/driver-root``.
    :param directory: host path of the daemon's directory (``<plugins dir>/gpu.nvidia.com/mps/<id>``).
    :param shm_in_driver_root: the plugin container has ``/driver-root/dev/shm``: the shm directory is mounted
        there, else at ``/dev/shm`` (NVIDIA's rule).
    :param feature_gates: the plugin's ``FEATURE_GATES`` value, passed to the daemon's container.
    :param kind: label ``resource.nvidia.com/mps-kind``: the component that manages the daemon.
    :param service_account: ``serviceAccountName`` of the Pod (``--service-account-name``; ``""``: the default).
    :param pull_secrets: ``imagePullSecrets`` names (``--image-pull-secrets``).
    :param pull_policy: ``imagePullPolicy`` (``--image-pull-policy``; ``""``: Kubernetes' default).
    """

    namespace: str
    node_name: str
    image: str
    driver_root: str
    directory: str
    shm_in_driver_root: bool = False
    feature_gates: str = ""
    kind: str = "claim"
    service_account: str = ""
    pull_secrets: tuple[str, ...] = ()
    pull_policy: str = ""


def _container_script(daemon: ControlDaemon) -> str:
    """The container's ``sh -c`` script (own text; commands and paths are NVIDIA's contract)."""
    start = "nvidia-cuda-mps-control -d" + (" -M" if daemon.multi_user else "")
    commands = [start]
    if daemon.active_thread_percentage is not None:
        commands.append(f"echo set_default_active_thread_percentage {int(daemon.active_thread_percentage)} | "
                        "nvidia-cuda-mps-control")
    for uuid, limit in daemon.pinned_memory_limits:
        commands.append(f"echo set_default_device_pinned_mem_limit {shlex.quote(uuid)} {shlex.quote(limit)} | "
                        "nvidia-cuda-mps-control")
    body = " && ".join(commands)
    root = CONTAINER_DRIVER_ROOT
    chrooted = (f'{body} && echo "{STARTUP_MARKER}" > {CONTAINER_LOG_DIR}/{STARTUP_LOG} && '
                f"exec tail -n +1 -F {CONTAINER_LOG_DIR}/{CONTROL_LOG}")
    return "\n".join((
        "set -eu",
        f'if [ -x {root}/bin/sh ] || [ -x {root}/usr/bin/sh ]; then',
        f"  exec chroot {root} sh -c {shlex.quote(chrooted)}",
        "fi",
        f'export PATH="{root}/usr/bin:{root}/bin:{root}/usr/sbin:{root}/sbin:$PATH"',
        f'export LD_LIBRARY_PATH="{root}/usr/lib64:{root}/usr/lib/x86_64-linux-gnu:'
        f'{root}/usr/lib/aarch64-linux-gnu:{root}/lib64:{root}/lib:${{LD_LIBRARY_PATH:-}}"',
        f'export CUDA_MPS_PIPE_DIRECTORY="{root}{CONTAINER_PIPE_DIR}"',
        f'export CUDA_MPS_LOG_DIRECTORY="{root}{CONTAINER_LOG_DIR}"',
        body,
        f'echo "{STARTUP_MARKER}" > "$CUDA_MPS_LOG_DIRECTORY/{STARTUP_LOG}"',
        f'exec tail -n +1 -F "$CUDA_MPS_LOG_DIRECTORY/{CONTROL_LOG}"',
    ))


def deployment_manifest(daemon: ControlDaemon, placement: DaemonPlacement) -> JSONDict:
    """The daemon's ``apps/v1`` Deployment (module docstring).

    Shapes: ``spec.template.spec.containers[0].command`` is ``["sh", "-c", <script>]``; the startup probe is
    ``exec: ["cat", "/driver-root/var/log/nvidia-mps/startup.log"]``, period 1 s, failure threshold 60; volumes
    are ``hostPath`` directories.
    """
    name = daemon.deployment
    labels = {LABEL_APP: name, LABEL_CLAIM: daemon.claim_uid, LABEL_NODE: placement.node_name,
              LABEL_KIND: placement.kind}
    directory = placement.directory.rstrip("/")
    shm_target = f"{CONTAINER_DRIVER_ROOT}/dev/shm" if placement.shm_in_driver_root else "/dev/shm"
    env = [{"name": "CUDA_VISIBLE_DEVICES", "value": ",".join(daemon.uuids)}]
    if placement.feature_gates:
        env.append({"name": "FEATURE_GATES", "value": placement.feature_gates})
    marker = f"{CONTAINER_DRIVER_ROOT}{CONTAINER_LOG_DIR}/{STARTUP_LOG}"
    manifest: JSONDict = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": placement.namespace, "labels": dict(labels)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {LABEL_APP: name}},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "nodeName": placement.node_name,
                    "hostPID": True,
                    "restartPolicy": "Always",
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": CONTAINER_NAME,
                        "image": placement.image,
                        "command": ["sh", "-c", _container_script(daemon)],
                        "env": env,
                        "securityContext": {"privileged": True},
                        "startupProbe": {
                            "exec": {"command": ["cat", marker]},
                            "periodSeconds": 1,
                            "failureThreshold": 60,
                        },
                        "volumeMounts": [
                            {"name": "driver-root", "mountPath": CONTAINER_DRIVER_ROOT},
                            {"name": "mps-shm", "mountPath": shm_target},
                            {"name": "mps-pipe", "mountPath": f"{CONTAINER_DRIVER_ROOT}{CONTAINER_PIPE_DIR}"},
                            {"name": "mps-log", "mountPath": f"{CONTAINER_DRIVER_ROOT}{CONTAINER_LOG_DIR}"},
                        ],
                    }],
                    "volumes": [
                        {"name": "driver-root", "hostPath": {"path": placement.driver_root, "type": "Directory"}},
                        {"name": "mps-shm", "hostPath": {"path": f"{directory}/{SHM_DIR}", "type": "Directory"}},
                        {"name": "mps-pipe", "hostPath": {"path": f"{directory}/{PIPE_DIR}", "type": "Directory"}},
                        {"name": "mps-log", "hostPath": {"path": f"{directory}/{LOG_DIR}", "type": "Directory"}},
                    ],
                },
            },
        },
    }
    pod = manifest["spec"]["template"]["spec"]
    if placement.service_account:
        pod["serviceAccountName"] = placement.service_account
    if placement.pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in placement.pull_secrets]
    if placement.pull_policy:
        pod["containers"][0]["imagePullPolicy"] = placement.pull_policy
    return manifest


def readiness(deployment: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]) -> str:
    """Why the daemon is not ready yet, or ``""`` when it is (NVIDIA's rule, module docstring).

    :param deployment: the Deployment as read (``None``: it does not exist).
    :param pods: the Pods matching its selector (terminating ones included).
    """
    if deployment is None:
        return "the Deployment does not exist"
    ready = (deployment.get("status") or {}).get("readyReplicas") or 0
    if ready != 1:
        return f"the Deployment has {ready} ready replica(s), not 1"
    if len(pods) != 1:
        return f"{len(pods)} Pods match the Deployment's selector, not 1"
    statuses = (pods[0].get("status") or {}).get("containerStatuses") or []
    if len(statuses) != 1:
        return f"Pod {pods[0]['metadata']['name']} has {len(statuses)} container statuses, not 1"
    if not statuses[0].get("ready"):
        state = statuses[0].get("state") or {}
        detail = ", ".join(f"{k}: {(v or {}).get('reason') or ''}".rstrip(": ") for k, v in state.items())
        return f"container {statuses[0].get('name')} of Pod {pods[0]['metadata']['name']} is not ready" + \
            (f" ({detail})" if detail else "")
    return ""


def workload_edits(directory: str) -> ContainerEdits:
    """CDI edits that connect a workload container to the daemon whose host directory is ``directory``."""
    directory = directory.rstrip("/")
    return ContainerEdits(
        env=(f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}",),
        mounts=(
            Mount(f"{directory}/{SHM_DIR}", "/dev/shm", WORKLOAD_MOUNT_OPTIONS),
            Mount(f"{directory}/{PIPE_DIR}", CONTAINER_PIPE_DIR, WORKLOAD_MOUNT_OPTIONS),
        ),
    )
