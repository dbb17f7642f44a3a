"""``python -m bench vs_nvidia``: dradriver's ``gpu-kubelet-plugin`` beside NVIDIA's, figure by figure.

Both plugins run as separate processes on the same node definition (an 8-GPU H100 mock node: dradriver's
``dgx-h100`` profile, NVIDIA's ``mock-nvml-config-h100.yaml`` through NVIDIA's own mock NVML), against one API
emulator over HTTP, driven by the same kubelet client (:class:`dradriver.sandbox.kubelet.KubeletEmulator`, real
gRPC over the plugin's Unix sockets), in alternating runs. Each run measures, for one fresh process:

* process start -> registration socket (the ``*.sock`` in the registrar directory) exists, seconds;
* process start -> the node's ResourceSlice is stored in the API emulator, seconds;
* CPU (user + system, ``/proc/<pid>/stat``) spent when the slice is published, seconds;
* resident memory (``VmRSS``) at rest (one second after the slice) and after 600 one-claim prepare+unprepare
  pairs, MiB;
* one-claim ``NodePrepareResources`` p50/p99 and ``NodeUnprepareResources`` p50 over those pairs, milliseconds;
* the floors under those two: an empty ``NodePrepareResources`` (the kubelet's probe call, answered without the
  preparer: the plugin's gRPC round trip alone) before each pair, p50 ms; and, once per run, one ResourceClaim GET
  from a separate Python process with dradriver's client (:mod:`dradriver.kube.client`, the official
  ``kubernetes`` client) against the same API emulator, p50 ms. A plugin's one-claim prepare cannot take less
  than its empty call plus its GET, nor an unprepare less than its empty call; the report gives the ratio that
  floor alone implies (the report's ``floors``: ``prepare_floor_ratio``, ``unprepare_floor_ratio``).

Where the files go, as on a node: each plugin's CDI root (``--cdi-root``, ``/var/run/cdi`` in both charts) is on
a tmpfs (``/dev/shm``; ``/var/run`` is the tmpfs ``/run`` on every systemd host), its plugin directory with the
claim state or checkpoint (``/var/lib/kubelet/plugins/...``) on the disk that holds the system temp directory.
``--cdi-fs disk`` puts the CDI roots on that disk too (the placement of the runs before 2026-12-04 session 3);
without a tmpfs at ``/dev/shm`` the disk is used and the report says so.

Ratios are dradriver / NVIDIA (lower is better). Without NVIDIA's binary (or its mock NVML) only dradriver's
figures are reported and the report says the peer was not run; the memory row is then given as a ratio to a bare
interpreter's RSS measured in the same run. Targets are issue 17's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dradriver.sandbox.nvidiapeer import PEER_GPUS as GPUS
from dradriver.sandbox.nvidiapeer import Side, nvidia_side, peer_paths

REPO = Path(__file__).resolve().parent.parent
DRADRIVER_PROFILE = "dgx-h100"
DRIVER = "gpu.nvidia.com"
START_TIMEOUT = 60.0
POLL = 0.002

#: figure -> (target operator, target, what the target is relative to: "nvidia", "absolute" or "bare")
TARGETS: dict[str, tuple[str, float, str]] = {
    "prepare_p50_ms": ("<=", 0.7, "nvidia"),
    "prepare_p99_ms": ("<=", 1.0, "nvidia"),
    "unprepare_p50_ms": ("<=", 0.7, "nvidia"),
    "start_to_registration_s": ("<=", 0.3, "absolute"),
    "start_to_slice_s": ("<=", 0.8, "nvidia"),
    "cpu_to_start_s": ("", 0.0, "nvidia"),  # reported; issue 17 sets no target (an interpreter's floor)
    "cpu_to_registration_s": ("", 0.0, "nvidia"),
    "cpu_per_pair_ms": ("", 0.0, "nvidia"),
    "empty_call_p50_ms": ("", 0.0, "nvidia"),  # the gRPC floor (see the module docstring)
    "rss_rest_mib": ("<=", 1.0, "nvidia"),
    "rss_after_claims_mib": ("<=", 1.0, "nvidia"),
}
LABELS = {
    "prepare_p50_ms": "one-claim NodePrepareResources p50 (ms)",
    "prepare_p99_ms": "one-claim NodePrepareResources p99 (ms)",
    "unprepare_p50_ms": "one-claim NodeUnprepareResources p50 (ms)",
    "start_to_registration_s": "process start -> registration socket (s)",
    "start_to_slice_s": "process start -> ResourceSlice published (s)",
    "cpu_to_start_s": "CPU to start (s)",
    "cpu_to_registration_s": "CPU to the registration socket (s)",
    "cpu_per_pair_ms": "plugin CPU per one-claim prepare+unprepare pair (ms)",
    "empty_call_p50_ms": "empty NodePrepareResources p50 (ms): the gRPC round trip alone",
    "rss_rest_mib": "resident memory at rest (MiB)",
    "rss_after_claims_mib": "resident memory after the claims (MiB)",
}


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mib(pid: int) -> float:
    """``VmRSS`` of ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def bare_interpreter_rss_mib() -> float:
    """RSS of a bare ``python -c`` interpreter at rest, MiB (the floor any Python plugin starts from)."""
    code = ("import sys\nfor l in open('/proc/self/status'):\n"
            "    l.startswith('VmRSS:') and sys.stdout.write(l.split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out) / 1024


TMPFS = Path("/dev/shm")


def cdi_base(fs: str) -> tuple[Path | None, str]:
    """Where the runs' CDI roots are made: ``(directory, placement)``; directory ``None`` means the system temp
    directory (the disk). ``fs`` is ``"tmpfs"`` (as ``/var/run/cdi`` on a node) or ``"disk"``."""
    if fs == "disk":
        return None, "disk (system temp directory)"
    if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) and _fs_type(TMPFS) == "tmpfs":
        return TMPFS, f"tmpfs ({TMPFS})"
    return None, f"disk (system temp directory; no writable tmpfs at {TMPFS})"


