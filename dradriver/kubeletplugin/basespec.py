"""The compute-domain plugin's base CDI spec: the one device every IMEX daemon claim's containers get beside their
claim device (``k8s.compute-domain.nvidia.com/device=all``).

NVIDIA's plugin writes it as ``k8s.compute-domain.nvidia.com-device_base.yaml`` in "management" mode
(``NVIDIA_VISIBLE_DEVICES=void``, every GPU's node and the driver's user space; ``cmd/compute-domain-kubelet-plugin/
cdi.go`` in kubernetes-sigs/dra-driver-nvidia-gpu); dradriver's specs are JSON.
"""

from __future__ import annotations

from dradriver import _native
from dradriver.domain import cdi
from dradriver.domain.identity import DriverIdentity
from dradriver.host import devicenodes
from dradriver.host.devicenodes import DeviceNodeInfo
from dradriver.host.imexchannels import ImexNodeInfo
from dradriver.nvml import fabric
from dradriver.nvml.session import NvmlSession

BASE_SPEC_NAME = "k8s.compute-domain.nvidia.com-device_base.json"
"""The base spec's file in the CDI root (NVIDIA writes ``..._base.yaml``; dradriver's specs are JSON)."""


def base_spec(info: DeviceNodeInfo, identity: DriverIdentity, session: NvmlSession, imex: ImexNodeInfo,
              common: cdi.ContainerEdits) -> bytes:
    """The base spec: kind ``<vendor>/device``, one device ``all`` with the control nodes, every GPU's
    ``/dev/nvidia<minor>``, the ``fabric-imex-mgmt`` capability and the channel nodes present on the node, plus the
    driver's user space ``common`` (``nvidia-imex``, ``nvidia-imex-ctl`` among the binaries) and
    ``NVIDIA_VISIBLE_DEVICES=void`` (NVIDIA's "management" mode).

    :param info: where the device nodes are read and what their host paths are (majors from ``/proc/devices``).
    :raises dradriver.domain.cdi.CdiSpecError: the spec breaks a CDI rule.
    :raises dradriver.nvml.errors.NvmlError: the GPUs' minors cannot be read.
    """
    majors = info.read_majors()
    edits = devicenodes.control_edits(info, majors)
    nvidia = info.major(majors, ("nvidia", "nvidia-frontend", "nvidiactl"), "/dev/nvidiactl")
    nodes: list[cdi.DeviceNode] = []
    for minor in fabric.gpu_minors(session):
        nodes.append(cdi.DeviceNode(f"/dev/nvidia{minor}", info.host_path(f"/dev/nvidia{minor}"), "c", nvidia, minor))
    if imex.fabric_imex_mgmt_minor is not None and imex.caps_major is not None:
        path = imex.fabric_imex_mgmt_path
        nodes.append(cdi.DeviceNode(path, info.host_path(path), "c", imex.caps_major, imex.fabric_imex_mgmt_minor))
    if imex.channel_major is not None:
        for n in range(imex.channel_count):
            path = f"/dev/nvidia-caps-imex-channels/channel{n}"
            if info.stat_node(path) is not None:
                nodes.append(cdi.DeviceNode(path, info.host_path(path), "c", imex.channel_major, n, 0o666))
    edits = edits + cdi.ContainerEdits(device_nodes=tuple(nodes)) + common
    renderer = _native.load("cdispec")
    try:
        data: bytes = renderer.render_spec(f"{identity.cdi.vendor}/device", [("all", edits.record())], None)
    except (TypeError, ValueError) as exc:
        raise cdi.CdiSpecError(f"base CDI spec: {exc}") from exc
    return data
