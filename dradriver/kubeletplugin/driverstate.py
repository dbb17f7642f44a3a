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
:class:`DriverWatch` (the devices read since).

A driver reload under the running plugin (a GPU Operator upgrade replaces the driver container and reloads the
kernel modules; NVIDIA's plugin keeps its stale NVML handle and every claim fails with "invalid CDI Spec: empty
device edits" until it is restarted: NVIDIA/gpu-operator, aicr#980 and #1030, k8s-driver-manager#203) is detected by
a :class:`ReloadDetector` that the watch asks every :attr:`DriverWatch.period_s`, and at once after an NVML call
failed with one of :data:`RELOAD_HINTS` (:meth:`DriverWatch.suspect`, the health monitor's NVML-error hook). The
watch then refuses prepares with the reason (readiness NOT_SERVING), runs the plugin's ``depart`` (stop what uses
NVML, report it), shuts the stale NVML handle (:meth:`~dradriver.nvml.session.NvmlSession.lose`) and tries
``nvmlInit`` again as at a start without the driver; ``arrive`` re-reads the devices and the new driver's files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from dradriver.domain.claims import ClaimRef, ClaimResult
from dradriver.domain.ports import ClaimPreparer
from dradriver.nvml.errors import NvmlError, NvmlUnavailable
from dradriver.nvml.session import DRIVER_GONE, NvmlSession

log = logging.getLogger(__name__)

RETRY_PERIOD_S = 5.0
"""Seconds between two tries of ``nvmlInit`` while the driver is absent (NVIDIA's driver container
checks for the driver's readiness at the same order of period)."""

READING = "the NVIDIA driver is back; reading its devices"
"""The reason while the devices of a driver that came back are being read."""

RELOAD_HINTS = frozenset({1, 9, 15, 18})
"""``nvmlReturn_t`` codes of failed NVML calls after which the watch checks for a reload at once instead of at its
next period: UNINITIALIZED, DRIVER_NOT_LOADED, GPU_IS_LOST (also one GPU falling off the bus: the check tells them
apart), LIB_RM_VERSION_MISMATCH (``nvml.h``)."""


class ReloadDetector:
    """Whether the NVIDIA driver NVML was initialised with is still the one loaded; the reason when it is not.

    Four signs, checked by :meth:`check` against what :meth:`remember` saw when the driver's devices were read:
    ``nvmlSystemGetDriverVersion`` failing with :data:`~dradriver.nvml.session.DRIVER_GONE` (the module was unloaded
    under the session), the driver version changed, the ``nvidia`` character-device major in ``/proc/devices``
    changed or vanished, or a file the loaded module owns was made again or is gone (``files``: ``/dev/nvidiactl``
    and ``/sys/module/nvidia``, whose inodes are new after the module is loaded again even when its major, 195 in
    practice, and its version stay the same). A change of the ``nvidia-uvm`` or ``nvidia-caps`` majors alone is no
    reload: the CDI edits are computed again from ``/proc/devices`` (:class:`~dradriver.host.devicenodes.EditsCache`).
    Each sign costs a file read or a ``stat``, and one NVML call.

    :param session: the plugin's NVML session.
    :param majors: character-device majors by name now (``/proc/devices``;
        :meth:`~dradriver.host.devicenodes.DeviceNodeInfo.read_majors`).
    :param files: the identity of each of the module's files that exists now, by path
        (:func:`~dradriver.host.devicenodes.read_identities`); a file absent at :meth:`remember` is not watched.
    """

    MODULE = "nvidia"
    """The ``/proc/devices`` name of the NVIDIA kernel module's character devices (``/dev/nvidia<minor>``,
    ``/dev/nvidiactl``)."""

    def __init__(self, session: NvmlSession, majors: Callable[[], Mapping[str, int]],
                 files: Callable[[], Mapping[str, object]] | None = None) -> None:
        self.session = session
        self.majors = majors
        self.files = files
        self.version = ""
        """The driver version read at :meth:`remember` (``""`` before)."""
        self.major: int | None = None
        """The ``nvidia`` major at :meth:`remember` (``None``: not in ``/proc/devices`` then)."""
        self.identities: Mapping[str, object] = {}
        """The identities of the module's files at :meth:`remember`, by path."""

    def remember(self) -> None:
        """Take the driver in use now as the one to compare with (after its devices were read).

        :raises NvmlError: the driver version cannot be read.
        """
        self.version = self.session.driver_version()
        self.major = self.majors().get(self.MODULE)
        self.identities = dict(self.files()) if self.files is not None else {}

    def check(self) -> str:
        """Why the driver in use is not the one remembered (``""``: it is, or nothing was remembered yet, or NVML is
        already known to be unavailable)."""
        if not self.version:
            return ""
        try:
            version = self.session.driver_version()
        except NvmlUnavailable:
            return ""
        except DRIVER_GONE as exc:
            return f"NVML calls fail ({exc}): the NVIDIA driver {self.version} was unloaded"
        except NvmlError as exc:  # another failure says nothing about a reload
            log.debug("driver version not readable now: %s", exc)
            return ""
        if version != self.version:
            return f"the NVIDIA driver version changed from {self.version} to {version}"
        major = self.majors().get(self.MODULE)
        if self.major is not None and major != self.major:
            now = f"is {major} now" if major is not None else "is no longer in /proc/devices"
            return (f"the {self.MODULE} character-device major was {self.major} and {now}: the kernel module was "
                    "reloaded")
        if self.identities and self.files is not None:
            files = self.files()
            for path, seen in self.identities.items():
                if files.get(path) != seen:
                    how = "was made again" if path in files else "is gone"
                    return f"{path} {how}: the kernel module was reloaded"
        return ""


class DriverWatch:
    """Whether the plugin can prepare with the NVIDIA driver now, and why not; brings it back without a restart.

    :param session: the plugin's NVML session (available or not).
    :param library: the NVML library to load at each try (the driver root's ``libnvidia-ml.so.1`` may appear).
    :param arrive: blocking, run once NVML is initialised (discovery, driver files, publication, health, kept
        undo); an exception is logged and the next try runs it again.
    :param period_s: seconds between tries (``None``: :data:`RETRY_PERIOD_S`).
    :param interrupt: ends an :attr:`arrive` in progress at :meth:`stop` (the compute-domain plugin's wait for the
        NVLink fabric registration); ``None``: stop waits for it.
    :param reloaded: why the driver in use went away, ``""`` while it has not (:meth:`ReloadDetector.check`):
        with it the watch keeps running while the driver is available and checks every period (and at
        :meth:`suspect`); without it the watch ends once the driver is usable.
    :param depart: blocking, run with the reason once a reload is detected, before the stale NVML handle is shut
        (stop what uses NVML, report it); an exception is logged.
    """

    def __init__(self, session: NvmlSession, *, library: Callable[[], str], arrive: Callable[[], None],
                 period_s: float | None = None, interrupt: Callable[[], None] | None = None,
                 reloaded: Callable[[], str] | None = None, depart: Callable[[str], None] | None = None) -> None:
        self.session = session
        self.library = library
        self.arrive = arrive
        self.interrupt = interrupt
        self.reloaded = reloaded
        self.depart = depart
        self.period_s = RETRY_PERIOD_S if period_s is None else period_s
        self._reason = session.unavailable_reason if not session.available else ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.tries = 0
        """``nvmlInit`` tries so far (after the start's own)."""
        self.reloads = 0
        """Reloads detected so far (:meth:`check_once`)."""
        self._departing = ""

    def reason(self) -> str:
        """Why prepares are refused now: the driver's absence (``nvmlInit``'s error), or :data:`READING`; ``""``
        once the devices of an available driver are read."""
        return self._reason

    def refusal(self) -> str:
        """Why prepares are refused now, as a claim's error says it (``""`` once they are served)."""
        why = self._reason
        return (f"the NVIDIA driver is not available on this node ({why}); the plugin uses it once it is back, "
                "without a restart") if why else ""

    def departing(self) -> str:
        """Why the driver is going away, while a detected reload is being handled and NVML may still look usable
        (:attr:`depart` running, the stale handle not shut yet); ``""`` otherwise. Undo that needs the driver is
        kept for its return meanwhile (the runner's ``driver_unavailable``)."""
        return self._departing

    def start(self) -> None:
        """Try again in a background thread until the driver is back (nothing to do when it is and there is no
        :attr:`reloaded` check); with :attr:`reloaded`, keep checking for a reload while it is available."""
        if (self._reason or self.reloaded is not None) and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="nvidia-driver-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the background tries (waits for one in progress, interrupted when :attr:`interrupt` is given)."""
        self._stop.set()
        self._wake.set()
        if self.interrupt is not None:
            self.interrupt()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def suspect(self, code: int) -> None:
        """An NVML call failed with ``code`` (``nvmlReturn_t``): for one of :data:`RELOAD_HINTS`, check for a
        reload now rather than at the next period (any thread; returns at once)."""
        if code in RELOAD_HINTS and not self._reason:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            if self._reason:
                if self.try_once() and self.reloaded is None:
                    return
            elif self.reloaded is not None:
                self.check_once()

    def check_once(self) -> bool:
        """Ask :attr:`reloaded`; on a reload refuse prepares with its reason, run :attr:`depart` and shut the stale
        NVML handle, so the next period tries ``nvmlInit`` again. True when a reload was detected.

        A session that another part made unavailable meanwhile is a driver gone too: the GPU plugin's
        re-initialisation after a VFIO swap (:meth:`~dradriver.nvml.session.NvmlSession.reinit`) that ran after the
        module was unloaded and before this check saw it leaves the session without NVML, which :attr:`reloaded`
        cannot tell (it has no NVML to ask); without this the watch would never try ``nvmlInit`` again."""
        if self.reloaded is None or self._reason:
            return False
        why = self.reloaded()
        if not why and not self.session.available and not self.session.closed:
            why = f"NVML was initialised again and is not available ({self.session.unavailable_reason})"
        if not why:
            return False
        self.reloads += 1
        self._reason = self._departing = (f"the NVIDIA driver went away under the plugin ({why}); waiting for it to "
                                          "be loaded again")
        log.error("%s", self._reason)
        try:
            if self.depart is not None:
                self.depart(why)
        except Exception:
            log.exception("stopping what uses the NVIDIA driver after a reload failed")
        finally:
            self.session.lose(why)
            self._departing = ""
        return True

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
