"""Composition roots: one short module per binary, built from the parts in :mod:`dradriver.app.assembly`.

``gpu``: the ``gpu.nvidia.com`` kubelet plugin (``dradriver gpu-kubelet-plugin``).
"""

from dradriver.app.gpu import GpuPlugin, run_plugin, start_plugin

__all__ = ["GpuPlugin", "run_plugin", "start_plugin"]
