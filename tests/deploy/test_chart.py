"""NVIDIA's chart with dradriver's image: each container's exact command line, run against the sandbox.

The ``gpus`` and ``compute-domains`` containers of the kubelet-plugin DaemonSet, the compute-domain controller's
container, the IMEX daemon container of the DaemonSet that controller creates (taken from the API after the
controller reconciled a ComputeDomain, i.e. what dradriver's controller really makes), and the optional admission
webhook's container (``webhook.enabled``; its Secret at ``/cert`` is a certificate the test makes).

:mod:`tests.deploy.chart` renders the chart's containers from the chart's facts with
``deploy/helm/values-dradriver.yaml`` merged over NVIDIA's defaults, for a host-installed driver
(``nvidiaDriverRoot: /``) and for the GPU Operator's (``/run/nvidia/driver``). The tests run ``bash -c <script>``
(or the container's command) with the kubelet's ``$(VAR)`` expansion, so ``gpu-kubelet-plugin -v 4``,
``compute-domain-kubelet-plugin -v 4``, ``compute-domain-controller -v 4`` and ``compute-domain-daemon -v 4 run``
are what start, found on ``PATH`` as the console scripts ``pyproject.toml`` declares; the daemon's probe
``compute-domain-daemon check`` runs in the daemon container's environment. Every variable the chart sets is
checked to be an environment twin of one of the binary's flags (or one NVIDIA's binaries do not read either), so a
missing flag fails by its name.

What a pod would get from its mounts, which a test without a container runtime cannot make, is given by
dradriver's own path flags instead: the chart's container paths (``/var/run/cdi``, ``/driver-root``) become the
sandbox node's directories, ``/proc``, ``/sys`` and ``/dev`` the node's (``PROC_ROOT``, ``SYSFS_ROOT``,
``DEV_ROOT``), and the ServiceAccount token the emulator's kubeconfig. The node's GPUs are the mock NVML library,
installed as the driver's ``libnvidia-ml.so.1`` under the driver root (so the plugin finds NVML there, as with a
real driver) and told its node by ``DRADRIVER_MOCK_NVML_PROFILE``. Operator values that would clash on a shared
machine (healthcheck and metrics ports, the kubelet directories) are set as an operator would set them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dradriver import config
from dradriver.commands import compute_domain_controller, compute_domain_daemon, webhook
from dradriver.domain import computedomains as cds
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER
from dradriver.nvml import mock
from dradriver.sandbox.kubelet import SyncKubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.computedomain.cdplugin_helpers import write_imex_proc
from tests.plugin.conftest import claim_object, ref_of, result, set_allocation
from tests.webhook.tls import make_certificate, running_webhook

from . import chart

REPO = Path(__file__).resolve().parents[2]
VALUES_FILE = REPO / "deploy" / "helm" / "values-dradriver.yaml"
NAMESPACE = "nvidia-dra-driver-gpu"
SERVICE_ACCOUNT = "nvidia-dra-driver-gpu-service-account-kubeletplugin"
CD_DRIVER = COMPUTE_DOMAIN_DRIVER.driver_name
#: klog's header: level letter, mmdd, time with microseconds, pid (7 wide), file:line, "] ".
KLOG = re.compile(r"^[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d{6} [ \d]{7,} [\w.-]+\.py:\d+\] ")
#: Hang guard for start-up (the chart's startup probe allows 600 s; the sandbox needs seconds).
START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _console_script(bin_dir: Path, name: str) -> Path:
    """An executable ``name`` as pip generates it from ``[project.scripts]`` in pyproject.toml."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts[name].partition(":")
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n")
    path.chmod(0o755)
    return path


def _install_mock_nvml(driver_root: Path) -> Path:
    """Make the driver tree's ``libnvidia-ml.so.1`` the mock library (the link stays, its target is replaced)."""
    link = driver_root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvidia-ml.so.1"
    target = link.resolve()
    target.unlink()
    shutil.copy(mock.library_path(), target)
    return link


