"""Use cases of the kubelet plugin: prepare and unprepare claims, publish resources, guard the node.

Sits between the thin gRPC layer (``dradriver.server``) and the boundaries (``dradriver.nvml``,
``dradriver.kube``) and the domain model.
"""
