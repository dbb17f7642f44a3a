"""The compute-domain daemon: one per ComputeDomain and node, wrapping ``nvidia-imex`` (``compute-domain-daemon
run|check``).

``run`` (``nvidia-dra-driver.md`` 1.4, 7.4; ``nvidia-dra-driver-updates.md`` 2c "IMEX daemon wrapper"):

1. refuse to start without ``COMPUTE_DOMAIN_UUID`` (the daemon claim's CDI spec injects it);
2. label its own Pod ``resource.nvidia.com/computeDomain.cliqueID=<cliqueID>`` (explicitly empty on a node in
   no clique); with no clique, idle until SIGTERM;
3. render ``<imexd>/imexd.cfg`` from ``<imexd>/imexd.cfg.tmpl`` (pod IP, ``nodes.cfg`` path) and the static
   ``nodes.cfg`` of per-domain DNS names;
4. loop every ``poll_interval_s``: read its own Pod's Ready condition; insert or update its entry in the
   ComputeDomainClique ``<cdUID>.<cliqueID>`` of its namespace (created when missing, labels as 7.1, its Pod
   added as an owner) with the index rule of :func:`~dradriver.domain.imex.upsert_entry`, by
   read-modify-write conditional on ``resourceVersion`` with retries on conflict (NVIDIA's protocol); rewrite the
   hosts file with the name -> IP mapping of the same-clique daemons; start ``nvidia-imex`` once, and send it
   SIGUSR1 when the mapping changes;
5. on SIGTERM: remove its own entry (matched by pod IP), stop ``nvidia-imex``.

``check`` runs ``nvidia-imex-ctl -c <imexd>/imexd.cfg -q`` and succeeds only when it prints exactly
``READY\\n``; with no clique it succeeds at once.

Differences from NVIDIA: the clique and the own Pod are polled (``poll_interval_s``, default 1 s) rather than
watched through informers (NVIDIA: informer events, resync 4 min); only the default gate settings
(ComputeDomainCliques and IMEXDaemonsWithDNSNames on) are implemented: the status-nodes and IP-list modes are not.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.domain import computedomains as cd
from dradriver.domain import imex
from dradriver.domain.computedomains import CliqueDaemon
from dradriver.errors import DradriverError
from dradriver.host.imexprocess import ImexProcess, query_ready, write_config_file, write_hosts_file
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kube import pods
from dradriver.kube.client import KubeClient

__all__ = ["CDI_HINT", "DaemonError", "DaemonSettings", "check", "join_clique", "leave_clique", "render_configs",
           "run_daemon"]

log = logging.getLogger(__name__)

CDI_HINT = "COMPUTE_DOMAIN_UUID is empty: is CDI enabled in your container runtime?"
CONFLICT_RETRIES = 20


class DaemonError(DradriverError):
    """The daemon cannot run: missing settings, missing template, no free index."""


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    """What the daemon knows about itself (flags and environment, ``nvidia-dra-driver.md`` 1.4).

    :param clique_id: ``CLIQUE_ID`` (``<clusterUUID>.<cliqueId>``; empty: the node is in no clique).
    :param max_nodes: ``MAX_NODES_PER_IMEX_DOMAIN``: slots, DNS names and lines of ``nodes.cfg``.
    :param imexd_dir: the domain directory mounted at ``/imexd`` (template in, config files out).
    :param hosts_file: the resolver's hosts file the daemon owns (the container's ``/etc/hosts``).
    :param poll_interval_s: seconds between two reads of the clique and the own Pod.
    """

    clique_id: str
    cd_uid: str
    cd_name: str = ""
    cd_namespace: str = ""
    node_name: str = ""
    pod_ip: str = ""
    pod_uid: str = ""
    pod_name: str = ""
    pod_namespace: str = ""
    max_nodes: int = cd.DEFAULT_MAX_NODES_PER_IMEX_DOMAIN
    imexd_dir: Path = Path("/imexd")
    hosts_file: Path = Path("/etc/hosts")
    imex_binary: str = "nvidia-imex"
    imex_ctl_binary: str = "nvidia-imex-ctl"
    poll_interval_s: float = 1.0
    imex_env: dict[str, str] | None = field(default=None)

    @property
    def config_path(self) -> Path:
        return self.imexd_dir / imex.CONFIG_FILE

    @property
    def clique_name(self) -> str:
        return cd.clique_object_name(self.cd_uid, self.clique_id)

    def validate(self) -> None:
        """:raises DaemonError: ``COMPUTE_DOMAIN_UUID`` missing (:data:`CDI_HINT`), or a Pod field missing, or
        ``max_nodes`` below 1."""
        if not self.cd_uid:
            raise DaemonError(CDI_HINT)
        missing = [env for env, value in (("NODE_NAME", self.node_name), ("POD_IP", self.pod_ip),
                                          ("POD_UID", self.pod_uid), ("POD_NAME", self.pod_name),
                                          ("POD_NAMESPACE", self.pod_namespace)) if not value]
        if missing:
            raise DaemonError(f"{', '.join(missing)} not set (the DaemonSet passes them from the Pod's fields)")
        if self.max_nodes < 1:
            raise DaemonError(f"MAX_NODES_PER_IMEX_DOMAIN {self.max_nodes} must be at least 1")


# -- the clique entry ----------------------------------------------------------------------------------------


def _owner(settings: DaemonSettings) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "name": settings.pod_name, "uid": settings.pod_uid}


def _new_clique(settings: DaemonSettings) -> dict[str, Any]:
    return {"apiVersion": cd.API_GROUP_VERSION, "kind": cd.CLIQUE_KIND,
            "metadata": {"name": settings.clique_name, "namespace": settings.pod_namespace,
                         "labels": {cd.LABEL_COMPUTE_DOMAIN: settings.cd_uid,
                                    cd.LABEL_CLIQUE_ID: settings.clique_id},
                         "ownerReferences": [_owner(settings)]},
            "daemons": []}


def _daemons(obj: dict[str, Any]) -> list[CliqueDaemon]:
    return [CliqueDaemon.from_entry(e) for e in obj.get("daemons") or ()]


def _backoff(attempt: int) -> None:
    time.sleep(min(0.5, 0.005 * 2 ** attempt) * (1 + random.random()))


def join_clique(client: KubeClient, settings: DaemonSettings, status: str) -> list[CliqueDaemon]:
    """Insert or update this daemon's entry (and owner reference) in its clique, creating the clique when
    missing; returns the clique's entries after the write.

    :raises DaemonError: no free index, or conflicts did not settle in :data:`CONFLICT_RETRIES` tries.
    :raises dradriver.kube.errors.KubeAPIError: the API failed after its own retries.
    """
    ns = settings.pod_namespace
    for attempt in range(CONFLICT_RETRIES):
        obj = kube_cd.get_clique(client, ns, settings.clique_name)
        if obj is None:
            created = kube_cd.create_clique(client, _new_clique(settings))
            obj = created if created is not None else kube_cd.get_clique(client, ns, settings.clique_name)
            if obj is None:
                continue
        daemons = _daemons(obj)
        try:
            updated, entry = imex.upsert_entry(daemons, node_name=settings.node_name, ip_address=settings.pod_ip,
                                               clique_id=settings.clique_id, max_nodes=settings.max_nodes,
                                               status=status)
        except cd.ComputeDomainError as exc:
            raise DaemonError(f"ComputeDomainClique {ns}/{settings.clique_name}: {exc}") from exc
        meta = obj.setdefault("metadata", {})
        owners = list(meta.get("ownerReferences") or [])
        has_owner = any(o.get("uid") == settings.pod_uid for o in owners)
        if updated == daemons and has_owner:
            return daemons
        if not has_owner:
            meta["ownerReferences"] = [*owners, _owner(settings)]
        obj["daemons"] = [d.to_clique_entry() for d in updated]
        try:
            written = kube_cd.update_clique(client, obj)
        except kube_errors.KubeConflictError:
            _backoff(attempt)
            continue
        if updated != daemons:
            log.info("clique %s/%s: entry of node %s is index %d, %s, status %s", ns, settings.clique_name,
                     settings.node_name, entry.index, entry.ip_address, entry.status)
        return _daemons(written)
    raise DaemonError(f"ComputeDomainClique {ns}/{settings.clique_name}: {CONFLICT_RETRIES} conflicting updates "
                      "in a row")


def leave_clique(client: KubeClient, settings: DaemonSettings) -> bool:
    """Remove this daemon's entry (matched by node name and pod IP) from its clique.

    :returns: whether an entry was removed.
    :raises dradriver.kube.errors.KubeAPIError: the API failed after its own retries.
    """
    for attempt in range(CONFLICT_RETRIES):
        obj = kube_cd.get_clique(client, settings.pod_namespace, settings.clique_name)
        if obj is None:
            return False
        daemons = _daemons(obj)
        kept = imex.remove_entry(daemons, node_name=settings.node_name, ip_address=settings.pod_ip)
        if kept == daemons:
            return False
        obj["daemons"] = [d.to_clique_entry() for d in kept]
        try:
            kube_cd.update_clique(client, obj)
        except kube_errors.KubeConflictError:
            _backoff(attempt)
            continue
        log.info("clique %s/%s: removed the entry of node %s (%s)", settings.pod_namespace, settings.clique_name,
                 settings.node_name, settings.pod_ip)
        return True
    return False


# -- run and check -----------------------------------------------------------------------------------------------


def render_configs(settings: DaemonSettings) -> None:
    """Write ``imexd.cfg`` (from ``imexd.cfg.tmpl``) and the static ``nodes.cfg`` into the domain directory.

    :raises DaemonError: the template is missing (the daemon claim was not prepared by a compute-domain plugin).
    """
    template_path = settings.imexd_dir / imex.CONFIG_TEMPLATE_FILE
    try:
        template = template_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DaemonError(f"{template_path} is missing: the daemon claim's Prepare puts it there") from None
    nodes_path = settings.imexd_dir / imex.NODES_FILE
    write_config_file(settings.config_path,
                      imex.render_imexd_config(template, pod_ip=settings.pod_ip, nodes_config=str(nodes_path)))
    write_config_file(nodes_path, imex.render_nodes_config(settings.cd_uid, settings.max_nodes))


def run_daemon(settings: DaemonSettings, client: KubeClient, stop: threading.Event) -> int:
    """Run until ``stop`` is set; returns the exit status (0 after a clean stop).

    :raises DaemonError: bad settings (:meth:`DaemonSettings.validate`), missing template, no free index.
    :raises dradriver.kube.errors.KubeAPIError: labelling the own Pod failed.
    """
    settings.validate()
    pods.set_pod_label(client, settings.pod_namespace, settings.pod_name, cd.LABEL_CLIQUE_ID, settings.clique_id)
    if not settings.clique_id:
        log.info("node %s is in no NVLink clique: idle until terminated", settings.node_name)
        stop.wait()
        return 0
    render_configs(settings)
    env = dict(os.environ) if settings.imex_env is None else dict(settings.imex_env)
    env["DRADRIVER_HOSTS_FILE"] = str(settings.hosts_file)  # the stand-in's resolver; the real daemon's is libc's
    process = ImexProcess([settings.imex_binary, "-c", str(settings.config_path)], env=env)
    mapping: dict[str, str] | None = None
    try:
        while not stop.is_set():
            try:
                ready = pods.pod_ready(pods.get_pod(client, settings.pod_namespace, settings.pod_name))
                daemons = join_clique(client, settings, cd.STATUS_READY if ready else cd.STATUS_NOT_READY)
            except kube_errors.KubeAPIError as exc:
                log.warning("cannot update the clique entry: %s", exc)
                stop.wait(settings.poll_interval_s)
                continue
            new = imex.dns_mapping(settings.cd_uid, daemons, settings.clique_id, settings.max_nodes)
            current = settings.hosts_file.read_text(encoding="utf-8") if settings.hosts_file.exists() else ""
            if write_hosts_file(settings.hosts_file, imex.render_hosts(current, new)):
                log.info("wrote %s: %d of %d IMEX peer names in use", settings.hosts_file,
                         sum(ip != cd.UNUSED_SLOT_IP for ip in new.values()), len(new))
            if mapping is None:
                process.ensure_started()  # once; the watchdog restarts it after an unexpected exit
            else:
                change = imex.membership_change(mapping, new)
                if change.changed:
                    log.info("IMEX peers changed (added %s, removed %s, moved %s)", list(change.added),
                             list(change.removed), list(change.moved))
                    process.reload()
            mapping = new
            stop.wait(settings.poll_interval_s)
    finally:
        try:
            leave_clique(client, settings)
        except kube_errors.KubeAPIError as exc:
            log.warning("cannot remove the clique entry: %s", exc)
        process.stop()
    return 0


def check(settings: DaemonSettings, timeout_s: float = 10.0) -> tuple[bool, str]:
    """The probe: ``nvidia-imex-ctl -c <imexd.cfg> -q`` must print exactly ``READY\\n``
    (:func:`~dradriver.host.imexprocess.query_ready`); no clique: success.

    :returns: (ok, what was printed or why it failed).
    """
    if not settings.clique_id:
        return True, "no clique: nothing to check"
    return query_ready(settings.imex_ctl_binary, settings.config_path, timeout_s)