def _fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (``/proc/self/mounts``; longest mount point wins)."""
    best, kind = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and (str(path) + "/").startswith(fields[1].rstrip("/") + "/") \
                    and len(fields[1]) >= len(best):
                best, kind = fields[1], fields[2]
    return kind


NO_CHECKPOINT = "dradriver-no-checkpoint"
"""The side name of dradriver run with ``--nvidia-checkpoint=false`` (what keeping NVIDIA's checkpoint costs)."""


def dradriver_side(node: Any, cdi_root: Path | None = None, *, nvidia_checkpoint: bool = True) -> Side:
    """dradriver's plugin as a process (the ``gpu-kubelet-plugin`` console script) on ``node``; its CDI root is
    ``cdi_root`` (default: the sandbox node's); ``nvidia_checkpoint=False`` runs it without NVIDIA's
    ``checkpoint.json`` (side :data:`NO_CHECKPOINT`)."""
    from dradriver.sandbox.cluster import plugin_environment

    if cdi_root is not None:
        cdi_root.mkdir(parents=True, exist_ok=True)
    config = node.config(log_level="error", nvidia_checkpoint=nvidia_checkpoint,
                         **({"cdi_root": cdi_root} if cdi_root is not None else {}))
    env = dict(os.environ)
    env.update(plugin_environment(config))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # The ``gpu-kubelet-plugin`` console script, as NVIDIA's chart runs it (with this checkout's interpreter).
    script = ("import sys; from dradriver.commands.gpu_kubelet_plugin import main; "
              "sys.argv[0] = 'gpu-kubelet-plugin'; sys.exit(main())")
    return Side("dradriver" if nvidia_checkpoint else NO_CHECKPOINT, [sys.executable, "-c", script], env,
                Path(config.kubelet_registrar_directory_path))



def _slice_count(api: Any, node_name: str) -> int:
    return sum(1 for s in api.objects("ResourceSlice")
               if s.get("spec", {}).get("nodeName") == node_name and s.get("spec", {}).get("driver") == DRIVER)


def _delete_slices(api: Any, node_name: str) -> None:
    for s in api.objects("ResourceSlice"):
        if s.get("spec", {}).get("nodeName") == node_name:
            with contextlib.suppress(Exception):
                api.delete("ResourceSlice", s["metadata"]["name"])


def _create_claims(api: Any, node_name: str, count: int, tag: str, *, admin: bool = False) -> list[Any]:
    """``count`` allocated one-GPU claims (``gpu-<i mod 8>``); ``admin``: with ``adminAccess`` (they may share a
    GPU with each other and with a workload claim, so any number can be held at once)."""
    from dradriver.domain.claims import ClaimRef

    refs = []
    for i in range(count):
        exactly: dict[str, Any] = {"deviceClassName": DRIVER, **({"adminAccess": True} if admin else {})}
        obj = api.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"vs-{tag}-{i}", "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        })
        found: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": node_name, "device": f"gpu-{i % GPUS}",
                                 **({"adminAccess": True} if admin else {})}
        obj["status"] = {"allocation": {"devices": {"results": [found]}}}
        obj = api.update(obj, subresource="status")
        refs.append(ClaimRef("default", obj["metadata"]["name"], obj["metadata"]["uid"]))
    return refs


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(side: Side, node: Any, claims: int, tag: str, held: int = 0) -> dict[str, float]:
    """Start ``side``'s plugin, measure every figure once, stop it. Raises RuntimeError when it fails to start.

    ``held``: claims (admin access, :func:`_create_claims`) prepared before the pairs and held while they run, so
    the pairs are measured on a node that already holds that many claims; unprepared before the plugin stops.
    """
    from dradriver.sandbox.kubelet import KubeletEmulator

    api = node.api
    _delete_slices(api, node.node_name)
    for sock in side.registrar.glob("*.sock"):
        sock.unlink()
    refs = _create_claims(api, node.node_name, claims, tag)
    held_refs = _create_claims(api, node.node_name, held, f"{tag}-held", admin=True)
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(side.argv, env=side.env, stdout=log, stderr=subprocess.STDOUT)
    figures: dict[str, float] = {}
    try:
        deadline = start + START_TIMEOUT
        while "start_to_slice_s" not in figures:
            now = time.perf_counter()
            if "start_to_registration_s" not in figures and any(side.registrar.glob("*.sock")):
                figures["start_to_registration_s"] = now - start
                figures["cpu_to_registration_s"] = _proc_cpu(proc.pid)
            if _slice_count(api, node.node_name):
                figures["start_to_slice_s"] = now - start
                figures["cpu_to_start_s"] = _proc_cpu(proc.pid)
            if proc.poll() is not None or now > deadline:
                log.seek(0)
                raise RuntimeError(f"{side.name} plugin did not start (exit {proc.returncode}): "
                                   f"{log.read()[-2000:].decode(errors='replace')}")
            time.sleep(POLL)  # the API emulator runs in this process: polling slower would delay it
        figures.setdefault("start_to_registration_s", figures["start_to_slice_s"])
        figures.setdefault("cpu_to_registration_s", figures["cpu_to_start_s"])
        time.sleep(1.0)
        figures["rss_rest_mib"] = _proc_rss_mib(proc.pid)
        cpu_before = _proc_cpu(proc.pid)
        checkpoint = Path(node.config().plugin_dir) / "checkpoint.json"

        def sized() -> None:  # the checkpoint each pair rewrites (once per prepare, once per unprepare)
            figures["checkpoint_kib"] = checkpoint.stat().st_size / 1024 if checkpoint.exists() else 0.0

        prepares, unprepares, empties = asyncio.run(_pairs(KubeletEmulator, side.registrar, refs, held_refs, sized))
        figures["cpu_per_pair_ms"] = (_proc_cpu(proc.pid) - cpu_before) / len(refs) * 1e3
        figures["rss_after_claims_mib"] = _proc_rss_mib(proc.pid)
        figures["prepare_p50_ms"] = statistics.median(prepares) * 1e3
        figures["prepare_p99_ms"] = _percentile(prepares, 0.99) * 1e3
        figures["unprepare_p50_ms"] = statistics.median(unprepares) * 1e3
        figures["empty_call_p50_ms"] = statistics.median(empties) * 1e3
        figures["api_get_p50_ms"] = api_get_p50_ms(node.kubeconfig, refs[0])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for ref in (*refs, *held_refs):
            with contextlib.suppress(Exception):
                api.delete("ResourceClaim", ref.name, ref.namespace)
    return figures


