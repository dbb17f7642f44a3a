"""NVIDIA's MPS contract in the pure part: daemon ID, shm size, Deployment, readiness rule, workload edits."""

from __future__ import annotations

import dataclasses
from typing import Any

import kubernetes_validate
import pytest

from dradriver.domain import mps
from dradriver.domain.cdi import Mount

UID = "c1a2b3c4-0000-4000-8000-000000000001"
DAEMON = mps.ControlDaemon(mps.control_daemon_id(UID, ["GPU-b", "GPU-a"]), UID, ("GPU-a", "GPU-b"), ("GPU-a",),
                           40, (("GPU-a", "1024M"), ("GPU-b", "2048M")), True)
PLACEMENT = mps.DaemonPlacement("dradriver", "node-a", "registry.example/dradriver:0.1.0", "/run/nvidia/driver",
                                f"/var/lib/kubelet/plugins/gpu.nvidia.com/mps/{DAEMON.daemon_id}/",
                                feature_gates="MPSSupport=true")


def test_daemon_id_is_claim_uid_and_five_hex_of_sha256_of_sorted_uuids() -> None:
    # sha256("GPU-a,GPU-b") = 95a93...: the order the UUIDs come in does not matter
    assert mps.control_daemon_id(UID, ["GPU-b", "GPU-a"]) == f"{UID}-95a93"
    assert mps.control_daemon_id(UID, ["GPU-a", "GPU-b"]) == f"{UID}-95a93"
    assert mps.control_daemon_id(UID, ["GPU-a"]) != f"{UID}-95a93"
    assert DAEMON.deployment == f"mps-control-daemon-{UID}-95a93"


@pytest.mark.parametrize(("meminfo", "size"), [
    ("MemTotal:       16314612 kB\nMemFree: 1 kB\n", "8157306k"),
    ("MemFree: 1 kB\nMemTotal:       2113412036 kB\n", "1056706018k"),
    ("MemTotal: 7 kB\n", "3k"),
    ("MemFree: 1 kB\n", "65536k"),
    ("", "65536k"),
    (None, "65536k"),
])
def test_shm_size_is_half_of_memtotal_with_its_unit(meminfo: str | None, size: str) -> None:
    assert mps.shm_size(meminfo) == size
    assert mps.tmpfs_options(size) == f"rw,nosuid,nodev,noexec,relatime,size={size}"


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    [container] = manifest["spec"]["template"]["spec"]["containers"]
    return container


