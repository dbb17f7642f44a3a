"""KEP-5007 binding conditions of the compute-domain plugin (``--binding-conditions``): the channels carry them in
the ResourceSlices, and the node's plugin sets ``ComputeDomainReady`` (or ``ComputeDomainFailed``) in the claim's
``status.devices`` once the domain is ready (or cannot be) on the node (the API emulator over HTTP, the plugin over
gRPC, the sandbox scheduler's PreBind)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from dradriver.domain.claims import ClaimRef
from dradriver.domain.computedomains import (
    BINDING_CONDITION,
    BINDING_FAILURE_CONDITION,
    IMEX_DAEMON_CONDITION,
    LABEL_COMPUTE_DOMAIN,
    REASON_IMEX_FAILED,
)
from dradriver.domain.featuregates import HOST_MANAGED_IMEX_DAEMON
from dradriver.sandbox import scheduler
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    DRIVER,
    DRIVER_NAMESPACE,
    GB200_CLIQUE,
    cd_config,
    node_label,
    running,
    seed_clique,
    seed_domain,
    wait_for,
    write_imex_proc,
)
from tests.computedomain.test_plugin_recovery import IMEX_CTL


@pytest.fixture
def node() -> Any:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        yield sandbox


def channel_class(api: ApiServerEmulator) -> None:
    api.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": "compute-domain-default-channel.nvidia.com"},
                "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}' && device.attributes["
                                                              f"'{DRIVER}'].type == 'channel'"}}]}})


def pending_claim(api: ApiServerEmulator, name: str, cd_uid: str) -> ClaimRef:
    """A channel claim as the controller's workload template makes it, not allocated yet."""
    claim = api.create({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {
            "requests": [{"name": "channel",
                          "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"}}],
            "config": [{"requests": ["channel"], "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig",
                "domainID": cd_uid, "allocationMode": "Single"}}}]}},
    })
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def device_entry(api: ApiServerEmulator, name: str) -> dict[str, Any]:
    stored = api.get("ResourceClaim", name, "default") or {}
    entries = [d for d in (stored.get("status") or {}).get("devices") or [] if d.get("device") == "channel-0"]
    return entries[0] if entries else {}


def condition(api: ApiServerEmulator, name: str, type_: str) -> dict[str, Any] | None:
    return next((c for c in device_entry(api, name).get("conditions") or [] if c.get("type") == type_), None)


def published_channel(api: ApiServerEmulator) -> dict[str, Any]:
    for s in api.objects("ResourceSlice"):
        if s["spec"]["driver"] == DRIVER:
            return next(d for d in s["spec"]["devices"] if d["name"] == "channel-0")
    raise AssertionError("no compute-domain ResourceSlice")


