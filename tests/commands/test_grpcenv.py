"""gRPC start-up settings (:mod:`dradriver.commands._grpcenv`): set before grpc loads, known to the grpcio installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dradriver.commands import _grpcenv

REPO = Path(__file__).resolve().parents[2]

# An entry point's import, then a sync gRPC server on a Unix socket answering one call: what the plugins do.
SERVE_ONE_CALL = """
import os, sys, tempfile
from concurrent import futures
import dradriver.commands.gpu_kubelet_plugin  # the console script's module, imported first as in production
import grpc
sock = os.path.join(tempfile.mkdtemp(dir="/tmp"), "g.sock")
handler = grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers((handler,))
server.add_insecure_port("unix:" + sock)
server.start()
with grpc.insecure_channel("unix:" + sock) as channel:
    assert channel.unary_unary("/t.T/M")(b"ping", timeout=10) == b"ping"
server.stop(0)
print(os.environ.get("GRPC_EXPERIMENTS", "<unset>"))
"""


def test_default_is_set_when_absent() -> None:
    env: dict[str, str] = {}
    assert _grpcenv.apply_defaults(env) is True
    assert env == {"GRPC_EXPERIMENTS": _grpcenv.EXPERIMENTS}


def test_operator_value_is_kept() -> None:
    env = {"GRPC_EXPERIMENTS": "-some_other_experiment"}
    assert _grpcenv.apply_defaults(env) is False
    assert env == {"GRPC_EXPERIMENTS": "-some_other_experiment"}
    empty = {"GRPC_EXPERIMENTS": ""}  # set empty on purpose: gRPC's own defaults
    assert _grpcenv.apply_defaults(empty) is False
    assert empty == {"GRPC_EXPERIMENTS": ""}


def _serve_one_call(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env)
    return subprocess.run([sys.executable, "-c", SERVE_ONE_CALL], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_entry_point_sets_it_before_grpc_loads_and_grpcio_knows_it() -> None:
    """The console script's import sets the variable before grpc initialises, and the installed grpcio accepts
    the experiment: an upgrade that drops it logs "Unknown experiment" at start-up and fails here."""
    done = _serve_one_call({})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == _grpcenv.EXPERIMENTS
    assert "Unknown experiment" not in done.stderr, done.stderr
    assert "experiment" not in done.stderr.lower(), done.stderr


def test_unknown_experiment_would_be_reported() -> None:
    """The check above can fail: grpc reports an experiment it does not know on stderr (and still serves)."""
    done = _serve_one_call({"GRPC_EXPERIMENTS": "-no_such_experiment_here"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "-no_such_experiment_here"
    assert "Unknown experiment: no_such_experiment_here" in done.stderr
