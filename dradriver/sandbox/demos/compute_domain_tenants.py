"""``dradriver demo --scenario compute-domain --tenants N`` (N >= 2): N jobs from N namespaces on one GB200 NVL72
rack, each ComputeDomain with its own IMEX channel (``IMEX_ISOLATION=channel``), side by side; a node killed
mid-run and the jobs healing on a spare node.

Channel isolation needs host-managed IMEX (``docs/user-guide/compute-domains.md``, "Isolation"): the multi-node sandbox
(:mod:`dradriver.sandbox.multinode`, ``host_imex=True, channel_isolation=True``) runs one rack of ``N + 2`` nodes,
each with the host's own ``nvidia-imex`` stand-in (a static ``nodes.cfg`` listing the rack, as an operator's
``nvidia-imex.service`` has), a ``compute-domain-kubelet-plugin`` process per node with ``IMEX_MODE=hostManaged``
and ``IMEX_ISOLATION=channel``, and the ``compute-domain-controller`` with the same settings. Tenant ``i`` (namespace
``team-<a, b, ...>``) runs two workload Pods on nodes ``i`` and ``i + 1``, so neighbouring tenants share a node;
the last node is the spare. Steps:

1. start the rack: host IMEX daemons (``READY``), plugins, controller; CRDs and DeviceClasses;
2. the ResourceSlices: every node publishes its 2048 channels in slices of 128 (no ``daemon-0``);
3. one elastic ComputeDomain ``job`` (no ``numNodes``) per tenant namespace: the controller gives each its own
   channel (annotation ``resource.nvidia.com/imexChannel``) and a workload template selecting it;
4. the workload Pods side by side: each gets its domain's channel device and no other, two channels on a shared
   node; each domain goes ``Ready``;
5. isolation: a claim in the second tenant's namespace that asks for the first tenant's channel is refused by the
   plugin with the claim and the field named, and nothing is injected;
6. node ``1`` (shared by the first two tenants) is killed: kubelet, plugin and host ``nvidia-imex`` stop answering.
   The other Pods keep their channels; the lost Pods are replaced on the spare node, as their job controller does
   once the node lifecycle controller evicted them, and get their domain's channel again; every domain ``Ready``;
7. the node heals: its kubelet finds its Pods gone and unprepares their claims (no CDI spec, no claim state left);
8. delete the Pods and the ComputeDomains: nothing left behind (templates, CDI specs, claim state), the channel
   annotations gone with their domains.
"""

from __future__ import annotations

import string
from typing import Any

from dradriver.domain import computedomains as cd
from dradriver.sandbox.demos.compute_domain import (
    compute_domain,
    domain_ready,
    started_cluster,
    wait_step,
    workload_pod,
)
from dradriver.sandbox.demos.narrator import DemoError, Narrator, Step, run_steps
from dradriver.sandbox.multinode import EmulatedNode, MultiNodeCluster

DOMAIN = "job"
TEMPLATE = "job-channel"
CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"
MAX_TENANTS = 4
"""Tenants the scenario runs at most (``N + 2`` node processes on one machine)."""


def tenant_namespaces(tenants: int) -> list[str]:
    """``team-a``, ``team-b``, ... (one namespace per tenant)."""
    return [f"team-{string.ascii_lowercase[i]}" for i in range(tenants)]


def domain_channel_of(cluster: MultiNodeCluster, namespace: str) -> int | None:
    """The IMEX channel the controller gave ComputeDomain ``namespace/job`` (its annotation), if any yet."""
    obj = cluster.api.get(cd.COMPUTE_DOMAIN_KIND, DOMAIN, namespace) or {}
    return cd.domain_channel(obj) if obj else None


def _channel_path(channel: int) -> str:
    return f"{CHANNELS_DIR}/channel{channel}"


def run(narrator: Narrator, tenants: int) -> None:
    """Run the eight steps of the module docstring for ``tenants`` tenants.

    :raises DemoError: ``tenants`` outside 2..:data:`MAX_TENANTS`, or a step did not produce what the driver
        promises (the message says which).
    """
    if not 2 <= tenants <= MAX_TENANTS:
        raise DemoError(f"--tenants: {tenants} is outside 2..{MAX_TENANTS} for the multi-tenant compute-domain "
                        "scenario (1 runs the single-domain one)")
    narrator.step(1, f"one GB200 NVL72 rack of {tenants + 2} nodes: host-managed IMEX, IMEX_ISOLATION=channel")
    with started_cluster((tenants + 2,), host_imex=True, channel_isolation=True) as cluster:
        for node in cluster.nodes.values():
            narrator.say(f"node {node.name}: address {node.ip}, host nvidia-imex pid "
                         f"{node.host_imex.pid if node.host_imex else '-'} ({cluster.host_imex_state(node)}), "
                         f"plugin pid {node.plugin.pid if node.plugin else '-'}",
                         node=node.name, ip=node.ip, host_imex=cluster.host_imex_state(node))
        narrator.done()
        _run_steps(cluster, narrator, tenants)


