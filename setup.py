"""Build declarations for the compiled parts of dradriver; everything else lives in pyproject.toml.

Each entry of ``ext/`` becomes one module under ``dradriver/_native/`` (Cython hot paths) or, for the
mock NVML library used by tests and ``--mock-profile``, a plain C shared library.

Environment knobs:
  DRADRIVER_NO_EXTENSIONS=1  build no Cython extension (the pure-Python twins are then selected
                             explicitly at run time with the same variable).
  DRADRIVER_DEBUG=1          -O0 -g and Cython line tracing.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tools import build_support

setup(
    ext_modules=build_support.extensions(
        no_extensions=os.environ.get("DRADRIVER_NO_EXTENSIONS") == "1",
        debug=os.environ.get("DRADRIVER_DEBUG") == "1",
    ),
    cmdclass=build_support.cmdclass(),
)
