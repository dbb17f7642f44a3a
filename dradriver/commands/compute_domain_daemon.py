"""``compute-domain-daemon run|check`` (also ``dradriver compute-domain-daemon``): the IMEX daemon wrapper of a
ComputeDomain's daemon pod (:mod:`dradriver.computedomain.daemon`).

NVIDIA's chart runs ``compute-domain-daemon -v $(LOG_VERBOSITY) run`` with probes ``compute-domain-daemon check``
(NVIDIA's ``cmd/compute-domain-daemon/main.go``, ``cmd/compute-domain-controller/``). Flags and their environment twins
are NVIDIA's (:data:`DAEMON_FLAGS`; ``CLIQUE_ID`` and ``COMPUTE_DOMAIN_*`` come from the daemon claim's CDI edits, the
Pod fields from the DaemonSet), plus dradriver's ``--imexd-dir`` (``DRADRIVER_IMEXD_DIR``) and ``--hosts-file``
(``DRADRIVER_HOSTS_FILE``), which let the sandbox run a daemon as a local process, ``--poll-interval-seconds``
(``DRADRIVER_POLL_INTERVAL_SECONDS``) and ``--kubeconfig`` (in a cluster: the Pod's service account).
Global flags go before the subcommand.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from dradriver import config
from dradriver.commands import _entrypoint
from dradriver.commands._options import add_output_alias

PROG = "compute-domain-daemon"
DESCRIPTION = "IMEX daemon wrapper of a ComputeDomain (driver compute-domain.nvidia.com): joins the domain's " \
              "clique, keeps nodes.cfg and /etc/hosts, runs nvidia-imex; 'check' is the pod's probe."

_PLUGIN_FLAGS = {f.option: f for f in config.PLUGIN_FLAGS}

DAEMON_FLAGS: tuple[config.Flag, ...] = (
    config.Flag("--cliqueid", "CLIQUE_ID", "", "NVLink clique of this node, <clusterUUID>.<cliqueId>; empty: no "
                "clique (the daemon idles). Injected by the daemon claim's CDI spec."),
    config.Flag("--compute-domain-uuid", "COMPUTE_DOMAIN_UUID", "", "UID of the ComputeDomain (CDI-injected)."),
    config.Flag("--compute-domain-name", "COMPUTE_DOMAIN_NAME", "", "Name of the ComputeDomain (CDI-injected)."),
    config.Flag("--compute-domain-namespace", "COMPUTE_DOMAIN_NAMESPACE", "", "Namespace of the ComputeDomain "
                "(CDI-injected)."),
    config.Flag("--node-name", "NODE_NAME", "", "The node this daemon runs on."),
    config.Flag("--pod-ip", "POD_IP", "", "This pod's IP: the IMEX bind address and the clique entry's address."),
    config.Flag("--pod-uid", "POD_UID", "", "This pod's UID (owner reference of the clique)."),
    config.Flag("--pod-name", "POD_NAME", "", "This pod's name (its clique ID label)."),
    config.Flag("--pod-namespace", "POD_NAMESPACE", "", "This pod's namespace: the clique object's namespace."),
    config.Flag("--max-nodes-per-imex-domain", "MAX_NODES_PER_IMEX_DOMAIN", 18, "Slots of an IMEX domain: "
                "indexes and DNS names 0..N-1.", "int"),
    _PLUGIN_FLAGS["--feature-gates"],
    config.Flag("--kubeconfig", "KUBECONFIG", "", "kubeconfig file; empty means in-cluster configuration.", "path"),
    config.Flag("--imexd-dir", "DRADRIVER_IMEXD_DIR", "/imexd", "The domain directory (imexd.cfg.tmpl in; "
                "imexd.cfg, nodes.cfg out).", "path"),
    config.Flag("--hosts-file", "DRADRIVER_HOSTS_FILE", "/etc/hosts", "The hosts file naming the IMEX peers.",
                "path"),
    config.Flag("--poll-interval-seconds", "DRADRIVER_POLL_INTERVAL_SECONDS", 1.0, "Seconds between two reads of "
                "the clique and of this pod (NVIDIA watches both through informers).", "float"),
    _PLUGIN_FLAGS["--log-level"],
    _PLUGIN_FLAGS["--log-format"],
)


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(action=None)
    sub = parser.add_subparsers(dest="daemon_command", metavar="run|check")
    sub.add_parser("run", help="join the domain and run nvidia-imex until SIGTERM").set_defaults(action="run")
    sub.add_parser("check", help="succeed when nvidia-imex-ctl -q reports READY (or no clique)") \
        .set_defaults(action="check")


def register(subparsers: Any) -> None:
    """Add the ``compute-domain-daemon`` subcommand (with ``run`` and ``check``)."""
    parser = subparsers.add_parser(PROG, help="IMEX daemon wrapper of a ComputeDomain (run|check)",
                                   description=DESCRIPTION)
    _entrypoint.add_component_flags(parser, DAEMON_FLAGS)
    add_output_alias(parser)
    _add_subcommands(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``compute-domain-daemon`` console script; returns the exit status (141, quietly, when its standard
    output is closed: :func:`~dradriver.commands._entrypoint.exit_quietly_on_closed_stdout`)."""
    import sys

    from dradriver.errors import DradriverError

    def body() -> int:
        try:
            parser = _entrypoint.build_parser(PROG, DESCRIPTION, DAEMON_FLAGS)
        except DradriverError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        _add_subcommands(parser)
        return run(parser.parse_args(argv))

    return _entrypoint.exit_quietly_on_closed_stdout(body)


