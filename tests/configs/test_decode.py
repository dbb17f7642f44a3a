"""Strict decoding, normalising and validation of GpuConfig / MigDeviceConfig (reference 3.1-3.3, 8)."""

from __future__ import annotations

from typing import Any

import pytest

from dradriver.domain import configs
from dradriver.domain.configs import (
    DeviceConfigError,
    FeatureGates,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
    MpsPlan,
    Sharing,
    SharingPlan,
    TimeSlicingConfig,
    TimeSlicingPlan,
)
from dradriver.domain.quantity import Quantity
from tests.configs.helpers import API, GPU0, GPU1, MIG_A, OLD_GPU, params

AT = "status.allocation.devices.config[1].opaque.parameters"
ALL_ON = FeatureGates({"TimeSlicingSettings": True, "MPSSupport": True})

DECODED: list[tuple[str, Any, configs.DeviceConfig]] = [
    ("empty GpuConfig", params(), GpuConfig()),
    ("empty MigDeviceConfig", params("MigDeviceConfig"), MigDeviceConfig()),
    ("null sharing", params(sharing=None), GpuConfig()),
    ("time-slicing", params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
     GpuConfig(Sharing("TimeSlicing", TimeSlicingConfig("Long")))),
    ("empty timeSlicingConfig", params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
     GpuConfig(Sharing("TimeSlicing", TimeSlicingConfig(None)))),
    ("mps, all fields", params(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi",
        "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi", GPU1.uuid: 2**30}, "multiUser": True}}),
     GpuConfig(Sharing("MPS", mps=MpsConfig(50, Quantity.parse("10Gi"),
                                            (("0", Quantity.parse("5Gi")), (GPU1.uuid, Quantity.parse("1Gi"))),
                                            True)))),
    ("mig mps", params("MigDeviceConfig", sharing={"strategy": "MPS"}), MigDeviceConfig(Sharing("MPS"))),
    ("strategy omitted", params(sharing={}), GpuConfig(Sharing(""))),
]


@pytest.mark.parametrize(("parameters", "expected"), [c[1:] for c in DECODED], ids=[c[0] for c in DECODED])
def test_decodes(parameters: Any, expected: configs.DeviceConfig) -> None:
    assert configs.decode(parameters, AT) == expected


