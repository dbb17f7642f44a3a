"""The compute-domain controller copies a daemon's own report (its clique entry's ``IMEXDaemonRunning``
condition, written by ``compute-domain-daemon run`` when its ``nvidia-imex`` keeps failing) into
``ComputeDomain.status.nodes[]``, so ``kubectl describe computedomain`` shows why a node is not ready."""

from __future__ import annotations

from typing import Any

from dradriver.computedomain.controller import ComputeDomainController
from dradriver.domain.computedomains import IMEX_DAEMON_CONDITION, REASON_IMEX_FAILED
from dradriver.kube.client import KubeClient
from dradriver.sandbox.apiserver import ApiServerEmulator
from tests.computedomain.controller_helpers import (
    GROUP,
    VERSION,
    clique_object,
    compute_domain,
    daemon_pod,
    entry,
    running,
    settings,
    wait_for,
)


def _status_nodes(api: ApiServerEmulator, name: str) -> list[dict[str, Any]]:
    obj = api.get("ComputeDomain", name, "default") or {}
    return list((obj.get("status") or {}).get("nodes") or [])


def test_the_domain_status_shows_each_nodes_daemon_failure(api: ApiServerEmulator, client: KubeClient) -> None:
    controller = ComputeDomainController(client, settings(), status_period_s=0.05)
    condition = {"type": IMEX_DAEMON_CONDITION, "status": "False", "reason": REASON_IMEX_FAILED,
                 "message": "nvidia-imex (pid 9) exited with status 1 after 0.1 s (4 failure(s) in a row; next start "
                            "in 8 s): cannot start an IMEX session: the fabric-imex-mgmt capability is in use by "
                            "another IMEX daemon (pid 1234); one nvidia-imex runs per node",
                 "lastTransitionTime": "2026-12-04T21:00:00Z"}
    with running(controller):
        created = client.custom.create_namespaced_custom_object(GROUP, VERSION, "default", "computedomains",
                                                                 compute_domain("cd1", num_nodes=2))
        uid = created["metadata"]["uid"]
        daemon_pod(api, uid, "node-a", "10.0.0.1")
        daemon_pod(api, uid, "node-b", "10.0.0.2", ready=False)
        failing = {**entry("node-b", "10.0.0.2", 1, "NotReady"), "conditions": [condition]}
        api.create(clique_object(uid, [entry("node-a", "10.0.0.1", 0), failing]))
        nodes = wait_for(lambda: (n := _status_nodes(api, "cd1")) and len(n) == 2 and n, "status.nodes")
        assert "conditions" not in nodes[0]  # a daemon that never failed reports nothing
        assert nodes[1]["name"] == "node-b" and nodes[1]["status"] == "NotReady"
        assert nodes[1]["conditions"] == [condition]
