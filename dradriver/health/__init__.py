"""Device health of the GPU plugin: ``monitor`` (NVML events and polls into device taints and the kubelet's
health stream) and ``metrics`` (the Prometheus metrics and their endpoint)."""
