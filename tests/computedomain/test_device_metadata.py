"""KEP-5304 device metadata on the compute-domain plugin (``DeviceMetadata`` gate): an IMEX channel claim's file names
its ComputeDomain, mounted by the claim spec the compiled channel generator renders; an IMEX daemon claim's file
names its ComputeDomain too, mounted beside the daemon's own edits."""

from __future__ import annotations

import asyncio

from dradriver.domain import devicemetadata as dm
from dradriver.domain.featuregates import FeatureGates
from dradriver.host.devicemetadata import SUBDIR
from dradriver.sandbox.node import SandboxNode
from tests.cdi.helpers import read_mounted_metadata, validate
from tests.computedomain.cdplugin_helpers import (
    DRIVER,
    DRIVER_NAMESPACE,
    cd_config,
    running,
    seed_claim,
    seed_clique,
    seed_domain,
    spec_path,
)


def test_channel_claim_metadata_names_its_compute_domain(imex_node: SandboxNode) -> None:
    node = imex_node
    api = node.api
    assert api is not None
    uid = seed_domain(api, "train-domain", "team-a")
    seed_clique(api, uid, node.node_name, "Ready")
    ref = seed_claim(api, "wl-0", uid, namespace="team-a")
    config = cd_config(node, feature_gates=FeatureGates({"DeviceMetadata": True}))

    async def body() -> None:
        async with running(config) as (_plugin, conn):
            assert (await conn.prepare([ref]))[ref.uid].error == ""
            spec = validate(spec_path(node, ref.uid).read_bytes())
            [mount] = dm.spec_mounts(spec)["*"]  # the claim's one channel device: spec-level edits
            assert mount["containerPath"] == ("/var/run/kubernetes.io/dra-device-attributes/resourceclaims/wl-0/"
                                              f"channel/{DRIVER}-metadata.json")
            doc = read_mounted_metadata(mount)[0]
            assert doc["metadata"]["name"] == "wl-0" and doc["metadata"]["namespace"] == "team-a"
            [request] = doc["requests"]
            [device] = request["devices"]
            assert (request["name"], device["driver"], device["name"]) == ("channel", DRIVER, "channel-0")
            attrs = device["attributes"]
            assert attrs["type"] == {"string": "channel"} and attrs["id"] == {"int": 0}  # as published
            assert attrs["computeDomainUID"] == {"string": uid}
            assert attrs["computeDomainNamespace"] == {"string": "team-a"}
            assert attrs["computeDomainName"] == {"string": "train-domain"}
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            assert list((config.plugin_dir / SUBDIR).iterdir()) == []

    asyncio.run(body())


def test_imex_daemon_claim_metadata_names_its_compute_domain(imex_node: SandboxNode) -> None:
    node = imex_node
    api = node.api
    assert api is not None
    uid = seed_domain(api, "train-domain", "team-a")
    seed_clique(api, uid, node.node_name, "NotReady")  # the daemon claim does not wait for its own readiness
    ref = seed_claim(api, "daemon", uid, namespace=DRIVER_NAMESPACE, kind="daemon")
    config = cd_config(node, feature_gates=FeatureGates({"DeviceMetadata": True}))

    async def body() -> None:
        async with running(config) as (_plugin, conn):
            got = (await conn.prepare([ref]))[ref.uid]
            assert got.error == "", got.error
            spec = validate(spec_path(node, ref.uid).read_bytes())
            mounts = dm.spec_mounts(spec)
            [[mount]] = mounts.values()
            assert mount["containerPath"] == ("/var/run/kubernetes.io/dra-device-attributes/resourceclaims/daemon/"
                                              f"daemon/{DRIVER}-metadata.json")
            doc = read_mounted_metadata(mount)[0]
            assert doc["metadata"]["name"] == "daemon" and doc["metadata"]["namespace"] == DRIVER_NAMESPACE
            [request] = doc["requests"]
            [device] = request["devices"]
            assert (request["name"], device["driver"], device["name"]) == ("daemon", DRIVER, "daemon-0")
            attrs = device["attributes"]
            assert attrs["type"] == {"string": "daemon"}  # as published
            assert attrs["computeDomainUID"] == {"string": uid}
            assert attrs["computeDomainNamespace"] == {"string": "team-a"}
            assert attrs["computeDomainName"] == {"string": "train-domain"}
            assert (await conn.unprepare([ref]))[ref.uid] == ""
            assert list((config.plugin_dir / SUBDIR).iterdir()) == []

    asyncio.run(body())
