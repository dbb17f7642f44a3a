"""Which config applies to which allocation result (reference 3.6): precedence, requests, defaults."""

from __future__ import annotations

from typing import Any

import pytest

from dradriver.domain import configs
from dradriver.domain.claims import ClaimError, claim_from_object
from dradriver.domain.configs import FeatureGates, GpuConfig, MigDeviceConfig, Sharing, TimeSlicingConfig
from tests.configs.helpers import (
    DEVICES,
    DRIVER,
    GPU0,
    GPU1,
    MIG_A,
    MIG_B,
    POOL,
    REF,
    claim,
    claim_object,
    entry,
    params,
)
from tests.factories import vfio_for

ALL_ON = FeatureGates({"TimeSlicingSettings": True, "MPSSupport": True})


def ts(interval: str) -> dict[str, Any]:
    """GpuConfig parameters selecting time-slicing with ``interval``."""
    return params(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}})


def gpu_ts(interval: str) -> GpuConfig:
    return GpuConfig(Sharing("TimeSlicing", TimeSlicingConfig(interval)))


def where_of(selection: configs.ConfigSelection, device: str) -> str:
    group = selection.for_device(device)
    assert group is not None
    return group.entry.where


def test_no_configs_means_built_in_defaults_per_device_type() -> None:
    selection = configs.select_configs(claim([("a", GPU0.name), ("b", MIG_A.name)], []), DEVICES)
    assert selection.device_configs() == {GPU0.name: GpuConfig(), MIG_A.name: MigDeviceConfig()}
    assert [g.entry.where for g in selection.groups] == ["built-in default GpuConfig",
                                                         "built-in default MigDeviceConfig"]
    assert all(g.plan == configs.EXCLUSIVE for g in selection.groups)
    assert selection.by_result == (0, 1)


def test_claim_config_overrides_class_config() -> None:
    c = claim([("gpu", GPU0.name)], [entry(ts("Short"), source="FromClaim"), entry(ts("Long"), source="FromClass")])
    selection = configs.select_configs(c, DEVICES, ALL_ON)
    assert where_of(selection, GPU0.name) == "status.allocation.devices.config[0]"
    assert selection.device_configs()[GPU0.name] == gpu_ts("Short")


def test_later_entry_of_one_source_overrides_earlier() -> None:
    c = claim([("gpu", GPU0.name)], [entry(ts("Short")), entry(ts("Medium"))])
    assert configs.select_configs(c, DEVICES, ALL_ON).device_configs()[GPU0.name] == gpu_ts("Medium")


def test_request_lists_pick_configs_per_result() -> None:
    c = claim(
        [("train", GPU0.name), ("infer", GPU1.name), ("other", GPU0.name)],
        [entry(ts("Long"), requests=["train"]), entry(ts("Short"), requests=["infer", "x"])],
    )
    selection = configs.select_configs(c, DEVICES, ALL_ON)
    assert [g.entry.where for g in selection.groups] == [
        "status.allocation.devices.config[0]", "status.allocation.devices.config[1]", "built-in default GpuConfig"]
    assert [g.results for g in selection.groups] == [(0,), (1,), (2,)]
    assert selection.by_result == (0, 1, 2)


def test_results_sharing_a_config_form_one_group() -> None:
    c = claim([("a", GPU0.name), ("b", GPU1.name), ("c", MIG_A.name), ("d", MIG_B.name)],
              [entry(ts("Long"))])
    selection = configs.select_configs(c, DEVICES, ALL_ON)
    [gpus, migs] = selection.groups
    assert gpus.devices == (GPU0.name, GPU1.name) and gpus.results == (0, 1)
    assert gpus.plan.time_slicing == configs.TimeSlicingPlan("Long", 3)
    assert migs.devices == (MIG_A.name, MIG_B.name) and migs.entry.where == "built-in default MigDeviceConfig"


def test_parent_request_matches_subrequest_results() -> None:
    c = claim([("gpu/large", GPU0.name), ("gpu/small", MIG_A.name)],
              [entry(ts("Medium"), requests=["gpu"]),
               entry(params("MigDeviceConfig", sharing={"strategy": "TimeSlicing"}), requests=["gpu/small"])])
    selection = configs.select_configs(c, DEVICES, ALL_ON)
    assert where_of(selection, GPU0.name) == "status.allocation.devices.config[0]"
    assert where_of(selection, MIG_A.name) == "status.allocation.devices.config[1]"


def test_named_request_with_wrong_device_type_is_an_error() -> None:
    c = claim([("small", MIG_A.name)], [entry(params(), requests=["small"])])
    with pytest.raises(ClaimError) as info:
        configs.select_configs(c, DEVICES)
    assert str(info.value) == (
        f"claim {REF}: status.allocation.devices.config[0]: cannot apply GpuConfig to device "
        f'"{MIG_A.name}" of type "mig" (request: small)')


