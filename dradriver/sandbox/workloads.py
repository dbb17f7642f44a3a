"""Workloads in the sandbox: a minimal Deployment controller and a node-side container runner.

What a cluster does with the MPS control daemon's Deployment, reduced to what the driver relies on
(NVIDIA's ``cmd/gpu-kubelet-plugin/sharing.go``):

* **Deployment controller** (kube-controller-manager's, without the ReplicaSet in between): for each
  Deployment not being deleted, as many Pods as ``spec.replicas``, named ``<deployment>-<5 random>``, labelled
  from the template, owned by the Deployment (``ownerReferences``, so deleting it deletes them through the API
  emulator's garbage collector); ``status.replicas``/``readyReplicas``/``availableReplicas`` kept current.
* **Container runner** (the kubelet and the container runtime of this node): each Pod the controller made that is
  bound to the node gets its containers started as local processes (other Pods, such as a user's workload whose
  claims the sandbox's kubelet emulator prepares, are not run: their images are not here), with the container's
  ``env`` (``value`` entries), in a new session. ``hostPath`` volumes stand in for bind mounts: every
  ``mountPath`` of the container is replaced by its volume's host path in the command, arguments, environment
  values and exec probes (longest path first), so a script that writes ``/driver-root/var/log/nvidia-mps/startup.log``
  writes the host directory the Pod mounts there. The image is not pulled: the node's own
  programs run (a sandbox runs the plugin's code from the same checkout). A ``startupProbe``/``readinessProbe``
  ``exec`` runs every ``periodSeconds`` (times ``time_scale``); the container is ready after the startup probe
  (and readiness probe, if any) succeeded, and the Pod's ``Ready`` condition and ``containerStatuses`` follow. A
  container that exits is restarted (``restartPolicy: Always``) after a doubling back-off from 10 s (times
  ``time_scale``).
* **Graceful deletion**: the runner puts its finalizer on every Pod it runs, so deleting a Pod only marks it;
  the runner then stops the container — SIGTERM to every process carrying the container's marker in its
  environment (the sandbox's cgroup: daemons that detached are found too), SIGKILL after the grace period —
  and removes the finalizer, and the Pod is gone. So "no Pod left" means "no process left", as on a node.

Container output goes to ``<logs>/<namespace>_<pod>_<uid>/<container>.log``. ``$(VAR)`` references in commands,
arguments, env values and exec probes are expanded from the container's environment, as the kubelet does
(:func:`expand`). A subclass picks which Pods it runs and adds what a container runtime would
(:meth:`Workloads.runs`, :meth:`~Workloads.can_start`, :meth:`~Workloads.extra_mounts`,
:meth:`~Workloads.container_env`, :meth:`~Workloads.status_extra`): the multi-node sandbox's node runtime
(:mod:`dradriver.sandbox.multinode`) runs DaemonSet Pods with their CDI edits that way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.apiserver.errors import ApiStatusError
from dradriver.sandbox.apiserver.resources import now

log = logging.getLogger(__name__)

FINALIZER = "sandbox.dradriver.io/container-runtime"
MARKER_ENV = "DRADRIVER_SANDBOX_CONTAINER"
"""Environment variable every process of a sandbox container inherits: ``<pod uid>/<container name>``."""
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RESTART_BACKOFF_S = 10.0
JSONDict = dict[str, Any]


def path_map(container: Mapping[str, Any], volumes: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(mount path, host path) of each ``hostPath`` volume mount of ``container``, longest mount path first."""
    hosts = {str(v["name"]): str(v["hostPath"]["path"]) for v in volumes if isinstance(v.get("hostPath"), Mapping)}
    pairs = [(str(m["mountPath"]).rstrip("/") or "/", hosts[str(m["name"])])
             for m in container.get("volumeMounts") or [] if str(m.get("name")) in hosts]
    return sorted(pairs, key=lambda p: -len(p[0]))


