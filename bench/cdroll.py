"""``python -m bench roll``: an upgrade of the pre-warmed IMEX daemons of one rack with running ComputeDomains, in
the multi-node sandbox (:mod:`dradriver.sandbox.multinode`: real processes, the real controller, plugins, daemons
and ``nvidia-imex`` stand-ins; the DaemonSet controller's rolling update of :mod:`dradriver.sandbox.daemonsets`).

The run: one rack of ``nodes`` emulated GB200 NVL72 nodes in pre-warmed mode (``--imex-mode preWarmed``), its
clique daemons Ready; ``domains`` ComputeDomains each with a workload pod on every node of the rack, all Ready; then
the controller is restarted with another image, as an upgrade does. The new controller updates the clique
DaemonSet's pod template (its ``resource.nvidia.com/daemonTemplateHash`` differs), and the DaemonSet's
``RollingUpdate`` (``maxUnavailable`` 1, the Kubernetes default) replaces the daemons one node at a time.

Measured, every ``sample_s`` from the API (wall-clock seconds of the sandbox; probe periods are Kubernetes' own
times ``time_scale``):

* per node, how long a domain's channel there is unusable: the node's clique daemon Pod is not Ready, or the
  node's entry in the clique's ComputeDomainClique is not a Ready member (no ``ipAddress``, or ``status`` not
  ``Ready``): a workload there cannot import or export memory over IMEX meanwhile; in how many separate windows;
  and the node's own replacement apart (from its old daemon Pod's deletion until its channel is usable on the new
  Pod): the rest is time a peer's restart made this node's daemon not Ready;
* how long more than one node was unusable at once (the DaemonSet deletes the next old Pod once the new one is
  Ready; the channel also needs the controller to mark the new daemon's clique entry Ready);
* per node, how long the domains' ``status.nodes`` condition ``CliqueDaemonReady`` is False there (what an operator
  sees) and whether each domain got a Warning Event naming the node;
* the roll's total time: from the DaemonSet's template update (its ``metadata.generation`` changes) until
  ``status.updatedNumberScheduled`` and ``numberReady`` are the rack's size and every node's channel is usable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dradriver.domain import computedomains as cd
from dradriver.sandbox.demos import compute_domain as domain_demo
from dradriver.sandbox.multinode import MultiNodeCluster

__all__ = ["RollReport", "channel_usable", "format_report", "main", "run"]

NS = "default"
UPGRADE_IMAGE = "registry.example/dradriver:next"
CONTROLLER_ENV = {"NODE_FAILURE_GRACE_PERIOD": "40s", "STATUS_RESYNC_PERIOD": "60s"}
"""The controller's own defaults, written out (node grace 40 s, status resync 60 s)."""


@dataclass
class RollReport:
    """What :func:`run` measured (module docstring); seconds.

    :param unusable_s: node -> how long a domain's channel there was unusable during the roll.
    :param condition_false_s: node -> the longest time any domain's ``CliqueDaemonReady`` was False there.
    :param warned: node -> every domain got a Warning Event naming the node.
    :param roll_s: the template update until the whole rack runs the new daemons and every channel is usable.
    :param pods_kept_running: every workload pod was Running at every sample.
    """

    nodes: int
    domains: int
    time_scale: float
    sample_s: float
    roll_s: float = 0.0
    unusable_s: dict[str, float] = field(default_factory=dict)
    condition_false_s: dict[str, float] = field(default_factory=dict)
    warned: dict[str, bool] = field(default_factory=dict)
    pods_kept_running: bool = True
    unusable_at_once: int = 0
    """The most nodes whose channel was unusable at the same sample."""
    own_s: dict[str, float] = field(default_factory=dict)
    """node -> its own replacement: from its old daemon Pod's deletion until its channel is usable on the new one
    (a node that had no daemon Pod when the roll began is left out)."""
    windows: dict[str, int] = field(default_factory=dict)
    """node -> how many separate unusable windows it had (its own replacement and those a peer's restart caused)."""
    overlap_s: float = 0.0
    """How long more than one node's channel was unusable at once (the DaemonSet counts a Pod available once it is
    Ready; the channel is usable once the controller has also marked the node's clique entry Ready)."""

    @property
    def max_s(self) -> float:
        """The longest unusable window of one node."""
        return max(self.unusable_s.values(), default=0.0)

    @property
    def median_s(self) -> float:
        """The median unusable window over the nodes."""
        return statistics.median(self.unusable_s.values()) if self.unusable_s else 0.0

    @property
    def own_max_s(self) -> float:
        """The longest own replacement of one node."""
        return max(self.own_s.values(), default=0.0)

    @property
    def own_median_s(self) -> float:
        """The median own replacement over the nodes."""
        return statistics.median(self.own_s.values()) if self.own_s else 0.0


