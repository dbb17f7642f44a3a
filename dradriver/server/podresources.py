"""The kubelet's PodResources API, client side: which pod, container and ResourceClaim hold each DRA device.

``v1.PodResourcesLister/List`` on the kubelet's ``/var/lib/kubelet/pod-resources/kubelet.sock`` (upstream
``k8s.io/kubelet/pkg/apis/podresources/v1``; ``protos/podresources_v1.proto``). Every container's
``dynamic_resources`` name the claim (``claim_name``, ``claim_namespace``) and its devices
(``driver_name``, ``pool_name``, ``device_name``). dcgm-exporter reads the same call to attribute GPUs to pods
(``pod``, ``namespace``, ``container`` and the ``dra_*`` labels; NVIDIA/dcgm-exporter
``internal/pkg/transformation/kubernetes.go`` and ``dra.go``);
``dradriver exporter`` does too (both naming modes), so its series carry the same labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from dradriver._proto import podresources_v1_pb2, podresources_v1_pb2_grpc
from dradriver.domain.holders import DeviceHolder
from dradriver.errors import DradriverError

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
"""Where the kubelet serves the PodResources API."""


class PodResourcesError(DradriverError):
    """The PodResources socket did not answer (missing, refused, timed out); the message names the socket."""


def holders(response: Any, *, driver: str, pool: str | None) -> dict[str, tuple[DeviceHolder, ...]]:
    """Device name -> every container holding it, for the devices of ``driver`` in a ``ListPodResourcesResponse``.

    A device several containers use (one claim referenced by two pods or containers, or several claims sharing
    it) lists each of them once, in the order the kubelet listed them: dcgm-exporter writes one series per
    pod/container using a device (its ``toDeviceToSharingPods``, NVIDIA/dcgm-exporter PR #432), and so do the
    collectors fed from this map.

    :param pool: keep only devices of this pool (the node's name); ``None`` keeps every pool (a kubelet lists
        only its own node's pods, so a node-local driver's devices are this node's whatever the pool is called).
    """
    out: dict[str, list[DeviceHolder]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for dynamic in container.dynamic_resources:
                for resource in dynamic.claim_resources:
                    if resource.driver_name != driver or not resource.device_name:
                        continue
                    if pool is not None and resource.pool_name != pool:
                        continue
                    holder = DeviceHolder(pod.name, pod.namespace, container.name, dynamic.claim_name,
                                          dynamic.claim_namespace or pod.namespace, resource.pool_name)
                    listed = out.setdefault(resource.device_name, [])
                    if holder not in listed:
                        listed.append(holder)
    return {device: tuple(found) for device, found in out.items()}


def list_holders(socket_path: str, *, driver: str, pool: str | None,
                 timeout_s: float = 5.0) -> dict[str, tuple[DeviceHolder, ...]]:
    """Call ``List`` once and return :func:`holders` of its answer.

    :raises PodResourcesError: the socket did not answer within ``timeout_s`` seconds.
    """
    try:
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            stub = podresources_v1_pb2_grpc.PodResourcesListerStub(channel)
            response = stub.List(podresources_v1_pb2.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        raise PodResourcesError(f"PodResources List on {socket_path}: {getattr(code, 'name', code)}: {detail}"
                                ) from exc
    return holders(response, driver=driver, pool=pool)


def encode_response(pods: Iterable[tuple[str, str, str, str, str, Iterable[tuple[str, str, str]]]]) -> Any:
    """A ``ListPodResourcesResponse`` from ``(pod, namespace, container, claim, claim namespace,
    [(driver, pool, device), ...])`` rows (for a kubelet emulator serving the API)."""
    response = podresources_v1_pb2.ListPodResourcesResponse()
    by_pod: dict[tuple[str, str], Any] = {}
    for pod, namespace, container, claim, claim_namespace, devices in pods:
        entry = by_pod.get((namespace, pod))
        if entry is None:
            entry = response.pod_resources.add(name=pod, namespace=namespace)
            by_pod[(namespace, pod)] = entry
        target = next((c for c in entry.containers if c.name == container), None) or entry.containers.add(
            name=container)
        dynamic = target.dynamic_resources.add(claim_name=claim, claim_namespace=claim_namespace)
        for driver, pool, device in devices:
            dynamic.claim_resources.add(driver_name=driver, pool_name=pool, device_name=device)
    return response