def test_deployment_follows_nvidias_template_and_validates() -> None:
    manifest = mps.deployment_manifest(DAEMON, PLACEMENT)
    kubernetes_validate.validate(manifest, "1.34", strict=True)
    assert manifest["metadata"]["name"] == DAEMON.deployment
    assert manifest["metadata"]["namespace"] == "dradriver"
    spec = manifest["spec"]
    assert spec["replicas"] == 1
    assert spec["selector"] == {"matchLabels": {"app": DAEMON.deployment}}
    pod = spec["template"]["spec"]
    assert pod["nodeName"] == "node-a" and pod["hostPID"] is True
    container = _container(manifest)
    assert container["image"] == "registry.example/dradriver:0.1.0"
    assert container["securityContext"] == {"privileged": True}
    assert {e["name"]: e["value"] for e in container["env"]} == {
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b", "FEATURE_GATES": "MPSSupport=true"}
    probe = container["startupProbe"]
    assert probe["exec"]["command"] == ["cat", "/driver-root/var/log/nvidia-mps/startup.log"]
    assert probe["periodSeconds"] == 1
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    hosts = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    directory = f"/var/lib/kubelet/plugins/gpu.nvidia.com/mps/{DAEMON.daemon_id}"
    assert {mounts[n]: hosts[n] for n in mounts} == {
        "/driver-root": "/run/nvidia/driver",
        "/dev/shm": f"{directory}/shm",
        "/driver-root/tmp/nvidia-mps": f"{directory}/pipe",
        "/driver-root/var/log/nvidia-mps": f"{directory}/log",
    }


def test_container_script_runs_nvidias_commands_in_both_modes() -> None:
    script = _container(mps.deployment_manifest(DAEMON, PLACEMENT))["command"]
    assert script[:2] == ["sh", "-c"]
    text = script[2]
    assert "nvidia-cuda-mps-control -d -M" in text  # multiUser
    assert "echo set_default_active_thread_percentage 40 | nvidia-cuda-mps-control" in text
    assert "echo set_default_device_pinned_mem_limit GPU-a 1024M | nvidia-cuda-mps-control" in text
    assert "echo set_default_device_pinned_mem_limit GPU-b 2048M | nvidia-cuda-mps-control" in text
    assert "chroot /driver-root sh -c" in text  # a driver root with a shell
    assert 'export CUDA_MPS_PIPE_DIRECTORY="/driver-root/tmp/nvidia-mps"' in text  # and one without (GKE)
    assert 'export CUDA_MPS_LOG_DIRECTORY="/driver-root/var/log/nvidia-mps"' in text
    assert 'echo "startup complete" > "$CUDA_MPS_LOG_DIRECTORY/startup.log"' in text
    plain = mps.ControlDaemon("x-00000", "x", ("GPU-a",), ("GPU-a",))
    text = _container(mps.deployment_manifest(plain, PLACEMENT))["command"][2]
    assert "-M" not in text and "set_default_" not in text


def test_pull_settings_and_service_account_reach_the_pod() -> None:
    assert "serviceAccountName" not in mps.deployment_manifest(DAEMON, PLACEMENT)["spec"]["template"]["spec"]
    placement = dataclasses.replace(PLACEMENT, service_account="mps-sa", pull_secrets=("reg-a", "reg-b"),
                                    pull_policy="Always")
    manifest = mps.deployment_manifest(DAEMON, placement)
    kubernetes_validate.validate(manifest, "1.34", strict=True)
    pod = manifest["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mps-sa"
    assert pod["imagePullSecrets"] == [{"name": "reg-a"}, {"name": "reg-b"}]
    assert pod["containers"][0]["imagePullPolicy"] == "Always"


def test_shm_goes_under_the_driver_root_when_the_plugin_has_one_there() -> None:
    placement = dataclasses.replace(PLACEMENT, shm_in_driver_root=True)
    mounts = [m["mountPath"] for m in _container(mps.deployment_manifest(DAEMON, placement))["volumeMounts"]]
    assert "/driver-root/dev/shm" in mounts and "/dev/shm" not in mounts


def test_record_round_trips_and_rejects_bad_ids() -> None:
    assert mps.ControlDaemon.from_json(DAEMON.to_json()) == DAEMON
    with pytest.raises(ValueError, match="bad id"):
        mps.ControlDaemon.from_json({**DAEMON.to_json(), "id": "../etc"})
    with pytest.raises(ValueError, match="uuids"):
        mps.ControlDaemon.from_json({"id": "a", "claim": "b"})


def _pod(name: str = "p", ready: bool = True, containers: int = 1) -> dict[str, Any]:
    statuses = [{"name": "c", "ready": ready, "state": {"waiting": {"reason": "ContainerCreating"}}}] * containers
    return {"metadata": {"name": name}, "status": {"containerStatuses": statuses}}


@pytest.mark.parametrize(("deployment", "pods", "reason"), [
    (None, [], "the Deployment does not exist"),
    ({"status": {}}, [_pod()], "0 ready replica(s), not 1"),
    ({"status": {"readyReplicas": 1}}, [], "0 Pods match"),
    ({"status": {"readyReplicas": 1}}, [_pod("a"), _pod("b")], "2 Pods match"),
    ({"status": {"readyReplicas": 1}}, [_pod(containers=2)], "2 container statuses, not 1"),
    ({"status": {"readyReplicas": 1}}, [_pod(ready=False)], "container c of Pod p is not ready (waiting: "
                                                            "ContainerCreating)"),
])
def test_readiness_is_nvidias_rule(deployment: dict[str, Any] | None, pods: list[dict[str, Any]],
                                   reason: str) -> None:
    assert reason in mps.readiness(deployment, pods)
    assert mps.readiness({"status": {"readyReplicas": 1}}, [_pod()]) == ""


def test_workload_edits_give_the_pipe_directory_and_shm() -> None:
    edits = mps.workload_edits("/var/lib/kubelet/plugins/gpu.nvidia.com/mps/x/")
    assert edits.env == ("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",)
    options = ("rw", "nosuid", "nodev", "bind")
    assert edits.mounts == (
        Mount("/var/lib/kubelet/plugins/gpu.nvidia.com/mps/x/shm", "/dev/shm", options),
        Mount("/var/lib/kubelet/plugins/gpu.nvidia.com/mps/x/pipe", "/tmp/nvidia-mps", options),
    )
