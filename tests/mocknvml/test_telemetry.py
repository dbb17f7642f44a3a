"""Telemetry and field values (what the poller and the health exporter read), per profile values."""

from __future__ import annotations

from typing import Any

import pytest

from dradriver.nvml import mock

NVML_FI_DEV_GPU_TEMP = 308  # nvml.h; newer than this pynvml


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "gb200-nvl72-node", "l4-inference"])
def test_telemetry_matches_the_profile(nvml: Any, name: str) -> None:
    pynvml = nvml(name)
    g = mock.resolved_gpus(mock.load_profile(name))[0]
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    util = pynvml.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (g["utilization"]["gpu"], g["utilization"]["memory"])
    assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == g["temperature"]
    assert pynvml.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU) == g["temperature"]
    assert pynvml.nvmlDeviceGetPowerUsage(h) == g["power"]["usage"]
    assert pynvml.nvmlDeviceGetPowerManagementLimit(h) == g["power"]["limit"]
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(h) == g["power"]["limit"]
    assert pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h) == [g["power"]["minLimit"], g["power"]["maxLimit"]]
    for clock, key in ((pynvml.NVML_CLOCK_GRAPHICS, "graphics"), (pynvml.NVML_CLOCK_SM, "sm"),
                       (pynvml.NVML_CLOCK_MEM, "mem"), (pynvml.NVML_CLOCK_VIDEO, "video")):
        assert pynvml.nvmlDeviceGetClockInfo(h, clock) == g["clocks"][key]
        assert pynvml.nvmlDeviceGetMaxClockInfo(h, clock) == g["maxClocks"][key]
        assert g["clocks"][key] <= g["maxClocks"][key]
    assert pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES) == g["pcieThroughput"]["tx"]
    assert pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) == g["pcieThroughput"]["rx"]
    assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h) == g["pcieMaxGen"]
    assert pynvml.nvmlDeviceGetEccMode(h) == [1, 1]
    for error_type in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
        for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            assert pynvml.nvmlDeviceGetTotalEccErrors(h, error_type, counter) == 0
            assert pynvml.nvmlDeviceGetMemoryErrorCounter(h, error_type, counter,
                                                         pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY) == 0
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == 0
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) >= 0
    assert pynvml.nvmlDeviceGetBAR1MemoryInfo(h).bar1Total == g["bar1Total"]
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(h) == []


def test_field_values(lib: Any, nvml: Any) -> None:
    pynvml = nvml("dgx-h100")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    lib.mocknvml_control(b"ecc 0 uncorrected volatile 3")
    lib.mocknvml_control(b"ecc 0 corrected aggregate 40")
    lib.mocknvml_control(b"set 0 remappedRows.uncorrected 2")
    lib.mocknvml_control(b"set 0 remappedRows.pending 1")
    ids = [pynvml.NVML_FI_DEV_ECC_CURRENT, pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL,
           pynvml.NVML_FI_DEV_REMAPPED_UNC, pynvml.NVML_FI_DEV_REMAPPED_PENDING, pynvml.NVML_FI_DEV_POWER_INSTANT,
           pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT, pynvml.NVML_FI_DEV_RETIRED_DBE, NVML_FI_DEV_GPU_TEMP,
           pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 250]
    values = pynvml.nvmlDeviceGetFieldValues(h, ids)
    by_id = {v.fieldId: v for v in values}
    def value(fid: int) -> int:
        v = by_id[fid]
        assert v.nvmlReturn == 0, fid
        return int(v.value.ullVal if v.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG else v.value.uiVal)
    assert value(pynvml.NVML_FI_DEV_ECC_CURRENT) == 1
    assert value(pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL) == 3
    assert value(pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL) == 40
    assert value(pynvml.NVML_FI_DEV_REMAPPED_UNC) == 2
    assert value(pynvml.NVML_FI_DEV_REMAPPED_PENDING) == 1
    assert value(pynvml.NVML_FI_DEV_POWER_INSTANT) == 72000
    assert value(pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT) == 700000
    assert value(pynvml.NVML_FI_DEV_RETIRED_DBE) == 0
    assert value(NVML_FI_DEV_GPU_TEMP) == 29
    assert value(pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES) >= 0
    assert by_id[250].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert all(v.timestamp > 0 for v in values)


def test_field_values_on_a_mig_device_are_not_supported(nvml: Any) -> None:
    pynvml = nvml("dgx-a100")
    m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(0), 0)
    values = pynvml.nvmlDeviceGetFieldValues(m, [pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL])
    assert values[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_invalid_sensor_and_clock_arguments(nvml: Any) -> None:
    pynvml = nvml("dgx-a100")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetClockInfo(h, 9)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetTemperature(h, 5)
