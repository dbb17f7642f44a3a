"""Pre-warmed IMEX (``--imex-mode preWarmed``, issue 35): the controller's clique DaemonSets and a domain's
objects, against the API emulator over HTTP (the end-to-end flow with plugins and daemons is
``test_e2e_prewarmed.py``), and the flags that select the mode."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from typing import Any

from dradriver.commands import compute_domain_controller as controller_command
from dradriver.computedomain.controller import ComputeDomainController
from dradriver.config import PluginConfig, pre_warmed_implied
from dradriver.domain.cdtemplates import (
    ANNOTATION_TEMPLATE_HASH,
    IMEX_MODE_PRE_WARMED,
    clique_daemon_set,
    clique_domain,
)
from dradriver.domain.computedomains import (
    ANNOTATION_IMEX_CHANNEL,
    FINALIZER,
    ISOLATED_CHANNEL_DEVICE_CLASS,
    LABEL_COMPUTE_DOMAIN,
    NODE_CLIQUE_LABEL,
    REASON_CLIQUE_DAEMON_NOT_READY,
    REASON_CLIQUE_DAEMON_READY,
    clique_domain_uid,
    daemon_object_name,
)
from dradriver.kube.client import KubeClient
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import (
    DRIVER_NAMESPACE,
    GB200_CLIQUE,
    cd_config,
    node_label,
    seed_claim,
    seed_clique,
    seed_domain,
    spec_path,
)
from tests.computedomain.cdplugin_helpers import running as plugin_running
from tests.computedomain.controller_helpers import (
    DRIVER_NS,
    GROUP,
    VERSION,
    clique_object,
    compute_domain,
    entry,
    running,
    settings,
    wait_for,
)

RACK1, RACK2 = "abc9829a-0000-4000-8000-000000000001.1", "abc9829a-0000-4000-8000-000000000001.2"


def _controller(client: KubeClient) -> ComputeDomainController:
    return ComputeDomainController(client, settings(imex_mode=IMEX_MODE_PRE_WARMED), status_period_s=0.05,
                                   node_check_s=0.05)


def _label(api: ApiServerEmulator, node: str, clique: str | None) -> None:
    obj = api.get("Node", node)
    assert obj is not None
    labels = obj["metadata"].setdefault("labels", {})
    if clique is None:
        labels.pop(NODE_CLIQUE_LABEL, None)
    else:
        labels[NODE_CLIQUE_LABEL] = clique
    api.update(obj)


def _clique_daemon_sets(api: ApiServerEmulator) -> dict[str, dict[str, Any]]:
    """Clique ID -> the live clique DaemonSet."""
    return {ds["spec"]["template"]["spec"]["nodeSelector"][NODE_CLIQUE_LABEL]: ds
            for ds in api.objects("DaemonSet", DRIVER_NS) if not ds["metadata"].get("deletionTimestamp")}


def test_the_pre_warmed_controller_runs_a_daemonset_per_clique_before_any_domain(api: ApiServerEmulator,
                                                                                client: KubeClient) -> None:
    _label(api, "node-a", RACK1)
    _label(api, "node-b", RACK1)
    _label(api, "node-c", RACK2)
    with running(_controller(client)):
        sets = wait_for(lambda: (found := _clique_daemon_sets(api)) and len(found) == 2 and found, "two DaemonSets")
    assert not api.objects("ComputeDomain")
    for clique in (RACK1, RACK2):
        ds, uid = sets[clique], clique_domain_uid(clique)
        expected = clique_daemon_set(clique, settings(imex_mode=IMEX_MODE_PRE_WARMED))
        assert ds["metadata"]["name"] == daemon_object_name(uid) and ds["spec"] == expected["spec"]
        assert ds["spec"]["template"]["spec"]["nodeSelector"] == {NODE_CLIQUE_LABEL: clique}
        assert ds["spec"]["template"]["metadata"]["labels"] == {LABEL_COMPUTE_DOMAIN: uid}
        template = api.get("ResourceClaimTemplate", daemon_object_name(uid), DRIVER_NS)
        assert template is not None
        params = template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
        assert params["domainID"] == uid  # the clique domain stands where a ComputeDomain's UID stands
    assert clique_domain(RACK1, settings()).uid == clique_domain_uid(RACK1) != clique_domain_uid(RACK2)


def test_pre_warmed_domains_get_their_own_channels_and_no_daemon_objects(api: ApiServerEmulator,
                                                                       client: KubeClient) -> None:
    _label(api, "node-a", RACK1)
    with running(_controller(client)):
        wait_for(lambda: _clique_daemon_sets(api), "the clique DaemonSet")
        for name in ("job-a", "job-b"):
            client.custom.create_namespaced_custom_object(GROUP, VERSION, "default", "computedomains",
                                                          compute_domain(name))
        templates = [wait_for(lambda n=n: api.get("ResourceClaimTemplate", f"{n}-channel", "default"), n)
                     for n in ("job-a", "job-b")]
        wait_for(lambda: all((api.get("ComputeDomain", n, "default") or {}).get("status", {}).get("status")
                             == "Ready" for n in ("job-a", "job-b")), "both Ready (no node yet: nothing to wait for)")
    channels = [int((api.get("ComputeDomain", n, "default") or {})["metadata"]["annotations"][ANNOTATION_IMEX_CHANNEL])
                for n in ("job-a", "job-b")]
    assert sorted(channels) == [1, 2]
    for template, channel in zip(templates, channels, strict=True):
        request = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
        assert request["deviceClassName"] == ISOLATED_CHANNEL_DEVICE_CLASS
        assert request["selectors"][0]["cel"]["expression"].endswith(f".id == {channel}")
        assert template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"] == "Single"
    assert len(api.objects("DaemonSet", DRIVER_NS)) == 1  # the clique's only: no DaemonSet per domain
    assert not [n for n in api.objects("Node") if LABEL_COMPUTE_DOMAIN in (n["metadata"].get("labels") or {})]


def test_a_clique_no_node_carries_any_more_loses_its_daemons(api: ApiServerEmulator, client: KubeClient) -> None:
    _label(api, "node-a", RACK1)
    _label(api, "node-c", RACK2)
    with running(_controller(client)):
        wait_for(lambda: len(_clique_daemon_sets(api)) == 2, "two DaemonSets")
        _label(api, "node-c", RACK1)  # the node moved: no node is in RACK2 any more
        wait_for(lambda: set(_clique_daemon_sets(api)) == {RACK1}, "RACK2's DaemonSet deleted")
        gone = daemon_object_name(clique_domain_uid(RACK2))
        wait_for(lambda: api.get("ResourceClaimTemplate", gone, DRIVER_NS) is None, "RACK2's daemon template deleted")
        ds = _clique_daemon_sets(api)[RACK1]
        api.delete("DaemonSet", ds["metadata"]["name"], DRIVER_NS)  # deleted by hand: made again
        wait_for(lambda: (now := _clique_daemon_sets(api).get(RACK1))
                 and now["metadata"]["uid"] != ds["metadata"]["uid"], "RACK1's DaemonSet made again")


def test_the_sweep_of_a_fresh_controller_keeps_the_clique_daemons(api: ApiServerEmulator, client: KubeClient) -> None:
    _label(api, "node-a", RACK1)
    _controller(client).ensure_clique_daemons()
    name = daemon_object_name(clique_domain_uid(RACK1))
    _controller(client).sweep()  # a new leader whose first clique pass has not run (or failed)
    assert api.get("DaemonSet", name, DRIVER_NS) is not None
    ComputeDomainController(client, settings()).sweep()  # switched to driver-managed: the clique daemons are stale
    assert api.get("DaemonSet", name, DRIVER_NS) is None


def test_pre_warmed_mode_implies_channel_isolation_and_the_clique_label() -> None:
    config = pre_warmed_implied(replace(PluginConfig(node_name="n"), imex_mode="preWarmed"))
    assert (config.imex_isolation, config.gpu_clique_label_enabled) == ("channel", True)
    assert pre_warmed_implied(PluginConfig(node_name="n")).imex_isolation == "domain"
    args = argparse.Namespace(**{f.dest: f.default for f in controller_command.FLAGS})
    args.image_name, args.log_verbosity_cd_daemon, args.imex_mode = "img", 4, "preWarmed"
    made = controller_command.config_from_args(args)
    assert made.settings.pre_warmed and made.settings.channel_isolation and not made.settings.domain_daemons


# -- the plugin ----------------------------------------------------------------------------------------------------


def _give_channel(api: ApiServerEmulator, name: str, channel: int) -> None:
    """What the controller writes (tested above against the controller itself)."""
    obj = api.get("ComputeDomain", name, "default")
    assert obj is not None
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_IMEX_CHANNEL] = str(channel)
    api.update(obj)


def test_a_pre_warmed_channel_claim_waits_only_for_the_clique_daemon_of_its_node(imex_node: SandboxNode) -> None:
    api = imex_node.api
    assert api is not None
    clique_uid = clique_domain_uid(GB200_CLIQUE)
    uid_a, uid_b = seed_domain(api, "job-a"), seed_domain(api, "job-b")
    _give_channel(api, "job-a", 1)
    _give_channel(api, "job-b", 2)
    claim_a = seed_claim(api, "wl-a", uid_a, device="channel-1")
    claim_b = seed_claim(api, "wl-b", uid_b, device="channel-2")
    daemon = seed_claim(api, "clique-daemon", clique_uid, namespace=DRIVER_NAMESPACE, kind="daemon")
    config = cd_config(imex_node, imex_mode="preWarmed", prepare_deadline_seconds=1)

    async def body() -> None:
        async with plugin_running(config) as (plugin, conn):
            waiting = (await conn.prepare([claim_a]))[claim_a.uid]
            assert f"the pre-warmed IMEX daemon of clique {GB200_CLIQUE} on node {imex_node.node_name} is not " \
                   f"Ready (ComputeDomain default/job-a; ComputeDomainClique {DRIVER_NAMESPACE}/{clique_uid}." \
                   f"{GB200_CLIQUE}: no entry for this node)" in waiting.error
            got_daemon = (await conn.prepare([daemon]))[daemon.uid]  # the clique daemon's own claim
            assert got_daemon.ok, got_daemon.error
            seed_clique(api, clique_uid, imex_node.node_name, "Ready")
            got = await conn.prepare([claim_a, claim_b])
            assert got[claim_a.uid].ok and got[claim_b.uid].ok, (got[claim_a.uid].error, got[claim_b.uid].error)
            assert node_label(api) is None  # two domains on the node, no per-domain label
            assert (await conn.unprepare([claim_a, claim_b, daemon])).keys() >= {claim_a.uid, claim_b.uid}
            await asyncio.to_thread(plugin.refresh)  # the 10-minute cleanup between two clique daemon pods
            assert (config.plugin_dir / "domains" / clique_uid).is_dir()  # no ComputeDomain has the ID: kept

    asyncio.run(body())
    assert not spec_path(imex_node, claim_a.uid).exists()  # unprepared


def test_a_full_pass_reports_each_domain_node_and_reads_the_fleet_once(api: ApiServerEmulator,
                                                                       client: KubeClient) -> None:
    _label(api, "node-a", RACK1)
    clique_uid = clique_domain_uid(RACK1)
    api.create(clique_object(clique_uid, [entry("node-a", "10.0.0.1", 0, clique=RACK1)], clique=RACK1))
    for i in range(4):
        made = client.custom.create_namespaced_custom_object(GROUP, VERSION, "default", "computedomains",
                                                             {**compute_domain(f"job-{i}"), "metadata": {
                                                                 "name": f"job-{i}", "finalizers": [FINALIZER]}})
        seed_claim(api, f"wl-{i}", made["metadata"]["uid"], device=f"channel-{i + 1}", pool="node-a")
    controller = _controller(client)
    api.clear_requests()
    controller.sync_all_status()
    for i in range(4):
        (node,) = (api.get("ComputeDomain", f"job-{i}", "default") or {})["status"]["nodes"]
        assert (node["name"], node["cliqueID"], node["index"], node["status"]) == ("node-a", RACK1, 0, "Ready")
        assert node["conditions"][0]["reason"] == REASON_CLIQUE_DAEMON_READY
    assert api.count("list", "resourceclaims") == 1  # one namespace, one list for the four domains
    assert api.count("list", "nodes") <= 2  # the node check's and the domains' (not one per domain)
    assert api.count("get", "computedomaincliques") == 1
    stored = api.get("ComputeDomainClique", f"{clique_uid}.{RACK1}", DRIVER_NS)
    assert stored is not None
    stored["daemons"][0]["status"] = "NotReady"  # the clique daemon on node-a restarts
    api.update(stored)
    controller.sync_all_status()
    status = (api.get("ComputeDomain", "job-0", "default") or {})["status"]
    assert status["status"] == "NotReady"
    assert status["nodes"][0]["conditions"][0]["reason"] == REASON_CLIQUE_DAEMON_NOT_READY
    warnings = [e for e in api.objects("Event", "default") if e.get("reason") == REASON_CLIQUE_DAEMON_NOT_READY]
    assert sorted(e["involvedObject"]["name"] for e in warnings) == [f"job-{i}" for i in range(4)]
    assert all(e["type"] == "Warning" and "node-a" in e["message"] for e in warnings)


def test_an_upgraded_controller_updates_the_clique_daemonset_once(api: ApiServerEmulator, client: KubeClient) -> None:
    _label(api, "node-a", RACK1)
    name = daemon_object_name(clique_domain_uid(RACK1))
    _controller(client).ensure_clique_daemons()
    old = api.get("DaemonSet", name, DRIVER_NS)
    assert old is not None
    upgraded = ComputeDomainController(client, settings(imex_mode=IMEX_MODE_PRE_WARMED, image="registry.example/new:2"))
    upgraded.ensure_clique_daemons()
    new = api.get("DaemonSet", name, DRIVER_NS)
    assert new is not None and new["metadata"]["uid"] == old["metadata"]["uid"]  # updated in place: a rolling update
    assert new["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/new:2"
    assert new["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH] != old["metadata"]["annotations"][
        ANNOTATION_TEMPLATE_HASH]
    upgraded.ensure_clique_daemons()  # nothing changed since: no write
    again = api.get("DaemonSet", name, DRIVER_NS)
    assert again is not None and again["metadata"]["resourceVersion"] == new["metadata"]["resourceVersion"]
