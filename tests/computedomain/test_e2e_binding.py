"""KEP-5007 binding conditions end to end in the multi-node sandbox (``binding_conditions=True``: the scheduler's
gate and every plugin's ``BINDING_CONDITIONS=true``): NVIDIA's ``channel-injection.yaml`` unchanged, its pod held in
PreBind until the node's plugin sets ``ComputeDomainReady``, then bound and prepared at once; and the scheduler
loop's failure and timeout paths (claims deallocated, the pod scheduled again)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.domain import computedomains as cd
from dradriver.host import imexchannels
from dradriver.sandbox.multinode import MultiNodeCluster

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "sandbox" / "fixtures" / "imex"
NS = "default"
WAIT_S = 90.0
DRIVER = "compute-domain.nvidia.com"


def _claim_of(c: MultiNodeCluster, pod: str) -> dict[str, Any] | None:
    obj = c.api.get("Pod", pod, NS) or {}
    names = [s.get("resourceClaimName") for s in (obj.get("status") or {}).get("resourceClaimStatuses") or []]
    return c.api.get("ResourceClaim", str(names[0]), NS) if names and names[0] else None


def _condition(claim: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for entry in ((claim or {}).get("status") or {}).get("devices") or []:
        for cond in entry.get("conditions") or []:
            if cond.get("type") == type_ and cond.get("status") == "True":
                return dict(cond)
    return None


def _bound(c: MultiNodeCluster, pod: str) -> str:
    return str(((c.api.get("Pod", pod, NS) or {}).get("spec") or {}).get("nodeName") or "")


def test_a_workload_pod_is_bound_only_once_its_domain_is_ready_on_the_node() -> None:
    with MultiNodeCluster((1,), time_scale=0.1, interval_s=0.05, binding_conditions=True) as c:
        c.install_compute_domains()
        c.start_plugins(timeout_s=120)
        c.start_controller()
        node = next(iter(c.nodes.values()))
        channel = c.wait_for("the channel published", lambda: next(
            (d for s in c.api.objects("ResourceSlice") if s["spec"]["driver"] == DRIVER
             for d in s["spec"]["devices"] if d["name"] == "channel-0"), None), timeout_s=WAIT_S)
        assert channel["bindingConditions"] == [cd.BINDING_CONDITION] and channel["bindsToNode"] is True
        docs = [d for d in yaml.safe_load_all((FIXTURES / "channel-injection.yaml").read_text()) if d]
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("namespace", NS)
            c.api.create(doc)
        c.start()
        # held in PreBind: allocated on the node, the node labelled for its domain, not bound
        claim = c.wait_for("the workload claim allocated",
                           lambda: (cl := _claim_of(c, "imex-channel-injection")) is not None
                           and (cl.get("status") or {}).get("allocation") and cl, timeout_s=WAIT_S)
        result = claim["status"]["allocation"]["devices"]["results"][0]
        assert result["bindingConditions"] == [cd.BINDING_CONDITION]
        seen_unbound_while_waiting = False
        deadline = time.monotonic() + WAIT_S
        while not _bound(c, "imex-channel-injection"):
            ready = _condition(_claim_of(c, "imex-channel-injection"), cd.BINDING_CONDITION)
            if ready is None:
                seen_unbound_while_waiting = True
            assert time.monotonic() < deadline, "the workload pod was never bound"
            time.sleep(0.05)
        assert seen_unbound_while_waiting
        # what the prepare waits for holds at binding: this node's daemon of the domain says ready in its
        # readiness record (the prepare's first read)
        uid = node.labels()[cd.LABEL_COMPUTE_DOMAIN]
        record = imexchannels.read_readiness(imexchannels.domain_dir(c.plugin_config(node).plugin_dir, uid))
        assert record is not None and record.ready and record.node_name == node.name
        # bound only with the condition set, and its domain's daemon Ready on the node by then
        bound_claim = _claim_of(c, "imex-channel-injection")
        ready = _condition(bound_claim, cd.BINDING_CONDITION)
        assert ready is not None and ready["reason"] == "DomainReady"
        assert _bound(c, "imex-channel-injection") == node.name
        c.wait_for("the workload Pod running", lambda: c.pod_running("imex-channel-injection"), timeout_s=WAIT_S)
        assert node.pod_devices[f"{NS}/imex-channel-injection"].device_paths() == [
            "/dev/nvidia-caps-imex-channels/channel0"]


@pytest.fixture
def loop() -> Iterator[MultiNodeCluster]:
    """One node, no plugin: its channel slice published by hand with binding conditions, one pod with a claim;
    the control plane's passes are run by the test."""
    with MultiNodeCluster((1,), binding_conditions=True, binding_timeout_s=1.0) as c:
        name = next(iter(c.nodes))
        for obj in cd.plugin_resource_slices(name, DRIVER, daemon=False, binding_conditions=True):
            c.api.create(obj)
        c.api.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "channel"},
                      "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}})
        c.api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                      "metadata": {"name": "wl", "namespace": NS},
                      "spec": {"devices": {"requests": [{"name": "ch", "exactly": {"deviceClassName": "channel"}}]}}})
        c.api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wl", "namespace": NS},
                      "spec": {"containers": [{"name": "c", "image": "x"}],
                               "resourceClaims": [{"name": "ch", "resourceClaimName": "wl"}]}})
        yield c


