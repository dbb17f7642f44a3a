"""Scenario 5: resident memory of a plugin holding 10,000 prepared claims, the full MIG table of an 8-GPU
node and the 2048-channel IMEX table, measured step by step in a fresh interpreter.

Steps (RSS after each, ``/proc/self/status`` ``VmRSS``): imports of the plugin's modules (the baseline);
NVML discovery of the 8 GPU x 7 MIG node and its ResourceSlices; the 2048 IMEX channels' CDI spec and
device-node table; the claim state with 10,000 prepared claims (journal on disk, read at open). Target: the
10,000 claims add at most 20 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from bench import nvmlenv

_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    directory, profile = Path(sys.argv[1]), sys.argv[2]
    from dradriver import app  # noqa: F401  -- every module the plugin imports
    from dradriver.domain import cdi, pools
    from dradriver.host.claimstate import ClaimState, HeldDevice
    from dradriver.nvml.discovery import discover
    from dradriver.nvml.session import open_session
    out = {}
    gc.collect(); base = rss_kib(); out["imports"] = base
    session = open_session(mock_profile=profile)
    inventory = discover(session)
    slices = pools.build_resource_slices(inventory, "node")
    gc.collect(); out["mig_table"] = rss_kib() - base; base = rss_kib()
    out["mig_devices"] = len(inventory.migs)
    channels = [cdi.DeviceNode(f"/dev/nvidia-caps-imex-channels/channel{i}", "", "c", 234, i, 0o666)
                for i in range(2048)]
    spec = cdi.render_imex_channel_spec(234)
    gc.collect(); out["channel_table"] = rss_kib() - base; base = rss_kib()
    state = ClaimState.open(directory / "claims.state", boot_id_path=directory / "boot_id")
    for i in range(len(state), 10_000):
        uid = f"{i:08x}-0000-4000-8000-{i:012x}"
        held = [HeldDevice(("gpu",), "node", f"gpu-{i % 8}", (f"k8s.gpu.nvidia.com/claim={uid}-gpu-{i % 8}",),
                           admin_access=True)]
        state.prepare_started(uid, namespace="default", name=f"claim-{i}", devices=held)
        state.prepare_completed(uid)
    state.close()
    gc.collect(); base = rss_kib()
    state = ClaimState.open(directory / "claims.state", boot_id_path=directory / "boot_id")
    assert len(state) == 10_000
    gc.collect(); out["claims_10000"] = rss_kib() - base
    print(json.dumps(out))
    """
)


def test_memory_of_a_loaded_plugin(benchmark: Any, tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "boot_id").write_text("bench-boot\n")
    profile = nvmlenv.all_mig_profile(tmp_path)

    def probe() -> dict[str, int]:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path), str(profile), str(repo)],
                             check=True, capture_output=True, text=True, timeout=600)
        result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    rss = benchmark.pedantic(probe, rounds=1, iterations=1)
    assert rss["mig_devices"] == 56
    benchmark.extra_info.update(
        scenario="plugin_memory",
        figures={
            "RSS after the plugin's imports (MiB)": (round(rss["imports"] / 1024, 1), "", None),
            "added by NVML (library + init) and the 8 GPU x 7 MIG table with its ResourceSlices (MiB)": (
                round(rss["mig_table"] / 1024, 2), "", None),
            "added by the 2048-channel IMEX table and spec (MiB)": (round(rss["channel_table"] / 1024, 2), "", None),
            "added by 10,000 prepared claims (MiB)": (round(rss["claims_10000"] / 1024, 2), "<=", 20.0),
        },
    )


@pytest.fixture(autouse=True)
def _no_leftover_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRADRIVER_MOCK_NVML_PROFILE", raising=False)
