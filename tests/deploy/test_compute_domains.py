"""deploy/ for ComputeDomains: the CRDs and DeviceClasses in the base, and overlays/compute-domains -- the
controller Deployment against the controller's flags, its least-privilege RBAC, the IMEX daemons'
ServiceAccount (the name the controller's DaemonSets use), and the compute-domain kubelet plugin container."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from dradriver.app.computedomaincontroller import ControllerConfig
from dradriver.commands import compute_domain_controller
from dradriver.config import add_flags
from dradriver.domain.computedomains import CHANNEL_DEVICE_CLASS, DAEMON_DEVICE_CLASS, DAEMON_SERVICE_ACCOUNT
from dradriver.server.probe import READINESS_SERVICE
from tests.deploy.manifests import container, find, one, render

OVERLAY = "overlays/compute-domains"
CONTROLLER = "dradriver-compute-domain-controller"


def _env(ctr: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in ctr.get("env") or []}


def _controller_container() -> dict[str, Any]:
    deployment = one(render(OVERLAY), "Deployment", CONTROLLER)
    [ctr] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(ctr)


def _rules(kind: str, name: str) -> set[tuple[str, str, tuple[str, ...]]]:
    role = one(render(OVERLAY), kind, name)
    return {(group, resource, tuple(sorted(rule["verbs"]))) for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]}


def test_the_base_has_the_crds_and_device_classes_of_compute_domains() -> None:
    objs = render("base")
    crds = {c["metadata"]["name"]: c for c in find(objs, "CustomResourceDefinition")}
    assert set(crds) == {"computedomains.resource.nvidia.com", "computedomaincliques.resource.nvidia.com"}
    cd = crds["computedomains.resource.nvidia.com"]["spec"]
    assert cd["scope"] == "Namespaced" and cd["versions"][0]["subresources"] == {"status": {}}
    spec = cd["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["x-kubernetes-validations"] == [{"rule": "self == oldSelf",
                                                 "message": "A computeDomain.spec is immutable"}]
    assert spec["properties"]["numNodes"]["default"] == 0
    assert spec["properties"]["channel"]["properties"]["allocationMode"]["default"] == "Single"
    status = cd["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["nodes"]["x-kubernetes-list-map-keys"] == ["name"]
    clique = crds["computedomaincliques.resource.nvidia.com"]["spec"]["versions"][0]
    assert "subresources" not in clique
    assert clique["schema"]["openAPIV3Schema"]["properties"]["daemons"]["x-kubernetes-list-map-keys"] == [
        "nodeName"]
    assert {c["metadata"]["name"] for c in find(objs, "DeviceClass")} >= {CHANNEL_DEVICE_CLASS, DAEMON_DEVICE_CLASS}


def test_controller_env_names_are_exactly_its_flag_twins() -> None:
    env = _env(_controller_container())
    assert set(env) == {flag.env for flag in compute_domain_controller.FLAGS}
    downward = {"POD_NAME": "metadata.name", "NAMESPACE": "metadata.namespace",
                "LEADER_ELECTION_LEASE_LOCK_NAMESPACE": "metadata.namespace"}
    for name, entry in env.items():
        if name in downward:
            assert entry["valueFrom"] == {"fieldRef": {"fieldPath": downward[name]}}, name
        else:
            assert isinstance(entry["value"], str), name


def test_controller_env_values_parse_into_a_controller_config(monkeypatch: pytest.MonkeyPatch) -> None:
    ctr = _controller_container()
    values = {"POD_NAME": "dradriver-compute-domain-controller-x", "NAMESPACE": "dradriver",
              "LEADER_ELECTION_LEASE_LOCK_NAMESPACE": "dradriver"}
    environ = {name: values.get(name, entry.get("value", "")) for name, entry in _env(ctr).items()}
    parser = argparse.ArgumentParser()
    add_flags(parser, compute_domain_controller.FLAGS, environ=environ)
    cfg = compute_domain_controller.config_from_args(parser.parse_args([]))
    assert isinstance(cfg, ControllerConfig)
    assert cfg.leader_election is True and cfg.lease_name == CONTROLLER
    assert (cfg.lease_duration_s, cfg.renew_deadline_s, cfg.retry_period_s) == (15.0, 10.0, 2.0)
    assert cfg.settings.image == ctr["image"] == "dradriver:0.1.0"  # the daemons run the controller's image
    assert cfg.settings.namespace == "dradriver" and cfg.settings.max_nodes_per_imex_domain == 18
    assert ctr["command"] == ["dradriver", "compute-domain-controller"]


def test_controller_runs_two_replicas_unprivileged_as_its_service_account() -> None:
    deployment = one(render(OVERLAY), "Deployment", CONTROLLER)
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == CONTROLLER
    sc = pod["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == [
        "ALL"]


def test_controller_rbac_is_least_privilege() -> None:
    assert _rules("ClusterRole", CONTROLLER) == {
        ("resource.nvidia.com", "computedomains", ("get", "list", "update", "watch")),
        ("resource.nvidia.com", "computedomains/status", ("patch", "update")),  # the status is a merge patch
        # an earlier install's objects in another namespace, and the daemon pods a deleted domain waits for
        ("apps", "daemonsets", ("delete", "get", "list", "update")),
        ("", "pods", ("list",)),
        ("resource.nvidia.com", "computedomaincliques", ("delete", "list")),
        ("resource.k8s.io", "resourceclaimtemplates", ("create", "delete", "get", "list", "update", "watch")),
        ("", "nodes", ("get", "list", "patch")),
        ("coordination.k8s.io", "leases", ("list",)),  # the kubelets' heartbeats in kube-node-lease
        # pre-warmed IMEX: each domain's nodes from its allocated claims, an Event per change of a node's daemon
        ("resource.k8s.io", "resourceclaims", ("list",)),
        ("", "events", ("create",)),
    }
    assert _rules("Role", CONTROLLER) == {
        ("apps", "daemonsets", ("create", "delete", "get", "list", "update", "watch")),
        ("", "pods", ("list", "watch")),
        ("resource.nvidia.com", "computedomaincliques", ("delete", "get", "list", "patch", "update", "watch")),
        ("coordination.k8s.io", "leases", ("create", "get", "update")),
    }
    role = one(render(OVERLAY), "Role", CONTROLLER)
    binding = one(render(OVERLAY), "RoleBinding", CONTROLLER)
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "dradriver"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": "dradriver"}]


def test_the_daemons_service_account_is_the_one_the_daemonsets_name() -> None:
    objs = render(OVERLAY)
    sa = one(objs, "ServiceAccount", DAEMON_SERVICE_ACCOUNT)
    assert sa["metadata"]["namespace"] == "dradriver"
    assert _rules("Role", "dradriver-compute-domain-daemon") == {
        ("resource.nvidia.com", "computedomaincliques", ("create", "get", "list", "patch", "update", "watch")),
        ("", "pods", ("get", "patch")),
    }
    assert _rules("ClusterRole", "dradriver-compute-domain-daemon") == {
        ("resource.nvidia.com", "computedomains", ("get",)),
        ("resource.nvidia.com", "computedomains/status", ("get", "update")),
        ("", "events", ("create",)),  # IMEXDaemonFailed / IMEXDaemonRunning about its ComputeDomain
    }
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        binding = one(objs, kind, "dradriver-compute-domain-daemon")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": DAEMON_SERVICE_ACCOUNT,
                                        "namespace": "dradriver"}]


def test_the_compute_domain_plugin_runs_beside_the_gpu_plugin() -> None:
    ds = one(render(OVERLAY), "DaemonSet")
    assert sorted(c["name"] for c in ds["spec"]["template"]["spec"]["containers"]) == ["compute-domains", "gpus"]
    ctr = container(ds, "compute-domains")
    assert ctr["command"] == ["dradriver", "compute-domain-kubelet-plugin"]
    env = _env(ctr)
    nvidia_names = {"NODE_NAME", "NAMESPACE", "HTTP_ENDPOINT", "METRICS_PATH", "CDI_ROOT", "NVIDIA_DRIVER_ROOT",
                    "DRIVER_ROOT_CTR_PATH", "NVIDIA_CDI_HOOK_PATH", "KUBELET_REGISTRAR_DIRECTORY_PATH",
                    "KUBELET_PLUGINS_DIRECTORY_PATH", "HEALTHCHECK_PORT", "GPU_CLIQUE_LABEL_ENABLED", "IMEX_MODE",
                    "IMEX_ISOLATION", "IMEX_HOST_SOCKET_PATH", "FEATURE_GATES", "KUBECONFIG"}
    assert nvidia_names <= set(env)
    assert env["HEALTHCHECK_PORT"]["value"] == "51515" and env["HTTP_ENDPOINT"]["value"] == ":8081"
    # not ready while the NVLink fabric registration is waited out, then until the slices are published
    assert ctr["readinessProbe"]["grpc"] == {"port": 51515, "service": READINESS_SERVICE}
    assert ctr["image"] == container(ds, "gpus")["image"]
    gpus_mounts = {m["mountPath"] for m in container(ds, "gpus")["volumeMounts"]}
    assert {m["mountPath"] for m in ctr["volumeMounts"]} <= gpus_mounts
    assert _rules("Role", "dradriver-compute-domain-kubelet-plugin") == {
        ("resource.nvidia.com", "computedomaincliques", ("get",))}


def test_the_compute_domain_plugin_may_write_its_claims_device_status() -> None:
    """KEP-4817 status.devices of a prepared channel: the base role's resourceclaims/status update, and from
    Kubernetes 1.36 the associated-node verbs on resourceclaims/driver named after this plugin's driver."""
    role = one(render(OVERLAY), "ClusterRole", "dradriver-compute-domain-kubelet-plugin")
    [rule] = [r for r in role["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resourceNames"] == ["compute-domain.nvidia.com"]
    assert sorted(rule["verbs"]) == ["associated-node:patch", "associated-node:update"]
    assert ("resource.k8s.io", "resourceclaims/status", ("update",)) in _rules("ClusterRole",
                                                                                 "dradriver-kubelet-plugin")


def test_the_component_tags_images_as_the_base_does() -> None:
    import yaml

    from tests.deploy.manifests import KUSTOMIZE

    base = yaml.safe_load((KUSTOMIZE / "base" / "kustomization.yaml").read_text())
    component = yaml.safe_load((KUSTOMIZE / "components" / "compute-domains" / "kustomization.yaml").read_text())
    assert component["images"] == base["images"]
