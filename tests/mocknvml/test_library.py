"""The built artefact: ELF SONAME, no Python dependency, resolution by SONAME, and the plain C ABI path."""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dradriver.nvml import mock


def _dynamic_entries(path: Path) -> tuple[list[str], str]:
    """(DT_NEEDED names, DT_SONAME) of a little-endian ELF64 shared object, read from its section headers."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "expected a little-endian ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + k * shentsize) for k in range(shnum)]
    dynamic = next(s for s in sections if s[1] == 6)  # SHT_DYNAMIC
    strtab = sections[dynamic[6]]  # sh_link
    def string(offset: int) -> str:
        start = strtab[4] + offset
        return data[start:data.index(b"\0", start)].decode()
    needed, soname = [], ""
    for k in range(dynamic[5] // 16):
        tag, val = struct.unpack_from("<qQ", data, dynamic[4] + 16 * k)
        if tag == 1:
            needed.append(string(val))
        elif tag == 14:
            soname = string(val)
    return needed, soname


def test_soname_and_dependencies() -> None:
    needed, soname = _dynamic_entries(mock.library_path())
    assert soname == "libnvidia-ml.so.1"
    assert not [n for n in needed if "python" in n]
    assert b"PyInit_" not in mock.library_path().read_bytes()


def test_pynvml_resolves_the_mock_by_soname(nvml: Any) -> None:
    pynvml = nvml("dgx-h100")
    assert pynvml.nvmlDeviceGetCount() == 8
    mapped = {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "libnvidia-ml" in line
    }
    assert mapped == {str(mock.library_path())}


C_PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
typedef struct nvmlDevice_st *nvmlDevice_t;
int main(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) { printf("dlopen failed: %s\n", dlerror()); return 1; }
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*count)(unsigned *) = (int (*)(unsigned *))dlsym(h, "nvmlDeviceGetCount_v2");
    typedef int (*by_index_t)(unsigned, nvmlDevice_t *);
    typedef int (*name_t)(nvmlDevice_t, char *, unsigned);
    by_index_t byIndex = (by_index_t)dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    name_t name = (name_t)dlsym(h, "nvmlDeviceGetName");
    int (*shutdown)(void) = (int (*)(void))dlsym(h, "nvmlShutdown");
    unsigned n = 0;
    char buf[96];
    nvmlDevice_t dev;
    if (init() || count(&n) || byIndex(0, &dev) || name(dev, buf, sizeof buf)) return 2;
    printf("%u %s\n", n, buf);
    return shutdown();
}
"""


def test_c_program_reaches_the_mock_through_dlopen(tmp_path: Path) -> None:
    src = tmp_path / "probe.c"
    src.write_text(C_PROGRAM)
    exe = tmp_path / "probe"
    subprocess.run([shutil.which("cc") or "gcc", "-o", str(exe), str(src), "-ldl"], check=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(mock.library_path().parent)
    env[mock.PROFILE_ENV] = str(mock.profile_path("gb200-nvl72-node"))
    out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True).stdout
    assert out == "4 NVIDIA GB200\n"


def test_internal_symbols_are_hidden(lib: ctypes.CDLL) -> None:
    for name in ("json_parse", "mock_load_profile", "g_mock"):
        with pytest.raises(AttributeError):
            getattr(lib, name)
    assert lib.nvmlInit_v2 is not None and lib.mocknvml_control is not None
