"""The NVML poller: compiled extension and pynvml twin sample identical values through the mock's C ABI."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dradriver import _native
from dradriver._native import nvmlfields, nvmlpoll_py
from dradriver.nvml import errors, mock
from dradriver.nvml.discovery import discover
from dradriver.nvml.poller import PollLoop, open_poller
from dradriver.nvml.session import NvmlSession, open_session

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_GPU_IS_LOST = 15
EXTENSIONS_EXPECTED = os.environ.get("DRADRIVER_NO_EXTENSIONS") != "1"
RISING = {"energy_millijoules"}  # counters that grow with time: compared by status, not value


def _same(a: nvmlfields.Sample, b: nvmlfields.Sample) -> None:
    assert list(a.status) == list(b.status)
    for device in a.devices:
        for field in a.fields:
            if field not in RISING:
                assert a.get(device, field) == b.get(device, field), (device, field)


def _compiled() -> ModuleType | None:
    try:
        from dradriver._native import nvmlpoll
    except ImportError:
        return None
    return nvmlpoll


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[NvmlSession, list[str], list[str]]]:
    """The dgx-a100 mock node: (session, GPU UUIDs, MIG UUIDs)."""
    session = open_session(mock_profile="dgx-a100")
    try:
        inventory = discover(session)
        yield session, [g.uuid for g in inventory.gpus], [m.uuid for m in inventory.migs]
    finally:
        session.close()


def _pollers(uuids: list[str], fields: list[str] | None = None) -> list[object]:
    out: list[object] = [nvmlpoll_py.Poller(uuids, fields)]
    compiled = _compiled()
    if compiled is not None:
        out.append(compiled.Poller(uuids, fields))
    return out


def test_compiled_poller_is_loaded_when_expected() -> None:
    if not EXTENSIONS_EXPECTED:
        assert _native.implementation("nvmlpoll") == "py"
        return
    assert _compiled() is not None, "dradriver._native.nvmlpoll was expected but is not importable"
    assert _native.implementation("nvmlpoll") == "c"


def test_extension_and_twin_sample_identical_values(node: tuple[NvmlSession, list[str], list[str]]) -> None:
    _, gpus, migs = node
    pollers = _pollers(gpus + migs)
    try:
        samples = [p.poll() for p in pollers]  # type: ignore[attr-defined]
        first = samples[0]
        assert len(first.values) == len(gpus + migs) * len(nvmlfields.FIELD_NAMES)
        for other in samples[1:]:
            _same(first, other)
    finally:
        for p in pollers:
            p.close()  # type: ignore[attr-defined]


def test_values_match_the_profile_and_mig_devices_report_not_supported(
    node: tuple[NvmlSession, list[str], list[str]],
) -> None:
    _, gpus, migs = node
    resolved = {g["uuid"]: g for g in mock.resolved_gpus(mock.load_profile("dgx-a100"))}
    for poller in _pollers(gpus + migs):
        try:
            sample = poller.poll()  # type: ignore[attr-defined]
            for uuid in gpus:
                gpu = resolved[uuid]
                assert sample.get(uuid, "temperature_celsius") == gpu["temperature"]
                assert sample.get(uuid, "power_usage_milliwatts") == gpu["power"]["usage"]
                assert sample.get(uuid, "memory_total_bytes") == gpu["memory"]["total"]
                assert sample.get(uuid, "sm_clock_mhz") == gpu["clocks"]["sm"]
            for uuid in migs:
                assert sample.code(uuid, "gpu_utilization_percent") == NVML_ERROR_NOT_SUPPORTED
                assert sample.get(uuid, "temperature_celsius") is None
                assert sample.get(uuid, "memory_total_bytes") is not None  # a MIG device has its own memory
        finally:
            poller.close()  # type: ignore[attr-defined]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_device_and_field_selections_agree(
    node: tuple[NvmlSession, list[str], list[str]], data: st.DataObject
) -> None:
    _, gpus, migs = node
    devices = data.draw(st.lists(st.sampled_from(gpus + migs), min_size=1, max_size=12))
    fields = data.draw(st.lists(st.sampled_from(nvmlfields.FIELD_NAMES), min_size=1, unique=True))
    pollers = _pollers(devices, fields)
    try:
        samples = [p.poll() for p in pollers]  # type: ignore[attr-defined]
        for s in samples:
            assert s.fields == tuple(fields) and s.devices == tuple(devices)
        for other in samples[1:]:
            _same(samples[0], other)
    finally:
        for p in pollers:
            p.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fields", "message"),
    [(["no_such_field"], "unknown NVML poller field"), (["sm_clock_mhz", "sm_clock_mhz"], "given twice")],
)
def test_bad_fields_fail_identically(node: tuple[NvmlSession, list[str], list[str]], fields: list[str],
                                     message: str) -> None:
    _, gpus, _ = node
    impls = [nvmlpoll_py] + ([m] if (m := _compiled()) is not None else [])
    for impl in impls:
        with pytest.raises(ValueError, match=message):
            impl.Poller(gpus[:1], fields)


def test_unknown_uuid_fails_identically(node: tuple[NvmlSession, list[str], list[str]]) -> None:
    impls = [nvmlpoll_py] + ([m] if (m := _compiled()) is not None else [])
    for impl in impls:
        with pytest.raises(nvmlfields.PollerError) as info:
            impl.Poller(["GPU-00000000-0000-0000-0000-000000000000"])
        assert info.value.code == NVML_ERROR_NOT_FOUND
    with pytest.raises(errors.NvmlNotFound):
        open_poller(["GPU-00000000-0000-0000-0000-000000000000"])


def test_lost_gpu_reports_gpu_is_lost_in_both(node: tuple[NvmlSession, list[str], list[str]]) -> None:
    _, gpus, _ = node
    lib = ctypes.CDLL(str(mock.library_path()))
    pollers = _pollers(gpus[2:4])
    try:
        assert lib.mocknvml_set_lost(ctypes.c_uint(2), 1) == 0
        samples = [p.poll() for p in pollers]  # type: ignore[attr-defined]
        for s in samples:
            assert s.code(gpus[2], "temperature_celsius") == NVML_ERROR_GPU_IS_LOST
            assert s.get(gpus[3], "temperature_celsius") is not None
        assert all(list(s.status) == list(samples[0].status) for s in samples)
    finally:
        lib.mocknvml_set_lost(ctypes.c_uint(2), 0)
        for p in pollers:
            p.close()  # type: ignore[attr-defined]


def test_poll_loop_keeps_the_latest_sample(node: tuple[NvmlSession, list[str], list[str]]) -> None:
    _, gpus, _ = node
    seen: list[float] = []
    loop = PollLoop(gpus, interval_s=0.01, on_sample=lambda s: seen.append(s.timestamp))
    try:
        loop.start()
        deadline = time.monotonic() + 10
        while loop.polls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.polls >= 3 and loop.latest is not None
        assert seen == sorted(seen)
        assert loop.latest.get(gpus[0], "memory_total_bytes") == 40 * 2**30
    finally:
        loop.stop()
