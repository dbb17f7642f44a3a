"""ControlDaemons, the reusable component: start/stop/sweep against the API emulator over HTTP, the sandbox's
workloads, NVML compute mode on the mock library, and tmpfs mounts (real where permitted)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dradriver.domain import mps
from dradriver.kube.client import RetryPolicy, open_client
from dradriver.nvml import discovery, settings
from dradriver.nvml.session import NvmlSession
from dradriver.preparers.mps import RECORD, ControlDaemons, MpsDaemonError
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode


@pytest.fixture
def node() -> Iterator[SandboxNode]:
    with SandboxNode(profile="dgx-h100") as sandbox:
        sandbox.run_workloads()
        yield sandbox


@dataclasses.dataclass
class Parts:
    daemons: ControlDaemons
    session: NvmlSession
    gpu: str


@pytest.fixture
def parts(node: SandboxNode, mock_session: Callable[[str], NvmlSession]) -> Iterator[Parts]:
    session = mock_session("dgx-h100")
    config = node.mps_config()
    client = open_client(config.kubeconfig, retry=RetryPolicy(attempts=1))
    placement = mps.DaemonPlacement(SANDBOX_NAMESPACE, node.node_name, "dradriver:sandbox",
                                    str(config.nvidia_driver_root), "")
    daemons = ControlDaemons(
        root=config.mps_root, client=client, placement=placement, meminfo=config.proc_root / "meminfo",
        set_compute_mode=lambda uuid, mode: settings.set_compute_mode(session, uuid, settings.ComputeMode[mode]),
        mounts=node.mounts)
    yield Parts(daemons, session, discovery.discover(session).gpus[0].uuid)
    client.close()


def test_start_waits_for_ready_and_stop_undoes_everything(node: SandboxNode, parts: Parts) -> None:
    daemons, session, gpu = parts.daemons, parts.session, parts.gpu
    daemon = mps.ControlDaemon(mps.control_daemon_id("claim-1", [gpu]), "claim-1", (gpu,), (gpu,), 10)
    daemons.start(daemon, deadline=time.monotonic() + 30)
    directory = daemons.directory(daemon.daemon_id)
    assert mps.ControlDaemon.from_json(json.loads((directory / RECORD).read_text())) == daemon
    assert node.mounts.is_mounted(directory / mps.SHM_DIR)
    assert settings.compute_mode(session, gpu) is settings.ComputeMode.EXCLUSIVE_PROCESS
    assert daemons.known() == [daemon.daemon_id]
    assert daemons.stop(daemon.daemon_id) is True
    assert not directory.exists() and not node.mounts.is_mounted(directory / mps.SHM_DIR)
    assert settings.compute_mode(session, gpu) is settings.ComputeMode.DEFAULT
    assert node.api is not None and node.api.objects("Deployment") == [] and node.api.objects("Pod") == []
    assert daemons.stop(daemon.daemon_id) is False  # idempotent


def test_a_refused_deployment_undoes_the_mount_and_compute_mode(node: SandboxNode, parts: Parts) -> None:
    daemons, session, gpu = parts.daemons, parts.session, parts.gpu
    daemon = mps.ControlDaemon(mps.control_daemon_id("claim-2", [gpu]), "claim-2", (gpu,), (gpu,))
    assert node.api is not None
    node.api.fail_next(status=403, method="POST", path=f"/apis/apps/v1/namespaces/{SANDBOX_NAMESPACE}/deployments")
    with pytest.raises(MpsDaemonError, match=r"mps-control-daemon-claim-2-.*POST deployments"):
        daemons.start(daemon)
    directory = daemons.directory(daemon.daemon_id)
    assert not directory.exists() and not node.mounts.is_mounted(directory / mps.SHM_DIR)
    assert settings.compute_mode(session, gpu) is settings.ComputeMode.DEFAULT


def test_sweep_stops_unknown_daemons_and_deletes_stray_deployments(node: SandboxNode, parts: Parts) -> None:
    daemons, gpu = parts.daemons, parts.gpu
    kept = mps.ControlDaemon(mps.control_daemon_id("kept", [gpu]), "kept", (gpu,), ())
    lost = mps.ControlDaemon(mps.control_daemon_id("lost", [gpu]), "lost", (gpu,), ())
    for daemon in (kept, lost):
        daemons.start(daemon)
    # a Deployment whose directory is gone (its stop was cut short after the directory was removed)
    stray = mps.ControlDaemon(mps.control_daemon_id("stray", [gpu]), "stray", (gpu,), ())
    assert node.api is not None
    node.api.create(mps.deployment_manifest(stray, dataclasses.replace(daemons.placement, directory="/nonexistent")))
    # another component's daemons (other kind label) are not this one's to sweep
    other = mps.deployment_manifest(mps.ControlDaemon("gpu-x-00000", "gpu-x", (gpu,), ()),
                                    dataclasses.replace(daemons.placement, directory="/x", kind="shares"))
    node.api.create(other)
    swept = daemons.sweep([kept.daemon_id])
    assert sorted(swept) == sorted([lost.daemon_id, stray.daemon_id])
    names = sorted(d["metadata"]["name"] for d in node.api.objects("Deployment"))
    assert names == sorted([kept.deployment, "mps-control-daemon-gpu-x-00000"])
    assert daemons.known() == [kept.daemon_id]
    daemons.stop(kept.daemon_id)


def test_unreadable_record_is_an_error_naming_the_daemon(parts: Parts) -> None:
    daemons = parts.daemons
    directory = daemons.directory("claim-3-abcde")
    directory.mkdir(parents=True)
    (directory / RECORD).write_text("{not json")
    with pytest.raises(MpsDaemonError, match=f"claim-3-abcde: unreadable {RECORD}"):
        daemons.stop("claim-3-abcde")
    assert Path(directory).exists()
