"""The manifests under ``deploy/``: rendered by ``kubectl kustomize``, validated against the official Kubernetes
1.34 schemas (kubernetes-validate, strict), and checked against the plugin's own flags and paths."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dradriver.allocator.resources import parse_claim, parse_device_class, parse_slice
from dradriver.config import PLUGIN_FLAGS, PluginConfig, add_flags, config_from_args
from dradriver.domain.identity import GPU_DRIVER
from dradriver.nvml import mock
from dradriver.server.probe import READINESS_SERVICE

from .manifests import (
    EXAMPLES,
    TARGETS,
    Obj,
    container,
    env_of,
    example,
    find,
    mount_for,
    one,
    render,
    volume,
)

K8S_VERSION = "1.34"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXAMPLE_FILES = tuple(sorted(p.name for p in EXAMPLES.glob("*.yaml")))

#: Env vars of the plugin container that come from the downward API, and from which field.
DOWNWARD = {"NODE_NAME": "spec.nodeName", "POD_UID": "metadata.uid", "NAMESPACE": "metadata.namespace",
            "SERVICE_ACCOUNT_NAME": "spec.serviceAccountName"}


def _plugin(target: str) -> Obj:
    return container(one(render(target), "DaemonSet", "dradriver-kubelet-plugin"), "gpus")


def _plugin_config(target: str) -> PluginConfig:
    """The PluginConfig the plugin builds from the DaemonSet's environment (downward values filled in)."""
    import argparse

    environ: dict[str, str] = {}
    for name, entry in env_of(_plugin(target)).items():
        if "valueFrom" in entry:
            environ[name] = {"NODE_NAME": "node-a", "POD_UID": "0b5f4c1e-8d2a-4c55-9a4e-5d1f2e3c4b5a",
                             "NAMESPACE": "dradriver", "SERVICE_ACCOUNT_NAME": "dradriver-kubelet-plugin"}[name]
        else:
            environ[name] = entry["value"]
    parser = argparse.ArgumentParser()
    add_flags(parser, environ=environ)
    return config_from_args(parser.parse_args([]))


