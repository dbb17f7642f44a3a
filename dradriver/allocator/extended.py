"""DRA-backed extended resources (KEP-5004, ``DRAExtendedResource``, GA in Kubernetes 1.37).

A Pod that asks for an extended resource in its container resources (``nvidia.com/gpu: 1`` under
``limits``) with no ``resourceClaims`` still gets devices through DRA when a DeviceClass maps the resource.
Facts, from kube-scheduler's DynamicResources plugin (``pkg/scheduler/framework/plugins/dynamicresources``,
``extended/`` and ``extendedresource.go``) and ``k8s.io/api/resource/v1``:

* every DeviceClass maps its implicit name ``deviceclass.resource.kubernetes.io/<class name>``, and also
  ``spec.extendedResourceName`` when set; when several classes map one name, the newest
  (``metadata.creationTimestamp``) wins, then the lowest class name;
* a node whose ``status.allocatable`` offers the resource (a device plugin) serves it the classic way; only
  resources no device plugin offers on the node go to DRA;
* the scheduler creates one claim per Pod for all of them: ``generateName: <pod>-extended-resources-``,
  annotation ``resource.kubernetes.io/extended-resource-claim: "true"``, owned by the Pod (controller,
  blockOwnerDeletion), one request per (container, resource) named ``container-<i>-request-<j>`` (``i``: the
  container's index in initContainers followed by containers; ``j``: the resource's index in the
  container's sorted request names) with ``exactly: {deviceClassName, allocationMode: ExactCount, count}``,
  requests sorted by name;
* it records the claim in ``pod.status.extendedResourceClaimStatus``: ``resourceClaimName`` and
  ``requestMappings[]`` of ``{containerName, resourceName, requestName}``.

Container requests default to their limits (API server defaulting), so a limit alone is a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dradriver.allocator.naming import generated_name
from dradriver.allocator.resources import InputError

DEVICE_CLASS_PREFIX = "deviceclass.resource.kubernetes.io/"
"""``resourceapi.ResourceDeviceClassPrefix``: the implicit extended resource name of a DeviceClass."""

EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
"""``resourceapi.ExtendedResourceClaimAnnotation``; its single valid value is ``"true"``."""

NATIVE_PREFIXES = ("hugepages-", "requests.", "attachable-volumes-")


def implicit_name(class_name: str) -> str:
    """``deviceclass.resource.kubernetes.io/<class name>``."""
    return DEVICE_CLASS_PREFIX + class_name


def is_extended_resource_name(name: str) -> bool:
    """True for an extended resource name (``vendor.example/thing``, not a ``kubernetes.io`` native one).

    Implicit DeviceClass names (:data:`DEVICE_CLASS_PREFIX`) count although their domain is a
    ``kubernetes.io`` subdomain.
    """
    if name.startswith(DEVICE_CLASS_PREFIX):
        return True
    if "/" not in name or name.startswith(NATIVE_PREFIXES):
        return False
    domain = name.split("/", 1)[0]
    return domain != "kubernetes.io" and not domain.endswith(".kubernetes.io")


def _created(obj: dict[str, Any]) -> float:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return 0.0
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def class_mapping(classes: list[dict[str, Any]]) -> dict[str, str]:
    """Extended resource name -> DeviceClass name, as the scheduler builds it (see the module docstring)."""
    chosen: dict[str, dict[str, Any]] = {}

    def better(new: dict[str, Any], old: dict[str, Any]) -> bool:
        if _created(new) == _created(old):
            return str(new["metadata"]["name"]) < str(old["metadata"]["name"])
        return _created(new) > _created(old)

    for obj in classes:
        name = str((obj.get("metadata") or {}).get("name"))
        chosen[implicit_name(name)] = obj
        explicit = (obj.get("spec") or {}).get("extendedResourceName")
        if explicit:
            old = chosen.get(str(explicit))
            if old is None or better(obj, old):
                chosen[str(explicit)] = obj
    return {resource: str(obj["metadata"]["name"]) for resource, obj in chosen.items()}


@dataclass(frozen=True)
class ContainerRequest:
    """One container's request for one extended resource.

    :param index: the container's index in initContainers followed by containers.
    :param request_index: the resource's index among the container's sorted request names.
    :param where: the field path (``spec.containers[0].resources.limits[nvidia.com/gpu]``).
    """

    index: int
    container: str
    resource: str
    count: int
    request_index: int
    where: str

    @property
    def request_name(self) -> str:
        """``container-<i>-request-<j>``."""
        return f"container-{self.index}-request-{self.request_index}"


def _integer(value: Any, where: str) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit():
        raise InputError(f"{where}: an extended resource must be a whole number, got {value!r}")
    return int(text)


def container_requests(pod: dict[str, Any], what: str) -> list[ContainerRequest]:
    """Every non-zero extended resource request of ``pod``'s init containers and containers.

    :raises InputError: a non-integer quantity, or requests and limits that differ (the API server refuses
        both for extended resources), naming the field.
    """
    spec = pod.get("spec") or {}
    out: list[ContainerRequest] = []
    containers = [("initContainers", c) for c in spec.get("initContainers") or []]
    containers += [("containers", c) for c in spec.get("containers") or []]
    positions: dict[str, int] = {}
    for index, (list_name, container) in enumerate(containers):
        position = positions.get(list_name, 0)
        positions[list_name] = position + 1
        if not isinstance(container, dict):
            continue
        resources = container.get("resources") or {}
        limits = {str(k): v for k, v in (resources.get("limits") or {}).items()}
        requests = {str(k): v for k, v in (resources.get("requests") or {}).items()}
        for name, value in limits.items():
            requests.setdefault(name, value)
        keys = sorted(requests)
        for name in keys:
            if not is_extended_resource_name(name):
                continue
            kind = "requests" if name in (resources.get("requests") or {}) else "limits"
            where = f"{what}: spec.{list_name}[{position}].resources.{kind}[{name}]"
            count = _integer(requests[name], where)
            if name in limits and _integer(limits[name], where) != count:
                raise InputError(f"{where}: requests and limits of an extended resource must be equal")
            if count:
                out.append(
                    ContainerRequest(index, str(container.get("name", "")), name, count, keys.index(name), where)
                )
    return out


@dataclass
class ExtendedPlan:
    """What the scheduler makes of one Pod's extended resources.

    :param claim: the generated ResourceClaim (v1 JSON), or ``None`` when nothing goes through DRA.
    :param mappings: ``requestMappings`` for ``pod.status.extendedResourceClaimStatus``.
    :param device_plugin: ``resource -> node names`` offering it in ``status.allocatable``.
    :param unserved: requests neither a DeviceClass nor a device plugin serves (the Pod stays pending).
    """

    claim: dict[str, Any] | None = None
    mappings: list[dict[str, str]] = field(default_factory=list)
    requests: list[ContainerRequest] = field(default_factory=list)
    device_plugin: dict[str, list[str]] = field(default_factory=dict)
    unserved: list[ContainerRequest] = field(default_factory=list)

    def status(self) -> dict[str, Any] | None:
        """``pod.status.extendedResourceClaimStatus`` once the claim exists."""
        if self.claim is None:
            return None
        return {"requestMappings": list(self.mappings), "resourceClaimName": self.claim["metadata"]["name"]}


def plan(
    pod: dict[str, Any],
    mapping: dict[str, str],
    allocatable: dict[str, dict[str, Any]],
    *,
    claim_name: str | None = None,
) -> ExtendedPlan:
    """The generated claim and request mappings for ``pod`` (module docstring).

    :param mapping: from :func:`class_mapping`.
    :param allocatable: ``node name -> status.allocatable`` of the Nodes known.
    :param claim_name: the name to give the claim (default: a stand-in for the API server's generated name).
    :raises InputError: see :func:`container_requests`.
    """
    meta = pod.get("metadata") or {}
    namespace, pod_name = str(meta.get("namespace") or "default"), str(meta.get("name"))
    requests = container_requests(pod, f"Pod {namespace}/{pod_name}")
    result = ExtendedPlan(requests=requests)
    node_name = (pod.get("spec") or {}).get("nodeName")
    dra: list[ContainerRequest] = []
    for request in requests:
        offering = [
            node for node, values in sorted(allocatable.items()) if _offered(values.get(request.resource))
        ]
        if offering:
            result.device_plugin[request.resource] = offering
        if node_name and node_name in offering:
            continue  # the node's device plugin serves it
        if request.resource in mapping:
            dra.append(request)
        elif not offering:
            result.unserved.append(request)
    if not dra:
        return result
    device_requests = sorted(
        (
            {
                "name": r.request_name,
                "exactly": {
                    "deviceClassName": mapping[r.resource],
                    "allocationMode": "ExactCount",
                    "count": r.count,
                },
            }
            for r in dra
        ),
        key=lambda item: str(item["name"]),
    )
    name = claim_name or generated_name(f"{pod_name}-extended-resources-", f"{namespace}/{pod_name}/extended")
    result.claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod_name,
                    "uid": str(meta.get("uid", "")),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"devices": {"requests": device_requests}},
    }
    result.mappings = [
        {"containerName": r.container, "resourceName": r.resource, "requestName": r.request_name}
        for r in sorted(dra, key=lambda r: (r.index, r.request_index))
    ]
    return result


def _offered(value: Any) -> bool:
    try:
        return value is not None and int(str(value)) > 0
    except ValueError:
        return False


def unserved_reason(request: ContainerRequest) -> str:
    """Why nothing serves ``request``, in the user's terms (for ``explain`` and failures)."""
    hint = ""
    if request.resource.startswith("nvidia.com/"):
        hint = (
            "; dradriver's gpu.nvidia.com DeviceClass in deploy/ maps nvidia.com/gpu "
            "(spec.extendedResourceName: nvidia.com/gpu)"
        )
    return (
        f"container {request.container!r} asks for {request.resource}: {request.count}, and nothing serves it: "
        f"no DeviceClass has spec.extendedResourceName {request.resource} (nor is it an implicit "
        f"{DEVICE_CLASS_PREFIX}<class> name of one) and no Node offers it in status.allocatable"
        f" (a device plugin){hint}"
    )
