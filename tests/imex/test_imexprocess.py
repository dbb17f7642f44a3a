"""The compute-domain daemon's ``nvidia-imex`` under failure, with the ``nvidia-imex`` stand-in and the API emulator:
SIGUSR1 only once the process handles it, a restart when the daemon's own index changes, a back-off for a process
that keeps failing, its cause in the probe, the readiness record, the clique entry's condition (and from there
``ComputeDomain.status.nodes[]``) and an Event, and a probe that a host ``nvidia-imex`` cannot answer for the pod."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from dradriver.computedomain import daemon as cddaemon
from dradriver.computedomain.controller import node_entries
from dradriver.domain import computedomains as cd
from dradriver.domain import imex
from dradriver.host import imexchannels
from dradriver.host.imexprocess import ImexExit, ImexProcess, check_own_daemon
from dradriver.kube import computedomains as kcd
from dradriver.kube.client import KubeClient, open_client
from dradriver.sandbox.apiserver import ApiServerEmulator
from tests.factories import wait_until
from tests.imex.imexnodes import ImexNode, install_tools, loopback_prefix, template

CD_UID = "7c1e2d3f-4a5b-4c6d-8e7f-0123456789ab"
CLIQUE = "abc9829a-1111-2222-3333-444455556666.2"
DRIVER_NS, CD_NS = "dradriver", "team-a"
NAMES = cd.dns_names(CD_UID, 4)
SESSION_ENV = "DRADRIVER_FABRIC_IMEX_MGMT"
"""The stand-in's IMEX session (its docstring): the node's fabric-imex-mgmt capability."""
WAIT_S = 30.0


def _start_alone(node: ImexNode, **env: str) -> None:
    """Start ``node``'s stand-in as a one-node IMEX domain (READY at once), e.g. a host nvidia-imex.service."""
    node.write([NAMES[0]], {NAMES[0]: node.ip})
    node.start(**env)
    wait_until(node.ready, f"{node.name} READY", timeout=WAIT_S)


def test_sigusr1_right_after_a_fresh_start_waits_for_the_handler_instead_of_killing_it(short_dir: Path) -> None:
    bin_dir = install_tools(short_dir / "bin")
    node = ImexNode(short_dir, "node-0", f"{loopback_prefix()}.1", bin_dir)
    node.write(NAMES, {NAMES[0]: node.ip, **{n: cd.UNUSED_SLOT_IP for n in NAMES[1:]}})
    process = ImexProcess([str(bin_dir / "nvidia-imex"), "-c", str(node.config)],
                          env={**os.environ, "DRADRIVER_HOSTS_FILE": str(node.hosts)}, watchdog_interval_s=0.05)
    try:
        assert process.ensure_started()
        first = process.pid
        process.reload()  # the peer mapping changed a few milliseconds after the start (a new domain's nodes)
        wait_until(lambda: any("SIGUSR1 received" in line for line in process.log_tail()), "the reload handled",
                   timeout=WAIT_S)
        assert process.pid == first and process.starts == 1 and process.reloads == 1
        assert process.last_exit is None  # not killed by SIGUSR1's default action (status -10)
    finally:
        assert process.stop(timeout_s=10) == 0


def test_a_process_that_never_handles_sigusr1_is_restarted_instead_of_killed(tmp_path: Path) -> None:
    script = tmp_path / "no-handler.py"
    script.write_text("import time\nwhile True: time.sleep(0.05)\n")
    exits: list[ImexExit] = []
    process = ImexProcess([sys.executable, "-S", str(script)], watchdog_interval_s=0.05, handler_wait_s=0.3,
                          on_exit=exits.append)
    try:
        process.ensure_started()
        first = process.pid
        assert process.reload() is False
        assert process.pid not in (None, first) and process.restarts == 1 and process.reloads == 0
        assert not exits  # a restart asked for is no failure; nothing died of SIGUSR1's default action
    finally:
        process.stop(timeout_s=10)


