"""dradriver: a Kubernetes DRA driver for NVIDIA GPUs, drop-in for NVIDIA's kubelet plugins.

Layers, top to bottom (enforced by import-linter, see pyproject.toml):
``cli``/``commands`` -> ``sandbox`` -> ``app`` (one composition per binary) -> ``server`` (thin gRPC) ->
``kubeletplugin`` (batch runner, lifecycle, guard) -> ``preparers`` | ``health`` (device kinds, device health) ->
{``nvml``, ``kube``, ``host``, ``allocator``} (boundaries) -> ``domain`` (pure model) -> ``_native``
(compiled hot paths). The plugins' names live in :mod:`dradriver.domain.identity`.
"""

__version__ = "0.1.0"
