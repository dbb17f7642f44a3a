"""The NVML poller's field table, shared by the compiled poller (``ext/nvmlpoll.pyx``) and its twin.

Each field is sampled for every device (GPU or MIG device) by one NVML call; fields of kind ``FIELD`` are
fetched together through one ``nvmlDeviceGetFieldValues`` call per device (the batched API). Field IDs and
enum values come from the official ``nvml.h`` (``NVML_FI_DEV_*``, ``nvmlClockType_t``,
``nvmlPcieUtilCounter_t``). Units are in the field names.
"""

from __future__ import annotations

from typing import Final

# Sampling kinds (how one value is obtained).
KIND_UTIL_GPU: Final = 0  # nvmlDeviceGetUtilizationRates().gpu, percent
KIND_UTIL_MEM: Final = 1  # nvmlDeviceGetUtilizationRates().memory, percent
KIND_MEM_TOTAL: Final = 2  # nvmlDeviceGetMemoryInfo_v2().total, bytes
KIND_MEM_USED: Final = 3  # nvmlDeviceGetMemoryInfo_v2().used, bytes
KIND_MEM_FREE: Final = 4  # nvmlDeviceGetMemoryInfo_v2().free, bytes
KIND_TEMPERATURE: Final = 5  # nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU), degrees C
KIND_POWER: Final = 6  # nvmlDeviceGetPowerUsage, milliwatts
KIND_CLOCK: Final = 7  # nvmlDeviceGetClockInfo(arg), MHz
KIND_PCIE: Final = 8  # nvmlDeviceGetPcieThroughput(arg), KB/s
KIND_FIELD: Final = 9  # nvmlDeviceGetFieldValues(fieldId=arg)

NVML_CLOCK_SM: Final = 1
NVML_CLOCK_MEM: Final = 2
NVML_PCIE_UTIL_TX_BYTES: Final = 0
NVML_PCIE_UTIL_RX_BYTES: Final = 1

# nvmlReturn_t values the poller itself produces or checks (nvml.h).
NVML_SUCCESS: Final = 0
NVML_ERROR_NOT_SUPPORTED: Final = 3
NVML_ERROR_UNKNOWN: Final = 999

FIELDS: Final[tuple[tuple[str, int, int], ...]] = (
    ("gpu_utilization_percent", KIND_UTIL_GPU, 0),
    ("memory_utilization_percent", KIND_UTIL_MEM, 0),
    ("memory_total_bytes", KIND_MEM_TOTAL, 0),
    ("memory_used_bytes", KIND_MEM_USED, 0),
    ("memory_free_bytes", KIND_MEM_FREE, 0),
    ("temperature_celsius", KIND_TEMPERATURE, 0),
    ("power_usage_milliwatts", KIND_POWER, 0),
    ("sm_clock_mhz", KIND_CLOCK, NVML_CLOCK_SM),
    ("memory_clock_mhz", KIND_CLOCK, NVML_CLOCK_MEM),
    ("pcie_tx_kilobytes_per_second", KIND_PCIE, NVML_PCIE_UTIL_TX_BYTES),
    ("pcie_rx_kilobytes_per_second", KIND_PCIE, NVML_PCIE_UTIL_RX_BYTES),
    ("ecc_sbe_volatile_total", KIND_FIELD, 3),  # NVML_FI_DEV_ECC_SBE_VOL_TOTAL
    ("ecc_dbe_volatile_total", KIND_FIELD, 4),  # NVML_FI_DEV_ECC_DBE_VOL_TOTAL
    ("ecc_sbe_aggregate_total", KIND_FIELD, 5),  # NVML_FI_DEV_ECC_SBE_AGG_TOTAL
    ("ecc_dbe_aggregate_total", KIND_FIELD, 6),  # NVML_FI_DEV_ECC_DBE_AGG_TOTAL
    ("retired_pages_sbe", KIND_FIELD, 29),  # NVML_FI_DEV_RETIRED_SBE
    ("retired_pages_dbe", KIND_FIELD, 30),  # NVML_FI_DEV_RETIRED_DBE
    ("retired_pages_pending", KIND_FIELD, 31),  # NVML_FI_DEV_RETIRED_PENDING
    ("remapped_rows_correctable", KIND_FIELD, 142),  # NVML_FI_DEV_REMAPPED_COR
    ("remapped_rows_uncorrectable", KIND_FIELD, 143),  # NVML_FI_DEV_REMAPPED_UNC
    ("remapped_rows_pending", KIND_FIELD, 144),  # NVML_FI_DEV_REMAPPED_PENDING
    ("remapped_rows_failure", KIND_FIELD, 145),  # NVML_FI_DEV_REMAPPED_FAILURE
    ("energy_millijoules", KIND_FIELD, 83),  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
)
"""``(name, kind, argument)`` for every field the poller can sample, in buffer order."""