# --- schemas -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_rendered_objects_validate_against_kubernetes_schemas(target: str) -> None:
    objs = render(target)
    kinds = {o["kind"] for o in objs}
    assert {"DaemonSet", "ClusterRole", "ClusterRoleBinding", "ServiceAccount", "DeviceClass"} <= kinds
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_examples_validate_against_kubernetes_schemas(name: str) -> None:
    import jsonschema

    crds = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c for c in render("base")
            if c["kind"] == "CustomResourceDefinition"}
    for obj in example(name):
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        if (group, obj["kind"]) in crds:  # our CRDs' kinds (ComputeDomain): against the CRD's served schema
            [served] = [v for v in crds[(group, obj["kind"])]["spec"]["versions"]
                        if f"{group}/{v['name']}" == obj["apiVersion"]]
            jsonschema.validate(obj["spec"], served["schema"]["openAPIV3Schema"]["properties"]["spec"])
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_resourceslice_fixture_validates() -> None:
    with (FIXTURES / "resourceslices.yaml").open() as f:
        for obj in yaml.safe_load_all(f):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_validation_is_strict_enough_to_catch_a_typo() -> None:
    daemonset = copy.deepcopy(one(render("base"), "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, K8S_VERSION, strict=True)


def test_cluster_scoped_objects_carry_no_namespace() -> None:
    cluster_scoped = {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "DeviceClass",
        "PriorityClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingWebhookConfiguration",
    }
    for target in TARGETS:
        for obj in render(target):
            if obj["kind"] in cluster_scoped:
                assert "namespace" not in obj["metadata"], f"{target}: {obj['kind']} {obj['metadata']['name']}"
            else:
                assert obj["metadata"].get("namespace") == "dradriver", f"{target}: {obj['kind']}"


# --- the DaemonSet against the plugin's flags ----------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_env_names_are_exactly_the_plugin_flag_twins(target: str) -> None:
    env = env_of(_plugin(target))
    assert set(env) == {flag.env for flag in PLUGIN_FLAGS}
    for name, entry in env.items():
        if name in DOWNWARD:
            assert entry["valueFrom"] == {"fieldRef": {"fieldPath": DOWNWARD[name]}}, name
        else:
            assert "valueFrom" not in entry and isinstance(entry["value"], str), name


@pytest.mark.parametrize("target", TARGETS)
def test_env_values_parse_into_a_plugin_config(target: str) -> None:
    config = _plugin_config(target)
    env = env_of(_plugin(target))
    for flag in PLUGIN_FLAGS:
        if flag.choices:  # argparse does not check defaults (here: from the environment) against choices
            assert env[flag.env]["value"] in flag.choices, flag.env
    assert config.node_name == "node-a"
    assert config.pod_uid, "POD_UID must be set for the rolling update with maxSurge"
    assert config.ignore_device_plugin is False
    assert config.healthcheck_port > 0


@pytest.mark.parametrize("target", TARGETS)
def test_plugin_paths_are_mounted_from_the_host(target: str) -> None:
    ds = one(render(target), "DaemonSet")
    plugin = _plugin(target)
    config = _plugin_config(target)

    def host_path(mount_path: Path) -> str:
        mount = mount_for(plugin, str(mount_path))
        return str(volume(ds, mount["name"])["hostPath"]["path"])

    # The kubelet sees the plugin's sockets and CDI specs at the same paths (kubelet-dra-protocol.md 4.1).
    assert host_path(config.kubelet_plugins_directory_path) == str(config.kubelet_plugins_directory_path)
    assert mount_for(plugin, str(config.kubelet_plugins_directory_path))["mountPropagation"] == "Bidirectional"
    assert host_path(config.kubelet_registrar_directory_path) == str(config.kubelet_registrar_directory_path)
    assert host_path(config.cdi_root) == str(config.cdi_root)
    assert host_path(config.kubelet_device_plugins_directory_path) == "/var/lib/kubelet/device-plugins"
    assert mount_for(plugin, str(config.kubelet_device_plugins_directory_path))["readOnly"] is True
    # The driver root: NVIDIA_DRIVER_ROOT on the host is mounted at DRIVER_ROOT_CTR_PATH, seeing later mounts.
    assert host_path(config.container_driver_root) == str(config.nvidia_driver_root)
    assert mount_for(plugin, str(config.container_driver_root))["mountPropagation"] == "HostToContainer"
    assert config.dev_root == config.container_driver_root
    # Sockets derived from the config live under mounted host directories.
    assert config.dra_socket.parent.parent == config.kubelet_plugins_directory_path
    assert config.registration_socket.parent == config.kubelet_registrar_directory_path
    if config.nvml_library:
        assert mount_for(plugin, str(Path(config.nvml_library).parent))


@pytest.mark.parametrize("target", TARGETS)
def test_probes_use_the_grpc_health_port_and_metrics_port_is_named(target: str) -> None:
    plugin = _plugin(target)
    config = _plugin_config(target)
    for probe in ("startupProbe", "livenessProbe"):
        assert plugin[probe]["grpc"] == {"port": config.healthcheck_port}, probe
    # readiness means published: the probe's own service name (dradriver.server.probe.READINESS_SERVICE)
    assert plugin["readinessProbe"]["grpc"] == {"port": config.healthcheck_port, "service": READINESS_SERVICE}
    ports = {p["name"]: p["containerPort"] for p in plugin["ports"]}
    assert ports["metrics"] == int(config.http_endpoint.rsplit(":", 1)[1])
    assert config.metrics_path == "/metrics"


@pytest.mark.parametrize("target", TARGETS)
def test_pod_scheduling_priority_and_update_strategy(target: str) -> None:
    ds = one(render(target), "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in spec["tolerations"]
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    if strategy["rollingUpdate"].get("maxSurge", 0) != 0:
        # Two plugin pods on one node are only safe with per-pod socket names.
        assert _plugin_config(target).pod_uid
    if target != "overlays/mock":
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        keys = {e["key"] for t in terms for e in t["matchExpressions"]}
        assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    plugin = _plugin(target)
    assert plugin["resources"]["requests"]["memory"] and plugin["resources"]["limits"]["memory"]
    assert plugin["command"] == ["dradriver", "gpu-kubelet-plugin"]


@pytest.mark.parametrize("target", TARGETS)
def test_security_contexts(target: str) -> None:
    ds = one(render(target), "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    for forbidden in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(forbidden), forbidden
    for ctr in spec["containers"] + (spec.get("initContainers") or []):
        sc = ctr["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, ctr["name"]
        if any(m.get("mountPropagation") == "Bidirectional" for m in ctr.get("volumeMounts") or []):
            # The API server accepts Bidirectional propagation only in privileged containers.
            assert sc["privileged"] is True
        if not sc.get("privileged"):
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_gpu_operator_overlay_moves_the_driver_root_everywhere() -> None:
    for target, root in (("base", "/"), ("overlays/gpu-operator", "/run/nvidia/driver")):
        ds = one(render(target), "DaemonSet")
        config = _plugin_config(target)
        assert str(config.nvidia_driver_root) == root
        assert volume(ds, "driver-root")["hostPath"]["path"] == root
        mount = next(m for m in container(ds, "gpus")["volumeMounts"] if m["name"] == "driver-root")
        assert mount["mountPath"] == str(config.container_driver_root)
        assert mount["mountPropagation"] == "HostToContainer"  # the operator mounts the driver after the pod


@pytest.mark.parametrize("target", TARGETS)
def test_nothing_in_the_daemonset_waits_for_the_driver(target: str) -> None:
    """A driver reinstall evicts GPU pods, whose claims only the plugin can unprepare: no init container may keep
    it from starting while the driver is absent, and the plugin looks for libnvidia-ml.so.1 under the driver root
    itself (again at every try), not at a path an init container made."""
    ds = one(render(target), "DaemonSet")
    assert not ds["spec"]["template"]["spec"].get("initContainers")
    assert _plugin_config(target).nvml_library == ""


def test_mock_overlay_names_a_bundled_profile_and_requires_no_gpu_node() -> None:
    ds = one(render("overlays/mock"), "DaemonSet")
    config = _plugin_config("overlays/mock")
    assert config.mock_profile in mock.profile_names()
    assert "affinity" not in ds["spec"]["template"]["spec"]


# --- RBAC and admission --------------------------------------------------------------------------------------


def test_rbac_is_least_privilege_and_bound_to_the_plugins_service_account() -> None:
    objs = render("base")
    ds = one(objs, "DaemonSet")
    sa_name = ds["spec"]["template"]["spec"]["serviceAccountName"]
    sa = one(objs, "ServiceAccount", sa_name)
    role = one(objs, "ClusterRole")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule
        if "resourceNames" in rule:  # only the 1.36+ granular status rule, for our own driver name
            assert rule["resources"] == ["resourceclaims/driver"] and rule["resourceNames"] == ["gpu.nvidia.com"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == {
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("resource.k8s.io", "resourceclaims/status"): {"update"},
        ("resource.k8s.io", "resourceclaims/driver"): {"associated-node:update", "associated-node:patch"},
        ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("", "nodes"): {"get"},
        ("", "events"): {"create", "patch"},
        ("events.k8s.io", "events"): {"create", "patch"},
    }
    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa_name, "namespace": sa["metadata"]["namespace"]}
    ]
    assert not find(objs, "Role") and not find(objs, "RoleBinding")


def test_resourceslice_policy_names_the_plugins_service_account() -> None:
    objs = render("base")
    sa = one(objs, "ServiceAccount")
    policy = one(objs, "ValidatingAdmissionPolicy")
    username = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    conditions = [c["expression"] for c in policy["spec"]["matchConditions"]]
    assert conditions == [f"request.userInfo.username == '{username}'"]
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rules[0]["resources"] == ["resourceslices"] and set(rules[0]["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    binding = one(objs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


# --- DeviceClasses and examples against a ResourceSlice ------------------------------------------------------


def _devices() -> list[Any]:
    with (FIXTURES / "resourceslices.yaml").open() as f:
        return [d for obj in yaml.safe_load_all(f) for d in parse_slice(obj).devices]


def _selected(selectors: list[Any], devices: list[Any]) -> set[str]:
    out = set()
    for device in devices:
        outcomes = [s.evaluate(device.cel()) for s in selectors]
        if all(o.matched for o in outcomes):
            out.add(f"{device.driver}/{device.name}")
    return out


REFERENCE_SELECTORS = {
    "gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "mig.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
    "vfio.gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'",
    "compute-domain-default-channel.nvidia.com": "device.driver == 'compute-domain.nvidia.com' && "
    "device.attributes['compute-domain.nvidia.com'].type == 'channel' && "
    "device.attributes['compute-domain.nvidia.com'].id == 0",
    "compute-domain-daemon.nvidia.com": "device.driver == 'compute-domain.nvidia.com' && "
    "device.attributes['compute-domain.nvidia.com'].type == 'daemon'",
    # dradriver's own, for --imex-isolation channel (any channel; the workload template selects the domain's id)
    "compute-domain-channel.nvidia.com": "device.driver == 'compute-domain.nvidia.com' && "
    "device.attributes['compute-domain.nvidia.com'].type == 'channel'",
}


def test_device_classes_have_the_reference_selectors() -> None:
    classes = find(render("base"), "DeviceClass")
    assert {c["metadata"]["name"]: [s["cel"]["expression"] for s in c["spec"]["selectors"]] for c in classes} == {
        name: [expr] for name, expr in REFERENCE_SELECTORS.items()
    }
    # Like NVIDIA's chart (nvidia-dra-driver.md 9.3): gpu.nvidia.com maps nvidia.com/gpu (KEP-5004), mig does not.
    assert {c["metadata"]["name"]: c["spec"].get("extendedResourceName") for c in classes} == {
        "gpu.nvidia.com": "nvidia.com/gpu",
        "mig.nvidia.com": None,
        "vfio.gpu.nvidia.com": None,
        "compute-domain-default-channel.nvidia.com": None,
        "compute-domain-daemon.nvidia.com": None,
        "compute-domain-channel.nvidia.com": None,
    }


def test_device_classes_select_the_right_devices() -> None:
    devices = _devices()
    classes = {c["metadata"]["name"]: parse_device_class(c) for c in find(render("base"), "DeviceClass")}
    assert _selected(classes["gpu.nvidia.com"].selectors, devices) == {
        f"{GPU_DRIVER.driver_name}/gpu-0",
        f"{GPU_DRIVER.driver_name}/gpu-1",
        f"{GPU_DRIVER.driver_name}/gpu-2",
    }
    assert _selected(classes["mig.nvidia.com"].selectors, devices) == {
        f"{GPU_DRIVER.driver_name}/gpu-3-mig-1g10gb-19-0",
        f"{GPU_DRIVER.driver_name}/gpu-3-mig-7g80gb-0-0",
    }
    assert _selected(classes["vfio.gpu.nvidia.com"].selectors, devices) == {f"{GPU_DRIVER.driver_name}/gpu-vfio-4"}


def test_no_extended_resource_overlay_removes_only_the_mapping() -> None:
    classes = {c["metadata"]["name"]: c for c in find(render("overlays/no-extended-resource"), "DeviceClass")}
    assert all("extendedResourceName" not in c["spec"] for c in classes.values())
    assert (
        classes["gpu.nvidia.com"]["spec"]["selectors"]
        == one(render("base"), "DeviceClass", "gpu.nvidia.com")["spec"]["selectors"]
    )


def test_mps_overlay_turns_mps_on_with_the_plugins_image_and_a_namespaced_role() -> None:
    objs = render("overlays/mps")
    plugin = container(one(objs, "DaemonSet", "dradriver-kubelet-plugin"), "gpus")
    env = env_of(plugin)
    assert env["FEATURE_GATES"]["value"] == "MPSSupport=true"
    assert env["IMAGE_NAME"]["value"] == plugin["image"] == "dradriver:0.1.0"
    config = _plugin_config("overlays/mps")
    assert config.feature_gates.mps_support and config.image_name == plugin["image"]
    assert config.namespace == "dradriver"
    role = one(objs, "Role", "dradriver-mps-control-daemons")
    assert role["metadata"]["namespace"] == "dradriver"
    granted = {(g, r): set(rule["verbs"])
               for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted == {("apps", "deployments"): {"get", "list", "create", "delete"}, ("", "pods"): {"list"}}
    binding = one(objs, "RoleBinding", "dradriver-mps-control-daemons")
    assert binding["metadata"]["namespace"] == "dradriver"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dradriver-kubelet-plugin",
                                    "namespace": "dradriver"}]
    # the base grants nothing on Deployments or Pods (test_rbac_is_least_privilege...), and no Role at all
    assert not find(render("base"), "Role")


def test_big_gpu_example_selects_gpus_with_at_least_40gi() -> None:
    objs = example("gpu-40gi.yaml")
    template = one(objs, "ResourceClaimTemplate", "big-gpu")
    claim_obj = {"metadata": {"name": "dra-gpu-pod-gpu", "namespace": "default"}, "spec": template["spec"]["spec"]}
    claim = parse_claim(claim_obj)
    (request,) = claim.requests
    assert request.class_name == "gpu.nvidia.com" and request.count == 1
    assert [s.expression for s in request.selectors] == [
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
    ]
    gpu_class = parse_device_class(one(render("base"), "DeviceClass", request.class_name))
    selected = _selected(gpu_class.selectors + request.selectors, _devices())
    assert selected == {f"{GPU_DRIVER.driver_name}/gpu-0", f"{GPU_DRIVER.driver_name}/gpu-1"}
    pod = one(objs, "Pod", "dra-gpu-pod")
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "big-gpu"}]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]


def test_shared_claim_example_is_referenced_by_two_pods() -> None:
    objs = example("shared-claim.yaml")
    claim = one(objs, "ResourceClaim", "shared-gpu")
    assert parse_claim(claim).requests[0].class_name == "gpu.nvidia.com"
    pods = find(objs, "Pod")
    assert len(pods) == 2
    for pod in pods:
        assert pod["metadata"]["namespace"] == claim["metadata"]["namespace"]
        refs = {c["name"]: c for c in pod["spec"]["resourceClaims"]}
        assert refs == {"gpu": {"name": "gpu", "resourceClaimName": "shared-gpu"}}
        assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]


# --- GPU sharing ----------------------------------------------------------------------------------------------


def test_gpu_sharing_overlay_turns_on_time_slicing_only() -> None:
    assert not _plugin_config("base").feature_gates.time_slicing_settings
    gates = _plugin_config("overlays/gpu-sharing").feature_gates
    assert gates.time_slicing_settings and not gates.mps_support


def test_time_slicing_example_config_is_valid_with_the_overlay_gates() -> None:
    from dradriver.domain import configs

    gates = _plugin_config("overlays/gpu-sharing").feature_gates
    (claim,) = find(example("time-slicing.yaml"), "ResourceClaim")
    parameters = claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    config = configs.normalize(configs.decode(parameters, "spec.devices.config[0].opaque.parameters"), gates)
    configs.validate(config, gates)
    assert config.sharing is not None and config.sharing.time_slicing is not None
    assert config.sharing.time_slicing.interval == "Long"
    with pytest.raises(configs.DeviceConfigError, match="TimeSlicingSettings"):
        configs.validate(config, _plugin_config("base").feature_gates)


# --- per-node device policy -----------------------------------------------------------------------------------


def test_per_node_config_overlay_mounts_valid_profiles_where_the_plugin_reads_them() -> None:
    from dradriver.domain.driverconfig import decode_driver_config

    objs = render("overlays/per-node-config")
    ds = one(objs, "DaemonSet", "dradriver-kubelet-plugin")
    plugin = container(ds, "gpus")
    config = _plugin_config("overlays/per-node-config")
    assert config.feature_gates.per_node_gpu_config and not _plugin_config("base").feature_gates.per_node_gpu_config
    mount = mount_for(plugin, str(config.driver_config_directory))
    assert mount["readOnly"] is True
    configmap = one(objs, "ConfigMap", volume(ds, mount["name"])["configMap"]["name"])
    assert configmap["metadata"]["namespace"] == ds["metadata"]["namespace"]
    advertised = {name: decode_driver_config(text, name).advertised_device_types
                  for name, text in configmap["data"].items()}
    assert advertised["full-gpu"] == ("gpu",) and advertised["passthrough"] == ("vfio",)
    role = one(objs, "ClusterRole", "dradriver-kubelet-plugin-node-watch")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["watch"]}]
    binding = one(objs, "ClusterRoleBinding", "dradriver-kubelet-plugin-node-watch")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ds["spec"]["template"]["spec"]
                                    ["serviceAccountName"], "namespace": ds["metadata"]["namespace"]}]


def test_passthrough_overlay_turns_the_gate_on_and_mounts_the_host_root_and_dev() -> None:
    daemonset = one(render("overlays/passthrough"), "DaemonSet", "dradriver-kubelet-plugin")
    plugin = container(daemonset, "gpus")
    config = _plugin_config("overlays/passthrough")
    assert config.feature_gates.passthrough_support and not config.feature_gates.dynamic_mig
    root = mount_for(plugin, str(config.host_root))
    assert volume(daemonset, root["name"])["hostPath"]["path"] == "/" and root["readOnly"]
    dev = mount_for(plugin, "/dev")
    assert volume(daemonset, dev["name"])["hostPath"]["path"] == "/dev"
    assert dev["mountPropagation"] == "HostToContainer"
    assert not _plugin_config("base").feature_gates.passthrough_support
