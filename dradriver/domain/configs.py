"""NVIDIA's opaque device configuration API (``resource.nvidia.com/v1beta1``): decoding, defaults, validation
and selection of the config that applies to each allocated device.

A ResourceClaim may carry opaque configs for ``gpu.nvidia.com`` in ``status.allocation.devices.config[]``
(copied there from the DeviceClass, ``source: FromClass``, and from the claim, ``source: FromClaim``). Their
``opaque.parameters`` is one object of NVIDIA's API group; this driver accepts the kinds that apply to the
devices it publishes, ``GpuConfig``, ``MigDeviceConfig`` and ``VfioDeviceConfig`` (NVIDIA's
``api/nvidia.com/resource/v1beta1/gpuconfig.go``, ``migconfig.go``, ``sharing.go``, ``vfiodeviceconfig.go``,
``iommu.go``):

* **decoding** is strict, as NVIDIA's ``StrictDecoder``: ``apiVersion`` must be
  ``resource.nvidia.com/v1beta1``, ``kind`` one of the three, every field known and of the right JSON type;
  errors name the field path (``status.allocation.devices.config[1].opaque.parameters.sharing.strategy``);
* **normalising** fills implied defaults (``Normalize``): TimeSlicing without an interval gets ``Default``
  (also for ``timeSlicingConfig: {}``, which NVIDIA leaves unset and then dereferences), MPS without
  ``mpsConfig`` gets an empty one; a ``VfioDeviceConfig`` gets ``iommu.backendPolicy: LegacyOnly`` and
  ``iommu.enableAPIDevice: false`` where omitted;
* **validation** (``Validate``): the sharing strategy must be known and its feature gate enabled
  (``TimeSlicingSettings``, ``MPSSupport``; both off by default, section 8), the time-slice interval one of
  ``Default|Short|Medium|Long``, MPS ``defaultActiveThreadPercentage`` in 0..100; a ``VfioDeviceConfig`` needs
  the ``PassthroughSupport`` gate and a backend policy ``LegacyOnly|PreferIommuFD``;
* **selection** (section 3.6, ``prepareDevices``): built-in defaults (an empty ``GpuConfig``, an empty
  ``MigDeviceConfig`` and, with ``PassthroughSupport``, an empty ``VfioDeviceConfig``) at lowest precedence,
  then class configs, then claim configs. For each allocation
  result, configs are walked from the highest precedence; the first one that either names the result's
  request in ``requests`` (a kind/device-type mismatch there is an error) or has empty ``requests`` and a
  kind matching the device type wins. Unlike NVIDIA, a config naming the parent request ``r`` also matches
  sub-request results ``r/<sub>`` (DRA ``firstAvailable``). Results are grouped by winning config; each group
  is normalised and validated once and turned into a :class:`SharingPlan` (the checks NVIDIA makes when it
  applies a config: TimeSlicing with ``mpsConfig``, MPS with ``timeSlicingConfig``, pinned-memory limits and
  device keys, ``multiUser`` compute capability); a sharing strategy selected by an admin-access result is
  refused at ``...sharing.strategy`` (an admin claim never changes the device, :func:`refuse_admin_sharing`).
  At most one ``VfioDeviceConfig`` group per claim (NVIDIA's ``device_state.go``): the VFIO devices of a claim
  share one IOMMU backend choice.

The gates come from ``--feature-gates`` (:mod:`dradriver.domain.featuregates`); both sharing gates are off by
default, as in NVIDIA's driver, and a config selecting a strategy whose gate is off is rejected with NVIDIA's
wording. A sharing step (``dradriver.preparers.sharing``) applies each group's :class:`SharingPlan`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from math import ceil

from dradriver.domain.claims import Claim, ClaimError, base_request_name
from dradriver.domain.devices import DeviceType, GpuDevice, MigDevice
from dradriver.domain.featuregates import (
    DEFAULT_GATES,
    MPS_SUPPORT,
    PASSTHROUGH_SUPPORT,
    TIME_SLICING_SETTINGS,
    FeatureGates,
)
from dradriver.domain.passthrough import VfioDevice
from dradriver.domain.quantity import Quantity, QuantityError, parse_quantity
from dradriver.errors import DradriverError

API_VERSION = "resource.nvidia.com/v1beta1"
"""``apiVersion`` of every config (``api/nvidia.com/resource/v1beta1``)."""

GPU_CONFIG = "GpuConfig"
MIG_DEVICE_CONFIG = "MigDeviceConfig"
VFIO_DEVICE_CONFIG = "VfioDeviceConfig"
SUPPORTED_KINDS = (GPU_CONFIG, MIG_DEVICE_CONFIG, VFIO_DEVICE_CONFIG)

LEGACY_ONLY, PREFER_IOMMUFD = "LegacyOnly", "PreferIommuFD"
IOMMU_BACKEND_POLICIES = (LEGACY_ONLY, PREFER_IOMMUFD)
"""``iommu.backendPolicy`` values (NVIDIA's ``iommu.go``): ``LegacyOnly`` (the default) hands the VM the VFIO group
``/dev/vfio/<group>``; ``PreferIommuFD`` the VFIO device cdev ``/dev/vfio/devices/vfio<N>`` when the host has
``/dev/iommu``, else the group."""

UNSUPPORTED_KINDS = {
    "ComputeDomainChannelConfig": "it configures compute-domain.nvidia.com IMEX channels, not GPUs",
    "ComputeDomainDaemonConfig": "it configures compute-domain.nvidia.com IMEX daemons, not GPUs",
    "ComputeDomain": "it is a custom resource, not a device config",
    "ComputeDomainClique": "it is a custom resource, not a device config",
}
"""Other kinds registered in NVIDIA's API group, with why this driver does not take them as device configs."""

TIME_SLICING = "TimeSlicing"
MPS = "MPS"

TIME_SLICE_INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
"""Interval name -> ``nvidia-smi compute-policy --set-timeslice`` value (``sharing.go`` ``Int()``)."""

MIB = 1024 * 1024

MPS_WITH_CONSUMABLE_SHARES = "MPS sharing is not supported when consumable shares is enabled"
MPS_WITH_DYNAMIC_MIG = "MPS is not yet supported when using featureGates.DynamicMIG=true"
"""NVIDIA's refusals of the MPS strategy (``api/nvidia.com/resource/v1beta1/validate.go``), at ``sharing.strategy``."""

_NOT_IMPLEMENTED: dict[str, str] = {}
"""Strategy -> a note appended to its gate error while this driver does not implement it (none now: both are)."""
_INTEGER_KEY = re.compile(r"[+-]?[0-9]+")


class DeviceConfigError(DradriverError, ValueError):
    """A config is malformed or invalid.

    :param field: the full field path, e.g. ``status.allocation.devices.config[1].opaque.parameters.kind``.
    :param problem: what is wrong with it.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


# ------------------------------------------------------------------------------------------- the API types
@dataclass(frozen=True, slots=True)
class TimeSlicingConfig:
    """``timeSlicingConfig``: ``interval`` is ``Default|Short|Medium|Long`` (``None`` when omitted)."""

    interval: str | None = None


@dataclass(frozen=True, slots=True)
class MpsConfig:
    """``mpsConfig`` (reference 3.3).

    :param default_active_thread_percentage: ``defaultActiveThreadPercentage``, percent (0..100 valid).
    :param default_pinned_device_memory_limit: ``defaultPinnedDeviceMemoryLimit``, bytes, for every device.
    :param default_per_device_pinned_memory_limit: ``defaultPerDevicePinnedMemoryLimit`` as (key, bytes) pairs
        in document order; key = device UUID or index into the group's sorted UUIDs.
    :param multi_user: ``multiUser``; the control daemon starts with ``-M``.
    """

    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit: Quantity | None = None
    default_per_device_pinned_memory_limit: tuple[tuple[str, Quantity], ...] = ()
    multi_user: bool | None = None


@dataclass(frozen=True, slots=True)
class Sharing:
    """``sharing``: ``strategy`` (``""`` when omitted) and its settings; ``time_slicing`` only on GpuConfig."""

    strategy: str = ""
    time_slicing: TimeSlicingConfig | None = None
    mps: MpsConfig | None = None


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """``kind: GpuConfig``: applies to full GPUs (``type=gpu``)."""

    sharing: Sharing | None = None

    kind = GPU_CONFIG
    device_type = "gpu"


@dataclass(frozen=True, slots=True)
class MigDeviceConfig:
    """``kind: MigDeviceConfig``: applies to MIG devices (``type=mig``); no ``timeSlicingConfig`` field."""

    sharing: Sharing | None = None

    kind = MIG_DEVICE_CONFIG
    device_type = "mig"


@dataclass(frozen=True, slots=True)
class IommuConfig:
    """``iommu`` of a ``VfioDeviceConfig``.

    :param backend_policy: ``backendPolicy``, one of :data:`IOMMU_BACKEND_POLICIES` (``""`` when omitted).
    :param enable_api_device: ``enableAPIDevice``: also give the container the API device (``/dev/iommu`` with the
        iommufd backend, ``/dev/vfio/vfio`` with the legacy one); ``None`` when omitted.
    """

    backend_policy: str = ""
    enable_api_device: bool | None = None


@dataclass(frozen=True, slots=True)
class VfioDeviceConfig:
    """``kind: VfioDeviceConfig``: applies to VFIO passthrough devices (``type=vfio``, gate PassthroughSupport)."""

    iommu: IommuConfig | None = None

    kind = VFIO_DEVICE_CONFIG
    device_type = "vfio"

    @property
    def sharing(self) -> Sharing | None:
        """Always ``None``: a GPU given to a VM is not shared."""
        return None


DeviceConfig = GpuConfig | MigDeviceConfig | VfioDeviceConfig


# ------------------------------------------------------------------------------------------------ decoding
def _q(text: str) -> str:
    """Go's ``%q`` for the plain strings used here (a JSON string literal)."""
    return json.dumps(text)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _object(value: object, where: str, allowed: Sequence[str]) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise DeviceConfigError(where, f"must be an object, got {_type_name(value)}")
    for key in value:
        if key not in allowed:
            raise DeviceConfigError(f"{where}.{key}", f"unknown field (known fields: {', '.join(allowed)})")
    return value


def _string(value: object, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DeviceConfigError(where, f"must be a string, got {_type_name(value)}")
    return value


def _quantity(value: object, where: str) -> Quantity:
    if value is None:
        return Quantity.of(0)  # JSON null unmarshals to a zero resource.Quantity
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DeviceConfigError(where, f'must be a quantity such as "1Gi", got {_type_name(value)}')
    try:
        return parse_quantity(value)
    except QuantityError as exc:
        raise DeviceConfigError(where, str(exc)) from None


def _decode_mps(value: object, where: str) -> MpsConfig:
    obj = _object(value, where, ("defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                                 "defaultPerDevicePinnedMemoryLimit", "multiUser"))
    percentage = obj.get("defaultActiveThreadPercentage")
    if percentage is not None and (isinstance(percentage, bool) or not isinstance(percentage, int)):
        raise DeviceConfigError(f"{where}.defaultActiveThreadPercentage",
                          f"must be an integer, got {_type_name(percentage)} {percentage!r}")
    limit = obj.get("defaultPinnedDeviceMemoryLimit")
    default_limit = None if limit is None else _quantity(limit, f"{where}.defaultPinnedDeviceMemoryLimit")
    per_device: list[tuple[str, Quantity]] = []
    raw_map = obj.get("defaultPerDevicePinnedMemoryLimit")
    if raw_map is not None:
        map_where = f"{where}.defaultPerDevicePinnedMemoryLimit"
        if not isinstance(raw_map, Mapping):
            raise DeviceConfigError(map_where, f"must be an object of device -> quantity, got {_type_name(raw_map)}")
        for key, item in raw_map.items():
            per_device.append((str(key), _quantity(item, f"{map_where}[{_q(str(key))}]")))
    multi_user = obj.get("multiUser")
    if multi_user is not None and not isinstance(multi_user, bool):
        raise DeviceConfigError(f"{where}.multiUser", f"must be a boolean, got {_type_name(multi_user)}")
    return MpsConfig(
        default_active_thread_percentage=percentage,
        default_pinned_device_memory_limit=default_limit,
        default_per_device_pinned_memory_limit=tuple(per_device),
        multi_user=multi_user,
    )


def _decode_sharing(value: object, where: str, *, gpu: bool) -> Sharing | None:
    if value is None:
        return None
    allowed = ("strategy", "timeSlicingConfig", "mpsConfig") if gpu else ("strategy", "mpsConfig")
    obj = _object(value, where, allowed)
    time_slicing = None
    if obj.get("timeSlicingConfig") is not None:
        ts = _object(obj["timeSlicingConfig"], f"{where}.timeSlicingConfig", ("interval",))
        interval = ts.get("interval")
        time_slicing = TimeSlicingConfig(
            None if interval is None else _string(interval, f"{where}.timeSlicingConfig.interval"))
    mps = None if obj.get("mpsConfig") is None else _decode_mps(obj["mpsConfig"], f"{where}.mpsConfig")
    return Sharing(strategy=_string(obj.get("strategy"), f"{where}.strategy"), time_slicing=time_slicing, mps=mps)


def _decode_iommu(value: object, where: str) -> IommuConfig | None:
    if value is None:
        return None
    obj = _object(value, where, ("backendPolicy", "enableAPIDevice"))
    enable = obj.get("enableAPIDevice")
    if enable is not None and not isinstance(enable, bool):
        raise DeviceConfigError(f"{where}.enableAPIDevice", f"must be a boolean, got {_type_name(enable)}")
    return IommuConfig(_string(obj.get("backendPolicy"), f"{where}.backendPolicy"), enable)


def decode(parameters: object, where: str = "parameters") -> DeviceConfig:
    """Decode one ``opaque.parameters`` object strictly (NVIDIA ``configapi.StrictDecoder``).

    :param parameters: the JSON object as a dict.
    :param where: the field path of ``parameters``, prefixed to every error's field.
    :raises DeviceConfigError: not an object, missing or wrong ``apiVersion``/``kind``, a kind of NVIDIA's group
        that this driver does not support, an unknown field, or a value of the wrong JSON type.
    """
    kind_given = parameters.get("kind") if isinstance(parameters, Mapping) else None
    body = "iommu" if kind_given == VFIO_DEVICE_CONFIG else "sharing"
    obj = _object(parameters, where, ("apiVersion", "kind", body))
    api_version = obj.get("apiVersion")
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind:
        raise DeviceConfigError(f"{where}.kind",
                                f"Object 'Kind' is missing: must be one of {', '.join(SUPPORTED_KINDS)}")
    if not isinstance(api_version, str) or not api_version:
        raise DeviceConfigError(f"{where}.apiVersion", f"Object 'apiVersion' is missing: must be {API_VERSION!r}")
    if api_version != API_VERSION:
        raise DeviceConfigError(f"{where}.apiVersion", f"{api_version!r} is not supported: must be {API_VERSION!r}")
    if kind in UNSUPPORTED_KINDS:
        raise DeviceConfigError(f"{where}.kind", f"{kind} is not supported by this driver: {UNSUPPORTED_KINDS[kind]} "
                                           f"(supported kinds: {', '.join(SUPPORTED_KINDS)})")
    if kind not in SUPPORTED_KINDS:
        raise DeviceConfigError(f"{where}.kind", f"no kind {kind!r} is registered for version {API_VERSION!r} "
                                           f"(supported kinds: {', '.join(SUPPORTED_KINDS)})")
    if kind == GPU_CONFIG:
        return GpuConfig(_decode_sharing(obj.get("sharing"), f"{where}.sharing", gpu=True))
    if kind == VFIO_DEVICE_CONFIG:
        return VfioDeviceConfig(_decode_iommu(obj.get("iommu"), f"{where}.iommu"))
    return MigDeviceConfig(_decode_sharing(obj.get("sharing"), f"{where}.sharing", gpu=False))


# ----------------------------------------------------------------------------------- normalise and validate
def normalize(config: DeviceConfig, gates: FeatureGates = DEFAULT_GATES) -> DeviceConfig:
    """Fill implied defaults (NVIDIA ``Normalize``); returns a new config.

    TimeSlicing without ``timeSlicingConfig`` or without its ``interval`` gets ``Default`` (only with the
    TimeSlicingSettings gate, as NVIDIA); MPS without ``mpsConfig`` gets an empty one (only with MPSSupport); a
    ``VfioDeviceConfig`` gets ``backendPolicy: LegacyOnly`` and ``enableAPIDevice: false`` where omitted.
    """
    if isinstance(config, VfioDeviceConfig):
        iommu = config.iommu or IommuConfig()
        return VfioDeviceConfig(IommuConfig(iommu.backend_policy or LEGACY_ONLY, bool(iommu.enable_api_device)))
    sharing = config.sharing
    if sharing is None:
        return config
    if isinstance(config, GpuConfig) and sharing.strategy == TIME_SLICING and gates.time_slicing_settings:
        if sharing.time_slicing is None or sharing.time_slicing.interval is None:
            sharing = replace(sharing, time_slicing=TimeSlicingConfig("Default"))
    if sharing.strategy == MPS and sharing.mps is None and gates.mps_support:
        sharing = replace(sharing, mps=MpsConfig())
    return replace(config, sharing=sharing)


def _gate_error(strategy: str, gate: str) -> str:
    note = _NOT_IMPLEMENTED.get(strategy)
    return (f"{_q(strategy)} is selected as the GPU sharing strategy, but the {_q(gate)} feature gate is not "
            f"enabled" + (f" ({note})" if note else ""))


def validate(config: DeviceConfig, gates: FeatureGates = DEFAULT_GATES, where: str = "parameters") -> None:
    """Check a normalised config (NVIDIA ``Validate``).

    :raises DeviceConfigError: at ``<where>.sharing.strategy``: a strategy whose gate is off ("%q is selected as
        the GPU sharing strategy, but the %q feature gate is not enabled"), an unknown one ("unknown GPU sharing
        strategy"), MPS with the ConsumableShares gate on ("MPS sharing is not supported when consumable shares
        is enabled") or with DynamicMIG on ("MPS is not yet supported when using featureGates.DynamicMIG=true";
        the gate table forbids that pair at start-up, so only a hand-built gate set reaches it); at
        ``...timeSlicingConfig.interval``: not ``Default|Short|Medium|Long``; at
        ``...mpsConfig.defaultActiveThreadPercentage``: outside 0..100; a ``VfioDeviceConfig`` at ``<where>.kind``
        without the PassthroughSupport gate, at ``<where>.iommu.backendPolicy`` with a policy other than
        ``LegacyOnly|PreferIommuFD``.
    """
    if isinstance(config, VfioDeviceConfig):
        _validate_vfio(config, gates, where)
        return
    sharing = config.sharing
    if sharing is None:
        return
    at = f"{where}.sharing"
    if sharing.strategy == TIME_SLICING:
        if not gates.time_slicing_settings:
            raise DeviceConfigError(f"{at}.strategy", _gate_error(TIME_SLICING, TIME_SLICING_SETTINGS))
    elif sharing.strategy == MPS:
        if not gates.mps_support:
            raise DeviceConfigError(f"{at}.strategy", _gate_error(MPS, MPS_SUPPORT))
        if gates.consumable_shares:  # NVIDIA's apply-time refusals (cmd/gpu-kubelet-plugin/sharing.go)
            raise DeviceConfigError(f"{at}.strategy", MPS_WITH_CONSUMABLE_SHARES)
        if gates.dynamic_mig:
            raise DeviceConfigError(f"{at}.strategy", MPS_WITH_DYNAMIC_MIG)
    else:
        raise DeviceConfigError(f"{at}.strategy", f"unknown GPU sharing strategy: {sharing.strategy}, supported GPU "
                                            f"sharing strategies: {TIME_SLICING}, {MPS}")
    if sharing.strategy == TIME_SLICING and isinstance(config, GpuConfig):
        interval = sharing.time_slicing.interval if sharing.time_slicing else None
        if interval not in TIME_SLICE_INTERVALS:
            raise DeviceConfigError(f"{at}.timeSlicingConfig.interval",
                              f"unknown time-slice interval: {interval or ''}, supported time-slice intervals: "
                              f"{', '.join(TIME_SLICE_INTERVALS)}")
    if sharing.strategy == MPS and sharing.mps is not None:
        percentage = sharing.mps.default_active_thread_percentage
        if percentage is not None and percentage < 0:
            raise DeviceConfigError(f"{at}.mpsConfig.defaultActiveThreadPercentage",
                              "active thread percentage must not be negative")
        if percentage is not None and percentage > 100:
            raise DeviceConfigError(f"{at}.mpsConfig.defaultActiveThreadPercentage",
                              "active thread percentage must not be greater than 100")


def _validate_vfio(config: VfioDeviceConfig, gates: FeatureGates, where: str) -> None:
    if not gates.passthrough_support:
        raise DeviceConfigError(f"{where}.kind", f"{VFIO_DEVICE_CONFIG} needs the {_q(PASSTHROUGH_SUPPORT)} feature "
                                                 "gate (VFIO passthrough devices exist only with it)")
    policy = config.iommu.backend_policy if config.iommu is not None else LEGACY_ONLY
    if policy not in IOMMU_BACKEND_POLICIES:
        raise DeviceConfigError(f"{where}.iommu.backendPolicy", f"unknown IOMMU backend policy: {policy}, supported "
                                f"IOMMU backend policies: {', '.join(IOMMU_BACKEND_POLICIES)}")


# ------------------------------------------------------------------------------------------- sharing plans
@dataclass(frozen=True, slots=True)
class TimeSlicingPlan:
    """Time-slicing for a group of full GPUs: ``timeslice`` is the ``nvidia-smi compute-policy
    --set-timeslice`` value (Default 0, Short 1, Medium 2, Long 3)."""

    interval: str
    timeslice: int


@dataclass(frozen=True, slots=True)
class MpsPlan:
    """One MPS control daemon for a group of devices.

    :param pinned_memory_limits: (device UUID, ``"<n>M"`` whole MiB) pairs, sorted by UUID
        (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` entries).
    """

    active_thread_percentage: int | None
    pinned_memory_limits: tuple[tuple[str, str], ...]
    multi_user: bool


@dataclass(frozen=True, slots=True)
class SharingPlan:
    """What sharing a group of devices needs: ``strategy`` ``None`` (exclusive use), ``TimeSlicing`` or
    ``MPS``. TimeSlicing on MIG devices is valid and a no-op (``time_slicing`` ``None``)."""

    strategy: str | None = None
    time_slicing: TimeSlicingPlan | None = None
    mps: MpsPlan | None = None


EXCLUSIVE = SharingPlan()


def _megabytes(limit: Quantity) -> int:
    """Whole MiB as NVIDIA's ``limit.Megabyte``: ``Quantity.Value()`` (rounded up) / 1024 / 1024, truncated."""
    value = ceil(limit.value)
    return int(Fraction(value, MIB)) if value >= 0 else -int(Fraction(-value, MIB))


def _device_key(key: str, uuids: Sequence[str]) -> str:
    """A per-device limit key -> UUID (NVIDIA ``uuidSet.Normalize``)."""
    if key in uuids:
        return key
    if not _INTEGER_KEY.fullmatch(key):
        raise ValueError(f"invalid device: unable to parse key as an integer: {key}")
    index = int(key)
    if 0 <= index < len(uuids):
        return uuids[index]
    raise ValueError(f"invalid device: invalid device index: {index}")


def plan_sharing(config: DeviceConfig, devices: Sequence[GpuDevice | MigDevice | VfioDevice],
                 where: str = "parameters") -> SharingPlan:
    """Turn a normalised, validated config for ``devices`` into a :class:`SharingPlan`.

    Makes the checks NVIDIA makes when it applies the config (``GetTimeSlicingConfig``, ``GetMpsConfig``,
    ``MpsPerDevicePinnedMemoryLimit.Normalize``, the multi-user check).

    :param devices: the devices of the group; their sorted UUIDs are what integer limit keys index.
    :raises DeviceConfigError: TimeSlicing with ``mpsConfig`` or MPS with ``timeSlicingConfig`` (GpuConfig), a
        pinned-memory limit under 1 MiB ("invalid limit"), a limit key that is neither a UUID of the group nor
        an index into it ("invalid device"), ``multiUser`` with a GPU of compute capability below 7.0.
    """
    sharing = config.sharing
    if sharing is None:
        return EXCLUSIVE
    at = f"{where}.sharing"
    if sharing.strategy == TIME_SLICING:
        if isinstance(config, MigDeviceConfig):
            return SharingPlan(TIME_SLICING)
        if sharing.mps is not None:
            raise DeviceConfigError(f"{at}.mpsConfig", f"cannot use MpsConfig with the '{TIME_SLICING}' strategy")
        interval = sharing.time_slicing.interval if sharing.time_slicing else None
        interval = interval or "Default"
        return SharingPlan(TIME_SLICING, time_slicing=TimeSlicingPlan(interval, TIME_SLICE_INTERVALS[interval]))
    if sharing.time_slicing is not None:
        raise DeviceConfigError(f"{at}.timeSlicingConfig", f"cannot use TimeSlicingConfig with the '{MPS}' strategy")
    mps = sharing.mps or MpsConfig()
    uuids = sorted(d.uuid for d in devices)
    limits: dict[str, str] = {}
    default = mps.default_pinned_device_memory_limit
    if default is not None and uuids:
        megabytes = _megabytes(default)
        if megabytes <= 0:
            raise DeviceConfigError(f"{at}.mpsConfig.defaultPinnedDeviceMemoryLimit",
                              f"invalid limit: default value set too low: {default}")
        limits = {uuid: f"{megabytes}M" for uuid in uuids}
    for key, limit in mps.default_per_device_pinned_memory_limit:
        key_at = f"{at}.mpsConfig.defaultPerDevicePinnedMemoryLimit[{_q(key)}]"
        try:
            uuid = _device_key(key, uuids)
        except ValueError as exc:
            raise DeviceConfigError(key_at, str(exc)) from None
        megabytes = _megabytes(limit)
        if megabytes <= 0:
            raise DeviceConfigError(key_at, f"invalid limit: value set too low: {key}: {limit}")
        limits[uuid] = f"{megabytes}M"
    if mps.multi_user:
        for device in devices:
            if isinstance(device, GpuDevice) and device.cuda_compute_capability < (7, 0):
                major, minor = device.cuda_compute_capability
                raise DeviceConfigError(f"{at}.mpsConfig.multiUser",
                                  f"multi-user MPS needs compute capability 7.0 or newer; device "
                                  f"{device.name!r} has {major}.{minor}")
    return SharingPlan(MPS, mps=MpsPlan(mps.default_active_thread_percentage, tuple(sorted(limits.items())),
                                        bool(mps.multi_user)))


# -------------------------------------------------------------------------------------------------- selection
@dataclass(frozen=True, slots=True)
class ConfigEntry:
    """One decoded config in precedence order.

    :param where: field path of the entry (``status.allocation.devices.config[<i>]``) or
        ``built-in default <kind>``.
    :param source: ``FromClass``, ``FromClaim`` or ``Default``.
    :param requests: ``requests`` of the entry; empty = every request of a matching device type.
    """

    where: str
    source: str
    requests: tuple[str, ...]
    config: DeviceConfig

    @property
    def parameters_at(self) -> str:
        """Field path of the decoded object (prefix for validation errors)."""
        return f"{self.where}.opaque.parameters"


@dataclass(frozen=True, slots=True)
class ConfigGroup:
    """Allocation results that share one winning config.

    :param config: the winning config, normalised.
    :param results: indices into ``Claim.results``, in order.
    :param devices: DRA device names of those results, unique, in order.
    """

    entry: ConfigEntry
    config: DeviceConfig
    results: tuple[int, ...]
    devices: tuple[str, ...]
    plan: SharingPlan


@dataclass(frozen=True, slots=True)
class ConfigSelection:
    """The config of every allocation result of a claim.

    :param groups: one per winning config, in order of first use.
    :param by_result: for each entry of ``Claim.results``, the index of its group.
    """

    groups: tuple[ConfigGroup, ...]
    by_result: tuple[int, ...] = field(default_factory=tuple)

    def for_device(self, device: str) -> ConfigGroup | None:
        """The group of the first result naming ``device``, or ``None`` when no result names it."""
        for group in self.groups:
            if device in group.devices:
                return group
        return None

    def device_configs(self) -> dict[str, DeviceConfig]:
        """DRA device name -> the normalised config that applies to it (first result naming it wins)."""
        out: dict[str, DeviceConfig] = {}
        for group in self.groups:
            for name in group.devices:
                out.setdefault(name, group.config)
        return out


def _device_type(device: object) -> str:
    """``gpu`` for a full GPU; ``vfio`` for a VFIO device; ``mig`` for an existing MIG device and a dynamic-MIG
    placement."""
    return DeviceType.of(device).value


def decode_entries(claim: Claim, gates: FeatureGates = DEFAULT_GATES) -> list[ConfigEntry]:
    """Decode ``claim.configs`` (already ours and in precedence order, lowest first), defaults prepended (the
    ``VfioDeviceConfig`` default only with the PassthroughSupport gate, as NVIDIA's).

    :raises DeviceConfigError: an entry's ``requests`` is not a list of strings, or its parameters do not decode.
    """
    entries = [
        ConfigEntry("built-in default GpuConfig", "Default", (), GpuConfig()),
        ConfigEntry("built-in default MigDeviceConfig", "Default", (), MigDeviceConfig()),
    ]
    if gates.passthrough_support:
        entries.append(ConfigEntry("built-in default VfioDeviceConfig", "Default", (), VfioDeviceConfig()))
    indices = claim.config_indices if len(claim.config_indices) == len(claim.configs) else range(len(claim.configs))
    for index, raw in zip(indices, claim.configs, strict=True):
        where = f"status.allocation.devices.config[{index}]"
        requests = raw.get("requests")
        requests = [] if requests is None else requests
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise DeviceConfigError(f"{where}.requests", "must be a list of request names")
        opaque = raw.get("opaque")
        if not isinstance(opaque, Mapping):
            raise DeviceConfigError(where, "only opaque device configs are supported by this driver")
        config = decode(opaque.get("parameters"), f"{where}.opaque.parameters")
        entries.append(ConfigEntry(where, str(raw.get("source", "")), tuple(requests), config))
    return entries


def _names_request(requests: tuple[str, ...], request: str) -> bool:
    return request in requests or base_request_name(request) in requests


def refuse_admin_sharing(claim: Claim, entry: ConfigEntry, plan: SharingPlan, results: Sequence[int]) -> None:
    """Refuse a sharing config that selects a strategy for an admin-access result.

    An admin-access request observes a device that another claim may own (the scheduler and the plugin let it
    overlap, NVIDIA's ``cmd/gpu-kubelet-plugin/device_state.go``); it never changes the device. A time-slice, a compute
    mode or an MPS control daemon is a setting of the whole device, so applying an admin claim's sharing config would
    change the owner's setting, start a second daemon, and reset the owner's GPU at the admin claim's unprepare. As
    NVIDIA does since kubernetes-sigs/dra-driver-nvidia-gpu#1280 (PR #1320), such a config is refused, whether it comes
    from the claim or from its DeviceClass; a config without ``sharing`` still applies.

    :param results: indices into ``claim.results`` of the results that selected ``entry``.
    :raises DeviceConfigError: at ``<parameters>.sharing.strategy``, naming the admin-access result and request.
    """
    if plan.strategy is None:
        return
    admin = [r for r in results if claim.results[r].admin_access]
    if not admin:
        return
    first = claim.results[admin[0]]
    origin = " (from the DeviceClass)" if entry.source == "FromClass" else ""
    raise admin_sharing_refusal(
        entry.parameters_at, f"{_q(plan.strategy)}{origin}",
        f"status.allocation.devices.results[{admin[0]}] (request {_q(first.request)}, device {_q(first.device)})")


def admin_sharing_refusal(parameters_at: str, strategy: str, target: str) -> DeviceConfigError:
    """The one wording of the admin-access rule (:func:`refuse_admin_sharing`), at Prepare and at admission.

    :param parameters_at: the field path of the config's parameters; the error is at its ``.sharing.strategy``.
    :param strategy: the strategy as quoted in the message (with where the config came from, if not the claim).
    :param target: what it cannot apply to: an allocation result and its device (Prepare) or a request
        (admission, before allocation).
    """
    return DeviceConfigError(
        f"{parameters_at}.sharing.strategy",
        f"{strategy} cannot apply to {target}: it has adminAccess, and an admin-access claim never changes the "
        "device another claim may own (the time-slice, compute mode and MPS daemon are per device); use a config "
        "without sharing for admin-access requests")


def select_configs(claim: Claim, devices: Mapping[str, GpuDevice | MigDevice | VfioDevice],
                   gates: FeatureGates = DEFAULT_GATES) -> ConfigSelection:
    """Decode, select, normalise and validate the configs of ``claim`` (module docstring; reference 3.6).

    :param devices: DRA device name -> device on this node; every result's device must be in it (the caller
        reports missing devices first).
    :raises ClaimError: naming the claim and the config's field path: a decoding error (for any of our
        configs, used or not, as NVIDIA decodes them all), a config naming a request whose device is of the
        other type ("cannot apply GpuConfig to device \"gpu-0-mig-1g10gb-19-0\" of type \"mig\""), a
        validation/plan error of a config that some result selected, a sharing config selected by an
        admin-access result (:func:`refuse_admin_sharing`), two ``VfioDeviceConfig`` groups (naming both
        configs), or a VFIO device with no config for it (PassthroughSupport off).
    """
    try:
        entries = decode_entries(claim, gates)
    except DeviceConfigError as exc:
        raise ClaimError(claim.ref, str(exc)) from None
    winners: dict[int, list[int]] = {}
    by_result: list[int] = []
    for r, result in enumerate(claim.results):
        device = devices[result.device]
        kind = _device_type(device)
        chosen: int | None = None
        for e in range(len(entries) - 1, -1, -1):
            entry = entries[e]
            if _names_request(entry.requests, result.request):
                if entry.config.device_type != kind:
                    raise ClaimError(claim.ref, f"{entry.where}: cannot apply {entry.config.kind} to device "
                                                f"{_q(result.device)} of type {_q(kind)} (request: {result.request})")
                chosen = e
                break
            if not entry.requests and entry.config.device_type == kind:
                chosen = e
                break
        if chosen is None:  # the built-in defaults match every device type of the gates in force
            raise ClaimError(claim.ref, f"no config applies to device {_q(result.device)} of type {_q(kind)} "
                                        f"(request: {result.request}): the {_q(PASSTHROUGH_SUPPORT)} feature gate is "
                                        "not enabled")
        winners.setdefault(chosen, []).append(r)
        by_result.append(chosen)
    vfio_groups = [e for e in winners if isinstance(entries[e].config, VfioDeviceConfig)]
    if len(vfio_groups) > 1:
        first, second = sorted(vfio_groups)[:2]
        raise ClaimError(claim.ref, f"{entries[first].where} and {entries[second].where}: at most one "
                                    f"{VFIO_DEVICE_CONFIG} may apply to the devices of a claim (both apply to some)")
    groups: list[ConfigGroup] = []
    position: dict[int, int] = {}
    for e, results in winners.items():
        entry = entries[e]
        names = tuple(dict.fromkeys(claim.results[r].device for r in results))
        try:
            config = normalize(entry.config, gates)
            validate(config, gates, entry.parameters_at)
            plan = plan_sharing(config, [devices[n] for n in names], entry.parameters_at)
            refuse_admin_sharing(claim, entry, plan, results)
        except DeviceConfigError as exc:
            raise ClaimError(claim.ref, str(exc)) from None
        position[e] = len(groups)
        groups.append(ConfigGroup(entry, config, tuple(results), names, plan))
    return ConfigSelection(tuple(groups), tuple(position[e] for e in by_result))
