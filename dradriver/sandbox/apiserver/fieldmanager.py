"""Field ownership and server-side apply (SSA): ``metadata.managedFields`` and the ``application/apply-patch+yaml``
merge, as the API server's structured-merge-diff does them.

Facts (Kubernetes documentation "Server-Side Apply"; ``k8s.io/apimachinery`` ``ManagedFieldsEntry``;
``sigs.k8s.io/structured-merge-diff`` ``fieldpath`` serialization):

* Each ``managedFields`` entry is one (``manager``, ``operation``, ``subresource``) with ``apiVersion``, ``time``
  (RFC 3339, seconds), ``fieldsType: FieldsV1`` and ``fieldsV1``: a trie whose keys are ``f:<field>`` (a struct
  field or map key), ``k:<json>`` (a list-map item by its keys, compact JSON with the keys sorted), ``v:<json>``
  (a set item) and ``.`` (the item itself); a leaf is ``{}``.
* Apply: the applier owns every field its configuration names; a field it owned before and no longer applies is
  removed from the object unless another manager owns it too; a list-map item stays while anyone owns a field
  in it. Applying a different value to a field another manager owns is a conflict (409, one
  ``FieldManagerConflict`` cause per field) unless ``force``, which takes the field over; the same value makes
  the ownership shared.
* Update (POST, PUT, JSON/merge/strategic patch): the writer's ``Update`` entry takes every field it added or
  changed, which other managers lose; removed fields leave every entry. ``managedFields`` in a write's body is
  ignored (the stored entries carry on) unless it is ``[{}]``, which resets them.
* The main resource of a type with a ``status`` subresource tracks no ``status`` fields, the ``status``
  subresource only those (``subresource: status`` entries).
* Never owned: ``apiVersion``, ``kind``, ``metadata.name``/``namespace``/``uid``/``resourceVersion``/
  ``generation``/``creationTimestamp``/``deletionTimestamp``/``managedFields``/``selfLink``.

List semantics come from the CRD's structural schema (``x-kubernetes-list-type``: ``map`` with
``x-kubernetes-list-map-keys``, ``set``, ``atomic``; ``x-kubernetes-map-type: atomic``); lists default to
atomic, objects to granular. Built-in types (no schema here) follow :data:`BUILTIN_LISTS` (the
patch-merge-keys of the built-in OpenAPI that the emulator's callers touch: ``metadata.ownerReferences`` by
``uid``, ``metadata.finalizers`` a set, containers by ``name``, conditions by ``type`` ...); every other list
of a built-in type is atomic, every object granular (so ``metadata.labels``/``annotations`` and a
ConfigMap's ``data`` are granular maps).

Cost: one apply or update is linear in the size of the object and of its managed fields (paths are flattened
into tuples and compared as sets).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dradriver.sandbox.apiserver.errors import ApiStatusError, JSONDict, bad_request
from dradriver.sandbox.apiserver.media import APPLY_PATCH

__all__ = ["APPLY_PATCH", "Entry", "Shape", "Write", "apply", "update"]

Path = tuple[str, ...]
"""One field path: ``("f:spec", "f:daemons", 'k:{"nodeName":"a"}', "f:index")``; ``"."`` ends an item's own."""

