"""The GPU plugin's per-node device policy, applied live (gate ``PerNodeGPUConfig``).

NVIDIA's contract (kubernetes-sigs/dra-driver-nvidia-gpu ``cmd/gpu-kubelet-plugin/driverconfig.go``, ksigs#1067):
the node label ``nvidia.com/dra-driver-gpu.config`` (else ``--default-config``) names a profile file of the
profiles directory whose ``gpu.advertisedDeviceTypes`` lists the device types the plugin publishes
(:mod:`dradriver.domain.driverconfig`). NVIDIA resolves it once at start and needs a pod restart for a change;
dradriver watches its Node and applies a change of the label, or of the profile files (re-read at each Node event
and at least every :attr:`NodePolicyWatch.RESYNC_S`), without a restart:

* the pool is republished with only the advertised types; claims already prepared stay prepared and are
  unprepared as usual (their devices are not touched);
* a claim not prepared yet on a device of a type the policy does not advertise (allocated before the change) is
  refused with a per-claim error naming the device and the profile;
* a bad profile (an empty label, an unknown profile, an invalid file) is an error in the log and a
  ``DriverConfigInvalid`` Warning Event on the Node, reported once per distinct problem. A running plugin keeps
  the last good policy; a plugin that never read a good one since it started advertises nothing (fail closed: a
  node meant for VM workloads must not hand its GPUs to containers because its profile has a typo). A policy
  applied is a ``DriverConfigApplied`` Normal Event.

With the gate off the label is not read and every device is advertised (NVIDIA's behaviour); a label or
``--default-config`` that is set anyway is named in a warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from dradriver.config import PluginConfig
from dradriver.domain.devices import DeviceType
from dradriver.domain.driverconfig import EVERYTHING, NODE_LABEL, DriverConfigError, NodePolicy, fail_closed
from dradriver.host import driverconfigs
from dradriver.kube import errors as kube_errors
from dradriver.kube import nodes
from dradriver.kube.client import KubeClient

log = logging.getLogger(__name__)

INVALID_REASON = "DriverConfigInvalid"
"""Warning Event reason: the profile asked for cannot be used."""
APPLIED_REASON = "DriverConfigApplied"
"""Normal Event reason: a (new) policy is in force."""


class NodePolicyWatch:
    """This node's device policy now (:attr:`policy`), kept up to date from the Node's label by a watch thread.

    :param labels: the Node's labels as read at start; ``None`` when the Node could not be read.
    :param report: records an Event on this Node: ``report(reason, message, type)``, type ``Warning`` or
        ``Normal`` (best effort: it raises nothing).
    :param on_change: called (on the watch thread) after the policy changed: republish.
    """

    WATCH_TIMEOUT_S = 60.0
    """Each watch request's ``timeoutSeconds``; the profile file is re-read when one ends."""
    RESYNC_S = WATCH_TIMEOUT_S
    """Longest time before a change of a profile file alone (the ConfigMap edited) is seen."""
    RETRY_S = 5.0
    """Pause after a failed watch request."""

    def __init__(self, client: KubeClient, config: PluginConfig, labels: Mapping[str, str] | None, *,
                 report: Callable[[str, str, str], None], on_change: Callable[[], None] = lambda: None) -> None:
        self.client, self.config, self.report = client, config, report
        self.enabled = config.feature_gates.per_node_gpu_config
        self.on_change = on_change
        self.policy: NodePolicy = EVERYTHING
        """The policy in force (replaced whole; read from any thread)."""
        self.changes = 0
        """Policies applied after the first."""
        self._labels: Mapping[str, str] | None = None
        self._problem = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        if not self.enabled:
            self._warn_ignored(labels or {})
            return
        if labels is None:
            self.policy = fail_closed(f"the Node {config.node_name} could not be read, so its label {NODE_LABEL} is "
                                      "unknown; waiting for the Node")
            log.error("per-node device policy: %s", self.policy.describe())
        else:
            self.observe(labels, first=True)

    def _warn_ignored(self, labels: Mapping[str, str]) -> None:
        if NODE_LABEL in labels:
            log.warning("node label %s=%r is ignored: the feature gate PerNodeGPUConfig is off (every device type "
                        "is advertised)", NODE_LABEL, labels[NODE_LABEL])
        if self.config.default_config:
            log.warning("--default-config (env DEFAULT_CONFIG) %r is ignored: the feature gate PerNodeGPUConfig is "
                        "off", self.config.default_config)

    def refusal(self, _name: str, device: object) -> str:
        """Why a claim not prepared yet may not be prepared on ``device`` now (``""`` when it may), for
        :class:`~dradriver.kubeletplugin.runner.BatchRunner`'s ``refuse_device``."""
        policy = self.policy
        device_type = DeviceType.of(device).value
        if policy.advertises(device_type):
            return ""
        return (f"is a {device_type} device, which this node does not advertise now ({policy.describe()}); it was "
                "allocated before the node's policy changed: delete the claim (or its pod) so that the scheduler "
                "allocates an advertised device")

    def observe(self, labels: Mapping[str, str], *, first: bool = False) -> None:
        """Resolve the policy for ``labels`` (re-reading the profile file) and apply it when it changed; a bad
        profile is reported once and the policy in force is kept (:func:`fail_closed` when there is none yet)."""
        with self._lock:
            self._labels = dict(labels)
            try:
                policy = driverconfigs.resolve(labels, self.config.driver_config_directory,
                                               self.config.default_config)
            except DriverConfigError as exc:
                if first:
                    self.policy = fail_closed(f"{exc}")
                self._report_problem(str(exc), first=first)
                return
            self._problem = ""
            if policy == self.policy and not first:
                return
            self.policy = policy
            if not first:
                self.changes += 1
        log.info("per-node device policy: %s", policy.describe())
        if policy is not EVERYTHING or not first:
            self._event(APPLIED_REASON, policy.describe(), type_="Normal")
        if not first:
            self.on_change()

    def _report_problem(self, problem: str, *, first: bool) -> None:
        if problem == self._problem:
            return
        self._problem = problem
        kept = self.policy.describe() if not first else "nothing is advertised until a valid profile is selected"
        message = f"{problem}; {'keeping ' + kept if not first else kept}"
        log.error("per-node device policy: %s", message)
        self._event(INVALID_REASON, message)

    def _event(self, reason: str, message: str, type_: str = "Warning") -> None:
        self.report(reason, message, type_)

    def resync(self) -> None:
        """Resolve again with the labels last seen (a profile file may have changed)."""
        with self._lock:
            labels = self._labels
        if labels is not None:
            self.observe(labels)

    def start(self) -> None:
        """Start the watch thread (nothing with the gate off)."""
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="node-policy-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the watch thread (it ends within one watch request's read)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=1.0)

    def _run(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                for event in nodes.watch_node(self.client, self.config.node_name, rv, self.WATCH_TIMEOUT_S):
                    if self._stop.is_set():
                        return
                    rv = self._handle(event)
                if not self._stop.is_set():
                    self.resync()
            except kube_errors.KubeGoneError:
                rv = ""
            except Exception as exc:  # an API failure, or anything else: the thread must keep watching
                if isinstance(exc, kube_errors.KubeAPIError):
                    log.warning("watch on Node %s failed: %s; retrying in %gs", self.config.node_name, exc,
                                self.RETRY_S)
                else:
                    log.error("watch on Node %s failed unexpectedly; retrying in %gs", self.config.node_name,
                              self.RETRY_S, exc_info=exc)
                self._stop.wait(self.RETRY_S)
                rv = ""

    def _handle(self, event: Mapping[str, Any]) -> str:
        """Apply one watch event; returns the resource version to resume from."""
        obj = event.get("object") or {}
        if event.get("type") in ("ADDED", "MODIFIED"):
            self.observe(nodes.Node.from_object(obj).labels)
        return str((obj.get("metadata") or {}).get("resourceVersion") or "")
