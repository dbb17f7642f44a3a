"""Fixture driver roots, written by hand (independently of ``dradriver.sandbox.node.lay_out_driver_tree``).

A tree is a mapping of paths (relative to the root) to ``""`` for an empty file, ``"/"`` for a directory and
``"-> target"`` for a symlink.
"""

from __future__ import annotations

from pathlib import Path

VERSION = "580.105.08"
OTHER = "570.148.08"
X86 = "/usr/lib/x86_64-linux-gnu"
ARM = "/usr/lib/aarch64-linux-gnu"


def build(root: Path, tree: dict[str, str]) -> Path:
    """Create ``tree`` under ``root`` and return ``root``."""
    for rel, what in tree.items():
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if what == "/":
            path.mkdir(exist_ok=True)
        elif what.startswith("-> "):
            path.symlink_to(what[3:])
        else:
            path.write_text(what)
    return root


def ubuntu_x86_64(version: str = VERSION) -> dict[str, str]:
    """A merged-/usr Ubuntu host (``/lib -> usr/lib``, ``/var/run -> /run``) with driver ``version``."""
    lib = X86
    return {
        "/lib": "-> usr/lib",
        "/bin": "-> usr/bin",
        "/sbin": "-> usr/sbin",
        "/lib64": "-> usr/lib64",
        "/usr/lib64/ld-linux-x86-64.so.2": "",
        "/var/run": "-> /run",
        f"{lib}/libcuda.so.{version}": "",
        f"{lib}/libcuda.so.1": f"-> libcuda.so.{version}",
        f"{lib}/libcuda.so": "-> libcuda.so.1",
        f"{lib}/libnvidia-ml.so.{version}": "",
        f"{lib}/libnvidia-ml.so.1": f"-> libnvidia-ml.so.{version}",
        f"{lib}/libnvidia-ptxjitcompiler.so.{version}": "",
        f"{lib}/libnvidia-ptxjitcompiler.so.1": f"-> libnvidia-ptxjitcompiler.so.{version}",
        f"{lib}/libnvidia-nvvm.so.{version}": "",
        f"{lib}/libnvidia-nvvm.so.4": f"-> libnvidia-nvvm.so.{version}",
        f"{lib}/libnvidia-nvvm.so": "-> libnvidia-nvvm.so.4",
        f"{lib}/libnvidia-gpucomp.so.{version}": "",
        f"{lib}/libnvidia-allocator.so.{version}": "",
        f"{lib}/libnvidia-allocator.so.1": f"-> {lib}/libnvidia-allocator.so.{version}",  # absolute link
        f"{lib}/libnvidia-opticalflow.so.{version}": "",
        f"{lib}/libnvidia-opticalflow.so.1": f"-> libnvidia-opticalflow.so.{version}",
        f"{lib}/libGLX_nvidia.so.{version}": "",
        f"{lib}/libGLX_nvidia.so.0": f"-> libGLX_nvidia.so.{version}",
        f"{lib}/libnvidia-egl-wayland.so.1.1.19": "",
        f"{lib}/libnvidia-egl-wayland.so.1": "-> libnvidia-egl-wayland.so.1.1.19",
        f"{lib}/libnvidia-nvvm70.so.4": "",
        f"{lib}/vdpau/libvdpau_nvidia.so.{version}": "",
        f"{lib}/vdpau/libvdpau_nvidia.so.1": f"-> libvdpau_nvidia.so.{version}",
        # not the driver's: another version, an unrelated library, a link of an unexpected name, a link that
        # points outside the root (resolved inside it, where it does not exist)
        f"{lib}/libcuda.so.{OTHER}": "",
        f"{lib}/libz.so.1": "",
        f"{lib}/libcuda-compat-alias.so": f"-> libcuda.so.{version}",
        f"{lib}/libnvidia-tls.so.{version}": "-> /etc/passwd",
        "/usr/lib/xorg/modules/drivers/nvidia_drv.so": "",
        "/usr/bin/nvidia-smi": "",
        "/usr/bin/nvidia-debugdump": "",
        "/usr/bin/nvidia-persistenced": "",
        "/usr/bin/nvidia-cuda-mps-control": "",
        "/usr/bin/nvidia-cuda-mps-server": "",
        "/run/nvidia-persistenced/socket": "",
        "/run/nvidia-fabricmanager/socket": "",
        "/tmp/nvidia-mps": "/",
        f"/usr/lib/firmware/nvidia/{version}/gsp_ga10x.bin": "",
        f"/usr/lib/firmware/nvidia/{version}/gsp_tu10x.bin": "",
        f"/usr/lib/firmware/nvidia/{version}/README": "",
        f"/usr/lib/firmware/nvidia/{OTHER}/gsp_ga10x.bin": "",
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": "",
        "/etc/vulkan/icd.d/nvidia_icd.json": "",
        "/etc/OpenCL/vendors/nvidia.icd": "",
    }


def debian_aarch64(version: str = VERSION, release: str = "6.8.0-1013-nvidia-64k") -> dict[str, str]:
    """A Grace host without merged /usr: a minimal driver, firmware under the kernel's updates directory."""
    return {
        f"{ARM}/libcuda.so.{version}": "",
        f"{ARM}/libcuda.so.1": f"-> libcuda.so.{version}",
        f"{ARM}/libnvidia-ml.so.{version}": "",
        f"{ARM}/libnvidia-ml.so.1": f"-> libnvidia-ml.so.{version}",
        f"{ARM}/libnvidia-ptxjitcompiler.so.{version}": "",
        "/usr/bin/nvidia-smi": "",
        "/var/run/nvidia-persistenced/socket": "",
        f"/lib/firmware/updates/{release}/nvidia/{version}/gsp_ga10x.bin": "",
        f"/lib/firmware/nvidia/{version}/gsp_ga10x.bin": "",
    }


def rhel_x86_64(version: str = VERSION) -> dict[str, str]:
    """An RPM host: libraries in /usr/lib64 (also reachable as /lib64), binaries in /usr/local/bin first."""
    return {
        "/lib64": "-> usr/lib64",
        f"/usr/lib64/libcuda.so.{version}": "",
        f"/usr/lib64/libnvidia-ml.so.{version}": "",
        f"/usr/lib64/libnvidia-cfg.so.{version}": "",
        "/usr/lib64/libnvidia-cfg.so.1": f"-> libnvidia-cfg.so.{version}",
        "/usr/local/bin/nvidia-smi": "-> /opt/nvidia/bin/nvidia-smi",
        "/opt/nvidia/bin/nvidia-smi": "",
        "/usr/bin/nvidia-smi": "",
        f"/opt/firmware/nvidia/{version}/gsp_ga10x.bin": "",
    }