def test_an_imex_that_keeps_failing_is_restarted_with_a_growing_back_off_and_its_cause_reported(
        short_dir: Path) -> None:
    bin_dir = install_tools(short_dir / "bin")
    session = short_dir / "nvidia-cap1"
    host = ImexNode(short_dir, "host", f"{loopback_prefix()}.1", bin_dir)
    _start_alone(host, **{SESSION_ENV: str(session)})  # the host's nvidia-imex.service holds the IMEX session
    pod = ImexNode(short_dir, "pod", f"{loopback_prefix()}.2", bin_dir)
    pod.write([NAMES[0]], {NAMES[0]: pod.ip})
    exits: list[ImexExit] = []
    recovered = threading.Event()
    process = ImexProcess([str(bin_dir / "nvidia-imex"), "-c", str(pod.config)],
                          env={**os.environ, "DRADRIVER_HOSTS_FILE": str(pod.hosts), SESSION_ENV: str(session)},
                          watchdog_interval_s=0.05, backoff_max_s=0.4, stable_s=5.0, on_exit=exits.append,
                          on_recovered=recovered.set)
    try:
        process.ensure_started()
        wait_until(lambda: len(exits) >= 5, "five failed starts", timeout=WAIT_S)
        assert [e.failures for e in exits[:5]] == [1, 2, 3, 4, 5]
        assert [e.retry_in_s for e in exits[:5]] == [0.05, 0.1, 0.2, 0.4, 0.4]  # doubling, capped; NVIDIA: 1 s
        assert all(e.status == 1 for e in exits)
        assert host.proc is not None
        cause = f"is in use by another IMEX daemon (pid {host.proc.pid}); one nvidia-imex runs per node"
        assert cause in exits[0].cause and exits[0].cause in exits[0].reason()
        assert "exited with status 1" in exits[0].reason() and "1 failure(s) in a row" in exits[0].reason()
        host.stop()  # the operator disables the host service: the next start gets the session
        wait_until(recovered.is_set, "the process reported recovered", timeout=WAIT_S)
        assert process.pid is not None and process.failures == 0
    finally:
        process.stop(timeout_s=10)


# -- the daemon in-process -------------------------------------------------------------------------------------


@dataclass
class World:
    api: ApiServerEmulator
    client: KubeClient
    settings: cddaemon.DaemonSettings
    bin_dir: Path
    root: Path


@pytest.fixture
def world(short_dir: Path) -> Iterator[World]:
    bin_dir = install_tools(short_dir / "bin")
    imexd = short_dir / "imexd"
    imexd.mkdir()
    (imexd / imex.CONFIG_TEMPLATE_FILE).write_text(template())
    hosts = short_dir / "hosts"
    hosts.write_text("127.0.0.1\tlocalhost\n")
    with ApiServerEmulator() as api:
        api.install_crds()
        pod = api.create({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": "cd-daemon-x", "namespace": DRIVER_NS,
                                       "labels": {cd.LABEL_COMPUTE_DOMAIN: CD_UID}},
                          "spec": {"nodeName": "node-a", "containers": [{"name": "imex", "image": "dradriver"}]}})
        client = open_client(api.kubeconfig_path(short_dir))
        settings = cddaemon.DaemonSettings(
            clique_id=CLIQUE, cd_uid=CD_UID, cd_name="domain", cd_namespace=CD_NS, node_name="node-a",
            pod_ip=f"{loopback_prefix()}.1", pod_uid=pod["metadata"]["uid"], pod_name="cd-daemon-x",
            pod_namespace=DRIVER_NS, max_nodes=len(NAMES), imexd_dir=imexd, hosts_file=hosts,
            imex_binary=str(bin_dir / "nvidia-imex"), imex_ctl_binary=str(bin_dir / "nvidia-imex-ctl"),
            poll_interval_s=0.1, imex_env=dict(os.environ), imex_watchdog_s=0.05, imex_backoff_max_s=0.4,
            imex_stable_s=1.0)
        try:
            yield World(api, client, settings, bin_dir, short_dir)
        finally:
            client.close()


@contextlib.contextmanager
def running(world: World, settings: cddaemon.DaemonSettings | None = None) -> Iterator[cddaemon.DaemonSettings]:
    """``compute-domain-daemon run`` in a thread of this process, stopped (SIGTERM's path) at the end."""
    settings = settings or world.settings
    stop = threading.Event()
    thread = threading.Thread(target=cddaemon.run_daemon, args=(settings, world.client, stop), daemon=True)
    thread.start()
    try:
        yield settings
    finally:
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()


