"""HTTP: the request handler (``http.server``), verb dispatch, request records and fault injection."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dradriver.sandbox.apiserver import fieldmanager, openapi, paging, resources, tables
from dradriver.sandbox.apiserver.errors import ApiStatusError, JSONDict, bad_request, method_not_allowed
from dradriver.sandbox.apiserver.errors import not_found as not_found_error
from dradriver.sandbox.apiserver.faults import Fault, take_fault
from dradriver.sandbox.apiserver.flowcontrol import FlowControlSettings, Latency, ThreadedFlowControl
from dradriver.sandbox.apiserver.media import JSON, decode_body, decode_delete_body, encode_body, negotiate
from dradriver.sandbox.apiserver.patches import apply_patch
from dradriver.sandbox.apiserver.resources import ResourceType, without_type
from dradriver.sandbox.apiserver.routes import SERVER_VERSION, Route, resolve
from dradriver.sandbox.apiserver.selectors import parse_field_selector, parse_label_selector
from dradriver.sandbox.apiserver.storage import Storage
from dradriver.sandbox.apiserver.watch import check_watch_options, serve_watch


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request the emulator received.

    :param verb: Kubernetes verb (``get``, ``list``, ``watch``, ``create``, ``update``, ``patch``,
        ``delete``, ``deletecollection``), or the lower-case HTTP method for non-resource paths.
    :param code: HTTP status code of the answer (200 for a watch once streaming starts).
    :param field_manager: the write's field manager (the ``fieldManager`` query parameter, else the
        ``User-Agent`` up to its first ``/``); ``""`` for reads.
    :param apply: the write was a server-side apply (``application/apply-patch+yaml``).
    :param user_agent: the request's ``User-Agent`` header (``""`` without one), reads included: who sent it, so
        a benchmark can count each client's requests and 409s (``bench/cdfleet.py``).
    """

    method: str
    path: str
    query: str
    verb: str
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    code: int
    field_manager: str = ""
    apply: bool = False
    user_agent: str = ""


