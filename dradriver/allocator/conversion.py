"""resource.k8s.io objects of any served version, converted to the v1 shape the allocator reads.

The API server (Kubernetes 1.34+) serves ``resource.k8s.io`` in ``v1``, ``v1beta2`` and ``v1beta1`` and
converts between them losslessly (``pkg/apis/resource/v1beta1/conversion.go``; reference
``resource/v1/types.go`` in kubernetes/api). What differs from v1:

* ``v1beta1`` ``ResourceClaim``/``ResourceClaimTemplate``: a device request carries the exact-request fields
  (``deviceClassName``, ``selectors``, ``allocationMode``, ``count``, ``adminAccess``, ``tolerations``,
  ``capacity``) at its top level, next to ``firstAvailable``; v1 moves them under ``exactly``. A request with
  ``firstAvailable`` keeps it as is (its subrequests have the same fields in every version).
* ``v1beta1`` ``ResourceSlice``: each device wraps its fields in ``basic``; v1 lists them on the device.
* ``v1beta2``: the v1 shape already (``exactly``, flat devices).
* ``DeviceClass``: the same in all three versions.

Retired versions are refused with the reason, never read as empty objects: ``resource.k8s.io/v1alpha2``
(and ``v1alpha1``) is classic DRA (``ResourceClass``, ``resourceClassName``, ``parametersRef``,
``ResourceClaimParameters``, ``PodSchedulingContext``), removed in Kubernetes 1.31 in favour of structured
parameters; ``v1alpha3`` claims, classes and slices were last served by Kubernetes 1.32 (from 1.33 on
``v1alpha3`` holds only ``DeviceTaintRule``).
"""

from __future__ import annotations

import copy
from typing import Any

from dradriver.allocator.resources import InputError

GROUP = "resource.k8s.io"
SERVED_VERSIONS = ("v1", "v1beta2", "v1beta1")
"""Versions of ``resource.k8s.io`` a 1.34+ API server serves for claims, templates, classes and slices."""

CONVERTED_KINDS = ("ResourceClaim", "ResourceClaimTemplate", "DeviceClass", "ResourceSlice")

CLASSIC_KINDS = ("ResourceClass", "ResourceClaimParameters", "ResourceClassParameters", "PodSchedulingContext")
"""Kinds of classic DRA (``resource.k8s.io/v1alpha2``), removed in Kubernetes 1.31."""

EXACT_FIELDS = ("deviceClassName", "selectors", "allocationMode", "count", "adminAccess", "tolerations", "capacity")
"""Fields of a v1beta1 ``DeviceRequest`` that v1 moves under ``exactly`` (``ExactDeviceRequest``)."""

CLASSIC_REMOVED = (
    "classic DRA (resourceClassName, parametersRef, ResourceClass) was removed in Kubernetes 1.31; "
    "write a resource.k8s.io/v1 ResourceClaim with spec.devices.requests and a DeviceClass instead"
)


def as_mapping(value: Any) -> dict[str, Any]:
    """``value`` if it is a mapping, else an empty one (malformed fields are reported by the parsers)."""
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    """``value`` if it is a list, else an empty one."""
    return value if isinstance(value, list) else []


def describe_object(obj: dict[str, Any]) -> str:
    """``ResourceClaim default/name`` or ``DeviceClass name`` for messages."""
    meta = as_mapping(obj.get("metadata"))
    name = str(meta.get("name", "<unnamed>"))
    namespace = meta.get("namespace")
    kind = str(obj.get("kind", "<no kind>"))
    if kind in ("ResourceClaim", "ResourceClaimTemplate"):
        return f"{kind} {namespace or 'default'}/{name}"
    return f"{kind} {name}"


def is_resource_api(obj: dict[str, Any]) -> bool:
    """True if ``obj`` belongs to the ``resource.k8s.io`` group (any version)."""
    return str(obj.get("apiVersion", "")).startswith(GROUP + "/")


