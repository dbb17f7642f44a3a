"""The NVIDIA driver as the GPU kubelet plugin sees it: usable, or not and why.

A node's driver can be absent while the plugin must run: a driver upgrade (the driver container is replaced, or
the kernel module is unloaded and its user space swapped), a reboot into a module that does not load. The kubelet
still unprepares the claims of the pods it evicts meanwhile, and a plugin that exits without NVML leaves their CDI
specs and claim state behind and deadlocks the upgrade on their Unprepare. So the plugin starts without NVML
(:func:`dradriver.nvml.session.open_session_or_absent`) and:

- unprepares from its claim state (specs deleted, devices released; undo that needs the driver kept with the claim,
  :meth:`dradriver.kubeletplugin.runner.BatchRunner.resume_undo`);
- refuses prepares per claim with the reason (:class:`DriverGate`), and its ``readiness`` probe is NOT_SERVING;
- tries ``nvmlInit`` again every :attr:`DriverWatch.period_s` and, once the driver is back, reads the devices and
  the driver's files, publishes them, starts the health monitor, runs the kept undo, and serves prepares, all
  without a restart (:class:`DriverWatch`).

The state lives in the NVML session (:attr:`~dradriver.nvml.session.NvmlSession.unavailable_reason`) and in
:class:`DriverWatch` (the devices read since); a driver-reload detector marks the session unavailable and starts
the watch again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from dradriver.app import assembly
from dradriver.config import PluginConfig
from dradriver.domain.claims import ClaimRef, ClaimResult
from dradriver.domain.identity import DriverIdentity
from dradriver.domain.ports import ClaimPreparer
from dradriver.host.cdihook import CdiHook, visible_path
from dradriver.nvml.session import NvmlSession

log = logging.getLogger(__name__)

RETRY_PERIOD_S = 5.0
"""Seconds between two tries of ``nvmlInit`` while the driver is absent (NVIDIA's driver container
checks for the driver's readiness at the same order of period)."""

READING = "the NVIDIA driver is back; reading its devices"
"""The reason while the devices of a driver that came back are being read."""


class DriverWatch:
    """Whether the plugin can prepare with the NVIDIA driver now, and why not; brings it back without a restart.

    :param session: the plugin's NVML session (available or not).
    :param library: the NVML library to load at each try (the driver root's ``libnvidia-ml.so.1`` may appear).
    :param arrive: blocking, run once NVML is initialised (discovery, driver files, publication, health, kept
        undo); an exception is logged and the next try runs it again.
    :param period_s: seconds between tries (``None``: :data:`RETRY_PERIOD_S`).
    :param interrupt: ends an :attr:`arrive` in progress at :meth:`stop` (the compute-domain plugin's wait for the
        NVLink fabric registration); ``None``: stop waits for it.
    """

    def __init__(self, session: NvmlSession, *, library: Callable[[], str], arrive: Callable[[], None],
                 period_s: float | None = None, interrupt: Callable[[], None] | None = None) -> None:
        self.session = session
        self.library = library
        self.arrive = arrive
        self.interrupt = interrupt
        self.period_s = RETRY_PERIOD_S if period_s is None else period_s
        self._reason = session.unavailable_reason if not session.available else ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tries = 0
        """``nvmlInit`` tries so far (after the start's own)."""

    def reason(self) -> str:
        """Why prepares are refused now: the driver's absence (``nvmlInit``'s error), or :data:`READING`; ``""``
        once the devices of an available driver are read."""
        return self._reason

    def refusal(self) -> str:
        """Why prepares are refused now, as a claim's error says it (``""`` once they are served)."""
        why = self._reason
        return (f"the NVIDIA driver is not available on this node ({why}); the plugin uses it once it is back, "
                "without a restart") if why else ""

    def start(self) -> None:
        """Try again in a background thread until the driver is back (nothing to do when it is)."""
        if self._reason and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="nvidia-driver-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the background tries (waits for one in progress, interrupted when :attr:`interrupt` is given)."""
        self._stop.set()
        if self.interrupt is not None:
            self.interrupt()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.try_once():
                return

    def try_once(self) -> bool:
        """One try: ``nvmlInit``, then :attr:`arrive`; True once the driver is usable."""
        self.tries += 1
        try:
            available = self.session.init(self.library())
        except Exception as exc:  # nvmlInit failed otherwise than by the driver's absence: keep trying
            self._reason = f"NVML cannot be initialised: {exc}"
            log.error("%s", self._reason)
            return False
        if not available:
            self._reason = self.session.unavailable_reason
            log.debug("NVIDIA driver still not available: %s", self._reason)
            return False
        self._reason = READING
        try:
            self.arrive()
        except Exception as exc:
            if self._stop.is_set():  # interrupted by stop()
                log.info("NVIDIA driver watch stopped while the driver's devices were read: %s", exc)
                return False
            self._reason = f"the NVIDIA driver is back but its devices cannot be used yet: {exc}"
            log.error("%s; trying again in %.0f s", self._reason, self.period_s)
            return False
        self._reason = ""
        log.info("NVIDIA driver available: prepares are served")
        return True


class DriverGate:
    """The :class:`~dradriver.domain.ports.ClaimPreparer` the plugin serves: the runner, whose prepares are refused
    per claim while ``refusal()`` says why (:meth:`DriverWatch.refusal`, or the compute-domain plugin's wait for
    the NVLink fabric); unprepares always run (from the claim state alone)."""

    def __init__(self, runner: ClaimPreparer, refusal: Callable[[], str]) -> None:
        self.runner = runner
        self.refusal = refusal

    def prepare_claims(self, claims: Sequence[ClaimRef], *,
                       deadline_s: float | None = None) -> Mapping[str, ClaimResult]:
        """The runner's answer, or each claim's error naming why prepares are refused (nothing prepared)."""
        why = self.refusal()
        if not why:
            return self.runner.prepare_claims(claims, deadline_s=deadline_s)
        return {ref.uid: ClaimResult(error=f"claim {ref}: not prepared: {why} (the kubelet retries)")
                for ref in claims}

    def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """The runner's unprepare (it needs no driver: what needs one is kept for its return)."""
        return self.runner.unprepare_claims(claims)


async def report_unavailable(identity: DriverIdentity, config: PluginConfig, connection: assembly.Connection,
                             session: NvmlSession) -> None:
    """At a start without a usable driver: log it and record a ``NvidiaDriverUnavailable`` Warning Event on the
    Node naming ``nvmlInit``'s failure (:attr:`NvmlSession.unavailable_reason`)."""
    log.error("NVIDIA driver not available: %s; unprepares are served, prepares wait for the driver",
              session.unavailable_reason)
    await asyncio.to_thread(assembly.report_event, identity, connection.client, config, connection.node_uid,
                            "NvidiaDriverUnavailable", f"NVIDIA driver not available: {session.unavailable_reason}; "
                            "claims are unprepared, prepares wait for it")


def first_refusal(*refusals: Callable[[], str]) -> Callable[[], str]:
    """One "why prepares are refused and the plugin is not ready" of several (the driver's absence, the CDI
    hook's): the first non-empty reason, ``""`` when none has one. :class:`DriverGate` refuses by it and the
    ``readiness`` probe is SERVING only while it is ``""``."""
    def refusal() -> str:
        for why in refusals:
            if reason := why():
                return reason
        return ""
    return refusal


async def check_cdi_hook(identity: DriverIdentity, config: PluginConfig, connection: assembly.Connection, *,
                         named: Callable[[], bool]) -> Callable[[], str]:
    """Start step: the ``nvidia-cdi-hook`` that claim specs name (:mod:`dradriver.host.cdihook`), looked at now
    and at each later ask while specs name a hook (``named()``: the driver's files were found, so the spec-level
    edits carry hooks; with none, e.g. the mock NVML without driver files, nothing depends on it).

    With no ``--nvidia-cdi-hook-path`` the image's hook is copied to ``<plugin dir>/nvidia-cdi-hook`` at the first
    look, as NVIDIA's plugin does. While the hook is missing the plugin is not ready and refuses prepares (the
    returned refusal, combined by :func:`first_refusal`): a claim prepared then would give a container that
    cannot be created. Each time it is found missing a ``NvidiaCdiHookMissing`` Warning Event on the Node says
    why; once it is there (installed on the host, or a fixed image) the plugin serves without a restart.

    :returns: why prepares are refused for the hook now (``""``: it is there, cannot be checked, or is not named).
    """
    def report(reason: str) -> None:  # called on a probe or prepare thread: the API call runs on its own
        threading.Thread(target=assembly.report_event, name="cdi-hook-event", daemon=True,
                         args=(identity, connection.client, config, connection.node_uid, "NvidiaCdiHookMissing",
                               reason)).start()

    visible = visible_path(config.cdi_hook_path, plugin_dir=config.plugin_dir,
                           host_driver_root=config.nvidia_driver_root,
                           container_driver_root=config.container_driver_root)
    hook = CdiHook(config.cdi_hook_path, visible, on_missing=report,
                   source=None if config.nvidia_cdi_hook_path else config.image_cdi_hook)

    def refusal() -> str:
        return hook.refusal() if named() else ""

    await asyncio.to_thread(refusal)
    return refusal