def test_parent_request_with_wrong_device_type_is_an_error() -> None:
    c = claim([("gpu/whole", GPU0.name)], [entry(params("MigDeviceConfig"), requests=["gpu"])])
    with pytest.raises(ClaimError, match=r'cannot apply MigDeviceConfig to device "gpu-0" of type "gpu" '
                                         r"\(request: gpu/whole\)"):
        configs.select_configs(c, DEVICES)


def test_unnamed_config_of_the_other_type_is_skipped() -> None:
    c = claim([("a", MIG_A.name)], [entry(ts("Long"))])
    selection = configs.select_configs(c, DEVICES, ALL_ON)
    assert where_of(selection, MIG_A.name) == "built-in default MigDeviceConfig"


def test_higher_precedence_unnamed_config_beats_lower_named_one() -> None:
    # NVIDIA walks once from the highest precedence: whichever applicable entry comes first wins.
    c = claim([("gpu", GPU0.name)], [entry(ts("Long"), requests=["gpu"], source="FromClass"), entry(ts("Short"))])
    selection = configs.select_configs(c, DEVICES, ALL_ON)
    assert selection.device_configs()[GPU0.name] == gpu_ts("Short")


def test_configs_of_other_drivers_are_ignored() -> None:
    c = claim([("gpu", GPU0.name)], [entry({"anything": True}, driver="net.example.com")])
    assert c.configs == ()
    assert configs.select_configs(c, DEVICES).device_configs() == {GPU0.name: GpuConfig()}


def test_unused_invalid_config_is_not_validated_but_must_decode() -> None:
    # Selected by nothing (MIG-only claim): NVIDIA decodes it but never validates it.
    unused = claim([("a", MIG_A.name)], [entry(ts("Long"))])
    assert configs.select_configs(unused, DEVICES).device_configs() == {MIG_A.name: MigDeviceConfig()}
    malformed = claim([("a", MIG_A.name)], [entry(params(sharing={"strategy": "TimeSlicing", "bogus": 1}))])
    with pytest.raises(ClaimError, match=r"config\[0\]\.opaque\.parameters\.sharing\.bogus: unknown field"):
        configs.select_configs(malformed, DEVICES)


def test_selected_config_is_validated_with_its_index() -> None:
    c = claim([("a", GPU0.name), ("b", GPU1.name)],
              [entry(params(), requests=["a"]), entry(ts("Long"), requests=["b"])])
    with pytest.raises(ClaimError) as info:
        configs.select_configs(c, DEVICES)
    assert str(info.value) == (
        f"claim {REF}: status.allocation.devices.config[1].opaque.parameters.sharing.strategy: "
        '"TimeSlicing" is selected as the GPU sharing strategy, but the "TimeSlicingSettings" feature gate is '
        "not enabled")


def test_class_configs_keep_their_api_index() -> None:
    c = claim([("a", GPU0.name)], [entry(params(), source="FromClaim"),
                                   entry(params("ComputeDomainDaemonConfig"), source="FromClass")])
    with pytest.raises(ClaimError, match=r"config\[1\]\.opaque\.parameters\.kind: ComputeDomainDaemonConfig is "
                                         r"not supported by this driver"):
        configs.select_configs(c, DEVICES)


