"""Extension declarations for setup.py.

Kept out of setup.py so each compiled part is declared in one place and the list stays readable.
Cython hot paths: add the module's name to :data:`CYTHON_MODULES` (source ``ext/<name>.pyx``, module
``dradriver._native.<name>``, twin ``dradriver/_native/<name>_py.py``). Other compiled parts (the mock
NVML library) are declared in :func:`extensions`.
"""

from __future__ import annotations

from typing import Any

from setuptools import Extension
from setuptools.command.build_ext import build_ext

CYTHON_MODULES: list[str] = [
    "nvmlpoll",
    "claimstore",
    "cdispec",
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


def extensions(*, no_extensions: bool, debug: bool) -> list[Extension]:
    """Return every extension to build.

    :param no_extensions: skip the Cython hot paths (the mock NVML library is always built: tests need it).
    :param debug: compile with ``-O0 -g``.
    """
    exts: list[Extension] = []
    if not no_extensions:
        exts.extend(_cython_extensions(debug=debug))
    return exts


def cmdclass() -> dict[str, Any]:
    """Custom build commands (none beyond setuptools' own yet)."""
    return {"build_ext": build_ext}
