"""``dradriver demo --scenario compute-domain``: a ComputeDomain across two nodes of one of two emulated NVL72
racks, from the command line with ``--output json`` (every step reported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_compute_domain_scenario_reports_every_step() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", "--scenario", "compute-domain", "--output",
                           "json"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["scenario"] == "compute-domain"
    steps = {s["step"]: s for s in report["steps"]}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6, 7]
    nodes = steps[1]["details"]
    assert {d["rack"] for d in nodes} == {1, 2} and len(nodes) == 4
    assert all(d["devices"] == ["channel-0", "daemon-0"] for d in steps[2]["details"])
    placed = {d["node"] for d in steps[3]["details"]}
    assert len(placed) == 2 and all(n.startswith("rack1-") for n in placed)
    ready = [d for d in steps[4]["details"] if "status" in d]
    assert sorted(d["name"] for d in ready) == sorted(placed) and all(d["status"] == "Ready" for d in ready)
    for detail in steps[5]["details"]:
        assert [n["path"] for n in detail["device_nodes"]] == ["/dev/nvidia-caps-imex-channels/channel0"]
    assert [d["state"] for d in steps[6]["details"]] == ["READY", "READY"]
    assert not any(steps[7]["details"][0]["leftovers"].values())


def test_two_tenants_each_get_their_own_channel_and_heal_after_a_node_dies() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", "--scenario", "compute-domain", "--tenants", "2",
                           "--output", "json"], cwd=ROOT, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["tenants"] == 2
    steps = {s["step"]: s["details"] for s in report["steps"]}
    assert sorted(steps) == list(range(1, 9))
    assert len(steps[1]) == 4 and all(d["host_imex"] == "READY" for d in steps[1])
    assert all(d["devices"] == 2048 and not d["daemon"] for d in steps[2])  # host-managed: no daemon-0
    channels = {d["namespace"]: d["channel"] for d in steps[3]}
    assert sorted(channels) == ["team-a", "team-b"] and len(set(channels.values())) == 2 and 0 not in channels.values()
    assert all(d["selector"].endswith(f"id == {d['channel']}") for d in steps[3])
    by_node = {d["node"]: d["pods"] for d in steps[4] if "node" in d}
    shared = by_node["rack1-node01"]
    assert {p["namespace"] for p in shared} == {"team-a", "team-b"}  # two tenants on one node
    for pods in by_node.values():
        for pod in pods:
            assert pod["device_paths"] == [f"/dev/nvidia-caps-imex-channels/channel{channels[pod['namespace']]}"]
    refused = steps[5][0]
    assert refused["node"] == "rack1-node02"
    assert f"device 'channel-{channels['team-a']}' is not the IMEX channel of ComputeDomain team-b/job" \
        in refused["error"] and "claim team-b/peek (uid " in refused["error"]
    assert steps[6][0]["lost"] == ["team-a/worker-1", "team-b/worker-0"]
    assert steps[6][1]["kept"] == ["team-a/worker-0", "team-b/worker-1"]
    replaced = {d["namespace"]: d for d in steps[6] if "pod" in d}
    for ns, detail in replaced.items():
        assert detail["node"] == "rack1-node03"
        assert detail["device_paths"] == [f"/dev/nvidia-caps-imex-channels/channel{channels[ns]}"]
    assert steps[7][0]["specs_before"] == 2 and steps[7][0]["host_imex"] == "READY"
    assert not any(steps[8][0]["leftovers"].values())


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--scenario", "compute-domain", "--tenants", "5"], 1, "--tenants: 5 is outside 2..4"),
    (["--scenario", "basic", "--tenants", "2"], 2, "--tenants applies to --scenario compute-domain, not basic"),
])
def test_tenants_out_of_range_or_on_another_scenario_is_refused(argv: list[str], code: int, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == code and message in proc.stderr, proc.stderr


def test_pre_warmed_scenario_shows_daemons_before_any_domain_two_timed_jobs_and_a_job_held_at_binding() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", "--scenario", "compute-domain", "--imex",
                           "pre-warmed", "--output", "json"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["scenario"] == "compute-domain" and report["imex"] == "pre-warmed"
    steps = {s["step"]: s["details"] for s in report["steps"]}
    assert sorted(steps) == list(range(1, 8))
    nodes = {d["node"] for d in steps[1]}
    assert len(nodes) == 2
    # the clique daemons run and are Ready before the first ComputeDomain exists
    daemons = [d for d in steps[2] if "pod" in d]
    assert {d["node"] for d in daemons} == nodes
    assert all(d["ready"] and d["state"] == "READY" and d["compute_domains"] == 0 for d in daemons)
    assert steps[2][-1]["binding_conditions"] == ["ComputeDomainReady"]
    # two jobs, each timed from its ComputeDomain's creation to all its claims prepared, each its own channel
    jobs = {d["job"]: d for step in (3, 4) for d in steps[step] if "seconds_to_prepared" in d}
    assert sorted(jobs) == ["job-1", "job-2"]
    assert all(j["seconds_to_prepared"] > 0 and j["new_pods"] == 0 for j in jobs.values())
    channels = {name: j["channel"] for name, j in jobs.items()}
    assert len(set(channels.values())) == 2 and 0 not in channels.values()
    for step in (3, 4):
        pods = [d for d in steps[step] if "pod" in d]
        assert {d["node"] for d in pods} == nodes
        assert all(d["device_paths"] == [f"/dev/nvidia-caps-imex-channels/channel{channels[d['job']]}"] for d in pods)
    # job-3's pod on the node whose daemon is not Ready is held in PreBind, bound only after the daemon turned Ready
    held = next(d for d in steps[5] if d.get("held"))
    assert held["binding_conditions"] == ["ComputeDomainReady"] and held["node"] == steps[5][0]["node"]
    released = steps[6][0]
    bound = steps[6][1]
    assert bound["pod"] == held["pod"] and bound["held_until_release"] is True
    assert bound["condition"]["type"] == "ComputeDomainReady" and bound["condition"]["status"] == "True"
    assert bound["bound_s"] > released["released_s"] and bound["prepared_s"] >= bound["bound_s"]
    job3 = {d["pod"]: d for d in steps[6] if d.get("job") == "job-3"}
    assert len(job3) == 2 and job3[held["pod"]]["node"] == held["node"]
    assert {d["channel"] for d in job3.values()} == {job3[held["pod"]]["channel"]}
    assert job3[held["pod"]]["channel"] not in channels.values()
    # cleanup: nothing of the jobs left, the clique daemons still there
    assert not any(steps[7][0]["leftovers"].values()) and steps[7][0]["workload_claims"] == 6
    assert set(steps[7][1]["daemons"]) == nodes


@pytest.mark.parametrize(("argv", "message"), [
    (["--scenario", "basic", "--imex", "pre-warmed"], "--imex applies to --scenario compute-domain, not basic"),
    (["--scenario", "compute-domain", "--imex", "host-managed"],
     "--imex host-managed is not what --tenants 1 runs (driver-managed)"),
    (["--scenario", "compute-domain", "--tenants", "2", "--imex", "driver-managed"],
     "--imex driver-managed is not what --tenants 2 runs (host-managed)"),
    (["--scenario", "compute-domain", "--tenants", "2", "--imex", "pre-warmed"],
     "--imex pre-warmed runs its own three jobs: --tenants applies to the host-managed scenario"),
])
def test_an_imex_mode_the_scenario_does_not_run_is_refused(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "demo", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and message in proc.stderr and not proc.stdout, proc.stderr
