"""Import only the parts of the ``kubernetes`` package a process uses (start-up time, issue 17).

The official client's package ``__init__`` imports every subpackage eagerly (``client``, ``config``,
``dynamic`` with ``jsonschema`` and ``kubernetes_validate``, ``watch``, ``stream``, ``utils``,
``leaderelection``, ``informer``): about 0.2 s of CPU before the first request, most of it for parts the
driver never calls (it uses ``client`` and ``config`` only, :mod:`dradriver.kube.client`).

:func:`defer_kubernetes_subpackages` registers the package module without running that ``__init__``; each
subpackage is then imported on first use, by an ``import kubernetes.<name>`` or by the attribute access
``kubernetes.<name>`` (a module ``__getattr__``, PEP 562), so code written against the eager package behaves
the same. ``__version__`` comes from the installed distribution's metadata. Only the commands that run a
long-lived component call it, first thing; a process that imported ``kubernetes`` already is left alone.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from types import ModuleType

__all__ = ["EAGER_SUBPACKAGES", "defer_kubernetes_subpackages", "is_deferred"]

EAGER_SUBPACKAGES = ("client", "config", "dynamic", "watch", "stream", "utils", "leaderelection", "informer")
"""What the package's own ``__init__`` imports (kubernetes 31-37)."""


def defer_kubernetes_subpackages() -> bool:
    """Register ``kubernetes`` with its subpackages imported on first use; False (nothing done) when the
    package is already imported or not installed as a regular package."""
    if "kubernetes" in sys.modules:
        return False
    spec = importlib.util.find_spec("kubernetes")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return False
    module = importlib.util.module_from_spec(spec)  # __path__, __spec__ and the loader set; __init__ not run

    def __getattr__(name: str) -> object:
        if name in EAGER_SUBPACKAGES:
            return importlib.import_module(f"kubernetes.{name}")
        if name == "__version__":
            return importlib.metadata.version("kubernetes")
        if name == "__project__":
            return "kubernetes"
        raise AttributeError(f"module 'kubernetes' has no attribute {name!r}")

    setattr(module, "__getattr__", __getattr__)  # noqa: B010 (a module attribute by name, PEP 562)
    sys.modules["kubernetes"] = module
    return True


def is_deferred(module: ModuleType | None = None) -> bool:
    """True when ``kubernetes`` was registered by :func:`defer_kubernetes_subpackages`."""
    module = module or sys.modules.get("kubernetes")
    return module is not None and "__getattr__" in vars(module)