@dataclass(slots=True)
class ServerState:
    """What request handling shares with :class:`~dradriver.sandbox.apiserver.ApiServerEmulator`."""

    types: Sequence[ResourceType]
    storage: Storage
    server_address: Callable[[], str]
    faults: list[Fault] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    records_lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards :attr:`faults` and :attr:`records` (not the storage's lock: counting a request never waits behind
    a write or a watch's scan)."""
    latency: Latency = field(default_factory=Latency)
    """Injected per-request latency (:mod:`.flowcontrol`; all 0: none)."""
    flow_control: ThreadedFlowControl | None = None
    """The API Priority and Fairness model every non-watch resource request passes (``None``: no limit)."""

    def limit(self, settings: FlowControlSettings | None) -> None:
        """Install (or with ``None`` remove) the API Priority and Fairness limit."""
        self.flow_control = ThreadedFlowControl(settings) if settings is not None else None


_VERBS_BY_METHOD = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def _verb(method: str, route: Route, params: Mapping[str, str]) -> str:
    if method == "GET":
        if route.name:
            return "get"
        return "watch" if params.get("watch") in ("true", "1") else "list"
    if method == "DELETE":
        return "delete" if route.name else "deletecollection"
    return _VERBS_BY_METHOD.get(method, method.lower())


def serve_request(state: ServerState, handler: RequestHandler) -> None:
    """Serve one HTTP request (called from the per-connection thread)."""
    method = handler.command
    split = urlsplit(handler.path)
    path, query = split.path, split.query
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    body = handler.read_body()
    route = resolve(state.types, path, state.server_address())
    verb = method.lower()
    rt_name = sub = ns = name = None
    if isinstance(route, Route):
        rt_name, sub, ns, name = route.rt.plural, route.subresource, route.namespace, route.name
        verb = _verb(method, route, params)

    user_agent = handler.headers.get("User-Agent", "")
    content_type = handler.headers.get("Content-Type", "")
    is_apply = verb == "patch" and content_type.split(";")[0].strip() == fieldmanager.APPLY_PATCH
    writer = ""
    if verb in ("create", "update", "patch", "delete", "deletecollection"):
        writer = params.get("fieldManager") or user_agent.split("/", 1)[0]

    def record(code: int) -> None:
        with state.records_lock:
            state.records.append(RequestRecord(method, path, query, verb, rt_name, sub, ns, name, code, writer,
                                               is_apply, user_agent))

    accept = handler.headers.get("Accept", "")
    flow = state.flow_control if isinstance(route, Route) and verb != "watch" else None
    if flow is not None and isinstance(route, Route) and not flow.acquire(user_agent):
        err = too_many_requests(flow.settings.retry_after_s)
        record(err.code)
        handler.send_object(err.code, err.status(), _best_effort_media(accept, route.rt, verb), err.headers)
        return
    try:
        delay = state.latency.of(verb) if isinstance(route, Route) else 0.0
        if delay > 0:
            time.sleep(delay)  # this request's thread only, before the storage: the commit comes after it
        _serve_admitted(state, handler, method, path, params, body, route, verb, accept, user_agent, content_type,
                        is_apply, record)
    finally:
        if flow is not None:
            flow.release()


def too_many_requests(retry_after_s: int) -> ApiStatusError:
    """The 429 kube-apiserver's API Priority and Fairness filter answers a request it rejects (its message and
    ``Retry-After``; ``details.retryAfterSeconds`` as the ``Status`` of a 429 carries it)."""
    return ApiStatusError(429, "TooManyRequests", "Too many requests, please try again later.",
                          details={"retryAfterSeconds": retry_after_s},
                          headers={"Retry-After": str(retry_after_s)})


def _serve_admitted(state: ServerState, handler: RequestHandler, method: str, path: str, params: dict[str, str],
                    body: bytes, route: Any, verb: str, accept: str, user_agent: str, content_type: str,
                    is_apply: bool, record: Callable[[int], None]) -> None:
    media = JSON
    with state.records_lock:
        fault = take_fault(state.faults, method, path)
    if fault is not None and fault.delay_s > 0:
        time.sleep(fault.delay_s)  # this request's thread only: the server keeps answering others
    if fault is not None and fault.status == 0:
        fault = None
    if fault is not None and fault.body is not None:
        record(fault.status)
        handler.send_body(fault.status, fault.body, fault.content_type)
        return
    if fault is not None:
        err = fault.error()
        record(err.code)
        if isinstance(route, Route):
            media = _best_effort_media(accept, route.rt, verb)
        handler.send_object(err.code, err.status(), media, err.headers)
        return
    try:
        if path == "/openapi/v2" or path == "/openapi/v3" or path.startswith("/openapi/v3/"):
            if method != "GET":
                raise method_not_allowed()
            document = _openapi_document(state, path, accept)
            record(200)
            handler.send_body(200, document, JSON)
            return
        if route is None:
            raise ApiStatusError(404, "NotFound", "the server could not find the requested resource", details={})
        if isinstance(route, str):
            record(200)
            handler.send_text(200, route)
            return
        if not isinstance(route, Route):
            if method != "GET":
                raise method_not_allowed()
            record(200)
            handler.send_json(200, route)
            return
        rt = route.rt
        if verb == "watch":
            negotiate(accept, None, None)
            check_watch_options(params)
            record(200)
            serve_watch(state.storage, handler, rt, route.namespace, params, delay_s=state.latency.watch_s)
            return
        as_table = verb in ("get", "list") and tables.wants_table(accept)
        media = JSON if as_table else negotiate(accept, rt.api_version, rt.kind)
        decoded: list[Any] = []

        def read_body() -> Any:
            if not decoded:
                decoded.append(decode_delete_body(body, content_type, custom=rt.custom) if verb == "delete"
                               else decode_body(body, content_type, rt.api_version, rt.kind))
            return decoded[0]

        warnings: list[str] = []
        if verb in ("create", "update", "patch"):
            directive = openapi.field_validation(params)
            if not (verb == "patch" and "json-patch" in content_type):
                warnings = openapi.check_fields(rt, read_body(), directive, patch=verb == "patch" and not is_apply)
        code, payload = serve_resource(state.storage, route, verb, params, read_body, content_type,
                                       user_agent=user_agent)
        record(code)
        if as_table and code == 200:
            handler.send_json(code, tables.table(rt, payload, params))
            return
        headers = {"Warning": ", ".join(warnings)} if warnings else None
        handler.send_object(code, payload, media, headers, api_version=rt.api_version, kind=rt.kind)
    except ApiStatusError as exc:
        record(exc.code)
        handler.send_object(exc.code, exc.status(), media, exc.headers)


def _openapi_document(state: ServerState, path: str, accept: str) -> bytes:
    """The OpenAPI v2 or v3 document at ``path``, JSON only.

    :raises ApiStatusError: 406 when ``Accept`` takes no JSON (protobuf OpenAPI is not served), 404 for an
        unknown group-version.
    """
    accepted = [a.split(";", 1)[0].strip().lower() for a in accept.split(",") if a.strip()]
    if accepted and not {"application/json", "*/*", "application/*"} & set(accepted):
        raise ApiStatusError(406, "NotAcceptable", "only the following media types are accepted: application/json")
    version = str(SERVER_VERSION["gitVersion"])
    if path == "/openapi/v2":
        return openapi.v2_document(state.types, version)
    if path == "/openapi/v3":
        return json.dumps(openapi.v3_root(state.types, version)).encode()
    document = openapi.v3_group_version(state.types, path.removeprefix("/openapi/v3/"), version)
    if document is None:
        raise ApiStatusError(404, "NotFound", "the server could not find the requested resource", details={})
    return document


def _best_effort_media(accept: str, rt: ResourceType, verb: str) -> str:
    try:
        return negotiate(accept, None if verb == "watch" else rt.api_version, rt.kind)
    except ApiStatusError:
        return JSON


def serve_resource(
    storage: Storage,
    route: Route,
    verb: str,
    params: Mapping[str, str],
    body: Callable[[], Any],
    content_type: str,
    *,
    user_agent: str = "",
) -> tuple[int, JSONDict]:
    """Run one verb (not watch) on a resource route; returns the status code and the response object.

    Writes keep ``metadata.managedFields`` (:mod:`.fieldmanager`): a server-side apply always; other writes
    record their ``Update`` ownership when they name a ``fieldManager`` or the object already has managed
    fields (the emulator's one deviation: an object only ever written without a field manager has none, where
    the API server would list the client's User-Agent as its manager).

    :param body: decodes the request body (``None`` without one); called only by verbs that read one.
    :param user_agent: the request's ``User-Agent`` (the default field manager).
    """
    rt, ns, name = route.rt, route.namespace, route.name
    if rt.namespaced and ns is None and verb not in ("list", "watch"):
        return 404, ApiStatusError(404, "NotFound", "the server could not find the requested resource").status()
    with storage.lock:
        if verb == "get":
            assert name is not None
            return 200, copy.deepcopy(storage.existing(rt, ns, name))
        if verb in ("list", "deletecollection"):
            labels = parse_label_selector(params.get("labelSelector", ""))
            fields = parse_field_selector(params.get("fieldSelector", ""), rt)
            items = storage.list(rt, ns, labels, fields)
            list_meta: JSONDict = {"resourceVersion": str(storage.rv)}
            if verb == "deletecollection":
                options = body() or {}
                items = [
                    storage.delete(rt, o["metadata"].get("namespace"), o["metadata"]["name"], options)
                    for o in list(items)
                ]
            else:
                items, list_meta = paging.page(items, params, storage.rv, selected=bool(labels or fields))
            return 200, {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version,
                "metadata": list_meta,
                "items": [without_type(o) for o in items],
            }
        if verb == "patch" and content_type.split(";")[0].strip() == fieldmanager.APPLY_PATCH:
            assert name is not None
            return _apply(storage, route, params, body())
        data = body()
        shape = fieldmanager.shape_of(rt.schema.root if rt.schema is not None else None)
        write = fieldmanager.Write(fieldmanager.manager_of(params, user_agent), rt.api_version, route.subresource,
                                   rt.status, resources.now())

        def manage(old: JSONDict | None, new: JSONDict) -> None:
            sent = fieldmanager.carry_entries(old or {}, new)
            fieldmanager.update(old, new, shape, write, sent)

        tracked = "fieldManager" in params
        if verb == "create":
            if not isinstance(data, dict):
                raise bad_request("the request body must be an object")
            if params.get("dryRun"):
                return 201, data
            return 201, storage.create(rt, ns, data, keep_status=False, manage=manage if tracked else None)
        assert name is not None
        if verb in ("update", "patch"):
            if verb == "patch":
                fieldmanager.refuse_force(params)
            stored = storage.existing(rt, ns, name)
            tracked = tracked or bool(stored["metadata"].get("managedFields"))
        if verb == "update":
            if not isinstance(data, dict):
                raise bad_request("the request body must be an object")
            return 200, storage.update(rt, ns, name, data, route.subresource, manage if tracked else None)
        if verb == "patch":
            current = copy.deepcopy(storage.existing(rt, ns, name))
            patched = apply_patch(current, data, content_type)
            if not isinstance(patched, dict):
                raise bad_request("the patch did not produce an object")
            return 200, storage.update(rt, ns, name, patched, route.subresource, manage if tracked else None)
        if verb == "delete":
            options = data or {}
            for key in ("propagationPolicy", "dryRun"):
                if key in params:
                    options[key] = params[key]
            return 200, storage.delete(rt, ns, name, options)
    raise method_not_allowed()


def _apply(storage: Storage, route: Route, params: Mapping[str, str], data: Any) -> tuple[int, JSONDict]:
    """A server-side apply of ``data`` (the decoded body) on ``route``; creates the object when it does not
    exist (201). Expects ``storage.lock`` held.

    :raises ApiStatusError: 400 without ``fieldManager`` or for a body that is not an object; 409 on conflicts
        (:func:`.fieldmanager.apply`); 404 for a subresource apply of a missing object.
    """
    rt, ns, name = route.rt, route.namespace, route.name
    assert name is not None
    manager, force = fieldmanager.check_apply_params(params)
    if not isinstance(data, dict):
        raise bad_request("the apply configuration must be an object")
    if data.get("apiVersion", rt.api_version) != rt.api_version or data.get("kind", rt.kind) != rt.kind:
        raise bad_request(f"the API version in the data ({data.get('apiVersion')}) and kind ({data.get('kind')}) "
                          f"do not match {rt.api_version} {rt.kind}")
    meta = data.get("metadata")
    if isinstance(meta, dict) and meta.get("name", name) != name:
        raise bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
    shape = fieldmanager.shape_of(rt.schema.root if rt.schema is not None else None)
    write = fieldmanager.Write(manager, rt.api_version, route.subresource, rt.status, resources.now())
    live = storage.objects.get(storage.key(rt, ns, name))
    if live is None and route.subresource:
        raise not_found_error(rt, name)
    merged = fieldmanager.apply(copy.deepcopy(live) if live is not None else None, data, shape, write, force=force)
    entries = merged["metadata"].get("managedFields")

    def manage(old: JSONDict | None, new: JSONDict) -> None:
        if entries is not None:
            new["metadata"]["managedFields"] = entries
        fieldmanager.keep_present(new, shape, rt.status)

    if live is None:
        merged["metadata"]["name"] = name
        return 201, storage.create(rt, ns, merged, keep_status=False, manage=manage)
    return 200, storage.update(rt, ns, name, merged, route.subresource, manage)


class RequestHandler(BaseHTTPRequestHandler):
    """One connection's requests; :attr:`state` is set on a per-server subclass."""

    protocol_version = "HTTP/1.1"
    server_version = "dradriver-apiserver-emulator"
    # Headers and body leave in one segment (buffered writer, flushed per response) and without Nagle:
    # otherwise every small response waits for the client's delayed ACK (about 40 ms on Linux).
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    state: ServerState

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: requests are recorded in :attr:`ApiServerEmulator.requests` instead."""

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            return self.rfile.read(length)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return b""

    def send_body(self, code: int, data: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def send_json(self, code: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        self.send_body(code, json.dumps(payload).encode(), JSON, headers)

    def send_object(
        self,
        code: int,
        payload: JSONDict,
        media: str,
        headers: Mapping[str, str] | None = None,
        *,
        api_version: str = "v1",
        kind: str = "Status",
    ) -> None:
        """``payload`` in the negotiated media type (``api_version``/``kind`` if it names none itself)."""
        data, content_type = encode_body(payload, media, api_version, kind)
        self.send_body(code, data, content_type, headers)

    def send_text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> bool:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            return True
        except OSError:
            return False

    def send_chunk(self, event: Any) -> bool:
        data = event if isinstance(event, bytes) else json.dumps(event).encode() + b"\n"
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            return True
        except OSError:
            self.close_connection = True
            return False

    def end_stream(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _dispatch(self) -> None:
        try:
            serve_request(self.state, self)
        except (ConnectionError, BrokenPipeError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch
