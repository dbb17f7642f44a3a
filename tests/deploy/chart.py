"""NVIDIA's chart (dra-driver-nvidia-gpu v0.5.0-dev) rendered from its facts: the kubelet plugin's ``gpus`` and
``compute-domains`` containers, the compute-domain controller's container and the optional webhook's container.

Helm is not installed here and NVIDIA's templates are not ours to copy; this renders what
``../shared/reference/nvidia-image-contract.md`` and ``nvidia-dra-driver.md`` 9 say the templates produce
(``templates/kubeletplugin.yaml``, ``templates/controller.yaml``): each container's command, args and
environment, its gRPC probes, and the init container's command and environment, from a values dict of the same
shape as the chart's ``values.yaml``.
:func:`expand` does the kubelet's ``$(VAR)`` expansion of command and args.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

#: The chart values the kubelet-plugin templates read, with the chart's defaults.
DEFAULTS: dict[str, Any] = {
    "nvidiaDriverRoot": "/",
    "nvidiaCDIHookPath": "",
    "gpuResourcesEnabledOverride": False,
    "consumableShares": "",
    "imagePullSecrets": [],
    "image": {"repository": "registry.k8s.io/dra-driver-nvidia/dra-driver-nvidia-gpu", "pullPolicy": "IfNotPresent",
              "tag": ""},
    "appVersion": "0.5.0-dev",
    "featureGates": {},
    "logVerbosity": "4",
    "maskNvidiaDriverParams": False,
    "altProcDevices": "",
    # imex.hostSocketPath: inferred name of the value behind IMEX_HOST_SOCKET_PATH (the contract gives the default).
    "resources": {"gpus": {"enabled": True},
                  "computeDomains": {"enabled": True, "imex": {"mode": "driverManaged", "isolation": "domain",
                                                               "hostSocketPath": "/etc/nvidia-imex/imex_ctrl.sock"}}},
    "controller": {
        "leaderElection": {"enabled": False, "leaseDuration": "15s", "renewDeadline": "10s", "retryPeriod": "2s"},
        "metrics": {"enabled": True, "httpEndpoint": ":8080", "metricsPath": "/metrics", "profilePath": ""},
    },
    "chartName": "nvidia-dra-driver-gpu",
    "webhook": {"enabled": False, "containerPort": 443},
    "kubeletPlugin": {
        "metrics": {"enabled": True, "gpuHttpEndpoint": ":8080", "computeDomainHttpEndpoint": ":8081",
                    "metricsPath": "/metrics"},
        "podSecurityContext": {},
        "kubeletRegistrarDirectoryPath": "/var/lib/kubelet/plugins_registry",
        "kubeletPluginsDirectoryPath": "/var/lib/kubelet/plugins",
        "containers": {
            "gpus": {"env": [], "securityContext": {"privileged": True}, "healthcheckPort": 51516},
            "computeDomains": {"env": [], "securityContext": {"privileged": True}, "healthcheckPort": 51515,
                               "gpuCliqueLabelEnabled": False},
        },
    },
}

#: The ``gpus`` container's script (``command: ["bash", "-c"]``): mask the driver's params file when asked, then
#: the plugin with klog verbosity from the environment.
GPUS_SCRIPT = """\
if [ "${MASK_NVIDIA_DRIVER_PARAMS}" = "true" ]; then
  cp /proc/driver/nvidia/params /root/gpu-params
  sed -i 's/^ModifyDeviceFiles: 1$/ModifyDeviceFiles: 0/' /root/gpu-params
  mount --bind /root/gpu-params /proc/driver/nvidia/params
fi
gpu-kubelet-plugin -v $(LOG_VERBOSITY)"""

#: The ``compute-domains`` container's script: the same pattern with its own executable.
COMPUTE_DOMAINS_SCRIPT = GPUS_SCRIPT.replace("gpu-kubelet-plugin", "compute-domain-kubelet-plugin")


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's values merge: maps merge key by key, anything else (lists included) is replaced."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values(*overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The chart's defaults with ``overrides`` merged in order (as ``helm -f a.yaml -f b.yaml``)."""
    out = DEFAULTS
    for override in overrides:
        out = merge(out, override)
    return copy.deepcopy(out)


def full_image(v: Mapping[str, Any]) -> str:
    """``<repository>:<tag>``; an empty tag is ``v<appVersion>``."""
    return f"{v['image']['repository']}:{v['image']['tag'] or 'v' + v['appVersion']}"


