"""The sandbox's Deployment controller and container runner (dradriver.sandbox.workloads)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.workloads import FINALIZER, Workloads, path_map, pids_with_marker, translate


def _until(predicate: Callable[[], Any], timeout: float = 15.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture
def cluster(short_dir: Path) -> Iterator[tuple[ApiServerEmulator, Workloads, Path]]:
    with ApiServerEmulator() as api:
        api.add_node("node-a")
        workloads = Workloads(api, "node-a", short_dir / "pods", time_scale=0.05).start()
        try:
            yield api, workloads, short_dir
        finally:
            workloads.stop()


def _deployment(host: Path, script: str, *, probe: bool = True) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main", "image": "busybox", "command": ["sh", "-c", script],
        "env": [{"name": "WHERE", "value": "/data/out"}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    if probe:
        container["startupProbe"] = {"exec": {"command": ["cat", "/data/ready"]}, "periodSeconds": 1}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"nodeName": "node-a", "containers": [container],
                                       "volumes": [{"name": "data", "hostPath": {"path": str(host)}}]}}},
    }


def test_mount_paths_become_host_paths_as_whole_prefixes() -> None:
    mapping = path_map({"volumeMounts": [{"name": "a", "mountPath": "/driver-root"},
                                         {"name": "b", "mountPath": "/driver-root/tmp/nvidia-mps"},
                                         {"name": "c", "mountPath": "/empty"}]},
                       [{"name": "a", "hostPath": {"path": "/host/root"}}, {"name": "b", "hostPath": {"path": "/p"}},
                        {"name": "c", "emptyDir": {}}])
    assert mapping == [("/driver-root/tmp/nvidia-mps", "/p"), ("/driver-root", "/host/root")]
    assert translate('x=/driver-root/tmp/nvidia-mps/control "/driver-root" /driver-rootx /a/driver-root',
                     mapping) == 'x=/p/control "/host/root" /driver-rootx /a/driver-root'


def test_deployment_pod_runs_locally_and_becomes_ready(cluster: tuple[ApiServerEmulator, Workloads, Path]) -> None:
    api, _, root = cluster
    host = root / "data"
    host.mkdir()
    api.create(_deployment(host, 'echo "$WHERE" > /data/env; sleep 0.2; touch /data/ready; exec sleep 60'))
    deployment = _until(lambda: (d := api.get("Deployment", "web", "default")) and
                        (d.get("status") or {}).get("readyReplicas") == 1 and d)
    assert deployment["status"]["replicas"] == 1
    [pod] = api.objects("Pod", "default")
    assert pod["metadata"]["name"].startswith("web-") and pod["metadata"]["labels"] == {"app": "web"}
    assert pod["metadata"]["ownerReferences"][0]["uid"] == deployment["metadata"]["uid"]
    assert FINALIZER in pod["metadata"]["finalizers"]
    [status] = pod["status"]["containerStatuses"]
    assert status["ready"] and status["started"] and "running" in status["state"]
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    assert (host / "env").read_text() == f"{host}/out\n"  # env values see the host path of the mount


def test_deleting_the_deployment_stops_every_process_before_the_pod_goes(
        cluster: tuple[ApiServerEmulator, Workloads, Path]) -> None:
    api, _, root = cluster
    host = root / "data"
    host.mkdir()
    # a detached grandchild in its own session, as `nvidia-cuda-mps-control -d` makes
    api.create(_deployment(host, "setsid sleep 300 & touch /data/ready; exec sleep 300"))
    pod = _until(lambda: [p for p in api.objects("Pod", "default")
                          if (p.get("status") or {}).get("phase") == "Running"])[0]
    marker = f"{pod['metadata']['uid']}/main"
    _until(lambda: len(pids_with_marker(marker)) >= 2)
    api.delete("Deployment", "web", "default")
    _until(lambda: not api.objects("Pod", "default"))
    assert pids_with_marker(marker) == []


def test_an_exited_container_is_restarted_and_not_ready_meanwhile(
        cluster: tuple[ApiServerEmulator, Workloads, Path]) -> None:
    api, _, root = cluster
    host = root / "data"
    host.mkdir()
    api.create(_deployment(host, "echo run >> /data/runs; exit 3", probe=False))
    _until(lambda: len((host / "runs").read_text().split()) >= 2 if (host / "runs").exists() else False)
    [pod] = api.objects("Pod", "default")
    assert pod["status"]["containerStatuses"][0]["restartCount"] >= 1
    deployment = api.get("Deployment", "web", "default")
    assert deployment is not None and "readyReplicas" not in deployment["status"]
