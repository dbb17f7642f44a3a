"""ComputeDomains on nodes whose NVLink fabric is not usable, in the multi-node sandbox: a node in no clique
(fabric info NOT_SUPPORTED: the daemon idles, the channel prepare has no device edits) and a node whose fabric
registration is still IN_PROGRESS (the plugin waits, not ready) and then fails (its devices are tainted)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dradriver.domain import computedomains as cd
from dradriver.nvml import mock
from dradriver.sandbox.demos import compute_domain as domain_demo
from dradriver.sandbox.multinode import MultiNodeCluster, cdi_edits

pytestmark = pytest.mark.slow

NOT_SUPPORTED = 0
WAIT_S = 90.0


@pytest.fixture
def cluster() -> Iterator[MultiNodeCluster]:
    fabric = {1: (NOT_SUPPORTED, 0), 2: (mock.FABRIC_STATE_IN_PROGRESS, 0)}
    with MultiNodeCluster((1, 1), time_scale=0.1, interval_s=0.05, fabric=fabric) as c:
        c.install_compute_domains()
        yield c


def test_in_progress_fabric_is_waited_out_a_failed_one_taints_and_a_node_in_no_clique_idles(
        cluster: MultiNodeCluster) -> None:
    cluster.start_plugin("rack2-node00")
    cluster.wait_for_plugin("rack2-node00", timeout_s=WAIT_S)  # served early: registered, not ready, waiting
    node = cluster.node("rack2-node00")
    cluster.wait_for("the wait in the plugin's log",
                     lambda: "waiting for NVLink fabric registration" in node.plugin_log.read_text(), timeout_s=WAIT_S)
    assert "IN_PROGRESS" in node.plugin_log.read_text()
    cluster.wait_for("the Event", lambda: [e["involvedObject"]["name"] for e in cluster.api.objects("Event")
                                           if e.get("reason") == "FabricRegistrationPending"] == ["rack2-node00"],
                     timeout_s=WAIT_S)  # recorded just after the log line
    # the fabric manager finishes the registration, and it fails (status NVML_ERROR_UNKNOWN)
    with node.sandbox.nvml_control.open("a") as control:
        control.writelines(f"set {g} fabric.status 999\nset {g} fabric.state 3\n" for g in range(4))

    def taint_values() -> list[list[str]]:
        return [[t.get("value", "") for t in d.get("taints", [])] for s in cluster.api.objects("ResourceSlice")
                if s["spec"].get("nodeName") == "rack2-node00" for d in s["spec"]["devices"]]

    cluster.wait_for("rack2's devices tainted", lambda: bool(taint_values()) and all(
        v == ["registration-failed"] for v in taint_values()), timeout_s=WAIT_S)
    assert "NVML error 999" in node.plugin_log.read_text()
    assert cluster.stop_plugin("rack2-node00") == 0
    cluster.api.delete("Node", "rack2-node00")  # the sandbox's scheduler does not read device taints

    cluster.start_plugin("rack1-node00")
    cluster.wait_for_plugin("rack1-node00", timeout_s=WAIT_S)
    cluster.start_controller()
    domain = cluster.api.create(domain_demo.compute_domain("solo", "solo-channel", num_nodes=1))
    cluster.api.create(domain_demo.workload_pod("solo-w", "solo-channel", group="solo"))
    cluster.wait_for("the workload running", lambda: cluster.pod_running("solo-w"), timeout_s=WAIT_S)
    node = cluster.node("rack1-node00")
    assert node.pod_devices["default/solo-w"].device_nodes == []  # no clique: no channel device edits
    # the workload needs no daemon on a node in no clique, so the daemon pod may come after it: wait for it
    cluster.wait_for("the domain's daemon pod", lambda: list(domain_demo.daemon_pods(
        cluster, domain["metadata"]["uid"])) == ["rack1-node00"], timeout_s=WAIT_S)
    daemons = domain_demo.daemon_pods(cluster, domain["metadata"]["uid"])
    pod = daemons["rack1-node00"]
    cluster.wait_for("the idle daemon ready", lambda: cluster.pod_running(pod["metadata"]["name"], cluster.namespace),
                     timeout_s=WAIT_S)
    edits = node.pod_devices[f"{cluster.namespace}/{pod['metadata']['name']}"]
    assert edits.env.get("CLIQUE_ID", "") == ""
    claim_ids = [i for i in edits.device_ids if "/claim=" in i]
    claim_edits = cdi_edits(node.sandbox.cdi_root, claim_ids)
    assert claim_edits.device_paths() == []  # no fabric-imex-mgmt capability outside a clique
    cluster.wait_for("the idle daemon's pod label",
                     lambda: ((cluster.api.get("Pod", pod["metadata"]["name"], cluster.namespace) or {})
                              .get("metadata", {}).get("labels", {}).get(cd.LABEL_CLIQUE_ID)) == "",
                     timeout_s=WAIT_S)
    log = next((node.root / "pods").glob(f"*{pod['metadata']['uid']}")).joinpath(
        pod["spec"]["containers"][0]["name"] + ".log")
    # the daemon labels its pod first and logs after: wait for the line rather than read once
    cluster.wait_for("the idle daemon's log line", lambda: "no NVLink clique" in log.read_text(), timeout_s=WAIT_S)