def run(args: argparse.Namespace) -> int:
    """``run``: 0 after SIGTERM, 1 when it cannot run; ``check``: 0 when ready; 2 on bad flags."""
    import logging
    import sys
    import threading
    from pathlib import Path

    from dradriver.domain.featuregates import FeatureGateError, parse_feature_gates
    from dradriver.errors import DradriverError
    from dradriver.kube.lazyimport import defer_kubernetes_subpackages

    defer_kubernetes_subpackages()  # the client's unused subpackages are not imported (start-up time, memory)
    try:
        gates = parse_feature_gates(args.feature_gates, where="--feature-gates (env FEATURE_GATES)")
        _entrypoint.start_logging(PROG, args, gates)
    except (DradriverError, FeatureGateError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    log = logging.getLogger("dradriver.compute_domain_daemon")
    if args.action is None:
        print(f"{PROG}: a subcommand is required: run or check", file=sys.stderr)
        return 2
    if args.action == "check":  # the probe runs every second at start-up: no plugin parts are loaded for it
        if not args.cliqueid:
            return 0
        from dradriver.domain.imex import CONFIG_FILE
        from dradriver.host.imexchannels import record_readiness
        from dradriver.host.imexprocess import check_own_daemon

        # This pod's own nvidia-imex, not whatever answers on its address (a host nvidia-imex.service).
        ok, detail = check_own_daemon(Path(args.imexd_dir), "nvidia-imex-ctl", Path(args.imexd_dir) / CONFIG_FILE,
                                      pod_uid=args.pod_uid)
        problem = record_readiness(Path(args.imexd_dir), node_name=args.node_name, pod_uid=args.pod_uid,
                                   pod_ip=args.pod_ip, ready=ok, detail=detail)  # for the plugin on this node
        if problem:
            print(f"{PROG} check: {problem}", file=sys.stderr)
        if not ok:
            print(f"{PROG} check: {detail}", file=sys.stderr)
        return 0 if ok else 1

    from dradriver.computedomain import daemon as cddaemon

    settings = cddaemon.DaemonSettings(
        clique_id=args.cliqueid, cd_uid=args.compute_domain_uuid, cd_name=args.compute_domain_name,
        cd_namespace=args.compute_domain_namespace, node_name=args.node_name, pod_ip=args.pod_ip,
        pod_uid=args.pod_uid, pod_name=args.pod_name, pod_namespace=args.pod_namespace,
        max_nodes=args.max_nodes_per_imex_domain, imexd_dir=Path(args.imexd_dir), hosts_file=Path(args.hosts_file),
        poll_interval_s=args.poll_interval_seconds)
    stop = threading.Event()
    _entrypoint.stop_on_signals(stop)
    try:
        settings.validate()
        from dradriver.kube.client import open_client

        log.info("compute-domain-daemon: domain %s/%s (%s), clique %r, node %s, pod %s/%s (%s)",
                 settings.cd_namespace, settings.cd_name, settings.cd_uid, settings.clique_id, settings.node_name,
                 settings.pod_namespace, settings.pod_name, settings.pod_ip)
        with open_client(args.kubeconfig, user_agent="dradriver/compute-domain-daemon") as client:
            return cddaemon.run_daemon(settings, client, stop)
    except (DradriverError, OSError) as exc:
        log.error("%s", exc)
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
