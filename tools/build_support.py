"""Extension declarations for setup.py.

Kept out of setup.py so each compiled part is declared in one place and the list stays readable.
Cython hot paths: add the module's name to :data:`CYTHON_MODULES` (source ``ext/<name>.pyx``, module
``dradriver._native.<name>``, twin ``dradriver/_native/<name>_py.py``). Other compiled parts (the mock
NVML library) are declared in :func:`extensions`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from setuptools import Extension
from setuptools.command.build_ext import build_ext

MOCK_NVML_EXTENSION = "dradriver.nvml._mock.libnvidia_ml"
"""The mock NVML C library (``ext/mocknvml/``); built as ``dradriver/nvml/_mock/libnvidia-ml.so.1``."""
MOCK_NVML_FILENAME = "libnvidia-ml.so.1"
MOCK_NVFM_EXTENSION = "dradriver.host._mock.libnvfm"
"""The mock Fabric Manager SDK library (``ext/mocknvfm/``); built as ``dradriver/host/_mock/libnvfm.so.1``."""
MOCK_NVFM_FILENAME = "libnvfm.so.1"
_MOCK_LIBRARIES = {MOCK_NVML_EXTENSION: MOCK_NVML_FILENAME, MOCK_NVFM_EXTENSION: MOCK_NVFM_FILENAME}

CYTHON_MODULES: list[str] = [
    "nvmlpoll",
    "claimstore",
    "cdispec",
    "kubeletchecksum",
]
"""Cython hot paths in ``ext/``; each is independent (they share only extern ``.pxd`` files)."""


def _cython_extensions(*, debug: bool) -> list[Extension]:
    from Cython.Build import cythonize

    cflags = ["-O0", "-g"] if debug else ["-O2"]
    exts = [
        Extension(f"dradriver._native.{name}", [f"ext/{name}.pyx"], extra_compile_args=cflags)
        for name in CYTHON_MODULES
    ]
    directives = {"language_level": "3", "embedsignature": True}
    if debug:
        directives["linetrace"] = True
    result: list[Extension] = cythonize(exts, include_path=["ext"], compiler_directives=directives, quiet=True)
    return result


def nvml_include_dir() -> str:
    """Directory holding the official ``nvml.h`` of the installed ``nvidia-nvml-dev`` wheel (a build requirement).

    :raises RuntimeError: the wheel is not installed in the build environment.
    """
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for header in sorted(Path(root).glob("*/include/nvml.h"), reverse=True):  # cu13 before cu12
            return str(header.parent)
    raise RuntimeError("nvml.h not found: install the nvidia-nvml-dev package (a build requirement)")


def _mock_nvml_extension(*, debug: bool) -> Extension:
    """The mock ``libnvidia-ml.so.1``: plain C, no Python API, SONAME ``libnvidia-ml.so.1``.

    Linked ``-Bsymbolic`` so that each copy a process maps (a driver reload opens the new driver's file beside the
    old one) calls its own entry points, as NVIDIA's library does, instead of the first copy's."""
    src = sorted(str(p) for p in Path("ext/mocknvml").glob("*.c"))
    return Extension(
        MOCK_NVML_EXTENSION,
        src,
        include_dirs=["ext/mocknvml", nvml_include_dir()],
        extra_compile_args=["-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wextra"]
        + (["-O0", "-g"] if debug else ["-O2"]),
        extra_link_args=[f"-Wl,-soname,{MOCK_NVML_FILENAME}", "-Wl,-Bsymbolic", "-pthread"],
    )


def _mock_nvfm_extension(*, debug: bool) -> Extension:
    """The mock ``libnvfm.so.1`` (NVIDIA's Fabric Manager SDK ABI): plain C, no Python API, SONAME ``libnvfm.so.1``."""
    return Extension(
        MOCK_NVFM_EXTENSION,
        sorted(str(p) for p in Path("ext/mocknvfm").glob("*.c")),
        include_dirs=["ext/mocknvfm"],
        extra_compile_args=["-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wextra"]
        + (["-O0", "-g"] if debug else ["-O2"]),
        extra_link_args=[f"-Wl,-soname,{MOCK_NVFM_FILENAME}", "-Wl,-Bsymbolic", "-pthread"],
    )


def extensions(*, no_extensions: bool, debug: bool) -> list[Extension]:
    """Return every extension to build.

    :param no_extensions: skip the Cython hot paths (the mock NVML and Fabric Manager libraries are always built:
        tests need them).
    :param debug: compile with ``-O0 -g``.
    """
    exts: list[Extension] = [_mock_nvml_extension(debug=debug), _mock_nvfm_extension(debug=debug)]
    if not no_extensions:
        exts.extend(_cython_extensions(debug=debug))
    return exts


class BuildExt(build_ext):
    """``build_ext`` that names the mock libraries ``libnvidia-ml.so.1`` and ``libnvfm.so.1`` (no Python extension
    suffix).

    Both the in-place (editable install) and the wheel paths go through :meth:`get_ext_filename`, so the file
    lands in ``dradriver/nvml/_mock/`` in either case.
    """

    def get_ext_filename(self, fullname: str) -> str:
        for extension, filename in _MOCK_LIBRARIES.items():
            if fullname == extension:
                return os.path.join(*fullname.split(".")[:-1], filename)
            if fullname == extension.rsplit(".", 1)[1]:
                return filename
        result: str = super().get_ext_filename(fullname)
        return result

    def copy_extensions_to_source(self) -> None:
        # the mocks' directories hold no Python module, so nothing else creates them before the in-place copy
        for extension in _MOCK_LIBRARIES:
            package = extension.rsplit(".", 1)[0]
            Path(self.get_finalized_command("build_py").get_package_dir(package)).mkdir(parents=True, exist_ok=True)
        super().copy_extensions_to_source()


def cmdclass() -> dict[str, Any]:
    """Custom build commands: :class:`BuildExt` for the mock NVML library's file name."""
    return {"build_ext": BuildExt}
