"""CustomResourceDefinitions: an ``apiextensions.k8s.io/v1`` CRD written to the emulator registers (or replaces)
its resource type at runtime, and objects of that type then get what kube-apiserver's apiextensions server does
with a structural schema:

* **pruning**: fields the schema does not declare are dropped (``x-kubernetes-preserve-unknown-fields`` keeps
  them; ``metadata``, ``apiVersion`` and ``kind`` at the root are never pruned); with ``fieldValidation=Strict``
  they are a 400, with ``Warn`` (the default) a ``Warning`` header per field (:func:`unknown_fields`);
* **defaulting**: ``default`` of every declared property missing from an object that is present;
* **validation** with :mod:`jsonschema` (``type``, ``required``, ``enum``, ``minimum``/``maximum``,
  ``pattern``, lengths, item counts; ``nullable``; ``x-kubernetes-int-or-string``) and the list types
  (``x-kubernetes-list-type: map`` keys and ``set`` items unique), answered as 422 ``Invalid`` with
  kube-apiserver's wording (``spec.numNodes: Invalid value: -1: spec.numNodes in body should be greater than or
  equal to 0``);
* **transition rules**: the CEL rule ``self == oldSelf`` of ``x-kubernetes-validations`` (the only rule the
  emulator evaluates; a CRD with another rule is refused with 422 at apply time, not silently served) is checked
  on update wherever the old object has the field, e.g. ``spec: Invalid value: "object": A computeDomain.spec is
  immutable``;
* the ``status`` subresource when the served version declares it.

Deleting a CRD deletes its objects and unregisters the type; a type the emulator serves without a CRD (the
ComputeDomain types of :data:`.resources.RESOURCE_TYPES`, stored without schema) falls back to that entry.
Objects seeded in process (``ApiServerEmulator.create``) get defaults but neither pruning nor validation, so tests
can still seed deliberately odd objects. Facts: Kubernetes ``apiextensions-apiserver`` (structural schemas,
pruning, defaulting, CEL transition rules, KEP-2876), field paths and messages as ``field.ErrorList`` prints
them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources as package_files
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml

from dradriver.sandbox.apiserver.errors import ApiStatusError, Cause, JSONDict, invalid

__all__ = [
    "BUNDLED_CRDS",
    "CRD_API_VERSION",
    "CRD_KIND",
    "CustomSchema",
    "apply_defaults",
    "bundled_crds",
    "crd_status",
    "prune",
    "refuse_crd",
    "strict_error",
    "types_of_crd",
    "unknown_fields",
    "validate_crd",
    "validate_object",
]

CRD_API_VERSION = "apiextensions.k8s.io/v1"
CRD_KIND = "CustomResourceDefinition"
_SELF_EQ_OLD = re.compile(r"^\s*self\s*==\s*oldSelf\s*$")
_ROOT_META = ("apiVersion", "kind", "metadata")
BUNDLED_CRDS = ("resource.nvidia.com_computedomains.yaml", "resource.nvidia.com_computedomaincliques.yaml")
"""The CRDs ``deploy/kustomize/base/crds/`` ships, bundled in ``dradriver/sandbox/manifests/``."""


def bundled_crds() -> list[JSONDict]:
    """The ComputeDomain and ComputeDomainClique CRDs exactly as ``deploy/`` ships them."""
    folder = package_files.files("dradriver.sandbox").joinpath("manifests")
    return [doc for name in BUNDLED_CRDS for doc in yaml.safe_load_all(folder.joinpath(name).read_text()) if doc]


@dataclass(frozen=True, slots=True)
class CustomSchema:
    """The served version's ``openAPIV3Schema`` and its compiled validator."""

    crd_name: str
    root: JSONDict
    validator: Any = field(compare=False, repr=False)

    @classmethod
    def of(cls, crd_name: str, root: Mapping[str, Any]) -> CustomSchema:
        """Compile ``root`` (an ``openAPIV3Schema``) for :mod:`jsonschema`."""
        return cls(crd_name, copy.deepcopy(dict(root)),
                   jsonschema.Draft202012Validator(_to_json_schema(root, top=True)))


