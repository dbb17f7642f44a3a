"""Publishing this node's ResourceSlices: a reconciler for one pool, modelled on the Go helper.

Input: the desired ``resource.k8s.io/v1`` ResourceSlice objects of this node's pool, already split by
:mod:`dradriver.domain.resourceslices` (dicts with ``spec``; no ``metadata.name``). The publisher owns
``metadata.generateName``, ``metadata.ownerReferences`` (the Node, ``controller: true``; its UID from a
Node GET), ``spec.driver``, ``spec.nodeName``, and ``spec.pool`` (``name``, ``generation``,
``resourceSliceCount``); values the builder put there are checked (driver, node, pool name) or replaced
(generation, count).

One sync (:meth:`SlicePublisher.publish`) follows ``resourceslice/resourceslicecontroller.go``
(``resourceslice/resourceslicecontroller.go`` in k8s.io/dynamic-resource-allocation), with slices matched by index as in
Kubernetes 1.36:

1. LIST slices with ``fieldSelector=spec.driver=<driver>,spec.nodeName=<node>`` and keep those of our
   pool; other drivers', nodes' and pools' slices are never read, written or deleted.
2. Current generation = the highest ``spec.pool.generation`` seen; lower generations are obsolete.
3. Existing slices are matched to desired slice *i* by the name prefix ``<i as zero-padded hex>-``
   (``generateName = <index>-<driver>-<node>-``; width ``max(5, hex digits of n-1)``); unmatched or
   duplicate ones are obsolete.
4. Generation: kept when no slice is new and at most one matched slice changed (one update is atomic);
   otherwise current + 1, and then every matched slice is rewritten so the whole pool carries it.
5. Writes: DELETE obsolete slices (preconditions uid + resourceVersion; 404 ignored), then UPDATE
   changed ones, then CREATE missing ones. Nothing is written when the pool already matches.

The API server may store a slice differently from what was sent (quantities canonicalised, fields
dropped by a disabled feature gate). The publisher remembers what each sent spec came back as, so the
next comparison treats that stored form as equal instead of updating forever (the Go helper's
``DroppedFieldsError`` handling, without the error).

:meth:`SlicePublisher.run` is the long-running loop: :meth:`SlicePublisher.update` hands it a new desired
state (bursts coalesce: only the newest state is published), a watch on our slices schedules a re-sync
after :attr:`resync_delay_s` when someone else changes or deletes them (the kubelet deletes a node's
slices when it starts), a periodic re-sync catches anything missed, and API failures are retried with
exponential backoff. Invalid desired slices (duplicate device names, another driver's spec) are
reported and not retried, like the Go helper's pre-validation.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from dradriver.domain.resourceslices import ResourceSliceError
from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient
from dradriver.kube.nodes import get_node

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
_SLICES = "/apis/resource.k8s.io/v1/resourceslices"  # through KubeClient.raw: no ResourceV1Api at all


def _slice_path(name: str) -> str:
    return f"{_SLICES}/{quote(name, safe='')}"
_INDEX_MIN_LENGTH = 5  # resourceSliceIndexMinLength in the Go helper
_SEPARATOR = "-"


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What one sync did.

    :param generation: ``spec.pool.generation`` the pool carries after the sync.
    :param slices: names of the pool's slices after the sync, in desired order.
    """

    generation: int
    created: int
    updated: int
    deleted: int
    slices: tuple[str, ...]

    @property
    def wrote(self) -> bool:
        """True when the sync changed anything on the API server."""
        return bool(self.created or self.updated or self.deleted)


def index_length(count: int) -> int:
    """Width of the hex index prefix for a pool of ``count`` slices (at least 5)."""
    return max(_INDEX_MIN_LENGTH, len(format(max(count - 1, 0), "x")))


def encode_index(index: int, length: int) -> str:
    """``index`` as lower-case hex, zero-padded to ``length``."""
    return format(index, f"0{length}x")


def slice_generate_name(index: int, count: int, driver: str, node_name: str) -> str:
    """``metadata.generateName`` of slice ``index`` of a pool of ``count`` slices, as :class:`SlicePublisher`
    creates it: ``<index as zero-padded hex>-<driver>-<node>-`` (the server appends 5 random characters)."""
    return f"{encode_index(index, index_length(count))}{_SEPARATOR}{driver}{_SEPARATOR}{node_name}{_SEPARATOR}"


