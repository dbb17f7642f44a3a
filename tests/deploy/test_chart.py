"""NVIDIA's chart with dradriver's image: the ``gpus`` container's exact command line, run against the sandbox.

:mod:`tests.deploy.chart` renders the container from the chart's facts with ``deploy/helm/values-dradriver.yaml``
merged over NVIDIA's defaults, for a host-installed driver (``nvidiaDriverRoot: /``) and for the GPU Operator's
(``/run/nvidia/driver``). The test runs ``bash -c <script>`` with the kubelet's ``$(VAR)`` expansion, so
``gpu-kubelet-plugin -v 4`` is what starts, found on ``PATH`` as the console script ``pyproject.toml`` declares.

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

from dradriver.nvml import mock
from dradriver.sandbox.kubelet import SyncKubeletEmulator
from dradriver.sandbox.node import SandboxNode
from tests.plugin.conftest import claim_object, ref_of, result, set_allocation

from . import chart

REPO = Path(__file__).resolve().parents[2]
VALUES_FILE = REPO / "deploy" / "helm" / "values-dradriver.yaml"
NAMESPACE = "nvidia-dra-driver-gpu"
SERVICE_ACCOUNT = "nvidia-dra-driver-gpu-service-account-kubeletplugin"
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
            pytest.fail(f"the plugin exited ({proc.returncode}) before {what}:\n{log.read_text()}")
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
    assert env["FEATURE_GATES"]["value"] == "NVMLDeviceHealthCheck=true,"
    assert env["IMAGE_NAME"]["value"] == container["image"]
    assert {e["name"] for e in original["env"]} | {"FEATURE_GATES"} == set(env)
    assert container["startupProbe"]["grpc"] == {"port": 51516, "service": "liveness"}
    assert chart.init_container(ours)["command"] == ["bash", "/usr/bin/kubelet-plugin-prestart.sh"]
    assert ours["resources"]["computeDomains"]["enabled"] is False  # pending issue 13


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
    assert "feature_gates=NVMLDeviceHealthCheck=true " in startup
    specs = [json.loads(p.read_text()) for p in sandbox.cdi_root.glob("*.json")]
    host_paths = [m["hostPath"] for spec in specs for m in spec.get("containerEdits", {}).get("mounts", [])]
    libcuda = [p for p in host_paths if "/libcuda.so." in p]
    prefix = "" if driver_root == "/" else driver_root
    assert libcuda and all(p.startswith(f"{prefix}/usr/lib/x86_64-linux-gnu/") for p in libcuda), host_paths
    assert f"NVML library {sandbox.driver_root}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." in text  # found there
    assert "Traceback" not in text, text
