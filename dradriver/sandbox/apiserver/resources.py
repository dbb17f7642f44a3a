"""Per-resource behaviour: the resource types table, ``generateName``, the ``status`` subresource, the
garbage collector's owner references, and seeded Nodes."""

from __future__ import annotations

import copy
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

JSONDict = dict[str, Any]

# generateName suffix alphabet and length, as in k8s.io/apiserver/pkg/storage/names (utilrand.String(5)).
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_NAME_SUFFIX_LEN = 5
# Fields only the server sets: dropped from a create body, carried over from the stored object on update.
CREATE_SERVER_FIELDS = (
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "deletionTimestamp",
    "generation",
    "selfLink",
    "managedFields",
)
UPDATE_SERVER_FIELDS = ("uid", "creationTimestamp", "generation", "deletionTimestamp")


@dataclass(frozen=True, slots=True)
class ResourceType:
    """One REST resource the emulator serves.

    :param status: the resource has a ``status`` subresource (main-resource writes keep the old status).
    :param field_labels: field-selector labels accepted besides ``metadata.name`` and ``metadata.namespace``.
    :param keep_status_on_create: HTTP create keeps ``status`` (Nodes are created with status by the kubelet).
    :param custom: a custom resource (no built-in OpenAPI schema to validate against).
    :param schema: for a type registered by a CustomResourceDefinition, its
        :class:`~dradriver.sandbox.apiserver.crds.CustomSchema` (pruning, defaults, validation); ``None`` for
        built-in types and custom types served without a CRD. Not part of equality: a CRD that replaces a
        type's schema keeps the objects stored under it.
    """

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    status: bool = False
    field_labels: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()
    keep_status_on_create: bool = False
    custom: bool = False
    schema: Any = field(default=None, compare=False, hash=False)

    @property
    def api_version(self) -> str:
        """``apiVersion`` of objects of this resource (``v1`` or ``<group>/<version>``)."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``<plural>.<group>`` as error messages spell it (just ``<plural>`` for the core group)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        """``<Kind>.<group>`` as validation messages spell it."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


RESOURCE_TYPES: tuple[ResourceType, ...] = (
    ResourceType(
        "",
        "v1",
        "namespaces",
        "namespace",
        "Namespace",
        False,
        status=True,
        field_labels=("status.phase",),
        short_names=("ns",),
        keep_status_on_create=True,
    ),
    ResourceType(
        "",
        "v1",
        "nodes",
        "node",
        "Node",
        False,
        status=True,
        field_labels=("spec.unschedulable",),
        short_names=("no",),
        keep_status_on_create=True,
    ),
    ResourceType(
        "",
        "v1",
        "pods",
        "pod",
        "Pod",
        True,
        status=True,
        field_labels=(
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ),
        short_names=("po",),
    ),
    ResourceType(
        "",
        "v1",
        "events",
        "event",
        "Event",
        True,
        field_labels=(
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ),
        short_names=("ev",),
    ),
    ResourceType("", "v1", "configmaps", "configmap", "ConfigMap", True, short_names=("cm",)),
    ResourceType("", "v1", "serviceaccounts", "serviceaccount", "ServiceAccount", True, short_names=("sa",)),
    ResourceType("rbac.authorization.k8s.io", "v1", "clusterroles", "clusterrole", "ClusterRole", False),
    ResourceType("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "clusterrolebinding",
                 "ClusterRoleBinding", False),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "role", "Role", True),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "rolebinding", "RoleBinding", True),
    ResourceType(
        "events.k8s.io",
        "v1",
        "events",
        "event",
        "Event",
        True,
        field_labels=(
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "reason",
            "reportingController",
            "type",
        ),
        short_names=("ev",),
    ),
    ResourceType("apps", "v1", "deployments", "deployment", "Deployment", True, status=True, short_names=("deploy",)),
    ResourceType("apps", "v1", "daemonsets", "daemonset", "DaemonSet", True, status=True, short_names=("ds",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "lease", "Lease", True),
    ResourceType("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations",
                 "validatingwebhookconfiguration", "ValidatingWebhookConfiguration", False),
    ResourceType("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", "validatingadmissionpolicy",
                 "ValidatingAdmissionPolicy", False, status=True),
    ResourceType("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings",
                 "validatingadmissionpolicybinding", "ValidatingAdmissionPolicyBinding", False),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "customresourcedefinition",
                 "CustomResourceDefinition", False, status=True, short_names=("crd", "crds")),
    ResourceType("resource.nvidia.com", "v1beta1", "computedomains", "computedomain", "ComputeDomain", True,
                 status=True, custom=True),
    ResourceType("resource.nvidia.com", "v1beta1", "computedomaincliques", "computedomainclique",
                 "ComputeDomainClique", True, custom=True),
    ResourceType("resource.k8s.io", "v1", "deviceclasses", "deviceclass", "DeviceClass", False),
    ResourceType(
        "resource.k8s.io", "v1", "resourceclaims", "resourceclaim", "ResourceClaim", True, status=True
    ),
    ResourceType(
        "resource.k8s.io",
        "v1",
        "resourceclaimtemplates",
        "resourceclaimtemplate",
        "ResourceClaimTemplate",
        True,
    ),
    ResourceType(
        "resource.k8s.io",
        "v1",
        "resourceslices",
        "resourceslice",
        "ResourceSlice",
        False,
        field_labels=("spec.nodeName", "spec.driver"),
    ),
)


