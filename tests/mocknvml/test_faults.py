"""Fault injection: malformed profiles, failing init, NOT_SUPPORTED, lost GPUs, events, runtime control."""

from __future__ import annotations

import ctypes
import json
import threading
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dradriver.nvml import mock

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
NO_ID = 0xFFFFFFFF


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": 1,', "1:14: unexpected end of input"),
        ('{"format": 1, "gpus": [1,]}', "1:26: unexpected character ']'"),
        ('{"a": "unterminated}', "unterminated string"),
        ('{"a": "\\q"}', "invalid escape"),
        ("[" * 100 + "]" * 100, "nesting deeper than 64"),
        ('{"a": 01}', "leading zero"),
        ('{} {}', "trailing characters"),
        ('{"format": 2, "system": {}, "gpus": []}', "'format' must be 1"),
        ('{"format": 1, "system": {"driverVersion": "1"}, "gpus": [{"name": "x"}]}', "missing required key 'uuid'"),
    ],
)
def test_malformed_profile_fails_init_with_a_clear_message(
    nvml: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml(path)
    err = capfd.readouterr().err
    assert f"mocknvml: {path}" in err and message in err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p["gpus"][0]["gpuInstances"][0].update(placement={"start": 1, "size": 4}),
         "placement 1:4 is not a possible placement of profile 9"),
        (lambda p: p["gpus"][0]["gpuInstances"][1].update(placement={"start": 4, "size": 2}),
         "overlaps another GPU instance"),
        (lambda p: p["gpus"][0]["gpuInstances"][1].update(id=1), "duplicate GPU instance id 1"),
        (lambda p: p["gpus"][3].update(uuid=p["gpus"][2]["uuid"]), "duplicate uuid"),
        (lambda p: p["gpus"][3].update(model="a200"), "model 'a200' is not defined"),
        (lambda p: p["gpus"][3].update(minorNumber="three"), "'minorNumber' must be an integer"),
        (lambda p: p["gpus"][5].update(gpuInstances=[]) or p["gpus"][5]["migMode"].update(current=0)
         or p["gpus"][0]["migMode"].update(current=0), "'gpuInstances' given but migMode.current is not 1"),
    ],
)
def test_inconsistent_profile_is_refused(
    nvml: Any, write_profile: Any, capfd: pytest.CaptureFixture[str], edit: Any, message: str
) -> None:
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml(write_profile("dgx-a100", edit))
    assert message in capfd.readouterr().err