def _to_json_schema(schema: Mapping[str, Any], *, top: bool = False) -> JSONDict:
    """An OpenAPI v3 structural schema as plain JSON Schema (``nullable`` and ``x-kubernetes-int-or-string``
    become type unions; ``metadata`` at the root is left to the metadata checks)."""
    out: JSONDict = {}
    for key in ("enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern", "minLength",
                "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "required", "multipleOf"):
        if key in schema:
            out[key] = copy.deepcopy(schema[key])
    # OpenAPI v3.0 writes exclusive bounds as booleans next to minimum/maximum.
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(flag), bool):
            if out.pop(flag) and bound in out:
                out[flag] = out.pop(bound)
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    elif "type" in schema:
        out["type"] = [schema["type"], "null"] if schema.get("nullable") else schema["type"]
    if "enum" in out and schema.get("nullable"):
        out["enum"] = [*out["enum"], None]
    props = schema.get("properties")
    if isinstance(props, Mapping):
        out["properties"] = {
            k: ({} if top and k == "metadata" else _to_json_schema(v)) for k, v in props.items()
        }
    addl = schema.get("additionalProperties")
    if isinstance(addl, Mapping):
        out["additionalProperties"] = _to_json_schema(addl)
    items = schema.get("items")
    if isinstance(items, Mapping):
        out["items"] = _to_json_schema(items)
    return out


# -- the CRD object itself ------------------------------------------------------------------------------------------