GET_SCRIPT = """
import statistics, sys, time
from dradriver.kube import claims, client
c = client.open_client(sys.argv[1])
times = []
for _ in range(int(sys.argv[4])):
    t0 = time.perf_counter()
    claims.get_resource_claim(c, sys.argv[2], sys.argv[3])
    times.append(time.perf_counter() - t0)
print(statistics.median(times[len(times) // 5:]) * 1e3)
"""


def api_get_p50_ms(kubeconfig: Path | str, ref: Any, count: int = 200) -> float:
    """p50 of one ResourceClaim GET, ms, from a fresh Python process with dradriver's client (after 20 % warm-up)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", GET_SCRIPT, str(kubeconfig), ref.namespace, ref.name, str(count)],
                         capture_output=True, text=True, check=True, env=env, timeout=120).stdout
    return float(out.strip().splitlines()[-1])


HELD_BATCH = 100
"""Claims per call when the held claims are prepared and unprepared (not timed)."""


async def _batches(conn: Any, refs: list[Any], *, prepare: bool) -> None:
    for i in range(0, len(refs), HELD_BATCH):
        batch = refs[i:i + HELD_BATCH]
        if prepare:
            errors = [r.error for r in (await conn.prepare(batch)).values() if r.error]
        else:
            errors = [e for e in (await conn.unprepare(batch)).values() if e]
        if errors:
            raise RuntimeError(f"{'prepare' if prepare else 'unprepare'} of held claims: {errors[0]}")


async def _pairs(emulator_cls: Any, registrar: Path, refs: list[Any], held: list[Any] | None = None,
                 after_held: Callable[[], None] | None = None) -> tuple[list[float], list[float], list[float]]:
    """Time the one-claim pairs of ``refs`` (with the empty call before each) while the claims ``held`` are
    prepared (before the pairs, untimed, ``after_held`` called then; unprepared after them)."""
    prepares: list[float] = []
    unprepares: list[float] = []
    empties: list[float] = []
    async with emulator_cls(registrar) as kubelet:
        conn = await kubelet.wait_for_plugin(DRIVER)
        await _batches(conn, held or [], prepare=True)
        if after_held is not None:
            after_held()
        await _pair_loop(conn, refs, prepares, unprepares, empties)
        await _batches(conn, held or [], prepare=False)
    return prepares, unprepares, empties


async def _pair_loop(conn: Any, refs: list[Any], prepares: list[float], unprepares: list[float],
                     empties: list[float]) -> None:
    for ref in refs:
        t0 = time.perf_counter()
        await conn.prepare([])
        empties.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        answer = await conn.prepare([ref])
        t1 = time.perf_counter()
        errors = [r.error for r in answer.values() if r.error]
        if errors:
            raise RuntimeError(f"prepare {ref}: {errors[0]}")
        gone = await conn.unprepare([ref])
        t2 = time.perf_counter()
        if any(gone.values()):
            raise RuntimeError(f"unprepare {ref}: {gone}")
        prepares.append(t1 - t0)
        unprepares.append(t2 - t1)


def run(*, nvidia_plugin: Path | None, nvidia_mock_nvml: Path | None, rounds: int = 3,
        claims: int = 600, cdi_fs: str = "tmpfs", checkpoint_cost: bool = True) -> dict[str, Any]:
    """Alternate ``rounds`` runs of each plugin; return the report (see :func:`build_report`; ``cdi_root`` says
    where the CDI roots were).

    ``nvidia_plugin``/``nvidia_mock_nvml`` ``None`` or missing: only dradriver runs. ``cdi_fs``: see
    :func:`cdi_base`. ``checkpoint_cost``: also run dradriver without NVIDIA's checkpoint, in the same rotation
    (the report's ``checkpoint_cost``).
    """
    from dradriver.sandbox.node import SandboxNode

    peer_reason = ""
    if nvidia_plugin is None or not nvidia_plugin.exists():
        peer_reason = f"NVIDIA's plugin binary not found ({nvidia_plugin})"
    elif nvidia_mock_nvml is None or not (nvidia_mock_nvml / "libnvidia-ml.so.1").exists():
        peer_reason = f"NVIDIA's mock NVML not found ({nvidia_mock_nvml})"
    samples: dict[str, list[dict[str, float]]] = {"dradriver": [], "nvidia": [], NO_CHECKPOINT: []}
    base, placement = cdi_base(cdi_fs)
    with SandboxNode(profile=DRADRIVER_PROFILE) as node, tempfile.TemporaryDirectory(prefix="vs-nvidia-") as tmp, \
            tempfile.TemporaryDirectory(prefix="vs-nvidia-cdi-", dir=base) as cdi:
        sides = [dradriver_side(node, Path(cdi) / "dradriver")]
        if checkpoint_cost:
            sides.append(dradriver_side(node, Path(cdi) / NO_CHECKPOINT, nvidia_checkpoint=False))
        if not peer_reason:
            assert nvidia_plugin is not None and nvidia_mock_nvml is not None
            sides.append(nvidia_side(node, nvidia_plugin, nvidia_mock_nvml, Path(tmp), Path(cdi) / "nvidia"))
        bare = bare_interpreter_rss_mib()
        load_before = os.getloadavg()[0]
        for r in range(rounds):
            for side in sides if r % 2 == 0 else list(reversed(sides)):
                try:
                    samples[side.name].append(measure(side, node, claims, f"{side.name}-{r}"))
                except RuntimeError as exc:
                    if side.name != "nvidia":
                        raise
                    peer_reason = f"NVIDIA's plugin failed: {exc}"
                    sides = [s for s in sides if s.name != "nvidia"]
                    samples["nvidia"] = []
                    break
    report = build_report(samples, bare_rss_mib=bare, peer_reason=peer_reason, claims=claims, rounds=rounds)
    report["checkpoint_cost"] = checkpoint_costs(samples)
    report["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    report["cdi_root"] = placement
    report["samples"] = samples
    return report


HELD_COUNTS = (0, 100, 1000)
"""Claims already held when the held-claims comparison (:func:`run_held`) times its one-claim pairs."""
HELD_FIGURES = ("prepare_p50_ms", "prepare_p99_ms", "unprepare_p50_ms", "cpu_per_pair_ms")


def run_held(*, held_counts: tuple[int, ...] = HELD_COUNTS, rounds: int = 3, claims: int = 200,
             cdi_fs: str = "tmpfs") -> dict[str, Any]:
    """What NVIDIA's checkpoint costs as the node's claims grow: dradriver's plugin with and without
    ``--nvidia-checkpoint`` (alternating, the same node and directories), ``claims`` one-claim prepare+unprepare
    pairs timed while ``held`` other claims (admin access, so they share the 8 GPUs) are prepared, for each count in
    ``held_counts``. The file is rewritten whole at each change (temp file, fsync, rename), so its cost grows with
    the claims it names; dradriver's claim state appends one record whatever its size.

    Returns ``{"rows": [{"held", "checkpoint_kib", "with": {figure: ms}, "without": {...}, "ratio": {...}}],
    "rounds", "claims", "cdi_root", "load_average", "samples"}``: medians over the runs, ``ratio`` = with / without
    (1.0: the checkpoint costs nothing) for :data:`HELD_FIGURES`. NVIDIA's plugin is not run here.
    """
    from dradriver.sandbox.node import SandboxNode

    samples: dict[int, dict[str, list[dict[str, float]]]] = {n: {"dradriver": [], NO_CHECKPOINT: []}
                                                             for n in held_counts}
    base, placement = cdi_base(cdi_fs)
    load_before = os.getloadavg()[0]
    with SandboxNode(profile=DRADRIVER_PROFILE) as node, \
            tempfile.TemporaryDirectory(prefix="vs-nvidia-cdi-", dir=base) as cdi:
        sides = [dradriver_side(node, Path(cdi) / "dradriver"),
                 dradriver_side(node, Path(cdi) / NO_CHECKPOINT, nvidia_checkpoint=False)]
        for r in range(rounds):
            for held in held_counts:
                for side in sides if r % 2 == 0 else list(reversed(sides)):
                    samples[held][side.name].append(measure(side, node, claims, f"{side.name}-{r}-{held}", held))
    rows = []
    for held in held_counts:
        with_ = {f: round(_median(samples[held]["dradriver"], f), 3) for f in HELD_FIGURES}
        without = {f: round(_median(samples[held][NO_CHECKPOINT], f), 3) for f in HELD_FIGURES}
        rows.append({"held": held, "checkpoint_kib": round(_median(samples[held]["dradriver"], "checkpoint_kib"), 1),
                     "with": with_, "without": without,
                     "ratio": {f: round(with_[f] / without[f], 2) if without[f] else None for f in HELD_FIGURES}})
    return {"rows": rows, "rounds": rounds, "claims": claims, "cdi_root": placement,
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "samples": {str(k): v for k, v in samples.items()}}


def format_held_report(report: dict[str, Any]) -> str:
    """:func:`run_held`'s report as a Markdown table (one row per held-claims count)."""
    lines = ["| claims held | checkpoint.json (KiB) | prepare p50 with / without (ms) | ratio | prepare p99 with / "
             "without (ms) | ratio | unprepare p50 with / without (ms) | ratio | CPU per pair with / without (ms) "
             "| ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        cells = [str(row["held"]), f"{row['checkpoint_kib']:g}"]
        for figure in HELD_FIGURES:
            cells += [f"{row['with'][figure]} / {row['without'][figure]}", f"{row['ratio'][figure]}"]
        lines.append("| " + " | ".join(cells) + " |")
    load = report["load_average"]
    lines.append(f"{report['rounds']} alternating runs per count, {report['claims']} one-claim pairs per run; "
                 f"1-min load average {load[0]} before, {load[1]} after; CDI roots on {report['cdi_root']}")
    return "\n".join(lines)


def build_report(samples: dict[str, list[dict[str, float]]], *, bare_rss_mib: float, peer_reason: str,
                 claims: int, rounds: int) -> dict[str, Any]:
    """The report: ``{"peer_run": bool, "peer_note": str, "bare_interpreter_rss_mib": float, "claims": int,
    "rounds": int, "rows": {figure: {"label", "dradriver", "nvidia", "ratio", "target", "met"}}}``.

    Each figure is the median over the runs. ``ratio`` is dradriver / NVIDIA (``None`` without the peer; the
    memory rows then divide by the bare interpreter's RSS and ``target`` says so).
    """
    peer_run = bool(samples.get("nvidia")) and not peer_reason
    rows: dict[str, dict[str, Any]] = {}
    for figure, (op, target, base) in TARGETS.items():
        ours = _median(samples["dradriver"], figure)
        theirs = _median(samples["nvidia"], figure) if peer_run else None
        ratio: float | None = None
        target_text = f"{op} {target:g}x NVIDIA"
        if base == "absolute":
            value_for_target: float | None = ours
            target_text = f"{op} {target:g}"
            if theirs:
                ratio = ours / theirs
        elif theirs:
            ratio = ours / theirs
            value_for_target = ratio
        elif figure.startswith("rss_"):
            ratio = ours / bare_rss_mib
            value_for_target = None
            target_text = f"{op} {target:g}x NVIDIA (peer not run: ratio is to a bare interpreter)"
        else:
            value_for_target = None
        if not op:
            value_for_target, target_text = None, ""
        met = None if value_for_target is None else (value_for_target <= target)
        rows[figure] = {"label": LABELS[figure], "dradriver": round(ours, 3),
                        "nvidia": None if theirs is None else round(theirs, 3),
                        "ratio": None if ratio is None else round(ratio, 3), "target": target_text, "met": met}
    note = "" if peer_run else f"peer not run: {peer_reason or 'no samples'}"
    return {"peer_run": peer_run, "peer_note": note, "bare_interpreter_rss_mib": round(bare_rss_mib, 2),
            "claims": claims, "rounds": rounds, "rows": rows, "floors": _floors(samples, peer_run)}


def _floors(samples: dict[str, list[dict[str, float]]], peer_run: bool) -> dict[str, float | None]:
    """What dradriver's gRPC round trip and a Python client's GET alone put under its one-claim figures:
    ``{"api_get_p50_ms", "prepare_floor_ms", "unprepare_floor_ms", "prepare_floor_ratio",
    "unprepare_floor_ratio"}`` (ratios to NVIDIA's figures, ``None`` without the peer)."""
    runs = [s for side in samples.values() for s in side if "api_get_p50_ms" in s]
    if not runs or not samples.get("dradriver"):
        return {}
    get_ms = statistics.median(s["api_get_p50_ms"] for s in runs)
    empty_ms = _median(samples["dradriver"], "empty_call_p50_ms")
    floors: dict[str, float | None] = {"api_get_p50_ms": round(get_ms, 3),
                                       "prepare_floor_ms": round(empty_ms + get_ms, 3),
                                       "unprepare_floor_ms": round(empty_ms, 3),
                                       "prepare_floor_ratio": None, "unprepare_floor_ratio": None}
    if peer_run:
        floors["prepare_floor_ratio"] = round((empty_ms + get_ms) / _median(samples["nvidia"], "prepare_p50_ms"), 3)
        floors["unprepare_floor_ratio"] = round(empty_ms / _median(samples["nvidia"], "unprepare_p50_ms"), 3)
    return floors


COST_FIGURES = ("prepare_p50_ms", "prepare_p99_ms", "unprepare_p50_ms", "cpu_per_pair_ms")


def checkpoint_costs(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """What keeping NVIDIA's checkpoint costs dradriver: ``{figure: {"with", "without", "delta"}}`` for the
    one-claim figures (medians over the runs; ``{}`` when the variant did not run)."""
    if not samples.get(NO_CHECKPOINT) or not samples.get("dradriver"):
        return {}
    out = {}
    for figure in COST_FIGURES:
        with_, without = _median(samples["dradriver"], figure), _median(samples[NO_CHECKPOINT], figure)
        out[figure] = {"with": round(with_, 3), "without": round(without, 3), "delta": round(with_ - without, 3)}
    return out


def _median(samples: list[dict[str, float]], figure: str) -> float:
    return statistics.median(s[figure] for s in samples)


def format_report(report: dict[str, Any]) -> str:
    """The report as a Markdown table (one row per figure)."""
    lines = []
    if not report["peer_run"]:
        lines.append(report["peer_note"])
    lines += ["| figure | dradriver | NVIDIA | ratio | target | met |", "|---|---|---|---|---|---|"]
    for row in report["rows"].values():
        met = "" if row["met"] is None else ("yes" if row["met"] else "NO")
        theirs = "-" if row["nvidia"] is None else row["nvidia"]
        ratio = "-" if row["ratio"] is None else row["ratio"]
        lines.append(f"| {row['label']} | {row['dradriver']} | {theirs} | {ratio} | {row['target']} | {met} |")
    floors = report.get("floors") or {}
    if floors:
        ratio = (f" = {floors['prepare_floor_ratio']}x / {floors['unprepare_floor_ratio']}x NVIDIA's"
                 if floors.get("prepare_floor_ratio") is not None else "")
        lines.append(f"floors: a ResourceClaim GET from a Python process {floors['api_get_p50_ms']} ms p50; "
                     f"dradriver's empty call + GET {floors['prepare_floor_ms']} ms under a prepare, its empty "
                     f"call {floors['unprepare_floor_ms']} ms under an unprepare{ratio}")
    costs = report.get("checkpoint_cost") or {}
    if costs:
        lines.append("NVIDIA's checkpoint kept (dradriver with / without --nvidia-checkpoint): " + "; ".join(
            f"{LABELS.get(f, f).split(' (')[0]} {c['with']} / {c['without']} ({c['delta']:+} ms)"
            for f, c in costs.items()))
    load = report.get("load_average")
    lines.append(f"bare interpreter RSS: {report['bare_interpreter_rss_mib']} MiB; {report['rounds']} alternating "
                 f"runs, {report['claims']} one-claim pairs per run"
                 + (f"; 1-min load average {load[0]} before, {load[1]} after" if load else "")
                 + (f"; CDI roots on {report['cdi_root']}" if report.get("cdi_root") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI of the scenario; returns 0 when it ran (targets are reported, not enforced)."""
    parser = argparse.ArgumentParser(prog="python -m bench vs_nvidia", description=__doc__.split("\n")[0])
    plugin, mock_nvml = peer_paths()  # under DRADRIVER_NVIDIA_PEERS when it is set
    parser.add_argument("--nvidia-plugin", type=Path, default=plugin,
                        help="NVIDIA's gpu-kubelet-plugin (default: bin/ under DRADRIVER_NVIDIA_PEERS)")
    parser.add_argument("--nvidia-mock-nvml", type=Path, default=mock_nvml,
                        help="NVIDIA's mock NVML folder (default: mocknvml/ under DRADRIVER_NVIDIA_PEERS)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each plugin, alternating")
    parser.add_argument("--claims", type=int, default=600, help="one-claim prepare+unprepare pairs per run")
    parser.add_argument("--cdi-fs", choices=("tmpfs", "disk"), default="tmpfs",
                        help="where both plugins' CDI roots go: tmpfs as /var/run/cdi on a node (default), or disk")
    parser.add_argument("--no-checkpoint-cost", action="store_true",
                        help="skip the runs of dradriver without NVIDIA's checkpoint (its cost is then not reported)")
    parser.add_argument("--held", metavar="N,N,...", default="",
                        help="instead: dradriver with and without NVIDIA's checkpoint only, the one-claim pairs timed "
                             "while N other claims are held, for each N (e.g. 0,100,1000; --claims pairs per run)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    if args.held:
        held = run_held(held_counts=tuple(int(n) for n in args.held.split(",")), rounds=args.rounds,
                        claims=args.claims, cdi_fs=args.cdi_fs)
        print(format_held_report(held))
        if args.json:
            Path(args.json).write_text(json.dumps(held, indent=2) + "\n")
        return 0
    report = run(nvidia_plugin=args.nvidia_plugin, nvidia_mock_nvml=args.nvidia_mock_nvml, rounds=args.rounds,
                 claims=args.claims, cdi_fs=args.cdi_fs, checkpoint_cost=not args.no_checkpoint_cost)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
