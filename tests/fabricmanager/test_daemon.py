"""The Fabric Manager stand-in run as its own process: the activation state survives a daemon restart (state
file), a JSON table replaces the default one, and no daemon means FM down for the client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dradriver.host.fabricmanager import FabricManagerClient, FabricManagerError, FmAddress
from dradriver.sandbox.standins.nv_fabricmanager import load_table, mock_library_path
from tests.factories import wait_until


class Daemon:
    def __init__(self, socket_path: Path, *args: str) -> None:
        self.socket_path, self.args = socket_path, args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "dradriver.sandbox.standins.nv_fabricmanager",
                                      "--socket", str(self.socket_path), *self.args])
        wait_until(lambda: self.socket_path.exists(), "the stand-in's socket")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            assert self.proc.wait(timeout=30) == 0
        self.proc = None


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in made:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_activation_state_survives_a_daemon_restart(tmp_path: Path, daemons: list[Daemon]) -> None:
    sock = tmp_path / "run" / "nvidia-fabricmanager" / "socket"
    daemon = Daemon(sock, "--profile", "dgx-b200", "--state", str(tmp_path / "fm.json"))
    daemons.append(daemon)
    daemon.start()
    client = FabricManagerClient(mock_library_path(), FmAddress(str(sock)))
    client.activate(2)
    daemon.stop()
    assert not sock.exists()
    with pytest.raises(FabricManagerError, match="FM_ST_CONNECTION_NOT_VALID"):
        client.partitions()
    daemon.start()
    assert [p.partition_id for p in client.partitions() if p.active] == [2]


def test_a_json_table_replaces_the_default(tmp_path: Path, daemons: list[Daemon]) -> None:
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"partitions": [
        {"id": 0, "gpus": [{"physicalId": 2, "uuid": "GPU-b", "pciBusId": "00000000:3F:00.0"},
                           {"physicalId": 1, "uuid": "GPU-a", "pciBusId": "00000000:29:00.0"}]},
        {"id": 5, "gpus": [{"physicalId": 1}]}]}))
    assert [p.partition_id for p in load_table(table)] == [0, 5]
    sock = tmp_path / "fm.sock"
    daemon = Daemon(sock, "--table", str(table))
    daemons.append(daemon)
    daemon.start()
    parts = FabricManagerClient(mock_library_path(), FmAddress(str(sock))).partitions()
    assert [(p.partition_id, p.module_ids, p.pci_bus_ids) for p in parts] == [
        (0, (1, 2), ("00000000:29:00.0", "00000000:3F:00.0")), (5, (1,), ("",))]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"partitions": [{"id": 0}]}))
    with pytest.raises(ValueError, match=r"partitions\[0\]"):
        load_table(bad)
