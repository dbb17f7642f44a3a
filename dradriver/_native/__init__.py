"""Runtime home of the compiled hot paths (sources in ``ext/``) and their pure-Python twins.

:func:`load` picks the implementation of one module in one place. The compiled module is the default;
``DRADRIVER_NO_EXTENSIONS=1`` selects the twin explicitly. A compiled module that fails to import is a
loud :class:`~dradriver.errors.ExtensionMissingError`, never a silent fall-back to the slow path.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from dradriver.errors import ExtensionMissingError


def use_extensions() -> bool:
    """False when ``DRADRIVER_NO_EXTENSIONS=1`` asks for the pure-Python twins."""
    return os.environ.get("DRADRIVER_NO_EXTENSIONS", "") != "1"


def load(name: str) -> ModuleType:
    """Return ``dradriver._native.<name>`` (compiled) or ``dradriver._native.<name>_py`` (twin).

    :raises ExtensionMissingError: the compiled module is wanted but cannot be imported.
    """
    if not use_extensions():
        return importlib.import_module(f"{__name__}.{name}_py")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:
        raise ExtensionMissingError(
            f"compiled module dradriver._native.{name} is missing ({exc}); rebuild with "
            "`python -m pip install -e .` or set DRADRIVER_NO_EXTENSIONS=1 to run the pure-Python twin"
        ) from exc


MODULES: tuple[str, ...] = ("nvmlpoll", "cdispec", "claimstore")
"""Every hot path with a compiled module in ``ext/`` and a pure-Python twin."""


def load_all() -> dict[str, str]:
    """Load every module of :data:`MODULES` now (at program start); returns name -> ``"c"``/``"py"``.

    :raises ExtensionMissingError: a compiled module is wanted but cannot be imported.
    """
    return {name: ("py" if load(name).__name__.endswith("_py") else "c") for name in MODULES}


def implementation(name: str) -> str:
    """``"c"`` or ``"py"``: which implementation :func:`load` returns for ``name``."""
    module = load(name)
    return "py" if module.__name__.endswith("_py") else "c"
