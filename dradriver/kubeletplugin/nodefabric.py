"""This node's NVLink fabric as the compute-domain plugin uses it at start: the wait for the GPUs' fabric
registration, and the ``nvidia.com/gpu.clique`` node label.

The clique ID and fabric health come from NVML's fabric info (:mod:`dradriver.nvml.fabric`; NVIDIA's
``getCliqueID``, ``cmd/compute-domain-kubelet-plugin/nvlib.go`` in kubernetes-sigs/dra-driver-nvidia-gpu). Where
NVIDIA's plugin exits while a registration is in progress (strict mode, gate ``CrashOnNVLinkFabricErrors``) and
crash-loops (its issue #1264), dradriver's waits, serving, with a back-off (:func:`wait_for_fabric`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dradriver.config import PluginConfig
from dradriver.domain.computedomains import NODE_CLIQUE_LABEL
from dradriver.domain.featuregates import CRASH_ON_NVLINK_FABRIC_ERRORS
from dradriver.domain.identity import DriverIdentity
from dradriver.kube import computedomains as kube_cd
from dradriver.kube import errors as kube_errors
from dradriver.kube.client import KubeClient
from dradriver.nvml import fabric
from dradriver.nvml.session import NvmlSession
from dradriver.preparers.mps import Backoff

log = logging.getLogger(__name__)

FABRIC_WAIT_BACKOFF = Backoff(initial_s=1.0, max_s=30.0, jitter=0.1)
"""Delays between fabric reads while a GPU's registration is in progress at start: 1 s doubling to 30 s."""


async def wait_for_fabric(config: PluginConfig, identity: DriverIdentity, session: NvmlSession, *,
                          report: Callable[[str, str], None], backoff: Backoff = FABRIC_WAIT_BACKOFF,
                          pending: Callable[[str], None] = lambda _states: None) -> fabric.NodeFabric:
    """Read the node's fabric; while a GPU's registration is in progress (strict mode,
    :class:`~dradriver.nvml.fabric.FabricPendingError`), read again after each of ``backoff``'s delays.

    While it waits: ``pending`` gets the GPUs' states (``""`` once the wait ends: the plugin, already serving,
    refuses prepares naming them and answers the ``readiness`` probe NOT_SERVING; unprepares are served); each read
    logs them; a ``FabricRegistrationPending`` Warning Event on the Node names them (again when they change).

    :param report: records a Warning Event on the Node, ``(reason, message)``; blocking, run on a thread.
    :returns: the reading.
    :raises dradriver.nvml.fabric.FabricError: GPUs disagree on the clique.
    :raises dradriver.nvml.errors.NvmlError: fabric info cannot be read.
    """
    strict = config.feature_gates[CRASH_ON_NVLINK_FABRIC_ERRORS]
    delays = iter(backoff.delays())
    reported = ""
    started = time.monotonic()
    try:
        while True:
            gpus = await asyncio.to_thread(fabric.read_node_fabric, session)
            try:
                node = fabric.assess_node(gpus, strict=strict)
            except fabric.FabricPendingError as exc:
                delay = next(delays)
                pending(str(exc))
                log.warning("waiting for NVLink fabric registration, not ready meanwhile: %s; reading again in %.1f s",
                            exc, delay)
                if str(exc) != reported:
                    reported = str(exc)
                    await asyncio.to_thread(
                        report, "FabricRegistrationPending", f"{identity.driver_name} kubelet plugin waits for the "
                        f"NVLink fabric manager to register this node's GPUs (not ready meanwhile): {exc}")
                await asyncio.sleep(delay)
                continue
            log.info("NVLink clique of node %s: %s (%d GPU(s), %s mode)%s", config.node_name,
                     node.clique_id or "none (not MNNVL)", len(gpus), "strict" if strict else "legacy",
                     f"; fabric registration done after {time.monotonic() - started:.1f} s" if reported else "")
            return node
    finally:
        pending("")


def set_clique_label(client: KubeClient, node: str, clique: str) -> None:
    """Set ``nvidia.com/gpu.clique=<clique>`` (removed when ``clique`` is empty); failures are logged."""
    try:
        kube_cd.set_node_label(client, node, NODE_CLIQUE_LABEL, clique or None)
    except kube_errors.KubeAPIError as exc:
        log.warning("cannot set node label %s: %s", NODE_CLIQUE_LABEL, exc)