def _run_steps(cluster: MultiNodeCluster, narrator: Narrator, tenants: int) -> None:
    scenario = _Tenants(cluster, narrator, tenants)
    first, second = scenario.namespaces[0], scenario.namespaces[1]
    victim = scenario.victim
    run_steps(narrator, [
        Step("ResourceSlices of driver compute-domain.nvidia.com: every channel of every node", scenario.slices),
        Step(f"{tenants} tenants, one elastic ComputeDomain '{DOMAIN}' each (no numNodes)", scenario.domains),
        Step("the workload Pods side by side: each its own domain's channel", scenario.workloads),
        Step(lambda: f"isolation: {second} asks for {first}'s channel {scenario.channels[first]}",
             scenario.isolation),
        Step(f"node {victim} killed mid-run (it serves {first} and {second})", scenario.kill_node),
        Step(f"node {victim} heals: its orphaned claims are unprepared", scenario.heal_node),
        Step("delete the Pods and the ComputeDomains: nothing left behind", scenario.tear_down),
    ], first=2)


class _Tenants:
    """The multi-tenant scenario's steps 2 to 8 (module docstring) and what they learn on the way (each domain's
    UID and channel, where each tenant's Pods run)."""

    def __init__(self, cluster: MultiNodeCluster, narrator: Narrator, tenants: int) -> None:
        self.cluster, self.narrator, self.tenants = cluster, narrator, tenants
        self.nodes = sorted(cluster.nodes)
        self.spare = self.nodes[-1]
        self.victim = self.nodes[1]
        self.namespaces = tenant_namespaces(tenants)
        self.uids: dict[str, str] = {}
        self.channels: dict[str, int] = {}
        self.placement = {ns: [self.nodes[i], self.nodes[i + 1]] for i, ns in enumerate(self.namespaces)}

    def slices(self) -> None:
        cluster = self.cluster
        slices = wait_step(cluster, "every node's channel slices", lambda: _channel_slices(cluster, len(self.nodes)))
        for pool, devices in sorted(slices.items()):
            self.narrator.say(f"pool {pool}: {len(devices)} devices in {len(set(d[1] for d in devices))} slices "
                              f"(channel-0 .. channel-{len(devices) - 1})", pool=pool, devices=len(devices),
                              daemon=any(name.startswith("daemon") for name, _ in devices))

    def domains(self) -> None:
        cluster, uids, channels = self.cluster, self.uids, self.channels
        for ns in self.namespaces:
            cluster.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns},
                                "status": {"phase": "Active"}})
            uids[ns] = str(cluster.api.create(compute_domain(DOMAIN, TEMPLATE, num_nodes=None,
                                                             namespace=ns))["metadata"]["uid"])
        for ns in self.namespaces:
            channels[ns] = wait_step(cluster, f"ComputeDomain {ns}/{DOMAIN}'s IMEX channel",
                                     lambda ns=ns: domain_channel_of(cluster, ns))
            template = wait_step(cluster, f"ResourceClaimTemplate {ns}/{TEMPLATE}",
                                 lambda ns=ns: cluster.api.get("ResourceClaimTemplate", TEMPLATE, ns))
            request = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
            selector = request["selectors"][0]["cel"]["expression"]
            self.narrator.say(f"{ns}/{DOMAIN}: IMEX channel {channels[ns]} ({cd.ANNOTATION_IMEX_CHANNEL}); template "
                              f"{TEMPLATE}: {request['deviceClassName']}, {selector}", namespace=ns,
                              channel=channels[ns], uid=uids[ns], device_class=request["deviceClassName"],
                              selector=selector)
        if len(set(channels.values())) != self.tenants or 0 in channels.values():
            raise DemoError(f"every tenant should get its own channel other than 0, got {channels}")

    def workloads(self) -> None:
        cluster, placement = self.cluster, self.placement
        for ns, where in placement.items():
            for k, node_name in enumerate(where):
                cluster.api.create(workload_pod(f"worker-{k}", TEMPLATE, group=DOMAIN, namespace=ns, node=node_name))
        for ns, where in placement.items():
            for k in range(len(where)):
                _check_pod(cluster, ns, f"worker-{k}", self.channels[ns])
        for node_name in self.nodes:
            node = cluster.node(node_name)
            here = [(ns, f"worker-{k}") for ns, where in placement.items() for k, n in enumerate(where)
                    if n == node_name]
            cells = [f"{ns}/{pod} -> {', '.join(node.pod_devices[f'{ns}/{pod}'].device_paths())}" for ns, pod in here]
            self.narrator.say(f"{node_name}: {'; '.join(cells) or '(spare)'}", node=node_name,
                              pods=[{"namespace": ns, "pod": pod,
                                     "device_paths": node.pod_devices[f"{ns}/{pod}"].device_paths()}
                                    for ns, pod in here])
        self._all_ready()
        self.narrator.say("every ComputeDomain Ready: " + ", ".join(f"{ns}/{DOMAIN}" for ns in self.namespaces),
                          ready=self.namespaces)

    def _all_ready(self) -> None:
        for ns in self.namespaces:
            wait_step(self.cluster, f"ComputeDomain {ns}/{DOMAIN} Ready",
                      lambda ns=ns: domain_ready(self.cluster, DOMAIN, ns))

    def isolation(self) -> None:
        cluster, channels = self.cluster, self.channels
        first, second = self.namespaces[0], self.namespaces[1]
        target = self.placement[second][1]  # a node where the first tenant's channel is not allocated
        cluster.api.create(_peek_claim(second, self.uids[second], channels[first]))
        cluster.api.create(_peek_pod(second, target))
        node = cluster.node(target)
        error = wait_step(cluster, f"the plugin on {target} to answer the claim {second}/peek",
                          lambda: node.prepare_errors.get(f"{second}/peek", ""))
        if "is not the IMEX channel of ComputeDomain" not in error or f"{second}/peek" not in error:
            raise DemoError(f"the claim {second}/peek should be refused for naming another domain's channel: "
                            f"{error!r}")
        if f"{second}/peek" in node.pod_devices or cluster.pod_running("peek", second):
            raise DemoError(f"Pod {second}/peek must not run with channel {channels[first]}")
        self.narrator.say(f"NodePrepareResources on {target} refused it:\n  {error}", node=target, error=error)
        cluster.force_delete_pod("peek", second)
        cluster.api.delete("ResourceClaim", "peek", second)

    def kill_node(self) -> None:
        cluster, narrator, victim, spare = self.cluster, self.narrator, self.victim, self.spare
        cluster.kill_node(victim)
        pods = [(ns, f"worker-{k}", n) for ns, where in self.placement.items() for k, n in enumerate(where)]
        lost = [(ns, pod) for ns, pod, n in pods if n == victim]
        kept = [(ns, pod) for ns, pod, n in pods if n != victim]
        narrator.say(f"{victim}: kubelet, plugin and host nvidia-imex frozen; lost Pods: "
                     + ", ".join(f"{ns}/{pod}" for ns, pod in lost), node=victim, lost=[f"{n}/{p}" for n, p in lost])
        for ns, pod in kept:
            _check_pod(cluster, ns, pod, self.channels[ns])
        narrator.say("still running with their channels: " + ", ".join(f"{ns}/{pod}" for ns, pod in kept),
                     kept=[f"{n}/{p}" for n, p in kept])
        for ns, pod in lost:  # the node lifecycle controller evicted them; their job controller makes new ones
            cluster.force_delete_pod(pod, ns)
            cluster.api.create(workload_pod(f"{pod}-r", TEMPLATE, group=DOMAIN, namespace=ns, node=spare))
        for ns, pod in lost:
            edits = _check_pod(cluster, ns, f"{pod}-r", self.channels[ns])
            narrator.say(f"{ns}/{pod}-r on spare {spare}: {', '.join(edits.device_paths())}", namespace=ns,
                         pod=f"{pod}-r", node=spare, device_paths=edits.device_paths())
        spare_paths = sorted(p for ns, pod in lost for p in cluster.node(spare).pod_devices[f"{ns}/{pod}-r"]
                             .device_paths())
        if spare_paths != sorted(_channel_path(self.channels[ns]) for ns, _ in lost):
            raise DemoError(f"the spare node should hold exactly the lost tenants' channels, it holds {spare_paths}")
        self._all_ready()
        narrator.say("every ComputeDomain Ready again", ready=self.namespaces)

    def heal_node(self) -> None:
        cluster, victim = self.cluster, self.victim
        before = len(cluster.claim_specs(victim))
        cluster.heal_node(victim)
        wait_step(cluster, f"no claim left prepared on {victim}",
                  lambda: not cluster.claim_specs(victim) and not cluster.claim_state(victim))
        self.narrator.say(f"{victim}: {before} claim CDI specs before, none now; claim state empty; host nvidia-imex "
                          f"{cluster.host_imex_state(cluster.node(victim))}", node=victim, specs_before=before,
                          host_imex=cluster.host_imex_state(cluster.node(victim)))

    def tear_down(self) -> None:
        cluster = self.cluster
        for ns in self.namespaces:
            for obj in cluster.api.objects("Pod", ns):
                cluster.api.delete("Pod", obj["metadata"]["name"], ns)
            cluster.api.delete(cd.COMPUTE_DOMAIN_KIND, DOMAIN, ns)
        for ns in self.namespaces:
            wait_step(cluster, f"ComputeDomain {ns}/{DOMAIN} gone",
                      lambda ns=ns: cluster.api.get(cd.COMPUTE_DOMAIN_KIND, DOMAIN, ns) is None)
        leftovers: dict[str, list[str]] = {}
        for uid in self.uids.values():
            wait_step(cluster, f"every object, spec and claim of ComputeDomain {uid} gone",
                      lambda uid=uid: not any(cluster.compute_domain_leftovers(uid).values()))
            for key, items in cluster.compute_domain_leftovers(uid).items():
                leftovers.setdefault(key, []).extend(items)
        self.narrator.say("ComputeDomains gone with their channel annotations (every channel free again); templates, "
                          "CDI specs, claim state: none left", leftovers=leftovers)