def _entry(world: World) -> dict[str, Any]:
    obj = world.api.get(cd.CLIQUE_KIND, cd.clique_object_name(CD_UID, CLIQUE), DRIVER_NS) or {}
    return next((e for e in obj.get("daemons") or () if e.get("nodeName") == "node-a"), {})


def _set_index(world: World, index: int) -> None:
    """The controller's write of this node's index (its JSON patch of the item)."""
    name = cd.clique_object_name(CD_UID, CLIQUE)
    obj = world.api.get(cd.CLIQUE_KIND, name, DRIVER_NS) or {}
    position = next(i for i, e in enumerate(obj.get("daemons") or ()) if e.get("nodeName") == "node-a")
    assert kcd.patch_clique(world.client, DRIVER_NS, name, [
        {"op": "test", "path": f"/daemons/{position}/nodeName", "value": "node-a"},
        {"op": "add", "path": f"/daemons/{position}/index", "value": index}]) is not None


def _own_name(world: World) -> str | None:
    """The name this node's running nvidia-imex holds itself to be (``nvidia-imex-ctl -N -j``)."""
    done = subprocess.run([str(world.bin_dir / "nvidia-imex-ctl"), "-c", str(world.settings.config_path), "-N", "-j"],
                          capture_output=True, text=True, timeout=20, check=False)
    try:
        nodes = json.loads(done.stdout)["nodes"]
    except (ValueError, KeyError):
        return None
    return next((n["name"] for n in nodes if n["self"]), None)


def test_a_daemon_whose_index_is_assigned_or_changes_restarts_nvidia_imex_and_gets_ready(world: World) -> None:
    with running(world) as settings:
        wait_until(lambda: bool(_entry(world).get("ipAddress")), "the entry applied", timeout=WAIT_S)
        wait_until(lambda: imexchannels.read_process_record(settings.imexd_dir) is not None and
                   imexchannels.read_process_record(settings.imexd_dir).pid > 0,  # type: ignore[union-attr]
                   "nvidia-imex started", timeout=WAIT_S)
        assert not cddaemon.check(settings)[0]  # started before its index: no name of its own yet
        _set_index(world, 0)  # the controller assigns the index: the name nvidia-imex must hold is known now
        wait_until(lambda: cddaemon.check(settings)[0] and _own_name(world) == NAMES[0], "READY as index 0",
                   timeout=WAIT_S)
        first = imexchannels.read_process_record(settings.imexd_dir)
        _set_index(world, 2)  # e.g. an index swap (ksigs#1418): SIGUSR1 cannot apply it
        wait_until(lambda: cddaemon.check(settings)[0] and _own_name(world) == NAMES[2], "READY as index 2",
                   timeout=WAIT_S)
        second = imexchannels.read_process_record(settings.imexd_dir)
        assert first is not None and second is not None and second.pid != first.pid and not second.failure


