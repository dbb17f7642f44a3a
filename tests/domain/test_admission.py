"""The webhook's pure admission logic (:mod:`dradriver.domain.admission`): which configs may apply to an
admin-access request, and the one rule both the webhook and Prepare can call."""

from __future__ import annotations

from typing import Any

import pytest

from dradriver.domain import admission
from dradriver.domain.configs import DeviceConfigError, GpuConfig, MigDeviceConfig, Sharing
from dradriver.domain.featuregates import FeatureGates, parse_feature_gates

GATES = parse_feature_gates("TimeSlicingSettings=true,MPSSupport=true,")


def gpu(strategy: str = "", requests: list[str] | None = None, kind: str = "GpuConfig") -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind}
    if strategy:
        parameters["sharing"] = {"strategy": strategy}
    entry: dict[str, Any] = {"opaque": {"driver": "gpu.nvidia.com", "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def spec(*configs: dict[str, Any], admin: tuple[str, ...] = ("a",)) -> dict[str, Any]:
    requests: list[dict[str, Any]] = [{"name": n, "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                             "adminAccess": n in admin}} for n in ("a", "b")]
    requests.append({"name": "c", "firstAvailable": [{"name": "x", "deviceClassName": "gpu.nvidia.com"}]})
    return {"devices": {"requests": requests, "config": list(configs)}}


def refused_indices(s: dict[str, Any]) -> list[int]:
    return [int(e.split("[", 1)[1].split("]", 1)[0]) for e in admission.config_errors(s, "spec", GATES)]


def test_refuse_sharing_for_admin_access_names_the_strategy_field() -> None:
    admission.refuse_sharing_for_admin_access("a", GpuConfig(), "p")
    admission.refuse_sharing_for_admin_access("a", MigDeviceConfig(Sharing()), "p")
    with pytest.raises(DeviceConfigError) as caught:
        admission.refuse_sharing_for_admin_access("a", MigDeviceConfig(Sharing("MPS")), "p")
    assert caught.value.field == "p.sharing.strategy"
    assert caught.value.problem.startswith('"MPS" cannot apply to request "a": it has adminAccess')


@pytest.mark.parametrize(("configs", "refused"), [
    ((gpu("TimeSlicing"),), [0]),  # names no request: applies to every request, the admin one included
    ((gpu("TimeSlicing", ["a"]),), [0]),
    ((gpu("TimeSlicing", ["b"]),), []),  # the shared request has no admin access
    ((gpu("TimeSlicing", ["c/x"]),), []),
    ((gpu("TimeSlicing"), gpu("", ["a"])), []),  # the request's own config wins over the general one below it
    ((gpu("", ["a"]), gpu("MPS")), [1]),  # a general config above it applies to devices of its kind first
    ((gpu("MPS", kind="MigDeviceConfig"), gpu("TimeSlicing", ["b"])), [0]),
])
def test_a_config_that_may_apply_to_an_admin_access_request_must_not_share(configs: tuple[dict[str, Any], ...],
                                                                           refused: list[int]) -> None:
    assert refused_indices(spec(*configs)) == refused


def test_admin_access_is_read_in_the_v1beta1_shape_too() -> None:
    assert admission.admin_access_requests([{"name": "a", "adminAccess": True}, {"name": "b"},
                                            {"name": "c", "exactly": {"adminAccess": True}}]) == ("a", "c")


def test_an_invalid_config_is_reported_once_even_when_it_also_shares_with_admin_access() -> None:
    errors = admission.config_errors(spec(gpu("Sharing")), "spec", GATES)
    assert len(errors) == 1 and "unknown GPU sharing strategy: Sharing" in errors[0]


def test_a_vfio_config_is_admitted_with_passthrough_support_and_refused_without_it() -> None:
    vfio = gpu(kind="VfioDeviceConfig")
    vfio["opaque"]["parameters"]["iommu"] = {"backendPolicy": "PreferIommuFD", "enableAPIDevice": True}
    on = FeatureGates({"PassthroughSupport": True})
    assert admission.config_errors(spec(vfio), "spec", on) == []
    [error] = admission.config_errors(spec(vfio), "spec", GATES)
    assert error.startswith("spec.devices.config[0].opaque.parameters.kind: VfioDeviceConfig needs the "
                            '"PassthroughSupport" feature gate')
    vfio["opaque"]["parameters"]["iommu"]["backendPolicy"] = "Whatever"
    [error] = admission.config_errors(spec(vfio), "spec", on)
    assert error.startswith("spec.devices.config[0].opaque.parameters.iommu.backendPolicy: unknown IOMMU backend")
