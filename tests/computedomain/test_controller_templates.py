"""The objects the controller makes for a ComputeDomain (domain/cdtemplates.py) against NVIDIA's contract
(nvidia-dra-driver.md 7.3): names, labels, finalizer, requests and opaque configs, and the IMEX daemon
DaemonSet's pod (nodeSelector, tolerations, ServiceAccount, command, env, probes, claim)."""

from __future__ import annotations

import pytest

from dradriver.domain.cdtemplates import (
    IMEX_MODE_HOST_MANAGED,
    ControllerSettings,
    daemon_claim_template,
    daemon_set,
    render_all_gates,
    workload_claim_template,
)
from dradriver.domain.computedomains import ComputeDomain
from dradriver.domain.featuregates import DEFAULT_GATES, GATES_BY_NAME

UID = "0b7e5c1a-5f0e-4d4b-9a35-2d8f0c3a1e77"
CD = ComputeDomain(name="job", namespace="team-a", uid=UID, num_nodes=2, template_name="job-channel",
                   allocation_mode="All")
SETTINGS = ControllerSettings(namespace="dradriver", image="registry.example/dradriver:1", log_verbosity=6,
                              max_nodes_per_imex_domain=8, pull_secrets=("regcred",))


def test_daemon_claim_template() -> None:
    rct = daemon_claim_template(CD, SETTINGS)
    assert rct["apiVersion"] == "resource.k8s.io/v1" and rct["kind"] == "ResourceClaimTemplate"
    assert rct["metadata"] == {"name": f"computedomain-daemon-{UID}", "namespace": "dradriver",
                               "finalizers": ["resource.nvidia.com/computeDomain"],
                               "labels": {"resource.nvidia.com/computeDomain": UID,
                                          "resource.nvidia.com/computeDomainTarget": "Daemon"}}
    assert rct["spec"]["spec"]["devices"] == {
        "requests": [{"name": "daemon", "exactly": {"deviceClassName": "compute-domain-daemon.nvidia.com"}}],
        "config": [{"requests": ["daemon"], "opaque": {"driver": "compute-domain.nvidia.com", "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainDaemonConfig", "domainID": UID}}}],
    }


def test_workload_claim_template() -> None:
    rct = workload_claim_template(CD, SETTINGS)
    assert (rct["metadata"]["name"], rct["metadata"]["namespace"]) == ("job-channel", "team-a")
    assert rct["metadata"]["labels"]["resource.nvidia.com/computeDomainTarget"] == "Workload"
    devices = rct["spec"]["spec"]["devices"]
    assert devices["requests"] == [{"name": "channel",
                                    "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"}}]
    assert devices["config"][0]["opaque"]["parameters"] == {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": UID,
        "allocationMode": "All"}
    host = ControllerSettings(namespace="dradriver", imex_mode=IMEX_MODE_HOST_MANAGED)
    assert workload_claim_template(CD, host)["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"][
        "allocationMode"] == "Single"


def test_daemon_set() -> None:
    ds = daemon_set(CD, SETTINGS)
    name = f"computedomain-daemon-{UID}"
    selector = {"resource.nvidia.com/computeDomain": UID}
    assert ds["metadata"] == {"name": name, "namespace": "dradriver",
                              "finalizers": ["resource.nvidia.com/computeDomain"], "labels": selector}
    assert ds["spec"]["selector"] == {"matchLabels": selector}
    assert ds["spec"]["template"]["metadata"]["labels"] == selector
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == selector  # only nodes where a workload channel was prepared
    assert pod["serviceAccountName"] == "compute-domain-daemon-service-account"
    assert pod["tolerations"] == [{"operator": "Exists", "effect": e}
                                  for e in ("NoSchedule", "NoExecute", "PreferNoSchedule")]
    assert pod["resourceClaims"] == [{"name": "compute-domain-daemon", "resourceClaimTemplateName": name}]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    [ctr] = pod["containers"]
    assert ctr["image"] == "registry.example/dradriver:1"
    assert ctr["command"] == ["compute-domain-daemon", "-v", "$(LOG_VERBOSITY)", "run"]
    assert ctr["resources"] == {"claims": [{"name": "compute-domain-daemon"}]}
    env = {e["name"]: e for e in ctr["env"]}
    assert list(env) == ["LOG_VERBOSITY", "MAX_NODES_PER_IMEX_DOMAIN", "NODE_NAME", "POD_IP", "POD_UID", "POD_NAME",
                         "POD_NAMESPACE", "NVIDIA_VISIBLE_DEVICES", "FEATURE_GATES"]
    assert env["LOG_VERBOSITY"]["value"] == "6" and env["MAX_NODES_PER_IMEX_DOMAIN"]["value"] == "8"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"
    gates = dict(pair.split("=") for pair in env["FEATURE_GATES"]["value"].split(","))
    assert set(gates) == set(GATES_BY_NAME)  # the full gate map, as NVIDIA passes it
    assert gates["ComputeDomainCliques"] == "true" and gates["IMEXDaemonsWithDNSNames"] == "true"
    check = {"exec": {"command": ["compute-domain-daemon", "check"]}, "timeoutSeconds": 10}
    assert ctr["startupProbe"] == {**check, "periodSeconds": 1, "failureThreshold": 1200}
    assert ctr["livenessProbe"] == {**check, "periodSeconds": 60, "failureThreshold": 20}
    assert ctr["readinessProbe"] == {**check, "periodSeconds": 10, "failureThreshold": 1}


def test_daemon_set_needs_driver_managed_mode_and_an_image() -> None:
    with pytest.raises(ValueError, match="host-managed"):
        daemon_set(CD, ControllerSettings(imex_mode=IMEX_MODE_HOST_MANAGED, image="x"))
    with pytest.raises(ValueError, match="IMAGE_NAME"):
        daemon_set(CD, ControllerSettings())


def test_render_all_gates_sorts_and_spells_booleans() -> None:
    text = render_all_gates(DEFAULT_GATES.with_gates(MPSSupport=True))
    pairs = text.split(",")
    assert pairs == sorted(pairs) and "MPSSupport=true" in pairs and "DynamicMIG=false" in pairs
