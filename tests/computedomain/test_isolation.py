"""``--imex-isolation channel`` (host-managed IMEX): several ComputeDomains on one node, each with its own IMEX
channel (issue 14). The plugin runs behind the kubelet emulator (real gRPC) against the API emulator; the controller
runs against it over real HTTP."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dradriver.app.computedomain import start_compute_domain_plugin
from dradriver.computedomain.controller import ComputeDomainController
from dradriver.config import CHANNEL_NEEDS_HOST_MANAGED, PluginConfig
from dradriver.domain.cdtemplates import IMEX_ISOLATION_CHANNEL, IMEX_MODE_HOST_MANAGED
from dradriver.domain.computedomains import (
    ANNOTATION_IMEX_CHANNEL,
    ISOLATED_CHANNEL_DEVICE_CLASS,
    ComputeDomainError,
    choose_channel,
    plugin_resource_slices,
)
from dradriver.domain.featuregates import DEFAULT_GATES, HOST_MANAGED_IMEX_DAEMON
from dradriver.domain.resourceslices import limit_violations
from dradriver.errors import FlagError
from dradriver.kube.client import KubeClient
from dradriver.preparers.computedomain import CHANNEL_KIND
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.node import SandboxNode
from tests.cdi.helpers import validate
from tests.computedomain.cdplugin_helpers import (
    DRIVER,
    cd_config,
    node_label,
    running,
    seed_claim,
    seed_domain,
    spec_path,
    write_imex_proc,
)
from tests.computedomain.controller_helpers import (
    GROUP,
    VERSION,
    compute_domain,
    settings,
)

IMEX_CTL_READY = "#!/bin/sh\necho READY\n"
"""``nvidia-imex-ctl -q`` of a host whose IMEX daemon is up."""


@pytest.fixture
def node() -> Any:
    with SandboxNode(profile="gb200-nvl72-node") as sandbox:
        write_imex_proc(sandbox)
        ctl = sandbox.driver_root / "usr" / "bin" / "nvidia-imex-ctl"
        ctl.write_text(IMEX_CTL_READY)
        ctl.chmod(0o755)
        yield sandbox


def _isolated(node: SandboxNode, **overrides: Any) -> PluginConfig:
    base = cd_config(node, **overrides)
    return replace(base, imex_mode="hostManaged", imex_isolation="channel",
                   feature_gates=base.feature_gates.with_gates(**{HOST_MANAGED_IMEX_DAEMON: True}))


def _namespace(api: ApiServerEmulator, name: str) -> None:
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}, "status": {"phase": "Active"}})


def _give_channel(api: ApiServerEmulator, name: str, namespace: str, channel: int) -> None:
    """What the controller writes (tested below against the controller itself)."""
    obj = api.get("ComputeDomain", name, namespace)
    assert obj is not None
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_IMEX_CHANNEL] = str(channel)
    api.update(obj)


def _spec_minors(node: SandboxNode, uid: str) -> list[int]:
    spec = validate(spec_path(node, uid).read_bytes())
    return [n["minor"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]


def test_two_domains_from_two_namespaces_share_a_node_each_with_its_own_channel(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    for ns in ("team-a", "team-b"):
        _namespace(api, ns)
    uid_a = seed_domain(api, "job-a", "team-a")
    uid_b = seed_domain(api, "job-b", "team-b")
    uid_c = seed_domain(api, "job-c", "team-b")
    _give_channel(api, "job-a", "team-a", 1)
    _give_channel(api, "job-b", "team-b", 2)
    _give_channel(api, "job-c", "team-b", 1)  # a hand-edited annotation colliding with job-a's
    claim_a = seed_claim(api, "wl-a", uid_a, namespace="team-a", device="channel-1")
    claim_b = seed_claim(api, "wl-b", uid_b, namespace="team-b", device="channel-2")
    wrong = seed_claim(api, "wl-b-wrong", uid_b, namespace="team-b", device="channel-3")
    stolen = seed_claim(api, "wl-c", uid_c, namespace="team-b", device="channel-1")
    uid_d = seed_domain(api, "job-d", "team-a")
    _give_channel(api, "job-d", "team-a", 4)
    every = seed_claim(api, "wl-all", uid_d, namespace="team-a", device="channel-4", mode="All")
    config = _isolated(node, prepare_deadline_seconds=2)

    async def body() -> None:
        async with running(config) as (_plugin, conn):
            published = [s for s in api.objects("ResourceSlice") if s["spec"]["driver"] == DRIVER]
            assert len(published) == 2048 // 128
            assert all(s["spec"]["pool"]["resourceSliceCount"] == 16 for s in published)
            assert all(limit_violations(s) == [] for s in published)
            names = {d["name"] for s in published for d in s["spec"]["devices"]}
            assert names == {f"channel-{n}" for n in range(2048)}  # no daemon-0 in host-managed mode
            got = await conn.prepare([claim_a, claim_b])
            assert got[claim_a.uid].ok and got[claim_b.uid].ok, (got[claim_a.uid].error, got[claim_b.uid].error)
            assert _spec_minors(node, claim_a.uid) == [1]  # only its own channel's node
            assert _spec_minors(node, claim_b.uid) == [2]
            assert node_label(api) is None  # several domains, no node label conflict
            refused = await conn.prepare([wrong, stolen, every])
            assert refused[wrong.uid].error == (
                f"claim team-b/wl-b-wrong (uid {wrong.uid}): status.allocation.devices.results: device 'channel-3' "
                "is not the IMEX channel of ComputeDomain team-b/job-b (channel-2, annotation "
                "resource.nvidia.com/imexChannel); --imex-isolation channel gives a domain's pods its own channel "
                "only")
            # a channel is prepared for one claim at a time on a node (the claim state knows its holder)
            assert (f"device 'channel-1' is already prepared for claim team-a/wl-a (uid {claim_a.uid})"
                    ) in refused[stolen.uid].error
            assert "allocationMode: 'All' would give every IMEX channel" in refused[every.uid].error
            assert not spec_path(node, stolen.uid).exists()

        # a restarted plugin reads domain -> channel back from its claim state and still refuses the collision
        async with running(config) as (plugin, conn):
            held = {uid: (r.data["domain"], r.data["channel"], r.data["channels"])
                    for uid, r in plugin.runner.stored_records(CHANNEL_KIND, "")}
            assert held == {claim_a.uid: (uid_a, 1, [1]), claim_b.uid: (uid_b, 2, [2])}
            again = await conn.prepare([stolen, claim_a])
            assert "is already prepared for claim team-a/wl-a" in again[stolen.uid].error
            assert again[claim_a.uid].ok and _spec_minors(node, claim_a.uid) == [1]
            assert (await conn.unprepare([claim_a]))[claim_a.uid] == ""
            after = await conn.prepare([stolen])  # job-a left the node: channel 1 is free for job-c here
            assert after[stolen.uid].ok, after[stolen.uid].error

    asyncio.run(body())


def test_a_domain_without_a_channel_yet_is_retried_not_refused(node: SandboxNode) -> None:
    api = node.api
    assert api is not None
    uid = seed_domain(api, "late")
    ref = seed_claim(api, "wl-late", uid, device="channel-1")

    async def body() -> None:
        async with running(_isolated(node, prepare_deadline_seconds=1)) as (_plugin, conn):
            waiting = (await conn.prepare([ref]))[ref.uid]
            assert "ComputeDomain default/late has no IMEX channel yet (annotation " \
                   "resource.nvidia.com/imexChannel, written by the controller)" in waiting.error
            _give_channel(api, "late", "default", 1)
            assert (await conn.prepare([ref]))[ref.uid].ok

    asyncio.run(body())


def test_channel_isolation_with_driver_managed_imex_is_refused_at_start(node: SandboxNode) -> None:
    config = replace(cd_config(node), imex_isolation="channel")
    with pytest.raises(FlagError) as refused:
        asyncio.run(start_compute_domain_plugin(config))
    assert str(refused.value) == CHANNEL_NEEDS_HOST_MANAGED
    assert "that daemon owns the node's IMEX" in str(refused.value)


def test_slices_keep_the_api_limits_and_nvidia_shape_by_default() -> None:
    (one,) = plugin_resource_slices("n1", DRIVER, daemon=True)
    assert [d["name"] for d in one["spec"]["devices"]] == ["channel-0", "daemon-0"]
    many = plugin_resource_slices("n1", DRIVER, daemon=True, channels=300)
    assert [len(s["spec"]["devices"]) for s in many] == [128, 128, 45]
    assert many[-1]["spec"]["devices"][-1]["name"] == "daemon-0"
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in many} == {3}
    with pytest.raises(ComputeDomainError, match="at least channel 0"):
        plugin_resource_slices("n1", DRIVER, daemon=False, channels=0)


def test_choose_channel_skips_zero_and_fills_gaps() -> None:
    assert choose_channel([]) == 1
    assert choose_channel([1, 2, 4]) == 3
    with pytest.raises(ComputeDomainError, match=r"all 3 channels 1\.\.3 belong to live ComputeDomains"):
        choose_channel([1, 2, 3], count=4)


# -- controller --------------------------------------------------------------------------------------------------


def _controller(client: KubeClient) -> ComputeDomainController:
    return ComputeDomainController(client, settings(imex_mode=IMEX_MODE_HOST_MANAGED,
                                                    imex_isolation=IMEX_ISOLATION_CHANNEL,
                                                    feature_gates=DEFAULT_GATES.with_gates(HostManagedIMEXDaemon=True)))


def _channel_of(api: ApiServerEmulator, name: str, namespace: str) -> str:
    obj = api.get("ComputeDomain", name, namespace)
    assert obj is not None
    return str(obj["metadata"]["annotations"][ANNOTATION_IMEX_CHANNEL])


def _selector(api: ApiServerEmulator, template: str, namespace: str) -> tuple[str, list[str]]:
    rct = api.get("ResourceClaimTemplate", template, namespace)
    assert rct is not None
    (request,) = rct["spec"]["spec"]["devices"]["requests"]
    return request["exactly"]["deviceClassName"], [s["cel"]["expression"] for s in request["exactly"]["selectors"]]


def test_controller_gives_distinct_channels_and_keeps_them_across_a_restart(api: ApiServerEmulator,
                                                                            client: KubeClient) -> None:
    for ns in ("team-a", "team-b"):
        _namespace(api, ns)
    for name, ns in (("job-a", "team-a"), ("job-b", "team-b")):
        client.custom.create_namespaced_custom_object(GROUP, VERSION, ns, "computedomains", compute_domain(name))
    first = _controller(client)
    first.reconcile(("team-a", "job-a"))
    first.reconcile(("team-b", "job-b"))
    assert (_channel_of(api, "job-a", "team-a"), _channel_of(api, "job-b", "team-b")) == ("1", "2")
    assert _selector(api, "job-a-channel", "team-a") == (
        ISOLATED_CHANNEL_DEVICE_CLASS, ["device.attributes['compute-domain.nvidia.com'].id == 1"])
    assert _selector(api, "job-b-channel", "team-b")[1] == ["device.attributes['compute-domain.nvidia.com'].id == 2"]
    # a new controller (restart, new leader) reads the IDs back and gives a new domain the next free one
    client.custom.create_namespaced_custom_object(GROUP, VERSION, "team-a", "computedomains",
                                                  compute_domain("job-c"))
    second = _controller(client)
    for key in (("team-b", "job-b"), ("team-a", "job-c"), ("team-a", "job-a")):
        second.reconcile(key)
    assert [_channel_of(api, n, ns) for n, ns in (("job-a", "team-a"), ("job-b", "team-b"),
                                                   ("job-c", "team-a"))] == ["1", "2", "3"]


def test_the_workload_template_selects_the_domains_channel_from_the_published_slices() -> None:
    """The scheduler's view (dradriver's allocator, the reference's algorithm): a claim made from two domains'
    templates against two nodes' slices gets each domain's own channel on both nodes."""
    import yaml

    from dradriver.allocator.allocation import Allocator
    from dradriver.allocator.resources import parse_claim, parse_device_class, parse_slice
    from dradriver.domain.cdtemplates import workload_claim_template
    from dradriver.domain.computedomains import ComputeDomain

    manifests = Path(__file__).resolve().parents[2] / "deploy" / "kustomize" / "base" / "deviceclasses.yaml"
    classes = {c["metadata"]["name"]: parse_device_class(c) for c in yaml.safe_load_all(manifests.read_text()) if c}
    slices = [parse_slice(s) for node in ("node-a", "node-b")
              for s in plugin_resource_slices(node, DRIVER, daemon=False, channels=2048)]
    isolated = settings(imex_mode=IMEX_MODE_HOST_MANAGED, imex_isolation=IMEX_ISOLATION_CHANNEL)
    allocator = Allocator(slices, classes)
    for name, channel in (("job-a", 1), ("job-b", 2)):
        cd = ComputeDomain(name=name, namespace="default", uid=f"uid-{name}", template_name=f"{name}-channel")
        template = workload_claim_template(cd, isolated, channel)
        for node in ("node-a", "node-b"):
            claim = parse_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                 "metadata": {"name": f"{name}-{node}", "namespace": "default"},
                                 "spec": template["spec"]["spec"]})
            _node, (allocation,) = allocator.allocate([claim], node)
            assert [r["device"] for r in allocation["devices"]["results"]] == [f"channel-{channel}"]
