"""``dradriver exporter`` as a process: discovery + poller + event monitor + metrics server, until SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dradriver.nvml import mock

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def test_exporter_serves_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.write_text("")
    env = dict(os.environ, **{mock.CONTROL_ENV: str(control)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "dradriver", "exporter", "--mock-profile", "dgx-a100", "--node-name", "node-e",
         "--http-endpoint", "127.0.0.1:0", "--poll-interval", "0.2", "--log-level", "info"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stderr or ():
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        url = ""
        seen: list[str] = []
        while not url:
            line = lines.get(timeout=30)
            seen.append(line)
            match = re.search(r"at (http://\S+)", line)
            url = match.group(1) if match else ""
        with control.open("a") as f:
            f.write("event 2 8 79\n")  # Xid 79 on GPU index 2, applied by the mock inside the exporter

        def xid_seen() -> bool:
            with urllib.request.urlopen(url, timeout=10) as response:
                families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
            return any(
                s.labels.get("device") == "gpu-2" and s.labels.get("node") == "node-e" and s.value == 79
                for s in families["dradriver_gpu_last_xid"].samples
            )

        while not xid_seen():
            assert proc.poll() is None, "".join(seen)
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_exporter_rejects_a_bad_endpoint() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dradriver", "exporter", "--mock-profile", "l4-inference", "--http-endpoint", "9400"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "expected [host]:port" in result.stderr
    assert "Traceback" not in result.stderr
