"""Pure rules of the IMEX daemon (``dradriver.domain.imex``) and the process/file helpers
(``dradriver.host.imexprocess``)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from dradriver.domain import imex
from dradriver.domain.computedomains import (
    STATUS_NOT_READY,
    STATUS_READY,
    UNUSED_SLOT_IP,
    CliqueDaemon,
    ComputeDomainError,
    dns_name,
    dns_names,
)
from dradriver.host.imexprocess import ImexProcess, write_config_file, write_hosts_file
from tests.factories import wait_until
from tests.imex.imexnodes import template

CD = "0c7e5f3a-1111-4222-8333-444455556666"
CLIQUE = "abc9829a-0000-0000-0000-000000000001.2"


def test_imexd_config_sets_the_pod_ip_and_nodes_file_and_keeps_nvidias_keys() -> None:
    text = imex.render_imexd_config(template(), pod_ip="10.1.2.3", nodes_config="/imexd/nodes.cfg")
    lines = text.splitlines()
    assert "IMEX_CMD_BIND_INTERFACE_IP=10.1.2.3" in lines and "IMEX_NODE_CONFIG_FILE=/imexd/nodes.cfg" in lines
    for fixed in ("LOG_LEVEL=4", "LOG_FILE_NAME=", "DAEMONIZE=0", "SERVER_PORT=50000", "BIND_INTERFACE_IP=",
                  "IMEX_WAIT_FOR_QUORUM=RECOVERY", "IMEX_ENABLE_AUTH_ENCRYPTION=0", "IMEX_CMD_ENABLED=1",
                  "IMEX_CMD_PORT=50005", "IMEX_NODE_DISCONNECTED_GRACE_TIME=-1",
                  "STATS_FILE_NAME=/var/log/nvidia-imex-stats.log"):
        assert fixed in lines
    assert sum(line.startswith("IMEX_CMD_BIND_INTERFACE_IP=") for line in lines) == 1
    appended = imex.render_imexd_config("# only a comment\nSERVER_PORT=1\n", pod_ip="ip", nodes_config="n",
                                        overrides={"SERVER_PORT": "2"})
    assert appended == "# only a comment\nSERVER_PORT=2\nIMEX_CMD_BIND_INTERFACE_IP=ip\nIMEX_NODE_CONFIG_FILE=n\n"


def test_nodes_config_is_static_per_domain_names() -> None:
    text = imex.render_nodes_config(CD, 18)
    assert text.splitlines() == dns_names(CD, 18)
    assert text.splitlines()[0].endswith("-0000") and text.splitlines()[17].endswith("-0017")
    assert imex.render_nodes_config(CD, 18) != imex.render_nodes_config("another-uid", 18)


def test_mapping_and_hosts_section() -> None:
    daemons = [CliqueDaemon("n-a", "10.0.0.5", CLIQUE, 1), CliqueDaemon("n-b", "10.0.0.6", CLIQUE, 0),
               CliqueDaemon("n-c", "10.0.0.7", "other.1", 2), CliqueDaemon("n-d", "", CLIQUE, 3),
               CliqueDaemon("n-e", "10.0.0.9", CLIQUE, 9)]
    mapping = imex.dns_mapping(CD, daemons, CLIQUE, 4)
    assert mapping == {dns_name(CD, 0): "10.0.0.6", dns_name(CD, 1): "10.0.0.5", dns_name(CD, 2): UNUSED_SLOT_IP,
                       dns_name(CD, 3): UNUSED_SLOT_IP}
    old = ("127.0.0.1\tlocalhost\n10.9.9.9\tpod-x\n" + imex.HOSTS_HEADER + "\n"
           "10.0.0.1\tcompute-domain-daemon-0000\n10.0.0.2\tcompute-domain-daemon-ffff-0001\n")
    hosts = imex.render_hosts(old, mapping)
    assert hosts == ("127.0.0.1\tlocalhost\n10.9.9.9\tpod-x\n\n" + imex.HOSTS_HEADER + "\n"
                     + "".join(f"{ip}\t{name}\n" for name, ip in mapping.items()))
    assert imex.render_hosts(hosts, mapping) == hosts  # idempotent
    assert imex.render_hosts("", mapping).startswith(imex.HOSTS_HEADER + "\n")


def test_membership_change() -> None:
    a, b, c = (dns_name(CD, i) for i in range(3))
    old = {a: "10.0.0.1", b: "10.0.0.2", c: UNUSED_SLOT_IP}
    assert not imex.membership_change(old, dict(old)).changed
    change = imex.membership_change(old, {a: "10.0.0.1", b: "10.0.0.9", c: "10.0.0.3"})
    assert change == imex.MembershipChange(added=(c,), moved=(b,)) and change.changed
    assert imex.membership_change(old, {a: "10.0.0.1", b: UNUSED_SLOT_IP, c: UNUSED_SLOT_IP}).removed == (b,)


def test_upsert_keeps_the_index_fills_gaps_and_never_swaps() -> None:
    daemons = [CliqueDaemon("n-a", "10.0.0.1", CLIQUE, 0, STATUS_READY), CliqueDaemon("n-c", "10.0.0.3", CLIQUE, 2)]
    out, entry = imex.upsert_entry(daemons, node_name="n-b", ip_address="10.0.0.2", clique_id=CLIQUE, max_nodes=4)
    assert entry == CliqueDaemon("n-b", "10.0.0.2", CLIQUE, 1, STATUS_NOT_READY) and out == [*daemons, entry]
    again, moved = imex.upsert_entry(out, node_name="n-c", ip_address="10.0.0.33", clique_id=CLIQUE, max_nodes=4,
                                     status=STATUS_READY)
    assert moved.index == 2 and again[1] == moved and again[0] == daemons[0] and again[2] == entry
    with pytest.raises(ComputeDomainError, match="all 3 slots"):
        imex.upsert_entry(again, node_name="n-d", ip_address="x", clique_id=CLIQUE, max_nodes=3)
    assert imex.remove_entry(again, node_name="n-c", ip_address="10.0.0.3") == again  # an old pod's IP: kept
    assert [d.node_name for d in imex.remove_entry(again, node_name="n-c", ip_address="10.0.0.33")] == ["n-a", "n-b"]


def test_config_and_hosts_files_are_rewritten_only_on_change(tmp_path: Path) -> None:
    path = tmp_path / "nodes.cfg"
    assert write_config_file(path, "a\n") and not write_config_file(path, "a\n") and path.read_text() == "a\n"
    hosts = tmp_path / "hosts"
    assert write_hosts_file(hosts, "x\n") and not write_hosts_file(hosts, "x\n")
    assert oct(hosts.stat().st_mode & 0o777) == "0o644"


def test_imex_process_watchdog_restarts_and_reload_signals(tmp_path: Path) -> None:
    script = tmp_path / "fake-imex.py"
    marks = tmp_path / "marks"
    script.write_text(
        "import os, signal, sys, time\n"
        f"out = open({str(marks)!r}, 'a', buffering=1)\n"
        "out.write(f'start {os.getpid()}\\n')\n"
        "signal.signal(signal.SIGUSR1, lambda *_: out.write('usr1\\n'))\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "while True: time.sleep(0.05)\n")
    process = ImexProcess([sys.executable, "-S", str(script)], watchdog_interval_s=0.1)
    assert process.ensure_started() and not process.ensure_started()
    wait_until(lambda: marks.exists() and "start" in marks.read_text(), "the first start")
    process.reload()
    wait_until(lambda: "usr1" in marks.read_text(), "SIGUSR1 delivered")
    first = process.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: process.pid not in (None, first), "the watchdog's restart")
    assert process.starts == 2 and process.reloads == 1
    wait_until(lambda: marks.read_text().count("start") == 2, "the second start logged")
    assert process.stop() == 0
    assert process.pid is None


def test_the_daemon_readiness_record_round_trips_and_names_a_bad_field() -> None:
    record = imex.DaemonRecord("node-a", "pod-uid", "10.0.0.7", True, 1000.5, "READY")
    assert imex.DaemonRecord.from_json(record.to_json()) == record
    assert record.current(1000.5 + imex.READINESS_MAX_AGE_S) and not record.current(1031.0)
    assert not record.current(1000.5 - imex.READINESS_MAX_AGE_S - 1)  # a clock that went back: stale, not eternal
    for data, field in ((b"{", "not JSON"), (b"[]", "not a JSON object"), (b'{"nodeName": 1}', "nodeName"),
                        (record.to_json().replace(b'"ready":true', b'"ready":"yes"'), "ready"),
                        (record.to_json().replace(b'"writtenAt":1000.5', b'"writtenAt":true'), "writtenAt")):
        with pytest.raises(ValueError, match=field):
            imex.DaemonRecord.from_json(data)
