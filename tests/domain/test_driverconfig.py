"""Driver config profiles (NVIDIA's v1alpha1 DriverConfig): strict decoding with field paths, profile selection
from the node label, reading from the profiles directory, and the slice filter they drive."""

from __future__ import annotations

from pathlib import Path

import pytest

from dradriver.domain import pools
from dradriver.domain.devices import DriverVersions, NodeInventory
from dradriver.domain.driverconfig import (
    NODE_LABEL,
    DriverConfig,
    DriverConfigError,
    decode_driver_config,
    select_profile,
)
from dradriver.host.driverconfigs import load_profile, resolve
from dradriver.nvml.discovery import discover
from dradriver.nvml.session import open_session
from tests.factories import gpu_device, vfio_for

WHERE = "driver config profile 'p' (/available-configs/p)"


def test_a_valid_profile_decodes_in_file_order() -> None:
    text = "version: v1alpha1\ngpu:\n  advertisedDeviceTypes: [mig, gpu]\n"
    assert decode_driver_config(text, WHERE) == DriverConfig(advertised_device_types=("mig", "gpu"))


@pytest.mark.parametrize(("text", "field", "problem"), [
    ("version: v1alpha1\ngpu:\n  advertisedDeviceTypes: [gpu]\n  migStrategy: mixed\n", "gpu.migStrategy",
     "unknown field"),
    ("version: v1alpha1\nkind: DriverConfig\ngpu: {advertisedDeviceTypes: [gpu]}\n", "kind", "unknown field"),
    ("version: v1alpha1\nversion: v1alpha1\ngpu: {advertisedDeviceTypes: [gpu]}\n", "", "duplicate field 'version'"),
    ("version: v1\ngpu: {advertisedDeviceTypes: [gpu]}\n", "version", "unsupported version 'v1'"),
    ("gpu: {advertisedDeviceTypes: [gpu]}\n", "version", "required"),
    ("", "version", "required"),
    ("version: v1alpha1\n", "gpu", "required"),
    ("version: v1alpha1\ngpu: {advertisedDeviceTypes: []}\n", "gpu.advertisedDeviceTypes", "must not be empty"),
    ("version: v1alpha1\ngpu: {advertisedDeviceTypes: gpu}\n", "gpu.advertisedDeviceTypes", "must be a list"),
    ("version: v1alpha1\ngpu: {advertisedDeviceTypes: [gpu, gpu]}\n", "gpu.advertisedDeviceTypes[1]", "duplicate"),
    ("version: v1alpha1\ngpu: {advertisedDeviceTypes: [gpu, MIG]}\n", "gpu.advertisedDeviceTypes[1]",
     "unsupported device type 'MIG'"),
    ("version: v1alpha1\ngpu: [gpu]\n", "gpu", "must be an object"),
    ("version: [v1alpha1\n", "", "not valid YAML"),
])
def test_a_bad_profile_is_refused_naming_the_file_and_field(text: str, field: str, problem: str) -> None:
    with pytest.raises(DriverConfigError) as caught:
        decode_driver_config(text, WHERE)
    assert caught.value.field == field
    assert problem in caught.value.problem
    assert str(caught.value).startswith(WHERE)


def test_the_label_wins_over_the_default_and_an_empty_label_is_an_error() -> None:
    assert select_profile({NODE_LABEL: "full-gpu"}, "mixed") == ("full-gpu", "label")
    assert select_profile({}, "mixed") == ("mixed", "default")
    assert select_profile({"other": "x"}, "") == ("", "none")
    with pytest.raises(DriverConfigError, match="must not be empty"):
        select_profile({NODE_LABEL: ""}, "mixed")
    with pytest.raises(DriverConfigError, match="is not a profile name"):
        select_profile({NODE_LABEL: "../etc"}, "")


def test_an_unknown_profile_names_the_profiles_there(tmp_path: Path) -> None:
    (tmp_path / "full-gpu").write_text("version: v1alpha1\ngpu: {advertisedDeviceTypes: [gpu]}\n")
    assert load_profile(tmp_path, "full-gpu").advertised == frozenset({"gpu"})
    with pytest.raises(DriverConfigError, match=r"unknown profile: .*profiles there: full-gpu"):
        resolve({NODE_LABEL: "mig-only"}, tmp_path, "")
    assert resolve({}, tmp_path, "").advertised is None  # no label, no default: every device type


@pytest.mark.parametrize("advertised", [{"gpu"}, {"mig"}, {"gpu", "mig"}, {"vfio"}])
def test_slices_publish_only_the_advertised_device_types(advertised: set[str]) -> None:
    with open_session("", "dgx-a100") as session:
        inventory = discover(session)
    every = pools.build(inventory, "n").slices
    kept = pools.build(inventory, "n", advertised=advertised).slices
    types = {d["attributes"]["type"]["string"] for s in kept for d in s["spec"]["devices"]}
    assert types == advertised & {"gpu", "mig"}
    assert sum(len(s["spec"]["devices"]) for s in kept) == sum(
        1 for s in every for d in s["spec"]["devices"] if d["attributes"]["type"]["string"] in advertised)
    assert kept  # an empty pool still has its slice


def test_dynamic_mig_keeps_the_counter_sets_when_only_full_gpus_are_advertised() -> None:
    with open_session("", "dgx-h100") as session:
        inventory = discover(session, dynamic_mig=True)
    kept = pools.build(inventory, "n", server_version=(1, 35), advertised={"gpu"}).slices
    devices = [d for s in kept for d in s["spec"].get("devices", ())]
    assert devices and all(d["attributes"]["type"]["string"] == "gpu" for d in devices)
    assert sum(len(s["spec"].get("sharedCounters", ())) for s in kept) == len(inventory.gpus)


def test_a_vfio_only_profile_publishes_the_vfio_devices() -> None:
    gpus = (gpu_device(0), gpu_device(1))
    inventory = NodeInventory(versions=DriverVersions(driver="570.148.08", cuda_driver=12080), gpus=gpus,
                              vfio=vfio_for(*gpus))
    (kept,) = pools.build(inventory, "n", advertised={"vfio"}).slices
    assert [d["name"] for d in kept["spec"]["devices"]] == ["gpu-vfio-0", "gpu-vfio-1"]
