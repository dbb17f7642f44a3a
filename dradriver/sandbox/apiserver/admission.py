"""Admission: the metadata checks every write passes, the ResourceSlice and ResourceClaim validation subsets, a
Pod's claim references (:mod:`dradriver.domain.pods`), and (optionally) the OpenAPI schema check with
``kubernetes_validate``."""

from __future__ import annotations

import re
from collections.abc import Callable

from dradriver.domain.names import dns_label_problems, dns_subdomain_problems
from dradriver.domain.pods import claim_reference_problems
from dradriver.sandbox.apiserver import crds
from dradriver.sandbox.apiserver.errors import Cause, JSONDict, invalid
from dradriver.sandbox.apiserver.resources import ResourceType

# semver 2.0.0, the regular expression the API server applies to DeviceAttribute.version.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def validate_metadata(obj: JSONDict) -> list[Cause]:
    """``metadata.name`` (a DNS subdomain) and label values (at most 63 characters)."""
    causes: list[Cause] = []
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if not name:
        causes.append(
            ("FieldValueRequired", "metadata.name", "Required value: name or generateName is required")
        )
    else:
        causes.extend(("FieldValueInvalid", "metadata.name", f'Invalid value: "{name}": {problem}')
                      for problem in dns_subdomain_problems(name))
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63:
            causes.append(
                (
                    "FieldValueInvalid",
                    f"metadata.labels.{key}",
                    "Invalid value: must be no more than 63 characters",
                )
            )
    return causes


def validate_resource_slice(obj: JSONDict, old: JSONDict | None) -> list[Cause]:
    """The subset of ``pkg/apis/resource/validation`` (v1.34) that drivers trip over."""
    causes: list[Cause] = []
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [("FieldValueRequired", "spec", "Required value")]
    if not spec.get("driver"):
        causes.append(("FieldValueRequired", "spec.driver", "Required value"))
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        causes.append(("FieldValueRequired", "spec.pool.name", "Required value"))
    if not isinstance(pool.get("generation", 0), int) or pool.get("generation", 0) < 0:
        causes.append(
            ("FieldValueInvalid", "spec.pool.generation", "Invalid value: must be greater than or equal to 0")
        )
    count = pool.get("resourceSliceCount", 0)
    if not isinstance(count, int) or count <= 0:
        causes.append(
            (
                "FieldValueInvalid",
                "spec.pool.resourceSliceCount",
                f"Invalid value: {count}: must be greater than zero",
            )
        )
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    for k in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(k) is False:
            causes.append(("FieldValueInvalid", f"spec.{k}", "Invalid value: false: must be unset or true"))
    if len(selectors) != 1:
        causes.append(
            (
                "FieldValueRequired" if not selectors else "FieldValueInvalid",
                "spec",
                "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
            )
        )
    devices = spec.get("devices") or []
    if len(devices) > 128:
        causes.append(
            ("FieldValueTooMany", "spec.devices", f"Too many: {len(devices)}: must have at most 128 items")
        )
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        causes.extend(_validate_device(f"spec.devices[{i}]", dev, seen))
    if old is not None:
        old_spec = old.get("spec") or {}
        for path in ("driver", "nodeName"):
            if spec.get(path) != old_spec.get(path):
                causes.append(("FieldValueInvalid", f"spec.{path}", "Invalid value: field is immutable"))
        if pool.get("name") != (old_spec.get("pool") or {}).get("name"):
            causes.append(("FieldValueInvalid", "spec.pool.name", "Invalid value: field is immutable"))
    return causes


