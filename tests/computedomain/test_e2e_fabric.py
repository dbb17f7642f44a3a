"""ComputeDomains on nodes whose NVLink fabric is not usable, in the multi-node sandbox: a node in no clique
(fabric info NOT_SUPPORTED: the daemon idles, the channel prepare has no device edits) and a node whose fabric
registration is still IN_PROGRESS or failed (the plugin refuses to start, strict mode)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dradriver.domain import computedomains as cd
from dradriver.nvml import mock
from dradriver.sandbox import cddemo
from dradriver.sandbox.multinode import MultiNodeCluster, MultiNodeError, cdi_edits

pytestmark = pytest.mark.slow

NOT_SUPPORTED = 0
WAIT_S = 90.0


@pytest.fixture
def cluster() -> Iterator[MultiNodeCluster]:
    fabric = {1: (NOT_SUPPORTED, 0), 2: (mock.FABRIC_STATE_IN_PROGRESS, 0)}
    with MultiNodeCluster((1, 1), time_scale=0.1, interval_s=0.05, fabric=fabric) as c:
        c.install_compute_domains()
        yield c


def test_in_progress_fabric_stops_the_plugin_and_a_node_in_no_clique_idles(cluster: MultiNodeCluster) -> None:
    cluster.start_plugin("rack2-node00")
    with pytest.raises(MultiNodeError, match="exited"):
        cluster.wait_for_plugin("rack2-node00", timeout_s=WAIT_S)
    node = cluster.node("rack2-node00")
    assert "IN_PROGRESS" in node.plugin_log.read_text().upper().replace(" ", "_")
    failed = mock.rack_node_profile("gb200-nvl72-rack-b", 0, node.root / "nvml", fabric_state=3, fabric_status=999)
    assert failed == node.profile  # the same file: the node's GPUs now report a failed registration
    node.plugin_log.write_text("")
    cluster.start_plugin("rack2-node00")
    with pytest.raises(MultiNodeError, match="exited"):
        cluster.wait_for_plugin("rack2-node00", timeout_s=WAIT_S)
    assert "NVLink fabric status is NVML error 999" in node.plugin_log.read_text()
    cluster.api.delete("Node", "rack2-node00")  # no plugin, no pool: keep the scheduler to the other node

    cluster.start_plugin("rack1-node00")
    cluster.wait_for_plugin("rack1-node00", timeout_s=WAIT_S)
    cluster.start_controller()
    domain = cluster.api.create(cddemo.compute_domain("solo", "solo-channel", num_nodes=1))
    cluster.api.create(cddemo.workload_pod("solo-w", "solo-channel", group="solo"))
    cluster.wait_for("the workload running", lambda: cluster.pod_running("solo-w"), timeout_s=WAIT_S)
    node = cluster.node("rack1-node00")
    assert node.pod_devices["default/solo-w"].device_nodes == []  # no clique: no channel device edits
    daemons = cddemo.daemon_pods(cluster, domain["metadata"]["uid"])
    assert list(daemons) == ["rack1-node00"]
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