MALFORMED: list[tuple[str, Any, str, str]] = [
    ("not an object", ["GpuConfig"], "", "must be an object, got a list"),
    ("unknown top-level field", params(metadata={}), ".metadata", "unknown field"),
    ("unknown sharing field", params(sharing={"strategy": "MPS", "stratgy": "MPS"}), ".sharing.stratgy",
     "unknown field"),
    ("case matters", params(Sharing={}), ".Sharing", "unknown field"),
    ("unknown time-slicing field", params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"intervl": 1}}),
     ".sharing.timeSlicingConfig.intervl", "unknown field"),
    ("unknown mps field", params(sharing={"strategy": "MPS", "mpsConfig": {"threads": 1}}),
     ".sharing.mpsConfig.threads", "unknown field"),
    ("MIG has no timeSlicingConfig", params("MigDeviceConfig", sharing={"strategy": "TimeSlicing",
                                                                          "timeSlicingConfig": {}}),
     ".sharing.timeSlicingConfig", "unknown field"),
    ("kind missing", {"apiVersion": API}, ".kind", "Object 'Kind' is missing"),
    ("apiVersion missing", {"kind": "GpuConfig"}, ".apiVersion", "Object 'apiVersion' is missing"),
    ("other version", params(apiVersion="resource.nvidia.com/v1alpha1"), ".apiVersion",
     "'resource.nvidia.com/v1alpha1' is not supported: must be 'resource.nvidia.com/v1beta1'"),
    ("vfio has no sharing", params("VfioDeviceConfig", sharing={}), ".sharing",
     "unknown field (known fields: apiVersion, kind, iommu)"),
    ("unknown iommu field", params("VfioDeviceConfig", iommu={"backendPolicy": "LegacyOnly", "apiDevice": True}),
     ".iommu.apiDevice", "unknown field (known fields: backendPolicy, enableAPIDevice)"),
    ("iommu not an object", params("VfioDeviceConfig", iommu="PreferIommuFD"), ".iommu",
     "must be an object, got a string"),
    ("backendPolicy not a string", params("VfioDeviceConfig", iommu={"backendPolicy": 1}), ".iommu.backendPolicy",
     "must be a string, got a number"),
    ("enableAPIDevice not a boolean", params("VfioDeviceConfig", iommu={"enableAPIDevice": "yes"}),
     ".iommu.enableAPIDevice", "must be a boolean, got a string"),
    ("channel", params("ComputeDomainChannelConfig"), ".kind",
     "ComputeDomainChannelConfig is not supported by this driver"),
    ("daemon", params("ComputeDomainDaemonConfig"), ".kind", "ComputeDomainDaemonConfig is not supported"),
    ("unknown kind", params("TpuConfig"), ".kind", "no kind 'TpuConfig' is registered for version"),
    ("strategy not a string", params(sharing={"strategy": 1}), ".sharing.strategy", "must be a string, got a number"),
    ("interval not a string", params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 2}}),
     ".sharing.timeSlicingConfig.interval", "must be a string"),
    ("percentage float", params(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 5.5}}),
     ".sharing.mpsConfig.defaultActiveThreadPercentage", "must be an integer"),
    ("percentage bool", params(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": True}}),
     ".sharing.mpsConfig.defaultActiveThreadPercentage", "must be an integer"),
    ("bad quantity", params(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1GB"}}),
     ".sharing.mpsConfig.defaultPinnedDeviceMemoryLimit", "unknown suffix 'GB'"),
    ("quantity object", params(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": {}}}),
     ".sharing.mpsConfig.defaultPinnedDeviceMemoryLimit", "must be a quantity"),
    ("per-device not a map", params(sharing={"strategy": "MPS",
                                             "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": ["1Gi"]}}),
     ".sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit", "must be an object of device -> quantity"),
    ("per-device bad value", params(sharing={"strategy": "MPS",
                                             "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "x"}}}),
     '.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["0"]', "quantity 'x'"),
    ("multiUser string", params(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": "yes"}}),
     ".sharing.mpsConfig.multiUser", "must be a boolean"),
]


@pytest.mark.parametrize(("parameters", "field", "problem"), [c[1:] for c in MALFORMED],
                         ids=[c[0] for c in MALFORMED])
def test_malformed_parameters_name_the_field(parameters: Any, field: str, problem: str) -> None:
    with pytest.raises(DeviceConfigError) as info:
        configs.decode(parameters, AT)
    assert info.value.field == AT + field
    assert problem in info.value.problem
    assert str(info.value).startswith(AT + field + ": ")


def test_unknown_field_lists_the_known_ones() -> None:
    with pytest.raises(DeviceConfigError) as info:
        configs.decode(params(sharing={"strategy": "MPS", "strategy2": 1}), AT)
    assert info.value.problem == "unknown field (known fields: strategy, timeSlicingConfig, mpsConfig)"


def _check(parameters: dict[str, Any], gates: FeatureGates) -> configs.DeviceConfig:
    config = configs.normalize(configs.decode(parameters, AT), gates)
    configs.validate(config, gates, AT)
    return config


INVALID: list[tuple[str, dict[str, Any], FeatureGates, str, str]] = [
    ("time-slicing gate off", params(sharing={"strategy": "TimeSlicing"}), FeatureGates(), ".sharing.strategy",
     '"TimeSlicing" is selected as the GPU sharing strategy, but the "TimeSlicingSettings" feature gate is not '
     "enabled"),
    ("mps gate off", params(sharing={"strategy": "MPS"}), FeatureGates(), ".sharing.strategy",
     '"MPS" is selected as the GPU sharing strategy, but the "MPSSupport" feature gate is not enabled'),
    ("mig mps gate off", params("MigDeviceConfig", sharing={"strategy": "MPS"}), FeatureGates(),
     ".sharing.strategy", '"MPS" is selected as the GPU sharing strategy, but the "MPSSupport" feature gate'),
    ("time-slicing gate on, mps gate off", params(sharing={"strategy": "MPS"}),
     FeatureGates({"TimeSlicingSettings": True}), ".sharing.strategy", 'the "MPSSupport" feature gate is not enabled'),
    ("gate before interval", params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "x"}}),
     FeatureGates(), ".sharing.strategy", "feature gate is not enabled"),
    ("unknown strategy", params(sharing={"strategy": "Fabric"}), ALL_ON, ".sharing.strategy",
     "unknown GPU sharing strategy: Fabric, supported GPU sharing strategies: TimeSlicing, MPS"),
    ("strategy omitted", params(sharing={}), ALL_ON, ".sharing.strategy", "unknown GPU sharing strategy: ,"),
    ("bad interval", params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
     ALL_ON, ".sharing.timeSlicingConfig.interval",
     "unknown time-slice interval: Forever, supported time-slice intervals: Default, Short, Medium, Long"),
    ("negative percentage", params(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": -1}}),
     ALL_ON, ".sharing.mpsConfig.defaultActiveThreadPercentage", "active thread percentage must not be negative"),
    ("percentage over 100", params(sharing={"strategy": "MPS",
                                            "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
     ALL_ON, ".sharing.mpsConfig.defaultActiveThreadPercentage",
     "active thread percentage must not be greater than 100"),
    ("mps with consumable shares", params(sharing={"strategy": "MPS"}),
     FeatureGates({"MPSSupport": True, "ConsumableShares": True}), ".sharing.strategy",
     "MPS sharing is not supported when consumable shares is enabled"),
    ("mig mps with dynamic mig", params("MigDeviceConfig", sharing={"strategy": "MPS"}),
     FeatureGates({"MPSSupport": True, "DynamicMIG": True}), ".sharing.strategy",
     "MPS is not yet supported when using featureGates.DynamicMIG=true"),
    ("mps with dynamic mig", params(sharing={"strategy": "MPS"}),
     FeatureGates({"MPSSupport": True, "DynamicMIG": True}), ".sharing.strategy",
     "MPS is not yet supported when using featureGates.DynamicMIG=true"),
]


@pytest.mark.parametrize(("parameters", "gates", "field", "problem"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_configs(parameters: dict[str, Any], gates: FeatureGates, field: str, problem: str) -> None:
    with pytest.raises(DeviceConfigError) as info:
        _check(parameters, gates)
    assert info.value.field == AT + field
    assert problem in info.value.problem


def test_nvidia_default_gates_are_off() -> None:
    assert FeatureGates() == FeatureGates({"TimeSlicingSettings": False, "MPSSupport": False})


VALID: list[tuple[str, dict[str, Any], configs.DeviceConfig]] = [
    ("no sharing", params(), GpuConfig()),
    ("time-slicing defaults the interval", params(sharing={"strategy": "TimeSlicing"}),
     GpuConfig(Sharing("TimeSlicing", TimeSlicingConfig("Default")))),
    ("empty timeSlicingConfig is defaulted, not a crash",
     params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
     GpuConfig(Sharing("TimeSlicing", TimeSlicingConfig("Default")))),
    ("explicit interval kept", params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}),
     GpuConfig(Sharing("TimeSlicing", TimeSlicingConfig("Short")))),
    ("mps gets an empty mpsConfig", params(sharing={"strategy": "MPS"}), GpuConfig(Sharing("MPS", mps=MpsConfig()))),
    ("percentage bounds", params(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 100}}),
     GpuConfig(Sharing("MPS", mps=MpsConfig(100)))),
    ("mig time-slicing validates", params("MigDeviceConfig", sharing={"strategy": "TimeSlicing"}),
     MigDeviceConfig(Sharing("TimeSlicing"))),
    ("mig mps", params("MigDeviceConfig", sharing={"strategy": "MPS"}),
     MigDeviceConfig(Sharing("MPS", mps=MpsConfig()))),
]


@pytest.mark.parametrize(("parameters", "expected"), [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_configs_normalise(parameters: dict[str, Any], expected: configs.DeviceConfig) -> None:
    assert _check(parameters, ALL_ON) == expected


def test_normalise_leaves_sharing_alone_when_gates_are_off() -> None:
    config = configs.decode(params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}), AT)
    assert configs.normalize(config) == config


# --- sharing plans: the checks NVIDIA makes when it applies a config ---------------------------------------
def _plan(sharing: dict[str, Any], devices: list[Any], kind: str = "GpuConfig") -> SharingPlan:
    config = _check(params(kind, sharing=sharing), ALL_ON)
    return configs.plan_sharing(config, devices, AT)


def test_plan_for_no_sharing_is_exclusive() -> None:
    assert configs.plan_sharing(GpuConfig(), [GPU0], AT) == configs.EXCLUSIVE == SharingPlan()


@pytest.mark.parametrize(("interval", "timeslice"), [("Default", 0), ("Short", 1), ("Medium", 2), ("Long", 3)])
def test_time_slice_values(interval: str, timeslice: int) -> None:
    plan = _plan({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}, [GPU0])
    assert plan == SharingPlan("TimeSlicing", time_slicing=TimeSlicingPlan(interval, timeslice))


def test_time_slicing_on_mig_is_a_no_op() -> None:
    assert _plan({"strategy": "TimeSlicing"}, [MIG_A], "MigDeviceConfig") == SharingPlan("TimeSlicing")


def test_mps_limits_become_whole_mib_per_uuid() -> None:
    first, second = sorted([GPU0.uuid, GPU1.uuid])
    plan = _plan({"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 25,
        "defaultPinnedDeviceMemoryLimit": "10Gi",
        "defaultPerDevicePinnedMemoryLimit": {"1": "1.5Gi", first: "1048577"},
        "multiUser": True,
    }}, [GPU1, GPU0])
    assert plan == SharingPlan("MPS", mps=MpsPlan(25, ((first, "1M"), (second, "1536M")), True))


def test_mps_without_limits() -> None:
    assert _plan({"strategy": "MPS"}, [GPU0]) == SharingPlan("MPS", mps=MpsPlan(None, (), False))


PLAN_ERRORS: list[tuple[str, dict[str, Any], list[Any], str, str]] = [
    ("time-slicing with mpsConfig", {"strategy": "TimeSlicing", "mpsConfig": {}}, [GPU0], ".sharing.mpsConfig",
     "cannot use MpsConfig with the 'TimeSlicing' strategy"),
    ("mps with timeSlicingConfig", {"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}, [GPU0],
     ".sharing.timeSlicingConfig", "cannot use TimeSlicingConfig with the 'MPS' strategy"),
    ("default limit under 1Mi", {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1023Ki"}},
     [GPU0], ".sharing.mpsConfig.defaultPinnedDeviceMemoryLimit", "invalid limit: default value set too low: 1023Ki"),
    ("negative limit", {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "-2Gi"}}},
     [GPU0], '.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["0"]', "invalid limit: value set too low: 0: -2Gi"),
    ("key out of range", {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"2": "1Gi"}}},
     [GPU0, GPU1], '.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["2"]',
     "invalid device: invalid device index: 2"),
    ("key neither uuid nor index", {"strategy": "MPS",
                                    "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"GPU-x": "1Gi"}}},
     [GPU0], '.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["GPU-x"]',
     "invalid device: unable to parse key as an integer: GPU-x"),
    ("multiUser on a pre-Volta GPU", {"strategy": "MPS", "mpsConfig": {"multiUser": True}}, [GPU0, OLD_GPU],
     ".sharing.mpsConfig.multiUser", "compute capability 7.0 or newer; device 'gpu-3' has 6.1"),
]


