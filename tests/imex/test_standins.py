"""The nvidia-imex and nvidia-imex-ctl stand-ins: real TCP handshakes between emulated nodes on loopback
addresses, READY only with every listed peer connected both ways, refusals a wrong peer name causes, SIGUSR1."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.domain.computedomains import UNUSED_SLOT_IP, dns_names
from tests.factories import wait_until
from tests.imex.imexnodes import ImexNode, install_tools, loopback_prefix

Cluster = tuple[Path, str, list[ImexNode]]
"""(bin dir, loopback prefix, nodes to stop at the end)."""
CD_X, CD_Y = "11111111-aaaa-4aaa-8aaa-000000000001", "22222222-bbbb-4bbb-8bbb-000000000002"


@pytest.fixture
def cluster(short_dir: Path) -> Iterator[Cluster]:
    bin_dir = install_tools(short_dir / "bin")
    started: list[ImexNode] = []
    yield bin_dir, loopback_prefix(), started
    for node in started:
        node.stop()


def _nodes(short_dir: Path, bin_dir: Path, prefix: str, started: list[ImexNode], count: int,
           cd_uid: str = CD_X, slots: int = 4, first: int = 1) -> tuple[list[ImexNode], list[str]]:
    names = dns_names(cd_uid, slots)
    nodes = [ImexNode(short_dir / cd_uid[:8], f"node-{i}", f"{prefix}.{first + i}", bin_dir) for i in range(count)]
    hosts = {name: (nodes[i].ip if i < count else UNUSED_SLOT_IP) for i, name in enumerate(names)}
    for node in nodes:
        node.write(names, hosts)
    started.extend(nodes)
    return nodes, names


def test_three_daemons_with_correct_configs_all_get_ready(short_dir: Path, cluster: Cluster) -> None:
    bin_dir, prefix, started = cluster
    nodes, names = _nodes(short_dir, bin_dir, prefix, started, 3)
    for node in nodes:
        node.start()
    wait_until(lambda: all(n.ready() for n in nodes), "all three IMEX daemons READY")
    listing = nodes[0].ctl("-N", "-j")
    assert listing.returncode == 0, listing.stderr
    domain = json.loads(listing.stdout)
    assert domain["status"] == "UP"
    assert [(n["name"], n["state"]) for n in domain["nodes"][:3]] == [(names[i], "READY") for i in range(3)]
    assert domain["nodes"][3]["ip"] == UNUSED_SLOT_IP and domain["nodes"][3]["state"] == "UNAVAILABLE"
    text = nodes[1].ctl("-N", "-H").stdout
    assert "Domain State: UP" in text and f"{nodes[2].ip} ({names[2]}) - READY" in text
    for node in nodes:
        log = node.log()
        assert "IMEX daemon is READY" in log
        assert log.count("connected to ") >= 2 and log.count("accepted connection from ") >= 2


def test_ctl_reports_not_ready_and_no_daemon(short_dir: Path, cluster: Cluster) -> None:
    bin_dir, prefix, started = cluster
    nodes, _ = _nodes(short_dir, bin_dir, prefix, started, 2)
    nothing = nodes[0].ctl("-q")
    assert nothing.returncode == 1 and nothing.stdout == "" and "cannot connect" in nothing.stderr
    nodes[0].start()
    wait_until(lambda: nodes[0].ctl("-q").stdout == "WAITING_FOR_PEERS\n", "a lone daemon answering")
    alone = nodes[0].ctl("-q")
    assert alone.returncode == 1
    assert "Domain State: DOWN" in nodes[0].ctl("-N").stdout
    assert nodes[0].stop() == 0
    assert "SIGTERM received" in nodes[0].log()


def test_wrong_nodes_cfg_is_refused(short_dir: Path, cluster: Cluster) -> None:
    """Node 2 lists another domain's names (its nodes.cfg and hosts are domain Y's): the others' handshake
    asks for X's name and is refused."""
    bin_dir, prefix, started = cluster
    nodes, names = _nodes(short_dir, bin_dir, prefix, started, 3)
    y_names = dns_names(CD_Y, 4)
    nodes[2].write(y_names, {y_names[i]: nodes[i].ip for i in range(3)})
    for node in nodes:
        node.start()
    nodes[2].wait_log(f"asked for node '{names[2]}', but this node is '{y_names[2]}'")
    nodes[0].wait_log(f"connection to {names[2]} ({nodes[2].ip}:50000) failed: refused by the peer")
    assert not any(n.ready() for n in nodes)


