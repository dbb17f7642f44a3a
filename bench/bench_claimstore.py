"""Scenario 3: one prepare+unprepare pair of the claim store with 10, 1,000 and 10,000 claims already prepared.

Variants (``extra_info["variant"]`` = ``<variant>_<claims>``): ``extension`` (ext/claimstore.pyx),
``twin`` (dradriver/_native/claimstore_py.py), both through :class:`dradriver.host.claimstate.ClaimState`
(one journal ``write`` per step, no ``fdatasync``: the durability argument is in that module's docstring;
node-wide ``flock``, amortised compaction included), and
``whole_file``: the reference Go driver's scheme (NVIDIA's ``cmd/gpu-kubelet-plugin/checkpoint.go``), one JSON
checkpoint of every prepared claim rewritten whole (temp file, fsync, rename) at each of the three steps.
The baseline is generous: it skips the Go driver's extra checkpoint reads and its text checksums.

A pair is ``prepare_started`` + ``prepare_completed`` + ``remove`` of one extra claim on one extra device.
Each runs twice: in the pytest temporary directory (a real disk, scenario ``claimstore_pair``; the baseline's
fsyncs cost milliseconds there) and on tmpfs (``/dev/shm``, scenario ``claimstore_pair_tmpfs``); the store's
own figures are its CPU cost and its flatness on both.
The ``memory`` benchmark measures, in a fresh interpreter, the RSS that 10,000 prepared claims add.

Run: ``python -m pytest bench/bench_claimstore.py --benchmark-only`` (or ``python -m bench -k claimstore``).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dradriver.host.claimstate import ClaimState, HeldDevice

SCENARIO = "claimstore_pair"
TMPFS = Path("/dev/shm")
MEDIA = ("disk", "tmpfs")
SIZES = (10, 1_000, 10_000)
BOOT_ID = "d95dacd9-6a44-4f58-a9c9-ced799e1caa1"
NODE = "node-a"


def _claim(i: int) -> tuple[str, str, str, list[tuple[Any, ...]], str]:
    uid = f"0f1e2d3c-4b5a-4978-8a9b-{i:012d}"
    dev = (("gpu",), NODE, f"gpu-{i}", (f"k8s.gpu.nvidia.com/claim={uid}-gpu-{i}",), False)
    return uid, "team-a", f"claim-{i}", [dev], f"/var/run/cdi/k8s.gpu.nvidia.com-claim_{uid}.yaml"


def _backend(variant: str) -> ModuleType:
    return importlib.import_module("dradriver._native.claimstore" + ("_py" if variant == "twin" else ""))


def _seed_journal(directory: Path, backend: ModuleType, claims: int) -> Path:
    """Write a journal holding ``claims`` completed claims (as a compaction would) and return its path."""
    table = backend.Table()
    for i in range(claims):
        uid, namespace, name, devices, payload = _claim(i)
        table.prepare_started(uid, namespace, name, devices, payload)
        table.prepare_completed(uid, None, None)
    path = directory / "claims.state"
    path.write_bytes(backend.encode_header(BOOT_ID) + table.snapshot())
    (directory / "boot_id").write_text(BOOT_ID + "\n")
    return path


class WholeFileCheckpoint:
    """The baseline: a dict of every prepared claim, rewritten as one JSON file per change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, dict[str, Any]] = {}

    def _write(self) -> None:
        data = json.dumps({"v2": {"nodeBootID": BOOT_ID, "preparedClaims": self.claims}}).encode()
        tmp = self.path.with_name("." + self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)

    def put(self, uid: str, state: str, namespace: str, name: str, devices: list[tuple[Any, ...]],
            payload: str, *, write: bool = True) -> None:
        self.claims[uid] = {
            "checkpointState": state,
            "namespace": namespace,
            "name": name,
            "preparedDevices": [
                {"Requests": list(d[0]), "PoolName": d[1], "DeviceName": d[2], "CDIDeviceIDs": list(d[3])}
                for d in devices
            ],
            "payload": payload,
        }
        if write:
            self._write()

    def remove(self, uid: str) -> None:
        del self.claims[uid]
        self._write()


