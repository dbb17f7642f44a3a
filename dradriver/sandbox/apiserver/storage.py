"""The object store: objects by (resource, namespace, name), one resourceVersion counter for all of them
(like etcd's revision), and the writes (create, update, delete) with their server-side fields."""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dradriver.sandbox.apiserver import crds, resources, webhooks
from dradriver.sandbox.apiserver.admission import admit
from dradriver.sandbox.apiserver.errors import JSONDict, already_exists, bad_request, conflict, not_found
from dradriver.sandbox.apiserver.resources import ResourceType
from dradriver.sandbox.apiserver.selectors import FieldTerm, Requirement, selects
from dradriver.sandbox.apiserver.watch import EventLog

Key = tuple[ResourceType, str, str]
Manage = Callable[["JSONDict | None", JSONDict], None]
"""Sets a write's ``metadata.managedFields`` from the stored object (``None`` on create) and the new one
(:mod:`.fieldmanager`), called once the new object has its defaults."""


class Storage:
    """In-memory objects and their event log. Every method except :meth:`seeding` expects :attr:`lock` held.

    :param schema_version: OpenAPI schema version writes are checked against (not while :meth:`seeding`).
    :param types: the served resource types, shared with the request router; a CustomResourceDefinition
        written here registers, replaces or removes entries in it (:mod:`.crds`).
    """

    def __init__(self, *, schema_version: str | None = None, types: list[ResourceType] | None = None) -> None:
        self.types: list[ResourceType] = types if types is not None else list(resources.RESOURCE_TYPES)
        self._rlock = threading.RLock()
        self.lock = threading.Condition(self._rlock)
        self._changed: dict[str, threading.Condition] = {}
        """Per resource type, and per object name for ``metadata.name=`` watches (:func:`_wake_key`): the condition
        its watches wait on, over :attr:`lock`'s own lock, so a write wakes only the watches it concerns."""
        self.objects: dict[Key, JSONDict] = {}
        self.log = EventLog()
        self.rv = 0
        self.closing = False
        self._schema_version = schema_version
        self._seeding = False
        self.webhook_routes: webhooks.ServiceRoutes = {}
        """Where the webhooks of ValidatingWebhookConfigurations that name a Service listen (:mod:`.webhooks`)."""
        self._webhook_configs: dict[str, JSONDict] = {}
        """The stored ValidatingWebhookConfigurations by name (kept by :meth:`_record`: no scan per write)."""

    @contextmanager
    def seeding(self) -> Iterator[None]:
        """Writes inside skip the (slow) OpenAPI schema check: in-process seeding may store odd objects."""
        with self.lock:
            self._seeding = True
            try:
                yield
            finally:
                self._seeding = False

    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def _record(self, rt: ResourceType, type_: str, obj: JSONDict, old: JSONDict | None = None) -> None:
        self.log.append(rt, type_, obj, old)
        if rt.kind == webhooks.CONFIG_KIND and rt.group == webhooks.CONFIG_GROUP:
            name = str(obj["metadata"].get("name", ""))
            if type_ == "DELETED":
                self._webhook_configs.pop(name, None)
            else:
                self._webhook_configs[name] = obj
        for key in (_wake_key(rt), _wake_key(rt, str(obj["metadata"].get("name", "")))):
            waiting = self._changed.get(key)
            if waiting is not None:
                waiting.notify_all()

    def changed(self, rt: ResourceType, name: str | None = None) -> threading.Condition:
        """The condition a watch of ``rt`` waits on (hold :attr:`lock` to wait on it): notified by each write of an
        ``rt`` object (with ``name``: of an ``rt`` object of that name only, for a watch with the field selector
        ``metadata.name=<name>``, which the API server's watch cache also serves by that index) and by
        :meth:`wake_watches`."""
        key = _wake_key(rt, name)
        with self.lock:  # two watches asking at once must get the same condition
            waiting = self._changed.get(key)
            if waiting is None:
                waiting = self._changed[key] = threading.Condition(self._rlock)
            return waiting

    def wake_watches(self) -> None:
        """Wake every waiting watch (hold :attr:`lock`), e.g. to see :attr:`closing`."""
        self.lock.notify_all()
        for waiting in self._changed.values():
            waiting.notify_all()

    def key(self, rt: ResourceType, ns: str | None, name: str) -> Key:
        return (rt, (ns or "") if rt.namespaced else "", name)

    def _admit(self, rt: ResourceType, obj: JSONDict, old: JSONDict | None) -> None:
        admit(rt, obj, old, schema_version=None if self._seeding else self._schema_version,
              custom_schema=not self._seeding)
        if not self._seeding and self._webhook_configs:
            webhooks.run_validating_webhooks(list(self._webhook_configs.values()), rt,
                                             "CREATE" if old is None else "UPDATE", obj, old, self.webhook_routes)

    def _structure(self, rt: ResourceType, obj: JSONDict) -> None:
        """A custom resource with a CRD schema: prune undeclared fields (not while seeding), apply defaults."""
        if rt.schema is None:
            return
        if not self._seeding:
            crds.prune(obj, rt.schema.root)
        crds.apply_defaults(obj, rt.schema.root)

    # -- CustomResourceDefinitions ------------------------------------------------------------------------------
    @staticmethod
    def _is_crd(rt: ResourceType) -> bool:
        return rt.api_version == crds.CRD_API_VERSION and rt.kind == crds.CRD_KIND

    def _register_crd(self, crd: JSONDict) -> None:
        """Serve every served version of ``crd`` (replacing a type of the same group, version and plural) and
        stop serving its versions no longer served."""
        spec = crd["spec"]
        served: set[tuple[str, str, str]] = set()
        for group, version, plural, singular, kind, namespaced, status, short, schema in crds.types_of_crd(crd):
            served.add((group, version, plural))
            self._replace_type(resources.ResourceType(group, version, plural, singular, kind, namespaced,
                                                      status=status, short_names=short, custom=True,
                                                      schema=schema))
        for t in list(self.types):
            if (t.group, t.plural) == (spec["group"], spec["names"]["plural"]) and t.schema is not None \
                    and (t.group, t.version, t.plural) not in served:
                self._unregister_type(t)

    def _replace_type(self, new: ResourceType) -> None:
        for i, t in enumerate(self.types):
            if (t.group, t.version, t.plural) == (new.group, new.version, new.plural):
                self.types[i] = new
                if t != new:  # names or scope changed: objects move to the new type
                    for key in [k for k in self.objects if k[0] == t]:
                        self.objects[(new, key[1], key[2])] = self.objects.pop(key)
                return
        self.types.append(new)

    def _unregister_type(self, rt: ResourceType) -> None:
        """Delete every object of ``rt`` (as deleting its CRD does) and stop serving it; a type the emulator
        serves without a CRD falls back to its built-in entry."""
        for (t, ns, name) in [k for k in self.objects if k[0] == rt]:
            gone = self.objects.pop((t, ns, name))
            gone = copy.deepcopy(gone)
            gone["metadata"]["resourceVersion"] = str(self._next_rv())
            self._record(rt, "DELETED", gone)
        builtin = [t for t in resources.RESOURCE_TYPES if (t.group, t.version, t.plural) == (rt.group, rt.version,
                                                                                              rt.plural)]
        index = self.types.index(rt)
        if builtin:
            self.types[index] = builtin[0]
        else:
            del self.types[index]

    def _crd_gone(self, crd: JSONDict) -> None:
        for t in list(self.types):
            if t.schema is not None and t.schema.crd_name == crd["metadata"]["name"]:
                self._unregister_type(t)

    def existing(self, rt: ResourceType, ns: str | None, name: str) -> JSONDict:
        """The stored object (not a copy).

        :raises ApiStatusError: 404 ``NotFound``.
        """
        obj = self.objects.get(self.key(rt, ns, name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def list(
        self, rt: ResourceType, ns: str | None, labels: list[Requirement], fields: list[FieldTerm]
    ) -> list[JSONDict]:
        """The stored objects (not copies) that match, sorted by namespace and name."""
        items = [
            o
            for (t, ons, _), o in self.objects.items()
            if t == rt and (ns is None or ons == ns) and selects(o, labels, fields)
        ]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return items

    def create(self, rt: ResourceType, ns: str | None, obj: JSONDict, *, keep_status: bool,
               manage: Manage | None = None) -> JSONDict:
        """Store ``obj`` (taken over, not copied) with the server's fields; returns a copy.

        :param manage: sets the object's field ownership (:data:`Manage`); without it the object has none.

        :raises ApiStatusError: 400 for a body of another kind or namespace, 409 ``AlreadyExists``, 422.
        """
        if obj.get("apiVersion", rt.api_version) != rt.api_version or obj.get("kind", rt.kind) != rt.kind:
            raise bad_request(
                f"the API version in the data ({obj.get('apiVersion')}) and kind "
                f"({obj.get('kind')}) do not match {rt.api_version} {rt.kind}"
            )
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            for _ in range(100):
                candidate = resources.generate_name(str(meta["generateName"]))
                if self.key(rt, ns, candidate) not in self.objects:
                    meta["name"] = candidate
                    break
        if rt.status and not keep_status and not rt.keep_status_on_create:
            obj.pop("status", None)
        for server_field in resources.CREATE_SERVER_FIELDS:
            meta.pop(server_field, None)
        self._structure(rt, obj)
        if manage is not None:
            manage(None, obj)
        self._admit(rt, obj, None)
        key = self.key(rt, ns, meta["name"])
        if key in self.objects:
            raise already_exists(rt, meta["name"])
        if self._is_crd(rt):
            obj["status"] = crds.crd_status(obj, resources.now())
            self._register_crd(obj)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = resources.now()
        if "spec" in obj:
            meta["generation"] = 1
        meta["resourceVersion"] = str(self._next_rv())
        self.objects[key] = obj
        self._record(rt, "ADDED", obj)
        return copy.deepcopy(obj)

    def update(
        self, rt: ResourceType, ns: str | None, name: str, new: JSONDict, subresource: str | None,
        manage: Manage | None = None,
    ) -> JSONDict:
        """Replace the object (or only its ``status``); a no-op write keeps the resourceVersion. Returns a copy.

        :param manage: sets the object's field ownership (:data:`Manage`); without it the stored
            ``managedFields`` are kept as they are.

        :raises ApiStatusError: 404, 409 ``Conflict`` on a stale resourceVersion or another uid, 400, 422.
        """
        old = self.existing(rt, ns, name)
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
            )
        if rt.namespaced and meta.get("namespace", ns) != ns:
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        if meta.get("uid") and meta["uid"] != old["metadata"]["uid"]:
            raise conflict(
                rt,
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, UID in object "
                f"meta: {old['metadata']['uid']}",
            )
        if meta.get("resourceVersion") and meta["resourceVersion"] != old["metadata"]["resourceVersion"]:
            raise conflict(
                rt,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if subresource == "status":
            new = resources.write_status_subresource(old, new)
        else:
            new["apiVersion"], new["kind"] = rt.api_version, rt.kind
            for server_field in resources.UPDATE_SERVER_FIELDS:
                if server_field in old["metadata"]:
                    meta[server_field] = old["metadata"][server_field]
                else:
                    meta.pop(server_field, None)
            meta["name"] = name
            if rt.namespaced:
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            resources.keep_stored_status(rt, old, new)
        self._structure(rt, new)
        if manage is not None:
            manage(old, new)
        elif "managedFields" in old["metadata"]:
            new["metadata"]["managedFields"] = old["metadata"]["managedFields"]
        else:
            new["metadata"].pop("managedFields", None)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)  # a no-op write: no new resourceVersion, no watch event
        self._admit(rt, new, old)
        if "generation" in old["metadata"] and resources.spec_changed(old, new):
            new["metadata"]["generation"] = int(old["metadata"]["generation"]) + 1
        new["metadata"]["resourceVersion"] = str(self._next_rv())
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self.objects[self.key(rt, ns, name)]
            self._record(rt, "DELETED", new, old)
            self.collect_garbage(new["metadata"]["uid"])
            if self._is_crd(rt):
                self._crd_gone(new)
            return copy.deepcopy(new)
        self.objects[self.key(rt, ns, name)] = new
        self._record(rt, "MODIFIED", new, old)
        if self._is_crd(rt) and subresource != "status":
            self._register_crd(new)
        return copy.deepcopy(new)

    def delete(self, rt: ResourceType, ns: str | None, name: str, options: Mapping[str, Any]) -> JSONDict:
        """Delete as ``DeleteOptions`` ask (preconditions, dryRun, propagationPolicy); finalizers only mark
        the object with a ``deletionTimestamp``. Returns the last state.

        :raises ApiStatusError: 404, 409 ``Conflict`` on a failed precondition.
        """
        obj = self.existing(rt, ns, name)
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != obj["metadata"]["uid"]:
            raise conflict(
                rt,
                name,
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                f"meta: {obj['metadata']['uid']}",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise conflict(
                rt,
                name,
                f"Precondition failed: ResourceVersion in precondition: "
                f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                f"{obj['metadata']['resourceVersion']}",
            )
        if options.get("dryRun"):
            return copy.deepcopy(obj)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(obj)
            old = copy.deepcopy(obj)
            obj["metadata"]["deletionTimestamp"] = resources.now()
            obj["metadata"]["deletionGracePeriodSeconds"] = 0
            obj["metadata"]["resourceVersion"] = str(self._next_rv())
            self._record(rt, "MODIFIED", obj, old)
            return copy.deepcopy(obj)
        del self.objects[self.key(rt, ns, name)]
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self._next_rv())
        self._record(rt, "DELETED", gone, obj)
        if options.get("propagationPolicy") != "Orphan":
            self.collect_garbage(obj["metadata"]["uid"])
        if self._is_crd(rt):
            self._crd_gone(obj)
        return gone

    def collect_garbage(self, owner_uid: str) -> None:
        """The garbage collector's job for dependents whose ownerReferences name ``owner_uid``: delete those with
        no other owner that still exists; drop the dangling references of those that keep one (as the real
        collector does for, e.g., a ComputeDomainClique owned by every daemon Pod of the clique)."""
        dependents = [(t, ns, name) for (t, ns, name), o in self.objects.items() if resources.owned_by(o, owner_uid)]
        live = {o["metadata"].get("uid") for o in self.objects.values()}
        for t, ns, name in dependents:
            key = self.key(t, ns, name)
            obj = self.objects.get(key)
            if obj is None:
                continue
            refs = obj["metadata"].get("ownerReferences") or []
            kept = [r for r in refs if r.get("uid") != owner_uid and r.get("uid") in live]
            if not kept:
                self.delete(t, ns or None, name, {})
                continue
            new = copy.deepcopy(obj)
            new["metadata"]["ownerReferences"] = kept
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self.objects[key] = new
            self._record(t, "MODIFIED", new, obj)


def _wake_key(rt: ResourceType, name: str | None = None) -> str:
    """The key of :meth:`Storage.changed`'s conditions: ``group/plural``, with ``/name`` for one object's watches."""
    return f"{rt.group}/{rt.plural}" + (f"/{name}" if name is not None else "")