def test_a_failing_nvidia_imex_reaches_the_probe_the_entry_the_domain_status_and_an_event(world: World) -> None:
    session = world.root / "nvidia-cap1"
    host = ImexNode(world.root, "host", world.settings.pod_ip, world.bin_dir)  # the host's, on the pod's address
    _start_alone(host, **{SESSION_ENV: str(session)})
    settings = replace(world.settings, imex_env={**os.environ, SESSION_ENV: str(session)})
    try:
        with running(world, settings):
            wait_until(lambda: bool(_entry(world).get("ipAddress")), "the entry applied", timeout=WAIT_S)
            _set_index(world, 0)
            wait_until(lambda: bool(_entry(world).get("conditions")), "the entry's condition", timeout=WAIT_S)
            assert host.proc is not None
            cause = f"is in use by another IMEX daemon (pid {host.proc.pid}); one nvidia-imex runs per node"
            # The pod's probe address answers READY -- the host's daemon answers it -- but the probe asks the pod's own.
            assert host.ready()
            ok, why = cddaemon.check(settings)
            assert not ok and cause in why and "failure(s) in a row" in why
            condition = _entry(world)["conditions"][0]
            assert (condition["type"], condition["status"], condition["reason"]) == (
                cd.IMEX_DAEMON_CONDITION, "False", cd.REASON_IMEX_FAILED)
            assert cause in condition["message"]
            record = imexchannels.read_readiness(settings.imexd_dir)
            assert record is not None and not record.ready and record.detail.endswith(cause)  # whole, not cut
            # The controller copies the entry's condition into ComputeDomain.status.nodes[].
            clique = world.api.get(cd.CLIQUE_KIND, cd.clique_object_name(CD_UID, CLIQUE), DRIVER_NS)
            domain = cd.ComputeDomain(name="domain", namespace=CD_NS, uid=CD_UID)
            nodes = [n.to_status_node() for n in node_entries(domain, [], [clique or {}], cliques_gate=True)]
            assert nodes[0]["conditions"][0]["message"] == condition["message"]
            wait_until(lambda: any(e.get("reason") == cd.REASON_IMEX_FAILED
                                   for e in world.api.objects("Event", CD_NS)), "the Warning Event", timeout=WAIT_S)
            event = next(e for e in world.api.objects("Event", CD_NS) if e["reason"] == cd.REASON_IMEX_FAILED)
            assert event["type"] == "Warning" and event["involvedObject"]["kind"] == cd.COMPUTE_DOMAIN_KIND
            assert event["involvedObject"]["uid"] == CD_UID and cause in event["message"]
            assert "node node-a" in event["message"]
            host.stop()  # the host service is disabled: the pod's own nvidia-imex starts and stays up
            wait_until(lambda: (_entry(world).get("conditions") or [{}])[0].get("status") == "True",
                       "the condition back to True", timeout=WAIT_S)
            assert _entry(world)["conditions"][0]["reason"] == cd.REASON_IMEX_RUNNING
            wait_until(lambda: cddaemon.check(settings)[0], "the pod's own nvidia-imex READY", timeout=WAIT_S)
            assert any(e["reason"] == cd.REASON_IMEX_RUNNING and e["type"] == "Normal"
                       for e in world.api.objects("Event", CD_NS))
    finally:
        host.stop()


def test_the_probe_asks_only_the_pods_own_nvidia_imex(short_dir: Path) -> None:
    bin_dir = install_tools(short_dir / "bin")
    host = ImexNode(short_dir, "host", f"{loopback_prefix()}.1", bin_dir)
    _start_alone(host)  # answers READY on the address in host.config
    ctl = str(bin_dir / "nvidia-imex-ctl")
    ok, why = check_own_daemon(host.dir, ctl, host.config, pod_uid="pod-1")
    assert not ok and "has not been started yet" in why  # no process record of this pod: not its daemon
    assert host.proc is not None
    imexchannels.write_process_record(host.dir, imex.ImexProcessRecord("pod-0", host.proc.pid, "", 0.0))
    assert not check_own_daemon(host.dir, ctl, host.config, pod_uid="pod-1")[0]  # an earlier pod's record
    imexchannels.write_process_record(host.dir, imex.ImexProcessRecord("pod-1", 0, "it failed: why", 0.0))
    assert check_own_daemon(host.dir, ctl, host.config, pod_uid="pod-1") == (False, "it failed: why")
    imexchannels.write_process_record(host.dir, imex.ImexProcessRecord("pod-1", host.proc.pid, "", 0.0))
    assert check_own_daemon(host.dir, ctl, host.config, pod_uid="pod-1") == (True, "READY")
    host.stop()
    assert not check_own_daemon(host.dir, ctl, host.config, pod_uid="pod-1")[0]


def test_the_readiness_record_keeps_the_whole_reason(tmp_path: Path) -> None:
    reason = "nvidia-imex (pid 42) exited with status 1: " + "a long cause, " * 40 + "its end"
    assert not imexchannels.record_readiness(tmp_path, node_name="n", pod_uid="p", pod_ip="10.0.0.1", ready=False,
                                             detail=reason)
    record = imexchannels.read_readiness(tmp_path)
    assert record is not None and record.detail == reason
