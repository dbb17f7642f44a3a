"""Subprocess body for the crash and two-instance tests: drives a ClaimState and acknowledges each operation.

Run as ``python worker.py MODE STATE_DIR BOOT_ID_FILE IMPL SEED [COUNT]``; prints ``ACK <n>`` (flushed) after
operation ``n`` returned, i.e. after its record is on disk. Mode ``tombstones`` instead leaves the unprepare tombstone
of claim ``u-<n>`` as operation ``n``, with a tombstone TTL of SEED seconds.
"""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from dradriver.host.claimstate import ClaimState, HeldDevice

Op = tuple[str, str, int]
Model = dict[str, tuple[int, int]]  # uid -> (phase, device index)


def operations(seed: int, *, devices: int = 6, prefix: str = "") -> Iterator[tuple[Op, Model]]:
    """Yield a valid random operation and the model table after it, forever (deterministic in ``seed``)."""
    rng = random.Random(seed)
    model: Model = {}
    serial = 0
    while True:
        held = {dev for _phase, dev in model.values()}
        free = [d for d in range(devices) if d not in held]
        started = [u for u, (phase, _d) in model.items() if phase == 1]
        choice = rng.random()
        if free and (choice < 0.45 or not model):
            serial += 1
            uid = f"{prefix}claim-{serial}"
            dev = rng.choice(free)
            model[uid] = (1, dev)
            op: Op = ("start", uid, dev)
        elif started and choice < 0.75:
            uid = rng.choice(started)
            model[uid] = (2, model[uid][1])
            op = ("complete", uid, model[uid][1])
        else:
            uid = rng.choice(sorted(model))
            del model[uid]
            op = ("remove", uid, -1)
        yield op, dict(model)


def device(index: int, pool: str) -> HeldDevice:
    """The held device for model device ``index``."""
    return HeldDevice(("gpu",), pool, f"gpu-{index}", (f"k8s.gpu.nvidia.com/claim=x-gpu-{index}",))


def apply(state: ClaimState, op: Op, pool: str) -> None:
    """Perform one model operation on the store."""
    kind, uid, dev = op
    if kind == "start":
        state.prepare_started(uid, namespace="ns", name=uid, devices=[device(dev, pool)], payload=f"/cdi/{uid}")
    elif kind == "complete":
        state.prepare_completed(uid)
    else:
        state.remove(uid)


def main(argv: list[str]) -> int:
    mode, state_dir, boot_id_file, impl, seed = argv[:5]
    count = int(argv[5]) if len(argv) > 5 else 1_000_000
    backend = importlib.import_module("dradriver._native.claimstore" + ("_py" if impl == "py" else ""))
    if mode == "tombstones":
        with ClaimState.open(Path(state_dir) / "claims.state", boot_id_path=Path(boot_id_file), backend=backend,
                             tombstone_ttl_s=float(seed)) as state:
            for n in range(1, count + 1):
                state.note_unprepared([f"u-{n}"])
                sys.stdout.write(f"ACK {n}\n")
                sys.stdout.flush()
        return 0
    pool = f"pool-{seed}" if mode == "churn" else "node-a"
    prefix = f"w{seed}-" if mode == "churn" else ""
    state = ClaimState.open(
        Path(state_dir) / "claims.state", boot_id_path=Path(boot_id_file), backend=backend,
        compact_min_bytes=600, strict=False,
    )
    for n, (op, _model) in enumerate(operations(int(seed), prefix=prefix), start=1):
        if n > count:
            break
        apply(state, op, pool)
        sys.stdout.write(f"ACK {n}\n")
        sys.stdout.flush()
    state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
