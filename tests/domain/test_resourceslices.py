"""ResourceSlice builder (``dradriver.domain.resourceslices``) over hand-built inventories."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import pytest

from dradriver.domain.devices import DriverVersions, GpuDevice, MigDevice, NodeInventory
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.passthrough import vfio_devices, vfio_uuid
from dradriver.domain.pools import build, build_resource_slices
from dradriver.domain.resourceslices import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
    ResourceSliceError,
    limit_violations,
    quantity_bytes,
)
from dradriver.domain.shares import ShareMode
from tests.domain.slice_validation import assert_valid_slice, quantity_value
from tests.factories import gpu_device, gpu_function, mig_device, vfio_for

VERSIONS = DriverVersions(driver="570.148.08", cuda_driver=12080, nvml="12.570.148.08")
GIB = 1 << 30
MIB = 1 << 20
NOSCHEDULE = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}


def gpu(minor: int, bus: int, **kw: object) -> GpuDevice:
    fields: dict[str, object] = {
        "pci_bus_id": f"0000:{bus:02x}:00.0",
        "pcie_root": f"pci0000:{bus - 1:02x}",
        "numa_node": 0,
    }
    fields.update(kw)
    return gpu_device(minor, **fields)


def mig(parent: GpuDevice, gi: int, start: int, size: int = 1, **kw: object) -> MigDevice:
    return mig_device(parent, start, gi_id=gi, placement_size=size, **kw)


def attrs(device: dict) -> dict:
    return device["attributes"]


def test_full_gpu_device_has_nvidia_contract() -> None:
    inv = NodeInventory(versions=VERSIONS, gpus=(gpu(0, 7),))
    (slice_,) = build_resource_slices(inv, "node-a")
    assert_valid_slice(slice_)
    spec = slice_["spec"]
    assert spec["driver"] == GPU_DRIVER.driver_name
    assert spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 1}
    assert "name" not in slice_["metadata"]
    (dev,) = spec["devices"]
    assert dev["name"] == "gpu-0"
    assert attrs(dev) == {
        "type": {"string": "gpu"},
        "uuid": {"string": "GPU-00000000-0000-0000-0000-000000000000"},
        "productName": {"string": "NVIDIA A100-SXM4-40GB"},
        "brand": {"string": "Nvidia"},
        "architecture": {"string": "Ampere"},
        "driverVersion": {"version": "570.148.8"},
        "cudaDriverVersion": {"version": "12.8.0"},
        "cudaComputeCapability": {"version": "8.0.0"},
        "pcieBusID": {"string": "0000:07:00.0"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:07:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:06"},
        "resource.kubernetes.io/numaNode": {"int": 0},
    }
    assert dev["capacity"] == {"memory": {"value": "40Gi"}}


def test_unknown_optional_values_are_omitted() -> None:
    g = gpu(0, 7, pcie_root=None, numa_node=None, memory_bytes=None)
    versions = DriverVersions(driver="", cuda_driver=0)
    (slice_,) = build_resource_slices(NodeInventory(versions=versions, gpus=(g,)), "n")
    assert_valid_slice(slice_)
    (dev,) = slice_["spec"]["devices"]
    for key in (
        "resource.kubernetes.io/pcieRoot",
        "resource.kubernetes.io/numaNode",
        "driverVersion",
        "cudaDriverVersion",
    ):
        assert key not in attrs(dev)
    assert "capacity" not in dev


def test_mig_devices_replace_their_parent_and_inherit_attributes() -> None:
    parent = gpu(0, 7, mig_capable=True, mig_enabled=True)
    other = gpu(1, 15)
    migs = (
        mig(parent, 9, 2),
        mig(
            parent,
            1,
            4,
            size=4,
            profile="3g.20gb",
            gi_profile_id=9,
            ci_profile_id=2,
            memory_bytes=19968 * MIB,
            multiprocessors=42,
            copy_engines=3,
            decoders=2,
        ),
    )
    inv = NodeInventory(versions=VERSIONS, gpus=(parent, other), migs=migs)
    (slice_,) = build_resource_slices(inv, "n")
    assert_valid_slice(slice_)
    names = [d["name"] for d in slice_["spec"]["devices"]]
    assert names == ["gpu-0-mig-1g5gb-19-2", "gpu-0-mig-3g20gb-9-4", "gpu-1"]
    assert "gpu-0" not in names  # MIG-mode GPU is not double-published
    three_g = slice_["spec"]["devices"][1]
    assert attrs(three_g)["type"] == {"string": "mig"}
    assert attrs(three_g)["parentUUID"] == {"string": parent.uuid}
    assert attrs(three_g)["profile"] == {"string": "3g.20gb"}
    for inherited in ("productName", "brand", "architecture", "driverVersion", "cudaDriverVersion"):
        assert attrs(three_g)[inherited] == attrs(slice_["spec"]["devices"][2])[inherited]
    assert attrs(three_g)["resource.kubernetes.io/pciBusID"] == {"string": "0000:07:00.0"}
    assert three_g["capacity"] == {
        "multiprocessors": {"value": "42"},
        "copyEngines": {"value": "3"},
        "decoders": {"value": "2"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "0"},
        "ofaEngines": {"value": "0"},
        "memory": {"value": "19968Mi"},
        "memorySlice4": {"value": "1"},
        "memorySlice5": {"value": "1"},
        "memorySlice6": {"value": "1"},
        "memorySlice7": {"value": "1"},
    }


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (42949672960, "40Gi"),
        (85520809984, "81559Mi"),
        (4864 * MIB, "4864Mi"),
        (16106127360, "15Gi"),
        (1024, "1Ki"),
        (1023, "1023"),
        (1536, "1536"),
        (0, "0"),
        (1 << 40, "1Ti"),
    ],
)
def test_quantity_bytes_is_canonical_binary_si(value: int, text: str) -> None:
    assert quantity_bytes(value) == text
    assert quantity_value(text) == value


def test_seed_selector_is_expressible() -> None:
    """``device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0`` holds on A100-40GB/H100."""
    a100 = gpu(0, 7)
    h100 = gpu(1, 15, product_name="NVIDIA H100 80GB HBM3", memory_bytes=85520809984)
    l4 = gpu(2, 0x70, product_name="NVIDIA L4", memory_bytes=24152899584)
    (slice_,) = build_resource_slices(NodeInventory(versions=VERSIONS, gpus=(a100, h100, l4)), "n")
    memory = {d["name"]: quantity_value(d["capacity"]["memory"]["value"]) for d in slice_["spec"]["devices"]}
    forty_gi = quantity_value("40Gi")
    assert memory["gpu-0"] >= forty_gi
    assert memory["gpu-1"] >= forty_gi
    assert memory["gpu-2"] < forty_gi


def _many_gpus(n: int) -> NodeInventory:
    return NodeInventory(versions=VERSIONS, gpus=tuple(gpu(i, 1 + i % 250, index=i) for i in range(n)))


def test_split_at_128_devices_is_deterministic() -> None:
    inv = _many_gpus(300)
    slices = build_resource_slices(inv, "big")
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
    for s in slices:
        assert_valid_slice(s)
        assert s["spec"]["pool"]["resourceSliceCount"] == 3
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert len(set(names)) == 300
    buses = [d["attributes"]["resource.kubernetes.io/pciBusID"]["string"] for s in slices for d in s["spec"]["devices"]]
    assert buses == sorted(buses)
    shuffled = replace(inv, gpus=tuple(reversed(inv.gpus)))
    assert build_resource_slices(shuffled, "big") == slices


def test_taints_lower_the_slice_size_to_64() -> None:
    inv = _many_gpus(130)
    slices = build_resource_slices(inv, "big", taints={"gpu-5": [NOSCHEDULE]})
    assert [len(s["spec"]["devices"]) for s in slices] == [64, 64, 2]
    tainted = [d for s in slices for d in s["spec"]["devices"] if "taints" in d]
    assert [d["name"] for d in tainted] == ["gpu-5"]
    assert tainted[0]["taints"] == [NOSCHEDULE]
    for s in slices:
        assert_valid_slice(s)
    assert MAX_DEVICES_PER_SLICE == 128 and MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS == 64


def test_taint_for_unknown_device_is_a_warning() -> None:
    result = build(NodeInventory(versions=VERSIONS, gpus=(gpu(0, 7),)), "n", taints={"gpu-9": [NOSCHEDULE]})
    assert result.warnings == ["taints for unknown device gpu-9 ignored"]


def test_too_many_taints_is_an_error_naming_the_device() -> None:
    taints = {"gpu-0": [dict(NOSCHEDULE, key=f"k{i}") for i in range(17)]}
    with pytest.raises(ResourceSliceError, match="gpu-0"):
        build(NodeInventory(versions=VERSIONS, gpus=(gpu(0, 7),)), "n", taints=taints)


def test_names_do_not_shift_when_a_gpu_disappears() -> None:
    gpus = tuple(gpu(i, 0x10 + i) for i in range(4))
    before = build_resource_slices(NodeInventory(versions=VERSIONS, gpus=gpus), "n")[0]["spec"]["devices"]
    after = build_resource_slices(NodeInventory(versions=VERSIONS, gpus=gpus[:1] + gpus[2:]), "n")[0]["spec"][
        "devices"
    ]
    by_name = {d["name"]: d for d in before}
    assert [d["name"] for d in after] == ["gpu-0", "gpu-2", "gpu-3"]
    for dev in after:
        assert dev == by_name[dev["name"]]


def test_duplicate_device_names_are_refused() -> None:
    inv = NodeInventory(versions=VERSIONS, gpus=(gpu(0, 7), gpu(0, 8, uuid="GPU-other")))
    with pytest.raises(ResourceSliceError, match="gpu-0"):
        build(inv, "n")


def test_attribute_limit_drops_lowest_priority(caplog: pytest.LogCaptureFixture) -> None:
    parent = gpu(0, 7, mig_enabled=True)
    wide = mig(parent, 1, 0, size=16)  # 16 memory slices: 14 attributes + 23 capacities = 37 entries
    with caplog.at_level(logging.WARNING, logger="dradriver.domain.resourceslices"):
        result = build(NodeInventory(versions=VERSIONS, gpus=(parent,), migs=(wide,)), "n")
    (slice_,) = result.slices
    assert_valid_slice(slice_)
    (dev,) = slice_["spec"]["devices"]
    assert len(dev["attributes"]) + len(dev["capacity"]) == MAX_ATTRIBUTES_AND_CAPACITIES
    dropped = {"pcieBusID", "memorySlice15", "memorySlice14", "memorySlice13", "memorySlice12"}
    assert not dropped & (set(dev["attributes"]) | set(dev["capacity"]))
    for kept in ("type", "uuid", "parentUUID", "profile", "memory", "memorySlice0"):
        assert kept in dev["attributes"] or kept in dev["capacity"]
    assert len(result.warnings) == 5
    assert len(caplog.records) == 5


def test_long_string_value_is_dropped_not_truncated() -> None:
    long_name = "NVIDIA " + "X" * 70
    result = build(NodeInventory(versions=VERSIONS, gpus=(gpu(0, 7, product_name=long_name),)), "n")
    (slice_,) = result.slices
    assert_valid_slice(slice_)
    assert "productName" not in slice_["spec"]["devices"][0]["attributes"]
    assert any("productName" in w for w in result.warnings)


def test_empty_inventory_still_publishes_the_pool() -> None:
    slices = build_resource_slices(NodeInventory(versions=VERSIONS, gpus=()), "n", generation=7)
    assert len(slices) == 1
    assert slices[0]["spec"]["devices"] == []
    assert slices[0]["spec"]["pool"] == {"name": "n", "generation": 7, "resourceSliceCount": 1}
    assert_valid_slice(slices[0])


def test_generate_name_is_optional() -> None:
    inv = NodeInventory(versions=VERSIONS, gpus=(gpu(0, 7),))
    assert build_resource_slices(inv, "n", generate_name=False)[0]["metadata"] == {}
    assert build_resource_slices(inv, "n")[0]["metadata"] == {"generateName": "n-gpu.nvidia.com-"}


def test_limit_violations_reports_each_problem() -> None:
    (good,) = build_resource_slices(_many_gpus(1), "n")
    bad = copy.deepcopy(good)
    dev = bad["spec"]["devices"][0]
    dev["attributes"]["productName"] = {"string": "x" * 65}
    for i in range(40):
        dev["capacity"][f"c{i}"] = {"value": "1"}
    dev["taints"] = [NOSCHEDULE] * 17
    bad["spec"]["devices"] = [dev] + [copy.deepcopy(dev) for _ in range(64)]
    problems = limit_violations(bad)
    assert any("65 devices, limit 64" in p for p in problems)
    assert any("repeated" in p for p in problems)
    assert any("attributes and capacities" in p for p in problems)
    assert any("longer than 64" in p for p in problems)
    assert any("taints" in p for p in problems)
    assert limit_violations(good) == []


@pytest.mark.parametrize("mode", ["HMM", "ATS", "None"])
def test_addressing_mode_on_gpu_and_its_mig_devices(mode: str) -> None:
    """``addressingMode`` is a string attribute of the GPU, inherited by its MIG devices (nvidia-dra-driver.md
    2.3/2.4); a MIG device with a full 8-slice placement still fits the 32 attributes+capacities limit."""
    plain = gpu(0, 7, addressing_mode=mode)
    parent = gpu(1, 9, addressing_mode=mode, mig_capable=True, mig_enabled=True)
    big = mig(parent, 0, 0, size=8)
    inv = NodeInventory(versions=VERSIONS, gpus=(plain, parent), migs=(big,))
    result = build(inv, "node-a")
    assert result.warnings == []
    devices = [d for s in result.slices for d in s["spec"]["devices"]]
    for s in result.slices:
        assert_valid_slice(s)
    assert {d["name"] for d in devices} == {"gpu-0", big.name}
    for dev in devices:
        assert attrs(dev)["addressingMode"] == {"string": mode}
        assert len(attrs(dev)) + len(dev["capacity"]) <= MAX_ATTRIBUTES_AND_CAPACITIES


def test_addressing_mode_omitted_when_unknown() -> None:
    (slice_,) = build_resource_slices(NodeInventory(versions=VERSIONS, gpus=(gpu(0, 7),)), "n")
    assert "addressingMode" not in attrs(slice_["spec"]["devices"][0])


def _passthrough_inventory(n: int = 2, **gpu_fields: object) -> NodeInventory:
    gpus = tuple(gpu(i, 7 + i, **gpu_fields) for i in range(n))
    return NodeInventory(versions=VERSIONS, gpus=gpus, vfio=vfio_for(*gpus, iommufd=True))


def test_vfio_device_has_nvidia_attributes_and_addressable_memory() -> None:
    (slice_,) = build_resource_slices(_passthrough_inventory(1), "node-a")
    assert_valid_slice(slice_)
    names = [d["name"] for d in slice_["spec"]["devices"]]
    assert names == ["gpu-0", "gpu-vfio-0"]
    vfio = slice_["spec"]["devices"][1]
    assert attrs(vfio) == {
        "type": {"string": "vfio"},
        "uuid": {"string": vfio_uuid("0000:07:00.0")},
        "deviceID": {"string": "0x2330"},
        "vendorID": {"string": "0x10de"},
        "productName": {"string": "NVIDIA A100-SXM4-40GB"},
        "iommuFDEnabled": {"bool": True},
        "resource.kubernetes.io/pciBusID": {"string": "0000:07:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:06"},
        "resource.kubernetes.io/numaNode": {"int": 0},
    }
    assert vfio["capacity"] == {"addressableMemory": {"value": "128Gi"}}


def test_a_held_gpu_or_vfio_device_withdraws_its_sibling_from_the_pool() -> None:
    inv = _passthrough_inventory(2)
    taints = {"gpu-0": [NOSCHEDULE]}
    (slice_,) = build_resource_slices(inv, "n", held={"gpu-vfio-0", "gpu-1"}, taints=taints)
    assert_valid_slice(slice_)
    assert [d["name"] for d in slice_["spec"]["devices"]] == ["gpu-vfio-0", "gpu-1"]
    result = build(inv, "n", held={"gpu-vfio-0"}, taints=taints)
    assert result.warnings == []  # the withdrawn sibling's taints are not "unknown device"


def test_vfio_devices_are_never_shareable() -> None:
    (slice_,) = build_resource_slices(_passthrough_inventory(1), "n", shares=ShareMode("memory"))
    assert_valid_slice(slice_)
    gpu_entry, vfio_entry = slice_["spec"]["devices"]
    assert gpu_entry["allowMultipleAllocations"] is True
    assert "allowMultipleAllocations" not in vfio_entry
    assert vfio_entry["capacity"] == {"addressableMemory": {"value": "128Gi"}}


def test_fabric_partition_attributes_are_published_only_with_fabric_manager_partitioning() -> None:
    gpus = (gpu(0, 7, module_id=3, partitions={8: 0, 2: 5, 1: 11}),)
    (function,) = (gpu_function(7),)
    vfio = vfio_devices([function], gpus, iommufd=False, module_ids={"0000:07:00.0": 3},
                        partitions={"0000:07:00.0": {8: 0, 2: 5, 1: 11}})
    inv = NodeInventory(versions=VERSIONS, gpus=gpus, vfio=vfio)
    (plain,) = build_resource_slices(inv, "n")
    assert not any(k.startswith(("gpuModuleID", "partition")) for d in plain["spec"]["devices"] for k in attrs(d))
    (slice_,) = build_resource_slices(inv, "n", fabric_partitions=True)
    assert_valid_slice(slice_)
    for device in slice_["spec"]["devices"]:
        fabric = {k: v for k, v in attrs(device).items() if k.startswith(("gpuModuleID", "partition"))}
        assert fabric == {"gpuModuleID": {"int": 3}, "partition1": {"int": 11}, "partition2": {"int": 5},
                          "partition8": {"int": 0}}, device["name"]


def test_many_gpus_with_their_vfio_siblings_respect_the_per_slice_limits() -> None:
    gpus = tuple(gpu(i, 2 + i) for i in range(100))
    inv = NodeInventory(versions=VERSIONS, gpus=gpus, vfio=vfio_for(*gpus))
    slices = build_resource_slices(inv, "n")
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 72]
    for slice_ in slices:
        assert_valid_slice(slice_)