def translate(text: str, mapping: Sequence[tuple[str, str]]) -> str:
    """``text`` with each mount path (as a whole path prefix) replaced by its host path."""
    if not mapping:
        return text
    alternatives = "|".join(re.escape(m) for m, _ in mapping)
    hosts = dict(mapping)
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?=[/\s'\";:|&)]|$)")
    return pattern.sub(lambda m: hosts[m.group(1)].rstrip("/") or "/", text)


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in container commands, arguments and env values: a defined variable is
    replaced, an undefined reference stays as written, ``$$`` is a literal ``$``."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(one, text)


def pids_with_marker(marker: str) -> list[int]:
    """Processes whose environment holds ``DRADRIVER_SANDBOX_CONTAINER=<marker>`` (read from ``/proc``)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


@dataclass
class _Container:
    """One running (or restarting) container of a Pod."""

    name: str
    spec: JSONDict
    mapping: list[tuple[str, str]]
    marker: str
    log_path: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restarts: int = 0
    started: bool = False
    ready: bool = False
    next_probe: float = 0.0
    restart_at: float = 0.0
    exit_code: int | None = None


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    containers: list[_Container] = field(default_factory=list)
    reported: JSONDict = field(default_factory=dict)


class Workloads:
    """The Deployment controller and the container runner of one sandbox node (module docstring).

    :param api: the API emulator.
    :param node_name: the node whose Pods are run.
    :param logs: directory for container output.
    :param time_scale: factor on probe periods, grace periods and restart back-off (``0.05``: twenty times
        faster than a kubelet, for tests).
    :param interval_s: how often the loop looks at the API, seconds.
    """

    def __init__(self, api: ApiServerEmulator, node_name: str, logs: Path, *, time_scale: float = 1.0,
                 interval_s: float = 0.02, say: Callable[[str], None] | None = None) -> None:
        self.api = api
        self.node_name = node_name
        self.logs = logs
        self.time_scale = time_scale
        self.interval_s = interval_s
        self.say = say or (lambda text: log.info("%s", text))
        self._pods: dict[str, _Pod] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    # ------------------------------------------------------------------------------------------ loop
    def start(self) -> Workloads:
        """Run the loop in a daemon thread."""
        self._thread = threading.Thread(target=self._loop, name="sandbox-workloads", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop and every container it runs (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for pod in list(self._pods.values()):
            self._kill(pod)
        self._pods.clear()

    def __enter__(self) -> Workloads:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # the loop must outlive one bad object; the next pass retries
                log.exception("sandbox workloads: reconcile failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def reconcile(self) -> None:
        """One pass: Deployments -> Pods, then this node's Pods -> processes and status."""
        self._reconcile_deployments()
        self._reconcile_pods()

    # ----------------------------------------------------------------------------------- controller
    def _reconcile_deployments(self) -> None:
        pods = self.api.objects("Pod")
        for deployment in self.api.objects("Deployment"):
            meta = deployment["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            owned = [p for p in pods if any(o.get("uid") == meta["uid"]
                                            for o in p["metadata"].get("ownerReferences") or [])]
            live = [p for p in owned if not p["metadata"].get("deletionTimestamp")]
            wanted = int(deployment["spec"].get("replicas", 1))
            for _ in range(wanted - len(live)):
                live.append(self._create_pod(deployment))
            for extra in live[wanted:]:
                self._delete(extra)
            ready = sum(1 for p in live[:wanted] if _pod_ready(p))
            status = {"observedGeneration": meta.get("generation", 1), "replicas": len(live[:wanted]),
                      "updatedReplicas": len(live[:wanted]), "readyReplicas": ready, "availableReplicas": ready}
            if ready == 0:
                del status["readyReplicas"], status["availableReplicas"]  # omitted when zero, as the API does
            old = deployment.get("status") or {}
            if {k: old.get(k) for k in status} != status or set(old) - set(status) - {"conditions"}:
                deployment["status"] = status
                with contextlib.suppress(ApiStatusError):
                    self.api.update(deployment, subresource="status")

    def _create_pod(self, deployment: JSONDict) -> JSONDict:
        meta, template = deployment["metadata"], deployment["spec"]["template"]
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "generateName": f"{meta['name']}-", "namespace": meta["namespace"],
                "labels": dict((template.get("metadata") or {}).get("labels") or {}),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                     "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": dict(template["spec"]),
            "status": {"phase": "Pending"},
        }
        created = self.api.create(pod)
        self.say(f"Deployment {meta['namespace']}/{meta['name']}: created Pod {created['metadata']['name']}")
        return created

    def _delete(self, pod: JSONDict) -> None:
        with contextlib.suppress(ApiStatusError):
            self.api.delete("Pod", pod["metadata"]["name"], pod["metadata"]["namespace"])

    # ---------------------------------------------------------------------------------------- runner
    def _reconcile_pods(self) -> None:
        seen: set[str] = set()
        for pod in self.api.objects("Pod"):
            meta, spec = pod["metadata"], pod.get("spec") or {}
            if spec.get("nodeName") != self.node_name or "containers" not in spec or not self.runs(pod):
                continue
            uid = str(meta["uid"])
            if uid not in self._pods:
                if meta.get("deletionTimestamp"):
                    if FINALIZER in (meta.get("finalizers") or []):
                        self._finalize(pod)
                    continue
                if not self.can_start(pod) or not self._adopt(pod):
                    continue
            seen.add(uid)
            state = self._pods[uid]
            if meta.get("deletionTimestamp"):
                self._kill(state, grace_s=float(spec.get("terminationGracePeriodSeconds", 30)) * self.time_scale)
                del self._pods[uid]
                self._finalize(pod)
                self.say(f"Pod {state.namespace}/{state.name}: containers stopped, Pod deleted")
                continue
            self._tend(state, spec)
            self._report(state, pod)
        for uid in set(self._pods) - seen:  # gone without our finalizer (deleted behind the runner's back)
            self._kill(self._pods.pop(uid))

    def _adopt(self, pod: JSONDict) -> bool:
        """Add the finalizer, then start the containers; False when the Pod changed under us (next pass)."""
        meta = pod["metadata"]
        if FINALIZER not in (meta.get("finalizers") or []):
            meta["finalizers"] = [*(meta.get("finalizers") or []), FINALIZER]
            try:
                pod.update(self.api.update(pod))
            except ApiStatusError:
                return False
        spec = pod["spec"]
        volumes = spec.get("volumes") or []
        directory = self.pod_directory(pod)
        directory.mkdir(parents=True, exist_ok=True)
        state = _Pod(str(meta["uid"]), str(meta["namespace"]), str(meta["name"]))
        for container in spec["containers"]:
            name = str(container["name"])
            mapping = sorted([*path_map(container, volumes), *self.extra_mounts(pod, container)],
                             key=lambda p: -len(p[0]))
            c = _Container(name, container, mapping, f"{meta['uid']}/{name}", directory / f"{name}.log")
            c.extra_env = self.container_env(pod, container, directory)
            state.containers.append(c)
        self._pods[state.uid] = state
        for c in state.containers:
            self._run(state, c)
        return True

    # ------------------------------------------------------------------------------------------ hooks
    def pod_directory(self, pod: Mapping[str, Any]) -> Path:
        """The Pod's own directory on the node (container logs, files the runtime gives the Pod)."""
        meta = pod["metadata"]
        return self.logs / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"

    def container_pids(self) -> list[int]:
        """Process IDs of every container process this runner started, their children included."""
        pids: list[int] = []
        for pod in self._pods.values():
            for c in pod.containers:
                pids += pids_with_marker(c.marker)
        return sorted(set(pids))

    def runs(self, pod: JSONDict) -> bool:
        """Whether this runner starts the Pod's containers (here: Pods a Deployment controls)."""
        return _from_deployment(pod)

    def can_start(self, pod: JSONDict) -> bool:
        """Whether the Pod's containers may start now (a kubelet first prepares the Pod's claims)."""
        return True

    def extra_mounts(self, pod: JSONDict, container: JSONDict) -> list[tuple[str, str]]:
        """(container path, host path) pairs beside the ``hostPath`` volumes (for example from CDI specs)."""
        return []

    def container_env(self, pod: JSONDict, container: JSONDict, directory: Path) -> dict[str, str]:
        """Environment a container runtime adds (for example from CDI specs); ``directory`` is the Pod's own."""
        return {}

    def status_extra(self, pod: JSONDict) -> JSONDict:
        """Pod status fields the node reports besides the conditions (``hostIP``, ``podIP``)."""
        return {"hostIP": "127.0.0.1"}

    def _env(self, c: _Container) -> dict[str, str]:
        env = {"PATH": BASE_PATH, "HOME": "/root", "HOSTNAME": "sandbox"}
        env.update(c.extra_env)
        for item in c.spec.get("env") or []:
            if "value" in item:
                env[str(item["name"])] = translate(expand(str(item["value"]), env), c.mapping)
        env[MARKER_ENV] = c.marker
        return env

    def _run(self, pod: _Pod, c: _Container) -> None:
        env = self._env(c)
        argv = [translate(expand(str(a), env), c.mapping)
                for a in [*(c.spec.get("command") or []), *(c.spec.get("args") or [])]]
        with open(c.log_path, "ab") as out:
            try:
                c.process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
            except OSError as exc:
                out.write(f"sandbox: cannot start {argv[:1]}: {exc}\n".encode())
                c.process = None
                c.exit_code = 128
                c.restart_at = time.monotonic() + RESTART_BACKOFF_S * self.time_scale * 2 ** min(c.restarts, 5)
                return
        c.started_at, c.exit_code = now(), None
        c.started = not c.spec.get("startupProbe")
        c.ready = c.started and not c.spec.get("readinessProbe")
        c.next_probe = time.monotonic()
        self.say(f"Pod {pod.namespace}/{pod.name}: container {c.name} started (pid {c.process.pid})")

    def _tend(self, pod: _Pod, spec: JSONDict) -> None:
        clock = time.monotonic()
        for c in pod.containers:
            if c.process is not None and c.process.poll() is not None:
                c.exit_code = c.process.returncode
                c.process, c.started, c.ready = None, False, False
                c.restart_at = clock + RESTART_BACKOFF_S * self.time_scale * 2 ** min(c.restarts, 5)
                self.say(f"Pod {pod.namespace}/{pod.name}: container {c.name} exited {c.exit_code}")
                continue
            if c.process is None:
                if clock >= c.restart_at and spec.get("restartPolicy", "Always") != "Never":
                    c.restarts += 1
                    self._kill_marker(c.marker, 0.0)
                    self._run(pod, c)
                continue
            probe = c.spec.get("readinessProbe") if c.started else c.spec.get("startupProbe")
            if probe is None or clock < c.next_probe:
                continue
            c.next_probe = clock + float(probe.get("periodSeconds", 10)) * self.time_scale
            if self._probe(c, probe):
                if not c.started:
                    c.started = True
                    c.ready = not c.spec.get("readinessProbe")
                    c.next_probe = clock
                else:
                    c.ready = True
            elif c.started:
                c.ready = False

    def _probe(self, c: _Container, probe: Mapping[str, Any]) -> bool:
        command = (probe.get("exec") or {}).get("command")
        if not command:
            return True  # only exec probes are emulated; others pass
        env = self._env(c)
        argv = [translate(expand(str(a), env), c.mapping) for a in command]
        try:
            done = subprocess.run(argv, env=env, capture_output=True, check=False, cwd="/",
                                  timeout=max(0.5, float(probe.get("timeoutSeconds", 1))))
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    def _report(self, pod: _Pod, obj: JSONDict) -> None:
        statuses = []
        for c in pod.containers:
            if c.process is not None:
                state: JSONDict = {"running": {"startedAt": c.started_at}}
            elif c.exit_code is not None:
                state = {"waiting": {"reason": "CrashLoopBackOff"}}
            else:
                state = {"waiting": {"reason": "ContainerCreating"}}
            statuses.append({"name": c.name, "ready": c.ready, "started": c.started, "restartCount": c.restarts,
                             "image": str(c.spec.get("image", "")), "imageID": "", "state": state,
                             "containerID": f"sandbox://{c.process.pid}" if c.process else ""})
        ready = all(c.ready for c in pod.containers)
        flag = "True" if ready else "False"
        status = {
            "phase": "Running" if any(c.process for c in pod.containers) else "Pending",
            **self.status_extra(obj),
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                           {"type": "ContainersReady", "status": flag}, {"type": "Ready", "status": flag}],
            "containerStatuses": statuses,
        }
        if status == pod.reported:
            return
        old = obj.get("status") or {}  # keep what others wrote (resourceClaimStatuses, podIPs)
        obj["status"] = {**old, **status, "startTime": old.get("startTime") or now()}
        try:
            self.api.update(obj, subresource="status")
        except ApiStatusError:
            return  # changed under us: reported on the next pass
        pod.reported = status

    def _finalize(self, pod: JSONDict) -> None:
        meta = pod["metadata"]
        meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
        with contextlib.suppress(ApiStatusError):
            self.api.update(pod)

    def _kill(self, pod: _Pod, grace_s: float = 2.0) -> None:
        for c in pod.containers:
            self._kill_marker(c.marker, grace_s)
            if c.process is not None:
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    c.process.kill()
                    c.process.wait(timeout=1)
                c.process = None

    @staticmethod
    def _kill_marker(marker: str, grace_s: float) -> None:
        """SIGTERM every process of the container, then SIGKILL what is left after ``grace_s``."""
        pids = pids_with_marker(marker)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while pids and time.monotonic() < end:
            time.sleep(0.01)
            pids = pids_with_marker(marker)  # a zombie's environ reads empty: exited processes drop out
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _from_deployment(pod: Mapping[str, Any]) -> bool:
    """The Pod is controlled by a Deployment (made by the sandbox's controller)."""
    return any(o.get("kind") == "Deployment" and o.get("controller")
               for o in (pod.get("metadata") or {}).get("ownerReferences") or [])


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
