"""Leader election on a Lease: the elector's rules in process (a fake clock stands for the lease running out),
then two ``dradriver compute-domain-controller`` processes -- only the leader reconciles, and after a ``kill -9``
of the leader in the middle of a reconcile the standby takes the Lease and finishes it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from dradriver.commands.compute_domain_controller import parse_duration
from dradriver.config import CHANNEL_NEEDS_HOST_MANAGED
from dradriver.domain.computedomains import FINALIZER, daemon_object_name
from dradriver.errors import FlagError
from dradriver.kube.client import KubeClient
from dradriver.kube.leaderelection import LeaderElectionConfig, LeaderElector, candidate_identity
from dradriver.sandbox.apiserver import ApiServerEmulator
from tests.computedomain.controller_helpers import (
    DRIVER_NS,
    GROUP,
    IMAGE,
    VERSION,
    compute_domain,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
LEASE = "dradriver-compute-domain-controller"


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _elector(client: KubeClient, pod: str, clock: FakeClock | None = None) -> LeaderElector:
    cfg = LeaderElectionConfig(namespace=DRIVER_NS, name=LEASE, identity=candidate_identity(pod),
                               lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)
    return LeaderElector(client, cfg) if clock is None else LeaderElector(client, cfg, clock=clock)


def _lease(api: ApiServerEmulator) -> dict[str, Any]:
    lease = api.get("Lease", LEASE, DRIVER_NS)
    assert lease is not None
    return dict(lease["spec"])


def test_one_candidate_holds_the_lease_until_it_runs_out(api: ApiServerEmulator, client: KubeClient) -> None:
    a = _elector(client, "controller-a")
    clock = FakeClock()
    b = _elector(client, "controller-b", clock)
    assert a.config.identity.startswith("controller-a-") and len(a.config.identity) == len("controller-a-") + 36
    assert a.try_acquire_or_renew()
    spec = _lease(api)
    assert spec["holderIdentity"] == a.config.identity
    assert spec["leaseDurationSeconds"] == 15 and spec["leaseTransitions"] == 0
    assert not b.try_acquire_or_renew()  # held, and b has just seen it
    assert a.try_acquire_or_renew()  # a renews
    clock.now += 14.0
    assert not b.try_acquire_or_renew()  # a's renewal was seen less than 15 s ago on b's clock
    clock.now += 15.5  # a stops renewing (killed): after a lease duration of silence b takes over
    assert b.try_acquire_or_renew()
    spec = _lease(api)
    assert spec["holderIdentity"] == b.config.identity and spec["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()  # a, back, sees b's fresh lease


def test_a_stopped_leader_releases_the_lease(api: ApiServerEmulator, client: KubeClient) -> None:
    a = _elector(client, "controller-a")
    stop = threading.Event()
    leading = threading.Event()

    def lead(lost: threading.Event) -> None:
        leading.set()
        lost.wait()

    runner = threading.Thread(target=a.run, args=(lead, stop), daemon=True)
    runner.start()
    wait_for(leading.is_set, "a to lead")
    assert a.is_leader
    stop.set()
    runner.join(timeout=30)
    assert not runner.is_alive() and not a.is_leader
    spec = _lease(api)
    assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1
    b = _elector(client, "controller-b")
    assert b.try_acquire_or_renew()  # released: no need to wait out a lease duration


@pytest.mark.slow
def test_a_leader_that_cannot_renew_stops_leading(api: ApiServerEmulator, client: KubeClient) -> None:
    cfg = LeaderElectionConfig(namespace=DRIVER_NS, name=LEASE, identity="controller-a-x", lease_duration_s=1.5,
                               renew_deadline_s=1.0, retry_period_s=0.2)
    a = LeaderElector(client, cfg)
    lost_seen = threading.Event()

    def lead(lost: threading.Event) -> None:
        api.fail_next(1000, status=500, path=re.compile("/leases"))  # the API server stops answering leases
        lost.wait()
        lost_seen.set()

    assert a.run(lead, threading.Event()) is True
    assert lost_seen.is_set() and not a.is_leader
    api.clear_faults()


def test_election_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="must be greater than the renew deadline"):
        LeaderElectionConfig(namespace="n", name="l", identity="i", lease_duration_s=10, renew_deadline_s=10)
    assert parse_duration("15s", "x") == 15.0
    assert parse_duration("1m30s", "x") == 90.0
    assert parse_duration("500ms", "x") == 0.5
    with pytest.raises(FlagError, match="not a duration"):
        parse_duration("15", "--leader-election-lease-duration")


def _start(api: ApiServerEmulator, tmp_path: Path, pod: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{pod}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KUBECONFIG": api.kubeconfig_path(tmp_path), "POD_NAME": pod,
           "NAMESPACE": DRIVER_NS, "IMAGE_NAME": IMAGE, "LOG_VERBOSITY_CD_DAEMON": "4",
           "LEADER_ELECTION_ENABLED": "true", "LEADER_ELECTION_LEASE_LOCK_NAMESPACE": DRIVER_NS,
           "LEADER_ELECTION_LEASE_LOCK_NAME": LEASE, "LEADER_ELECTION_LEASE_DURATION": "3s",
           "LEADER_ELECTION_RENEW_DEADLINE": "2s", "LEADER_ELECTION_RETRY_PERIOD": "500ms"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dradriver", "compute-domain-controller"], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _holder(api: ApiServerEmulator) -> str:
    lease = api.get("Lease", LEASE, DRIVER_NS)
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


@pytest.mark.slow
def test_two_controllers_one_reconciles_and_the_standby_finishes_after_a_kill(api: ApiServerEmulator,
                                                                              client: KubeClient,
                                                                              tmp_path: Path) -> None:
    procs = {pod: _start(api, tmp_path, pod) for pod in ("controller-a", "controller-b")}
    try:
        holder = wait_for(lambda: _holder(api), "a leader")
        leader = next(pod for pod in procs if holder.startswith(f"{pod}-"))
        standby = next(pod for pod in procs if pod != leader)
        client.custom.create_namespaced_custom_object(GROUP, VERSION, "default", "computedomains",
                                                      compute_domain("cd1"))
        wait_for(lambda: "reconciled ComputeDomain default/cd1" in procs[leader][1].read_text(), "cd1 reconciled")
        wait_for(lambda: "waits for lease" in procs[standby][1].read_text(), "the standby's log")
        leader_log = procs[leader][1].read_text()
        standby_log = procs[standby][1].read_text()
        assert "reconciled ComputeDomain default/cd1" in leader_log
        assert "reconciled ComputeDomain" not in standby_log and "created " not in standby_log

        # the leader hangs creating cd2's DaemonSet (after the daemon template), and is killed there
        api.hang_next(1, seconds=10.0, method="POST", path=re.compile("/daemonsets$"))
        uid = client.custom.create_namespaced_custom_object(GROUP, VERSION, "default", "computedomains",
                                                            compute_domain("cd2"))["metadata"]["uid"]
        wait_for(lambda: api.get("ResourceClaimTemplate", daemon_object_name(uid), DRIVER_NS), "cd2's daemon RCT")
        wait_for(lambda: api.faults_left() == 0, "the leader's DaemonSet POST to hang")
        assert api.get("ResourceClaimTemplate", "cd2-channel", "default") is None  # mid-reconcile
        procs[leader][0].send_signal(signal.SIGKILL)
        procs[leader][0].wait(timeout=30)

        wait_for(lambda: _holder(api).startswith(f"{standby}-"), "the standby to take the Lease")
        wait_for(lambda: api.get("ResourceClaimTemplate", "cd2-channel", "default"), "cd2 finished by the standby")
        wait_for(lambda: api.get("DaemonSet", daemon_object_name(uid), DRIVER_NS), "cd2's DaemonSet")
        cd2 = api.get("ComputeDomain", "cd2", "default")
        assert cd2 is not None and cd2["metadata"]["finalizers"] == [FINALIZER]
        wait_for(lambda: "reconciled ComputeDomain default/cd2" in procs[standby][1].read_text(),
                 "the standby's reconcile of cd2")
        lease = api.get("Lease", LEASE, DRIVER_NS)
        assert lease is not None and lease["spec"]["leaseTransitions"] >= 1

        # SIGTERM: a clean stop that hands the Lease back
        procs[standby][0].send_signal(signal.SIGTERM)
        assert procs[standby][0].wait(timeout=60) == 0
        assert _holder(api) == ""
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def test_bad_flags_exit_2_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "POD_NAME": "p", "IMAGE_NAME": IMAGE,
           "LOG_VERBOSITY_CD_DAEMON": "4", "IMEX_ISOLATION": "channel"}
    proc = subprocess.run([sys.executable, "-m", "dradriver", "compute-domain-controller"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"compute-domain-controller: {CHANNEL_NEEDS_HOST_MANAGED}"
    env.pop("IMEX_ISOLATION")
    env["IMEX_MODE"] = "hostManaged"
    proc = subprocess.run([sys.executable, "-m", "dradriver", "compute-domain-controller"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "needs the feature gate HostManagedIMEXDaemon" in proc.stderr


@pytest.mark.parametrize(("missing", "flag"), [("IMAGE_NAME", "--image-name"),
                                               ("LOG_VERBOSITY_CD_DAEMON", "--log-verbosity-cd-daemon")])
def test_required_daemon_flags_exit_2_with_one_line(missing: str, flag: str) -> None:
    """NVIDIA's controller requires both (the IMEX daemon pods' image and LOG_VERBOSITY): a missing one is a flag
    error naming the flag and its environment twin, not a traceback or a DaemonSet with no image."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "POD_NAME": "p", "IMAGE_NAME": IMAGE,
           "LOG_VERBOSITY_CD_DAEMON": "4"}
    env.pop(missing)
    proc = subprocess.run([sys.executable, "-m", "dradriver", "compute-domain-controller"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"compute-domain-controller: {flag} (env {missing}) is required: "
                                                f"the IMEX daemon pods' "
                                                f"{'image' if missing == 'IMAGE_NAME' else 'LOG_VERBOSITY'}"]