def _gates(v: Mapping[str, Any]) -> str:
    """``Key=value,`` per gate, sorted as Go templates range over maps, with the trailing comma."""
    return "".join(f"{key}={str(val).lower() if isinstance(val, bool) else val}," for key, val in
                   sorted(v["featureGates"].items()))


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


class _Env(list[dict[str, Any]]):
    def put(self, name: str, value: str | dict[str, Any]) -> None:
        self.append({"name": name, **(value if isinstance(value, dict) else {"value": value})})


def _grpc_probes(container: dict[str, Any], port: int, liveness_period_s: int) -> None:
    if port > 0:
        probe = {"grpc": {"port": port, "service": "liveness"}, "timeoutSeconds": 10}
        container["startupProbe"] = {**probe, "failureThreshold": 600, "periodSeconds": 1}
        container["livenessProbe"] = {**probe, "failureThreshold": 3, "periodSeconds": liveness_period_s}


def gpus_container(v: Mapping[str, Any]) -> dict[str, Any]:
    """The ``gpus`` container of the kubelet-plugin DaemonSet for values ``v``."""
    plugin = v["kubeletPlugin"]
    gpus = plugin["containers"]["gpus"]
    gates = v["featureGates"]

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = []

    def put(name: str, value: str | dict[str, Any]) -> None:
        env.append({"name": name, **(value if isinstance(value, dict) else {"value": value})})

    if plugin["metrics"]["enabled"]:
        put("HTTP_ENDPOINT", plugin["metrics"]["gpuHttpEndpoint"])
        put("METRICS_PATH", plugin["metrics"]["metricsPath"])
    put("LOG_VERBOSITY", str(v["logVerbosity"]))
    put("MASK_NVIDIA_DRIVER_PARAMS", str(v["maskNvidiaDriverParams"]).lower())
    put("NVIDIA_DRIVER_ROOT", v["nvidiaDriverRoot"])
    put("NVIDIA_VISIBLE_DEVICES", "void")
    put("CDI_ROOT", "/var/run/cdi")
    if gates.get("PassthroughSupport"):
        put("HOST_ROOT", "/host-root")
    put("NVIDIA_MIG_CONFIG_DEVICES", "all")
    put("NODE_NAME", field("spec.nodeName"))
    put("NAMESPACE", field("metadata.namespace"))
    put("SERVICE_ACCOUNT_NAME", field("spec.serviceAccountName"))
    put("IMAGE_NAME", full_image(v))
    if v["imagePullSecrets"]:
        put("IMAGE_PULL_SECRETS", ",".join(s["name"] for s in v["imagePullSecrets"]))
    put("IMAGE_PULL_POLICY", v["image"]["pullPolicy"])
    if v["nvidiaCDIHookPath"]:
        put("NVIDIA_CDI_HOOK_PATH", v["nvidiaCDIHookPath"])
    if v["consumableShares"]:
        put("CONSUMABLE_SHARES", v["consumableShares"])
    if gates:
        put("FEATURE_GATES", _gates(v))
    put("KUBELET_REGISTRAR_DIRECTORY_PATH", plugin["kubeletRegistrarDirectoryPath"])
    put("KUBELET_PLUGINS_DIRECTORY_PATH", plugin["kubeletPluginsDirectoryPath"])
    port = int(gpus["healthcheckPort"])
    if port >= 0:
        put("HEALTHCHECK_PORT", str(port))
    env.extend(copy.deepcopy(gpus["env"]))
    container: dict[str, Any] = {
        "name": "gpus",
        "image": full_image(v),
        "imagePullPolicy": v["image"]["pullPolicy"],
        "securityContext": copy.deepcopy(gpus["securityContext"]),
        "command": ["bash", "-c"],
        "args": [GPUS_SCRIPT],
        "env": env,
    }
    _grpc_probes(container, port, 30)
    return container