def test_missing_profile_variable(lib: ctypes.CDLL, nvml: Any, monkeypatch: pytest.MonkeyPatch,
                                  capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(mock.PROFILE_ENV, raising=False)
    assert lib.nvmlInit_v2() == pynvml.NVML_ERROR_UNKNOWN
    assert mock.PROFILE_ENV in capfd.readouterr().err


def test_failing_init_returns_the_chosen_code(nvml: Any, write_profile: Any) -> None:
    path = write_profile("dgx-h100", lambda p: p.update(faults={"initReturn": pynvml.NVML_ERROR_DRIVER_NOT_LOADED}))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nvml(path)
    pynvml_ = nvml("dgx-h100")  # a good profile afterwards initialises normally
    assert pynvml_.nvmlDeviceGetCount() == 8


def test_profile_switch_within_one_process(nvml: Any) -> None:
    pynvml_ = nvml("dgx-a100")
    assert pynvml_.nvmlDeviceGetCount() == 8
    pynvml_.nvmlShutdown()
    pynvml_ = nvml("gb200-nvl72-node")
    assert pynvml_.nvmlDeviceGetCount() == 4
    assert pynvml_.nvmlDeviceGetName(pynvml_.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA GB200"


def test_not_supported_injection(nvml: Any, write_profile: Any) -> None:
    def edit(p: dict[str, Any]) -> None:
        p["faults"] = {"notSupported": ["nvmlDeviceGetPowerUsage"]}
        p["gpus"][1]["notSupported"] = ["nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo"]

    pynvml_ = nvml(write_profile("dgx-h100", edit))
    g0, g1 = pynvml_.nvmlDeviceGetHandleByIndex(0), pynvml_.nvmlDeviceGetHandleByIndex(1)
    for h in (g0, g1):
        with pytest.raises(pynvml_.NVMLError_NotSupported):
            pynvml_.nvmlDeviceGetPowerUsage(h)
    with pytest.raises(pynvml_.NVMLError_NotSupported):
        pynvml_.nvmlDeviceGetUUID(g1)
    with pytest.raises(pynvml_.NVMLError_NotSupported):
        pynvml_.nvmlDeviceGetMemoryInfo(g1)
    assert pynvml_.nvmlDeviceGetUUID(g0).startswith("GPU-")
    # the versioned memory call is a different entry point and still works
    assert pynvml_.nvmlDeviceGetMemoryInfo(g1, version=pynvml_.nvmlMemory_v2).total == 81559 * 1024 * 1024


def test_lost_gpu_from_the_profile(nvml: Any, write_profile: Any) -> None:
    pynvml_ = nvml(write_profile("dgx-a100", lambda p: p["gpus"][1].update(lost=True)))
    assert pynvml_.nvmlDeviceGetCount() == 8
    with pytest.raises(pynvml_.NVMLError_GpuIsLost):
        pynvml_.nvmlDeviceGetHandleByIndex(1)
    uuid1 = mock.load_profile("dgx-a100")["gpus"][1]["uuid"]
    with pytest.raises(pynvml_.NVMLError_GpuIsLost):
        pynvml_.nvmlDeviceGetHandleByUUID(uuid1)
    assert pynvml_.nvmlDeviceGetName(pynvml_.nvmlDeviceGetHandleByIndex(2)) == "NVIDIA A100-SXM4-40GB"


def test_gpu_lost_and_back_at_run_time(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml_ = nvml("dgx-a100")
    h = pynvml_.nvmlDeviceGetHandleByIndex(0)
    m = pynvml_.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert lib.mocknvml_set_lost(0, 1) == 0
    for call, handle in ((pynvml_.nvmlDeviceGetName, h), (pynvml_.nvmlDeviceGetUUID, m),
                         (pynvml_.nvmlDeviceGetMemoryInfo, h)):
        with pytest.raises(pynvml_.NVMLError_GpuIsLost):
            call(handle)
    assert lib.mocknvml_set_lost(0, 0) == 0
    assert pynvml_.nvmlDeviceGetName(h) == "NVIDIA A100-SXM4-40GB"
    assert lib.mocknvml_set_lost(99, 1) == pynvml_.NVML_ERROR_INVALID_ARGUMENT


def test_events_queued_in_the_profile(nvml: Any, write_profile: Any) -> None:
    def edit(p: dict[str, Any]) -> None:
        p["gpus"][0]["events"] = [
            {"eventType": XID, "eventData": 31, "gpuInstanceId": 9, "computeInstanceId": 0},
            {"eventType": XID, "eventData": 79},
        ]
        p["gpus"][3]["events"] = [{"eventType": DBE}]

    pynvml_ = nvml(write_profile("dgx-a100", edit))
    h0, h3 = pynvml_.nvmlDeviceGetHandleByIndex(0), pynvml_.nvmlDeviceGetHandleByIndex(3)
    assert pynvml_.nvmlDeviceGetSupportedEventTypes(h0) & (XID | DBE) == XID | DBE
    es = pynvml_.nvmlEventSetCreate()
    pynvml_.nvmlDeviceRegisterEvents(h0, XID, es)
    pynvml_.nvmlDeviceRegisterEvents(h3, XID | DBE, es)
    got = []
    for _ in range(3):
        data = pynvml_.nvmlEventSetWait(es, 0)
        got.append((pynvml_.nvmlDeviceGetIndex(data.device), data.eventType, data.eventData, data.gpuInstanceId,
                    data.computeInstanceId))
    assert got == [(0, XID, 31, 9, 0), (0, XID, 79, NO_ID, NO_ID), (3, DBE, 0, NO_ID, NO_ID)]
    with pytest.raises(pynvml_.NVMLError_Timeout):
        pynvml_.nvmlEventSetWait(es, 0)
    pynvml_.nvmlEventSetFree(es)


def test_event_registration_rules(nvml: Any, write_profile: Any) -> None:
    pynvml_ = nvml(write_profile("dgx-a100", lambda p: p["models"]["a100-sxm4-40gb"].update(supportedEventTypes=XID)))
    h = pynvml_.nvmlDeviceGetHandleByIndex(0)
    es = pynvml_.nvmlEventSetCreate()
    with pytest.raises(pynvml_.NVMLError_NotSupported):
        pynvml_.nvmlDeviceRegisterEvents(h, DBE, es)
    with pytest.raises(pynvml_.NVMLError_NotSupported):
        pynvml_.nvmlDeviceRegisterEvents(pynvml_.nvmlDeviceGetMigDeviceHandleByIndex(h, 0), XID, es)
    pynvml_.nvmlEventSetFree(es)
    with pytest.raises(pynvml_.NVMLError_InvalidArgument):
        pynvml_.nvmlEventSetFree(es)


def test_event_injected_while_waiting(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml_ = nvml("dgx-a100")
    h = pynvml_.nvmlDeviceGetHandleByIndex(1)
    es = pynvml_.nvmlEventSetCreate()
    pynvml_.nvmlDeviceRegisterEvents(h, XID, es)
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(pynvml_.nvmlEventSetWait(es, 60_000)))
    waiter.start()
    assert lib.mocknvml_inject_event(1, XID, 48, 2, 0) == 0
    waiter.join()
    data = result[0]
    assert (data.eventType, data.eventData, data.gpuInstanceId, data.computeInstanceId) == (XID, 48, 2, 0)
    assert pynvml_.nvmlDeviceGetIndex(data.device) == 1
    pynvml_.nvmlEventSetFree(es)


def test_wait_reports_a_lost_gpu(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml_ = nvml("dgx-h100")
    es = pynvml_.nvmlEventSetCreate()
    pynvml_.nvmlDeviceRegisterEvents(pynvml_.nvmlDeviceGetHandleByIndex(5), XID, es)
    lib.mocknvml_set_lost(5, 1)
    with pytest.raises(pynvml_.NVMLError_GpuIsLost):
        pynvml_.nvmlEventSetWait(es, 60_000)


def test_control_file_drives_another_process_view(nvml: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "control"
    control.write_text("# commands appended by a test\n")
    monkeypatch.setenv(mock.CONTROL_ENV, str(control))
    pynvml_ = nvml("dgx-h100")
    h2 = pynvml_.nvmlDeviceGetHandleByIndex(2)
    es = pynvml_.nvmlEventSetCreate()
    pynvml_.nvmlDeviceRegisterEvents(h2, XID | DBE, es)
    with control.open("a") as f:
        f.write("ecc 2 uncorrected volatile 5\nset 2 temperature 91\nevent 2 8 79\nlost 4 1\n")
        f.write("notsupported * nvmlDeviceGetSerial 1\n")
    assert pynvml_.nvmlDeviceGetTotalEccErrors(h2, 1, 0) == 5
    assert pynvml_.nvmlDeviceGetTemperature(h2, 0) == 91
    assert pynvml_.nvmlEventSetWait(es, 60_000).eventData == 79
    with pytest.raises(pynvml_.NVMLError_GpuIsLost):
        pynvml_.nvmlDeviceGetHandleByIndex(4)
    with pytest.raises(pynvml_.NVMLError_NotSupported):
        pynvml_.nvmlDeviceGetSerial(h2)
    # a command being written (no newline yet) waits for the rest of its line
    with control.open("a") as f:
        f.write("lost 4 0")
    with pytest.raises(pynvml_.NVMLError_GpuIsLost):
        pynvml_.nvmlDeviceGetHandleByIndex(4)
    with control.open("a") as f:
        f.write("\n")
    assert pynvml_.nvmlDeviceGetIndex(pynvml_.nvmlDeviceGetHandleByIndex(4)) == 4


def test_driver_unloaded_under_a_running_library_fails_every_call_and_init_until_loaded(
        nvml: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_profile: Any) -> None:
    """``driver unloaded [rc]`` in the control file: the running library's system, device and event calls return
    ``rc`` (default DRIVER_NOT_LOADED), a new ``nvmlInit`` fails with DRIVER_NOT_LOADED while the file's last
    ``driver`` line says so, and after ``driver loaded`` an init reads the profile again (a new driver version)."""
    control = tmp_path / "control"
    control.write_text("")
    monkeypatch.setenv(mock.CONTROL_ENV, str(control))
    profile = write_profile("dgx-h100")
    pynvml_ = nvml(profile)
    h0 = pynvml_.nvmlDeviceGetHandleByIndex(0)
    es = pynvml_.nvmlEventSetCreate()
    with control.open("a") as f:
        f.write("driver unloaded\n")
    with pytest.raises(pynvml_.NVMLError_DriverNotLoaded):
        pynvml_.nvmlSystemGetDriverVersion()
    with pytest.raises(pynvml_.NVMLError_DriverNotLoaded):
        pynvml_.nvmlDeviceGetTemperature(h0, 0)
    with pytest.raises(pynvml_.NVMLError_DriverNotLoaded):
        pynvml_.nvmlEventSetWait(es, 10)
    with control.open("a") as f:
        f.write("driver unloaded 15\n")
    with pytest.raises(pynvml_.NVMLError_GpuIsLost):
        pynvml_.nvmlDeviceGetTemperature(h0, 0)
    pynvml_.nvmlShutdown()  # the stale session is shut: this works whatever the driver does
    with pytest.raises(pynvml_.NVMLError_DriverNotLoaded):
        pynvml_.nvmlInit()
    data = json.loads(profile.read_text())
    data["system"]["driverVersion"] = "590.48.01"
    profile.write_text(json.dumps(data))
    with control.open("a") as f:
        f.write("driver loaded\n")
    pynvml_.nvmlInit()
    assert pynvml_.nvmlSystemGetDriverVersion() == "590.48.01"
    assert pynvml_.nvmlDeviceGetCount() == 8
    with control.open("a") as f:
        f.write("driver sideways\n")  # malformed: refused, the state stays
    assert pynvml_.nvmlSystemGetDriverVersion() == "590.48.01"


def test_control_function(lib: ctypes.CDLL, nvml: Any) -> None:
    pynvml_ = nvml("dgx-a100")
    assert lib.mocknvml_control(b"set 0 power.usage 350000") == 0
    assert pynvml_.nvmlDeviceGetPowerUsage(pynvml_.nvmlDeviceGetHandleByIndex(0)) == 350000
    assert lib.mocknvml_control(b"set 0 no.such.key 1") == pynvml_.NVML_ERROR_NOT_FOUND
    assert lib.mocknvml_control(b"frobnicate 0") == pynvml_.NVML_ERROR_INVALID_ARGUMENT
    assert lib.mocknvml_set_ecc(0, 1, 1, 12) == 0
    assert pynvml_.nvmlDeviceGetTotalEccErrors(pynvml_.nvmlDeviceGetHandleByIndex(0), 1, 1) == 12


_VALID = json.dumps(mock.load_profile("l4-inference")).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_profiles_never_crash(lib: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      edits: list[tuple[int, int]]) -> None:
    data = bytearray(_VALID)
    for pos, byte in edits:
        data[pos] = byte
    path = tmp_path / "fuzz.json"
    path.write_bytes(bytes(data))
    monkeypatch.setenv(mock.PROFILE_ENV, str(path))
    rc = lib.nvmlInit_v2()
    assert rc in (0, pynvml.NVML_ERROR_UNKNOWN)
    if rc == 0:
        count = ctypes.c_uint()
        assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        assert lib.nvmlShutdown() == 0
