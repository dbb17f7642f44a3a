"""A one-node cluster emulator for running the kubelet plugin by hand (``dradriver sandbox``).

It plays the control plane and the kubelet around a plugin started separately
(``dradriver gpu-kubelet-plugin`` with the environment file it writes):

* the Kubernetes API emulator over HTTP (use ``kubectl --kubeconfig <root>/kubeconfig``);
* the resourceclaim controller: a Pod's ``resourceClaimTemplateName`` entries become ResourceClaims;
* the scheduler: the Pod's pending claims are allocated on this node (our allocation simulator) and the Pod
  is bound (``spec.nodeName``);
* the kubelet: registers the plugin from the registrar directory, calls NodePrepareResources for the claims of
  each bound Pod, and NodeUnprepareResources once no Pod uses a claim any more (Pod deleted);
* the Deployment controller and the node's container runner (:mod:`dradriver.sandbox.workloads`), which run
  the MPS control daemons' Pods as local processes (``dradriver sandbox`` starts them and turns MPSSupport on
  where this process may mount tmpfs, as the plugin it starts does).

Each reconcile pass reads the emulator's objects directly; progress goes to ``log`` lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dradriver.allocator.allocation import AllocationError
from dradriver.config import PLUGIN_FLAGS, PluginConfig
from dradriver.domain.claims import ClaimRef
from dradriver.domain.featuregates import FeatureGates
from dradriver.domain.identity import GPU_DRIVER
from dradriver.sandbox import scheduler
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.kubelet import KubeletEmulator, KubeletError, PluginConnection
from dradriver.sandbox.node import SandboxNode

log = logging.getLogger(__name__)
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


def plugin_environment(config: PluginConfig) -> dict[str, str]:
    """The environment that makes ``dradriver gpu-kubelet-plugin`` run with ``config`` (flag twins only)."""
    env: dict[str, str] = {}
    for flag in PLUGIN_FLAGS:
        value = getattr(config, flag.dest)
        if isinstance(value, bool):
            env[flag.env] = "true" if value else "false"
        elif isinstance(value, FeatureGates):
            env[flag.env] = value.render()
        elif isinstance(value, tuple):
            env[flag.env] = ",".join(str(v) for v in value)
        else:
            env[flag.env] = str(value)
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

    def apply_device_classes(self) -> None:
        """Create the DeviceClasses ``deploy/`` ships (``gpu.nvidia.com``, ``mig.nvidia.com``)."""
        assert self.sandbox.api is not None
        text = resources.files("dradriver.sandbox").joinpath("manifests", "deviceclasses.yaml").read_text()
        for obj in yaml.safe_load_all(text):
            if obj and self.sandbox.api.get("DeviceClass", obj["metadata"]["name"]) is None:
                self.sandbox.api.create(obj)

    async def run(self, stop: asyncio.Event, *, interval_s: float = 0.2) -> None:
        """Reconcile until ``stop`` is set."""
        async with KubeletEmulator(self.sandbox.config().kubelet_registrar_directory_path) as kubelet:
            self._kubelet = kubelet
            while not stop.is_set():
                try:
                    await self.reconcile()
                except (AllocationError, KubeletError) as exc:
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
        if plugin is not None and plugin is not self._plugin:
            self._plugin = plugin
            self.say(f"kubelet: registered {GPU_DRIVER.driver_name} at {plugin.endpoint} ({plugin.service})")
        in_use: set[str] = set()
        for pod in api.objects("Pod"):
            claims = self._pod_claims(pod)
            if claims is None:
                continue
            refs = [ClaimRef(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
            in_use.update(r.uid for r in refs)
            todo = [r for r in refs if r.uid not in self.prepared]
            if not todo or self._plugin is None:
                continue
            answer = await self._plugin.prepare(todo)
            for ref in todo:
                res = answer[ref.uid]
                if res.error:
                    self.say(f"! kubelet: prepare {ref.namespace}/{ref.name} for pod {pod['metadata']['name']}: "
                             f"{res.error}")
                    continue
                self.prepared[ref.uid] = ref
                ids = ", ".join(i for d in res.devices for i in d.cdi_device_ids)
                self.say(f"kubelet: pod {ref.namespace}/{pod['metadata']['name']} claim {ref.name} prepared: {ids}")
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

    def _pod_claims(self, pod: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The Pod's claims, created from templates and allocated as needed; None when not schedulable yet."""
        api = self.sandbox.api
        assert api is not None
        ns = pod["metadata"].get("namespace", "default")
        entries = pod.get("spec", {}).get("resourceClaims") or []
        if not entries or pod["metadata"].get("deletionTimestamp"):
            return None
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
            claims = allocated
        return claims

    def _claim_from_template(self, pod: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
        assert self.sandbox.api is not None
        claim = create_claim_from_template(self.sandbox.api, pod, entry)
        self.say(f"resourceclaim controller: created claim {claim['metadata']['namespace']}/"
                 f"{claim['metadata']['name']} from template {entry['resourceClaimTemplateName']}")
        return claim


def create_claim_from_template(api: ApiServerEmulator, pod: dict[str, Any], entry: dict[str, Any], *,
                               suffix: str = "") -> dict[str, Any]:
    """What the resourceclaim controller does for a Pod's ``resourceClaimTemplateName`` entry.

    The claim is named ``<pod>-<entry>[-<suffix>]``, owned by the Pod and annotated with the Pod's claim
    name (``resource.kubernetes.io/pod-claim-name``), its spec copied from the template.

    :raises AllocationError: the template does not exist (the Pod cannot be scheduled).
    """
    ns = pod["metadata"].get("namespace", "default")
    template = api.get("ResourceClaimTemplate", entry["resourceClaimTemplateName"], ns)
    if template is None:
        raise AllocationError(f"pod {ns}/{pod['metadata']['name']}: ResourceClaimTemplate "
                              f"{entry['resourceClaimTemplateName']} not found")
    name = f"{pod['metadata']['name']}-{entry['name']}" + (f"-{suffix}" if suffix else "")
    return api.create({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": ns,
            "annotations": {POD_CLAIM_ANNOTATION: entry["name"]},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                 "uid": pod["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": template["spec"]["spec"],
    })


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
    }


def dump(info: dict[str, Any]) -> str:
    """One line of JSON."""
    return json.dumps(info)