def passthrough_volumes(v: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``gpus`` container's volume mounts and the pod's volumes the chart adds when
    ``featureGates.PassthroughSupport`` is true (``templates/kubeletplugin.yaml``: the host's ``/`` at
    ``/host-root``, read-only, HostToContainer; ``/sys/`` and ``/proc/`` Bidirectional); none without it."""
    if not v["featureGates"].get("PassthroughSupport"):
        return [], []
    mounts: list[dict[str, Any]] = [
        {"name": "host-root", "mountPath": "/host-root", "mountPropagation": "HostToContainer", "readOnly": True},
        {"name": "sysfs", "mountPath": "/sys/", "mountPropagation": "Bidirectional"},
        {"name": "procfs", "mountPath": "/proc/", "mountPropagation": "Bidirectional"},
    ]
    volumes: list[dict[str, Any]] = [{"name": name, "hostPath": {"path": path, "type": "Directory"}}
               for name, path in (("host-root", "/"), ("sysfs", "/sys/"), ("procfs", "/proc/"))]
    return mounts, volumes


def compute_domains_container(v: Mapping[str, Any]) -> dict[str, Any]:
    """The ``compute-domains`` container of the kubelet-plugin DaemonSet for values ``v`` (the environment of
    ``nvidia-image-contract.md`` "Environment of the compute-domains container"; liveness every 10 s)."""
    plugin = v["kubeletPlugin"]
    cds = plugin["containers"]["computeDomains"]
    imex = v["resources"]["computeDomains"]["imex"]
    env = _Env()
    if plugin["metrics"]["enabled"]:
        env.put("HTTP_ENDPOINT", plugin["metrics"]["computeDomainHttpEndpoint"])
        env.put("METRICS_PATH", plugin["metrics"]["metricsPath"])
    env.put("LOG_VERBOSITY", str(v["logVerbosity"]))
    env.put("MASK_NVIDIA_DRIVER_PARAMS", str(v["maskNvidiaDriverParams"]).lower())
    env.put("NVIDIA_DRIVER_ROOT", v["nvidiaDriverRoot"])
    env.put("NVIDIA_VISIBLE_DEVICES", "void")
    env.put("CDI_ROOT", "/var/run/cdi")
    env.put("NVIDIA_MIG_CONFIG_DEVICES", "all")
    if v["altProcDevices"]:
        env.put("ALT_PROC_DEVICES_PATH", "/alt-proc-devices")
    env.put("NODE_NAME", _field("spec.nodeName"))
    env.put("NAMESPACE", _field("metadata.namespace"))
    if v["nvidiaCDIHookPath"]:
        env.put("NVIDIA_CDI_HOOK_PATH", v["nvidiaCDIHookPath"])
    if v["featureGates"]:
        env.put("FEATURE_GATES", _gates(v))
    env.put("IMEX_MODE", imex["mode"])
    env.put("IMEX_ISOLATION", imex["isolation"])
    env.put("IMEX_HOST_SOCKET_PATH", imex["hostSocketPath"])
    env.put("KUBELET_REGISTRAR_DIRECTORY_PATH", plugin["kubeletRegistrarDirectoryPath"])
    env.put("KUBELET_PLUGINS_DIRECTORY_PATH", plugin["kubeletPluginsDirectoryPath"])
    port = int(cds["healthcheckPort"])
    if port >= 0:
        env.put("HEALTHCHECK_PORT", str(port))
    env.put("GPU_CLIQUE_LABEL_ENABLED", str(cds["gpuCliqueLabelEnabled"]).lower())
    env.extend(copy.deepcopy(cds["env"]))
    container: dict[str, Any] = {
        "name": "compute-domains",
        "image": full_image(v),
        "imagePullPolicy": v["image"]["pullPolicy"],
        "securityContext": copy.deepcopy(cds["securityContext"]),
        "command": ["bash", "-c"],
        "args": [COMPUTE_DOMAINS_SCRIPT],
        "env": list(env),
    }
    _grpc_probes(container, port, 10)
    return container


def controller_container(v: Mapping[str, Any], release_namespace: str) -> dict[str, Any]:
    """The controller Deployment's container for values ``v`` (``nvidia-image-contract.md`` "Environment of the
    controller"): ``command: [compute-domain-controller, -v, $(LOG_VERBOSITY)]``. The Lease lives in the
    release's namespace and is named ``<chart name>-controller``."""
    ctl = v["controller"]
    election = ctl["leaderElection"]
    imex = v["resources"]["computeDomains"]["imex"]
    env = _Env()
    if ctl["metrics"]["enabled"]:
        env.put("HTTP_ENDPOINT", ctl["metrics"]["httpEndpoint"])
        env.put("METRICS_PATH", ctl["metrics"]["metricsPath"])
        env.put("PPROF_PATH", ctl["metrics"]["profilePath"])
    env.put("LOG_VERBOSITY", str(v["logVerbosity"]))
    env.put("LOG_VERBOSITY_CD_DAEMON", str(v["logVerbosity"]))
    env.put("POD_NAME", _field("metadata.name"))
    env.put("NAMESPACE", _field("metadata.namespace"))
    env.put("IMAGE_NAME", full_image(v))
    env.put("CD_DAEMON_IMAGE_PULL_SECRET_NAMES", ",".join(s["name"] for s in v["imagePullSecrets"]))
    env.put("NVIDIA_VISIBLE_DEVICES", "void")
    if v["featureGates"]:
        env.put("FEATURE_GATES", _gates(v))
    env.put("IMEX_MODE", imex["mode"])
    env.put("IMEX_ISOLATION", imex["isolation"])
    env.put("LEADER_ELECTION_ENABLED", str(election["enabled"]).lower())
    env.put("LEADER_ELECTION_LEASE_LOCK_NAME", f"{v['chartName']}-controller")
    env.put("LEADER_ELECTION_LEASE_LOCK_NAMESPACE", release_namespace)
    env.put("LEADER_ELECTION_LEASE_DURATION", election["leaseDuration"])
    env.put("LEADER_ELECTION_RENEW_DEADLINE", election["renewDeadline"])
    env.put("LEADER_ELECTION_RETRY_PERIOD", election["retryPeriod"])
    return {
        "name": "compute-domain",
        "image": full_image(v),
        "imagePullPolicy": v["image"]["pullPolicy"],
        "command": ["compute-domain-controller", "-v", "$(LOG_VERBOSITY)"],
        "env": list(env),
    }


def webhook_container(v: Mapping[str, Any]) -> dict[str, Any]:
    """The webhook Deployment's container (``webhook.enabled``; NVIDIA's ``templates/webhook-deployment.yaml``):
    ``command: [webhook]`` with the TLS files of the Secret mounted at ``/cert`` and ``--port`` from
    ``webhook.containerPort``, ``FEATURE_GATES`` when gates are set, HTTPS probes on ``/readyz``."""
    port = int(v["webhook"]["containerPort"])
    env = _Env()
    if v["featureGates"]:
        env.put("FEATURE_GATES", _gates(v))
    probe = {"httpGet": {"path": "/readyz", "port": "webhook", "scheme": "HTTPS"}}
    return {
        "name": "webhook",
        "image": full_image(v),
        "imagePullPolicy": v["image"]["pullPolicy"],
        "command": ["webhook"],
        "args": ["--tls-cert-file=/cert/tls.crt", "--tls-private-key-file=/cert/tls.key", f"--port={port}"],
        "env": list(env),
        "ports": [{"name": "webhook", "containerPort": port}],
        "livenessProbe": {**probe, "failureThreshold": 5},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "volumeMounts": [{"name": "cert", "mountPath": "/cert", "readOnly": True}],
    }


def init_container(v: Mapping[str, Any]) -> dict[str, Any]:
    """The kubelet-plugin pod's init container (privileged; ``[bash, /usr/bin/kubelet-plugin-prestart.sh]``)."""
    plugin = v["kubeletPlugin"]
    return {
        "name": "init-container",
        "image": full_image(v),
        "securityContext": {"privileged": True},
        "command": ["bash", "/usr/bin/kubelet-plugin-prestart.sh"],
        "env": [
            {"name": "NVIDIA_DRIVER_ROOT", "value": v["nvidiaDriverRoot"]},
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
            {"name": "KUBELET_REGISTRAR_DIRECTORY_PATH", "value": plugin["kubeletRegistrarDirectoryPath"]},
            {"name": "KUBELET_PLUGINS_DIRECTORY_PATH", "value": plugin["kubeletPluginsDirectoryPath"]},
        ],
    }


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's expansion of ``$(VAR)`` in command and args: a defined variable is replaced, ``$$`` is a
    literal ``$``, an undefined reference stays as written
    (``k8s.io/kubernetes/third_party/forked/golang/expansion``)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REFERENCE.sub(one, text)


def container_env(container: Mapping[str, Any], downward: Mapping[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet sets it; ``downward`` gives each ``fieldRef`` path's value."""
    out: dict[str, str] = {}
    for entry in container["env"]:
        if "valueFrom" in entry:
            out[entry["name"]] = downward[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[entry["name"]] = expand(str(entry["value"]), out)
    return out
