"""The admission webhook's HTTPS server (``webhook`` executable, :mod:`dradriver.commands.webhook`).

Endpoints as NVIDIA's ``cmd/webhook`` (NVIDIA/k8s-dra-driver-gpu): ``POST /validate-resource-claim-parameters``
takes an ``admission.k8s.io/v1`` AdmissionReview with ``Content-Type: application/json`` (another type: 415, an
unreadable review: 400) and answers the response AdmissionReview from
:func:`dradriver.domain.admission.answer_review`; ``GET /readyz`` answers ``ok`` (the chart's liveness and
readiness probes); any other path is 404.

TLS: the certificate chain and key are read from files (the chart mounts its Secret at ``/cert``). cert-manager
rotates that Secret in place, so :class:`CertificateFiles` checks the files' modification time and size at each
new connection and loads a new server context when they changed; a pair that does not load (the certificate
written, the key not yet) keeps the previous context and is tried again at the next connection.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import socketserver
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dradriver.domain.admission import READY_PATH, VALIDATE_PATH, ReviewError, answer_review, read_review
from dradriver.domain.featuregates import FeatureGates

log = logging.getLogger(__name__)

JSON = "application/json"
MAX_REVIEW_BYTES = 3 * 1024 * 1024 + 64 * 1024
"""Largest request body read: the API server's object limit (3 MiB) and the review's envelope."""


class CertificateFiles:
    """The server's TLS context from a certificate chain file and a key file, reloaded when they change.

    :param cert_file: PEM certificate, the server's first, then any intermediates (``--tls-cert-file``).
    :param key_file: PEM private key of the first certificate (``--tls-private-key-file``).
    :raises OSError, ssl.SSLError: at construction, when the pair cannot be loaded (the process must not start).
    """

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._lock = threading.Lock()
        self._stamp = self._files_stamp()
        self._context = self._load()

    def _files_stamp(self) -> tuple[int, ...]:
        stamp: list[int] = []
        for path in (self.cert_file, self.key_file):
            info = os.stat(path)  # follows the Secret volume's ..data symlinks
            stamp += [info.st_mtime_ns, info.st_size, info.st_ino]
        return tuple(stamp)

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def context(self) -> ssl.SSLContext:
        """The current context; loads the files again first when their stamp (mtime, size, inode) changed."""
        with self._lock:
            try:
                stamp = self._files_stamp()
                if stamp != self._stamp:
                    self._context = self._load()
                    self._stamp = stamp
                    log.info("loaded the rotated TLS certificate from %s and %s", self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                log.warning("cannot load the TLS certificate %s with key %s (kept the previous one): %s",
                            self.cert_file, self.key_file, exc)
            return self._context


class WebhookServer(ThreadingHTTPServer):
    """HTTPS on ``(host, port)``; each accepted connection is wrapped with the current TLS context.

    :param gates: the feature gates the validation uses.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], certificates: CertificateFiles, gates: FeatureGates) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.certificates = certificates
        self.gates = gates
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        """Bind; ``::`` also takes IPv4 (dual stack, as Go's ``:port``). No reverse lookup of the address (the
        library's ``getfqdn`` would ask DNS at start)."""
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    @classmethod
    def on_every_address(cls, port: int, certificates: CertificateFiles, gates: FeatureGates) -> WebhookServer:
        """Listen on ``port`` of every IPv6 and IPv4 address, or of every IPv4 address on a host without IPv6.

        :raises OSError: the port cannot be bound.
        """
        if socket.has_ipv6:
            try:
                return cls(("::", port), certificates, gates)
            except OSError as exc:
                if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                    raise
        return cls(("0.0.0.0", port), certificates, gates)

    def get_request(self) -> tuple[socket.socket, Any]:
        """Accept and wrap in TLS; the handshake runs on the connection's own thread (:meth:`_Handler.setup`)."""
        sock, address = self.socket.accept()
        wrapped = self.certificates.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return wrapped, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line for a client that fails the handshake or hangs up, not a traceback."""
        import sys

        exc = sys.exc_info()[1]
        log.info("connection from %s ended: %s", client_address, exc)


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"
    timeout = 30

    def setup(self) -> None:
        super().setup()
        assert isinstance(self.connection, ssl.SSLSocket)
        self.connection.do_handshake()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str) -> None:
        self._send(code, (message + "\n").encode(), "text/plain; charset=utf-8")  # Go's http.Error

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == READY_PATH:
            self._send(200, b"ok", "text/plain; charset=utf-8")
        elif self.path.split("?", 1)[0] == VALIDATE_PATH:
            self._review()
        else:
            self._error(404, "404 page not found")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] == VALIDATE_PATH:
            self._review()
        elif self.path.split("?", 1)[0] == READY_PATH:
            self._send(200, b"ok", "text/plain; charset=utf-8")
        else:
            self._error(404, "404 page not found")

    def _review(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_REVIEW_BYTES:
            self._error(413, f"request body of {length} bytes is over the limit of {MAX_REVIEW_BYTES}")
            return
        body = self.rfile.read(length) if length > 0 else b""
        content_type = self.headers.get("Content-Type", "")
        if content_type.split(";", 1)[0].strip().lower() != JSON:
            message = f"contentType={content_type}, expected {JSON}"
            log.error("%s", message)
            self._error(415, message)
            return
        try:
            review = read_review(body)
        except ReviewError as exc:
            message = f"failed to read AdmissionReview from request body: {exc}"
            log.error("%s", message)
            self._error(400, message)
            return
        answer = answer_review(review, self.server.gates)
        response = answer["response"]
        if not response["allowed"]:
            request = review["request"]
            log.info("refused %s %s/%s (uid %s): %s", request.get("operation", ""), request.get("namespace", ""),
                     request.get("name", ""), request.get("uid", ""), response["status"]["message"])
        self._send(200, json.dumps(answer).encode(), JSON)


def serve(server: WebhookServer, stop: threading.Event) -> None:
    """Serve until ``stop`` is set, then close the listening socket; requests in progress finish first."""
    worker = threading.Thread(target=server.serve_forever, name="webhook-https", daemon=True)
    worker.start()
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        worker.join()
