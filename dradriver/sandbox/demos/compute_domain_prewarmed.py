"""``dradriver demo --scenario compute-domain --imex pre-warmed``: a GB200 NVL72 rack whose IMEX daemons run before
any ComputeDomain exists, jobs that get their domains without a new pod, and a job held at binding until its
domain is ready (issue 35: ``docs/user-guide/compute-domains.md``, "Pre-warmed IMEX daemons" and "Binding
conditions").

The multi-node sandbox (:mod:`dradriver.sandbox.multinode`, ``pre_warmed=True, binding_conditions=True``) runs one
rack of two emulated nodes (clique ``abc9829a-...2``), a ``compute-domain-kubelet-plugin`` process per node with
``IMEX_MODE=preWarmed`` and ``BINDING_CONDITIONS=true``, the ``compute-domain-controller`` in the pre-warmed mode
(its DaemonSet per clique runs one IMEX daemon Pod per node, each domain one channel in the clique's IMEX domain),
and a scheduler with KEP-5007's ``DRADeviceBindingConditions`` on: a workload Pod whose channel carries the binding
condition ``ComputeDomainReady`` waits in PreBind until the node's plugin sets it. Steps:

1. start the rack: plugins, controller; CRDs and DeviceClasses;
2. the clique daemons already running and Ready on every node (``nvidia-imex-ctl -q``: ``READY``) while no
   ComputeDomain exists; the channels published with their binding conditions;
3. job 1: a ComputeDomain and one workload Pod per node, created together; the time from the ComputeDomain's
   creation to every claim of the job prepared is measured and printed (no new pod anywhere: the clique daemons
   serve it), with the domain's channel;
4. job 2 the same, with a channel of its own beside job 1's on the same nodes;
5. the clique daemon of the second node is replaced (its Pod deleted, as a daemon upgrade or crash does) and its
   new Pod's image is still being pulled (:attr:`~dradriver.sandbox.multinode.EmulatedNode.pulling`), so the
   node's daemon is not Ready; job 3 is created: its Pod on the first node is bound and its claim prepared, while
   its Pod on the second node is allocated there and held in PreBind (no ``ComputeDomainReady`` yet, not bound,
   nothing prepared);
6. the image is pulled: the new daemon turns Ready, the plugin sets ``ComputeDomainReady``, the held Pod is bound
   and its claim prepared at once; the times (from job 3's creation) are printed;
7. delete the jobs: ComputeDomains, templates, node labels, the workload claims' CDI specs and claim state gone;
   the clique daemons keep running, Ready, for the next job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dradriver.domain import computedomains as cd
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER
from dradriver.sandbox.demos.compute_domain import (
    WAIT_S,
    compute_domain,
    daemon_pods,
    imex_state,
    started_cluster,
    wait_step,
    workload_pod,
)
from dradriver.sandbox.demos.narrator import DemoError, Narrator, Step, run_steps
from dradriver.sandbox.multinode import MultiNodeCluster

NS = "default"
CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"
JOBS = ("job-1", "job-2", "job-3")
POLL_S = 0.01
"""How often the measured waits look (seconds): the resolution of the printed times."""


def _channel_path(channel: int) -> str:
    return f"{CHANNELS_DIR}/channel{channel}"


def run(narrator: Narrator) -> None:
    """Run the seven steps of the module docstring.

    :raises DemoError: a step did not produce what the driver promises (the message says which).
    """
    narrator.step(1, "one GB200 NVL72 rack of 2 nodes: pre-warmed IMEX daemons, binding conditions")
    with started_cluster((2,), pre_warmed=True, binding_conditions=True) as cluster:
        for node in cluster.nodes.values():
            narrator.say(f"node {node.name}: address {node.ip}, plugin pid {node.plugin.pid if node.plugin else '-'} "
                         "(IMEX_MODE=preWarmed, BINDING_CONDITIONS=true)", node=node.name, ip=node.ip)
        narrator.done()
        scenario = _PreWarmed(cluster, narrator)
        run_steps(narrator, [
            Step("the clique daemons: already running and Ready, no ComputeDomain yet", scenario.daemons),
            Step("job-1: a ComputeDomain and a Pod per node, claims prepared", lambda: scenario.job("job-1")),
            Step("job-2: a ComputeDomain of its own on the same nodes", lambda: scenario.job("job-2")),
            Step(lambda: f"job-3 held at binding: {scenario.held_node}'s clique daemon replaced, its image pulling",
                 scenario.hold),
            Step(lambda: f"{scenario.held_node}'s daemon Ready: job-3 bound and prepared", scenario.release),
            Step("delete the jobs: nothing left behind, the clique daemons keep running", scenario.tear_down),
        ], first=2)


def _now_s(since: float) -> float:
    return round(time.monotonic() - since, 3)


class _PreWarmed:
    """Steps 2 to 7 (module docstring) and what they learn on the way (the clique, each job's UID, channel and
    workload claims, the held Pod's times)."""

    def __init__(self, cluster: MultiNodeCluster, narrator: Narrator) -> None:
        self.cluster, self.narrator = cluster, narrator
        self.nodes = sorted(cluster.nodes)
        self.held_node = self.nodes[-1]
        self.clique = ""
        self.uids: dict[str, str] = {}
        self.channels: dict[str, int] = {}
        self.claims: dict[str, str] = {}  # workload claim UID -> namespace/name
        self.job3_created = 0.0
        self.replaced = ""  # the daemon Pod replaced in step 5

    # ------------------------------------------------------------------ helpers
    def _daemons(self) -> dict[str, dict[str, Any]]:
        """Node name -> the live clique daemon Pod there (the pre-warmed domain of the rack's clique)."""
        return daemon_pods(self.cluster, cd.clique_domain_uid(self.clique)) if self.clique else {}

    def _pods(self, job: str) -> list[tuple[str, str]]:
        """(Pod name, node) of ``job``'s workload Pods: one per node."""
        return [(f"{job}-{i}", node) for i, node in enumerate(self.nodes)]

    def _bound(self, pod: str) -> str:
        return str(((self.cluster.api.get("Pod", pod, NS) or {}).get("spec") or {}).get("nodeName") or "")

    def _prepared(self, pod: str, node: str) -> bool:
        return f"{NS}/{pod}" in self.cluster.node(node).pod_devices

    def _claim(self, pod: str) -> dict[str, Any] | None:
        obj = self.cluster.api.get("Pod", pod, NS) or {}
        names = [s.get("resourceClaimName") for s in (obj.get("status") or {}).get("resourceClaimStatuses") or []]
        return self.cluster.api.get("ResourceClaim", str(names[0]), NS) if names and names[0] else None

    def _create_job(self, job: str) -> None:
        template = f"{job}-channel"
        self.uids[job] = str(self.cluster.api.create(compute_domain(job, template, num_nodes=None))["metadata"]["uid"])
        for pod, node in self._pods(job):
            self.cluster.api.create(workload_pod(pod, template, group=job, node=node))

    def _measure(self, what: str, done: Callable[[], bool], since: float) -> float:
        """Seconds from ``since`` until ``done()`` holds, looked at every :data:`POLL_S`.

        :raises DemoError: not within the demo's :data:`WAIT_S`.
        """
        deadline = since + WAIT_S
        while not done():
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {WAIT_S} s waiting for {what}")
            time.sleep(POLL_S)
        return _now_s(since)

    def _check_pods(self, job: str) -> list[dict[str, Any]]:
        """Each Pod of ``job``: running on its node with exactly its domain's channel; their details."""
        channel = self.channels[job]
        out = []
        for pod, node in self._pods(job):
            wait_step(self.cluster, f"Pod {pod} running", lambda pod=pod: self.cluster.pod_running(pod))
            edits = self.cluster.node(node).pod_devices[f"{NS}/{pod}"]
            if edits.device_paths() != [_channel_path(channel)]:
                raise DemoError(f"Pod {pod} should get {_channel_path(channel)} only, got {edits.device_paths()}")
            claim = self._claim(pod)
            if claim is not None:
                self.claims[str(claim["metadata"]["uid"])] = f"{NS}/{claim['metadata']['name']}"
            out.append({"pod": pod, "node": node, "device_paths": edits.device_paths()})
        return out

    # ------------------------------------------------------------------ steps
    def daemons(self) -> None:
        cluster, narrator = self.cluster, self.narrator
        self.clique = wait_step(cluster, "the clique label on every node", lambda: (
            c := {cluster.node(n).labels().get(cd.NODE_CLIQUE_LABEL, "") for n in self.nodes}) and len(c) == 1
            and "" not in c and next(iter(c)))
        ready = wait_step(cluster, "a Ready clique daemon on every node", lambda: (
            d := self._daemons()) and set(d) == set(self.nodes) and all(cd.pod_ready(p) for p in d.values()) and d)
        domains = cluster.api.objects(cd.COMPUTE_DOMAIN_KIND)
        if domains:
            raise DemoError(f"no ComputeDomain should exist yet, found {len(domains)}")
        for node, pod in sorted(ready.items()):
            owner = next((r["name"] for r in pod["metadata"].get("ownerReferences") or ()
                          if r.get("kind") == "DaemonSet"), "")
            state = wait_step(cluster, f"nvidia-imex on {node} READY",
                              lambda node=node, pod=pod: (s := imex_state(cluster, node, pod, "-q")) == "READY\n" and s)
            narrator.say(f"{node}: clique {self.clique}: daemon Pod {pod['metadata']['name']} (DaemonSet {owner}) "
                         f"Ready, nvidia-imex-ctl -q: {state.strip()}", node=node, pod=pod["metadata"]["name"],
                         daemonset=owner, clique=self.clique, ready=True, state=state.strip(), compute_domains=0)
        channel = next((d for s in cluster.api.objects("ResourceSlice")
                        if s["spec"].get("driver") == COMPUTE_DOMAIN_DRIVER.driver_name
                        for d in s["spec"].get("devices") or () if d.get("bindingConditions")), None)
        if channel is None:
            raise DemoError("the channels should be published with binding conditions (BINDING_CONDITIONS=true)")
        narrator.say(f"ComputeDomains: none. Channels published with bindingConditions {channel['bindingConditions']}, "
                     f"bindingFailureConditions {channel.get('bindingFailureConditions')}",
                     compute_domains=0, binding_conditions=channel["bindingConditions"],
                     binding_failure_conditions=channel.get("bindingFailureConditions"))

    def job(self, job: str) -> None:
        cluster, narrator = self.cluster, self.narrator
        before = {p["metadata"]["uid"] for p in cluster.api.objects("Pod", cluster.namespace)}
        created = time.monotonic()
        self._create_job(job)
        seconds = self._measure(f"every claim of {job} prepared",
                                lambda: all(self._prepared(p, n) for p, n in self._pods(job)), created)
        channel = cd.domain_channel(cluster.api.get(cd.COMPUTE_DOMAIN_KIND, job, NS) or {})
        if channel is None:
            raise DemoError(f"ComputeDomain {job} has prepared claims but no channel annotation")
        self.channels[job] = channel
        pods = self._check_pods(job)
        others = {j: c for j, c in self.channels.items() if j != job}
        if channel in others.values() or channel == 0:
            raise DemoError(f"{job} should get a channel of its own other than 0, got {channel} (others: {others})")
        new_pods = {p["metadata"]["uid"] for p in cluster.api.objects("Pod", cluster.namespace)} - before
        if new_pods:
            raise DemoError(f"{job} should need no new pod in the driver namespace, {len(new_pods)} were made")
        narrator.say(f"ComputeDomain {job} created -> every claim of its {len(pods)} Pods prepared in "
                     f"{seconds * 1000:.0f} ms (no new pod: the clique daemons serve it)", job=job,
                     seconds_to_prepared=seconds, channel=channel, uid=self.uids[job], new_pods=0)
        for detail in pods:
            narrator.say(f"{detail['pod']} on {detail['node']}: {', '.join(detail['device_paths'])}", job=job,
                         **detail)

    def hold(self) -> None:
        cluster, narrator, node = self.cluster, self.narrator, self.held_node
        old = self._daemons()[node]
        self.replaced = str(old["metadata"]["uid"])
        cluster.node(node).pulling = True  # the new daemon Pod's image is still being pulled
        cluster.api.delete("Pod", old["metadata"]["name"], cluster.namespace)
        fresh = wait_step(cluster, f"a new clique daemon Pod on {node}", lambda: (
            p := self._daemons().get(node)) and p["metadata"]["uid"] != self.replaced and p)
        if cd.pod_ready(fresh):
            raise DemoError(f"the new daemon Pod {fresh['metadata']['name']} should not be Ready while its image pulls")
        narrator.say(f"{node}: daemon Pod {old['metadata']['name']} deleted; its replacement "
                     f"{fresh['metadata']['name']} Pending (image pulling): the node's daemon is not Ready",
                     node=node, replaced=old["metadata"]["name"], pod=fresh["metadata"]["name"], ready=False)
        self.job3_created = created = time.monotonic()
        self._create_job("job-3")
        (other, other_node), (held, _) = self._pods("job-3")
        bound_s = self._measure(f"{other} bound to {other_node}", lambda: self._bound(other) == other_node, created)
        prepared_s = self._measure(f"{other}'s claim prepared", lambda: self._prepared(other, other_node), created)
        claim = wait_step(cluster, f"{held}'s claim allocated on {node}", lambda: (
            c := self._claim(held)) and ((c.get("status") or {}).get("allocation")) and c)
        result = claim["status"]["allocation"]["devices"]["results"][0]
        if cd.BINDING_CONDITION not in (result.get("bindingConditions") or ()) or result["pool"] != node:
            raise DemoError(f"{held}'s channel should be allocated on {node} with the binding condition "
                            f"{cd.BINDING_CONDITION}: {result}")
        conditions = [c for d in (claim.get("status") or {}).get("devices") or () for c in d.get("conditions") or ()]
        if self._bound(held) or self._prepared(held, node) or conditions:
            raise DemoError(f"{held} should be held in PreBind (unbound, nothing prepared, no condition): bound to "
                            f"{self._bound(held)!r}, conditions {conditions}")
        narrator.say(f"{other} on {other_node}: bound at +{bound_s * 1000:.0f} ms, its claim prepared at "
                     f"+{prepared_s * 1000:.0f} ms (the node's daemon is Ready)", pod=other, node=other_node,
                     bound_s=bound_s, prepared_s=prepared_s)
        narrator.say(f"{held}: channel {result['device']} allocated on {node} with bindingConditions "
                     f"{result['bindingConditions']}; held in PreBind: not bound, nothing prepared, no "
                     f"{cd.BINDING_CONDITION} yet (+{_now_s(created) * 1000:.0f} ms)", pod=held, node=node,
                     held=True, device=result["device"], binding_conditions=result["bindingConditions"],
                     held_s=_now_s(created))

    def release(self) -> None:
        cluster, narrator, node = self.cluster, self.narrator, self.held_node
        created, (_, (held, _)) = self.job3_created, self._pods("job-3")
        still_held = not self._bound(held)
        released_s = _now_s(created)
        cluster.node(node).pulling = False
        ready_s = self._measure(f"the new clique daemon on {node} Ready",
                                lambda: (p := self._daemons().get(node)) is not None and cd.pod_ready(p), created)
        bound_s = self._measure(f"{held} bound to {node}", lambda: self._bound(held) == node, created)
        prepared_s = self._measure(f"{held}'s claim prepared", lambda: self._prepared(held, node), created)
        claim = self._claim(held) or {}
        condition = next((c for d in (claim.get("status") or {}).get("devices") or ()
                          for c in d.get("conditions") or () if c.get("type") == cd.BINDING_CONDITION), None)
        if not still_held or condition is None or condition.get("status") != "True":
            raise DemoError(f"{held} should have been bound only once {cd.BINDING_CONDITION} was True: held until "
                            f"the release: {still_held}, condition {condition}")
        channel = cd.domain_channel(cluster.api.get(cd.COMPUTE_DOMAIN_KIND, "job-3", NS) or {})
        if channel is None or channel in (self.channels.get("job-1"), self.channels.get("job-2")):
            raise DemoError(f"job-3 should get a channel of its own, got {channel} ({self.channels})")
        self.channels["job-3"] = channel
        pods = self._check_pods("job-3")
        narrator.say(f"image pulled at +{released_s * 1000:.0f} ms; {node}'s new daemon Ready at "
                     f"+{ready_s * 1000:.0f} ms", node=node, released_s=released_s, daemon_ready_s=ready_s)
        narrator.say(f"{held}: {cd.BINDING_CONDITION}=True ({condition.get('reason')}: {condition.get('message')})\n"
                     f"bound at +{bound_s * 1000:.0f} ms, its claim prepared at +{prepared_s * 1000:.0f} ms",
                     pod=held, node=node, held_until_release=still_held, condition=condition, bound_s=bound_s,
                     prepared_s=prepared_s)
        for detail in pods:
            narrator.say(f"{detail['pod']} on {detail['node']}: {', '.join(detail['device_paths'])}", job="job-3",
                         channel=channel, **detail)

    def tear_down(self) -> None:
        cluster, narrator = self.cluster, self.narrator
        for job in JOBS:
            for pod, _ in self._pods(job):
                cluster.api.delete("Pod", pod, NS)
            cluster.api.delete(cd.COMPUTE_DOMAIN_KIND, job, NS)
        wait_step(cluster, "every ComputeDomain gone", lambda: not cluster.api.objects(cd.COMPUTE_DOMAIN_KIND))

        def leftovers() -> dict[str, list[str]]:
            return {
                "resource claim templates": [f"{NS}/{t['metadata']['name']}" for t in
                                             cluster.api.objects("ResourceClaimTemplate", NS)],
                "node labels": [n for n in self.nodes if any(
                    cluster.node(n).labels().get(cd.LABEL_COMPUTE_DOMAIN) == uid for uid in self.uids.values())],
                "cdi specs": [f"{n}:{f}" for n in self.nodes for f in cluster.claim_specs(n)
                              if any(uid in f for uid in self.claims)],
                "claim state": [f"{n}:{self.claims[uid]}" for n in self.nodes for uid in cluster.claim_state(n)
                                if uid in self.claims],
            }

        wait_step(cluster, "every template, label, CDI spec and claim state entry of the jobs gone",
                  lambda: not any(leftovers().values()))
        daemons = wait_step(cluster, "a Ready clique daemon on every node", lambda: (
            d := self._daemons()) and set(d) == set(self.nodes) and all(cd.pod_ready(p) for p in d.values()) and d)
        narrator.say(f"ComputeDomains, templates, node labels, the {len(self.claims)} workload claims' CDI specs and "
                     "claim state: none left", leftovers=leftovers(), workload_claims=len(self.claims))
        narrator.say("clique daemons still running and Ready: " + ", ".join(
            f"{n} {p['metadata']['name']}" for n, p in sorted(daemons.items())),
                     daemons={n: p["metadata"]["name"] for n, p in daemons.items()})
