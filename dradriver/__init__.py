"""dradriver: a Kubernetes DRA driver for NVIDIA GPUs (driver name ``gpu.nvidia.com``).

Layers, top to bottom (enforced by import-linter, see pyproject.toml):
``cli``/``commands`` -> ``app`` -> ``server`` (thin gRPC) -> ``driver`` (use cases) ->
{``nvml``, ``kube``, ``allocator``} (boundaries) -> ``domain`` (pure model) -> ``_native`` (compiled hot paths).
"""

__version__ = "0.1.0"

DRIVER_NAME = "gpu.nvidia.com"
"""The DRA driver name; equals ``spec.driver`` of our ResourceSlices and allocation results."""
