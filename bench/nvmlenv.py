"""NVML set-up shared by the benchmarks: the mock library with a benchmark profile, or the real driver.

``DRADRIVER_BENCH_REAL_NVML=1`` uses the system's ``libnvidia-ml.so.1`` (a GPU machine; read-only calls only).
Otherwise the bundled mock is loaded with :func:`all_mig_profile`: the ``dgx-a100`` node with every GPU in MIG
mode holding seven ``1g.5gb`` MIG devices (8 GPUs x 7 MIG devices, the benchmark's "full MIG table").
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import subprocess
import sysconfig
import uuid
from pathlib import Path

import pynvml

from dradriver.nvml import mock

REAL = os.environ.get("DRADRIVER_BENCH_REAL_NVML") == "1"
_MIG_NAMESPACE = uuid.UUID("6ba7b811-9dad-11d1-80b4-00c04fd430c8")  # RFC 4122 URL namespace


def all_mig_profile(directory: Path) -> Path:
    """Write the 8 GPU x 7 MIG device profile into ``directory`` and return its path."""
    base = mock.load_profile("dgx-a100")
    profile = copy.deepcopy(base)
    profile["description"] = "dgx-a100 with every GPU in MIG mode: 7x 1g.5gb each (benchmark profile)"
    for gpu in profile["gpus"]:
        gpu["migMode"] = {"current": 1, "pending": 1}
        gpu["gpuInstances"] = [
            {
                "id": 7 + slot,  # 1g GIs get IDs 7-14 (the MIG User Guide's examples, NVIDIA/DCGM#138)
                "profileId": 19,
                "placement": {"start": slot, "size": 1},
                "computeInstances": [
                    {
                        "id": 0,
                        "profileId": 0,
                        "placement": {"start": 0, "size": 1},
                        "uuid": "MIG-" + str(uuid.uuid5(_MIG_NAMESPACE, f"{gpu['uuid']}/{7 + slot}/0")),
                    }
                ],
            }
            for slot in range(7)
        ]
    path = directory / "dgx-a100-all-mig.json"
    path.write_text(json.dumps(profile, indent=1))
    return path


def open_nvml(directory: Path) -> list[str]:
    """Load NVML (mock or real), initialise it through pynvml, and return every GPU and MIG UUID."""
    if not REAL:
        lib = mock.activate(str(all_mig_profile(directory)))
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    pynvml.nvmlInit()
    uuids: list[str] = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuids.append(pynvml.nvmlDeviceGetUUID(handle))
        try:
            current, _ = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError:
            current = 0
        if current:
            for k in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, k)
                except pynvml.NVMLError:
                    continue
                uuids.append(pynvml.nvmlDeviceGetUUID(mig))
    return uuids


def build_c_loop(directory: Path) -> ctypes.CDLL:
    """Compile ``bench/c_poll_loop.c`` against the official ``nvml.h`` and load it."""
    import nvidia  # the nvidia-nvml-dev wheel ships nvml.h under nvidia/cu*/include

    headers = [p for root in nvidia.__path__ for p in Path(root).glob("cu*/include/nvml.h")]
    if not headers:
        raise RuntimeError("nvml.h not found: install nvidia-nvml-dev (part of the README setup)")
    out = directory / "c_poll_loop.so"
    cc = sysconfig.get_config_var("CC") or "cc"
    subprocess.run(
        [*cc.split(), "-O2", "-shared", "-fPIC", f"-I{headers[0].parent}", "-o", str(out),
         str(Path(__file__).with_name("c_poll_loop.c")), "-ldl"],
        check=True,
    )
    return ctypes.CDLL(str(out))


def many_gpu_profile(directory: Path, count: int) -> Path:
    """A node of ``count`` H100 GPUs without MIG (``dgx-h100`` replicated), for batch-prepare benchmarks."""
    base = mock.load_profile("dgx-h100")
    profile = copy.deepcopy(base)
    template = base["gpus"][0]
    profile["description"] = f"{count}x H100 (dgx-h100 replicated; benchmark profile)"
    gpus = []
    for i in range(count):
        gpu = copy.deepcopy(template)
        gpu["uuid"] = "GPU-" + str(uuid.uuid5(_MIG_NAMESPACE, f"bench-gpu-{i}"))
        gpu["serial"] = f"{1650000000000 + i}"
        gpu["pciBusId"] = f"{i // 256:08X}:{i % 256:02X}:00.0"
        gpu["minorNumber"] = i
        gpus.append(gpu)
    profile["gpus"] = gpus
    path = directory / f"h100-x{count}.json"
    path.write_text(json.dumps(profile, indent=1))
    return path