def channel_usable(cluster: MultiNodeCluster, clique: str) -> dict[str, bool]:
    """Node -> a domain's channel is usable there now (module docstring) for every node of clique ``clique``."""
    uid = cd.clique_domain_uid(clique)
    pods = domain_demo.daemon_pods(cluster, uid)
    obj = cluster.api.get(cd.CLIQUE_KIND, cd.clique_object_name(uid, clique), cluster.namespace) or {}
    entries = {e.node_name: e for e in (cd.CliqueDaemon.from_entry(r) for r in obj.get("daemons") or ())}
    out = {}
    for name, node in cluster.nodes.items():
        if node.labels().get(cd.NODE_CLIQUE_LABEL) != clique:
            continue
        entry = entries.get(name)
        out[name] = (name in pods and cd.pod_ready(pods[name]) and entry is not None and entry.member
                     and entry.status == cd.STATUS_READY)
    return out


def _conditions(cluster: MultiNodeCluster, domain: str) -> dict[str, bool]:
    obj = cluster.api.get(cd.COMPUTE_DOMAIN_KIND, domain, NS) or {}
    out = {}
    for node in (obj.get("status") or {}).get("nodes") or ():
        ready = [c for c in node.get("conditions") or () if c.get("type") == cd.CLIQUE_DAEMON_CONDITION]
        out[str(node["name"])] = bool(ready) and ready[0].get("status") == "True"
    return out