def _values(sandbox: SandboxNode, driver_root: str, health_port: int, metrics_port: int) -> dict[str, Any]:
    operator = {
        "nvidiaDriverRoot": driver_root,
        "kubeletPlugin": {
            "kubeletRegistrarDirectoryPath": str(sandbox.root / "registry"),
            "kubeletPluginsDirectoryPath": str(sandbox.root / "plugins"),
            "metrics": {"gpuHttpEndpoint": f"127.0.0.1:{metrics_port}"},
            "containers": {"gpus": {"healthcheckPort": health_port,
                                    "env": [{"name": "ADDITIONAL_XIDs_TO_IGNORE", "value": "13,31"}]}},
        },
    }
    return chart.values(yaml.safe_load(VALUES_FILE.read_text()), operator)


def _liveness(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                          timeout=10)
        return int(reply.status)


def _until(what: str, check: Any, proc: subprocess.Popen[bytes], log: Path) -> Any:
    """Retry ``check()`` (as the kubelet's startup probe does) until it returns a truthy value."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args!r} exited ({proc.returncode}) before {what}:\n{log.read_text()}")
        try:
            found = check()
        except (grpc.RpcError, OSError):
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {START_TIMEOUT_S:g} s:\n{log.read_text()}")
        time.sleep(0.1)


def test_values_file_changes_the_image_and_the_gates_and_nothing_of_the_plugin_command() -> None:
    ours = chart.values(yaml.safe_load(VALUES_FILE.read_text()))
    nvidia = chart.values()
    container, original = chart.gpus_container(ours), chart.gpus_container(nvidia)
    assert container["image"] == "REGISTRY/dradriver:0.1.0-nvidia-chart"
    assert container["command"] == original["command"] == ["bash", "-c"]
    assert container["args"] == original["args"]
    assert container["args"][0].endswith("gpu-kubelet-plugin -v $(LOG_VERBOSITY)")
    env = {e["name"]: e for e in container["env"]}
    assert env["FEATURE_GATES"]["value"] == ("ComputeDomainCliques=true,IMEXDaemonsWithDNSNames=true,"
                                             "NVMLDeviceHealthCheck=true,")
    assert env["IMAGE_NAME"]["value"] == container["image"]
    assert {e["name"] for e in original["env"]} | {"FEATURE_GATES"} == set(env)
    assert container["startupProbe"]["grpc"] == {"port": 51516, "service": "liveness"}
    assert chart.init_container(ours)["command"] == ["bash", "/usr/bin/kubelet-plugin-prestart.sh"]
    assert ours["resources"]["computeDomains"]["enabled"] is True
    cd_container, cd_original = chart.compute_domains_container(ours), chart.compute_domains_container(nvidia)
    assert cd_container["args"] == cd_original["args"]
    assert cd_container["args"][0].endswith("compute-domain-kubelet-plugin -v $(LOG_VERBOSITY)")
    assert {e["name"] for e in cd_original["env"]} | {"FEATURE_GATES"} == {e["name"] for e in cd_container["env"]}
    assert cd_container["livenessProbe"]["grpc"] == {"port": 51515, "service": "liveness"}
    controller = chart.controller_container(ours, NAMESPACE)
    assert controller["command"] == chart.controller_container(nvidia, NAMESPACE)["command"] == [
        "compute-domain-controller", "-v", "$(LOG_VERBOSITY)"]
    assert {e["name"]: e for e in controller["env"]}["IMAGE_NAME"]["value"] == container["image"]


def _parsed_env(container: dict[str, Any], flags: tuple[config.Flag, ...]) -> Any:
    """The ``argparse`` namespace a binary with ``flags`` builds from ``container``'s environment (downward values
    filled in as the kubelet fills them)."""
    import argparse

    downward = {"spec.nodeName": "node-a", "metadata.namespace": NAMESPACE, "metadata.name": "pod-a",
                "metadata.uid": "0b5f4c1e-8d2a-4c55-9a4e-5d1f2e3c4b5a"}
    environ = {e["name"]: e["value"] if "value" in e else downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
               for e in container["env"]}
    parser = argparse.ArgumentParser()
    config.add_flags(parser, flags, environ=environ)
    return parser.parse_args([])


def test_the_chart_s_imex_mode_value_and_a_plugin_env_entry_give_pre_warmed_imex_with_binding_conditions() -> None:
    """NVIDIA's value ``resources.computeDomains.imex.mode: preWarmed`` reaches the plugin and the controller as
    ``IMEX_MODE`` (the plugin then isolates by channel and labels its clique); ``BINDING_CONDITIONS``, which NVIDIA's
    chart has no value for, goes in the chart's ``kubeletPlugin.containers.computeDomains.env``, as
    ``values-dradriver.yaml`` shows."""
    operator = {"resources": {"computeDomains": {"imex": {"mode": "preWarmed"}}},
                "kubeletPlugin": {"containers": {"computeDomains": {"env": [{"name": "BINDING_CONDITIONS",
                                                                             "value": "true"}]}}}}
    v = chart.values(yaml.safe_load(VALUES_FILE.read_text()), operator)
    plugin = config.compute_domain_config_from_args(
        _parsed_env(chart.compute_domains_container(v), (*config.COMPUTE_DOMAIN_PLUGIN_FLAGS, *[
            f for f in config.PLUGIN_FLAGS if f not in config.COMPUTE_DOMAIN_PLUGIN_FLAGS])))
    assert (plugin.imex_mode, plugin.imex_isolation, plugin.gpu_clique_label_enabled, plugin.binding_conditions) == (
        "preWarmed", "channel", True, True)
    controller = compute_domain_controller.config_from_args(
        _parsed_env(chart.controller_container(v, NAMESPACE), compute_domain_controller.FLAGS))
    assert controller.settings.imex_mode == "preWarmed" and controller.settings.pre_warmed
    assert controller.settings.image == chart.full_image(v)  # the clique daemons run the controller's image
    default = config.compute_domain_config_from_args(_parsed_env(chart.compute_domains_container(chart.values(
        yaml.safe_load(VALUES_FILE.read_text()))), (*config.COMPUTE_DOMAIN_PLUGIN_FLAGS, *[
            f for f in config.PLUGIN_FLAGS if f not in config.COMPUTE_DOMAIN_PLUGIN_FLAGS])))
    assert (default.imex_mode, default.binding_conditions) == ("driverManaged", False)  # the values file's defaults


#: Environment the chart sets that no flag of the binary reads, as with NVIDIA's binaries (the container runtime's
#: variables, the kubelet's ``$(LOG_VERBOSITY)`` expansion, the chart's own script's switch).
NOT_FLAGS = {"LOG_VERBOSITY", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_MIG_CONFIG_DEVICES", "MASK_NVIDIA_DRIVER_PARAMS"}


def _flag_envs(flags: tuple[config.Flag, ...]) -> set[str]:
    return {env for flag in (*flags, *config.LOGGING_FLAGS) for env in flag.envs}


@pytest.mark.parametrize(("render", "flags"), [
    (chart.gpus_container, config.PLUGIN_FLAGS),
    (chart.compute_domains_container, config.COMPUTE_DOMAIN_PLUGIN_FLAGS),
    (lambda v: chart.controller_container(v, NAMESPACE), compute_domain_controller.FLAGS),
    (chart.webhook_container, webhook.FLAGS),
], ids=["gpus", "compute-domains", "controller", "webhook"])
def test_every_variable_the_chart_sets_is_a_flag_twin_of_its_binary(render: Any,
                                                                     flags: tuple[config.Flag, ...]) -> None:
    operator = {"featureGates": {"MPSSupport": True}, "nvidiaCDIHookPath": "/usr/local/bin/nvidia-cdi-hook",
                "consumableShares": "memory", "altProcDevices": "/x", "imagePullSecrets": [{"name": "s"}]}
    env = {e["name"] for e in render(chart.values(yaml.safe_load(VALUES_FILE.read_text()), operator))["env"]}
    missing = sorted(env - NOT_FLAGS - _flag_envs(flags))
    assert not missing, f"the chart sets {missing}, which no flag of the binary reads as its environment twin"


def _start(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM (as the kubelet stops a container), then the exit code; anything left is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _klog_clean(text: str) -> None:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and KLOG.match(lines[0]), text
    assert "Traceback" not in text, text


def _image_env(sandbox: SandboxNode, bin_dir: Path, *names: str) -> dict[str, str]:
    """What the image and the pod's mounts give every container: console scripts on ``PATH``, the ServiceAccount
    token (the emulator's kubeconfig)."""
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        _console_script(bin_dir, name)
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(REPO),
            "KUBECONFIG": sandbox.kubeconfig}


