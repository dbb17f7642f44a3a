"""``python -m bench fleet``: a ComputeDomain's start at 18, 72 and 256 nodes, every protocol, every latency setting,
in one run of the simulated-time model (:mod:`bench.fleetmodel`).

Figures: seconds from the ComputeDomain's creation to every workload claim prepared; the longest wait of one pod
from its binding to its claim prepared (the part the protocol adds); the first pod's time on a fresh node (a
one-node domain whose daemon image is pulled); API requests per node. Ratios are NVIDIA's protocol / dradriver's
mode in the same run. The runs go to a process pool (one per core) only to finish sooner: simulated time does not
depend on the harness's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import fleetmodel
from dradriver.sandbox.apiserver.flowcontrol import Latency

__all__ = ["LATENCIES", "NODES", "PROTOCOL_COLUMNS", "TARGETS", "Job", "format_report", "main", "report"]

NODES: tuple[int, ...] = (18, 72, 256)
LATENCIES: tuple[Latency, ...] = (Latency(), Latency(read_s=0.002, write_s=0.010, watch_s=0.002),
                                  Latency(read_s=0.005, write_s=0.030, watch_s=0.005))
"""The latency settings: writes 0, 10 and 30 ms (issue 35); reads and watch events a sixth of a write, rounded
(assumed: a write is a raft commit with an fsync on etcd, a read and a watch event are served from memory)."""
PROTOCOL_COLUMNS: tuple[str, ...] = ("nvidia", "driver-managed", "pre-warmed", "floor")
"""The report's columns; a protocol not in :data:`bench.fleetmodel.PROTOCOLS` is reported as not built yet. The
floor (:class:`bench.fleetmodel.FloorProtocol`) is the shared pod path alone: no mode can be faster."""
TARGETS: dict[str, float] = {"driver-managed": 2.0, "pre-warmed": 10.0}
"""NVIDIA's seconds / the mode's at 256 nodes, at every latency (issue 35); pre-warmed: first pod <= 2 s."""
FIRST_POD_TARGET_S = 2.0


@dataclass(frozen=True, slots=True)
class Job:
    """One run: protocol, nodes, latency, whether the daemon image is present."""

    protocol: str
    nodes: int
    latency: Latency
    image_present: bool = True
    clients: tuple[tuple[str, fleetmodel.ClientLimits], ...] = ()


def _run(job: Job) -> dict[str, Any]:
    pod = replace(fleetmodel.PodStart(), image_present=job.image_present)
    result = fleetmodel.run(job.protocol, job.nodes, latency=job.latency, pod=pod, clients=dict(job.clients))
    return {**asdict(result), "latency": asdict(job.latency)}


def report(nodes: Sequence[int] = NODES, latencies: Sequence[Latency] = LATENCIES, *,
           workers: int | None = None, clients: dict[str, fleetmodel.ClientLimits] | None = None) -> dict[str, Any]:
    """Every run of the report (the built protocols at every size and latency, and each one's fresh-node first
    pod), as ``{"runs": [...], "not_built": [...], "ratios": [...], "first_pod": [...]}``.

    :param workers: processes (default: one per core; 1 runs in this process).
    :param clients: client limits replacing the shipped ones (:data:`bench.fleetmodel.CLIENTS`), for a
        sensitivity run.
    """
    built = [p for p in PROTOCOL_COLUMNS if p in fleetmodel.PROTOCOLS]
    over = tuple(sorted((clients or {}).items()))
    jobs = [Job(p, n, lat, clients=over) for n in nodes for lat in latencies for p in built]
    jobs += [Job(p, 1, lat, image_present=False, clients=over) for lat in latencies for p in built]
    if workers == 1:
        runs = [_run(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
            runs = list(pool.map(_run, jobs))
    fleet = [r for r in runs if r["image_present"]]
    fresh = [r for r in runs if not r["image_present"]]

    def key(r: dict[str, Any]) -> tuple[int, float]:
        return r["nodes"], r["latency"]["write_s"]

    nvidia = {key(r): r for r in fleet if r["protocol"] == "nvidia"}
    ratios = [{"protocol": r["protocol"], "nodes": r["nodes"], "write_ms": round(r["latency"]["write_s"] * 1e3),
               "nvidia_s": nvidia[key(r)]["seconds"], "seconds": r["seconds"],
               "ratio": nvidia[key(r)]["seconds"] / r["seconds"],
               "target": TARGETS.get(r["protocol"]) if r["nodes"] == max(nodes) else None}
              for r in fleet if r["protocol"] != "nvidia" and key(r) in nvidia]
    for row in ratios:
        row["met"] = None if row["target"] is None else row["ratio"] >= row["target"]
    first = [{"protocol": r["protocol"], "write_ms": round(r["latency"]["write_s"] * 1e3), "seconds": r["first_s"],
              "target": FIRST_POD_TARGET_S if r["protocol"] == "pre-warmed" else None} for r in fresh]
    return {"runs": fleet, "first_pod": first, "ratios": ratios,
            "not_built": [p for p in PROTOCOL_COLUMNS if p not in fleetmodel.PROTOCOLS]}


def format_report(data: dict[str, Any]) -> str:
    """The report as Markdown tables: one row per size and latency, one column group per protocol."""
    runs = {(r["protocol"], r["nodes"], round(r["latency"]["write_s"] * 1e3)): r for r in data["runs"]}
    ratios = {(r["protocol"], r["nodes"], r["write_ms"]): r for r in data["ratios"]}
    first = {(r["protocol"], r["write_ms"]): r for r in data["first_pod"]}
    sizes = sorted({n for _, n, _ in runs})
    writes = sorted({w for _, _, w in runs})
    head = ["nodes", "write ms"]
    for p in PROTOCOL_COLUMNS:
        head += [f"{p}: s to all prepared", f"{p}: longest bind -> prepared s", f"{p}: requests per node"]
        if p != "nvidia":
            head.append(f"NVIDIA / {p}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in sizes:
        for w in writes:
            row = [str(n), str(w)]
            for p in PROTOCOL_COLUMNS:
                r = runs.get((p, n, w))
                if r is None:
                    row += ["not built yet", "", ""] + ([""] if p != "nvidia" else [])
                    continue
                row += [f"{r['seconds']:.1f}", f"{r['driver_s']:.1f}",
                        f"{r['node_requests']:.1f} ({r['all_requests']:.1f} cluster-wide)"]
                if p != "nvidia":
                    q = ratios[(p, n, w)]
                    verdict = "met" if q["met"] else "not met"
                    met = "" if q["met"] is None else f" (target >= {q['target']:g}: {verdict})"
                    row.append(f"{q['ratio']:.2f}{met}")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| first pod on a fresh node, write ms | " + " | ".join(PROTOCOL_COLUMNS) + " |",
              "|---|" + "---|" * len(PROTOCOL_COLUMNS)]
    for w in writes:
        cells = [f"{first[(p, w)]['seconds']:.1f} s" if (p, w) in first else "not built yet"
                 for p in PROTOCOL_COLUMNS]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench fleet [--nodes 18,72,256] [--workers N] [--json PATH]``; prints the tables."""
    parser = argparse.ArgumentParser(prog="python -m bench fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default=",".join(map(str, NODES)), help="domain sizes, comma-separated")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    parser.add_argument("--json", metavar="PATH", help="also write every run as JSON")
    parser.add_argument("--client", action="append", default=[], metavar="KIND=QPS/BURST",
                        help="replace a client's shipped limit (a sensitivity run), e.g. kube-controller-manager=-1/10 "
                             f"(no client-side limit); kinds: {', '.join(fleetmodel.CLIENTS)}")
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        print(f"python -m bench fleet: --nodes {args.nodes!r} is not a list of numbers", file=sys.stderr)
        return 2
    clients: dict[str, fleetmodel.ClientLimits] = {}
    for text in args.client:
        kind, _, limits = text.partition("=")
        qps, _, burst = limits.partition("/")
        try:
            if kind not in fleetmodel.CLIENTS:
                raise ValueError(f"no client kind {kind!r}")
            clients[kind] = replace(fleetmodel.CLIENTS[kind], qps=float(qps), burst=int(burst))
        except ValueError as exc:
            print(f"python -m bench fleet: --client {text!r}: {exc} (KIND=QPS/BURST, kinds: "
                  f"{', '.join(fleetmodel.CLIENTS)})", file=sys.stderr)
            return 2
    data = report(sizes, workers=args.workers, clients=clients)
    print(format_report(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return 0
