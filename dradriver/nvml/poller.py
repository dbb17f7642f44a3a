"""Background NVML polling: the compiled poller driven by a thread, the latest sample kept for readers.

Readers (the Prometheus exporter, the health monitor) never wait on NVML: they read :attr:`PollLoop.latest`,
the most recent :class:`~dradriver._native.nvmlfields.Sample`. The poller itself comes from
``dradriver._native.load("nvmlpoll")`` (compiled by default; the pynvml twin with
``DRADRIVER_NO_EXTENSIONS=1``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dradriver import _native
from dradriver._native import nvmlfields
from dradriver.nvml import errors

if TYPE_CHECKING:
    from dradriver._native import nvmlpoll

log = logging.getLogger(__name__)

Sample = nvmlfields.Sample
FIELD_NAMES = nvmlfields.FIELD_NAMES


def open_poller(
    uuids: Sequence[str], fields: Sequence[str] | None = None, library: str | None = None
) -> nvmlpoll.Poller:
    """Return a native ``Poller`` for ``uuids`` (GPU and MIG UUIDs).

    :param library: the ``libnvidia-ml.so.1`` file to sample through: the NVML session's
        (:attr:`~dradriver.nvml.session.NvmlSession.library`), so that after a driver reload that opened the new
        driver's file the poller uses it too; ``None``: the one the dynamic loader finds by name.

    :raises NvmlError: the subclass for the ``nvmlReturn_t`` NVML returned during set-up.
    :raises ExtensionMissingError: the compiled poller is missing and twins were not asked for.
    """
    module = _native.load("nvmlpoll")
    try:
        return module.Poller(list(uuids), None if fields is None else list(fields), library)
    except nvmlfields.PollerError as exc:
        raise errors.error_for_code(exc.code, str(exc)) from exc


class PollLoop:
    """Polls every ``interval_s`` seconds on a daemon thread; :attr:`latest` holds the newest sample.

    :param uuids: devices to sample (GPU and MIG UUIDs).
    :param interval_s: seconds between polls.
    :param on_sample: called on the polling thread after each poll (keep it short).
    :param library: the NVML library file (:func:`open_poller`).
    """

    def __init__(
        self,
        uuids: Sequence[str],
        *,
        interval_s: float = 10.0,
        fields: Sequence[str] | None = None,
        on_sample: Callable[[nvmlfields.Sample], None] | None = None,
        library: str | None = None,
    ) -> None:
        self._poller = open_poller(uuids, fields, library)
        self.interval_s = interval_s
        self._on_sample = on_sample
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the native poller is used by one thread at a time (shared buffers)
        self._thread: threading.Thread | None = None
        self.latest: nvmlfields.Sample | None = None
        self.polls = 0
        self.errors_by_code: dict[int, int] = {}

    def poll_once(self) -> nvmlfields.Sample:
        """Poll now on the calling thread, store and return the sample (thread-safe)."""
        with self._lock:
            sample = self._poller.poll()
        statuses: Sequence[int] = sample.status  # type: ignore[assignment]
        for code in set(statuses):
            if code not in (nvmlfields.NVML_SUCCESS, nvmlfields.NVML_ERROR_NOT_SUPPORTED):
                self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
        self.latest = sample
        self.polls += 1
        if self._on_sample is not None:
            self._on_sample(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # a failing poll must not end monitoring
                log.exception("NVML poll failed")
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        """Start the polling thread (first poll immediately)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nvml-poller", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and release NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            self._poller.close()