def to_v1(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` in ``resource.k8s.io/v1`` (a converted copy; v1 objects come back unchanged).

    Objects outside ``resource.k8s.io`` are returned as they are.

    :raises InputError: a retired version or kind (the message gives the reason and the replacement), an
        unknown version, or a v1beta1 request that sets both ``firstAvailable`` and exact-request fields.
    """
    if not is_resource_api(obj):
        return obj
    version = str(obj["apiVersion"]).split("/", 1)[1]
    kind = str(obj.get("kind", ""))
    what = f"{GROUP}/{version} {describe_object(obj)}"
    if kind in CLASSIC_KINDS or version in ("v1alpha1", "v1alpha2"):
        raise InputError(f"{what}: {CLASSIC_REMOVED}")
    if kind in ("ResourceClaim", "ResourceClaimTemplate"):
        _refuse_classic_fields(obj, what)
    if version == "v1alpha3" and kind in CONVERTED_KINDS:
        raise InputError(
            f"{what}: {GROUP}/v1alpha3 {kind} was last served by Kubernetes 1.32; "
            f"use {GROUP}/v1 (or v1beta1, v1beta2)"
        )
    if version not in SERVED_VERSIONS:
        if kind in CONVERTED_KINDS:
            raise InputError(f"{what}: unknown version {version}; served versions are {', '.join(SERVED_VERSIONS)}")
        return obj
    if version in ("v1", "v1beta2") and kind in ("ResourceClaim", "ResourceClaimTemplate"):
        _refuse_v1beta1_shape(obj, version, what)
    if version == "v1":
        return obj
    out = copy.deepcopy(obj)
    out["apiVersion"] = f"{GROUP}/v1"
    if version == "v1beta1" and kind == "ResourceClaim":
        _claim_spec_v1beta1(out.get("spec"), "spec", what)
    elif version == "v1beta1" and kind == "ResourceClaimTemplate":
        spec = out.get("spec")
        _claim_spec_v1beta1(spec.get("spec") if isinstance(spec, dict) else None, "spec.spec", what)
    elif version == "v1beta1" and kind == "ResourceSlice":
        _slice_v1beta1(out.get("spec"))
    return out


def _refuse_classic_fields(obj: dict[str, Any], what: str) -> None:
    spec = as_mapping(obj.get("spec"))
    if obj.get("kind") == "ResourceClaimTemplate":
        inner = spec.get("spec")
        spec = inner if isinstance(inner, dict) else {}
        prefix = "spec.spec"
    else:
        prefix = "spec"
    for name in ("resourceClassName", "parametersRef", "allocationMode"):
        if name in spec:
            raise InputError(f"{what}: {prefix}.{name}: {CLASSIC_REMOVED}")


def _claim_spec_v1beta1(spec: Any, where: str, what: str = "") -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("devices"), dict):
        return
    requests = spec["devices"].get("requests")
    if not isinstance(requests, list):
        return
    for i, request in enumerate(requests):
        if not isinstance(request, dict):
            continue
        exact = {k: request.pop(k) for k in EXACT_FIELDS if k in request}
        if "firstAvailable" in request:
            if exact:
                raise InputError(
                    f"{what + ': ' if what else ''}{where}.devices.requests[{i}]: firstAvailable cannot be "
                    f"combined with {', '.join(sorted(exact))}"
                )
            continue
        request["exactly"] = exact


def _slice_v1beta1(spec: Any) -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("devices"), list):
        return
    devices = []
    for device in spec["devices"]:
        if not isinstance(device, dict):
            devices.append(device)
            continue
        flat = {k: v for k, v in device.items() if k != "basic"}
        basic = device.get("basic")
        if isinstance(basic, dict):
            flat.update(basic)
        devices.append(flat)
    spec["devices"] = devices


def _refuse_v1beta1_shape(obj: dict[str, Any], version: str, what: str) -> None:
    """A v1/v1beta2 request with exact-request fields at its top level was written for v1beta1: say so."""
    spec = as_mapping(obj.get("spec"))
    where = "spec"
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = as_mapping(spec.get("spec"))
        where = "spec.spec"
    devices = as_mapping(spec.get("devices"))
    requests = as_list(devices.get("requests"))
    for i, request in enumerate(requests):
        if not isinstance(request, dict) or "exactly" in request:
            continue
        misplaced = [k for k in EXACT_FIELDS if k in request]
        if misplaced:
            raise InputError(
                f"{what}: {where}.devices.requests[{i}].{misplaced[0]}: not a field of {GROUP}/{version} "
                f"(this is the {GROUP}/v1beta1 shape); move the request's fields under exactly, or set "
                f"apiVersion: {GROUP}/v1beta1"
            )
