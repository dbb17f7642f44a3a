"""Import only the parts of the ``kubernetes`` package a process uses (start-up time, issue 17).

The official client's package ``__init__`` imports every subpackage eagerly (``client``, ``config``,
``dynamic`` with ``jsonschema`` and ``kubernetes_validate``, ``watch``, ``stream``, ``utils``,
``leaderelection``, ``informer``): about 0.2 s of CPU before the first request, most of it for parts the
driver never calls (it uses ``client`` and ``config`` only, :mod:`dradriver.kube.client`).

:func:`defer_kubernetes_subpackages` registers the package module without running that ``__init__``; each
subpackage is then imported on first use, by an ``import kubernetes.<name>`` or by the attribute access
``kubernetes.<name>`` (a module ``__getattr__``, PEP 562), so code written against the eager package behaves
the same. ``__version__`` comes from the installed distribution's metadata. Only the commands that run a
long-lived component call it, first thing (the two kubelet plugins, the compute-domain daemon and controller); a
process that imported ``kubernetes`` already is left alone.

``kubernetes.config`` is deferred the same way, one level down: its ``__init__`` imports ``kube_config``, which
imports ``oauthlib``, ``requests_oauthlib`` (with ``requests``) and ``google.auth`` for kubeconfig auth providers
a DaemonSet never uses. ``load_incluster_config`` and ``ConfigException`` are taken from their own modules
(``incluster_config``, ``config_exception``); any other name (``load_kube_config``, ``new_client_from_config``,
``load_config``, ...) runs the package's own ``__init__`` once and is then found as before. A plugin started with
the in-cluster service account (the DaemonSet) so imports none of those: the GPU plugin's import path up to the
in-cluster load takes 48.1-48.2 MiB RSS and 0.29-0.39 s CPU instead of 62.2-62.3 MiB and 0.41-0.43 s
(``docs/benchmarks.md``, "``vs_nvidia``: the memory floor").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from types import ModuleType

__all__ = ["EAGER_SUBPACKAGES", "defer_kubernetes_subpackages", "is_deferred"]

EAGER_SUBPACKAGES = ("client", "config", "dynamic", "watch", "stream", "utils", "leaderelection", "informer")
"""What the package's own ``__init__`` imports (kubernetes 31-37)."""

CONFIG_NAMES = {"load_incluster_config": "incluster_config", "ConfigException": "config_exception"}
"""Names of ``kubernetes.config`` taken from their own module without the package's ``__init__``."""


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
    _defer_config()
    return True


def _defer_config() -> None:
    """Register ``kubernetes.config`` without running its ``__init__`` (see the module docstring)."""
    spec = importlib.util.find_spec("kubernetes.config")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    loader = spec.loader
    module = importlib.util.module_from_spec(spec)
    ran = threading.Lock()
    done: list[bool] = []

    def __getattr__(name: str) -> object:
        part = CONFIG_NAMES.get(name)
        if part is not None:
            return getattr(importlib.import_module(f"kubernetes.config.{part}"), name)
        if not name.startswith("__"):
            with ran:
                if not done:
                    loader.exec_module(module)  # the package's own __init__: defines every public name
                    done.append(True)
            found = vars(module).get(name)
            if found is not None:
                return found
        raise AttributeError(f"module 'kubernetes.config' has no attribute {name!r}")

    setattr(module, "__getattr__", __getattr__)  # noqa: B010 (a module attribute by name, PEP 562)
    sys.modules["kubernetes.config"] = module


def is_deferred(module: ModuleType | None = None) -> bool:
    """True when ``kubernetes`` was registered by :func:`defer_kubernetes_subpackages`."""
    module = module or sys.modules.get("kubernetes")
    return module is not None and "__getattr__" in vars(module)
