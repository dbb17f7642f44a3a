"""Who uses a device: the pod container and the ResourceClaim through which it holds it.

Both sides of the metrics' attribution speak this: the kubelet's PodResources answer
(:func:`dradriver.server.podresources.holders`: pod, container and claim) and the kubelet plugin's own prepared
claims (claim only). Pure data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceHolder:
    """One user of a DRA device.

    :param pod: the pod's name; empty when only the claim is known (the kubelet plugin knows claims, not pods).
    :param namespace: the pod's namespace (empty with ``pod``).
    :param container: the container that references the claim (empty with ``pod``).
    :param claim_name: the ResourceClaim's name; ``claim_namespace``: its namespace.
    :param pool: the ResourceSlice pool the device is listed in (for ``gpu.nvidia.com``: the node's name); empty
        when it is this node's own pool.
    """

    pod: str
    namespace: str
    container: str
    claim_name: str
    claim_namespace: str
    pool: str = ""

    @classmethod
    def of_claim(cls, claim_namespace: str, claim_name: str) -> DeviceHolder:
        """A holder known by its claim only."""
        return cls("", "", "", claim_name, claim_namespace)
