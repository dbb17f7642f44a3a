"""A one-node cluster emulator for running the kubelet plugin by hand (``dradriver sandbox``).

It plays the control plane and the kubelet around a plugin started separately
(``dradriver gpu-kubelet-plugin`` with the environment file it writes):

* the Kubernetes API emulator over HTTP (use ``kubectl --kubeconfig <root>/kubeconfig``);
* the resourceclaim controller: a Pod's ``resourceClaimTemplateName`` entries become ResourceClaims;
* the scheduler: the Pod's pending claims are allocated on this node (our allocation simulator) and the Pod
  is bound (``spec.nodeName``); a Pod that asks for an extended resource a DeviceClass maps
  (``nvidia.com/gpu: 1``, no resourceClaims) gets the claim kube-scheduler generates (KEP-5004,
  :func:`dradriver.sandbox.scheduler.schedule_extended`);
* the kubelet: registers the plugin from the registrar directory, calls NodePrepareResources for the claims of
  each bound Pod, and NodeUnprepareResources once no Pod uses a claim any more (Pod deleted); a plugin whose
  registration socket is gone is deregistered, and whichever instance registers next (a restart, an upgrade, the
  other driver after a switch) is called for the claims prepared before, which are not prepared again;
* the Deployment controller and the node's container runner (:mod:`dradriver.sandbox.workloads`), which run
  the MPS control daemons' Pods as local processes (``dradriver sandbox`` starts them and turns MPSSupport on
  where this process may mount tmpfs, as the plugin it starts does).

What ``kubectl get pods``/``kubectl describe pod`` show comes from what those components write: a Pod whose
claims cannot be allocated gets the ``PodScheduled=False`` condition with reason ``Unschedulable`` and a
``FailedScheduling`` Warning Event in kube-scheduler's words (:data:`UNSCHEDULABLE_MESSAGE`); a placed Pod a
``Scheduled`` Event (``Successfully assigned <ns>/<pod> to <node>``) and ``PodScheduled=True``; a Pod whose
claims are prepared runs (phase ``Running``, containers ready: the emulated kubelet starts no processes); a
failed NodePrepareResources is a ``FailedPrepareDynamicResources`` Warning Event from the kubelet. A missing
ResourceClaimTemplate is the resourceclaim controller's ``FailedResourceClaimCreation`` Warning.

The kubelet's PodResources API is served too (:func:`pod_resources_socket`; ``v1.PodResourcesLister/List``): every
running pod's containers with the prepared claims they reference and their devices (driver, pool, device), so
``dradriver exporter --dcgm-compatible --pod-resources-socket <root>/pod-resources/kubelet.sock`` attributes
GPUs to pods as on a real node.

Each reconcile pass reads the emulator's objects directly; progress goes to ``say`` lines. A Pod that stays
pending is reported once per change of its reason (line, condition and Event), not at every pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dradriver.allocator.allocation import AllocationError
from dradriver.config import IMAGE_CDI_HOOK_ENV, PLUGIN_FLAGS, PluginConfig
from dradriver.domain.claims import POD_CLAIM_NAME_ANNOTATION, ClaimRef
from dradriver.domain.featuregates import FeatureGates
from dradriver.domain.identity import GPU_DRIVER
from dradriver.sandbox import scheduler
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError, PluginConnection
from dradriver.sandbox.node import SandboxNode

log = logging.getLogger(__name__)
POD_CLAIM_ANNOTATION = POD_CLAIM_NAME_ANNOTATION
SCHEDULER = "default-scheduler"
DELETE_PROTECTION_FINALIZER = "resource.kubernetes.io/delete-protection"
"""``resourceapi.Finalizer`` (``k8s.io/api/resource/v1``): kube-scheduler adds it when it writes a claim's
allocation (``bindClaim``, KEP-4381); the resourceclaim controller removes it with the allocation once no pod is
reserved and the claim is being deleted or its owning pod is gone, so a claim in use outlives ``kubectl delete``."""
UNSCHEDULABLE_MESSAGE = ("0/1 nodes are available: 1 cannot allocate all claims. preemption: 0/1 nodes are "
                         "available: 1 Preemption is not helpful for scheduling.")
"""kube-scheduler's FailedScheduling message when the DRA plugin cannot allocate a pod's claims on the only node
(the ``dynamicresources`` plugin's ``cannot allocate all claims`` status, as the scheduler's framework
summarises it)."""


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def record_event(api: ApiServerEmulator, pod: dict[str, Any], event_type: str, reason: str, message: str,
                 component: str) -> dict[str, Any]:
    """Create a core ``v1`` Event about ``pod`` as ``component`` reports it (``kubectl describe pod`` lists it)."""
    import uuid

    meta = pod["metadata"]
    ns = meta.get("namespace", "default")
    stamp = _now()
    return api.create({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": ns},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": meta["name"],
                           "uid": meta.get("uid", "")},
        "type": event_type,
        "reason": reason,
        "message": message,
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    })


def plugin_environment(config: PluginConfig) -> dict[str, str]:
    """The environment that makes ``dradriver gpu-kubelet-plugin`` run with ``config`` (flag twins only)."""
    env: dict[str, str] = {}
    for flag in PLUGIN_FLAGS:
        value = getattr(config, flag.dest)
        if isinstance(value, FeatureGates):  # the --feature-gates syntax: only the gates set explicitly
            env[flag.env] = ",".join(f"{k}={'true' if v else 'false'}" for k, v in value.explicit.items())
        elif isinstance(value, bool):
            env[flag.env] = "true" if value else "false"
        elif isinstance(value, FeatureGates):  # --feature-gates syntax: the explicitly set gates only
            env[flag.env] = ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(value.explicit.items()))
        elif isinstance(value, tuple):
            env[flag.env] = ",".join(str(v) for v in value)
        else:
            env[flag.env] = str(value)
    env[IMAGE_CDI_HOOK_ENV] = str(config.image_cdi_hook)  # the image's hook (no flag): the sandbox's stand-in
    return env


def write_env_file(path: Path, env: dict[str, str]) -> None:
    """``KEY=value`` lines, quoted for ``sh`` (``set -a; . FILE; set +a``)."""
    lines = [f"{k}='{v}'" for k, v in sorted(env.items())]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class ClusterEmulator:
    """Reconciles Pods and ResourceClaims of one sandbox node against a plugin registered in its directory."""

    sandbox: SandboxNode
    say: Callable[[str], None] = print
    prepared: dict[str, ClaimRef] = field(default_factory=dict)  # claim UID -> ref
    _kubelet: KubeletEmulator | None = None
    _plugin: PluginConnection | None = None
    _pending: dict[str, str] = field(default_factory=dict)  # pod UID -> the reason last reported
    _failed_prepare: dict[str, str] = field(default_factory=dict)  # pod UID -> the prepare error last reported
    _last_error: str = ""

    @property
    def plugin(self) -> PluginConnection | None:
        """The ``gpu.nvidia.com`` instance this kubelet calls, as of the last :meth:`reconcile`: the most recently
        registered one, ``None`` while none is (a plugin that stopped and removed its registration socket is
        deregistered, as the kubelet's plugin watcher does; one started in its place registers anew)."""
        return self._plugin

    def apply_device_classes(self) -> None:
        """Create the DeviceClasses ``deploy/`` ships (``gpu.nvidia.com``, ``mig.nvidia.com``,
        ``vfio.gpu.nvidia.com``, the compute-domain classes)."""
        assert self.sandbox.api is not None
        text = resources.files("dradriver.sandbox").joinpath("manifests", "deviceclasses.yaml").read_text()
        for obj in yaml.safe_load_all(text):
            if obj and self.sandbox.api.get("DeviceClass", obj["metadata"]["name"]) is None:
                self.sandbox.api.create(obj)

    def pod_resources(self) -> Any:
        """The kubelet's PodResources ``List`` answer now: each running pod's containers with the prepared claims
        they name in ``resources.claims`` and the claims' allocated devices."""
        from dradriver.server.podresources import encode_response

        api = self.sandbox.api
        assert api is not None
        prepared = {(r.namespace, r.name) for r in self.prepared.values()}
        rows = []
        for pod in api.objects("Pod"):
            if (pod.get("status") or {}).get("phase") != "Running":
                continue
            ns = pod["metadata"].get("namespace", "default")
            names = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get(
                "resourceClaimStatuses") or []}
            for entry in pod.get("spec", {}).get("resourceClaims") or []:
                names.setdefault(entry["name"], entry.get("resourceClaimName"))
            for container in pod.get("spec", {}).get("containers") or []:
                for ref in (container.get("resources") or {}).get("claims") or []:
                    claim_name = names.get(ref.get("name", ""))
                    if not claim_name or (ns, claim_name) not in prepared:
                        continue
                    claim = api.get("ResourceClaim", claim_name, ns)
                    results = (((claim or {}).get("status") or {}).get("allocation") or {}).get(
                        "devices", {}).get("results") or []
                    devices = [(r["driver"], r["pool"], r["device"]) for r in results
                               if not ref.get("request") or r.get("request", "").split("/")[0] == ref["request"]]
                    rows.append((pod["metadata"]["name"], ns, container.get("name", ""), claim_name, ns, devices))
        return encode_response(rows)

    async def run(self, stop: asyncio.Event, *, interval_s: float = 0.2) -> None:
        """Reconcile until ``stop`` is set (serving PodResources on :func:`pod_resources_socket` meanwhile)."""
        from dradriver.sandbox.podresources import PodResourcesServer

        socket_path = pod_resources_socket(self.sandbox)
        socket_path.parent.mkdir(parents=True, exist_ok=True)
        async with KubeletEmulator(self.sandbox.config().kubelet_registrar_directory_path) as kubelet, \
                _serving(PodResourcesServer(socket_path, self.pod_resources)):
            self._kubelet = kubelet
            while not stop.is_set():
                try:
                    await self.reconcile()
                    self._last_error = ""
                except (AllocationError, KubeletError) as exc:
                    if str(exc) != self._last_error:  # once per change, not at every pass
                        self._last_error = str(exc)
                        self.say(f"! {exc}")
                try:
                    await asyncio.wait_for(stop.wait(), timeout=interval_s)
                except TimeoutError:
                    pass

    async def reconcile(self) -> None:
        """One pass: register plugins, create claims from templates, schedule, prepare, unprepare."""
        api = self.sandbox.api
        assert api is not None and self._kubelet is not None
        await self._kubelet.scan()
        try:
            plugin = self._kubelet.plugin(GPU_DRIVER.driver_name)
        except KubeletError:
            plugin = None
        if plugin is not self._plugin:  # a new instance, or none left: the kubelet calls the newest registered
            self._plugin = plugin
            if plugin is not None:
                self.say(f"kubelet: registered {GPU_DRIVER.driver_name} at {plugin.endpoint} ({plugin.service})")
            else:
                self.say(f"kubelet: {GPU_DRIVER.driver_name} deregistered (its registration socket is gone)")
        in_use: set[str] = set()
        pods = api.objects("Pod")
        live = {p["metadata"].get("uid", "") for p in pods}
        for gone_uid in set(self._pending) - live:
            del self._pending[gone_uid]
        for gone_uid in set(self._failed_prepare) - live:
            del self._failed_prepare[gone_uid]
        for pod in pods:
            try:
                claims = self._pod_claims(pod)
            except AllocationError as exc:
                self._report_pending(pod, str(exc))
                continue
            if claims is None:
                continue
            refs = [ClaimRef(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
            in_use.update(r.uid for r in refs)
            # As the kubelet's claim cache: a claim another pod already had prepared is not prepared again,
            # and this pod runs once every claim it uses is prepared, whichever pod's turn prepared it.
            todo = [r for r in refs if r.uid not in self.prepared]
            if todo and self._plugin is None:
                continue
            answer = await self._plugin.prepare(todo) if todo and self._plugin else {}
            failures: list[str] = []
            for ref in todo:
                res = answer[ref.uid]
                if res.error:
                    failures.append(f"{ref.namespace}/{ref.name}: {res.error}")
                    continue
                self.prepared[ref.uid] = ref
                ids = ", ".join(i for d in res.devices for i in d.cdi_device_ids)
                self.say(f"kubelet: pod {ref.namespace}/{pod['metadata']['name']} claim {ref.name} prepared: {ids}")
            uid = pod["metadata"].get("uid", "")
            if failures:
                message = "; ".join(failures)
                if self._failed_prepare.get(uid) != message:
                    self._failed_prepare[uid] = message
                    self.say(f"! kubelet: prepare for pod {pod['metadata']['name']}: {message}")
                    record_event(api, pod, "Warning", "FailedPrepareDynamicResources",
                                 f"Failed to prepare dynamic resources: {message}", "kubelet")
            elif all(r.uid in self.prepared for r in refs):
                self._failed_prepare.pop(uid, None)
                self._mark_running(pod)
        self._release_claims(pods)
        gone = [ref for uid, ref in self.prepared.items() if uid not in in_use]
        if gone and self._plugin is not None:
            errors = await self._plugin.unprepare(gone)
            for ref in gone:
                if errors[ref.uid]:
                    self.say(f"! kubelet: unprepare {ref.namespace}/{ref.name}: {errors[ref.uid]}")
                    continue
                del self.prepared[ref.uid]
                self.say(f"kubelet: claim {ref.namespace}/{ref.name} unprepared (no pod uses it)")
                claim = api.get("ResourceClaim", ref.name, ref.namespace)
                owned = claim is not None and any(o.get("kind") == "Pod" for o in claim["metadata"].get(
                    "ownerReferences", []))
                if owned:
                    api.delete("ResourceClaim", ref.name, ref.namespace)

    def _release_claims(self, pods: list[dict[str, Any]]) -> None:
        """The resourceclaim controller's cleanup (``pkg/controller/resourceclaim/controller.go`` ``syncClaim``):
        drop ``reservedFor`` entries of pods that are gone or being deleted, once the kubelet unprepared the claim;
        a claim with no reservation left that is being deleted, or whose owning pod is gone, loses its allocation
        and :data:`DELETE_PROTECTION_FINALIZER` (the API server then completes a pending delete)."""
        api = self.sandbox.api
        assert api is not None
        live = {p["metadata"].get("uid", "") for p in pods if not p["metadata"].get("deletionTimestamp")}
        for claim in api.objects("ResourceClaim"):
            meta, status = claim["metadata"], claim.get("status") or {}
            if DELETE_PROTECTION_FINALIZER not in (meta.get("finalizers") or []) or meta["uid"] in self.prepared:
                continue
            reserved = [r for r in status.get("reservedFor") or [] if r.get("uid") in live]
            if reserved != (status.get("reservedFor") or []):
                claim.setdefault("status", {})["reservedFor"] = reserved or None
                claim = api.update(claim, subresource="status")
            owners = [o for o in meta.get("ownerReferences") or [] if o.get("kind") == "Pod"]
            if reserved or not (meta.get("deletionTimestamp") or any(o.get("uid") not in live for o in owners)):
                continue
            claim.setdefault("status", {}).pop("allocation", None)
            claim["status"].pop("reservedFor", None)
            claim = api.update(claim, subresource="status")
            claim["metadata"]["finalizers"] = [f for f in claim["metadata"]["finalizers"]
                                               if f != DELETE_PROTECTION_FINALIZER]
            api.update(claim)
            self.say(f"resourceclaim controller: claim {meta.get('namespace', 'default')}/{meta['name']} "
                     "deallocated, delete protection removed")

    def _protect(self, claims: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What kube-scheduler's ``bindClaim`` does before writing an allocation: add
        :data:`DELETE_PROTECTION_FINALIZER` (here just after, in the same pass)."""
        api = self.sandbox.api
        assert api is not None
        out = []
        for claim in claims:
            finalizers = claim["metadata"].get("finalizers") or []
            if DELETE_PROTECTION_FINALIZER not in finalizers:
                claim["metadata"]["finalizers"] = [*finalizers, DELETE_PROTECTION_FINALIZER]
                claim = api.update(claim)
            out.append(claim)
        return out

    def _report_pending(self, pod: dict[str, Any], reason: str) -> None:
        """A pod whose claims cannot be allocated: once per new reason, a line, the ``PodScheduled=False``
        condition and a ``FailedScheduling`` Event (or ``FailedResourceClaimCreation`` for a missing template)."""
        api = self.sandbox.api
        assert api is not None
        uid = pod["metadata"].get("uid", "")
        if self._pending.get(uid) == reason:
            return
        self._pending[uid] = reason
        name = f"{pod['metadata'].get('namespace', 'default')}/{pod['metadata']['name']}"
        self.say(f"! scheduler: pod {name} pending: {reason} (dradriver explain says why device by device)")
        if "ResourceClaimTemplate" in reason and "not found" in reason:
            record_event(api, pod, "Warning", "FailedResourceClaimCreation", reason, "resourceclaim-controller")
            message = f'0/1 nodes are available: pod "{name}": resource claim not created yet.'
        else:
            message = UNSCHEDULABLE_MESSAGE
        record_event(api, pod, "Warning", "FailedScheduling", message, SCHEDULER)
        self._set_condition(pod, {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                  "message": message})

    def _set_condition(self, pod: dict[str, Any], condition: dict[str, str], **status: Any) -> None:
        api = self.sandbox.api
        assert api is not None
        fresh = api.get("Pod", pod["metadata"]["name"], pod["metadata"].get("namespace", "default"))
        if fresh is None:
            return
        st = fresh.setdefault("status", {})
        conditions = [c for c in st.get("conditions") or [] if c.get("type") != condition["type"]]
        old = next((c for c in st.get("conditions") or [] if c.get("type") == condition["type"]), None)
        stamp = old["lastTransitionTime"] if old and old.get("status") == condition["status"] else _now()
        st["conditions"] = [*conditions, {**condition, "lastProbeTime": None, "lastTransitionTime": stamp}]
        st.setdefault("phase", "Pending")
        st.update(status)
        api.update(fresh, subresource="status")

    def _mark_scheduled(self, pod: dict[str, Any]) -> None:
        api = self.sandbox.api
        assert api is not None
        self._pending.pop(pod["metadata"].get("uid", ""), None)
        ns = pod["metadata"].get("namespace", "default")
        record_event(api, pod, "Normal", "Scheduled",
                     f"Successfully assigned {ns}/{pod['metadata']['name']} to {self.sandbox.node_name}", SCHEDULER)
        self._set_condition(pod, {"type": "PodScheduled", "status": "True"})

    def _mark_running(self, pod: dict[str, Any]) -> None:
        """Every claim prepared: the emulated kubelet reports the pod running (no process is started)."""
        api = self.sandbox.api
        assert api is not None
        fresh = api.get("Pod", pod["metadata"]["name"], pod["metadata"].get("namespace", "default"))
        if fresh is None or (fresh.get("status") or {}).get("phase") == "Running":
            return
        stamp = _now()
        st = fresh.setdefault("status", {})
        st["phase"] = "Running"
        st["startTime"] = st.get("startTime") or stamp
        kept = [c for c in st.get("conditions") or [] if c.get("type") == "PodScheduled"]
        st["conditions"] = kept + [{"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": stamp}
                                   for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")]
        st["containerStatuses"] = [{"name": c.get("name", ""), "image": c.get("image", ""), "ready": True,
                                    "started": True, "restartCount": 0, "state": {"running": {"startedAt": stamp}}}
                                   for c in fresh.get("spec", {}).get("containers") or []]
        api.update(fresh, subresource="status")
        self.say(f"kubelet: pod {fresh['metadata'].get('namespace', 'default')}/{fresh['metadata']['name']} running")

    def _pod_claims(self, pod: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The Pod's claims, created from templates and allocated as needed; None when not schedulable yet."""
        api = self.sandbox.api
        assert api is not None
        ns = pod["metadata"].get("namespace", "default")
        entries = pod.get("spec", {}).get("resourceClaims") or []
        if pod["metadata"].get("deletionTimestamp"):
            return None
        if not entries:
            return self._extended_claims(pod)
        statuses = {s["name"]: s.get("resourceClaimName") for s in pod.get("status", {}).get(
            "resourceClaimStatuses", [])}
        names: list[str] = []
        changed = False
        for entry in entries:
            if entry.get("resourceClaimName"):
                names.append(entry["resourceClaimName"])
            elif entry.get("resourceClaimTemplateName"):
                if entry["name"] not in statuses:
                    claim = self._claim_from_template(pod, entry)
                    statuses[entry["name"]] = claim["metadata"]["name"]
                    changed = True
                names.append(str(statuses[entry["name"]]))
        if changed:
            pod = api.get("Pod", pod["metadata"]["name"], ns) or pod
            pod.setdefault("status", {})["resourceClaimStatuses"] = [
                {"name": k, "resourceClaimName": v} for k, v in statuses.items()]
            pod = api.update(pod, subresource="status")
        found = [api.get("ResourceClaim", n, ns) for n in names]
        claims: list[dict[str, Any]] = [c for c in found if c is not None]
        if len(claims) != len(found):
            return None
        pod_ref = {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        pending = [c for c in claims if (c is not None and not (c.get("status") or {}).get("reservedFor")) or
                   (c is not None and pod_ref not in (c.get("status") or {}).get("reservedFor", []))]
        if pending:
            allocated = scheduler.allocate(api, [(ns, n) for n in names], node_name=self.sandbox.node_name,
                                           reserved_for=[pod_ref])
            devices = [r["device"] for c in allocated for r in c["status"]["allocation"]["devices"]["results"]]
            self.say(f"scheduler: pod {ns}/{pod['metadata']['name']} -> node {self.sandbox.node_name}, "
                     f"devices {', '.join(devices)}")
            if not pod.get("spec", {}).get("nodeName"):
                fresh = api.get("Pod", pod["metadata"]["name"], ns)
                if fresh is not None:
                    fresh["spec"]["nodeName"] = self.sandbox.node_name
                    api.update(fresh)
                    self._mark_scheduled(fresh)
            claims = self._protect(allocated)
        return claims + (self._extended_claims(pod) or [])  # extended resources beside claims (KEP-5004)

    def _extended_claims(self, pod: dict[str, Any]) -> list[dict[str, Any]] | None:
        """A device-plugin-style Pod (``nvidia.com/gpu: 1``, no resourceClaims): the claim the scheduler makes."""
        api = self.sandbox.api
        assert api is not None
        ns, name = pod["metadata"].get("namespace", "default"), pod["metadata"]["name"]
        pod_ref = {"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}
        existing = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
        if existing.get("resourceClaimName"):
            claim = api.get("ResourceClaim", existing["resourceClaimName"], ns)
            if claim is not None and pod_ref in (claim.get("status") or {}).get("reservedFor", []):
                return [claim]
        claim = scheduler.schedule_extended(api, pod, node_name=self.sandbox.node_name)
        if claim is None:
            return None
        [claim] = self._protect([claim])
        devices = ", ".join(r["device"] for r in claim["status"]["allocation"]["devices"]["results"])
        self.say(f"scheduler: pod {ns}/{name} (extended resources) -> node {self.sandbox.node_name}, claim "
                 f"{claim['metadata']['name']}, devices {devices}")
        fresh = api.get("Pod", name, ns)
        if fresh is not None and not fresh.get("spec", {}).get("nodeName"):
            fresh["spec"]["nodeName"] = self.sandbox.node_name
            api.update(fresh)
        return [claim]

    def _claim_from_template(self, pod: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
        assert self.sandbox.api is not None
        claim = create_claim_from_template(self.sandbox.api, pod, entry)
        self.say(f"resourceclaim controller: created claim {claim['metadata']['namespace']}/"
                 f"{claim['metadata']['name']} from template {entry['resourceClaimTemplateName']}")
        return claim


GENERATE_NAME_MAX = 57
"""The longest ``generateName`` the resourceclaim controller sets: 63 minus a hyphen and 5 random characters."""


def claim_generate_name(pod_name: str, pod_claim_name: str) -> str:
    """The resourceclaim controller's ``generateName`` for a Pod's template claim: ``<pod>-<claim>-``, or both
    names cut in proportion to their lengths (integer division, as the controller's Go code) when that is longer
    than :data:`GENERATE_NAME_MAX`, e.g. a 60-character pod name and ``gpu`` give 52 + ``-`` + 2 characters."""
    base = f"{pod_name}-{pod_claim_name}-"
    if len(base) <= GENERATE_NAME_MAX:
        return base
    return (pod_name[:len(pod_name) * GENERATE_NAME_MAX // len(base)] + "-"
            + pod_claim_name[:len(pod_claim_name) * GENERATE_NAME_MAX // len(base)])


def create_claim_from_template(api: ApiServerEmulator, pod: dict[str, Any], entry: dict[str, Any], *,
                               suffix: str = "") -> dict[str, Any]:
    """What the resourceclaim controller does for a Pod's ``resourceClaimTemplateName`` entry.

    The claim is owned by the Pod, carries the template's labels and annotations plus the Pod's claim name
    (``resource.kubernetes.io/pod-claim-name``), and its spec is copied from the template. Its name is generated
    as the resourceclaim controller does (``pkg/controller/resourceclaim/controller.go``): ``generateName``
    ``<pod>-<entry>-``, or, when that is longer than 57 characters, both names cut in proportion to their lengths
    and joined by ``-``; the API server appends 5 random characters (``names.SimpleNameGenerator``). ``suffix``
    names the claim ``<pod>-<entry>-<suffix>`` instead (a caller that needs the name before creating it).

    :raises AllocationError: the template does not exist (the Pod cannot be scheduled).
    """
    ns = pod["metadata"].get("namespace", "default")
    template = api.get("ResourceClaimTemplate", entry["resourceClaimTemplateName"], ns)
    if template is None:
        raise AllocationError(f"pod {ns}/{pod['metadata']['name']}: ResourceClaimTemplate "
                              f"{entry['resourceClaimTemplateName']} not found")
    template_meta = template["spec"].get("metadata") or {}
    naming = ({"name": f"{pod['metadata']['name']}-{entry['name']}-{suffix}"} if suffix
              else {"generateName": claim_generate_name(pod["metadata"]["name"], entry["name"])})
    return api.create({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            **naming,
            "namespace": ns,
            **({"labels": dict(template_meta["labels"])} if template_meta.get("labels") else {}),
            "annotations": {**(template_meta.get("annotations") or {}), POD_CLAIM_ANNOTATION: entry["name"]},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                 "uid": pod["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": template["spec"]["spec"],
    })


def pod_resources_socket(sandbox: SandboxNode) -> Path:
    """Where the emulated kubelet serves PodResources: ``<root>/pod-resources/kubelet.sock``."""
    return sandbox.root / "pod-resources" / "kubelet.sock"


@contextlib.asynccontextmanager
async def _serving(server: Any) -> AsyncIterator[Any]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def describe(sandbox: SandboxNode, env_file: Path) -> dict[str, Any]:
    """What a user needs to drive the sandbox: paths, the kubeconfig, the plugin environment file."""
    return {
        "root": str(sandbox.root),
        "node_name": sandbox.node_name,
        "kubeconfig": str(sandbox.kubeconfig),
        "api_server": sandbox.api.url if sandbox.api else "",
        "plugin_env_file": str(env_file),
        "cdi_root": str(sandbox.cdi_root),
        "registrar_dir": str(sandbox.config().kubelet_registrar_directory_path),
        "pod_resources_socket": str(pod_resources_socket(sandbox)),
    }


def dump(info: dict[str, Any]) -> str:
    """One line of JSON."""
    return json.dumps(info)