def _validate_device(where: str, dev: object, seen: set[str]) -> list[Cause]:
    causes: list[Cause] = []
    name = dev.get("name", "") if isinstance(dev, dict) else ""
    problems = dns_label_problems(name) if name else []
    if not name:
        causes.append(("FieldValueRequired", f"{where}.name", "Required value"))
    elif problems:
        causes.extend(("FieldValueInvalid", f"{where}.name", f'Invalid value: "{name}": {problem}')
                      for problem in problems)
    elif name in seen:
        causes.append(("FieldValueDuplicate", f"{where}.name", f'Duplicate value: "{name}"'))
    seen.add(name)
    attrs = dev.get("attributes") or {} if isinstance(dev, dict) else {}
    caps = dev.get("capacity") or {} if isinstance(dev, dict) else {}
    if len(attrs) + len(caps) > 32:
        causes.append(("FieldValueTooMany", where, "Too many: attributes and capacity must have at most 32 entries"))
    for aname, attr in attrs.items():
        kinds = [k for k in ("int", "bool", "string", "version") if k in (attr or {})]
        if len(kinds) != 1:
            causes.append(
                ("FieldValueRequired", f"{where}.attributes[{aname}]", "exactly one value must be specified")
            )
            continue
        value = attr[kinds[0]]
        if kinds[0] in ("string", "version") and (not isinstance(value, str) or len(value) > 64):
            causes.append(
                (
                    "FieldValueTooLong",
                    f"{where}.attributes[{aname}].{kinds[0]}",
                    "Too long: may not be more than 64 bytes",
                )
            )
        elif kinds[0] == "version" and not _SEMVER.match(value):
            causes.append(
                (
                    "FieldValueInvalid",
                    f"{where}.attributes[{aname}].version",
                    f'Invalid value: "{value}": must be a string compatible with semver.org spec 2.0.0',
                )
            )
    return causes


def validate_resource_claim(obj: JSONDict, old: JSONDict | None) -> list[Cause]:
    """An immutable spec; every request named and with exactly one of ``exactly`` / ``firstAvailable``."""
    if old is not None and obj.get("spec") != old.get("spec"):
        return [("FieldValueInvalid", "spec", "Invalid value: field is immutable")]
    causes: list[Cause] = []
    for i, req in enumerate(((obj.get("spec") or {}).get("devices") or {}).get("requests") or []):
        if not isinstance(req, dict) or not req.get("name"):
            causes.append(("FieldValueRequired", f"spec.devices.requests[{i}].name", "Required value"))
        elif ("exactly" in req) == ("firstAvailable" in req):
            causes.append(
                (
                    "FieldValueRequired",
                    f"spec.devices.requests[{i}]",
                    "exactly one of `exactly` or `firstAvailable` is required",
                )
            )
    return causes


KIND_VALIDATORS: dict[str, Callable[[JSONDict, JSONDict | None], list[Cause]]] = {
    "Pod": lambda obj, old: claim_reference_problems(obj.get("spec") or {}),
    "ResourceSlice": validate_resource_slice,
    "ResourceClaim": validate_resource_claim,
    crds.CRD_KIND: lambda obj, old: crds.validate_crd(obj),
}


def admit(rt: ResourceType, obj: JSONDict, old: JSONDict | None, *, schema_version: str | None,
          custom_schema: bool = True) -> None:
    """Validate a create (``old`` is None) or update.

    :param schema_version: also check the object against that Kubernetes version's OpenAPI schema.
    :param custom_schema: check an object of a CRD-registered type against the CRD's schema, list types and
        transition rules (:func:`.crds.validate_object`).
    :raises ApiStatusError: 422 ``Invalid`` with every cause found.
    """
    name = obj["metadata"].get("name", "")
    causes = validate_metadata(obj)
    validator = KIND_VALIDATORS.get(rt.kind)
    if validator is not None:
        causes.extend(validator(obj, old))
    if custom_schema and rt.schema is not None:
        causes.extend(crds.validate_object(rt.schema, obj, old))
    if not causes and schema_version is not None and not rt.custom:
        import kubernetes_validate  # test dependency, imported only when schema validation is asked for

        try:
            kubernetes_validate.validate(obj, schema_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            causes.append(("FieldValueInvalid", path or "<root>", exc.message))
    if causes:
        raise invalid(rt.group, rt.kind, name, causes)
