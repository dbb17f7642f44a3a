"""Scenario 1: NVML poll of the full field set on 8 GPUs x 7 MIG devices.

Variants: ``extension`` (ext/nvmlpoll.pyx), ``twin`` (pynvml), ``c_loop`` (the same NVML calls from a plain C
loop called once per poll through ctypes: the floor). With ``DRADRIVER_BENCH_REAL_NVML=1`` the scenario is
``nvml_poll_real_gpu`` and runs against the real driver (read-only).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from bench import nvmlenv
from dradriver._native import nvmlfields, nvmlpoll_py

SCENARIO = "nvml_poll_real_gpu" if nvmlenv.REAL else "nvml_poll_8gpu_7mig"


@pytest.fixture(scope="module")
def uuids(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    uuids = nvmlenv.open_nvml(tmp_path_factory.mktemp("nvml"))
    yield uuids
    pynvml.nvmlShutdown()  # back to reference count 0, so later benchmarks can load other mock profiles


def _info(benchmark: Any, variant: str, uuids: list[str], per_device: int) -> None:
    benchmark.extra_info.update(
        scenario=SCENARIO, variant=variant, devices=len(uuids), values_per_poll=len(uuids) * per_device
    )


def test_poll_extension(benchmark: Any, uuids: list[str]) -> None:
    from dradriver._native import nvmlpoll

    with nvmlpoll.Poller(uuids) as poller:
        _info(benchmark, "extension", uuids, len(nvmlfields.FIELD_NAMES))
        sample = benchmark(poller.poll)
    assert len(sample.values) == len(uuids) * len(nvmlfields.FIELD_NAMES)


def test_poll_twin(benchmark: Any, uuids: list[str]) -> None:
    with nvmlpoll_py.Poller(uuids) as poller:
        _info(benchmark, "twin", uuids, len(nvmlfields.FIELD_NAMES))
        sample = benchmark(poller.poll)
    assert len(sample.values) == len(uuids) * len(nvmlfields.FIELD_NAMES)


def test_poll_c_loop(benchmark: Any, uuids: list[str], tmp_path: Path) -> None:
    lib = nvmlenv.build_c_loop(tmp_path)
    per_device = lib.c_loop_values_per_device()
    assert per_device == len(nvmlfields.FIELD_NAMES)
    arr = (ctypes.c_char_p * len(uuids))(*[u.encode() for u in uuids])
    assert lib.c_loop_init(arr, len(uuids)) == 0
    values = (ctypes.c_double * (len(uuids) * per_device))()
    status = (ctypes.c_int * (len(uuids) * per_device))()
    poll = lib.c_loop_poll
    poll.restype = None
    _info(benchmark, "c_loop", uuids, per_device)
    benchmark(poll, values, status)