def test_stale_hosts_entry_fails_until_fixed_and_sigusr1(short_dir: Path, cluster: Cluster) -> None:
    """Node 0's hosts file still maps node 1's name to an old pod IP: no connection, nobody is READY; the fixed
    file and SIGUSR1 connect it."""
    bin_dir, prefix, started = cluster
    nodes, names = _nodes(short_dir, bin_dir, prefix, started, 2)
    stale = f"{prefix}.200"
    nodes[0].write(names, {names[0]: nodes[0].ip, names[1]: stale, names[2]: UNUSED_SLOT_IP,
                           names[3]: UNUSED_SLOT_IP})
    for node in nodes:
        node.start()
    nodes[0].wait_log(f"connection to {names[1]} ({stale}:50000) failed: ConnectionRefusedError")
    nodes[0].wait_log(f"says it is '{names[1]}', which resolves to {stale}")  # node 1's connection refused
    nodes[1].wait_log(f"connection to {names[0]} ({nodes[0].ip}:50000) failed: refused by the peer")
    assert not nodes[0].ready() and not nodes[1].ready()
    nodes[0].write(names, {names[0]: nodes[0].ip, names[1]: nodes[1].ip, names[2]: UNUSED_SLOT_IP,
                           names[3]: UNUSED_SLOT_IP})
    nodes[0].reload()
    nodes[0].wait_log("SIGUSR1 received")
    wait_until(lambda: nodes[0].ready() and nodes[1].ready(), "both READY after the fix")


def test_another_domains_daemon_on_a_reused_ip_is_refused(short_dir: Path, cluster: Cluster) -> None:
    """Domain X's node 0 believes its peer's name maps to an IP a daemon of domain Y now holds (pod IP reused):
    Y's daemon refuses the handshake for X's name."""
    bin_dir, prefix, started = cluster
    x_nodes, x_names = _nodes(short_dir, bin_dir, prefix, started, 1, CD_X, first=1)
    y_nodes, y_names = _nodes(short_dir, bin_dir, prefix, started, 1, CD_Y, first=2)
    reused = y_nodes[0].ip
    x_nodes[0].write(x_names, {x_names[0]: x_nodes[0].ip, x_names[1]: reused, x_names[2]: UNUSED_SLOT_IP,
                               x_names[3]: UNUSED_SLOT_IP})
    y_nodes[0].start()
    x_nodes[0].start()
    y_nodes[0].wait_log(f"asked for node '{x_names[1]}', but this node is '{y_names[0]}'")
    x_nodes[0].wait_log(f"connection to {x_names[1]} ({reused}:50000) failed: refused by the peer")
    assert not x_nodes[0].ready()
    wait_until(y_nodes[0].ready, "domain Y's lone daemon READY")


def test_sigusr1_after_a_hosts_change_connects_the_new_peer_and_drops_the_old(short_dir: Path,
                                                                             cluster: Cluster) -> None:
    bin_dir, prefix, started = cluster
    nodes, names = _nodes(short_dir, bin_dir, prefix, started, 3)
    two = {names[0]: nodes[0].ip, names[1]: nodes[1].ip, names[2]: UNUSED_SLOT_IP, names[3]: UNUSED_SLOT_IP}
    nodes[0].write(names, two)
    nodes[1].write(names, two)
    nodes[0].start()
    nodes[1].start()
    wait_until(lambda: nodes[0].ready() and nodes[1].ready(), "the first two READY")
    nodes[2].start()  # its hosts file knows all three; the first two do not know it yet
    nodes[0].wait_log(f"says it is '{names[2]}', which is not a peer")
    assert not nodes[2].ready()
    three = {**two, names[2]: nodes[2].ip}
    for node in nodes[:2]:
        node.write(names, three)
        node.reload()
    wait_until(lambda: all(n.ready() for n in nodes), "all three READY after SIGUSR1")
    assert "SIGUSR1 received" in nodes[0].log()
    for node in nodes[1:]:  # node 0 leaves: the others drop it on SIGUSR1 and stay READY
        node.write(names, {**three, names[0]: UNUSED_SLOT_IP})
        node.reload()
    nodes[0].stop()
    nodes[1].wait_log(f"dropping peer {names[0]}")
    wait_until(lambda: nodes[1].ready() and nodes[2].ready(), "the remaining two READY")


def test_host_managed_query_over_the_unix_socket(short_dir: Path, cluster: Cluster) -> None:
    """Host-managed IMEX: the plugin asks ``nvidia-imex-ctl -q --u=<socket>`` (``IMEX_CMD_UNIX_DOMAIN_PATH``)."""
    bin_dir, prefix, started = cluster
    nodes, _ = _nodes(short_dir, bin_dir, prefix, started, 1)
    socket_path = short_dir / "imex.sock"
    nodes[0].config.write_text(nodes[0].config.read_text() + f"IMEX_CMD_UNIX_DOMAIN_PATH={socket_path}\n")
    nodes[0].start()
    wait_until(socket_path.exists, "the command socket")
    for form in ([f"--u={socket_path}"], ["-u", str(socket_path)]):
        done = subprocess.run([str(bin_dir / "nvidia-imex-ctl"), "-q", *form], capture_output=True, text=True,
                              timeout=20, check=False)
        assert (done.returncode, done.stdout) == (0, "READY\n"), done.stderr
    assert nodes[0].stop() == 0
    assert not socket_path.exists()
