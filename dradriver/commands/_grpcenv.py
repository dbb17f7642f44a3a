"""The gRPC C-core settings every dradriver process starts with, applied before ``grpc`` is first imported.

gRPC reads its configuration variables (``GRPC_EXPERIMENTS`` among them, gRPC's ``doc/environment_variables.md``)
from the environment once, when its C core initialises at the first ``import grpc``; setting them later has no
effect. :func:`apply_defaults` therefore runs when :mod:`dradriver.commands` is imported (every console script and
the ``dradriver`` CLI import it first), before any entry point imports the gRPC layer (:mod:`dradriver.server`).
This module must not import ``grpc`` itself.

``GRPC_EXPERIMENTS=-event_engine_listener``: accepted connections are served by gRPC's long-standing poller
(the thread that polls the server's completion queue also reads the socket) instead of the EventEngine listener,
whose endpoints hand every read and write to its own thread pool. A sync server on a Unix socket answers a small
unary call with about a quarter less CPU (measured on grpcio 1.85.3: ``docs/benchmarks.md``, "``vs_nvidia``: gRPC's
listener"). An operator's own ``GRPC_EXPERIMENTS`` wins: nothing is set when the variable
is present.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

EXPERIMENTS = "-event_engine_listener"
"""The value :func:`apply_defaults` gives ``GRPC_EXPERIMENTS`` when the environment has none."""


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> bool:
    """Give ``GRPC_EXPERIMENTS`` its default (:data:`EXPERIMENTS`) unless it is set; True when this call set it.

    :param environ: the environment to change (default ``os.environ``, which child processes inherit).
    :returns: False when the variable was already set (an operator's choice) or ``grpc`` is already imported in
        this process (too late to matter here; the variable is then left alone so child processes and this one
        agree).
    """
    env = os.environ if environ is None else environ
    if "GRPC_EXPERIMENTS" in env or (environ is None and "grpc" in sys.modules):
        return False
    env["GRPC_EXPERIMENTS"] = EXPERIMENTS
    return True