def _channel_slices(cluster: MultiNodeCluster, count: int) -> dict[str, list[tuple[str, str]]] | None:
    """Pool -> ``(device, slice name)`` of every compute-domain slice, once every pool is complete."""
    pools: dict[str, list[tuple[str, str]]] = {}
    wanted: dict[str, int] = {}
    for obj in cluster.api.objects("ResourceSlice"):
        spec = obj["spec"]
        if spec.get("driver") != "compute-domain.nvidia.com":
            continue
        pool = spec["pool"]["name"]
        wanted[pool] = int(spec["pool"]["resourceSliceCount"])
        pools.setdefault(pool, []).extend((d["name"], obj["metadata"]["name"]) for d in spec.get("devices") or [])
    complete = {p: d for p, d in pools.items() if len({s for _, s in d}) == wanted[p]}
    return complete if len(complete) == count else None


def _check_pod(cluster: MultiNodeCluster, namespace: str, name: str, channel: int) -> Any:
    """Wait for Pod ``namespace/name`` running; it must hold exactly its domain's channel device."""
    wait_step(cluster, f"Pod {namespace}/{name} running", lambda: cluster.pod_running(name, namespace))
    node: EmulatedNode | None = cluster.pod_node(name, namespace)
    edits = node.pod_devices.get(f"{namespace}/{name}") if node else None
    if edits is None or edits.device_paths() != [_channel_path(channel)]:
        raise DemoError(f"Pod {namespace}/{name} should get {_channel_path(channel)} only, got "
                        f"{edits.device_paths() if edits else None}")
    return edits


def _peek_claim(namespace: str, own_uid: str, foreign_channel: int) -> dict[str, Any]:
    """A ResourceClaim in ``namespace`` for another tenant's channel, configured for its own domain."""
    driver = "compute-domain.nvidia.com"
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "peek", "namespace": namespace},
            "spec": {"devices": {
                "requests": [{"name": "channel", "exactly": {
                    "deviceClassName": cd.ISOLATED_CHANNEL_DEVICE_CLASS,
                    "selectors": [{"cel": {"expression": f"device.attributes['{driver}'].id == {foreign_channel}"}}]}}],
                "config": [{"requests": ["channel"], "opaque": {"driver": driver, "parameters": {
                    "apiVersion": cd.API_GROUP_VERSION, "kind": "ComputeDomainChannelConfig", "domainID": own_uid,
                    "allocationMode": cd.ALLOCATION_SINGLE}}}]}}}


def _peek_pod(namespace: str, node: str) -> dict[str, Any]:
    pod = workload_pod("peek", TEMPLATE, group="peek", namespace=namespace, node=node)
    pod["spec"]["resourceClaims"] = [{"name": "imex-channel-0", "resourceClaimName": "peek"}]
    return pod