def _allocation(c: MultiNodeCluster) -> dict[str, Any] | None:
    return ((c.api.get("ResourceClaim", "wl", NS) or {}).get("status") or {}).get("allocation")


def test_a_failure_condition_leaves_the_pod_unbound_deallocates_its_claim_and_schedules_it_again(
        loop: MultiNodeCluster) -> None:
    loop.reconcile_control_plane()
    assert _allocation(loop) is not None and not _bound(loop, "wl")
    claim = loop.api.get("ResourceClaim", "wl", NS)
    assert claim is not None
    first_at = claim["status"]["allocation"]["allocationTimestamp"]
    claim["status"]["devices"] = [{"driver": DRIVER, "pool": next(iter(loop.nodes)), "device": "channel-0",
                                   "conditions": [{"type": cd.BINDING_FAILURE_CONDITION, "status": "True",
                                                   "reason": "IMEXDaemonFailed", "message": "nvidia-imex exits",
                                                   "lastTransitionTime": first_at}]}]
    loop.api.update(claim, subresource="status")
    loop.reconcile_control_plane()
    assert _allocation(loop) is None and not _bound(loop, "wl")
    assert not (loop.api.get("ResourceClaim", "wl", NS) or {}).get("status", {}).get("devices")
    loop.wait_for("the pod scheduled again", lambda: (loop.reconcile_control_plane(), _allocation(loop))[1],
                  timeout_s=30)
    assert not _bound(loop, "wl")


def test_the_binding_timeout_leaves_the_pod_unbound_and_deallocates_its_claim(loop: MultiNodeCluster) -> None:
    loop.reconcile_control_plane()
    assert _allocation(loop) is not None and not _bound(loop, "wl")
    loop.wait_for("the binding timeout", lambda: (loop.reconcile_control_plane(), _allocation(loop) is None)[1],
                  timeout_s=30)
    assert not _bound(loop, "wl")


def test_with_the_gate_off_the_pod_is_not_scheduled_on_devices_with_binding_conditions() -> None:
    with MultiNodeCluster((1,)) as c:
        name = next(iter(c.nodes))
        for obj in cd.plugin_resource_slices(name, DRIVER, daemon=False, binding_conditions=True):
            c.api.create(obj)
        c.api.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "channel"},
                      "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}})
        c.api.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                      "metadata": {"name": "wl", "namespace": NS},
                      "spec": {"devices": {"requests": [{"name": "ch", "exactly": {"deviceClassName": "channel"}}]}}})
        c.api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wl", "namespace": NS},
                      "spec": {"containers": [{"name": "c", "image": "x"}],
                               "resourceClaims": [{"name": "ch", "resourceClaimName": "wl"}]}})
        c.reconcile_control_plane()
        assert _allocation(c) is None and not _bound(c, "wl")
