"""Claim specs for ``gpu.nvidia.com``: names, device nodes, MIG capabilities, versions, bulk specs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dradriver.domain import cdi
from dradriver.domain.cdi import ContainerEdits, Mount
from dradriver.domain.identity import GPU_DRIVER
from dradriver.host.devicenodes import DeviceNodeInfo
from tests.cdi import helpers
from tests.cdi.conftest import CLAIM_UID, LETTER_UID, make_gpu, make_migs


def validate(data: bytes) -> dict[str, Any]:
    """Schema and strict checks, with every node a fully specified character device."""
    return helpers.validate(data, fully_specified=True)


def _nodes(edits: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["path"]: n for n in edits.get("deviceNodes", [])}


def test_names_and_ids() -> None:
    assert GPU_DRIVER.cdi.device_id(CLAIM_UID, "gpu-0") == f"k8s.gpu.nvidia.com/claim={CLAIM_UID}-gpu-0"
    assert GPU_DRIVER.cdi.spec_name(CLAIM_UID) == f"k8s.gpu.nvidia.com-claim_{CLAIM_UID}.yaml"
    assert GPU_DRIVER.cdi.spec_path("/var/run/cdi", CLAIM_UID) == Path(
        f"/var/run/cdi/k8s.gpu.nvidia.com-claim_{CLAIM_UID}.yaml"
    )
    with pytest.raises(cdi.CdiSpecError, match="claim UID"):
        GPU_DRIVER.cdi.spec_name("../etc/passwd")


def test_one_gpu_claim(node_info: DeviceNodeInfo) -> None:
    spec = validate(helpers.render_gpu_spec(CLAIM_UID, [make_gpu(0)], node_info=node_info))
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    # the UID starts with a digit, so the device name needs 0.5.0 (cdi.md 1.4 rule 5)
    assert spec["cdiVersion"] == "0.5.0"
    assert [d["name"] for d in spec["devices"]] == [f"{CLAIM_UID}-gpu-0"]
    common = spec["containerEdits"]
    assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    ctl = _nodes(common)
    assert ctl["/dev/nvidiactl"] == {
        "path": "/dev/nvidiactl",
        "type": "c",
        "major": 195,
        "minor": 255,
        "fileMode": 0o666,
        "permissions": "rwm",
    }
    assert ctl["/dev/nvidia-uvm"]["major"] == 510 and "minor" not in ctl["/dev/nvidia-uvm"]
    assert ctl["/dev/nvidia-uvm-tools"]["major"] == 510 and ctl["/dev/nvidia-uvm-tools"]["minor"] == 1
    assert "/dev/nvidia-modeset" not in ctl  # not present on this host
    gpu = _nodes(spec["devices"][0]["containerEdits"])
    # minor 0 is omitted, as Go's omitempty does
    assert gpu == {
        "/dev/nvidia0": {"path": "/dev/nvidia0", "type": "c", "major": 195, "fileMode": 438, "permissions": "rwm"}
    }


def test_lowest_version_for_letter_uid(node_info: DeviceNodeInfo) -> None:
    spec = validate(helpers.render_gpu_spec(LETTER_UID, [make_gpu(3)], node_info=node_info))
    assert spec["cdiVersion"] == "0.3.0"
    assert _nodes(spec["devices"][0]["containerEdits"])["/dev/nvidia3"]["minor"] == 3


def test_eight_gpu_claim(node_info: DeviceNodeInfo) -> None:
    gpus = [make_gpu(m) for m in range(8)]
    spec = validate(helpers.render_gpu_spec(CLAIM_UID, gpus, node_info=node_info))
    assert [d["name"] for d in spec["devices"]] == [f"{CLAIM_UID}-gpu-{m}" for m in range(8)]
    for m, dev in enumerate(spec["devices"]):
        assert list(_nodes(dev["containerEdits"])) == [f"/dev/nvidia{m}"]


def test_mig_claim_has_capability_nodes(node_info: DeviceNodeInfo) -> None:
    parent = make_gpu(3, mig=True)
    mig = make_migs(parent)[4]  # GI 11, CI 0
    spec = validate(helpers.render_gpu_spec(CLAIM_UID, [mig], node_info=node_info))
    (dev,) = spec["devices"]
    assert dev["name"] == f"{CLAIM_UID}-gpu-3-mig-1g5gb-19-4"
    nodes = _nodes(dev["containerEdits"])
    gi_minor = 3 + 135 * 3 + 9 * 11
    ci_minor = 4 + 135 * 3 + 9 * 11 + 0
    assert list(nodes) == [
        "/dev/nvidia3",
        f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
        f"/dev/nvidia-caps/nvidia-cap{ci_minor}",
    ]
    assert nodes[f"/dev/nvidia-caps/nvidia-cap{gi_minor}"] == {
        "path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
        "type": "c",
        "major": 237,
        "minor": gi_minor,
        "fileMode": 0o444,
    }


def test_mig_minor_sources(tmp_path: Path, node_info: DeviceNodeInfo) -> None:
    # the capability file wins over mig-minors; mig-minors over the formula
    cap = node_info.capabilities_dir / "gpu0/mig/gi1/ci2/access"
    cap.parent.mkdir(parents=True)
    cap.write_text("DeviceFileMinor: 777\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    assert node_info.mig_cap(0, 1, 2) == (777, 256)
    assert node_info.mig_cap(0, 1, None) == (12, 0o444)
    node_info.mig_minors.write_text("gpu0/gi1/access 900\n")
    assert node_info.mig_cap(0, 1, None) == (900, 0o444)
    # formula (gpu-facts.md 3.2 checks): gpu3/gi3/ci3 -> 439, gpu6/gi11/ci7 -> 920, gpu31/gi14/ci7 -> 4322
    bare = DeviceNodeInfo(mig_minors=tmp_path / "none", capabilities_dir=tmp_path / "none")
    assert [bare.mig_cap(3, 3, 3)[0], bare.mig_cap(6, 11, 7)[0], bare.mig_cap(31, 14, 7)[0]] == [439, 920, 4322]
    with pytest.raises(cdi.DeviceNodeError, match="gpu32/gi0/access"):
        bare.mig_cap(32, 0, None)


def test_every_mig_device_of_an_eight_gpu_node(node_info: DeviceNodeInfo) -> None:
    migs = [m for minor in range(8) for m in make_migs(make_gpu(minor, mig=True))]
    spec = validate(helpers.render_gpu_spec(CLAIM_UID, migs, node_info=node_info))
    assert len(spec["devices"]) == 56
    cap_minors = [n["minor"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"][1:]]
    assert len(cap_minors) == len(set(cap_minors)) == 112


def test_host_root_transform(node_info: DeviceNodeInfo) -> None:
    info = DeviceNodeInfo(
        dev_root=node_info.dev_root,
        host_root="/run/nvidia/driver",
        proc_devices=node_info.proc_devices,
        mig_minors=node_info.mig_minors,
        capabilities_dir=node_info.capabilities_dir,
    )
    spec = validate(helpers.render_gpu_spec(LETTER_UID, [make_gpu(1)], node_info=info))
    assert spec["cdiVersion"] == "0.5.0"  # hostPath needs 0.5.0
    node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert node["hostPath"] == "/run/nvidia/driver/dev/nvidia1"


def test_major_falls_back_to_the_node_stat(tmp_path: Path, node_info: DeviceNodeInfo) -> None:
    proc = tmp_path / "devices-no-uvm"
    proc.write_text("Character devices:\n195 nvidia\n\nBlock devices:\n 99 nvidia-uvm\n")
    dev = tmp_path / "dev-fallback" / "dev"
    dev.mkdir(parents=True)
    # /dev/null is a real character device (1:3); stat follows the link
    os.symlink("/dev/null", dev / "nvidia-uvm")
    st = os.stat("/dev/null")
    info = DeviceNodeInfo(dev_root=dev.parent, proc_devices=proc, mig_minors=node_info.mig_minors)
    spec = validate(helpers.render_gpu_spec(LETTER_UID, [make_gpu(0)], node_info=info))
    nodes = _nodes(spec["containerEdits"])
    assert nodes["/dev/nvidia-uvm"]["major"] == os.major(st.st_rdev)
    assert nodes["/dev/nvidia-uvm"]["fileMode"] == st.st_mode & 0o7777
    # the block-device line for nvidia-uvm is not a character major; with no node the error is clear
    os.unlink(dev / "nvidia-uvm")
    with pytest.raises(cdi.DeviceNodeError, match=rf"claim {LETTER_UID}: .*nvidia-uvm"):
        helpers.render_gpu_spec(LETTER_UID, [make_gpu(0)], node_info=info)


def test_extra_edits_and_duplicate_devices(node_info: DeviceNodeInfo) -> None:
    mps = ContainerEdits(
        env=("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",),
        mounts=(Mount("/var/lib/mps/shm", "/dev/shm", ("rw", "nosuid", "nodev", "bind")),),
    )
    spec = validate(helpers.render_gpu_spec(LETTER_UID, [make_gpu(0)], node_info=node_info, extra_edits={"gpu-0": mps}))
    edits = spec["devices"][0]["containerEdits"]
    assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert edits["mounts"][0]["containerPath"] == "/dev/shm"
    with pytest.raises(cdi.CdiSpecError, match=rf"claim {LETTER_UID}: .*duplicate device name"):
        helpers.render_gpu_spec(LETTER_UID, [make_gpu(0), make_gpu(0)], node_info=node_info)
    bad = ContainerEdits(mounts=(Mount("relative", "/x"),))
    with pytest.raises(cdi.CdiSpecError, match="not an absolute path"):
        helpers.render_gpu_spec(LETTER_UID, [make_gpu(0)], node_info=node_info, common=bad)


def test_imex_channel_bulk_spec() -> None:
    spec = validate(cdi.render_imex_channel_spec(234, host_root="/"))
    assert spec["kind"] == "nvidia.com/imex-channel"
    assert spec["cdiVersion"] == "0.5.0"  # names are digits
    assert len(spec["devices"]) == 2048
    last = spec["devices"][-1]
    assert last == {
        "name": "2047",
        "containerEdits": {
            "deviceNodes": [
                {
                    "path": "/dev/nvidia-caps-imex-channels/channel2047",
                    "type": "c",
                    "major": 234,
                    "minor": 2047,
                    "fileMode": 438,
                }
            ]
        },
    }
    assert spec["containerEdits"] == {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}
    cd = validate(
        cdi.render_imex_channel_spec(
            508, range(4), kind="k8s.compute-domain.nvidia.com/claim", name_prefix=f"{LETTER_UID}-channel-"
        )
    )
    assert [d["name"] for d in cd["devices"]] == [f"{LETTER_UID}-channel-{n}" for n in range(4)]
    assert cd["cdiVersion"] == "0.3.0"
    with pytest.raises(cdi.CdiSpecError, match=r"channels\[1\] 2048 is out of range \[0, 2047\]"):
        cdi.render_imex_channel_spec(234, [0, 2048])
