"""Finding the driver's user-space files under a driver root (reference ``cdi.md`` 4.6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dradriver.host.driverfiles import (
    DriverFile,
    DriverFilesError,
    discover_driver_files,
    read_firmware_path,
    resolve_in_root,
)
from tests.driverfiles.trees import ARM, OTHER, VERSION, X86, build, debian_aarch64, rhel_x86_64, ubuntu_x86_64

RELEASE = "6.8.0-1013-nvidia-64k"


def test_ubuntu_x86_64_layout(tmp_path: Path) -> None:
    root = build(tmp_path, ubuntu_x86_64())
    files = discover_driver_files(root, VERSION, kernel_release=RELEASE)
    assert files.found and files.version == VERSION and files.root == str(root)
    # /lib/x86_64-linux-gnu is the same directory through /lib -> usr/lib: listed once, canonical
    assert files.libcuda_dirs == (X86,)
    assert files.libraries == tuple(sorted(f"{X86}/{name}" for name in (
        f"libcuda.so.{VERSION}",
        f"libnvidia-ml.so.{VERSION}",
        f"libnvidia-ptxjitcompiler.so.{VERSION}",
        f"libnvidia-nvvm.so.{VERSION}",
        f"libnvidia-gpucomp.so.{VERSION}",
        f"libnvidia-allocator.so.{VERSION}",
        f"libnvidia-opticalflow.so.{VERSION}",
        f"libGLX_nvidia.so.{VERSION}",
        "libnvidia-egl-wayland.so.1.1.19",
        "libnvidia-nvvm70.so.4",
        f"vdpau/libvdpau_nvidia.so.{VERSION}",
    )))
    assert files.library_dirs == (X86, f"{X86}/vdpau")
    assert files.links == (
        ("libcuda.so.1", f"{X86}/libcuda.so"),
        (f"libGLX_nvidia.so.{VERSION}", f"{X86}/libGLX_indirect.so.0"),
        ("libnvidia-opticalflow.so.1", f"{X86}/libnvidia-opticalflow.so"),
        (f"libGLX_nvidia.so.{VERSION}", f"{X86}/libGLX_nvidia.so.0"),
        (f"libcuda.so.{VERSION}", f"{X86}/libcuda.so.1"),
        # the absolute host link is written with the library's name, which resolves in the container too
        (f"libnvidia-allocator.so.{VERSION}", f"{X86}/libnvidia-allocator.so.1"),
        ("libnvidia-egl-wayland.so.1.1.19", f"{X86}/libnvidia-egl-wayland.so.1"),
        (f"libnvidia-ml.so.{VERSION}", f"{X86}/libnvidia-ml.so.1"),
        ("libnvidia-nvvm.so.4", f"{X86}/libnvidia-nvvm.so"),
        (f"libnvidia-nvvm.so.{VERSION}", f"{X86}/libnvidia-nvvm.so.4"),
        (f"libnvidia-opticalflow.so.{VERSION}", f"{X86}/libnvidia-opticalflow.so.1"),
        (f"libnvidia-ptxjitcompiler.so.{VERSION}", f"{X86}/libnvidia-ptxjitcompiler.so.1"),
        (f"libvdpau_nvidia.so.{VERSION}", f"{X86}/vdpau/libvdpau_nvidia.so.1"),
    )
    assert [b.path for b in files.binaries] == [
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-debugdump",
        "/usr/bin/nvidia-persistenced",
        "/usr/bin/nvidia-cuda-mps-control",
        "/usr/bin/nvidia-cuda-mps-server",
    ]
    assert all(b.path == b.source for b in files.binaries)
    assert files.ipc == (
        DriverFile("/run/nvidia-persistenced/socket", "/run/nvidia-persistenced/socket"),
        DriverFile("/run/nvidia-fabricmanager/socket", "/run/nvidia-fabricmanager/socket"),
        DriverFile("/tmp/nvidia-mps", "/tmp/nvidia-mps"),
    )
    # /lib/firmware is /usr/lib/firmware here; other versions and non-gsp files are left out
    assert files.firmware == (
        f"/usr/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/usr/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    )
    assert [g.path for g in files.graphics] == [
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        "/etc/OpenCL/vendors/nvidia.icd",
        "/etc/vulkan/icd.d/nvidia_icd.json",
        "/usr/lib/xorg/modules/drivers/nvidia_drv.so",
    ]
    assert files.count() == 11 + 5 + 3 + 2 + 4


def test_debian_aarch64_layout(tmp_path: Path) -> None:
    root = build(tmp_path, debian_aarch64(release=RELEASE))
    files = discover_driver_files(root, VERSION, kernel_release=RELEASE)
    assert files.libcuda_dirs == (ARM,)
    assert files.libraries == (
        f"{ARM}/libcuda.so.{VERSION}",
        f"{ARM}/libnvidia-ml.so.{VERSION}",
        f"{ARM}/libnvidia-ptxjitcompiler.so.{VERSION}",
    )
    assert files.links == (
        ("libcuda.so.1", f"{ARM}/libcuda.so"),
        (f"libcuda.so.{VERSION}", f"{ARM}/libcuda.so.1"),
        (f"libnvidia-ml.so.{VERSION}", f"{ARM}/libnvidia-ml.so.1"),
    )
    assert files.binaries == (DriverFile("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),)
    # /run has no socket, /var/run (a plain directory here) has
    assert files.ipc == (DriverFile("/var/run/nvidia-persistenced/socket", "/var/run/nvidia-persistenced/socket"),)
    # the kernel-specific updates directory is searched first; every directory of the search path counts
    assert files.firmware == (
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/updates/{RELEASE}/nvidia/{VERSION}/gsp_ga10x.bin",
    )
    assert files.graphics == ()
    # another kernel does not see the updates directory of this one
    other = discover_driver_files(root, VERSION, kernel_release="6.1.0-generic")
    assert other.firmware == (f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",)


def test_rpm_layout_and_binary_found_through_a_link(tmp_path: Path) -> None:
    root = build(tmp_path, rhel_x86_64())
    files = discover_driver_files(root, VERSION, kernel_release=RELEASE, firmware_path="/opt/firmware")
    assert files.libcuda_dirs == ("/usr/lib64",)  # /lib64 is the same directory
    assert files.libraries == tuple(f"/usr/lib64/{n}.so.{VERSION}" for n in ("libcuda", "libnvidia-cfg",
                                                                              "libnvidia-ml"))
    # /usr/local/bin comes first on the toolkit's PATH; the container sees it there, the source is the target
    assert files.binaries == (DriverFile("/usr/local/bin/nvidia-smi", "/opt/nvidia/bin/nvidia-smi"),)
    assert files.firmware == (f"/opt/firmware/nvidia/{VERSION}/gsp_ga10x.bin",)
    assert ("libcuda.so.1", "/usr/lib64/libcuda.so") in files.links
    assert (f"libnvidia-cfg.so.{VERSION}", "/usr/lib64/libnvidia-cfg.so.1") in files.links


def test_optional_files_missing(tmp_path: Path) -> None:
    root = build(tmp_path, {f"/usr/lib64/libcuda.so.{VERSION}": "", f"/usr/lib64/libnvidia-ml.so.{VERSION}": ""})
    files = discover_driver_files(root, VERSION, kernel_release=RELEASE)
    assert files.found
    assert files.libraries == (f"/usr/lib64/libcuda.so.{VERSION}", f"/usr/lib64/libnvidia-ml.so.{VERSION}")
    assert files.links == (("libcuda.so.1", "/usr/lib64/libcuda.so"),)
    assert files.binaries == files.ipc == files.graphics == ()
    assert files.firmware == ()


def test_missing_libcuda_is_an_error_naming_root_and_version(tmp_path: Path) -> None:
    with pytest.raises(DriverFilesError) as err:
        discover_driver_files(tmp_path, VERSION)
    message = str(err.value)
    assert f"libcuda.so.{VERSION} not found under driver root {tmp_path}" in message
    assert "--container-driver-root" in message and "NVIDIA_DRIVER_ROOT" in message


def test_libraries_of_another_driver_version_are_an_error(tmp_path: Path) -> None:
    root = build(tmp_path, ubuntu_x86_64(OTHER))
    with pytest.raises(DriverFilesError, match=f"libcuda.so.{VERSION} not found"):
        discover_driver_files(root, VERSION)
    assert discover_driver_files(root, OTHER, kernel_release=RELEASE).libcuda_dirs == (X86,)


def test_missing_libnvidia_ml_is_an_error(tmp_path: Path) -> None:
    root = build(tmp_path, {f"{X86}/libcuda.so.{VERSION}": ""})
    with pytest.raises(DriverFilesError, match=f"libnvidia-ml.so.{VERSION} not found next to libcuda"):
        discover_driver_files(root, VERSION)


def test_not_required_gives_an_empty_result(tmp_path: Path) -> None:
    files = discover_driver_files(tmp_path / "absent", VERSION, require=False)
    assert not files.found and files.count() == 0 and files.library_dirs == ()


@pytest.mark.parametrize("version", ["", "../580", "5*", "580 1"])
def test_unusable_version_is_an_error(tmp_path: Path, version: str) -> None:
    with pytest.raises(DriverFilesError, match="not usable"):
        discover_driver_files(tmp_path, version)


def test_resolve_in_root_stays_inside(tmp_path: Path) -> None:
    build(tmp_path, {
        "/usr/lib/real": "",
        "/lib": "-> usr/lib",
        "/abs": "-> /usr/lib/real",
        "/up": "-> ../../../../usr/lib/real",
        "/loop1": "-> loop2",
        "/loop2": "-> loop1",
        "/out": "-> /etc/hostname",
    })
    assert resolve_in_root(tmp_path, "/lib/real") == "/usr/lib/real"
    assert resolve_in_root(tmp_path, "/abs") == "/usr/lib/real"
    assert resolve_in_root(tmp_path, "/up") == "/usr/lib/real"
    assert resolve_in_root(tmp_path, "/usr/./lib/../lib/real") == "/usr/lib/real"
    assert resolve_in_root(tmp_path, "/loop1") is None
    assert resolve_in_root(tmp_path, "/out") is None  # /etc/hostname of the host does not count
    assert resolve_in_root(tmp_path, "/") == "/"


def test_read_firmware_path(tmp_path: Path) -> None:
    assert read_firmware_path(tmp_path) == ""
    params = tmp_path / "module" / "firmware_class" / "parameters"
    params.mkdir(parents=True)
    (params / "path").write_text("/opt/firmware\n")
    assert read_firmware_path(tmp_path) == "/opt/firmware"
