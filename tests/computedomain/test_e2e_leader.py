"""Two compute-domain controller replicas with leader election in the multi-node sandbox: the leader is
SIGKILLed, the standby takes the Lease and reconciles NVIDIA's channel-injection example to Ready."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.domain import computedomains as cd
from dradriver.sandbox.multinode import MultiNodeCluster

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "sandbox" / "fixtures" / "imex"
LEASE = "nvidia-compute-domain-controller"
WAIT_S = 90.0
ELECTION = {"LEADER_ELECTION_ENABLED": "true", "LEADER_ELECTION_LEASE_DURATION": "2s",
            "LEADER_ELECTION_RENEW_DEADLINE": "1s", "LEADER_ELECTION_RETRY_PERIOD": "200ms"}


@pytest.fixture
def cluster() -> Iterator[MultiNodeCluster]:
    with MultiNodeCluster((1,), time_scale=0.1, interval_s=0.05) as c:
        c.install_compute_domains()
        c.start_plugins(timeout_s=WAIT_S)
        yield c


def _holder(c: MultiNodeCluster) -> str:
    lease: dict[str, Any] = c.api.get("Lease", LEASE, "default") or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def test_the_standby_takes_over_when_the_leader_is_killed(cluster: MultiNodeCluster) -> None:
    procs = {name: cluster.start_controller(extra_env={**ELECTION, "POD_NAME": name}, log_name=f"{name}.log")
             for name in ("ctrl-a", "ctrl-b")}
    leader = cluster.wait_for("a leader", lambda: _holder(cluster).rsplit("-", 5)[0] if _holder(cluster) else "",
                              timeout_s=WAIT_S)
    assert leader in procs
    standby = next(n for n in procs if n != leader)
    procs[leader].send_signal(signal.SIGKILL)
    procs[leader].wait(timeout=30)
    for doc in yaml.safe_load_all((FIXTURES / "channel-injection.yaml").read_text()):
        if doc:
            doc["metadata"].setdefault("namespace", "default")
            cluster.api.create(doc)
    cluster.wait_for("the standby holding the Lease", lambda: _holder(cluster).startswith(f"{standby}-"),
                     timeout_s=WAIT_S)
    cluster.wait_for("the workload running", lambda: cluster.pod_running("imex-channel-injection"), timeout_s=WAIT_S)
    cluster.wait_for("the domain Ready", lambda: ((cluster.api.get(cd.COMPUTE_DOMAIN_KIND, "imex-channel-injection",
                                                                    "default") or {}).get("status") or {})
                     .get("status") == cd.STATUS_READY, timeout_s=WAIT_S)
    assert procs[standby].poll() is None
