"""Opening the API client, and the one place requests are sent, retried and translated into our errors.

:func:`open_client` reads a kubeconfig file, or the in-cluster service account when the path is empty
(the DaemonSet case), and returns a :class:`KubeClient`. Every request goes through
:meth:`KubeClient.call`, which

* asks the client library for the raw response (``_preload_content=False``) and decodes the JSON itself
  (:func:`dradriver.kube.jsonbody.decode`: any nesting up to Go's limit, whatever Python's recursion
  limit), so callers get the API's field names (``spec.nodeName``) and fields the client's models do not
  know survive a read; a body that cannot be decoded is a ``KubeAPIError`` (``InvalidResponse``);
* bounds each request by a connect and a read timeout (seconds);
* waits for the client-side rate limiter first, when there is one (``--kube-api-qps``/``--kube-api-burst``,
  :mod:`dradriver.kube.ratelimit`); every try and every watch opened takes a token, as in client-go;
* retries 429, 5xx and connection failures with exponential backoff and jitter, honouring ``Retry-After``,
  at most :attr:`RetryPolicy.attempts` tries; other errors are raised at once;
* raises only :mod:`dradriver.kube.errors` classes, the library's exception chained as ``__cause__``.

Retrying a create after a lost response may create a second object with a generated name; the
ResourceSlice publisher tolerates that (an unmatched slice is obsolete and deleted on the next sync).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3
import yaml

from dradriver.kube import errors, jsonbody
from dradriver.kube.kubeconfig import KUBECONFIG_HINT, config_error
from dradriver.kube.ratelimit import RateLimitTimeout, TokenBucket

log = logging.getLogger(__name__)

JSONDict = dict[str, Any]

LIST_PAGE_SIZE = 500
"""Items per page of :meth:`KubeClient.list_items` (client-go's ``pager.DefaultPageSize``)."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded exponential backoff for retryable API errors.

    :param attempts: total tries per call, the first included (1 = no retry).
    :param initial_delay_s: delay before the second try, seconds.
    :param max_delay_s: upper bound of one delay, seconds (also caps ``Retry-After``).
    :param multiplier: growth factor between consecutive delays.
    :param jitter: fraction of random spread added to each delay (0.2 = up to +20 %).
    """

    attempts: int = 5
    initial_delay_s: float = 0.2
    max_delay_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delay(self, retry: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        base = min(self.max_delay_s, self.initial_delay_s * self.multiplier ** (retry - 1))
        if retry_after_s is not None:
            base = min(self.max_delay_s, max(base, retry_after_s))
        return base * (1.0 + random.uniform(0.0, self.jitter))


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


class KubeClient:
    """The driver's handle on the API server: typed API objects plus one request path.

    :param api_client: a configured ``kubernetes.client.ApiClient`` (owned; closed by :meth:`close`).
    :param connect_timeout_s: TCP connect timeout per request, seconds.
    :param read_timeout_s: read timeout per request, seconds (watches pass their own).
    :param retry: retry policy for 429, 5xx and connection errors.
    :param sleep: the sleep function (tests may pass one that records delays).
    :param rate_limit: the client-side limiter every request waits for; ``None`` for none.
    """

    def __init__(self, api_client: Any, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0,
                 retry: RetryPolicy | None = None, sleep: Callable[[float], None] = time.sleep,
                 rate_limit: TokenBucket | None = None) -> None:
        self.api_client = api_client
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retry = retry or RetryPolicy()
        self.rate_limit = rate_limit
        self._sleep = sleep

    # The typed API objects are created at first use: importing one loads the client's models for every
    # operation it has (CoreV1Api: ~0.75 s and ~22 MiB), so a part that never calls it never pays for it.
    # Assigning one (tests) replaces it.

    @functools.cached_property
    def core(self) -> Any:
        """``CoreV1Api`` (created at first use)."""
        return kubernetes.client.CoreV1Api(self.api_client)

    @functools.cached_property
    def resource(self) -> Any:
        """``ResourceV1Api`` (created at first use)."""
        return kubernetes.client.ResourceV1Api(self.api_client)

    @functools.cached_property
    def apps(self) -> Any:
        """``AppsV1Api`` (created at first use)."""
        return kubernetes.client.AppsV1Api(self.api_client)

    @functools.cached_property
    def custom(self) -> Any:
        """``CustomObjectsApi`` (created at first use)."""
        return kubernetes.client.CustomObjectsApi(self.api_client)

    @functools.cached_property
    def coordination(self) -> Any:
        """``CoordinationV1Api`` (created at first use)."""
        return kubernetes.client.CoordinationV1Api(self.api_client)

    def raw(self, http_method: str, path: str, *, body: Any = None) -> Callable[..., Any]:
        """A method for :meth:`call` and :meth:`stream` that sends ``http_method path`` through the same
        ``ApiClient`` (its configuration, authentication and connection pool) without a typed API object, so
        no model module is loaded and no per-call argument validation runs; non-2xx answers raise the
        library's ``ApiException`` as typed methods do.

        The returned function takes ``body=`` (JSON-serialisable, sent as ``application/json``) and query
        parameters as the typed methods name them (``field_selector=...``, ``watch=True``: snake case, turned
        into the API's camel case; ``None`` values are left out).

        :param path: absolute API path, e.g. ``/api/v1/nodes/gpu-node-1`` (the caller quotes names).
        """
        default_body = body

        def send(*, _preload_content: bool = False, _request_timeout: Any = None, body: Any = None,
                 **query: Any) -> Any:
            content = default_body if body is None else body
            headers = {"Accept": "application/json"}
            if content is not None:
                headers["Content-Type"] = "application/json"
            params = [(_camel(k), v) for k, v in query.items() if v is not None]
            request = self.api_client.param_serialize(method=http_method, resource_path=path, query_params=params,
                                                      header_params=headers, body=content,
                                                      auth_settings=["BearerToken"])
            response = self.api_client.call_api(*request, _request_timeout=_request_timeout)
            if not 200 <= response.status <= 299:
                response.read()
                raise kubernetes.client.exceptions.ApiException.from_response(http_resp=response, body=None,
                                                                              data=None)
            return response.response

        return send

    @property
    def host(self) -> str:
        """The API server URL the client talks to."""
        return str(self.api_client.configuration.host)

    def call(self, what: str, method: Callable[..., Any], /, *args: Any, retry: bool = True,
             timeout_s: float | None = None, **kwargs: Any) -> JSONDict:
        """Send one request through a typed API ``method`` and return the decoded JSON body.

        :param what: a description for errors and logs, e.g. ``GET resourceclaims default/c``.
        :param method: a bound method of :attr:`core` or :attr:`resource` (``read_namespaced_pod``, ...).
        :param retry: False sends exactly once.
        :param timeout_s: the whole call's time limit, seconds (``None``: each try has the client's own connect and
            read timeouts): the rate-limit wait, every try and the pauses between them end by then. Each try's
            connect and read timeouts are cut to the time left (a read timeout bounds each wait for the server's
            next bytes, so a server that answers in time but trickles its body could pass it by one wait), and no
            retry starts whose pause would reach the limit.
        :raises errors.KubeTimeoutError: ``timeout_s`` passed before an answer (the last try's error chained).
        :raises errors.KubeAPIError: the subclass for the final failure.
        """
        attempts = self.retry.attempts if retry else 1
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request_timeout: tuple[float, float] = (self.connect_timeout_s, self.read_timeout_s)
        for attempt in range(1, attempts + 1):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.KubeTimeoutError(what, message=f"no answer within {timeout_s:.2f} s")
                request_timeout = (min(self.connect_timeout_s, left), min(self.read_timeout_s, left))
            if self.rate_limit is not None:
                try:
                    waited = self.rate_limit.wait(None if deadline is None else request_timeout[1])
                except RateLimitTimeout as exc:
                    raise errors.KubeTimeoutError(what, message=str(exc)) from exc
                if deadline is not None and waited > 0:
                    left = max(0.001, deadline - time.monotonic())
                    request_timeout = (min(request_timeout[0], left), min(request_timeout[1], left))
            try:
                response = method(*args, _preload_content=False, _request_timeout=request_timeout, **kwargs)
                data = response.data
                return jsonbody.decode(data) if data else {}
            except Exception as exc:  # translated below; nothing from the library escapes
                err = translate(what, exc)
                if err is None:
                    raise
                if deadline is not None and err.retryable and time.monotonic() >= deadline:
                    raise errors.KubeTimeoutError(what, message=f"no answer within {timeout_s:.2f} s: "
                                                               f"{err.message or err.reason}") from exc
                if not err.retryable or attempt == attempts:
                    raise err from exc
                delay = self.retry.delay(attempt, err.retry_after_s)
                if deadline is not None and time.monotonic() + delay >= deadline:
                    raise errors.KubeTimeoutError(what, message=f"no answer within {timeout_s:.2f} s "
                                                               f"(the next retry would start later): {err}") from exc
                log.warning("%s; retry %d/%d in %.2fs", err, attempt, attempts - 1, delay)
                self._sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def list_items(self, what: str, method: Callable[..., Any], /, *args: Any, page_size: int = LIST_PAGE_SIZE,
                   **kwargs: Any) -> Iterator[JSONDict]:
        """The ``items`` of a LIST through a typed ``method``, fetched ``page_size`` at a time (``limit`` and
        ``continue``, Kubernetes API concepts "Retrieving large results sets in chunks"; client-go's pager uses
        the same 500), so a caller that consumes them as they come holds one page of a large list, not all of it.
        Each page is one :meth:`call` (retried as any call).

        :raises errors.KubeGoneError: the list's snapshot expired between two pages (410; items already
            yielded are not repeated: the caller lists again).
        :raises errors.KubeAPIError: the subclass for any other final failure.
        """
        token = ""
        while True:
            paged = {"limit": page_size, "_continue": token} if token else {"limit": page_size}
            try:
                body = self.call(what, method, *args, **paged, **kwargs)
            except errors.KubeGoneError as exc:
                if not token:
                    raise
                raise errors.KubeGoneError(what, status=exc.status, reason=exc.reason,
                                           message=f"the list expired between pages; list again: {exc.message}"
                                           ) from exc
            yield from body.get("items") or ()
            token = str((body.get("metadata") or {}).get("continue") or "")
            if not token:
                return

    def stream(self, what: str, method: Callable[..., Any], /, *, timeout_s: float,
               **kwargs: Any) -> Iterator[JSONDict]:
        """Open a watch (``watch=True``) and yield its events as dicts until the server ends it.

        :param timeout_s: ``timeoutSeconds`` asked of the server; the read timeout is a little longer.
        :raises errors.KubeAPIError: opening or reading the stream failed (not retried here).
        """
        if self.rate_limit is not None:
            self.rate_limit.wait()
        try:
            response = method(watch=True, timeout_seconds=int(timeout_s), _preload_content=False,
                              _request_timeout=(self.connect_timeout_s, timeout_s + 30.0), **kwargs)
        except Exception as exc:
            err = translate(what, exc)
            if err is None:
                raise
            raise err from exc
        try:
            buffer = b""
            for chunk in response.stream(amt=None, decode_content=False):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield jsonbody.decode(line)
            if buffer.strip():
                yield jsonbody.decode(buffer)
        except Exception as exc:
            err = translate(what, exc)
            if err is None:
                raise
            raise err from exc
        finally:
            response.release_conn()

    def close(self) -> None:
        """Close the connection pool."""
        self.api_client.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def translate(what: str, exc: BaseException) -> errors.KubeAPIError | None:
    """Our error for a client-library exception, or ``None`` when ``exc`` is not from the request path."""
    if isinstance(exc, errors.KubeAPIError):
        return exc
    if isinstance(exc, kubernetes.client.ApiException):
        if not exc.status:
            return errors.KubeUnavailableError(what, reason=str(exc.reason or "connection failed"))
        headers = dict(exc.headers) if exc.headers else None
        return errors.error_from_response(what, int(exc.status), exc.body, headers)
    if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        return errors.KubeUnavailableError(what, reason=type(exc).__name__, message=str(exc))
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return errors.KubeAPIError(what, reason="InvalidResponse", message=f"response is not JSON: {exc}")
    if isinstance(exc, RecursionError):
        return errors.KubeAPIError(what, reason="InvalidResponse", message=f"response cannot be decoded: {exc}")
    if isinstance(exc, (ValueError, TypeError)):  # pydantic's ValidationError is a ValueError
        return errors.KubeRequestInvalidError(what, reason="RequestRejectedByClient", message=str(exc))
    return None


def check_reachable(client: KubeClient, kubeconfig: str) -> None:
    """``GET /version`` once, without retries: the API server answers at all.

    :raises errors.KubeUnavailableError: no answer (connection refused, DNS, TLS, timeout); the message is one
        line naming the server URL and where it came from, and ends with :data:`KUBECONFIG_HINT`.
    """
    source = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
    try:
        client.call("GET /version", kubernetes.client.VersionApi(client.api_client).get_code, retry=False)
    except errors.KubeUnavailableError as exc:
        text = " ".join(exc.message.split())
        errno_text = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
        detail = errno_text.group(1).strip() if errno_text else ": ".join(p for p in (exc.reason, text) if p)
        raise errors.KubeUnavailableError(f"cannot reach the Kubernetes API server {client.host} (from {source})",
                                          reason=detail, message=KUBECONFIG_HINT) from exc
    except errors.KubeAPIError:
        return  # it answered (even 401/403/404): reachable; later requests report their own errors


def open_client(kubeconfig: str = "", *, user_agent: str = "dradriver", connect_timeout_s: float = 5.0,
                read_timeout_s: float = 30.0, retry: RetryPolicy | None = None,
                rate_limit: TokenBucket | None = None, pool_size: int | None = None) -> KubeClient:
    """A :class:`KubeClient` from a kubeconfig file, or from the in-cluster service account if empty.

    In-cluster configuration reads ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the token and CA under
    ``/var/run/secrets/kubernetes.io/serviceaccount/``. The library's own urllib3 retries are turned off
    so :class:`RetryPolicy` is the only retry layer.

    :param user_agent: the ``User-Agent`` header (a plugin passes its identity's, e.g. ``dradriver/<driver>``).
    :param rate_limit: client-side rate limiter (:func:`dradriver.kube.ratelimit.rate_limiter`); ``None``: none.
    :param pool_size: connections kept open to the API server (urllib3's pool ``maxsize``; ``None``: the library's
        default, 5 per CPU): a client with many concurrent requests (watches held open, parallel writes) sets it to
        their number, or each connection beyond it is opened, used once and discarded with a warning.

    :raises errors.KubeAPIError: the configuration cannot be loaded (missing file, invalid YAML, not a
        kubeconfig, not in a cluster); the message is one line naming the file and pointing at
        :data:`KUBECONFIG_HINT`.
    """
    cfg = kubernetes.client.Configuration()
    try:
        if kubeconfig and not os.path.exists(kubeconfig):
            raise FileNotFoundError(errno.ENOENT, "no such file", kubeconfig)
        if kubeconfig:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg,
                                               persist_config=False)
        else:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
    except (kubernetes.config.ConfigException, yaml.YAMLError, OSError, ValueError, TypeError, AttributeError,
            KeyError, IndexError) as exc:
        # The library reads the file with yaml.safe_load and then indexes into whatever it got: invalid YAML,
        # or a document of the wrong shape, ends here as one line (YAML errors span several).
        raise config_error(kubeconfig, exc) from exc
    cfg.retries = False
    if pool_size is not None:
        cfg.connection_pool_maxsize = max(1, pool_size)
    # Pin the proxy the environment gave at load. With a bearer token the library's refresh hook re-assigns
    # ``host`` before every request, and each assignment re-reads the proxy variables from the whole process
    # environment (~0.1-0.4 ms a request); the environment does not change while the plugin runs.
    cfg.proxy = cfg.proxy
    api_client = kubernetes.client.ApiClient(cfg)
    api_client.user_agent = user_agent
    return KubeClient(api_client, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                      retry=retry, rate_limit=rate_limit)
