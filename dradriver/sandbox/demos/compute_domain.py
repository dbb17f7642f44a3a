"""``dradriver demo --scenario compute-domain``: a ComputeDomain across two GB200 NVL72 nodes, narrated.

The multi-node sandbox (:mod:`dradriver.sandbox.multinode`) runs two racks of two emulated nodes (rack 1: clique
``abc9829a-...2``, rack 2: ``5b1f40c2-...7``), one ``compute-domain-kubelet-plugin`` process per node, the
``compute-domain-controller`` process, and the IMEX daemon pods of the domain's DaemonSet as local processes with
the ``nvidia-imex`` stand-ins. Steps:

1. start the nodes, plugins and controller; install the CRDs and DeviceClasses;
2. show each node's ResourceSlice (``channel-0``, ``daemon-0``) and clique;
3. apply a ComputeDomain (``numNodes: 2``) and two workload Pods of NVIDIA's ``imex-channel-injection`` shape
   (each requests the channel from the domain's workload template), kept in rack 1 and on different nodes;
4. the domain goes Ready: the daemon pods on both nodes, their clique entries and ``status.nodes``;
5. the channel device in each workload's CDI spec (``/dev/nvidia-caps-imex-channels/channel0``);
6. the IMEX stand-ins connected (``nvidia-imex-ctl -q`` answers ``READY`` on both nodes);
7. delete the Pods and the ComputeDomain and check nothing is left (node labels, templates, DaemonSet, clique
   objects, daemon pods, CDI specs, claim state).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from typing import Any

from dradriver.domain import computedomains as cd
from dradriver.sandbox.demos.narrator import DemoError, Narrator, Step, run_steps
from dradriver.sandbox.multinode import HOSTNAME_LABEL, RACK_LABEL, MultiNodeCluster, MultiNodeError

NS = "default"
DOMAIN = "imex-channel-injection"
TEMPLATE = "imex-channel-0"
CHANNEL0 = "/dev/nvidia-caps-imex-channels/channel0"
WAIT_S = 120.0


def compute_domain(name: str, template: str, *, num_nodes: int | None, all_channels: bool = False,
                   namespace: str = NS) -> dict[str, Any]:
    """A ComputeDomain manifest (``resource.nvidia.com/v1beta1``) whose workload template is ``template``;
    ``num_nodes`` ``None`` leaves ``spec.numNodes`` out (an elastic domain: the CRD defaults it to 0)."""
    channel: dict[str, Any] = {"resourceClaimTemplate": {"name": template}}
    if all_channels:
        channel["allocationMode"] = cd.ALLOCATION_ALL
    spec: dict[str, Any] = {"channel": channel}
    if num_nodes is not None:
        spec["numNodes"] = num_nodes
    return {"apiVersion": cd.API_GROUP_VERSION, "kind": cd.COMPUTE_DOMAIN_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def workload_pod(name: str, template: str, *, group: str, rack: int | None = None, namespace: str = NS,
                 node: str | None = None) -> dict[str, Any]:
    """A Pod of NVIDIA's ``imex-channel-injection`` shape (one container listing the channel devices, the claim
    from ``template``) in ``namespace``, labelled ``job=<group>`` with required anti-affinity on
    ``kubernetes.io/hostname`` (one per node); with ``rack`` the sandbox's rack label and with ``node`` the node's
    hostname label as node selector."""
    spec: dict[str, Any] = {
        "containers": [{"name": "ctr", "image": "ubuntu:22.04", "command": ["bash", "-c"],
                        "args": ["ls -la /dev/nvidia-caps-imex-channels; trap 'exit 0' TERM; sleep 9999 & wait"],
                        "resources": {"claims": [{"name": "imex-channel-0"}]}}],
        "resourceClaims": [{"name": "imex-channel-0", "resourceClaimTemplateName": template}],
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"job": group}}, "topologyKey": HOSTNAME_LABEL}]}},
    }
    selector = {**({RACK_LABEL: str(rack)} if rack is not None else {}),
                **({HOSTNAME_LABEL: node} if node is not None else {})}
    if selector:
        spec["nodeSelector"] = selector
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"job": group}}, "spec": spec}


def imex_state(cluster: MultiNodeCluster, node_name: str, pod: dict[str, Any], *args: str) -> str:
    """What ``nvidia-imex-ctl -c <imexd.cfg> <args>`` prints for daemon Pod ``pod`` on its node (``-q``:
    ``READY`` when every peer of its domain is connected)."""
    node = cluster.node(node_name)
    edits = node.pod_devices.get(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")
    imexd = dict(edits.mounts).get("/imexd") if edits else None
    if not imexd:
        return ""
    done = subprocess.run([str(node.bin_dir / "nvidia-imex-ctl"), "-c", f"{imexd}/imexd.cfg", *args],
                          capture_output=True, text=True, timeout=30, check=False)
    return done.stdout


def daemon_pods(cluster: MultiNodeCluster, uid: str) -> dict[str, dict[str, Any]]:
    """Node name -> the live IMEX daemon Pod of ComputeDomain ``uid`` there."""
    return {p["spec"]["nodeName"]: p for p in cluster.api.objects("Pod", cluster.namespace)
            if (p["metadata"].get("labels") or {}).get(cd.LABEL_COMPUTE_DOMAIN) == uid
            and not p["metadata"].get("deletionTimestamp") and p["spec"].get("nodeName")}


def domain_ready(cluster: MultiNodeCluster, name: str, namespace: str = NS) -> bool:
    """The ComputeDomain's ``status.status`` is ``Ready``."""
    obj = cluster.api.get(cd.COMPUTE_DOMAIN_KIND, name, namespace) or {}
    return (obj.get("status") or {}).get("status") == cd.STATUS_READY