@pytest.fixture
def gb200() -> Any:
    """A GB200 NVL72 node (NVLink clique ``<clusterUUID>.2``) with the driver's IMEX files under ``/proc``."""
    with SandboxNode(profile="gb200-nvl72-node") as node:
        write_imex_proc(node)
        yield node


@pytest.mark.parametrize("driver_root", ["/", "/run/nvidia/driver"], ids=["host-driver", "gpu-operator"])
def test_compute_domains_command_line_starts_registers_and_answers_liveness(gb200: SandboxNode, tmp_path: Path,
                                                                            driver_root: str) -> None:
    sandbox = gb200
    health_port, metrics_port = _free_port(), _free_port()
    operator = {
        "nvidiaDriverRoot": driver_root,
        "kubeletPlugin": {
            "kubeletRegistrarDirectoryPath": str(sandbox.root / "registry"),
            "kubeletPluginsDirectoryPath": str(sandbox.root / "plugins"),
            "metrics": {"computeDomainHttpEndpoint": f"127.0.0.1:{metrics_port}"},
            "containers": {"computeDomains": {"healthcheckPort": health_port, "gpuCliqueLabelEnabled": True}},
        },
    }
    container = chart.compute_domains_container(chart.values(yaml.safe_load(VALUES_FILE.read_text()), operator))
    env = chart.container_env(container, {"spec.nodeName": sandbox.node_name, "metadata.namespace": NAMESPACE})
    assert env["NVIDIA_DRIVER_ROOT"] == driver_root and env["IMEX_MODE"] == "driverManaged"
    assert env["IMEX_ISOLATION"] == "domain" and env["HEALTHCHECK_PORT"] == str(health_port)
    env["CDI_ROOT"] = {"/var/run/cdi": str(sandbox.cdi_root)}[env["CDI_ROOT"]]
    _install_mock_nvml(sandbox.driver_root)
    env.update(_image_env(sandbox, tmp_path / "bin", "compute-domain-kubelet-plugin"))
    env.update({
        "DRIVER_ROOT_CTR_PATH": str(sandbox.driver_root),  # the chart's /driver-root mount
        "PROC_ROOT": str(sandbox.root / "proc"),
        "SYSFS_ROOT": str(sandbox.root / "sys"),
        "DEV_ROOT": str(sandbox.root),
        mock.PROFILE_ENV: str(mock.profile_path(sandbox.profile)),
    })
    argv = [*container["command"], *(chart.expand(arg, env) for arg in container["args"])]
    assert argv[-1].endswith("compute-domain-kubelet-plugin -v 4")
    log = tmp_path / "plugin.log"
    proc = _start(argv, env, tmp_path, log)
    try:
        with SyncKubeletEmulator(Path(env["KUBELET_REGISTRAR_DIRECTORY_PATH"])) as kubelet:
            connection = kubelet.wait_for_plugin(CD_DRIVER, timeout=START_TIMEOUT_S)
            assert connection.name == CD_DRIVER
        serving = health_pb2.HealthCheckResponse.SERVING
        assert _until("SERVING on liveness", lambda: _liveness(health_port) == serving, proc, log)
        assert sandbox.api is not None
        api = sandbox.api
        slices = _until("ResourceSlice", lambda: [s for s in api.objects("ResourceSlice")
                                                  if s["spec"].get("nodeName") == sandbox.node_name], proc, log)
        assert slices[0]["spec"]["driver"] == CD_DRIVER
        # GPU_CLIQUE_LABEL_ENABLED=true: the node's NVLink clique as a label.
        clique = _until("the nvidia.com/gpu.clique label", lambda: ((api.get("Node", sandbox.node_name) or {})
                        .get("metadata", {}).get("labels") or {}).get("nvidia.com/gpu.clique"), proc, log)
        assert clique.endswith(".2")
        # The chart's HTTP_ENDPOINT (:8081 by default) and METRICS_PATH: the request metrics of this driver.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200
            assert b'nvidia_dra_requests_inflight{driver="compute-domain.nvidia.com"' in response.read()
    finally:
        code = _stop(proc)
    text = log.read_text()
    assert code == 0, text
    _klog_clean(text)
    startup = next(line for line in text.splitlines() if KLOG.match(line) and "startup config:" in line)
    assert f"nvidia_driver_root={driver_root} " in startup
    assert "feature_gates=" in startup and "ComputeDomainCliques=true" in startup, startup


