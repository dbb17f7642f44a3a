"""Composition roots: one short module per binary, wiring only, built from the start steps in
:mod:`dradriver.app.assembly` (the steps both kubelet plugins share: API connection and host directories, claim
state, adoption and recovery, metrics, gRPC servers, ResourceSlice publisher, Events).

``gpu``: the ``gpu.nvidia.com`` kubelet plugin (``dradriver gpu-kubelet-plugin``); ``computedomain``: the
``compute-domain.nvidia.com`` kubelet plugin (``dradriver compute-domain-kubelet-plugin``);
``computedomaincontroller``: the ComputeDomain controller (``dradriver compute-domain-controller``).
The logic they compose lives in the rooms below: :mod:`dradriver.kubeletplugin` (batch runner, driver state,
device status, node policy, device refresher), :mod:`dradriver.preparers`, :mod:`dradriver.health`,
:mod:`dradriver.computedomain`.
"""

from dradriver.app.gpu import GpuPlugin, run_plugin, start_plugin

__all__ = ["GpuPlugin", "run_plugin", "start_plugin"]