def wait_step(cluster: MultiNodeCluster, what: str, predicate: Any) -> Any:
    """:meth:`MultiNodeCluster.wait_for` with the demo's :data:`WAIT_S`, its timeout raised as :class:`DemoError`."""
    try:
        return cluster.wait_for(what, predicate, timeout_s=WAIT_S)
    except MultiNodeError as exc:
        raise DemoError(str(exc)) from exc


@contextlib.contextmanager
def started_cluster(racks: Sequence[int], *, host_imex: bool = False, channel_isolation: bool = False,
                    pre_warmed: bool = False, binding_conditions: bool = False) -> Iterator[MultiNodeCluster]:
    """A multi-node sandbox with the demo's timing, its CRDs and DeviceClasses installed, (with ``host_imex``)
    the host IMEX daemons ready, every node's plugin registered and the controller started; closed on exit.
    ``pre_warmed`` and ``binding_conditions`` are :class:`MultiNodeCluster`'s (IMEX mode ``preWarmed``; KEP-5007
    binding conditions in the scheduler and the plugins).

    :raises DemoError: a node, daemon or plugin did not start (the message says which).
    """
    try:
        cluster = MultiNodeCluster(racks, time_scale=0.1, interval_s=0.05, host_imex=host_imex,
                                   channel_isolation=channel_isolation, pre_warmed=pre_warmed,
                                   binding_conditions=binding_conditions)
    except MultiNodeError as exc:
        raise DemoError(str(exc)) from exc
    with cluster:
        cluster.install_compute_domains()
        try:
            if host_imex:
                cluster.start_host_imex(timeout_s=WAIT_S)
            cluster.start_plugins(timeout_s=WAIT_S)
        except MultiNodeError as exc:
            raise DemoError(str(exc)) from exc
        cluster.start_controller()
        yield cluster


def run(narrator: Narrator) -> None:
    """Run the seven steps of the module docstring.

    :raises DemoError: a step did not produce what the driver promises (the message says which).
    """
    narrator.step(1, "two racks of GB200 NVL72 nodes: plugins, controller, CRDs")
    with started_cluster((2, 2)) as cluster:
        for node in cluster.nodes.values():
            narrator.say(f"node {node.name}: rack {node.rack}, tray {node.tray:02d}, address {node.ip}, "
                         f"plugin pid {node.plugin.pid if node.plugin else '-'}",
                         node=node.name, rack=node.rack, ip=node.ip)
        narrator.done()
        _run_steps(cluster, narrator)


def _run_steps(cluster: MultiNodeCluster, narrator: Narrator) -> None:
    scenario = _Domain(cluster, narrator)
    run_steps(narrator, [
        Step("ResourceSlices of driver compute-domain.nvidia.com", scenario.slices),
        Step(f"ComputeDomain {DOMAIN} (numNodes 2) and two workload Pods in rack 1", scenario.workloads),
        Step("the domain goes Ready", scenario.ready),
        Step("the IMEX channel in each workload's CDI spec", scenario.channels),
        Step("the IMEX daemons connected to each other", scenario.daemons_connected),
        Step("delete the Pods and the ComputeDomain: nothing left behind", scenario.tear_down),
    ], first=2)


