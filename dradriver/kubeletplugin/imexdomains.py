"""The IMEX domain directories (``<plugin dir>/domains/<cdUID>``) of ComputeDomains that are gone: removed by the
compute-domain plugin's 10-minute loop, as NVIDIA's plugin does (``cmd/compute-domain-kubelet-plugin/`` in
kubernetes-sigs/dra-driver-nvidia-gpu). A daemon claim's directory outlives the claim
(:mod:`dradriver.preparers.computedomain`) until its ComputeDomain is deleted."""

from __future__ import annotations

import logging
from typing import Any

from dradriver.config import PluginConfig
from dradriver.host import imexchannels
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kubeletplugin.runner import BatchRunner

log = logging.getLogger(__name__)


def remove_vanished_domain_dirs(client: Any, config: PluginConfig, runner: BatchRunner, *,
                                keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Remove ``<plugin dir>/domains/<cdUID>`` of every ComputeDomain that no longer exists and that no stored
    daemon claim names (NVIDIA's 10-minute loop), except the IDs in ``keep`` (pre-warmed mode: the node's clique
    domain, which is no ComputeDomain); returns the removed UIDs."""
    held = {str(r.data.get("domain")) for _uid, r in runner.stored_records("imex-daemon", "")}
    removed: list[str] = []
    try:
        existing = {str((i.get("metadata") or {}).get("uid")) for i in
                    kube_cd.list_compute_domains(client).get("items") or ()}
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot list ComputeDomains for the domain-directory cleanup: %s", exc)
        return removed
    for uid in imexchannels.domain_dirs(config.plugin_dir):
        if uid in existing or uid in held or uid in keep:
            continue
        try:
            if imexchannels.remove_domain_dir(config.plugin_dir, uid):
                removed.append(uid)
                log.info("removed IMEX domain directory of ComputeDomain %s (gone)", uid)
        except imexchannels.ImexError as exc:
            log.warning("%s", exc)
    return removed