def find_resource_type(
    types: Iterable[ResourceType], kind: str, api_version: str | None = None
) -> ResourceType:
    """The resource named by kind, plural, singular, ``plural.group`` or short name.

    :raises KeyError: unknown resource.
    """
    for rt in types:
        if api_version is not None and rt.api_version != api_version:
            continue
        if kind in (rt.kind, rt.plural, rt.singular, rt.group_resource, *rt.short_names):
            return rt
    raise KeyError(f"the emulator serves no resource {kind!r}" + (f" in {api_version}" if api_version else ""))


def now() -> str:
    """The current time as ``metav1.Time`` writes it (RFC 3339, seconds, UTC)."""
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def generate_name(base: str) -> str:
    """``names.SimpleNameGenerator``: the base cut to 63 - 5 characters, then 5 random characters."""
    return base[: 63 - _NAME_SUFFIX_LEN] + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(_NAME_SUFFIX_LEN))


def write_status_subresource(old: JSONDict, new: JSONDict) -> JSONDict:
    """A PUT on ``.../status``: the stored object with only ``status`` taken from ``new``."""
    merged = copy.deepcopy(old)
    if "status" in new:
        merged["status"] = new["status"]
    else:
        merged.pop("status", None)
    return merged


def keep_stored_status(rt: ResourceType, old: JSONDict, new: JSONDict) -> None:
    """A main-resource write of a resource with a status subresource keeps the stored ``status``."""
    if not rt.status:
        return
    if "status" in old:
        new["status"] = copy.deepcopy(old["status"])
    else:
        new.pop("status", None)


def spec_changed(old: JSONDict, new: JSONDict) -> bool:
    """Anything outside ``metadata`` and ``status`` changed (the server then bumps ``generation``)."""
    return any(new.get(k) != old.get(k) for k in set(new) | set(old) if k not in ("metadata", "status"))


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    """``obj`` names ``owner_uid`` in its ``ownerReferences`` (the garbage collector deletes it with its owner)."""
    return any(ref.get("uid") == owner_uid for ref in (obj["metadata"].get("ownerReferences") or []))


def node_object(name: str, allocatable: Mapping[str, str], labels: Mapping[str, str]) -> JSONDict:
    """A Ready Node as the kubelet registers it, with ``status.allocatable`` and ``status.capacity``."""
    alloc = dict(allocatable)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "spec": {},
        "status": {
            "allocatable": alloc,
            "capacity": dict(alloc),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "lastHeartbeatTime": now(),
                    "lastTransitionTime": now(),
                }
            ],
        },
    }


def without_type(obj: JSONDict) -> JSONDict:
    """A copy without ``apiVersion`` and ``kind`` (list items are written that way)."""
    out = copy.deepcopy(obj)
    out.pop("apiVersion", None)
    out.pop("kind", None)
    return out
