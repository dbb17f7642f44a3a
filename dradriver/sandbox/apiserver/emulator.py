"""``ApiServerEmulator``: lifecycle (bind, serve, stop), kubeconfig, faults and request records, and the
in-process helpers tests seed and inspect objects with."""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dradriver.sandbox.apiserver import crds as crd_manifests
from dradriver.sandbox.apiserver import resources
from dradriver.sandbox.apiserver.errors import JSONDict
from dradriver.sandbox.apiserver.faults import Fault
from dradriver.sandbox.apiserver.flowcontrol import (
    FlowControlSettings,
    Latency,
    flow_control_from_env,
    latency_from_env,
)
from dradriver.sandbox.apiserver.handler import RequestHandler, RequestRecord, ServerState, serve_request
from dradriver.sandbox.apiserver.resources import RESOURCE_TYPES, ResourceType
from dradriver.sandbox.apiserver.storage import Storage


class _Server(ThreadingHTTPServer):
    """The HTTP server, quiet about clients that hung up (a closed watch, a timed-out request): the API server
    logs nothing for them either; any other error in a request thread keeps the library's traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
            return
        super().handle_error(request, client_address)


class ApiServerEmulator:
    """An in-memory Kubernetes API server on ``127.0.0.1`` and a random port.

    :param schema_version: when set (e.g. ``"1.34"``), every created or updated object is also validated
        against that Kubernetes version's OpenAPI schema with ``kubernetes_validate`` (a test dependency);
        a failure is answered with 422 ``Invalid``. Objects seeded in process (:meth:`create`,
        :meth:`update`) skip this check, so tests can seed deliberately odd objects.
    :param host: interface to bind; the default keeps the emulator off the network.
    :param latency: seconds added to each HTTP read, write and watch event (:mod:`.flowcontrol`); ``None``
        reads ``DRADRIVER_APISERVER_LATENCY`` (unset: none), so the sandbox and the demos take it from their
        environment.
    :param flow_control: the API Priority and Fairness limit HTTP requests pass (429 with ``Retry-After`` past
        it); ``None`` reads ``DRADRIVER_APISERVER_FLOW_CONTROL`` (unset: no limit). In-process helpers pass
        neither.
    :raises flowcontrol.SettingsError: an environment setting that cannot be read.
    """

    def __init__(self, *, schema_version: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 latency: Latency | None = None, flow_control: FlowControlSettings | None = None) -> None:
        self._types: list[ResourceType] = list(RESOURCE_TYPES)
        self._storage = Storage(schema_version=schema_version, types=self._types)
        self._lock = self._storage.lock
        # the address a request was served on: kept after stop, for a request a connection thread is still serving
        self._state = ServerState(self._types, self._storage, lambda: self._address,
                                  latency=latency if latency is not None else latency_from_env(os.environ))
        self._state.limit(flow_control if flow_control is not None else flow_control_from_env(os.environ))
        self._host = host
        self._port = port
        self._address = f"{host}:{port}"
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        for ns in ("default", "kube-system"):
            self.create(
                {
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {"name": ns},
                    "status": {"phase": "Active"},
                }
            )

    # -------------------------------------------------------------------------------------- lifecycle
    def start(self) -> ApiServerEmulator:
        """Bind and serve in a background thread; returns ``self``."""
        if self._server is not None:
            return self
        state = self._state

        class Handler(RequestHandler):
            pass

        Handler.state = state
        server = _Server((self._host, self._port), Handler)
        server.daemon_threads = True
        self._server = server
        self._address = f"{self._host}:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="apiserver-emulator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; open watch streams end, in-memory objects stay readable."""
        with self._lock:
            self._storage.closing = True
            self._storage.wake_watches()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None
        self._thread = None

    def __enter__(self) -> ApiServerEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def handle(self, handler: RequestHandler) -> None:
        """Serve one HTTP request (called from the per-connection thread)."""
        serve_request(self._state, handler)

    @property
    def port(self) -> int:
        """The TCP port the server listens on (after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the API server emulator is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self._host}:{self.port}"

    def kubeconfig(self) -> JSONDict:
        """A kubeconfig (as a dict) pointing at this server, usable by the Python client and ``kubectl``."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": "default"},
                }
            ],
            "current-context": "emulator",
            "preferences": {},
        }

    def kubeconfig_path(self, directory: str | Path) -> str:
        """Write :meth:`kubeconfig` to ``<directory>/kubeconfig`` (JSON is valid YAML); return its path."""
        path = Path(directory) / "kubeconfig"
        path.write_text(json.dumps(self.kubeconfig(), indent=2) + "\n", encoding="utf-8")
        return str(path)

    # ---------------------------------------------------------------------------- faults and records
    def fail_next(
        self,
        count: int = 1,
        *,
        status: int = 500,
        method: str | None = None,
        path: str | re.Pattern[str] | None = None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the next ``count`` matching requests with ``status`` instead of serving them.

        :param method: HTTP method to match (``"PUT"``), or any.
        :param path: a URL path matched exactly or as a prefix of ``/``-separated segments, or a regular
            expression searched in the path; ``None`` matches every path.
        :param retry_after: value of the ``Retry-After`` header (seconds), e.g. for 429.
        """
        with self._state.records_lock:
            self._state.faults.append(Fault(count, status, method, path, retry_after))

    def hang_next(self, count: int = 1, *, seconds: float, method: str | None = None,
                  path: str | re.Pattern[str] | None = None) -> None:
        """Serve the next ``count`` matching requests only after ``seconds`` (a hung API server); the server
        answers other requests meanwhile. Matching as for :meth:`fail_next`."""
        with self._state.records_lock:
            self._state.faults.append(Fault(count, 0, method, path, None, delay_s=seconds))

    @property
    def latency(self) -> Latency:
        """The injected per-request latency (:mod:`.flowcontrol`)."""
        return self._state.latency

    @latency.setter
    def latency(self, value: Latency) -> None:
        self._state.latency = value

    def limit(self, settings: FlowControlSettings | None) -> None:
        """Install (``None``: remove) the API Priority and Fairness limit for the requests that arrive from now."""
        self._state.limit(settings)

    @property
    def rejected(self) -> int:
        """Requests the API Priority and Fairness limit answered 429 (since :meth:`limit`)."""
        flow = self._state.flow_control
        return flow.rejected if flow is not None else 0

    def faults_left(self) -> int:
        """How many more requests the queued faults will still answer (0: every fault has fired; a hung
        request is then in flight or served)."""
        with self._state.records_lock:
            return sum(f.remaining for f in self._state.faults)

    def clear_faults(self) -> None:
        """Drop every fault :meth:`fail_next` queued that has not fired yet."""
        with self._state.records_lock:
            self._state.faults.clear()

    def respond_next(
        self,
        body: bytes,
        count: int = 1,
        *,
        status: int = 200,
        method: str | None = None,
        path: str | re.Pattern[str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        """Answer the next ``count`` matching requests with ``body`` as is (``method``/``path`` as in
        :meth:`fail_next`): a raw response the emulator would not produce, e.g. a JSON object nested deeper
        than it can store or encode."""
        with self._state.records_lock:
            self._state.faults.append(Fault(count, status, method, path, None, body=body, content_type=content_type))

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request received so far, oldest first (a copy)."""
        with self._state.records_lock:
            return list(self._state.records)

    def count(
        self,
        verb: str | None = None,
        resource: str | None = None,
        *,
        subresource: str | None = None,
        name: str | None = None,
        namespace: str | None = None,
        code: int | None = None,
    ) -> int:
        """Number of recorded requests matching every given filter (``resource`` is the plural)."""
        with self._state.records_lock:
            return sum(
                1
                for r in self._state.records
                if (verb is None or r.verb == verb)
                and (resource is None or r.resource == resource)
                and (subresource is None or r.subresource == subresource)
                and (name is None or r.name == name)
                and (namespace is None or r.namespace == namespace)
                and (code is None or r.code == code)
            )

    def clear_requests(self) -> None:
        """Forget the recorded requests (not the objects)."""
        with self._state.records_lock:
            self._state.records.clear()

    def route_service(self, namespace: str, name: str, host: str, port: int) -> None:
        """Reach Service ``namespace/name`` at ``host:port`` when a ValidatingWebhookConfiguration's
        ``clientConfig.service`` names it (the emulator runs no Services; :mod:`.webhooks`)."""
        with self._lock:
            self._storage.webhook_routes[(namespace, name)] = (host, port)

    # --------------------------------------------------------------------------- in-process helpers
    def resource_type(self, kind: str, api_version: str | None = None) -> ResourceType:
        """Find a resource by kind (``"ResourceSlice"``), plural (``"resourceslices"``), ``plural.group``
        (``"events.events.k8s.io"``) or short name; ``api_version`` disambiguates a kind.

        :raises KeyError: unknown resource.
        """
        return resources.find_resource_type(self._types, kind, api_version)

    def create(self, obj: Mapping[str, Any], *, keep_status: bool = True) -> JSONDict:
        """Store a new object as a client's create would (server fields assigned); returns a copy.

        :param keep_status: keep ``status`` as given (seeding, e.g. an allocated claim); HTTP creates drop it
            for resources with a status subresource, as the real server does.
        :raises ApiStatusError: 409 ``AlreadyExists``, 422 ``Invalid``.
        """
        rt = self.resource_type(str(obj.get("kind", "")), obj.get("apiVersion"))
        ns = (obj.get("metadata") or {}).get("namespace") or ("default" if rt.namespaced else None)
        with self._storage.seeding():
            return self._storage.create(rt, ns, copy.deepcopy(dict(obj)), keep_status=keep_status)

    def get(self, kind: str, name: str, namespace: str | None = None) -> JSONDict | None:
        """A copy of the stored object, or ``None``."""
        rt = self.resource_type(kind)
        ns = namespace or ("default" if rt.namespaced else "")
        with self._lock:
            obj = self._storage.objects.get(self._storage.key(rt, ns, name))
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str, namespace: str | None = None) -> list[JSONDict]:
        """Copies of all stored objects of a resource (optionally one namespace), sorted by namespace/name."""
        rt = self.resource_type(kind)
        with self._lock:
            items = [
                o
                for (t, ns, _), o in self._storage.objects.items()
                if t == rt and (namespace is None or ns == namespace)
            ]
            items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
            return copy.deepcopy(items)

    def update(self, obj: Mapping[str, Any], *, subresource: str | None = None) -> JSONDict:
        """Replace an object (or its ``status`` with ``subresource="status"``) as a PUT would."""
        rt = self.resource_type(str(obj.get("kind", "")), obj.get("apiVersion"))
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace") or ("default" if rt.namespaced else None)
        with self._storage.seeding():
            return self._storage.update(rt, ns, meta.get("name", ""), copy.deepcopy(dict(obj)), subresource)

    def delete(self, kind: str, name: str, namespace: str | None = None) -> JSONDict:
        """Delete an object as a DELETE without options would; returns the last state."""
        rt = self.resource_type(kind)
        ns = namespace or ("default" if rt.namespaced else None)
        with self._lock:
            return self._storage.delete(rt, ns, name, {})

    def install_crds(self, crds: Iterable[Mapping[str, Any]] | None = None) -> list[JSONDict]:
        """Create (or replace) CustomResourceDefinitions in process, as ``kubectl apply`` of them would; the
        default is the bundled ComputeDomain and ComputeDomainClique CRDs (:func:`.crds.bundled_crds`).
        Returns the stored CRDs.

        :raises ApiStatusError: 422 for a CRD the emulator cannot serve.
        """
        out = []
        for crd in crds if crds is not None else crd_manifests.bundled_crds():
            current = self.get("CustomResourceDefinition", crd["metadata"]["name"])
            if current is None:
                out.append(self.create(crd))
            else:
                replaced = copy.deepcopy(dict(crd))
                replaced["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                out.append(self.update(replaced))
        return out

    def add_node(
        self,
        name: str,
        *,
        allocatable: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> JSONDict:
        """Seed a Ready Node with ``status.allocatable`` and ``status.capacity``."""
        alloc = allocatable or {"cpu": "8", "memory": "32Gi", "pods": "110"}
        return self.create(resources.node_object(name, alloc, labels or {}))
