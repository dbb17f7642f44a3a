"""dradriver: a Kubernetes DRA driver for NVIDIA GPUs, drop-in for NVIDIA's kubelet plugins.

Layers, top to bottom (enforced by import-linter, see pyproject.toml):
``cli``/``commands`` -> ``sandbox`` -> ``app`` (one composition per binary) -> ``server`` (thin gRPC) ->
``kubeletplugin`` (batch runner, lifecycle, guard) -> ``preparers`` | ``health`` (device kinds, device health) ->
{``nvml``, ``kube``, ``host``, ``allocator``} (boundaries) -> ``domain`` (pure model) -> ``_native``
(compiled hot paths). The plugins' names live in :mod:`dradriver.domain.identity`.

Citations in docstrings: "NVIDIA's ``cmd/...``" (also ``pkg/``, ``api/``, ``templates/``) is a path in NVIDIA's
driver, kubernetes-sigs/dra-driver-nvidia-gpu (formerly NVIDIA/k8s-dra-driver-gpu) at v0.5.0, and ``ksigs#N`` an
issue or pull request there; ``pkg/kubelet/...`` is in kubernetes/kubernetes, ``pkg/apis/...`` in kubernetes/kubelet,
``kubeletplugin/``, ``resourceslice/``, ``cel/`` and ``structured/`` in k8s.io/dynamic-resource-allocation.
"""

__version__ = "0.1.0"