def validate_crd(crd: Mapping[str, Any]) -> list[Cause]:
    """The checks of a CRD the emulator needs to serve it: ``metadata.name`` is ``<plural>.<group>``, names,
    scope, exactly one storage version, a schema per served version, only ``self == oldSelf`` CEL rules."""
    causes: list[Cause] = []
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group") or ""
    for key in ("plural", "kind"):
        if not names.get(key):
            causes.append(("FieldValueRequired", f"spec.names.{key}", "Required value"))
    if not group:
        causes.append(("FieldValueRequired", "spec.group", "Required value"))
    name = (crd.get("metadata") or {}).get("name", "")
    if names.get("plural") and group and name != f"{names['plural']}.{group}":
        causes.append(("FieldValueInvalid", "metadata.name",
                       f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        causes.append(("FieldValueNotSupported", "spec.scope",
                       f'Unsupported value: "{spec.get("scope", "")}": supported values: "Cluster", "Namespaced"'))
    versions = spec.get("versions") or []
    if not versions:
        causes.append(("FieldValueRequired", "spec.versions", "Required value: must have exactly one version "
                                                              "marked as storage version"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        causes.append(("FieldValueInvalid", "spec.versions",
                       "Invalid value: must have exactly one version marked as storage version"))
    for i, version in enumerate(versions):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        where = f"spec.versions[{i}].schema.openAPIV3Schema"
        if version.get("served") and not isinstance(schema, Mapping):
            causes.append(("FieldValueRequired", where, "Required value: schemas are required"))
            continue
        for path, rules in _rules(schema or {}, where):
            for j, rule in enumerate(rules):
                text = str((rule or {}).get("rule", ""))
                if not _SELF_EQ_OLD.match(text):
                    causes.append(("FieldValueInvalid", f"{path}.x-kubernetes-validations[{j}].rule",
                                   f"Invalid value: {json.dumps(text)}: the API server emulator evaluates only "
                                   "the CEL rule 'self == oldSelf'"))
    return causes


def _rules(schema: Mapping[str, Any], path: str) -> Iterator[tuple[str, list[Any]]]:
    if schema.get("x-kubernetes-validations"):
        yield path, list(schema["x-kubernetes-validations"])
    for key, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, f"{path}.properties[{key}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from _rules(schema[key], f"{path}.{key}")


def types_of_crd(crd: Mapping[str, Any]) -> list[tuple[str, str, str, str, str, bool, bool, tuple[str, ...],
                                                       CustomSchema]]:
    """One entry per served version: ``(group, version, plural, singular, kind, namespaced, status,
    short_names, schema)`` (the fields of a :class:`~.resources.ResourceType`)."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec.get("versions") or []:
        if not version.get("served"):
            continue
        schema = CustomSchema.of(crd["metadata"]["name"], version["schema"]["openAPIV3Schema"])
        out.append((spec["group"], version["name"], names["plural"],
                    names.get("singular") or names["kind"].lower(), names["kind"], spec["scope"] == "Namespaced",
                    "status" in (version.get("subresources") or {}), tuple(names.get("shortNames") or ()), schema))
    return out


def crd_status(crd: Mapping[str, Any], now: str) -> JSONDict:
    """``status`` of an established CRD: conditions ``NamesAccepted`` and ``Established``, ``acceptedNames``,
    ``storedVersions``."""
    spec = crd.get("spec") or {}
    names = dict(spec.get("names") or {})
    names.setdefault("singular", str(names.get("kind", "")).lower())
    names.setdefault("listKind", f"{names.get('kind', '')}List")
    conditions = [
        {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found",
         "lastTransitionTime": now},
        {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
         "message": "the initial names have been accepted", "lastTransitionTime": now},
    ]
    stored = [v["name"] for v in spec.get("versions") or [] if v.get("storage")]
    return {"conditions": conditions, "acceptedNames": names, "storedVersions": stored}


# -- objects of a custom resource -----------------------------------------------------------------------------------


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def prune(obj: JSONDict, schema: Mapping[str, Any]) -> list[str]:
    """Drop, in place, every field ``schema`` does not declare; returns their paths (``spec.foo``)."""
    dropped: list[str] = []
    _prune(obj, schema, "", dropped, root=True)
    return dropped


def unknown_fields(obj: Any, schema: Mapping[str, Any]) -> list[str]:
    """The paths :func:`prune` would drop from ``obj`` (which stays unchanged)."""
    if not isinstance(obj, dict):
        return []
    return prune(copy.deepcopy(obj), schema)


def _prune(value: Any, schema: Mapping[str, Any], path: str, dropped: list[str], *, root: bool = False) -> None:
    preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    if isinstance(value, dict):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        if isinstance(props, Mapping):
            for key in list(value):
                if root and key in _ROOT_META:
                    continue
                if key in props:
                    _prune(value[key], props[key], _path(path, key), dropped)
                elif not preserve:
                    dropped.append(_path(path, key))
                    del value[key]
        elif isinstance(addl, Mapping):
            for key in value:
                _prune(value[key], addl, _path(path, key), dropped)
        elif not preserve and addl is not True and schema.get("type") == "object":
            for key in list(value):
                dropped.append(_path(path, key))
                del value[key]
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            _prune(item, schema["items"], _path(path, i), dropped)


def apply_defaults(value: Any, schema: Mapping[str, Any], *, root: bool = True) -> None:
    """Fill in, in place, the ``default`` of every declared property missing from a present object (never
    inside the root's ``metadata``)."""
    if isinstance(value, dict):
        props = schema.get("properties")
        if isinstance(props, Mapping):
            for key, sub in props.items():
                if root and key in _ROOT_META:
                    continue
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value:
                    apply_defaults(value[key], sub, root=False)
        addl = schema.get("additionalProperties")
        if isinstance(addl, Mapping):
            for item in value.values():
                apply_defaults(item, addl, root=False)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            apply_defaults(item, schema["items"], root=False)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _shown(value: Any) -> str:
    """A value as ``field.Invalid`` shows it: strings quoted, objects and arrays by type name."""
    if isinstance(value, (dict, list)):
        return f'"{_type_name(value)}"'
    return json.dumps(value)


def _schema_causes(schema: CustomSchema, obj: JSONDict) -> list[Cause]:
    causes: list[Cause] = []
    body = {k: v for k, v in obj.items() if k != "metadata"}
    for err in sorted(schema.validator.iter_errors(body), key=lambda e: [str(p) for p in e.absolute_path]):
        where = ""
        for part in err.absolute_path:
            where = _path(where, part)
        kind = err.validator
        if kind == "required":
            present = err.instance if isinstance(err.instance, dict) else {}
            for missing in err.validator_value:
                if missing not in present:
                    cause = ("FieldValueRequired", _path(where, missing), "Required value")
                    if cause not in causes:
                        causes.append(cause)
        elif kind == "enum":
            allowed = ", ".join(json.dumps(v) for v in err.validator_value if v is not None)
            causes.append(("FieldValueNotSupported", where,
                           f"Unsupported value: {_shown(err.instance)}: supported values: {allowed}"))
        elif kind == "type":
            want = err.validator_value if isinstance(err.validator_value, str) else "/".join(err.validator_value)
            causes.append(("FieldValueTypeInvalid", where, f'Invalid value: "{_type_name(err.instance)}": '
                                                           f"{where} in body must be of type {want}: "
                                                           f'"{_type_name(err.instance)}"'))
        elif kind in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            relation = {"minimum": "greater than or equal to", "maximum": "less than or equal to",
                        "exclusiveMinimum": "greater than", "exclusiveMaximum": "less than"}[kind]
            causes.append(("FieldValueInvalid", where,
                           f"Invalid value: {_shown(err.instance)}: {where} in body should be {relation} "
                           f"{err.validator_value}"))
        else:
            causes.append(("FieldValueInvalid", where or "<root>", f"Invalid value: {_shown(err.instance)}: "
                                                                   f"{err.message}"))
    return causes


def _list_causes(value: Any, schema: Mapping[str, Any], path: str) -> list[Cause]:
    causes: list[Cause] = []
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) if isinstance(props, Mapping) else None
            if sub is None and isinstance(addl, Mapping):
                sub = addl
            if isinstance(sub, Mapping) and not (path == "" and key == "metadata"):
                causes.extend(_list_causes(item, sub, _path(path, key)))
    elif isinstance(value, list):
        list_type = schema.get("x-kubernetes-list-type")
        seen: list[Any] = []
        for i, item in enumerate(value):
            if list_type == "map" and isinstance(item, dict):
                ident = {k: item.get(k) for k in schema.get("x-kubernetes-list-map-keys") or ()}
            elif list_type == "set":
                ident = item
            else:
                ident = None
            if ident is not None:
                if ident in seen:
                    causes.append(("FieldValueDuplicate", _path(path, i),
                                   f"Duplicate value: {json.dumps(ident, sort_keys=True)}"))
                seen.append(ident)
            if isinstance(schema.get("items"), Mapping):
                causes.extend(_list_causes(item, schema["items"], _path(path, i)))
    return causes


def _transition_causes(new: Any, old: Any, schema: Mapping[str, Any], path: str) -> list[Cause]:
    """``self == oldSelf`` wherever both the new and the old object have the field."""
    causes: list[Cause] = []
    for rule in schema.get("x-kubernetes-validations") or ():
        if _SELF_EQ_OLD.match(str(rule.get("rule", ""))) and new != old:
            message = rule.get("message") or f"failed rule: {rule.get('rule')}"
            causes.append(("FieldValueInvalid", path or "<root>", f"Invalid value: {_shown(new)}: {message}"))
    props = schema.get("properties")
    if isinstance(new, dict) and isinstance(old, dict) and isinstance(props, Mapping):
        for key, sub in props.items():
            if key in new and key in old and not (path == "" and key == "metadata"):
                causes.extend(_transition_causes(new[key], old[key], sub, _path(path, key)))
    return causes


def validate_object(schema: CustomSchema, obj: JSONDict, old: JSONDict | None) -> list[Cause]:
    """Every schema, list-type and transition-rule cause of a (pruned, defaulted) object."""
    causes = _schema_causes(schema, obj)
    causes.extend(_list_causes(obj, schema.root, ""))
    if old is not None:
        causes.extend(_transition_causes(obj, old, schema.root, ""))
    return causes


def refuse_crd(crd: JSONDict) -> None:
    """Raise 422 when the emulator cannot serve ``crd`` (:func:`validate_crd`).

    :raises ApiStatusError: 422 ``Invalid`` naming each field.
    """
    causes = validate_crd(crd)
    if causes:
        raise invalid("apiextensions.k8s.io", CRD_KIND, (crd.get("metadata") or {}).get("name", ""), causes)


def strict_error(kind: str, version: str, dropped: list[str]) -> ApiStatusError:
    """The 400 of ``fieldValidation=Strict`` for unknown fields, as kube-apiserver words it."""
    fields = ", ".join(f'unknown field "{f}"' for f in dropped)
    return ApiStatusError(400, "BadRequest", f'{kind} in version "{version}" cannot be handled as a {kind}: '
                                             f"strict decoding error: {fields}")