class _Domain:
    """The single-domain scenario's steps 2 to 7 (module docstring) and what they learn on the way (the domain's
    UID, its workload Pods and where they and the IMEX daemons run)."""

    def __init__(self, cluster: MultiNodeCluster, narrator: Narrator) -> None:
        self.cluster, self.narrator = cluster, narrator
        self.uid = ""
        self.pods = [f"{DOMAIN}-{i}" for i in range(2)]
        self.placed: set[str] = set()
        self.daemons: dict[str, dict[str, Any]] = {}

    def slices(self) -> None:
        cluster = self.cluster
        slices = wait_step(cluster, "a ResourceSlice per node", lambda: (s := [
            x for x in cluster.api.objects("ResourceSlice") if x["spec"].get("driver") == "compute-domain.nvidia.com"])
            and len(s) == len(cluster.nodes) and s)
        for s in sorted(slices, key=lambda x: x["spec"]["pool"]["name"]):
            devices = [d["name"] for d in s["spec"].get("devices") or []]
            self.narrator.say(f"pool {s['spec']['pool']['name']}: {', '.join(devices)}",
                              pool=s["spec"]["pool"]["name"], devices=devices)

    def workloads(self) -> None:
        cluster = self.cluster
        domain = cluster.api.create(compute_domain(DOMAIN, TEMPLATE, num_nodes=2))
        self.uid = str(domain["metadata"]["uid"])
        for name in self.pods:
            cluster.api.create(workload_pod(name, TEMPLATE, group=DOMAIN, rack=1))
        for name in self.pods:
            wait_step(cluster, f"Pod {name} running", lambda name=name: cluster.pod_running(name))
            node = cluster.pod_node(name)
            self.narrator.say(f"Pod {name} -> node {node.name if node else '?'}", pod=name,
                              node=node.name if node else "")
        self.placed = placed = {n.name for p in self.pods if (n := cluster.pod_node(p)) is not None}
        if len(placed) != 2 or any(cluster.node(n).rack != 1 for n in placed):
            raise DemoError(f"the workload Pods should run on two nodes of rack 1, they run on {sorted(placed)}")

    def ready(self) -> None:
        cluster, narrator = self.cluster, self.narrator
        wait_step(cluster, f"ComputeDomain {DOMAIN} Ready", lambda: domain_ready(cluster, DOMAIN))
        status = (cluster.api.get(cd.COMPUTE_DOMAIN_KIND, DOMAIN, NS) or {}).get("status") or {}
        for entry in status.get("nodes") or []:
            narrator.say(f"status.nodes: {entry['name']} {entry['ipAddress']} clique {entry['cliqueID']} index "
                         f"{entry['index']} {entry['status']}", **entry)
        self.daemons = daemons = daemon_pods(cluster, self.uid)
        if set(daemons) != self.placed:
            raise DemoError(f"daemon Pods run on {sorted(daemons)}, the workloads on {sorted(self.placed)}")
        for node_name, pod in sorted(daemons.items()):
            narrator.say(f"daemon Pod {pod['metadata']['namespace']}/{pod['metadata']['name']} on {node_name}",
                         pod=pod["metadata"]["name"], node=node_name)

    def channels(self) -> None:
        for name in self.pods:
            node = self.cluster.pod_node(name)
            assert node is not None
            edits = node.pod_devices.get(f"{NS}/{name}")
            if edits is None or edits.device_paths() != [CHANNEL0]:
                raise DemoError(f"Pod {name} should get {CHANNEL0}, got {edits.device_paths() if edits else None}")
            dev = edits.device_nodes[0]
            self.narrator.say(f"{name}: {', '.join(edits.device_ids)} -> {dev['path']} (char {dev.get('major')}:"
                              f"{dev.get('minor', 0)})", pod=name, cdi_devices=edits.device_ids,
                              device_nodes=edits.device_nodes)

    def daemons_connected(self) -> None:
        cluster = self.cluster
        for node_name, pod in sorted(self.daemons.items()):
            wait_step(cluster, f"nvidia-imex on {node_name} READY",
                      lambda node_name=node_name, pod=pod: imex_state(cluster, node_name, pod, "-q") == "READY\n")
            self.narrator.say(f"{node_name}: nvidia-imex-ctl -q: READY", node=node_name, state="READY")

    def tear_down(self) -> None:
        cluster, uid = self.cluster, self.uid
        for name in self.pods:
            cluster.api.delete("Pod", name, NS)
        cluster.api.delete(cd.COMPUTE_DOMAIN_KIND, DOMAIN, NS)
        wait_step(cluster, "the ComputeDomain gone",
                  lambda: cluster.api.get(cd.COMPUTE_DOMAIN_KIND, DOMAIN, NS) is None)
        wait_step(cluster, "every object, label, spec and claim of the domain gone",
                  lambda: not any(cluster.compute_domain_leftovers(uid).values()))
        self.narrator.say("node labels, templates, DaemonSet, cliques, daemon Pods, CDI specs, claim state: none "
                          "left", leftovers=cluster.compute_domain_leftovers(uid))