def test_mps_limits_index_the_groups_sorted_uuids() -> None:
    c = claim([("a", GPU1.name), ("a", GPU0.name)],
              [entry(params(sharing={"strategy": "MPS",
                                     "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "2Gi"}}}))])
    [group] = configs.select_configs(c, DEVICES, ALL_ON).groups
    assert group.plan.mps is not None
    assert group.plan.mps.pinned_memory_limits == ((min(GPU0.uuid, GPU1.uuid), "2048M"),)


@pytest.mark.parametrize(("bad", "message"), [
    ({"source": "FromClaim", "requests": "gpu", "opaque": {"driver": "gpu.nvidia.com", "parameters": {}}},
     r"config\[0\]\.requests: must be a list of request names"),
])
def test_malformed_entries(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ClaimError, match=message):
        configs.select_configs(claim([("gpu", GPU0.name)], [bad]), DEVICES)


@pytest.mark.parametrize(("bad", "message"), [
    ({"source": "FromClaim", "requests": ["gpu"]},
     r"config\[0\]: only opaque device configs \(an 'opaque' field\) are supported by this driver"),
    ({"source": "FromSomewhere", "opaque": {"driver": "gpu.nvidia.com", "parameters": {}}},
     r"config\[0\]\.source is 'FromSomewhere': must be 'FromClass' or 'FromClaim'"),
])
def test_claim_reduction_rejects_non_opaque_and_unknown_sources(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ClaimError, match=message):
        claim_from_object(claim_object([("gpu", GPU0.name)], [bad]), REF, driver=DRIVER, pool=POOL)


def _admin(c: dict[str, Any], *indices: int) -> Any:
    for index in indices:
        c["status"]["allocation"]["devices"]["results"][index]["adminAccess"] = True
    return claim_from_object(c, REF, driver=DRIVER, pool=POOL)


@pytest.mark.parametrize("sharing", [
    {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
])
def test_a_sharing_config_for_an_admin_access_result_is_refused_with_its_field_path(sharing: dict[str, Any]) -> None:
    c = _admin(claim_object([("gpu", GPU0.name)], [entry(params(sharing=sharing))]), 0)
    with pytest.raises(ClaimError) as caught:
        configs.select_configs(c, DEVICES, ALL_ON)
    message = str(caught.value)
    assert "status.allocation.devices.config[0].opaque.parameters.sharing.strategy:" in message
    assert f"status.allocation.devices.results[0] (request \"gpu\", device \"{GPU0.name}\"): it has adminAccess" \
        in message


def test_a_class_sharing_config_reaching_an_admin_access_result_is_refused_and_says_so() -> None:
    c = _admin(claim_object([("watch", GPU0.name), ("work", GPU1.name)],
                            [entry(ts("Long"), source="FromClass", requests=["watch", "work"])]), 0)
    with pytest.raises(ClaimError, match=r'"TimeSlicing" \(from the DeviceClass\) cannot apply to '
                                         r'status.allocation.devices.results\[0\] \(request "watch"'):
        configs.select_configs(c, DEVICES, ALL_ON)


def test_admin_access_results_take_configs_without_sharing() -> None:
    c = _admin(claim_object([("watch", GPU0.name), ("work", GPU1.name)],
                            [entry(params(), requests=["watch"]), entry(ts("Long"), requests=["work"])]), 0)
    selection = configs.select_configs(c, DEVICES, ALL_ON)
    assert selection.device_configs() == {GPU0.name: GpuConfig(), GPU1.name: gpu_ts("Long")}


PASSTHROUGH = FeatureGates({"PassthroughSupport": True})
VFIO0, VFIO1 = vfio_for(GPU0, GPU1)
WITH_VFIO = {**DEVICES, VFIO0.name: VFIO0, VFIO1.name: VFIO1}


def test_vfio_devices_get_the_built_in_vfio_config_with_the_gate() -> None:
    c = claim([("vm", VFIO0.name), ("vm", VFIO1.name), ("gpu", GPU0.name)], [])
    selection = configs.select_configs(c, WITH_VFIO, PASSTHROUGH)
    assert where_of(selection, VFIO0.name) == "built-in default VfioDeviceConfig"
    assert selection.device_configs()[VFIO1.name] == configs.VfioDeviceConfig(configs.IommuConfig("LegacyOnly", False))
    assert where_of(selection, GPU0.name) == "built-in default GpuConfig"
    with pytest.raises(ClaimError, match=r'no config applies to device "gpu-vfio-0" of type "vfio" .*'
                                         r'"PassthroughSupport" feature gate is not enabled'):
        configs.select_configs(c, WITH_VFIO)


def test_a_gpu_config_on_a_vfio_device_and_a_vfio_config_on_a_gpu_are_refused() -> None:
    gpu_on_vfio = claim([("vm", VFIO0.name)], [entry(params(), requests=["vm"])])
    with pytest.raises(ClaimError, match=r'config\[0\]: cannot apply GpuConfig to device "gpu-vfio-0" of type '
                                         r'"vfio" \(request: vm\)'):
        configs.select_configs(gpu_on_vfio, WITH_VFIO, PASSTHROUGH)
    vfio_on_gpu = claim([("gpu", GPU0.name)], [entry(params("VfioDeviceConfig"), requests=["gpu"])])
    with pytest.raises(ClaimError, match=r'config\[0\]: cannot apply VfioDeviceConfig to device "gpu-0" of type '
                                         r'"gpu"'):
        configs.select_configs(vfio_on_gpu, WITH_VFIO, PASSTHROUGH)


def test_two_vfio_config_groups_in_one_claim_are_refused_naming_both() -> None:
    c = claim([("a", VFIO0.name), ("b", VFIO1.name)],
              [entry(params("VfioDeviceConfig"), requests=["a"]),
               entry(params("VfioDeviceConfig", iommu={"backendPolicy": "PreferIommuFD"}), requests=["b"])])
    with pytest.raises(ClaimError) as info:
        configs.select_configs(c, WITH_VFIO, PASSTHROUGH)
    assert str(info.value) == (
        f"claim {REF}: status.allocation.devices.config[0] and status.allocation.devices.config[1]: at most one "
        "VfioDeviceConfig may apply to the devices of a claim (both apply to some)")
    one = claim([("a", VFIO0.name), ("b", VFIO1.name)], [entry(params("VfioDeviceConfig"))])
    [group] = configs.select_configs(one, WITH_VFIO, PASSTHROUGH).groups
    assert group.devices == (VFIO0.name, VFIO1.name)
