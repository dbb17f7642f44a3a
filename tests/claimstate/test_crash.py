"""Real crashes: a subprocess driving the store is SIGKILLed at random points; every acknowledged op survives."""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
from pathlib import Path

from dradriver.host.claimstate import ClaimPhase, ClaimState, ProblemKind
from tests.claimstate import worker
from tests.claimstate.conftest import backend_module

WORKER = Path(worker.__file__)


def _table(state: ClaimState) -> worker.Model:
    out: worker.Model = {}
    for uid, rec in state.claims().items():
        assert rec.devices[0].device.startswith("gpu-")
        out[uid] = (int(rec.phase), int(rec.devices[0].device.removeprefix("gpu-")))
    return out


def _models(seed: int, upto: int) -> list[worker.Model]:
    models: list[worker.Model] = [{}]
    for _op, model in itertools.islice(worker.operations(seed), upto):
        models.append(model)
    return models


def test_sigkill_at_random_points_keeps_every_acknowledged_operation(
    impl: object, state_dir: Path, boot_id_file: Path
) -> None:
    tag = "py" if getattr(impl, "__name__", "").endswith("_py") else "c"
    rng = random.Random(20240611)
    acked_total = 0
    for seed in range(8):
        target = rng.randint(1, 80)
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "crash", str(state_dir), str(boot_id_file), tag, str(seed)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        acked = 0
        for line in proc.stdout:
            acked = int(line.split()[1])
            if acked >= target:
                break
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()  # acknowledgements written before the process died
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        for line in rest.splitlines():
            acked = int(line.split()[1])
        acked_total += acked

        models = _models(seed, acked + 1)
        state = ClaimState.open(state_dir / "claims.state", boot_id_path=boot_id_file,
                                backend=backend_module(tag))
        assert all(p.kind is ProblemKind.TORN_TAIL for p in state.problems)
        table = _table(state)
        # every acknowledged op is present; the op in flight at the kill may or may not have landed
        assert table in (models[acked], models[acked + 1]), (seed, acked)
        held = [dev for _phase, dev in table.values()]
        assert len(held) == len(set(held))  # no device held twice
        assert all(ClaimPhase(phase) for phase, _dev in table.values())
        # clean up for the next round, through the store itself
        for uid in list(table):
            state.remove(uid)
        state.close()
    assert acked_total > 0


def test_two_processes_hammering_one_store_lose_nothing(
    impl: object, state_dir: Path, boot_id_file: Path
) -> None:
    """Two plugin instances (rolling update) mutate one journal concurrently under the node-wide lock."""
    tag = "py" if getattr(impl, "__name__", "").endswith("_py") else "c"
    count = 60
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "churn", str(state_dir), str(boot_id_file), tag, str(seed), str(count)],
            stdout=subprocess.DEVNULL,
        )
        for seed in (101, 202)
    ]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    state = ClaimState.open(state_dir / "claims.state", boot_id_path=boot_id_file, backend=backend_module(tag))
    assert state.problems == ()
    expected: dict[str, tuple[int, int]] = {}
    for seed in (101, 202):
        model = _models_prefixed(seed, count)
        expected.update(model)
    assert _table(state) == expected


def _models_prefixed(seed: int, count: int) -> worker.Model:
    models = [m for _op, m in itertools.islice(worker.operations(seed, prefix=f"w{seed}-"), count)]
    return models[-1]
