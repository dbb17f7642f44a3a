"""Shared pieces of the controller tests: the API emulator with the bundled CRDs, a running controller, seeded
daemon pods and cliques."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from dradriver.computedomain.controller import ComputeDomainController
from dradriver.domain.cdtemplates import ControllerSettings
from dradriver.domain.computedomains import LABEL_CLIQUE_ID, LABEL_COMPUTE_DOMAIN, clique_object_name
from dradriver.kube.client import KubeClient, open_client
from dradriver.sandbox.apiserver import ApiServerEmulator

DRIVER_NS = "dradriver"
IMAGE = "registry.example/dradriver:test"
GROUP, VERSION = "resource.nvidia.com", "v1beta1"
FIXTURES = Path(__file__).resolve().parents[1] / "sandbox" / "fixtures" / "imex"
CLIQUE = "abc9829a-0000-4000-8000-000000000001.2"


def settings(**kw: Any) -> ControllerSettings:
    """Controller settings for the tests (driver namespace ``dradriver``)."""
    return ControllerSettings(**{"namespace": DRIVER_NS, "image": IMAGE, "log_verbosity": 4, **kw})


def nvidia_compute_domain(manifest: str = "channel-injection.yaml") -> dict[str, Any]:
    """The ComputeDomain of one of NVIDIA's example manifests, unchanged."""
    docs = [d for d in yaml.safe_load_all((FIXTURES / manifest).read_text()) if d]
    return next(d for d in docs if d["kind"] == "ComputeDomain")


def compute_domain(name: str, *, num_nodes: int = 0, template: str | None = None,
                   mode: str | None = None) -> dict[str, Any]:
    """A ComputeDomain manifest."""
    channel: dict[str, Any] = {"resourceClaimTemplate": {"name": template or f"{name}-channel"}}
    if mode:
        channel["allocationMode"] = mode
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ComputeDomain", "metadata": {"name": name},
            "spec": {"numNodes": num_nodes, "channel": channel}}


def emulator(tmp_path: Path) -> ApiServerEmulator:
    """A started API emulator validating built-in kinds against Kubernetes 1.34's schema, with the bundled CRDs,
    the driver namespace and three nodes."""
    api = ApiServerEmulator(schema_version="1.34").start()
    api.install_crds()
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DRIVER_NS},
                "status": {"phase": "Active"}})
    for node in ("node-a", "node-b", "node-c"):
        api.add_node(node)
    return api


def client_for(api: ApiServerEmulator, tmp_path: Path) -> KubeClient:
    """The driver's API client for ``api``."""
    return open_client(api.kubeconfig_path(tmp_path))


@contextlib.contextmanager
def running(controller: ComputeDomainController) -> Iterator[threading.Event]:
    """Run ``controller`` in a thread until the block ends."""
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,), name="controller", daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the controller did not stop"


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds
    (a bound on a hang, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def daemon_pod(api: ApiServerEmulator, cd_uid: str, node: str, ip: str, *, ready: bool = True,
               clique: str | None = CLIQUE) -> dict[str, Any]:
    """Seed a running daemon pod of the domain on ``node`` (what the DaemonSet controller and the daemon make)."""
    labels = {LABEL_COMPUTE_DOMAIN: cd_uid}
    if clique is not None:
        labels[LABEL_CLIQUE_ID] = clique
    return api.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"computedomain-daemon-{cd_uid[:8]}-{node}", "namespace": DRIVER_NS, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "compute-domain-daemon", "image": IMAGE}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    })


def clique_object(cd_uid: str, daemons: list[dict[str, Any]], clique: str = CLIQUE) -> dict[str, Any]:
    """A ComputeDomainClique as the daemons write it."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ComputeDomainClique",
            "metadata": {"name": clique_object_name(cd_uid, clique), "namespace": DRIVER_NS,
                         "labels": {LABEL_COMPUTE_DOMAIN: cd_uid, LABEL_CLIQUE_ID: clique}},
            "daemons": daemons}


def entry(node: str, ip: str, index: int, status: str = "Ready", clique: str = CLIQUE) -> dict[str, Any]:
    """One ``daemons[]`` entry."""
    return {"nodeName": node, "ipAddress": ip, "cliqueID": clique, "index": index, "status": status}