class _Windows:
    """Per key, the time spent in the False state between :meth:`sample` calls (closed at :meth:`close`)."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}
        self.total: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def sample(self, now: float, states: dict[str, bool]) -> None:
        for key, ok in states.items():
            self.total.setdefault(key, 0.0)
            if not ok and key not in self.since:
                self.since[key] = now
                self.count[key] = self.count.get(key, 0) + 1
            elif ok and key in self.since:
                self.total[key] += now - self.since.pop(key)

    def close(self, now: float) -> None:
        for key in list(self.since):
            self.total[key] += now - self.since.pop(key)


def run(nodes: int = 18, domains: int = 2, *, time_scale: float = 1.0, sample_s: float = 0.05,
        timeout_s: float = 900.0, say: Callable[[str], None] | None = None) -> RollReport:
    """One roll (module docstring) and its report.

    :raises dradriver.sandbox.multinode.MultiNodeError: the rack, a domain or the roll did not get where it should
        within ``timeout_s`` (the message names the step).
    """
    note = say or (lambda text: None)
    report = RollReport(nodes=nodes, domains=domains, time_scale=time_scale, sample_s=sample_s)
    with MultiNodeCluster((nodes,), time_scale=time_scale, interval_s=0.05, pre_warmed=True) as c:
        c.install_compute_domains()
        c.start_plugins(timeout_s=timeout_s)
        c.start_controller(extra_env=CONTROLLER_ENV)
        rack = sorted(c.nodes)
        clique = c.wait_for("the rack's clique label", lambda: c.node(rack[0]).labels().get(cd.NODE_CLIQUE_LABEL),
                            timeout_s=timeout_s)
        c.wait_for("a Ready clique daemon on every node",
                   lambda: len(channel_usable(c, clique)) == nodes and all(channel_usable(c, clique).values()),
                   timeout_s=timeout_s)
        note(f"{nodes} clique daemons Ready")
        names = [f"roll-{d}" for d in range(domains)]
        workloads = [f"{name}-{i}" for name in names for i in range(nodes)]
        for name in names:
            c.api.create(domain_demo.compute_domain(name, f"{name}-channel", num_nodes=None))
            for i, node in enumerate(rack):
                c.api.create(domain_demo.workload_pod(f"{name}-{i}", f"{name}-channel", group=name, node=node))
        c.wait_for("every workload pod running", lambda: all(c.pod_running(p) for p in workloads), timeout_s=timeout_s)
        c.wait_for("every domain Ready on the whole rack", lambda: all(
            domain_demo.domain_ready(c, n) and len(_conditions(c, n)) == nodes and all(_conditions(c, n).values())
            for n in names), timeout_s=timeout_s)
        note(f"{domains} domains Ready on {nodes} nodes; restarting the controller with image {UPGRADE_IMAGE}")
        ds_name = cd.daemon_object_name(cd.clique_domain_uid(clique))
        generation = int((c.api.get("DaemonSet", ds_name, c.namespace) or {})["metadata"]["generation"])
        first = {n: p["metadata"]["uid"] for n, p in domain_demo.daemon_pods(c, cd.clique_domain_uid(clique)).items()}
        replaced: dict[str, float] = {}  # node -> when its first daemon Pod started being deleted (or was gone)
        back: dict[str, float] = {}  # node -> when its channel was usable again on a new daemon Pod
        down: set[str] = set()  # nodes seen unusable since their replacement began
        usable, conditions, overlap = _Windows(), _Windows(), _Windows()
        stop, started, done = threading.Event(), [0.0], [0.0]

        def sample() -> None:
            while not stop.is_set():
                now = time.monotonic()
                ds = c.api.get("DaemonSet", ds_name, c.namespace) or {}
                if not started[0] and int(ds["metadata"]["generation"]) > generation:
                    started[0] = now
                states = channel_usable(c, clique)
                if started[0]:
                    live = {n: p["metadata"]["uid"] for n, p in
                            domain_demo.daemon_pods(c, cd.clique_domain_uid(clique)).items()}
                    for node, uid in first.items():
                        if node not in replaced and live.get(node) != uid:
                            replaced[node] = now
                        if node in replaced and not states.get(node):
                            down.add(node)  # seen unusable since: ``states`` may predate ``live`` by a moment
                        elif node in down and node not in back and live.get(node) != uid:
                            back[node] = now
                    usable.sample(now, states)
                    overlap.sample(now, {"overlap": sum(not ok for ok in states.values()) <= 1})
                    report.unusable_at_once = max(report.unusable_at_once, sum(not ok for ok in states.values()))
                    conditions.sample(now, {f"{n}/{node}": ok for n in names
                                            for node, ok in _conditions(c, n).items()})
                    if not all(c.pod_running(p) for p in workloads):
                        report.pods_kept_running = False
                    status = ds.get("status") or {}
                    if (status.get("observedGeneration", 0) > generation
                            and status.get("updatedNumberScheduled") == status.get("numberReady") == nodes
                            and len(states) == nodes and all(states.values())):
                        done[0] = now
                        return
                stop.wait(sample_s)

        sampler = threading.Thread(target=sample, name="roll-sampler", daemon=True)
        sampler.start()
        c.stop_controllers()
        c.start_controller(extra_env={**CONTROLLER_ENV, "IMAGE_NAME": UPGRADE_IMAGE})
        try:
            c.wait_for("the rack rolled to the new daemons", lambda: done[0], timeout_s=timeout_s)
        finally:
            stop.set()
            sampler.join(timeout=10)
        usable.close(done[0])
        overlap.close(done[0])
        report.overlap_s = round(overlap.total.get("overlap", 0.0), 3)
        conditions.close(done[0])
        # rounded like every window below, so that a window as long as the roll never reads longer than it
        report.roll_s = round(done[0] - started[0], 3)
        report.unusable_s = {n: round(usable.total.get(n, 0.0), 3) for n in rack}
        report.windows = {n: usable.count.get(n, 0) for n in rack}
        report.own_s = {n: round(back[n] - replaced[n], 3) for n in rack if n in back and n in replaced}
        report.condition_false_s = {node: round(max(conditions.total.get(f"{n}/{node}", 0.0) for n in names), 3)
                                    for node in rack}
        c.wait_for("every domain Ready again", lambda: all(domain_demo.domain_ready(c, n) for n in names),
                   timeout_s=timeout_s)
        events = [e for e in c.api.objects("Event", NS) if e.get("type") == "Warning"
                  and e.get("reason") in (cd.REASON_CLIQUE_DAEMON_NOT_READY, cd.REASON_NODE_LOST)]
        report.warned = {node: all(any((e.get("involvedObject") or {}).get("name") == n and node in e["message"]
                                       for e in events) for n in names) for node in rack}
    return report


def format_report(report: RollReport) -> str:
    """The report as Markdown: a summary line and a table per node."""
    lines = [f"Rolling update of the pre-warmed IMEX daemons of a rack of {report.nodes} nodes with {report.domains} "
             f"running ComputeDomains (time scale {report.time_scale}, sampled every {report.sample_s} s): roll "
             f"{report.roll_s:.1f} s; a node's channel unusable max {report.max_s:.2f} s, median "
             f"{report.median_s:.2f} s; at most {report.unusable_at_once} node(s) unusable at once (more than one for "
             f"{report.overlap_s:.2f} s in all); workload pods "
             f"kept running: {'yes' if report.pods_kept_running else 'NO'}; every node named in a Warning Event of "
             f"every domain: {'yes' if all(report.warned.values()) else 'NO'}; own replacement max "
             f"{report.own_max_s:.2f} s, median {report.own_median_s:.2f} s", "",
             "| Node | channel unusable s (windows) | own replacement s | CliqueDaemonReady False s (longest domain) | "
             "Warning Event, every domain |",
             "|---|---|---|---|---|"]
    for node in sorted(report.unusable_s):
        lines.append(f"| {node} | {report.unusable_s[node]:.2f} ({report.windows.get(node, 0)}) | "
                     f"{f'{report.own_s[node]:.2f}' if node in report.own_s else '-'} | "
                     f"{report.condition_false_s.get(node, 0.0):.2f} | "
                     f"{'yes' if report.warned.get(node) else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench roll [--nodes 18] [--domains 2] [--time-scale 1] [--json PATH]``; prints the report."""
    parser = argparse.ArgumentParser(prog="python -m bench roll", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=18, help="nodes of the rack (1-18)")
    parser.add_argument("--domains", type=int, default=2, help="ComputeDomains spanning the rack")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="factor on probe periods and grace periods (1: Kubernetes' own)")
    parser.add_argument("--sample", type=float, default=0.05, help="sampling period, seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 18 or args.domains < 1:
        print(f"python -m bench roll: --nodes must be 1-18 (one NVL72 rack) and --domains at least 1, not "
              f"{args.nodes} / {args.domains}", file=sys.stderr)
        return 2
    report = run(args.nodes, args.domains, time_scale=args.time_scale, sample_s=args.sample,
                 say=lambda text: print(f"# {text}", file=sys.stderr))
    print(format_report(report))
    if args.json:
        data: dict[str, Any] = {**asdict(report), "max_s": report.max_s, "median_s": report.median_s,
                                "own_max_s": report.own_max_s, "own_median_s": report.own_median_s}
        Path(args.json).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return 0
