"""The domain model: devices, claims, CDI specs, claim state, ResourceSlice content.

Pure Python over plain data. Nothing here opens a socket, calls NVML or talks to the Kubernetes API;
that is what ``dradriver.nvml`` and ``dradriver.kube`` are for. File writes of claim state and CDI specs
go through small, explicit functions so the crash-safety rules live next to the data they protect.
"""
