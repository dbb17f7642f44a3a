"""``webhook`` (also ``dradriver webhook``): the validating admission webhook for ResourceClaims and templates.

NVIDIA's chart runs it when ``webhook.enabled`` is set: ``command: ["webhook"]``, args
``--tls-cert-file=/cert/tls.crt --tls-private-key-file=/cert/tls.key --port=<webhook.containerPort>``,
``FEATURE_GATES`` from the chart's ``featureGates``, HTTPS probes on ``/readyz`` (NVIDIA/k8s-dra-driver-gpu
``templates/webhook-deployment.yaml``, ``cmd/webhook/main.go``). Flags are NVIDIA's with an environment twin each
(:data:`FLAGS`), plus klog's logging flags. What it checks: :mod:`dradriver.domain.admission`; the server:
:mod:`dradriver.server.webhook`. Exit status: 0 after SIGINT/SIGTERM, 1 when it cannot serve (certificate files
that do not load, a port in use), 2 on bad flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from dradriver import config
from dradriver.commands import _entrypoint
from dradriver.commands._options import add_output_alias

PROG = "webhook"
DESCRIPTION = ("Validating admission webhook for gpu.nvidia.com and compute-domain.nvidia.com opaque configs in "
               "ResourceClaims and ResourceClaimTemplates (HTTPS /validate-resource-claim-parameters, /readyz).")

_SHARED = {f.dest: f for f in config.PLUGIN_FLAGS}

FLAGS: tuple[config.Flag, ...] = (
    config.Flag("--tls-cert-file", "TLS_CERT_FILE", None, "PEM file with the server certificate, then any CA "
                "certificates of its chain (required; reloaded when it changes).", "path"),
    config.Flag("--tls-private-key-file", "TLS_PRIVATE_KEY_FILE", None, "PEM file with the private key of "
                "--tls-cert-file (required; reloaded when it changes).", "path"),
    config.Flag("--port", "WEBHOOK_PORT", 443, "Secure port the webhook listens on (all addresses).", "int"),
    config.Flag("--bind-address", "WEBHOOK_BIND_ADDRESS", "", "Address to listen on; empty means every IPv6 and "
                "IPv4 address, as NVIDIA's (dradriver's flag)."),
    _SHARED["feature_gates"], _SHARED["log_level"], _SHARED["log_format"],
)


def register(subparsers: Any) -> None:
    """Add the ``webhook`` subcommand; every flag has an environment twin."""
    parser = subparsers.add_parser(PROG, help="run the validating admission webhook for claims' opaque configs",
                                   description=DESCRIPTION)
    _entrypoint.add_component_flags(parser, FLAGS)
    add_output_alias(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``webhook`` console script (``[project.scripts]``); returns the exit status."""
    return _entrypoint.console_main(PROG, DESCRIPTION, FLAGS, run, argv)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM/SIGHUP/SIGQUIT (module docstring for the exit status)."""
    import logging
    import ssl
    import sys
    import threading
    from pathlib import Path

    from dradriver.domain.featuregates import FeatureGateError, parse_feature_gates
    from dradriver.errors import DradriverError
    from dradriver.server.webhook import CertificateFiles, WebhookServer, serve

    try:
        gates = parse_feature_gates(args.feature_gates, where="--feature-gates (env FEATURE_GATES)")
        _entrypoint.start_logging(PROG, args, gates)
        for flag in FLAGS[:2]:
            if not getattr(args, flag.dest):
                raise DradriverError(f"{flag.option} (env {flag.env}) is required")
        if not 0 <= args.port <= 65535:
            raise DradriverError(f"--port (env WEBHOOK_PORT) {args.port} is not a TCP port")
    except (DradriverError, FeatureGateError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    log = logging.getLogger("dradriver.webhook")
    try:
        certificates = CertificateFiles(Path(args.tls_cert_file), Path(args.tls_private_key_file))
        if args.bind_address:
            server = WebhookServer((args.bind_address, args.port), certificates, gates)
        else:
            server = WebhookServer.on_every_address(args.port, certificates, gates)
    except (OSError, ssl.SSLError) as exc:
        log.error("cannot start the webhook: %s", exc)
        return 1
    stop = threading.Event()
    _entrypoint.stop_on_signals(stop)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{host}]" if ":" in host else host
    log.info("serving the admission webhook on https://%s:%d (feature gates: %s)", shown, port,
             args.feature_gates or "defaults")
    serve(server, stop)
    log.info("stopped")
    return 0
