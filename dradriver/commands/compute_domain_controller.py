"""``compute-domain-controller`` (also ``dradriver compute-domain-controller``): reconcile ComputeDomains.

Every flag of NVIDIA's compute-domain-controller with its environment twin (NVIDIA's
``cmd/compute-domain-controller/main.go``), including leader election (``LEADER_ELECTION_ENABLED``,
``LEADER_ELECTION_LEASE_LOCK_NAMESPACE``, ``LEADER_ELECTION_LEASE_LOCK_NAME``, ``LEADER_ELECTION_LEASE_DURATION``,
``LEADER_ELECTION_RENEW_DEADLINE``, ``LEADER_ELECTION_RETRY_PERIOD``; Go durations such as ``15s``). The reconcile
itself: :mod:`dradriver.computedomain. controller`; the Lease: :mod:`dradriver.kube.leaderelection`. Exit status: 0
after SIGINT/SIGTERM, 1 when the controller cannot start or loses the Lease (NVIDIA's exits too: a new process campaigns
again), 2 on bad flags.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from dradriver import config
from dradriver.commands import _entrypoint
from dradriver.commands._options import add_output_alias
from dradriver.errors import FlagError

PROG = "compute-domain-controller"
DESCRIPTION = ("ComputeDomain controller (resource.nvidia.com/v1beta1): per-domain IMEX daemon DaemonSet and "
               "ResourceClaimTemplates, global status, cleanup; optional leader election on a Lease.")

_SHARED = {f.dest: f for f in config.PLUGIN_FLAGS}

FLAGS: tuple[config.Flag, ...] = (
    config.Flag("--pod-name", "POD_NAME", None, "This controller's pod (the leader election identity's prefix)."),
    config.Flag("--namespace", "NAMESPACE", "default", "The driver namespace: daemon DaemonSets, daemon "
                "ResourceClaimTemplates and ComputeDomainCliques live there."),
    config.Flag("--image-name", "IMAGE_NAME", None, "Image of the IMEX daemon pods."),
    config.Flag("--cd-daemon-image-pull-secret-names", "CD_DAEMON_IMAGE_PULL_SECRET_NAMES", "",
                "Comma-separated imagePullSecret names for the IMEX daemon pods."),
    config.Flag("--log-verbosity-cd-daemon", "LOG_VERBOSITY_CD_DAEMON", None, "klog verbosity of the IMEX daemon "
                "pods (their LOG_VERBOSITY).", "int"),
    config.Flag("--max-nodes-per-imex-domain", "MAX_NODES_PER_IMEX_DOMAIN", 18, "Most nodes in one IMEX domain "
                "(18: GB200/GB300 NVL72).", "int"),
    config.Flag("--imex-mode", "IMEX_MODE", "driverManaged", "driverManaged: IMEX daemons in a DaemonSet per "
                "domain; hostManaged: IMEX runs on the hosts (needs the gate HostManagedIMEXDaemon); preWarmed "
                "(dradriver's): a DaemonSet of IMEX daemons per NVLink clique before any domain exists, each domain "
                "its own channel.", "str", ("driverManaged", "hostManaged", "preWarmed")),
    config.Flag("--imex-isolation", "IMEX_ISOLATION", "domain", "domain: channel 0 for every domain (NVIDIA's); "
                "channel: each domain its own IMEX channel (needs --imex-mode hostManaged; preWarmed always "
                "isolates by channel).", "str",
                ("domain", "channel")),
    config.Flag("--pprof-path", "PPROF_PATH", "", "Go's profiling path in NVIDIA's; accepted and unused here."),
    config.Flag("--additional-namespaces", "ADDITIONAL_NAMESPACES", "", "Comma-separated further namespaces "
                "whose domain DaemonSets are swept (created only in --namespace)."),
    config.Flag("--leader-election-enabled", "LEADER_ELECTION_ENABLED", False, "Campaign for a Lease and "
                "reconcile only while holding it.", "bool"),
    config.Flag("--leader-election-lease-lock-namespace", "LEADER_ELECTION_LEASE_LOCK_NAMESPACE", "default",
                "Namespace of the Lease."),
    config.Flag("--leader-election-lease-lock-name", "LEADER_ELECTION_LEASE_LOCK_NAME",
                "nvidia-compute-domain-controller", "Name of the Lease."),
    config.Flag("--leader-election-lease-duration", "LEADER_ELECTION_LEASE_DURATION", "15s", "How long a standby "
                "waits after the last renewal it saw before taking the Lease."),
    config.Flag("--leader-election-renew-deadline", "LEADER_ELECTION_RENEW_DEADLINE", "10s", "How long the "
                "leader tries to renew before it stops leading."),
    config.Flag("--leader-election-retry-period", "LEADER_ELECTION_RETRY_PERIOD", "2s", "Between two tries to "
                "take or renew the Lease."),
    config.Flag("--node-failure-grace-period", "NODE_FAILURE_GRACE_PERIOD", "40s", "How long a node's Lease in "
                "kube-node-lease may go unrenewed (or its Ready condition be False/Unknown) before its IMEX daemon "
                "is dropped from its peers' mapping; its index is kept (dradriver; kube-controller-manager's "
                "--node-monitor-grace-period default)."),
    config.Flag("--status-resync-period", "STATUS_RESYNC_PERIOD", "60s", "Full membership and status resync "
                "period; between two, ComputeDomain status follows clique and daemon pod events (dradriver; "
                "NVIDIA polls every 2s)."),
    _SHARED["kubeconfig"], _SHARED["kube_api_qps"], _SHARED["kube_api_burst"], _SHARED["http_endpoint"],
    _SHARED["metrics_path"], _SHARED["feature_gates"], _SHARED["log_level"], _SHARED["log_format"],
)

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, where: str) -> float:
    """A Go ``time.ParseDuration`` value (``15s``, ``1m30s``, ``500ms``) in seconds.

    :raises FlagError: not a positive duration.
    """
    value = text.strip()
    pos, total = 0, 0.0
    while pos < len(value):
        m = _DURATION_PART.match(value, pos)
        if m is None:
            raise FlagError(f"{where} {text!r} is not a duration such as '15s' or '1m30s'")
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not value or total <= 0:
        raise FlagError(f"{where} {text!r} must be a positive duration such as '15s'")
    return total


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def config_from_args(args: argparse.Namespace) -> Any:
    """Check and gather the flags.

    :returns: a :class:`dradriver.app.computedomaincontroller.ControllerConfig`.
    :raises FlagError: a value NVIDIA's controller refuses too (host-managed mode without its gate, a bad duration
        or gate), or channel isolation without host-managed mode.
    """
    from dradriver.app.computedomaincontroller import ControllerConfig
    from dradriver.domain.cdtemplates import ControllerSettings
    from dradriver.domain.featuregates import (
        HOST_MANAGED_IMEX_DAEMON,
        FeatureGateError,
        check_gates,
        parse_feature_gates,
    )

    try:
        gates = parse_feature_gates(args.feature_gates, where="--feature-gates (env FEATURE_GATES)")
        check_gates(gates, where="--feature-gates (env FEATURE_GATES)")
    except FeatureGateError as exc:
        raise FlagError(str(exc)) from exc
    if args.imex_isolation == "channel" and args.imex_mode not in ("hostManaged", "preWarmed"):
        raise FlagError(config.CHANNEL_NEEDS_HOST_MANAGED)
    if args.imex_mode == "hostManaged" and not gates[HOST_MANAGED_IMEX_DAEMON]:
        raise FlagError("--imex-mode (env IMEX_MODE) hostManaged needs the feature gate HostManagedIMEXDaemon")
    if args.max_nodes_per_imex_domain <= 0:
        raise FlagError("--max-nodes-per-imex-domain (env MAX_NODES_PER_IMEX_DOMAIN) must be positive")
    for flag, env, value in (("--image-name", "IMAGE_NAME", args.image_name),
                             ("--log-verbosity-cd-daemon", "LOG_VERBOSITY_CD_DAEMON", args.log_verbosity_cd_daemon)):
        if value is None or value == "":  # required by NVIDIA's controller too: the IMEX daemon pods need both
            raise FlagError(f"{flag} (env {env}) is required: the IMEX daemon pods' "
                            f"{'image' if flag == '--image-name' else 'LOG_VERBOSITY'}")
    if args.log_verbosity_cd_daemon < 0:
        raise FlagError("--log-verbosity-cd-daemon (env LOG_VERBOSITY_CD_DAEMON) must not be negative")
    settings = ControllerSettings(namespace=args.namespace, image=args.image_name,
                                  log_verbosity=args.log_verbosity_cd_daemon,
                                  max_nodes_per_imex_domain=args.max_nodes_per_imex_domain,
                                  pull_secrets=_names(args.cd_daemon_image_pull_secret_names),
                                  feature_gates=gates, imex_mode=args.imex_mode,
                                  imex_isolation=args.imex_isolation)
    durations = {}
    for dest in ("leader_election_lease_duration", "leader_election_renew_deadline",
                 "leader_election_retry_period", "node_failure_grace_period", "status_resync_period"):
        option = "--" + dest.replace("_", "-")
        durations[dest] = parse_duration(getattr(args, dest), f"{option} (env {dest.upper()})")
    return ControllerConfig(
        pod_name=args.pod_name, kubeconfig=args.kubeconfig, settings=settings,
        additional_namespaces=_names(args.additional_namespaces), kube_api_qps=args.kube_api_qps,
        kube_api_burst=args.kube_api_burst, http_endpoint=args.http_endpoint, metrics_path=args.metrics_path,
        leader_election=args.leader_election_enabled, lease_namespace=args.leader_election_lease_lock_namespace,
        lease_name=args.leader_election_lease_lock_name,
        lease_duration_s=durations["leader_election_lease_duration"],
        renew_deadline_s=durations["leader_election_renew_deadline"],
        retry_period_s=durations["leader_election_retry_period"],
        node_failure_grace_s=durations["node_failure_grace_period"],
        status_resync_s=durations["status_resync_period"])


def register(subparsers: Any) -> None:
    """Add the ``compute-domain-controller`` subcommand; every flag has an environment twin."""
    parser = subparsers.add_parser(PROG, help="run the ComputeDomain controller", description=DESCRIPTION)
    _entrypoint.add_component_flags(parser, FLAGS)
    add_output_alias(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``compute-domain-controller`` console script; returns the exit status."""
    return _entrypoint.console_main(PROG, DESCRIPTION, FLAGS, run, argv)


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM/SIGHUP/SIGQUIT (0), a lost Lease or a start failure (1); 2 on bad flags."""
    import logging
    import sys
    import threading

    from dradriver.errors import DradriverError
    from dradriver.kube.lazyimport import defer_kubernetes_subpackages

    defer_kubernetes_subpackages()  # the client's unused subpackages are not imported (start-up time, memory)
    try:
        cfg = config_from_args(args)
        _entrypoint.start_logging(PROG, args, cfg.settings.feature_gates)
    except DradriverError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    from dradriver.app.computedomaincontroller import run_controller

    log = logging.getLogger("dradriver.compute_domain_controller")
    log.info("startup config: %s", cfg)
    stop = threading.Event()
    _entrypoint.stop_on_signals(stop)
    try:
        lost = run_controller(cfg, stop)
    except (DradriverError, OSError) as exc:
        log.error("cannot run the compute-domain controller: %s", exc)
        return 1
    return 1 if lost else 0
