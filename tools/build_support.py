"""Extension declarations for setup.py.

Kept out of setup.py so each compiled part is declared in one place and the list stays readable.
Contributors add their extension to :func:`extensions`.
"""

from __future__ import annotations

from typing import Any

from setuptools import Extension
from setuptools.command.build_ext import build_ext


def extensions(*, no_extensions: bool, debug: bool) -> list[Extension]:
    """Return every extension to build.

    :param no_extensions: skip the Cython hot paths (the mock NVML library is always built: tests need it).
    :param debug: compile with ``-O0 -g``.
    """
    exts: list[Extension] = []
    return exts


def cmdclass() -> dict[str, Any]:
    """Custom build commands (none beyond setuptools' own yet)."""
    return {"build_ext": build_ext}
