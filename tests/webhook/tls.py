"""TLS material and a running ``webhook`` process for the webhook tests: a self-signed certificate made with the
``openssl`` command line (the ``cryptography`` package is not a dependency), and the executable started as a
subprocess on a free port, ready when ``/readyz`` answers over HTTPS."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICE_NAME = "dradriver-webhook.dradriver.svc"
"""The DNS name the API server checks the certificate against for the component's Service."""


@dataclass(frozen=True)
class Certificate:
    """A PEM certificate (its own CA) and its key."""

    cert: Path
    key: Path

    def context(self) -> ssl.SSLContext:
        """A client context that trusts only this certificate."""
        return ssl.create_default_context(cafile=str(self.cert))


def make_certificate(directory: Path, names: Sequence[str] = (SERVICE_NAME, "localhost"), *,
                     stem: str = "tls") -> Certificate:
    """A self-signed RSA certificate for ``names``, 127.0.0.1 and ::1, valid one day, made with ``openssl req``."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
    san = ",".join([*(f"DNS:{n}" for n in names), "IP:127.0.0.1", "IP:::1"])
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", f"/CN={names[0]}", "-addext", f"subjectAltName={san}"],
                   check=True, capture_output=True, timeout=60)
    return Certificate(cert, key)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def readyz(port: int, context: ssl.SSLContext, host: str = "localhost") -> str:
    with urllib.request.urlopen(f"https://{host}:{port}/readyz", context=context, timeout=5) as answer:
        return str(answer.read().decode())


@contextlib.contextmanager
def running_webhook(argv: Sequence[str], env: dict[str, str], port: int, context: ssl.SSLContext,
                    log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``argv`` and wait until ``/readyz`` answers ``ok`` on ``port``; SIGTERM at the end (as the kubelet
    stops a container), and the exit code must be 0."""
    with log.open("ab") as out:
        proc = subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"{argv!r} exited ({proc.returncode}):\n{log.read_text()}")
            try:
                if readyz(port, context) == "ok":
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"no /readyz within 60 s:\n{log.read_text()}")
            time.sleep(0.1)
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def webhook_argv(cert: Certificate, port: int) -> list[str]:
    """``python -m dradriver webhook`` with NVIDIA's three flags."""
    return [sys.executable, "-m", "dradriver", "webhook", f"--tls-cert-file={cert.cert}",
            f"--tls-private-key-file={cert.key}", f"--port={port}"]


def webhook_env(**extra: str) -> dict[str, str]:
    """The test's environment with this tree first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("FEATURE_GATES", "WEBHOOK_PORT")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env
