"""``dradriver inspect`` through ``dradriver.cli.main`` (captured output) and once as a subprocess."""

from __future__ import annotations

import ctypes.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dradriver.cli import main
from dradriver.nvml import mock
from tests.domain.slice_validation import assert_valid_slice
from tests.factories import write_profile
from tests.nvml.mockenv import dra_bus_id, expected_pcie_root, make_sysfs, mig_layout

REPO = Path(__file__).resolve().parents[2]
PROFILES = mock.profile_names()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DRADRIVER_MOCK_PROFILE", "DRADRIVER_NVML_LIBRARY", "NODE_NAME", "SYSFS_ROOT", "DEFAULT_CONFIG",
                 "DRADRIVER_DRIVER_CONFIG_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)


def expected_device_count(profile: dict[str, Any]) -> int:
    count = 0
    for gpu in mock.resolved_gpus(profile):
        if gpu.get("lost"):
            continue
        count += len(mig_layout(gpu)) if gpu.get("migMode", {}).get("current") == 1 else 1
    return count


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["inspect", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("profile", PROFILES)
def test_json_output_per_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path, profile: str) -> None:
    data = mock.load_profile(profile)
    sysfs = make_sysfs(tmp_path / "sys", data)
    rc, out, err = inspect(
        capsys, "--mock-profile", profile, "--node-name", "node-a", "--output", "json", "--sysfs-root", str(sysfs)
    )
    assert rc == 0, err
    slices = json.loads(out)
    assert isinstance(slices, list) and slices
    for s in slices:
        assert_valid_slice(s)
        assert s["spec"]["nodeName"] == "node-a"
        assert s["spec"]["pool"]["resourceSliceCount"] == len(slices)
    devices = [d for s in slices for d in s["spec"]["devices"]]
    assert len(devices) == expected_device_count(data)
    roots = {
        expected_pcie_root(dra_bus_id(g["pciBusId"])) for g in mock.resolved_gpus(data)
    }
    assert {d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"] for d in devices} <= roots
    uuids = {g["uuid"] for g in mock.resolved_gpus(data)}
    for dev in devices:
        parent = dev["attributes"].get("parentUUID", dev["attributes"]["uuid"])["string"]
        assert parent in uuids


@pytest.mark.parametrize("profile", PROFILES)
def test_yaml_output_matches_json(capsys: pytest.CaptureFixture[str], profile: str) -> None:
    rc, out_yaml, _ = inspect(capsys, "--mock-profile", profile, "--node-name", "n")
    assert rc == 0
    assert out_yaml.startswith("# node n: driver ")
    rc, out_json, _ = inspect(capsys, "--mock-profile", profile, "--node-name", "n", "-o", "json")
    assert rc == 0
    assert list(yaml.safe_load_all(out_yaml)) == json.loads(out_json)


def test_environment_twins_and_default_node_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRADRIVER_MOCK_PROFILE", "dgx-h100")
    rc, out, _ = inspect(capsys, "-o", "json")
    assert rc == 0
    assert json.loads(out)[0]["spec"]["nodeName"] == socket.gethostname()
    monkeypatch.setenv("NODE_NAME", "from-env")
    rc, out, _ = inspect(capsys, "-o", "json")
    assert rc == 0
    assert json.loads(out)[0]["spec"]["pool"]["name"] == "from-env"


def test_explicit_library_path(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the profile the library reads; the library itself comes from the flag
    monkeypatch.setenv(mock.PROFILE_ENV, str(mock.profile_path("dgx-h100")))
    rc, out, err = inspect(capsys, "--nvml-library", str(mock.library_path()), "-o", "json")
    assert rc == 0, err
    assert len(json.loads(out)[0]["spec"]["devices"]) == 8


def test_missing_library_is_a_readable_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = inspect(capsys, "--nvml-library", str(tmp_path / "libnvidia-ml.so.1"))
    assert rc == 1
    assert out == ""
    assert "error" in err and "libnvidia-ml.so.1" in err
    assert "Traceback" not in err


def test_unknown_profile_is_a_readable_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = inspect(capsys, "--mock-profile", "no-such-node")
    assert rc == 1
    assert "no-such-node" in err and "dgx-a100" in err
    assert "Traceback" not in err


def test_failed_init_is_a_readable_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_profile(tmp_path, "dgx-h100", lambda d: d.setdefault("faults", {}).update(initReturn=9), "noinit")
    rc, out, err = inspect(capsys, "--mock-profile", path)
    assert rc == 1
    assert out == ""
    assert "nvmlInit" in err and "Traceback" not in err


def test_lost_gpu_is_reported_not_fatal(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_profile(tmp_path, "dgx-a100", lambda d: d["gpus"][5].update(lost=True), "lost")
    rc, out, err = inspect(capsys, "--mock-profile", path, "--node-name", "n")
    assert rc == 0
    assert "discovery failure: GPU index 5" in err
    assert "# discovery failure: GPU index 5" in out
    slices = list(yaml.safe_load_all(out))
    names = {d["name"] for s in slices for d in s["spec"]["devices"]}
    assert len(names) == expected_device_count(mock.load_profile(path))
    for s in slices:
        assert_valid_slice(s)


def test_subprocess_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "DRADRIVER_MOCK_NVML_PROFILE")}
    proc = subprocess.run(
        [sys.executable, "-m", "dradriver", "inspect", "--mock-profile", "gb200-nvl72-node", "-o", "json",
         "--node-name", "tray-1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    slices = json.loads(proc.stdout)
    for s in slices:
        assert_valid_slice(s)
    assert len(slices[0]["spec"]["devices"]) == 4


def test_subprocess_without_any_library_flag(tmp_path: Path) -> None:
    """Default mode reads the system library: a readable error where there is none, slices where there is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRADRIVER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "dradriver", "inspect", "-o", "json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "Traceback" not in proc.stderr
    if ctypes.util.find_library("nvidia-ml") is None:
        assert proc.returncode == 1
        assert "libnvidia-ml.so.1 not found" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert isinstance(json.loads(proc.stdout), list)


def test_slices_carry_the_plugins_generate_name(capsys: pytest.CaptureFixture[str]) -> None:
    from dradriver.kube.resourceslices import slice_generate_name

    rc, out, err = inspect(capsys, "--mock-profile", "synthetic-large", "--node-name", "n9", "-o", "json")
    assert rc == 0, err
    slices = json.loads(out)
    assert [s["metadata"]["generateName"] for s in slices] == [
        slice_generate_name(i, len(slices), "gpu.nvidia.com", "n9") for i in range(len(slices))
    ]
    assert slices[0]["metadata"]["generateName"] == "00000-gpu.nvidia.com-n9-"


def _table(out: str) -> list[dict[str, str]]:
    """The rows of ``-o table``/``-o wide`` by column name, cut at the header's column starts (cells may hold
    spaces: ``NVIDIA GB200``)."""
    header, *lines = out.splitlines()
    names = header.split()
    starts = [header.index(n) for n in names]
    ends = [*starts[1:], None]
    return [{n: line[a:b].strip() for n, a, b in zip(names, starts, ends, strict=True)} for line in lines]


def test_table_has_one_row_per_published_device(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = inspect(capsys, "--mock-profile", "dgx-a100", "--node-name", "n1", "-o", "table")
    assert rc == 0, err
    assert out.splitlines()[0].split() == ["NODE", "DEVICE", "GPU", "MIG", "MEMORY", "UUID", "HEALTH"]
    rows = _table(out)
    rc, out_json, _ = inspect(capsys, "--mock-profile", "dgx-a100", "--node-name", "n1", "-o", "json")
    devices = [d for s in json.loads(out_json) for d in s["spec"]["devices"]]
    assert [r["DEVICE"] for r in rows] == [d["name"] for d in devices]
    by_name = {d["name"]: d for d in devices}
    for row in rows:
        device = by_name[row["DEVICE"]]
        assert row["NODE"] == "n1" and row["HEALTH"] == "Healthy"
        assert row["UUID"] == device["attributes"]["uuid"]["string"]
        assert row["MEMORY"] == device["capacity"]["memory"]["value"]
        if device["attributes"]["type"]["string"] == "mig":
            assert row["MIG"] == device["attributes"]["profile"]["string"]
            assert row["DEVICE"].startswith(f"gpu-{row['GPU']}-mig-")
        else:
            assert row["MIG"] == "-" and row["DEVICE"] == f"gpu-{row['GPU']}"
    assert {r["MIG"] for r in rows} >= {"-", "1g.5gb", "3g.20gb"}


def test_wide_reports_an_unhealthy_gpu_with_its_taint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["gpus"][1]["retiredPages"] = {"pending": True}

    profile = write_profile(tmp_path, "dgx-h100", edit)
    rc, out, err = inspect(capsys, "--mock-profile", profile, "--node-name", "n1", "-o", "wide")
    assert rc == 0, err
    assert out.splitlines()[0].split() == ["NODE", "DEVICE", "GPU", "MIG", "MEMORY", "UUID", "HEALTH", "PRODUCT",
                                           "PCI-BUS-ID", "SLICE", "TAINTS"]
    rows = {r["DEVICE"]: [r[n] for n in ("HEALTH", "PRODUCT", "PCI-BUS-ID", "SLICE", "TAINTS")] for r in _table(out)}
    data = mock.load_profile(profile)
    sick = mock.resolved_gpus(data)[1]
    sick_name = f"gpu-{sick.get('minor', 1)}"
    health, product, bus_id, slice_name, taints = rows[sick_name]
    assert health == "Unhealthy" and taints != "-" and "gpu.nvidia.com" in taints
    assert product == sick["name"] and bus_id.lower() == dra_bus_id(sick["pciBusId"])
    assert slice_name == "00000-gpu.nvidia.com-n1-"
    assert all(r[0] == "Healthy" and r[4] == "-" for n, r in rows.items() if n != sick_name)


@pytest.mark.parametrize("profile, gpu, value", [
    ("gb200-nvl72-fabric-failed", None, "registration-failed"),  # state COMPLETED, status NVML_ERROR_UNKNOWN
    ("unhealthy-summary", 2, "unhealthy"),  # health summary UNHEALTHY (2) on GPU 2 of the GB200 tray
])
def test_wide_reports_a_faulty_nvlink_fabric_as_unhealthy_with_its_taint(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, profile: str, gpu: int | None, value: str) -> None:
    if profile == "unhealthy-summary":
        def edit(data: dict[str, Any]) -> None:
            data["gpus"][2]["fabric"]["healthSummary"] = 2
            data["gpus"][2]["fabric"]["healthMask"] = 0x9A  # route unhealthy

        profile = write_profile(tmp_path, "gb200-nvl72-node", edit)
    rc, out, err = inspect(capsys, "--mock-profile", profile, "--node-name", "n1", "-o", "wide")
    assert rc == 0, err
    rows = {row["DEVICE"]: row for row in _table(out)}
    sick = {f"gpu-{g}" for g in range(4)} if gpu is None else {f"gpu-{gpu}"}
    for name, row in rows.items():
        if name in sick:
            assert (row["HEALTH"], row["TAINTS"]) == ("Unhealthy", f"gpu.nvidia.com/fabric-unhealthy={value}")
        else:
            assert (row["HEALTH"], row["TAINTS"]) == ("Healthy", "-")


def test_inspect_shows_a_rubin_node(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``inspect --mock-profile vr200-node``: four Rubin GPUs, nothing left out, no warning."""
    sysfs = make_sysfs(tmp_path / "sys", mock.load_profile("vr200-node"))
    rc, out, err = inspect(capsys, "--mock-profile", "vr200-node", "--node-name", "vr-1", "--sysfs-root", str(sysfs))
    assert rc == 0 and err == "", err
    assert out.startswith("# node vr-1: driver 615.23, CUDA 13.4, 4 GPU(s), 0 MIG device(s)")
    (resource_slice,) = [s for s in yaml.safe_load_all(out) if s]
    assert_valid_slice(resource_slice)
    attributes = {d["name"]: d["attributes"] for d in resource_slice["spec"]["devices"]}
    assert list(attributes) == ["gpu-0", "gpu-3", "gpu-1", "gpu-2"]
    for attrs in attributes.values():
        assert attrs["architecture"] == {"string": "Rubin"}
        assert attrs["cudaComputeCapability"] == {"version": "10.7.0"}


def test_inspect_applies_a_driver_config_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """What a node labelled nvidia.com/dra-driver-gpu.config=<profile> would publish; a bad profile is refused
    naming the file and the field."""
    (tmp_path / "full-gpu").write_text("version: v1alpha1\ngpu:\n  advertisedDeviceTypes: [gpu]\n")
    (tmp_path / "typo").write_text("version: v1alpha1\ngpu:\n  advertisedDeviceType: [gpu]\n")
    common = ("--mock-profile", "dgx-a100", "--node-name", "node-a", "--driver-config-directory", str(tmp_path))
    rc, out, err = inspect(capsys, *common, "--default-config", "full-gpu", "--output", "json")
    assert rc == 0, err
    names = [d["name"] for s in json.loads(out) for d in s["spec"]["devices"]]
    assert names == [f"gpu-{i}" for i in range(2, 8)]  # GPUs 0 and 1 are in MIG mode: nothing of theirs
    assert "driver config profile 'full-gpu' (--default-config): advertising gpu" in err
    rc, out, err = inspect(capsys, *common, "--default-config", "typo")
    assert rc == 2 and not out
    assert f"{tmp_path / 'typo'}): gpu.advertisedDeviceType: unknown field" in err


def test_table_lists_vfio_devices_with_their_gpu_and_unknown_health() -> None:
    """The rows the plugin's inventory gives once it carries VFIO devices (gate PassthroughSupport): each
    ``gpu-vfio-<index>`` next to its GPU, MIG column ``vfio``, its addressable memory, ``Unknown`` health."""
    from dataclasses import replace

    from dradriver.commands.inspect import _header, device_rows, format_table, poll_health
    from dradriver.domain.pools import build
    from dradriver.nvml.discovery import discover
    from dradriver.nvml.session import open_session
    from tests.factories import vfio_for

    with open_session("", "l4-inference") as session:
        found = discover(session, sysfs_root=Path("/nonexistent"))
        inventory = replace(found, vfio=vfio_for(*found.gpus))
        health = poll_health(inventory, session, "n1")
    slices = build(inventory, "n1").slices
    rows = device_rows(inventory, "n1", slices, health, wide=True)
    header, *body = rows
    table = {row[1]: dict(zip(header, row, strict=True)) for row in body}
    for vfio in inventory.vfio:
        row = table[vfio.name]
        assert (row["GPU"], row["MIG"], row["MEMORY"], row["UUID"], row["HEALTH"]) == (
            str(vfio.parent_minor), "vfio", "128Gi", vfio.uuid, "Unknown")
        assert row["PCI-BUS-ID"] == vfio.function.address and row["PRODUCT"] == vfio.product_name
        assert table[str(vfio.sibling)]["HEALTH"] == "Healthy"
    assert len(body) == 2 * len(inventory.gpus)
    assert "gpu-vfio-0" in format_table(rows)
    assert f"{len(inventory.vfio)} VFIO device(s)" in _header(inventory, "n1", slices, [])[0]