@pytest.mark.parametrize(("sharing", "devices", "field", "problem"), [c[1:] for c in PLAN_ERRORS],
                         ids=[c[0] for c in PLAN_ERRORS])
def test_plan_errors(sharing: dict[str, Any], devices: list[Any], field: str, problem: str) -> None:
    with pytest.raises(DeviceConfigError) as info:
        _plan(sharing, devices)
    assert info.value.field == AT + field
    assert problem in info.value.problem


def test_default_limit_without_devices_is_not_checked() -> None:
    config = _check(params(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1"}}), ALL_ON)
    assert configs.plan_sharing(config, [], AT) == SharingPlan("MPS", mps=MpsPlan(None, (), False))


PASSTHROUGH = FeatureGates({"PassthroughSupport": True})


def test_vfio_config_decodes_strictly_and_defaults_to_legacy_only_without_the_api_device() -> None:
    decoded = configs.decode(params("VfioDeviceConfig"), AT)
    assert decoded == configs.VfioDeviceConfig()
    assert _check(params("VfioDeviceConfig"), PASSTHROUGH) == configs.VfioDeviceConfig(
        configs.IommuConfig("LegacyOnly", False))
    given = params("VfioDeviceConfig", iommu={"backendPolicy": "PreferIommuFD", "enableAPIDevice": True})
    assert _check(given, PASSTHROUGH) == configs.VfioDeviceConfig(configs.IommuConfig("PreferIommuFD", True))
    assert configs.plan_sharing(_check(given, PASSTHROUGH), []) == configs.EXCLUSIVE


def test_vfio_config_needs_the_passthrough_gate_and_a_known_backend_policy() -> None:
    with pytest.raises(DeviceConfigError) as info:
        _check(params("VfioDeviceConfig"), FeatureGates())
    assert info.value.field == AT + ".kind"
    assert '"PassthroughSupport" feature gate' in info.value.problem
    with pytest.raises(DeviceConfigError) as info:
        _check(params("VfioDeviceConfig", iommu={"backendPolicy": "IommuFDOnly"}), PASSTHROUGH)
    assert info.value.field == AT + ".iommu.backendPolicy"
    assert info.value.problem == ("unknown IOMMU backend policy: IommuFDOnly, supported IOMMU backend policies: "
                                  "LegacyOnly, PreferIommuFD")