def _info(benchmark: Any, variant: str, claims: int, medium: str) -> None:
    scenario = SCENARIO if medium == "disk" else f"{SCENARIO}_{medium}"
    benchmark.extra_info.update(scenario=scenario, variant=f"{variant}_{claims}", claims=claims, medium=medium)


@pytest.fixture
def workdir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """Return an empty directory on the requested medium (``disk``: pytest's tmp_path; ``tmpfs``)."""
    if request.param == "disk" or not TMPFS.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=TMPFS, prefix="dradriver-bench-") as tmp:
        yield Path(tmp)


@pytest.mark.parametrize("workdir", MEDIA, indirect=True)
@pytest.mark.parametrize("claims", SIZES)
@pytest.mark.parametrize("variant", ["extension", "twin"])
def test_pair_journal(benchmark: Any, variant: str, claims: int, workdir: Path,
                      request: pytest.FixtureRequest) -> None:
    backend = _backend(variant)
    path = _seed_journal(workdir, backend, claims)
    store = ClaimState.open(path, boot_id_path=workdir / "boot_id", backend=backend)
    _info(benchmark, variant, claims, request.node.callspec.params["workdir"])
    uid, namespace, name, devices, payload = _claim(10_000_000)
    held = [HeldDevice(*d) for d in devices]

    def pair() -> None:
        store.prepare_started(uid, namespace=namespace, name=name, devices=held, payload=payload)
        store.prepare_completed(uid)
        store.remove(uid)

    benchmark(pair)
    assert len(store) == claims and uid not in store
    store.close()


@pytest.mark.parametrize("workdir", MEDIA, indirect=True)
@pytest.mark.parametrize("claims", SIZES)
def test_pair_whole_file(benchmark: Any, claims: int, workdir: Path, request: pytest.FixtureRequest) -> None:
    checkpoint = WholeFileCheckpoint(workdir / "checkpoint.json")
    for i in range(claims):
        each_uid, each_namespace, each_name, each_devices, each_payload = _claim(i)
        checkpoint.put(each_uid, "PrepareCompleted", each_namespace, each_name, each_devices, each_payload,
                       write=False)
    checkpoint._write()
    _info(benchmark, "whole_file", claims, request.node.callspec.params["workdir"])
    uid, namespace, name, devices, payload = _claim(10_000_000)

    def pair() -> None:
        checkpoint.put(uid, "PrepareStarted", namespace, name, devices, payload)
        checkpoint.put(uid, "PrepareCompleted", namespace, name, devices, payload)
        checkpoint.remove(uid)

    benchmark(pair)
    assert len(checkpoint.claims) == claims


_RSS_PROBE = textwrap.dedent(
    """
    import gc, importlib, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    from bench import bench_claimstore as b
    from dradriver.host.claimstate import ClaimState

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    directory, variant, claims = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    backend = b._backend(variant)
    path = directory / "claims.state"
    gc.collect()
    before = rss_kib()
    state = ClaimState.open(path, boot_id_path=directory / "boot_id", backend=backend)
    assert len(state) == claims
    gc.collect()
    print(rss_kib() - before)
    """
)


@pytest.mark.parametrize("variant", ["extension", "twin"])
def test_memory_10000_claims(benchmark: Any, variant: str, tmp_path: Path) -> None:
    """RSS added by opening a store of 10,000 prepared claims (KiB -> MiB), in a fresh interpreter."""
    repo = Path(__file__).resolve().parents[1]
    _seed_journal(tmp_path, _backend(variant), 10_000)  # seeded here so the probe's heap holds only the store

    def probe() -> float:
        out = subprocess.run(
            [sys.executable, "-c", _RSS_PROBE, str(tmp_path), variant, "10000", str(repo)],
            check=True, capture_output=True, text=True,
        )
        return int(out.stdout.strip()) / 1024

    mib = benchmark.pedantic(probe, rounds=1, iterations=1)
    benchmark.extra_info.update(
        scenario="claimstore_memory",
        figures={f"RSS added by 10,000 prepared claims, {variant} (MiB)": (round(mib, 2), "<=", 20.0)},
    )
