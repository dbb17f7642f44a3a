"""Spec files: atomic replacement, mode 0644, no partial or temp files after failures and crashes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.domain import cdi
from dradriver.domain.identity import GPU_DRIVER
from dradriver.host import cdifiles
from dradriver.host.devicenodes import DeviceNodeInfo
from tests.cdi import helpers
from tests.cdi.conftest import CLAIM_UID, make_gpu
from tests.cdi.helpers import REPO_ROOT, validate


def test_write_and_delete(tmp_path: Path, node_info: DeviceNodeInfo) -> None:
    root = tmp_path / "cdi"
    root.mkdir()
    old = os.umask(0o077)
    try:
        path = helpers.write_gpu_spec(root, CLAIM_UID, [make_gpu(0)], node_info=node_info)
    finally:
        os.umask(old)
    assert path == root / f"k8s.gpu.nvidia.com-claim_{CLAIM_UID}.yaml"  # NVIDIA's name: its unprepare removes it
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert os.listdir(root) == [path.name]
    spec = validate(path.read_bytes())
    assert spec["devices"][0]["name"] == f"{CLAIM_UID}-gpu-0"
    # rewriting replaces the content; a .json twin (an older dradriver's spec of the claim) is removed
    (root / f"k8s.gpu.nvidia.com-claim_{CLAIM_UID}.json").write_text("{}")
    helpers.write_gpu_spec(root, CLAIM_UID, [make_gpu(1)], node_info=node_info)
    assert os.listdir(root) == [path.name]
    assert validate(path.read_bytes())["devices"][0]["name"] == f"{CLAIM_UID}-gpu-1"
    assert cdifiles.delete_claim_spec(GPU_DRIVER.cdi, root, CLAIM_UID) is True
    assert cdifiles.delete_claim_spec(GPU_DRIVER.cdi, root, CLAIM_UID) is False
    assert os.listdir(root) == []


def test_failure_mid_write_leaves_old_file_and_no_temp(
    tmp_path: Path, node_info: DeviceNodeInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cdi"
    root.mkdir()
    path = helpers.write_gpu_spec(root, CLAIM_UID, [make_gpu(0)], node_info=node_info)
    before = path.read_bytes()
    real_write = os.write

    def short_then_fail(fd: int, data: bytes | memoryview) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cdifiles.os, "write", short_then_fail)
    with pytest.raises(cdi.CdiSpecError, match=rf"claim {CLAIM_UID}: cannot write CDI spec .*No space"):
        helpers.write_gpu_spec(root, CLAIM_UID, [make_gpu(5)], node_info=node_info)
    assert os.listdir(root) == [path.name]
    assert path.read_bytes() == before


def test_missing_directory_is_a_clear_error(tmp_path: Path, node_info: DeviceNodeInfo) -> None:
    with pytest.raises(cdi.CdiSpecError, match="cannot write CDI spec"):
        helpers.write_gpu_spec(tmp_path / "absent", CLAIM_UID, [make_gpu(0)], node_info=node_info)


_CRASH = """
import os, signal, sys
from pathlib import Path
from dradriver.host import cdifiles
from dradriver.host.devicenodes import DeviceNodeInfo
from tests.cdi import helpers
from tests.cdi.conftest import make_gpu
root, uid, proc, minors = sys.argv[1:5]
def crash(*args):
    os.kill(os.getpid(), signal.SIGKILL)
cdifiles.os.replace = crash
helpers.write_gpu_spec(Path(root), uid, [make_gpu(0)],
                     node_info=DeviceNodeInfo(proc_devices=Path(proc), mig_minors=Path(minors)))
"""


def test_killed_writer_leaves_no_partial_spec(tmp_path: Path, node_info: DeviceNodeInfo) -> None:
    root = tmp_path / "cdi"
    root.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(root), CLAIM_UID, str(node_info.proc_devices), str(node_info.mig_minors)],
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    left = os.listdir(root)
    # the process died after writing the data and before the rename: only a temp file that CDI consumers
    # ignore (no .json/.yaml suffix) is there, never a partial spec
    assert len(left) == 1 and ".tmp-" in left[0] and not left[0].endswith((".json", ".yaml")), left
    path = helpers.write_gpu_spec(root, CLAIM_UID, [make_gpu(0)], node_info=node_info)
    assert os.listdir(root) == [path.name]
    validate(path.read_bytes())