def decode_index(name: str, length: int) -> int:
    """The index encoded at the start of a slice name, or -1 when the prefix is not ``length`` hex digits."""
    cut = name.find(_SEPARATOR)
    if cut != length:
        return -1
    try:
        return int(name[:cut], 16)
    except ValueError:
        return -1


def _clean(value: Any) -> Any:
    """Deep copy without ``None`` values (the API omits them; comparing must too)."""
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _fingerprint(spec: Mapping[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class _Desired:
    spec: JSONDict  # without spec.pool
    labels: JSONDict
    annotations: JSONDict


class SlicePublisher:
    """Reconciles the ResourceSlices of one node-local pool.

    :param client: API client (blocking); :meth:`run` calls it from a worker thread.
    :param driver: driver name, ``spec.driver`` (the plugin identity's driver name).
    :param node_name: ``spec.nodeName`` and owner; also the pool name unless ``pool_name`` is given.
    :param node_uid: the Node's UID for the owner reference; looked up with a Node GET when empty.
    :param on_error: called with every sync failure (metrics, Events); must not raise.
    :param on_publish: called with every successful sync's :class:`PublishResult`.
    :param resync_delay_s: delay between a watch event from someone else and the re-sync (seconds).
    :param resync_period_s: periodic re-sync even without events (seconds).
    :param coalesce_s: how long :meth:`update` waits for further updates before publishing (seconds).
    :param backoff_initial_s: first retry delay after a failed sync; doubles up to ``backoff_max_s``.
    :param watch: watch our slices (False: rely on the periodic re-sync).
    :param watch_timeout_s: ``timeoutSeconds`` of each watch request; the watch is re-opened after it.
    """

    def __init__(self, client: KubeClient, *, driver: str, node_name: str, pool_name: str = "", node_uid: str = "",
                 on_error: Callable[[Exception], None] | None = None,
                 on_publish: Callable[[PublishResult], None] | None = None,
                 resync_delay_s: float = 1.0, resync_period_s: float = 600.0, coalesce_s: float = 0.05,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 60.0,
                 watch: bool = True, watch_timeout_s: float = 300.0) -> None:
        self.client = client
        self.driver = driver
        self.node_name = node_name
        self.pool_name = pool_name or node_name
        self.node_uid = node_uid
        self.on_error = on_error
        self.on_publish = on_publish
        self.resync_delay_s = resync_delay_s
        self.resync_period_s = resync_period_s
        self.coalesce_s = coalesce_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.watch = watch
        self.watch_timeout_s = watch_timeout_s
        self.last_result: PublishResult | None = None
        self.last_error: Exception | None = None
        """The failure of the newest sync attempt; ``None`` once a sync succeeded after it."""
        self.failures = 0
        self._publish_lock = threading.Lock()
        self._state = threading.Lock()
        self._desired: list[Mapping[str, Any]] | None = None
        self._due_at: float | None = None  # time.monotonic() when the next sync is due
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stored_as: dict[str, JSONDict] = {}
        self._own_writes: dict[str, None] = {}  # resourceVersions we produced (bounded, insertion ordered)
        self._own_deletes: dict[str, None] = {}  # UIDs we deleted

    # ------------------------------------------------------------------------------------ one sync
    def _selector(self) -> str:
        return f"spec.driver={self.driver},spec.nodeName={self.node_name}"

    def _ours(self, obj: Mapping[str, Any]) -> bool:
        spec = obj.get("spec") or {}
        return (spec.get("driver") == self.driver and spec.get("nodeName") == self.node_name
                and (spec.get("pool") or {}).get("name") == self.pool_name)

    def _prepare(self, desired: Sequence[Mapping[str, Any]]) -> list[_Desired]:
        out: list[_Desired] = []
        names: set[str] = set()
        for i, obj in enumerate(desired):
            where = f"desired ResourceSlice {i} of pool {self.pool_name}"
            if not isinstance(obj, Mapping) or not isinstance(obj.get("spec"), Mapping):
                raise ResourceSliceError(f"{where}: spec is missing")
            if obj.get("apiVersion", API_VERSION) != API_VERSION or obj.get("kind", KIND) != KIND:
                raise ResourceSliceError(f"{where}: apiVersion/kind is {obj.get('apiVersion')}/{obj.get('kind')}, "
                                         f"expected {API_VERSION}/{KIND}")
            spec = _clean(obj["spec"])
            for key, ours in (("driver", self.driver), ("nodeName", self.node_name)):
                if spec.get(key, ours) != ours:
                    raise ResourceSliceError(f"{where}: spec.{key} is {spec[key]!r}, this publisher owns {ours!r}")
            pool = spec.pop("pool", None) or {}
            if pool.get("name", self.pool_name) != self.pool_name:
                raise ResourceSliceError(f"{where}: spec.pool.name is {pool['name']!r}, expected {self.pool_name!r}")
            for key in ("nodeSelector", "allNodes", "perDeviceNodeSelection"):
                if spec.get(key):
                    raise ResourceSliceError(f"{where}: spec.{key} is set; a node-local pool uses spec.nodeName")
            spec["driver"] = self.driver
            spec["nodeName"] = self.node_name
            for j, dev in enumerate(spec.get("devices") or []):
                name = dev.get("name") if isinstance(dev, Mapping) else None
                if not name:
                    raise ResourceSliceError(f"{where}: spec.devices[{j}].name is missing")
                if name in names:
                    raise ResourceSliceError(f"{where}: device name {name!r} appears twice in pool {self.pool_name}")
                names.add(name)
            meta = obj.get("metadata") or {}
            out.append(_Desired(spec, dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})))
        return out

    def _same(self, existing: Mapping[str, Any], desired: JSONDict) -> bool:
        current = _clean(existing.get("spec") or {})
        return current == desired or current == self._stored_as.get(_fingerprint(desired))

    def _remember(self, sent: JSONDict, stored: Mapping[str, Any]) -> None:
        spec = _clean(stored.get("spec") or {})
        if spec != sent:
            log.info("API server stored ResourceSlice %s differently from what was sent (fields normalised or "
                     "dropped); treating the stored form as current", (stored.get("metadata") or {}).get("name"))
            self._stored_as[_fingerprint(sent)] = spec
        rv = (stored.get("metadata") or {}).get("resourceVersion")
        if rv:
            self._own_writes[str(rv)] = None
            while len(self._own_writes) > 1024:
                self._own_writes.pop(next(iter(self._own_writes)))

    def _owner(self) -> JSONDict:
        if not self.node_uid:
            self.node_uid = get_node(self.client, self.node_name).uid
        return {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self.node_uid,
                "controller": True}

    def publish(self, desired: Sequence[Mapping[str, Any]]) -> PublishResult:
        """Make the API server's slices of this pool equal ``desired`` (one blocking sync).

        :param desired: the pool's slices in order; an empty sequence deletes every slice of the pool.
        :raises ResourceSliceError: ``desired`` is invalid (not retried by :meth:`run`).
        :raises errors.KubeAPIError: an API call failed (after the client's own retries); a 409 means
            someone changed a slice between our LIST and write, and the next sync resolves it.
        """
        want = self._prepare(desired)
        with self._publish_lock:
            owner = self._owner() if want else None
            listing = self.client.call(f"LIST resourceslices {self._selector()}", self.client.raw("GET", _SLICES),
                                       field_selector=self._selector())
            existing = sorted((s for s in listing.get("items") or [] if self._ours(s)),
                              key=lambda s: s["metadata"]["name"])
            generation = max((int((s["spec"].get("pool") or {}).get("generation", 0)) for s in existing), default=0)
            width = index_length(len(want))
            matched: dict[int, JSONDict] = {}
            obsolete: list[JSONDict] = []
            for s in existing:
                index = decode_index(s["metadata"]["name"], width)
                if (int(s["spec"]["pool"].get("generation", 0)) < generation or not 0 <= index < len(want)
                        or index in matched):
                    obsolete.append(s)
                else:
                    matched[index] = s
            pool: JSONDict = {"name": self.pool_name, "generation": generation, "resourceSliceCount": len(want)}

            def full_spec(i: int) -> JSONDict:
                return {**want[i].spec, "pool": dict(pool)}

            changed = {i for i, s in matched.items() if not self._same(s, full_spec(i))}
            new = [i for i in range(len(want)) if i not in matched]
            bumped = bool(new) or len(changed) > 1
            if bumped:
                pool["generation"] = generation + 1
            deleted = updated = created = 0
            for s in obsolete:
                meta = s["metadata"]
                options: JSONDict = {"preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}}
                try:
                    self.client.call(f"DELETE resourceslices {meta['name']}",
                                     self.client.raw("DELETE", _slice_path(meta["name"])), body=options)
                    self._own_deletes[meta["uid"]] = None
                    while len(self._own_deletes) > 1024:
                        self._own_deletes.pop(next(iter(self._own_deletes)))
                    deleted += 1
                except errors.KubeNotFoundError:
                    log.debug("ResourceSlice %s was already deleted", meta["name"])
            names: dict[int, str] = {}
            for i, s in sorted(matched.items()):
                names[i] = s["metadata"]["name"]
                if i not in changed and not bumped:
                    continue
                body: JSONDict = copy.deepcopy(s)
                body.setdefault("apiVersion", API_VERSION)
                body.setdefault("kind", KIND)
                body["spec"] = full_spec(i)
                stored = self.client.call(f"PUT resourceslices {names[i]}",
                                          self.client.raw("PUT", _slice_path(names[i])), body=body)
                self._remember(body["spec"], stored)
                updated += 1
            for i in new:
                created_meta: JSONDict = {
                    "generateName": slice_generate_name(i, len(want), self.driver, self.node_name),
                    "ownerReferences": [owner],
                }
                if want[i].labels:
                    created_meta["labels"] = want[i].labels
                if want[i].annotations:
                    created_meta["annotations"] = want[i].annotations
                body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": created_meta, "spec": full_spec(i)}
                stored = self.client.call(f"POST resourceslices {created_meta['generateName']}",
                                          self.client.raw("POST", _SLICES), body=body)
                self._remember(body["spec"], stored)
                names[i] = stored["metadata"]["name"]
                created += 1
            result = PublishResult(generation=int(pool["generation"]), created=created, updated=updated,
                                   deleted=deleted, slices=tuple(names[i] for i in range(len(want))))
        if result.wrote:
            log.info("published pool %s of driver %s: generation %d, %d slice(s): %d created, %d updated, "
                     "%d deleted", self.pool_name, self.driver, result.generation, len(want), created, updated, deleted)
        self.last_result = result
        return result

    @property
    def in_sync(self) -> bool:
        """True when the pool was published and the newest sync attempt succeeded (the readiness probe)."""
        return self.last_result is not None and self.last_error is None

    # ---------------------------------------------------------------------------------- the loop
    def update(self, desired: Sequence[Mapping[str, Any]]) -> None:
        """Hand :meth:`run` a new desired state (thread-safe; the newest state wins)."""
        snapshot: list[Mapping[str, Any]] = [copy.deepcopy(dict(s)) for s in desired]
        self._schedule(delay=self.coalesce_s, desired=snapshot)

    def resync(self, delay_s: float = 0.0) -> None:
        """Ask :meth:`run` to re-sync after ``delay_s`` seconds (thread-safe)."""
        self._schedule(delay=delay_s)

    def _schedule(self, *, delay: float, desired: list[Mapping[str, Any]] | None = None) -> None:
        with self._state:
            if desired is not None:
                self._desired = desired
            due = time.monotonic() + delay
            if self._due_at is None or due < self._due_at:
                self._due_at = due
        self._kick()

    def _kick(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def stop(self) -> None:
        """Make :meth:`run` return (thread-safe); the watch thread ends with its current request."""
        self._stopping.set()
        self._kick()

    async def run(self) -> None:
        """Publish and keep publishing until :meth:`stop` or cancellation (a stopped publisher stays stopped).

        Nothing is published before the first :meth:`update`. Failures go to ``on_error`` and are retried
        after ``backoff_initial_s``, doubling up to ``backoff_max_s``; a success resets the backoff.
        """
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        watcher: threading.Thread | None = None
        if self.watch:
            watcher = threading.Thread(target=self._watch_slices, name=f"resourceslice-watch-{self.pool_name}",
                                       daemon=True)
            watcher.start()
        backoff = self.backoff_initial_s
        try:
            while not self._stopping.is_set():
                with self._state:
                    due_at = self._due_at
                    desired = self._desired
                now = time.monotonic()
                if due_at is None or due_at > now or desired is None:
                    timeout = None if due_at is None else max(0.0, due_at - now)
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    except TimeoutError:
                        pass
                    if desired is None and due_at is not None and due_at <= time.monotonic():
                        with self._state:  # a re-sync asked for before the first update: nothing to do
                            if self._desired is None:
                                self._due_at = None
                    continue
                with self._state:
                    self._due_at = None
                try:
                    result = await asyncio.to_thread(self.publish, desired)
                except ResourceSliceError as exc:
                    log.error("not publishing pool %s: %s", self.pool_name, exc)
                    self.last_error = exc
                    self._report(exc)
                    continue
                except Exception as exc:  # API errors and anything unexpected: report, back off, keep going
                    self.failures += 1
                    self.last_error = exc
                    if isinstance(exc, errors.KubeAPIError | OSError):
                        log.warning("publishing pool %s failed, retrying in %.2fs: %s", self.pool_name, backoff, exc)
                    else:
                        log.error("publishing pool %s failed unexpectedly, retrying in %.2fs", self.pool_name,
                                  backoff, exc_info=exc)
                    self._report(exc)
                    self.resync(backoff)
                    backoff = min(backoff * 2, self.backoff_max_s)
                    continue
                backoff = self.backoff_initial_s
                self.last_error = None
                if self.on_publish is not None:
                    try:
                        self.on_publish(result)
                    except Exception:
                        log.exception("on_publish callback failed")
                self.resync(self.resync_period_s)
        finally:
            self._stopping.set()
            self._loop = None
            self._wake = None
            if watcher is not None:
                log.debug("watch thread for pool %s ends with its current request", self.pool_name)

    def _report(self, exc: Exception) -> None:
        if self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception:  # a metrics hook must not stop publishing
                log.exception("on_error callback failed")

    def _watch_slices(self) -> None:
        """Thread: watch our slices; changes made by others schedule a re-sync after ``resync_delay_s``."""
        backoff = self.backoff_initial_s
        resource_version = ""
        while not self._stopping.is_set():
            try:
                kwargs: dict[str, Any] = {"field_selector": self._selector(), "allow_watch_bookmarks": True}
                if resource_version:
                    kwargs["resource_version"] = resource_version
                for event in self.client.stream(f"WATCH resourceslices {self._selector()}",
                                                self.client.raw("GET", _SLICES),
                                                timeout_s=self.watch_timeout_s, **kwargs):
                    if self._stopping.is_set():
                        return
                    kind = event.get("type")
                    obj = event.get("object") or {}
                    meta = obj.get("metadata") or {}
                    if kind == "ERROR":
                        resource_version = ""  # 410 Expired: start over from the current state
                        break
                    resource_version = str(meta.get("resourceVersion") or resource_version)
                    if kind not in ("ADDED", "MODIFIED", "DELETED") or not self._ours(obj):
                        continue
                    if kind == "DELETED" and meta.get("uid") in self._own_deletes:
                        continue
                    if kind != "DELETED" and str(meta.get("resourceVersion")) in self._own_writes:
                        continue
                    log.debug("ResourceSlice %s %s by someone else; re-sync in %.1fs", meta.get("name"),
                              kind.lower(), self.resync_delay_s)
                    self.resync(self.resync_delay_s)
                backoff = self.backoff_initial_s
            except Exception as exc:  # the watch must outlive any one bad response
                if self._stopping.is_set():
                    return
                if isinstance(exc, errors.KubeAPIError):
                    log.debug("watch on ResourceSlices ended: %s; re-opening in %.2fs", exc, backoff)
                else:
                    log.warning("watch on ResourceSlices failed unexpectedly; re-opening in %.2fs", backoff,
                                exc_info=exc)
                resource_version = ""
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
