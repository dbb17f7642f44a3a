"""Wiring of ``dradriver compute-domain-controller``: the API client, the metrics endpoint, leader election and
the controller itself (:class:`dradriver.computedomain.controller.ComputeDomainController`)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from dradriver.computedomain.controller import CLIENT_POOL_SIZE, ComputeDomainController
from dradriver.domain.cdtemplates import ControllerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """The controller process's configuration (``dradriver compute-domain-controller`` flags; seconds)."""

    pod_name: str
    kubeconfig: str
    settings: ControllerSettings
    additional_namespaces: tuple[str, ...] = ()
    kube_api_qps: float = -1.0
    kube_api_burst: int = 10
    http_endpoint: str = ""
    metrics_path: str = "/metrics"
    leader_election: bool = False
    lease_namespace: str = "default"
    lease_name: str = "nvidia-compute-domain-controller"
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    node_failure_grace_s: float = 40.0
    status_resync_s: float = 60.0


def _serve_metrics(endpoint: str, path: str) -> Any:
    """Prometheus metrics (the process and platform metrics of ``prometheus_client``'s default registry) at
    ``path`` on ``host:port`` (other paths: 404), as the GPU plugin serves its own; ``None`` for an empty path
    (NVIDIA: "disabled if empty").

    :raises OSError: the address cannot be bound.
    """
    if not path:
        log.info("metrics server off: --metrics-path (env METRICS_PATH) is empty")
        return None
    import prometheus_client

    from dradriver.health.metrics import serve_metrics

    return serve_metrics(prometheus_client.REGISTRY, endpoint, path)


def run_controller(cfg: ControllerConfig, stop: threading.Event) -> bool:
    """Run the controller until ``stop`` is set; with leader election only while holding the Lease.

    :returns: True when the Lease was lost (the process should exit non-zero and campaign again).
    :raises errors.KubeAPIError: the API client cannot be opened.
    :raises ValueError: inconsistent leader election durations.
    """
    from dradriver.kube import ratelimit
    from dradriver.kube.client import open_client
    from dradriver.kube.leaderelection import LeaderElectionConfig, LeaderElector, candidate_identity

    client = open_client(cfg.kubeconfig, user_agent="dradriver/compute-domain-controller",
                         rate_limit=ratelimit.rate_limiter(cfg.kube_api_qps, cfg.kube_api_burst),
                         pool_size=CLIENT_POOL_SIZE + len(cfg.additional_namespaces))
    metrics = _serve_metrics(cfg.http_endpoint, cfg.metrics_path) if cfg.http_endpoint else None
    controller = ComputeDomainController(client, cfg.settings, additional_namespaces=cfg.additional_namespaces,
                                         status_period_s=cfg.status_resync_s, node_grace_s=cfg.node_failure_grace_s)
    try:
        if not cfg.leader_election:
            controller.run(stop)
            return False
        election = LeaderElectionConfig(namespace=cfg.lease_namespace, name=cfg.lease_name,
                                        identity=candidate_identity(cfg.pod_name),
                                        lease_duration_s=cfg.lease_duration_s,
                                        renew_deadline_s=cfg.renew_deadline_s, retry_period_s=cfg.retry_period_s)
        return LeaderElector(client, election).run(controller.run, stop)
    finally:
        if metrics is not None:
            metrics.stop()
        client.close()
