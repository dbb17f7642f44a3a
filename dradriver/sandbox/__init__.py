"""Emulators of a cluster and its GPU nodes, for the tests, ``dradriver demo`` and ``dradriver sandbox``: the
real plugin runs against them over real HTTP and gRPC sockets, on the mock NVML library.

:mod:`.apiserver` (a Kubernetes API server over HTTP), :mod:`.kubelet` (the kubelet's side of registration and
the DRA node API), :mod:`.scheduler` (pending claims allocated with :mod:`dradriver.allocator`),
:mod:`.workloads` (a Deployment controller and a container runner), :mod:`.podresources` (the kubelet's
PodResources API); :mod:`.node` (one sandboxed GPU node: directories, procfs fixtures, config),
:mod:`.cluster` (the one-node cluster of ``dradriver sandbox``) and :mod:`.multinode` (racks of emulated GB200
NVL72 nodes with a DaemonSet controller); :mod:`.profiles` (mock NVML node profiles derived for scenarios),
:mod:`.nvidia_smi` (the driver root's ``nvidia-smi``), :mod:`.standins` (node programs: MPS control, the CDI hook,
IMEX, ``mount``), :mod:`.nvidiapeer` (NVIDIA's own plugin as a peer on a node). ``dradriver demo``'s scenarios
live in :mod:`.demos`.
"""
