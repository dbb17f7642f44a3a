"""Mock NVML node profiles the sandbox derives for its scenarios when no bundled profile has the GPU it needs.

:func:`h200_node` is the sharing demo's node: NVIDIA H200 GPUs. When the bundled ``dgx-h200`` profile exists it is
used as is; otherwise the bundled ``dgx-h100`` node is given the H200's identity as public ``nvidia-smi`` dumps and
NVIDIA/mig-parted's ``config-default.yaml`` give it (name ``NVIDIA H200``, PCI device ID ``0x233510DE``,
150754820096 bytes = 143771 MiB of memory; same Hopper architecture, compute capability 9.0 and 132 SMs as the
H100) with MIG disabled, and written to a file.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

from dradriver.nvml import mock
from dradriver.nvml.mock import MockNvmlError

H200_NAME = "NVIDIA H200"
H200_PCI_DEVICE_ID = 0x233510DE
H200_MEMORY_BYTES = 150754820096
_NAMESPACE = uuid.UUID("5f0c9a52-3c49-4b6e-9a57-0d4c2b8e7a10")


def h200_node(directory: Path, *, gpus: int = 8) -> str:
    """A profile name or file path for a node of ``gpus`` H200 GPUs without MIG (module docstring)."""
    try:
        mock.load_profile("dgx-h200")
        if gpus == 8:
            return "dgx-h200"
    except MockNvmlError:
        pass
    profile = copy.deepcopy(mock.load_profile("dgx-h100"))
    profile["description"] = f"{gpus}x NVIDIA H200 141GB (dgx-h100 with the H200's name, PCI ID and memory; sandbox)"
    models = profile["models"]
    (key, model), = models.items()
    model["name"] = H200_NAME
    model["pciDeviceId"] = H200_PCI_DEVICE_ID
    model["memory"] = {**model["memory"], "total": H200_MEMORY_BYTES}
    template = profile["gpus"][0]
    profile["gpus"] = []
    for i in range(gpus):
        gpu = copy.deepcopy(template)
        gpu.update(model=key, uuid="GPU-" + str(uuid.uuid5(_NAMESPACE, f"h200-{i}")), serial=f"{1654000000000 + i}",
                   pciBusId=f"00000000:{0x18 + 0x10 * i:02X}:00.0", minorNumber=i, migMode={"current": 0, "pending": 0})
        profile["gpus"].append(gpu)
    path = directory / f"h200-x{gpus}.json"
    path.write_text(json.dumps(profile, indent=1))
    return str(path)