_UNOWNED_META = frozenset({"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                           "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"})

BUILTIN_LISTS: Mapping[str, tuple[str, ...]] = {
    "ownerReferences": ("map", "uid"),
    "finalizers": ("set",),
    "containers": ("map", "name"),
    "initContainers": ("map", "name"),
    "ephemeralContainers": ("map", "name"),
    "volumes": ("map", "name"),
    "volumeMounts": ("map", "mountPath"),
    "env": ("map", "name"),
    "conditions": ("map", "type"),
    "imagePullSecrets": ("map", "name"),
}
"""Field name -> list type (``map`` with its key, or ``set``) for lists of built-in types."""


class Shape:
    """How one value merges: its list type and the shape of its children.

    :param schema: the value's structural schema (a CRD's ``openAPIV3Schema`` node), or ``None`` for a built-in
        type (:data:`BUILTIN_LISTS` by field name).
    """

    __slots__ = ("field", "root", "schema")

    def __init__(self, schema: Mapping[str, Any] | None, field: str = "", *, root: bool = False) -> None:
        self.schema = schema
        self.field = field
        self.root = root

    def list_type(self) -> tuple[str, tuple[str, ...]]:
        """``("map", keys)``, ``("set", ())`` or ``("atomic", ())``."""
        if self.schema is not None:
            kind = str(self.schema.get("x-kubernetes-list-type") or "atomic")
            keys = tuple(self.schema.get("x-kubernetes-list-map-keys") or ())
            return (kind, keys) if kind == "map" else (kind, ())
        known = BUILTIN_LISTS.get(self.field)
        if known is None:
            return ("atomic", ())
        return (known[0], known[1:])

    def atomic_map(self) -> bool:
        """The object is replaced as a whole (``x-kubernetes-map-type: atomic``)."""
        return self.schema is not None and self.schema.get("x-kubernetes-map-type") == "atomic"

    def child(self, key: str) -> Shape:
        """The shape of field ``key`` of this object (an object's ``metadata`` is always ``ObjectMeta``, whatever a
        CRD's schema says of it)."""
        if self.schema is None or (self.root and key == "metadata"):
            return Shape(None, key)
        props = self.schema.get("properties")
        if isinstance(props, Mapping) and key in props:
            return Shape(props[key], key)
        addl = self.schema.get("additionalProperties")
        if isinstance(addl, Mapping):
            return Shape(addl, key)
        return Shape(None, key) if self.schema.get("x-kubernetes-preserve-unknown-fields") else Shape({}, key)

    def item(self) -> Shape:
        """The shape of this list's items."""
        if self.schema is None:
            return Shape(None, "")
        items = self.schema.get("items")
        return Shape(items if isinstance(items, Mapping) else {}, "")


def _key_element(item: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    return "k:" + json.dumps({k: item.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))


def _value_element(value: Any) -> str:
    return "v:" + json.dumps(value, sort_keys=True, separators=(",", ":"))


def field_set(value: Any, shape: Shape, prefix: Path = ()) -> dict[Path, Any]:
    """Every owned leaf path of ``value`` and the value found there (``"."`` paths map to the item).

    :raises ApiStatusError: 422 for a list-map item without its keys or two items with the same keys.
    """
    out: dict[Path, Any] = {}
    _collect(value, shape, prefix, out)
    return out


def _collect(value: Any, shape: Shape, prefix: Path, out: dict[Path, Any]) -> None:
    if isinstance(value, dict) and value and not shape.atomic_map():
        for key, sub in value.items():
            _collect(sub, shape.child(key), (*prefix, "f:" + key), out)
        return
    if isinstance(value, list) and value:
        kind, keys = shape.list_type()
        if kind == "map":
            item_shape = shape.item()
            for item in value:
                if not isinstance(item, dict) or any(k not in item for k in keys):
                    raise ApiStatusError(422, "Invalid", f"{_show(prefix)}: list-map item {item!r} lacks its "
                                                         f"keys {list(keys)}")
                element = (*prefix, _key_element(item, keys))
                if (*element, ".") in out:
                    raise ApiStatusError(422, "Invalid", f"{_show(prefix)}: duplicate entries for key "
                                                         f"{element[-1][2:]}")
                out[(*element, ".")] = item
                for key, sub in item.items():
                    _collect(sub, item_shape.child(key), (*element, "f:" + key), out)
            return
        if kind == "set":
            for item in value:
                out[(*prefix, _value_element(item))] = item
            return
    if prefix:
        out[prefix] = value


def owned_paths(obj: JSONDict, shape: Shape, subresource: str | None, status_subresource: bool) -> dict[Path, Any]:
    """:func:`field_set` of ``obj`` restricted to what a write to ``subresource`` can own."""
    paths: dict[Path, Any] = {}
    for key, value in obj.items():
        if key in ("apiVersion", "kind"):
            continue
        if status_subresource and (key == "status") != (subresource == "status"):
            continue
        if key == "metadata" and isinstance(value, dict):
            if subresource == "status":
                continue
            kept = {k: v for k, v in value.items() if k not in _UNOWNED_META}
            if kept:
                _collect(kept, shape.child("metadata"), ("f:metadata",), paths)
            continue
        _collect(value, shape.child(key), ("f:" + key,), paths)
    return paths


def to_fields_v1(paths: Iterable[Path]) -> JSONDict:
    """The ``fieldsV1`` trie of a set of paths."""
    root: JSONDict = {}
    for path in sorted(paths):
        node = root
        for element in path:
            node = node.setdefault(element, {})
    return root


def from_fields_v1(trie: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    """The paths of a ``fieldsV1`` trie (every node that is a leaf or holds ``"."``)."""
    out: set[Path] = set()
    for element, sub in trie.items():
        path = (*prefix, element)
        if isinstance(sub, Mapping) and sub:
            out |= from_fields_v1(sub, path)
        else:
            out.add(path)
    return out


def _show(path: Path) -> str:
    """A path as the API server prints it: ``.spec.daemons[nodeName="a"].index``."""
    parts: list[str] = []
    for element in path:
        if element == ".":
            continue
        kind, _, rest = element.partition(":")
        if kind == "f":
            parts.append("." + rest)
        elif kind == "k":
            keys = json.loads(rest)
            parts.append("[" + ",".join(f"{k}={json.dumps(v)}" for k, v in keys.items()) + "]")
        else:
            parts.append(f"[{rest}]")
    return "".join(parts) or "."


@dataclass(slots=True)
class Entry:
    """One ``managedFields`` entry with its paths as a set."""

    manager: str
    operation: str
    api_version: str
    time: str
    subresource: str
    paths: set[Path]

    def to_json(self) -> JSONDict:
        out: JSONDict = {"manager": self.manager, "operation": self.operation, "apiVersion": self.api_version,
                         "time": self.time, "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(self.paths)}
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def read_entries(obj: Mapping[str, Any]) -> list[Entry]:
    """The object's ``metadata.managedFields`` as :class:`Entry` values (malformed entries are dropped)."""
    out: list[Entry] = []
    for raw in (obj.get("metadata") or {}).get("managedFields") or ():
        if not isinstance(raw, Mapping) or not raw.get("manager"):
            continue
        fields = raw.get("fieldsV1")
        trie: Mapping[str, Any] = fields if isinstance(fields, Mapping) else {}
        out.append(Entry(str(raw["manager"]), str(raw.get("operation") or "Update"), str(raw.get("apiVersion", "")),
                         str(raw.get("time", "")), str(raw.get("subresource") or ""), from_fields_v1(trie)))
    return out


def write_entries(obj: JSONDict, entries: Iterable[Entry]) -> None:
    """Store ``entries`` (those owning nothing left out) as the object's ``metadata.managedFields``."""
    kept = [e.to_json() for e in entries if e.paths]
    meta = obj.setdefault("metadata", {})
    if kept:
        meta["managedFields"] = kept
    else:
        meta.pop("managedFields", None)


def manager_of(params: Mapping[str, str], user_agent: str) -> str:
    """The field manager of a write: the ``fieldManager`` query parameter, else the ``User-Agent`` up to its
    first ``/`` (the API server's default).

    :raises ApiStatusError: 400 for a ``fieldManager`` longer than 128 characters or with control characters.
    """
    manager = params.get("fieldManager")
    if manager is None:
        return user_agent.split("/", 1)[0] or "unknown"
    if len(manager) > 128 or any(not ch.isprintable() for ch in manager):
        raise bad_request(f'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Invalid value: "{manager}": '
                          "must be no more than 128 characters and printable")
    return manager


def _values_equal(a: Any, b: Any) -> bool:
    """JSON equality: ``1 == 1.0`` but ``True != 1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


# -- merging an applied configuration ---------------------------------------------------------------------------

def merge(live: Any, applied: Any, shape: Shape) -> Any:
    """``applied`` merged into ``live`` by ``shape`` (granular objects, list maps by key, sets by value, the rest
    replaced); neither input is changed."""
    if isinstance(applied, dict) and isinstance(live, dict) and not shape.atomic_map():
        out = dict(live)
        for key, value in applied.items():
            out[key] = merge(live.get(key), value, shape.child(key)) if key in live else copy.deepcopy(value)
        return out
    if isinstance(applied, list) and isinstance(live, list):
        kind, keys = shape.list_type()
        if kind == "map":
            item_shape = shape.item()
            index = {_key_element(item, keys): i for i, item in enumerate(live) if isinstance(item, dict)}
            merged = list(live)
            for item in applied:
                if not isinstance(item, dict):
                    continue
                at = index.get(_key_element(item, keys))
                if at is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[at] = merge(live[at], item, item_shape)
            return merged
        if kind == "set":
            seen = {_value_element(v) for v in live}
            return list(live) + [copy.deepcopy(v) for v in applied if _value_element(v) not in seen]
    return copy.deepcopy(applied)


def remove_paths(obj: Any, paths: set[Path], shape: Shape) -> None:
    """Remove, in place, the fields at ``paths`` (an item's ``"."`` path removes the item when nothing else in
    it is left owned, which the caller decides by passing the item's own paths too)."""
    # Whole items first (their own fields go with them), then the deepest fields first.
    for path in sorted(paths, key=lambda p: (p[-1] != ".", -len(p))):
        _remove(obj, path, shape)


def _remove(value: Any, path: Path, shape: Shape) -> None:
    if not path:
        return
    element, rest = path[0], path[1:]
    kind, _, name = element.partition(":")
    if kind == "f" and isinstance(value, dict):
        if name not in value:
            return
        if not rest:
            del value[name]
            return
        sub = value[name]
        _remove(sub, rest, shape.child(name))
        if isinstance(sub, (dict, list)) and not sub:
            del value[name]  # nothing left under it: as the server's pruning of empty parents
        return
    if kind == "k" and isinstance(value, list):
        _, keys = shape.list_type()
        for i, item in enumerate(value):
            if isinstance(item, dict) and _key_element(item, keys) == element:
                if rest == (".",):
                    del value[i]
                elif len(rest) == 1 and rest[0][2:] in keys:
                    pass  # a kept item keeps the keys that name it
                else:
                    _remove(item, rest, shape.item())
                return
        return
    if kind == "v" and isinstance(value, list):
        for i, item in enumerate(value):
            if _value_element(item) == element:
                del value[i]
                return


def _value_at(obj: Any, path: Path, shape: Shape) -> tuple[bool, Any]:
    value = obj
    for element in path:
        if element == ".":
            return True, value
        kind, _, name = element.partition(":")
        if kind == "f":
            if not isinstance(value, dict) or name not in value:
                return False, None
            value, shape = value[name], shape.child(name)
        elif kind == "k":
            if not isinstance(value, list):
                return False, None
            _, keys = shape.list_type()
            found = [item for item in value if isinstance(item, dict) and _key_element(item, keys) == element]
            if not found:
                return False, None
            value, shape = found[0], shape.item()
        else:
            if not isinstance(value, list):
                return False, None
            found = [item for item in value if _value_element(item) == element]
            if not found:
                return False, None
            value = found[0]
    return True, value


@dataclass(frozen=True, slots=True)
class Write:
    """Who writes and where: the manager, the object's ``apiVersion``, the subresource, whether the type has a
    ``status`` subresource, and the time to stamp on changed entries (RFC 3339)."""

    manager: str
    api_version: str
    subresource: str | None
    status_subresource: bool
    time: str


def apply(live: JSONDict | None, applied: JSONDict, shape: Shape, write: Write, *, force: bool) -> JSONDict:
    """The object after applying ``applied`` (the request body) to ``live`` (``None``: apply-create), with its
    ``managedFields``. The caller stores it (defaults, validation, resourceVersion as for any write).

    :raises ApiStatusError: 409 ``Conflict`` with ``FieldManagerConflict`` causes, or on a ``resourceVersion``
        in ``applied`` that is not the live one; 400 for a body that is not an object or names another
        kind/apiVersion; 422 for malformed list-map items.
    """
    if not isinstance(applied, dict):
        raise bad_request("the apply configuration must be an object")
    meta = applied.get("metadata")
    if not isinstance(meta, dict):
        raise bad_request("the apply configuration needs metadata")
    if live is not None and meta.get("resourceVersion") and \
            meta["resourceVersion"] != (live.get("metadata") or {}).get("resourceVersion"):
        name = (live.get("metadata") or {}).get("name", "")
        raise ApiStatusError(409, "Conflict", f"Operation cannot be fulfilled on {name}: the object has been "
                                              "modified; please apply your changes to the latest version and try "
                                              "again")
    config = {k: v for k, v in applied.items() if k != "status"} if (
        write.status_subresource and write.subresource != "status") else dict(applied)
    if write.subresource == "status":
        config = {"status": applied.get("status") or {}}
    config_meta = {k: v for k, v in meta.items() if k not in _UNOWNED_META}
    if write.subresource != "status":
        config["metadata"] = config_meta
    elif "metadata" in config:
        del config["metadata"]
    new_paths = set(owned_paths(config, shape, write.subresource, write.status_subresource))
    config_values = field_set(config, shape)
    entries = read_entries(live) if live is not None else []
    mine = [e for e in entries if e.manager == write.manager and e.operation == "Apply"
            and e.subresource == (write.subresource or "")]
    others = [e for e in entries if e not in mine]
    base: JSONDict = live if live is not None else {}
    conflicts: list[tuple[Entry, Path]] = []
    for entry in others:
        for path in new_paths & entry.paths:
            if path[-1] == "." or path[-1].startswith("v:"):
                continue
            found, current = _value_at(base, path, shape)
            if found and not _values_equal(current, config_values.get(path)):
                conflicts.append((entry, path))
    if conflicts and not force:
        raise _conflict_error(conflicts)
    for entry, path in conflicts:
        entry.paths.discard(path)
    old_mine: set[Path] = set().union(*(e.paths for e in mine)) if mine else set()
    still_owned: set[Path] = set().union(*(e.paths for e in others)) if others else set()
    merged = merge(base, {k: v for k, v in config.items() if k != "metadata"}, shape)
    merged_meta = merge(base.get("metadata") or {}, config_meta, shape.child("metadata"))
    merged["metadata"] = merged_meta if write.subresource != "status" else dict(base.get("metadata") or {})
    dropped = old_mine - new_paths - still_owned
    # An item goes only when nobody keeps a field inside it.
    kept_items = {p[:i + 1] for p in still_owned | new_paths for i, e in enumerate(p) if e.startswith("k:")}
    dropped = {p for p in dropped if not (p[-1] == "." and p[:-1] in kept_items)}
    remove_paths(merged, dropped, shape)
    entry = Entry(write.manager, "Apply", write.api_version, write.time, write.subresource or "", new_paths)
    if mine and mine[0].paths == new_paths and mine[0].api_version == write.api_version:
        entry.time = mine[0].time
    result = [entry if e is mine[0] else e for e in entries] if mine else [*entries, entry]
    write_entries(merged, result)
    if live is None:
        merged.setdefault("apiVersion", applied.get("apiVersion"))
        merged.setdefault("kind", applied.get("kind"))
        for key in ("name", "namespace", "generateName"):
            if key in meta:
                merged["metadata"][key] = meta[key]
    return merged


def _conflict_error(conflicts: list[tuple[Entry, Path]]) -> ApiStatusError:
    by_manager: dict[tuple[str, str], list[Path]] = {}
    for entry, path in conflicts:
        by_manager.setdefault((entry.manager, entry.api_version), []).append(path)
    n = len(conflicts)
    parts: list[str] = []
    causes: list[JSONDict] = []
    for (manager, api_version), paths in by_manager.items():
        paths.sort()
        who = f'"{manager}" using {api_version}'
        if len(paths) == 1 and n == 1:
            parts.append(f"conflict with {who}: {_show(paths[0])}")
        else:
            parts.append(f"conflicts with {who}:\n" + "\n".join(f"- {_show(p)}" for p in paths))
        causes.extend({"reason": "FieldManagerConflict", "message": f"conflict with {who}", "field": _show(p)}
                      for p in paths)
    noun = "conflict" if n == 1 else "conflicts"
    return ApiStatusError(409, "Conflict", f"Apply failed with {n} {noun}: " + "\n".join(parts),
                          details={"causes": causes})


# -- ownership of non-apply writes ------------------------------------------------------------------------------

def update(old: JSONDict | None, new: JSONDict, shape: Shape, write: Write, request_entries: Any) -> None:
    """Set ``new``'s ``managedFields`` after an Update (create, replace or non-apply patch) from ``old``.

    :param request_entries: ``metadata.managedFields`` as the request body left it: ``[{}]`` resets ownership
        (no entries afterwards); anything else is ignored and the stored entries carry on.
    """
    if isinstance(request_entries, list) and len(request_entries) == 1 and request_entries[0] == {}:
        new.setdefault("metadata", {}).pop("managedFields", None)
        return
    entries = read_entries(old) if old is not None else []
    new_values = owned_paths(new, shape, write.subresource, write.status_subresource)
    old_values = owned_paths(old, shape, write.subresource, write.status_subresource) if old is not None else {}
    changed = {p for p, v in new_values.items()
               if p not in old_values or (p[-1] != "." and not _values_equal(old_values[p], v))}
    present = set(new_values)
    if write.status_subresource:
        # The other half of the object is not this write's: its fields stay as they are.
        present |= set(owned_paths(new, shape, None if write.subresource == "status" else "status",
                                   write.status_subresource))
    mine: Entry | None = None
    for entry in entries:
        if entry.manager == write.manager and entry.operation == "Update" and \
                entry.subresource == (write.subresource or ""):
            mine = entry
            continue
        entry.paths = (entry.paths - changed) & present
    if changed or mine is not None:
        if mine is None:
            mine = Entry(write.manager, "Update", write.api_version, write.time, write.subresource or "", set())
            entries.append(mine)
        before = set(mine.paths)
        mine.paths = (mine.paths | changed) & present
        if mine.paths != before:
            mine.time = write.time
            mine.api_version = write.api_version
    write_entries(new, entries)


def carry_entries(old: JSONDict, new: JSONDict) -> Any:
    """Take the request's ``managedFields`` out of ``new`` (returned, for :func:`update`) and put the stored
    entries back, so ownership is computed from what the server holds."""
    meta = new.setdefault("metadata", {})
    sent = meta.pop("managedFields", None)
    stored = (old.get("metadata") or {}).get("managedFields")
    if stored is not None:
        meta["managedFields"] = copy.deepcopy(stored)
    return sent


def keep_present(obj: JSONDict, shape: Shape, status_subresource: bool) -> None:
    """Drop from every entry the paths the stored object no longer has (pruned by the CRD schema, or under a
    removed parent)."""
    entries = read_entries(obj)
    if not entries:
        return
    present = set(owned_paths(obj, shape, None, status_subresource))
    if status_subresource:
        present |= set(owned_paths(obj, shape, "status", status_subresource))
    for entry in entries:
        entry.paths &= present
    write_entries(obj, entries)


def shape_of(schema: Mapping[str, Any] | None) -> Shape:
    """The root :class:`Shape` of an object whose type has ``schema`` (``None``: a built-in type)."""
    return Shape(schema, "", root=True)


def check_apply_params(params: Mapping[str, str]) -> tuple[str, bool]:
    """``(field manager, force)`` of an apply request.

    :raises ApiStatusError: 400 without ``fieldManager``, with a bad one, or with a bad ``force``.
    """
    if not params.get("fieldManager"):
        raise bad_request('PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required '
                          "for apply patch")
    force = params.get("force", "false")
    if force not in ("true", "false", "1", "0", ""):
        raise bad_request(f"invalid force value {force!r}")
    return manager_of(params, ""), force in ("true", "1")


def refuse_force(params: Mapping[str, str]) -> None:
    """``force`` on a non-apply patch is refused as the API server refuses it.

    :raises ApiStatusError: 422.
    """
    if params.get("force") in ("true", "1"):
        raise ApiStatusError(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: force: Forbidden: may not '
                                             "be specified for non-apply patch")