FIELD_NAMES: Final[tuple[str, ...]] = tuple(f[0] for f in FIELDS)
_BY_NAME: Final = {f[0]: f for f in FIELDS}


class PollerError(Exception):
    """NVML refused to set up polling (init, or a device UUID it does not know).

    :param code: the ``nvmlReturn_t`` value.
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (nvmlReturn_t {code})")
        self.code = code


def resolve_fields(names: tuple[str, ...] | list[str] | None) -> tuple[tuple[str, int, int], ...]:
    """Return the table rows for ``names`` (all fields when ``None``), in the caller's order.

    :raises ValueError: an unknown or repeated field name.
    """
    if names is None:
        return FIELDS
    out = []
    seen = set()
    for name in names:
        if name not in _BY_NAME:
            raise ValueError(f"unknown NVML poller field {name!r}; known: {', '.join(FIELD_NAMES)}")
        if name in seen:
            raise ValueError(f"NVML poller field {name!r} given twice")
        seen.add(name)
        out.append(_BY_NAME[name])
    return tuple(out)


def make_index(devices: tuple[str, ...], fields: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int]]:
    """Row and column lookup tables of a :class:`Sample`; pollers build them once and share them."""
    return {uuid: i for i, uuid in enumerate(devices)}, {name: i for i, name in enumerate(fields)}


class Sample:
    """One poll of every device and field: a compact typed buffer plus its index.

    :param devices: device UUIDs (GPU ``GPU-...`` or MIG ``MIG-...``), the buffer's rows.
    :param fields: field names, the buffer's columns.
    :param values: ``array('d')`` of ``len(devices) * len(fields)`` values, row-major; a value whose status
        is not ``NVML_SUCCESS`` is ``0.0``.
    :param status: ``array('i')`` of the same length: the ``nvmlReturn_t`` of each value.
    :param timestamp: ``time.monotonic()`` seconds when the poll started.
    :param index: prebuilt ``(row, column)`` lookup tables from :func:`make_index` (shared between polls).
    """

    __slots__ = ("_column", "_row", "devices", "fields", "status", "timestamp", "values")

    def __init__(
        self,
        devices: tuple[str, ...],
        fields: tuple[str, ...],
        values: object,
        status: object,
        timestamp: float,
        index: tuple[dict[str, int], dict[str, int]] | None = None,
    ) -> None:
        self.devices = devices
        self.fields = fields
        self.values = values
        self.status = status
        self.timestamp = timestamp
        if index is None:
            index = make_index(devices, fields)
        self._row, self._column = index

    def get(self, device: str, field: str) -> float | None:
        """The value of ``field`` for ``device``, or ``None`` when NVML did not return it.

        :raises KeyError: unknown device UUID or field name.
        """
        i = self._row[device] * len(self.fields) + self._column[field]
        if self.status[i] != NVML_SUCCESS:  # type: ignore[index]
            return None
        return float(self.values[i])  # type: ignore[index]

    def code(self, device: str, field: str) -> int:
        """The ``nvmlReturn_t`` status of one value."""
        return int(self.status[self._row[device] * len(self.fields) + self._column[field]])  # type: ignore[index]