@pytest.mark.slow
def test_controller_command_line_reconciles_and_its_daemon_container_runs(gb200: SandboxNode,
                                                                          tmp_path: Path) -> None:
    sandbox = gb200
    assert sandbox.api is not None
    api = sandbox.api
    metrics_port = _free_port()
    operator = {"controller": {"leaderElection": {"enabled": True},
                               "metrics": {"httpEndpoint": f"127.0.0.1:{metrics_port}"}}}
    values = chart.values(yaml.safe_load(VALUES_FILE.read_text()), operator)
    container = chart.controller_container(values, NAMESPACE)
    pod_name = "nvidia-dra-driver-gpu-controller-7d9f8-x2x4q"
    env = chart.container_env(container, {"metadata.name": pod_name, "metadata.namespace": NAMESPACE})
    assert env["LEADER_ELECTION_ENABLED"] == "true" and env["LEADER_ELECTION_LEASE_DURATION"] == "15s"
    env.update(_image_env(sandbox, tmp_path / "bin", "compute-domain-controller", "compute-domain-daemon"))
    argv = [chart.expand(arg, env) for arg in container["command"]]
    assert argv == ["compute-domain-controller", "-v", "4"]
    log = tmp_path / "controller.log"
    proc = _start(argv, env, tmp_path, log)
    try:
        lease_name = env["LEADER_ELECTION_LEASE_LOCK_NAME"]
        holder = _until("the Lease", lambda: ((api.get("Lease", lease_name, NAMESPACE) or {}).get("spec") or {})
                        .get("holderIdentity"), proc, log)
        assert str(holder).startswith(f"{pod_name}-")
        domain = api.create({"apiVersion": cds.API_GROUP_VERSION, "kind": cds.COMPUTE_DOMAIN_KIND,
                             "metadata": {"name": "chart-cd", "namespace": "default"},
                             "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": "chart-cd-ch"}}}})
        uid = domain["metadata"]["uid"]
        name = f"computedomain-daemon-{uid}"
        _until("the finalizer", lambda: cds.FINALIZER in ((api.get(cds.COMPUTE_DOMAIN_KIND, "chart-cd", "default")
                                                           or {}).get("metadata", {}).get("finalizers") or []),
               proc, log)
        assert _until("the workload template", lambda: api.get("ResourceClaimTemplate", "chart-cd-ch", "default"),
                      proc, log)
        assert _until("the daemon template", lambda: api.get("ResourceClaimTemplate", name, NAMESPACE), proc, log)
        daemon_set = _until("the DaemonSet", lambda: api.get("DaemonSet", name, NAMESPACE), proc, log)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200
    finally:
        code = _stop(proc)
    text = log.read_text()
    assert code == 0, text
    _klog_clean(text)

    # The daemon container the controller made, against the contract (command, probes, environment, image).
    [daemon] = daemon_set["spec"]["template"]["spec"]["containers"]
    assert daemon["image"] == env["IMAGE_NAME"]
    assert daemon["command"] == ["compute-domain-daemon", "-v", "$(LOG_VERBOSITY)", "run"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert daemon[probe]["exec"]["command"] == ["compute-domain-daemon", "check"], probe
    daemon_env = {e["name"] for e in daemon["env"]}
    wanted = {"LOG_VERBOSITY", "MAX_NODES_PER_IMEX_DOMAIN", "NODE_NAME", "POD_IP", "POD_UID", "POD_NAME",
              "POD_NAMESPACE", "NVIDIA_VISIBLE_DEVICES", "FEATURE_GATES"}
    assert not wanted - daemon_env, f"the daemon container lacks {sorted(wanted - daemon_env)}"
    daemon_flags = _flag_envs(compute_domain_daemon.DAEMON_FLAGS)
    missing = sorted(daemon_env - NOT_FLAGS - daemon_flags)
    assert not missing, f"the daemon container sets {missing}, which no flag of compute-domain-daemon reads"

    # Run it as the kubelet would on a node in no NVLink clique: the pod's fields, the daemon claim's CDI env.
    pod = api.create({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": f"{name}-abcde", "namespace": NAMESPACE,
                                   "labels": {cds.LABEL_COMPUTE_DOMAIN: uid}},
                      "spec": {"nodeName": sandbox.node_name, "containers": [{"name": "compute-domain-daemon",
                                                                              "image": daemon["image"]}]},
                      "status": {"phase": "Running", "podIP": "127.0.0.1"}})
    meta = pod["metadata"]
    denv = chart.container_env(daemon, {"spec.nodeName": sandbox.node_name, "status.podIP": "127.0.0.1",
                                        "metadata.uid": meta["uid"], "metadata.name": meta["name"],
                                        "metadata.namespace": NAMESPACE})
    imexd = tmp_path / "imexd"
    imexd.mkdir()
    denv.update(_image_env(sandbox, tmp_path / "bin"))
    denv.update({"CLIQUE_ID": "", "COMPUTE_DOMAIN_UUID": uid, "COMPUTE_DOMAIN_NAME": "chart-cd",
                 "COMPUTE_DOMAIN_NAMESPACE": "default", "DRADRIVER_IMEXD_DIR": str(imexd),
                 "DRADRIVER_HOSTS_FILE": str(tmp_path / "hosts")})
    dargv = [chart.expand(arg, denv) for arg in daemon["command"]]
    assert dargv == ["compute-domain-daemon", "-v", "4", "run"]
    dlog = tmp_path / "daemon.log"
    dproc = _start(dargv, denv, tmp_path, dlog)
    try:
        _until("the daemon idling", lambda: "in no NVLink clique: idle" in dlog.read_text(), dproc, dlog)
        check = subprocess.run(daemon["livenessProbe"]["exec"]["command"], env=denv, cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        dcode = _stop(dproc)
    dtext = dlog.read_text()
    assert dcode == 0, dtext
    _klog_clean(dtext)


@pytest.mark.parametrize("driver_root", ["/", "/run/nvidia/driver"], ids=["host-driver", "gpu-operator"])
def test_chart_command_line_starts_registers_and_answers_liveness(sandbox: SandboxNode, tmp_path: Path,
                                                                  driver_root: str) -> None:
    health_port, metrics_port = _free_port(), _free_port()
    container = chart.gpus_container(_values(sandbox, driver_root, health_port, metrics_port))
    env = chart.container_env(container, {"spec.nodeName": sandbox.node_name, "metadata.namespace": NAMESPACE,
                                          "spec.serviceAccountName": SERVICE_ACCOUNT})
    assert env["NVIDIA_DRIVER_ROOT"] == driver_root and env["LOG_VERBOSITY"] == "4"
    assert env["HEALTHCHECK_PORT"] == str(health_port)
    mounts = {"/var/run/cdi": str(sandbox.cdi_root)}
    env["CDI_ROOT"] = mounts[env["CDI_ROOT"]]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _console_script(bin_dir, "gpu-kubelet-plugin")
    _install_mock_nvml(sandbox.driver_root)
    env.update({
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",  # the image's PATH, console scripts first
        "PYTHONPATH": str(REPO),
        "DRIVER_ROOT_CTR_PATH": str(sandbox.driver_root),  # the chart's /driver-root mount
        "PROC_ROOT": str(sandbox.root / "proc"),
        "SYSFS_ROOT": str(sandbox.root / "sys"),
        "DEV_ROOT": str(sandbox.root),
        "KUBECONFIG": sandbox.kubeconfig,  # the ServiceAccount token mount
        mock.PROFILE_ENV: str(mock.profile_path(sandbox.profile)),  # the node's GPUs
        config.IMAGE_CDI_HOOK_ENV: str(sandbox.image_cdi_hook),  # the image's /usr/bin/nvidia-cdi-hook (the stand-in)
    })
    argv = [*container["command"], *(chart.expand(arg, env) for arg in container["args"])]
    assert argv[-1].endswith("gpu-kubelet-plugin -v 4")
    log = tmp_path / "plugin.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        with SyncKubeletEmulator(Path(env["KUBELET_REGISTRAR_DIRECTORY_PATH"])) as kubelet:
            connection = kubelet.wait_for_plugin("gpu.nvidia.com", timeout=START_TIMEOUT_S)
            assert connection.name == "gpu.nvidia.com"
            # A claim prepared under the chart's environment: its CDI spec names host files under the chart's
            # driver root (NVIDIA_DRIVER_ROOT), read through the container's mount (/driver-root).
            assert sandbox.api is not None
            claim = set_allocation(sandbox, sandbox.api.create(claim_object("chart-claim")), [result("gpu-0")])
            prepared = connection.prepare([ref_of(claim)])[claim["metadata"]["uid"]]
            assert prepared.error == "" and [d.device_name for d in prepared.devices] == ["gpu-0"]
        serving = health_pb2.HealthCheckResponse.SERVING
        status = _until("SERVING on liveness", lambda: _liveness(health_port) == serving, proc, log)
        assert status
        assert sandbox.api is not None
        api = sandbox.api
        slices = _until("ResourceSlice", lambda: [s for s in api.objects("ResourceSlice")
                                                  if s["spec"].get("nodeName") == sandbox.node_name], proc, log)
        assert slices[0]["spec"]["driver"] == "gpu.nvidia.com"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200 and b"dradriver_" in response.read()
    finally:
        # The kubelet stops a container by SIGTERM to its first process. bash execs the script's last command, so
        # that is the plugin itself, which stops cleanly; anything left over is killed afterwards.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text
    lines = [line for line in text.splitlines() if line.strip()]
    headers = [line for line in lines if KLOG.match(line)]
    assert lines and KLOG.match(lines[0]), text
    startup = next(line for line in headers if "startup config:" in line)
    assert f"nvidia_driver_root={driver_root} " in startup
    assert "additional_xids_to_ignore=13,31 " in startup  # the mixed-case ADDITIONAL_XIDs_TO_IGNORE
    assert f"namespace={NAMESPACE} " in startup and f"service_account_name={SERVICE_ACCOUNT} " in startup
    assert "NVMLDeviceHealthCheck=true" in startup.split("feature_gates=")[1].split(" ")[0]
    specs = [json.loads(p.read_text()) for p in sandbox.cdi_root.glob("*.yaml")]
    host_paths = [m["hostPath"] for spec in specs for m in spec.get("containerEdits", {}).get("mounts", [])]
    libcuda = [p for p in host_paths if "/libcuda.so." in p]
    prefix = "" if driver_root == "/" else driver_root
    assert libcuda and all(p.startswith(f"{prefix}/usr/lib/x86_64-linux-gnu/") for p in libcuda), host_paths
    assert f"NVML library {sandbox.driver_root}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." in text  # found there
    assert "Traceback" not in text, text


@pytest.mark.parametrize(("component", "operator", "named"), [
    ("compute-domains", {"featureGates": {"ComputeDomainCliques": False}}, "ComputeDomainCliques=false"),
    ("compute-domains", {"featureGates": {"IMEXDaemonsWithDNSNames": False}}, "IMEXDaemonsWithDNSNames=false"),
    ("compute-domains", {"resources": {"computeDomains": {"imex": {"isolation": "channel"}}}}, "IMEX_ISOLATION"),
    ("controller", {"featureGates": {"ComputeDomainCliques": False}}, "ComputeDomainCliques=false"),
    ("controller", {"resources": {"computeDomains": {"imex": {"isolation": "channel"}}}}, "IMEX_ISOLATION"),
], ids=["plugin-cliques-off", "plugin-dns-names-off", "plugin-channel-isolation", "controller-cliques-off",
        "controller-channel-isolation"])
def test_chart_values_dradriver_refuses_stop_at_start_naming_the_value(sandbox: SandboxNode, tmp_path: Path,
                                                                       component: str, operator: dict[str, Any],
                                                                       named: str) -> None:
    values = chart.values(yaml.safe_load(VALUES_FILE.read_text()), operator)
    downward = {"spec.nodeName": sandbox.node_name, "metadata.namespace": NAMESPACE, "metadata.name": "ctl-0"}
    if component == "controller":
        container = chart.controller_container(values, NAMESPACE)
        env = chart.container_env(container, downward)
        env.update(_image_env(sandbox, tmp_path / "bin", "compute-domain-controller"))
        argv = [chart.expand(arg, env) for arg in container["command"]]
    else:
        container = chart.compute_domains_container(values)
        env = chart.container_env(container, downward)
        env.update(_image_env(sandbox, tmp_path / "bin", "compute-domain-kubelet-plugin"))
        argv = [*container["command"], *(chart.expand(arg, env) for arg in container["args"])]
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_chart_webhook_command_line_serves_https_and_refuses_a_config_prepare_would(tmp_path: Path) -> None:
    """``webhook.enabled: true`` with the values file: the chart's exact command line and environment (its gates
    included) start dradriver's ``webhook``; the Secret mounted at ``/cert`` is the test's certificate."""
    port = _free_port()
    values = chart.values(yaml.safe_load(VALUES_FILE.read_text()), {"webhook": {"enabled": True,
                                                                               "containerPort": port}})
    container = chart.webhook_container(values)
    env = chart.container_env(container, {})
    assert env["FEATURE_GATES"].startswith("ComputeDomainCliques=true,")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _console_script(bin_dir, "webhook")
    env.update({"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    cert = make_certificate(tmp_path / "cert")
    argv = [*container["command"], *(a.replace("=/cert/", f"={tmp_path / 'cert'}/") for a in container["args"])]
    assert argv[0] == "webhook" and argv[-1] == f"--port={port}"
    log = tmp_path / "webhook.log"
    with running_webhook(argv, env, port, cert.context(), log):
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "3c1f", "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "object": {"spec": {"devices": {"config": [{"opaque": {"driver": "gpu.nvidia.com", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS"}}}}]}}}}}
        request = urllib.request.Request(f"https://localhost:{port}/validate-resource-claim-parameters",
                                         data=json.dumps(review).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=cert.context(), timeout=10) as answer:
            response = json.loads(answer.read())["response"]
    assert response["uid"] == "3c1f" and response["allowed"] is False
    assert '"MPSSupport" feature gate is not enabled' in response["status"]["message"]
    _klog_clean(log.read_text())
