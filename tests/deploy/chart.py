"""NVIDIA's chart (dra-driver-nvidia-gpu v0.5.0-dev) rendered from its facts: the kubelet plugin's ``gpus`` container.

Helm is not installed here and NVIDIA's templates are not ours to copy; this renders what
``../shared/reference/nvidia-image-contract.md`` and ``nvidia-dra-driver.md`` 9 say the templates produce
(``templates/kubeletplugin.yaml``): the container's command, args and environment, its gRPC probes, and the init
container's command and environment, from a values dict of the same shape as the chart's ``values.yaml``.
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
    "resources": {"gpus": {"enabled": True}, "computeDomains": {"enabled": True}},
    "kubeletPlugin": {
        "metrics": {"enabled": True, "gpuHttpEndpoint": ":8080", "computeDomainHttpEndpoint": ":8081",
                    "metricsPath": "/metrics"},
        "podSecurityContext": {},
        "kubeletRegistrarDirectoryPath": "/var/lib/kubelet/plugins_registry",
        "kubeletPluginsDirectoryPath": "/var/lib/kubelet/plugins",
        "containers": {
            "gpus": {"env": [], "securityContext": {"privileged": True}, "healthcheckPort": 51516},
            "computeDomains": {"env": [], "securityContext": {"privileged": True}, "healthcheckPort": 51515},
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
    if port > 0:
        probe = {"grpc": {"port": port, "service": "liveness"}, "timeoutSeconds": 10}
        container["startupProbe"] = {**probe, "failureThreshold": 600, "periodSeconds": 1}
        container["livenessProbe"] = {**probe, "failureThreshold": 3, "periodSeconds": 30}
    return container


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