def test_with_the_option_off_channels_carry_no_binding_conditions_and_are_allocated_as_today(
        node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    channel_class(api)
    uid = seed_domain(api, "cd-off")
    ref = pending_claim(api, "wl-off", uid)

    async def body() -> None:
        async with running(cd_config(node)):
            channel = published_channel(api)
            assert not {"bindingConditions", "bindingFailureConditions", "bindsToNode"} & set(channel)
            [claim] = scheduler.allocate(api, [("default", ref.name)], node_name=node.node_name)
            [result] = claim["status"]["allocation"]["devices"]["results"]
            assert "bindingConditions" not in result
            assert scheduler.prebind(api, [("default", ref.name)]).state == "ready"

    asyncio.run(body())


def test_a_channel_claim_is_bound_only_once_its_domain_is_ready_and_its_prepare_does_not_wait(
        node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    channel_class(api)
    uid = seed_domain(api, "cd-ready")
    seed_clique(api, uid, node.node_name, "NotReady")
    ref = pending_claim(api, "wl-ready", uid)
    claims = [("default", ref.name)]

    async def body() -> None:
        async with running(cd_config(node, binding_conditions=True)) as (plugin, conn):
            channel = published_channel(api)
            assert channel["bindingConditions"] == [BINDING_CONDITION]
            assert channel["bindingFailureConditions"] == [BINDING_FAILURE_CONDITION]
            assert channel["bindsToNode"] is True
            with pytest.raises(scheduler.AllocationError, match="binding conditions"):
                scheduler.allocate(api, claims, node_name=node.node_name)  # the scheduler's gate off
            [claim] = scheduler.allocate(api, claims, node_name=node.node_name, binding_conditions=True)
            [result] = claim["status"]["allocation"]["devices"]["results"]
            assert result["bindingConditions"] == [BINDING_CONDITION]
            # the plugin labels the node for the domain (its daemon lands there) and waits for the daemon
            await wait_for(lambda: node_label(api) == uid)
            await asyncio.sleep(0.3)
            assert scheduler.prebind(api, claims).state == "waiting"
            assert condition(api, ref.name, BINDING_CONDITION) is None
            seed_clique(api, uid, node.node_name, "Ready")
            await wait_for(lambda: condition(api, ref.name, BINDING_CONDITION) is not None)
            written = condition(api, ref.name, BINDING_CONDITION)
            assert written is not None and (written["status"], written["reason"]) == ("True", "DomainReady")
            assert scheduler.prebind(api, claims).state == "ready"
            kubernetes_validate.validate(api.get("ResourceClaim", ref.name, "default"), "1.34", strict=True)
            # bound: the kubelet's prepare is answered at its first call
            answer = (await conn.prepare([ref]))[ref.uid]
            assert answer.ok, answer.error
            assert plugin.binding is not None and not plugin.binding.waiting()
            # the prepare's device status keeps the binding condition beside Ready
            await wait_for(lambda: condition(api, ref.name, "Ready") is not None)
            assert condition(api, ref.name, BINDING_CONDITION) is not None

    asyncio.run(body())


def test_a_failed_imex_daemon_sets_the_failure_condition_and_the_scheduler_deallocates_the_claim(
        node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    channel_class(api)
    uid = seed_domain(api, "cd-fail")
    seed_clique(api, uid, node.node_name, "NotReady")
    clique = api.get("ComputeDomainClique", f"{uid}.{GB200_CLIQUE}", DRIVER_NAMESPACE)
    assert clique is not None
    clique["daemons"][0]["conditions"] = [{
        "type": IMEX_DAEMON_CONDITION, "status": "False", "reason": REASON_IMEX_FAILED,
        "message": "nvidia-imex exited 8 times: cannot bind 10.0.0.1:50000",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    api.update(clique)
    ref = pending_claim(api, "wl-fail", uid)
    claims = [("default", ref.name)]
    pod_ref = {"resource": "pods", "name": "wl", "uid": "pod-uid-1"}

    async def body() -> None:
        async with running(cd_config(node, binding_conditions=True)):
            scheduler.allocate(api, claims, node_name=node.node_name, reserved_for=[pod_ref], binding_conditions=True)
            await wait_for(lambda: condition(api, ref.name, BINDING_FAILURE_CONDITION) is not None)
            failed = condition(api, ref.name, BINDING_FAILURE_CONDITION)
            assert failed is not None and (failed["status"], failed["reason"]) == ("True", REASON_IMEX_FAILED)
            assert "cannot bind 10.0.0.1:50000" in failed["message"]
            outcome = scheduler.prebind(api, claims)
            assert outcome.state == "failed" and "IMEXDaemonFailed" in outcome.message
            scheduler.unreserve(api, claims, pod_ref)
            stored = api.get("ResourceClaim", ref.name, "default")
            assert stored is not None and not (stored.get("status") or {}).get("allocation")
            # the plugin gives the node label of the abandoned claim up again
            await wait_for(lambda: node_label(api) is None)

    asyncio.run(body())


def test_a_node_serving_another_domain_sets_the_failure_condition_and_keeps_that_domains_label(
        node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    channel_class(api)
    other = seed_domain(api, "cd-other")
    uid = seed_domain(api, "cd-second")
    stored = api.get("Node", node.node_name)
    assert stored is not None
    stored["metadata"].setdefault("labels", {})[LABEL_COMPUTE_DOMAIN] = other
    api.update(stored)
    ref = pending_claim(api, "wl-second", uid)
    claims = [("default", ref.name)]

    async def body() -> None:
        async with running(cd_config(node, binding_conditions=True)):
            scheduler.allocate(api, claims, node_name=node.node_name, binding_conditions=True)
            await wait_for(lambda: condition(api, ref.name, BINDING_FAILURE_CONDITION) is not None)
            failed = condition(api, ref.name, BINDING_FAILURE_CONDITION)
            assert failed is not None and failed["reason"] == "NodeServesAnotherDomain"
            assert other in failed["message"] and "cd-second" in failed["message"]
            assert scheduler.prebind(api, claims).state == "failed"
            assert node_label(api) == other

    asyncio.run(body())


def test_host_managed_the_condition_is_set_once_the_hosts_imex_daemon_answers_ready(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    bin_dir = node.driver_root / "usr" / "bin"
    (bin_dir / "nvidia-imex-ctl").write_text(IMEX_CTL)
    (bin_dir / "nvidia-imex-ctl").chmod(0o755)
    channel_class(api)
    uid = seed_domain(api, "cd-host")
    ref = pending_claim(api, "wl-host", uid)
    claims = [("default", ref.name)]
    base = cd_config(node, binding_conditions=True)
    config = replace(base, imex_mode="hostManaged", imex_host_socket_path="/run/imex/ctl.sock",
                     feature_gates=base.feature_gates.with_gates(**{HOST_MANAGED_IMEX_DAEMON: True}))

    async def body() -> None:
        async with running(config) as (_plugin, conn):
            scheduler.allocate(api, claims, node_name=node.node_name, binding_conditions=True)
            await wait_for(lambda: (bin_dir / "asked").exists())  # asked, and not ready: nothing written
            assert scheduler.prebind(api, claims).state == "waiting"
            assert condition(api, ref.name, BINDING_CONDITION) is None
            (bin_dir / "ready").touch()
            await wait_for(lambda: condition(api, ref.name, BINDING_CONDITION) is not None)
            assert scheduler.prebind(api, claims).state == "ready"
            assert node_label(api) is None  # no label in host-managed mode
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.ok, got.error

    asyncio.run(body())


def test_pre_warmed_the_condition_is_set_once_the_cliques_daemon_is_ready_and_no_node_is_labelled(
        node: SandboxNode) -> None:
    """Pre-warmed IMEX: the clique's long-lived daemon serves every domain, so the binding condition waits for that
    daemon on this node (not for a domain's daemon), and the node is never labelled for the domain."""
    from dradriver.domain.computedomains import clique_domain_uid

    api = node.api
    assert api is not None
    channel_class(api)
    uid = seed_domain(api, "cd-warm")
    clique_uid = clique_domain_uid(GB200_CLIQUE)
    seed_clique(api, clique_uid, node.node_name, "NotReady")
    ref = pending_claim(api, "wl-warm", uid)
    claims = [("default", ref.name)]

    async def body() -> None:
        async with running(cd_config(node, binding_conditions=True, imex_mode="preWarmed")):
            scheduler.allocate(api, claims, node_name=node.node_name, binding_conditions=True)
            await asyncio.sleep(0.5)
            assert scheduler.prebind(api, claims).state == "waiting"
            assert condition(api, ref.name, BINDING_CONDITION) is None and node_label(api) is None
            seed_clique(api, clique_uid, node.node_name, "Ready")
            await wait_for(lambda: condition(api, ref.name, BINDING_CONDITION) is not None)
            written = condition(api, ref.name, BINDING_CONDITION)
            assert written is not None and (written["status"], written["reason"]) == ("True", "DomainReady")
            assert GB200_CLIQUE in written["message"] and node_label(api) is None
            assert scheduler.prebind(api, claims).state == "ready"

    asyncio.run(body())
