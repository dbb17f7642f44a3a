"""One long-lived NVML session: library loading, ``nvmlInit``/``nvmlShutdown``, cached handles, error mapping.

Which library is used (:func:`open_session`):

1. ``mock_profile`` set: the bundled mock ``libnvidia-ml.so.1`` (:mod:`dradriver.nvml.mock`) with that
   profile.
2. ``library_path`` set: exactly that file.
3. neither: the system's ``libnvidia-ml.so.1`` through the ordinary dynamic-loader search.

Loading mechanism (cases 1 and 2): the file is opened with ``ctypes.CDLL(path, RTLD_GLOBAL)`` and the
handle is installed as pynvml's library (``pynvml.nvmlLib``) before pynvml would load its own. Because the
NVIDIA library and our mock both carry the SONAME ``libnvidia-ml.so.1``, any later
``dlopen("libnvidia-ml.so.1")`` in this process (pynvml, or ``cuda.bindings.cynvml`` in our Cython
extensions) resolves to the same object. Asking for a different file later re-points pynvml at it while no
session is open (the old file stays mapped), and raises :class:`NvmlError` while a session is open.

The mock re-reads its profile at every ``nvmlInit``, so tests switch profiles by closing the session,
opening another with the new ``mock_profile``.

A node whose driver is not available now (a driver upgrade in progress, a reboot into a module that does not load,
a driver container that has not populated the driver root yet) gets a session that is not initialised, with the
reason (:func:`open_session_or_absent`): every call raises :class:`~dradriver.nvml.errors.NvmlUnavailable` naming
it, and :meth:`NvmlSession.init` tries ``nvmlInit`` again. The session is the one place that says whether NVML can
be used and why not; the parts of a plugin keep the same session object across the driver's absence.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pynvml

from dradriver.nvml.errors import (
    NvmlDriverNotLoaded,
    NvmlError,
    NvmlFunctionNotFound,
    NvmlLibraryNotFound,
    NvmlLibRmVersionMismatch,
    NvmlNotSupported,
    NvmlUnavailable,
    NvmlUninitialized,
    from_pynvml,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

SYSTEM_LIBRARY = "libnvidia-ml.so.1"

DRIVER_ABSENT: tuple[type[NvmlError], ...] = (NvmlLibraryNotFound, NvmlDriverNotLoaded, NvmlLibRmVersionMismatch)
"""``nvmlInit`` failures meaning the NVIDIA driver is not available now, and may come back without a restart: no
``libnvidia-ml.so.1`` (``NVML_ERROR_LIBRARY_NOT_FOUND``), no kernel module (``NVML_ERROR_DRIVER_NOT_LOADED``), or a
user space of another version than the loaded module, as in the middle of an upgrade
(``NVML_ERROR_LIB_RM_VERSION_MISMATCH``); ``nvmlReturn_t`` in NVIDIA's ``nvml.h``."""

DRIVER_GONE: tuple[type[NvmlError], ...] = (NvmlDriverNotLoaded, NvmlUninitialized, NvmlLibRmVersionMismatch)
"""Failures of a call on an initialised session meaning the driver it was initialised with went away (unloaded or
reloaded under the process): ``NVML_ERROR_DRIVER_NOT_LOADED``, ``NVML_ERROR_UNINITIALIZED`` (the library's
initialisation is gone), ``NVML_ERROR_LIB_RM_VERSION_MISMATCH`` (a kernel module of another version is loaded now);
``nvmlReturn_t`` in NVIDIA's ``nvml.h``."""

_lock = threading.Lock()
_open_sessions = 0
_loaded_path: str | None = None
_active_profile: str | None = None


def _install_library(path: str) -> None:
    """Load ``path`` globally and make it pynvml's NVML library; raises :class:`NvmlLibraryNotFound`."""
    global _loaded_path
    resolved = str(Path(path).resolve())
    if _loaded_path == resolved and pynvml.nvmlLib is not None:
        return
    if pynvml.nvmlLib is not None and _open_sessions > 0:
        raise NvmlError(
            f"cannot switch the NVML library to {resolved}: {_loaded_path or 'the system library'} "
            "is in use by an open session"
        )
    if not Path(resolved).is_file():
        raise NvmlLibraryNotFound(f"NVML library {path} does not exist")
    try:
        handle = ctypes.CDLL(resolved, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise NvmlLibraryNotFound(f"cannot load NVML library {resolved}: {exc}") from exc
    with pynvml.libLoadLock:
        pynvml.nvmlLib = handle
        pynvml._nvmlGetFunctionPointer_cache.clear()
    _loaded_path = resolved


def _load_system_library() -> None:
    """Let pynvml load ``libnvidia-ml.so.1`` from the loader path; raises :class:`NvmlLibraryNotFound`."""
    global _loaded_path
    if pynvml.nvmlLib is not None:
        return
    try:
        pynvml._LoadNvmlLibrary()
    except pynvml.NVMLError as exc:
        raise NvmlLibraryNotFound(
            f"NVML library {SYSTEM_LIBRARY} not found: is the NVIDIA driver installed? "
            "(use --nvml-library PATH or DRADRIVER_NVML_LIBRARY to name it, or --mock-profile NAME to try "
            "the bundled mock)"
        ) from exc
    _loaded_path = None


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class NvmlSession:
    """An initialised NVML library; use as a context manager or call :meth:`close`.

    All NVML calls of dradriver go through :meth:`call` / :meth:`optional` (or the helpers built on them),
    which convert pynvml's ``NVMLError`` into :mod:`dradriver.nvml.errors` classes. Device handles are
    cached for the life of the session and dropped at :meth:`close` (they are invalid after
    ``nvmlShutdown``).

    A session made by :func:`open_session_or_absent` on a node without a usable driver is not initialised:
    :attr:`available` is False, :attr:`unavailable_reason` says why, every call raises
    :class:`~dradriver.nvml.errors.NvmlUnavailable`, and :meth:`init` tries again.

    :ivar library: the file loaded, or ``"libnvidia-ml.so.1"`` for the system library.
    :ivar mock_profile: profile path when the bundled mock is in use, else ``None``.
    """

    def __init__(self, library: str, mock_profile: str | None = None, *, unavailable: str = "") -> None:
        self.library = library
        self.mock_profile = mock_profile
        self._unavailable = unavailable
        self._init_lock = threading.Lock()
        self._closed = False
        self._handles: dict[int, Any] = {}
        self._handles_by_uuid: dict[str, Any] = {}
        self._mig_handles: dict[tuple[int, int], Any] = {}

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def available(self) -> bool:
        """NVML is initialised and the session is open."""
        return not self._unavailable and not self._closed

    @property
    def unavailable_reason(self) -> str:
        """Why NVML cannot be used now (the ``nvmlInit`` failure), ``""`` when it can."""
        return self._unavailable

    def init(self, library_path: str = "") -> bool:
        """Try ``nvmlInit`` again on a session that started without the driver; True once NVML is initialised.

        :param library_path: the library to load now (the driver root's ``libnvidia-ml.so.1`` may have appeared
            since the last try); ignored with a mock profile.
        :returns: :attr:`available` (False: :attr:`unavailable_reason` holds the newest failure).
        :raises NvmlError: ``nvmlInit`` failed for another reason than the driver's absence (:data:`DRIVER_ABSENT`).
        """
        with self._init_lock:
            if self._closed or not self._unavailable:
                return self.available
            try:
                self.library, self.mock_profile = _initialise(library_path, self.mock_profile or "")
            except DRIVER_ABSENT as exc:
                self._unavailable = str(exc)
                return False
            self._unavailable = ""
        log.info("NVML initialised from %s", self.library)
        return True

    def close(self) -> None:
        """Drop cached handles and call ``nvmlShutdown`` once (when NVML was initialised); later calls do nothing."""
        with self._init_lock:
            if self._closed:
                return
            self._closed = True
            if self._unavailable:
                return
        self._shut_down()

    def lose(self, reason: str) -> bool:
        """The driver went away under this session (a driver reload): drop the cached handles, shut the stale
        initialisation (``nvmlShutdown``, which also releases the device files the old kernel module counts) and
        mark the session unavailable with ``reason``; :meth:`init` initialises it again once the driver is back.

        :returns: False when the session was closed or already unavailable (nothing done).
        """
        with self._init_lock:
            if self._closed or self._unavailable:
                return False
            self._unavailable = reason or "the NVIDIA driver went away"
        log.warning("NVML session shut: %s", self._unavailable)
        self._shut_down()
        return True

    def reinit(self, library_path: str = "") -> bool:
        """``nvmlShutdown`` then ``nvmlInit`` again, so NVML enumerates the GPUs anew: NVML lists the GPUs the
        ``nvidia`` driver holds at its first ``nvmlInit`` of a process (the library's reference count going from 0
        to 1), so a GPU bound back to ``nvidia`` is seen, and one given to a VFIO driver is gone, only after it
        (VFIO passthrough, :mod:`dradriver.preparers.vfio`). Every cached handle is dropped; handles others hold
        (the health monitor's) are invalid afterwards, so they are stopped first. Other sessions of the process
        keep the library initialised, and then nothing is enumerated again.

        :param library_path: as :meth:`init`.
        :returns: :attr:`available` (False: the ``nvmlInit`` failed with the driver's absence, which
            :attr:`unavailable_reason` says; :meth:`init` tries again).
        :raises NvmlError: ``nvmlInit`` failed otherwise (the session is unavailable with the reason).
        """
        with self._init_lock:
            if self._closed:
                return False
            if not self._unavailable:
                self._shut_down()
            try:
                self.library, self.mock_profile = _initialise(library_path, self.mock_profile or "")
            except DRIVER_ABSENT as exc:
                self._unavailable = str(exc)
                return False
            except NvmlError as exc:
                self._unavailable = str(exc)
                raise
            self._unavailable = ""
        log.info("NVML initialised again from %s (GPUs enumerated anew)", self.library)
        return True

    def _shut_down(self) -> None:
        """Forget the handles of this initialisation, uncount the session and call ``nvmlShutdown``."""
        global _open_sessions, _active_profile
        self._handles.clear()
        self._handles_by_uuid.clear()
        self._mig_handles.clear()
        with _lock:
            _open_sessions -= 1
            if _open_sessions == 0:
                _active_profile = None
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> NvmlSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- calling NVML ----------------------------------------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any, context: str = "") -> T:
        """Call a pynvml function; NVML failures raise the :class:`NvmlError` subclass of their code.

        :param context: text naming the call and the object, prefixed to the error message; defaults
            to the function's name.
        :raises NvmlUninitialized: the session is closed.
        """
        if self._closed:
            raise NvmlUninitialized(f"{context or fn.__name__}: NVML session is closed")
        if self._unavailable:
            raise NvmlUnavailable(f"{context or fn.__name__}: {self._unavailable}")
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            raise from_pynvml(exc, context or fn.__name__) from exc

    def optional(self, fn: Callable[..., T], *args: Any, context: str = "") -> T | None:
        """Like :meth:`call`, but "feature absent" gives ``None``: NOT_SUPPORTED, or FUNCTION_NOT_FOUND (an
        older driver without the entry point). Every other failure still raises."""
        try:
            return self.call(fn, *args, context=context)
        except (NvmlNotSupported, NvmlFunctionNotFound):
            return None

    # -- system queries --------------------------------------------------------------------------------------

    def driver_version(self) -> str:
        """``nvmlSystemGetDriverVersion``, verbatim (``"570.148.08"``)."""
        return _text(self.call(pynvml.nvmlSystemGetDriverVersion))

    def cuda_driver_version(self) -> int:
        """``nvmlSystemGetCudaDriverVersion_v2`` (``1000*major + 10*minor``), 0 when not supported."""
        value = self.optional(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        if value is None:
            value = self.optional(pynvml.nvmlSystemGetCudaDriverVersion)
        return int(value or 0)

    def nvml_version(self) -> str:
        """``nvmlSystemGetNVMLVersion`` verbatim, ``""`` when not supported."""
        value = self.optional(pynvml.nvmlSystemGetNVMLVersion)
        return _text(value) if value is not None else ""

    def device_count(self) -> int:
        """``nvmlDeviceGetCount_v2``: number of GPUs NVML enumerates (lost ones included)."""
        return int(self.call(pynvml.nvmlDeviceGetCount))

    # -- handles ---------------------------------------------------------------------------------------------

    def device(self, index: int) -> Any:
        """Handle of the GPU at enumeration ``index`` (cached)."""
        handle = self._handles.get(index)
        if handle is None:
            handle = self.call(pynvml.nvmlDeviceGetHandleByIndex, index, context=f"GPU index {index}")
            self._handles[index] = handle
        return handle

    def device_by_uuid(self, uuid: str) -> Any:
        """Handle of the GPU or MIG device with ``uuid`` (``GPU-…``/``MIG-…``), cached."""
        handle = self._handles_by_uuid.get(uuid)
        if handle is None:
            handle = self.call(pynvml.nvmlDeviceGetHandleByUUID, uuid, context=f"device {uuid}")
            self._handles_by_uuid[uuid] = handle
        return handle

    def mig_device(self, parent_index: int, mig_index: int) -> Any | None:
        """Handle of MIG device slot ``mig_index`` of GPU ``parent_index``; ``None`` for an empty slot
        (NOT_FOUND or INVALID_ARGUMENT, as go-nvlib treats them). Cached."""
        key = (parent_index, mig_index)
        if key in self._mig_handles:
            return self._mig_handles[key]
        try:
            handle = self.call(
                pynvml.nvmlDeviceGetMigDeviceHandleByIndex,
                self.device(parent_index),
                mig_index,
                context=f"MIG slot {mig_index} of GPU index {parent_index}",
            )
        except NvmlError as exc:
            if exc.code not in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                raise
            handle = None
        self._mig_handles[key] = handle
        return handle

    def forget_mig_handles(self, parent_uuid: str | None = None) -> None:
        """Drop cached MIG device handles: dynamic MIG created or destroyed an instance (on ``parent_uuid``, for
        the log), so MIG slots name other devices now. Full-GPU handles stay cached; slots are re-read lazily."""
        if self._mig_handles:
            log.debug("MIG device handles dropped after a change on %s", parent_uuid or "a GPU")
        self._mig_handles.clear()


def _initialise(library_path: str, mock_profile: str) -> tuple[str, str | None]:
    """Load the library (:func:`open_session`'s choice), call ``nvmlInit`` and count the session; returns the
    library loaded and the mock profile path (``None`` without the mock)."""
    global _open_sessions, _active_profile
    profile: str | None = None
    with _lock:
        if mock_profile:
            from dradriver.nvml import mock

            wanted = str(mock.profile_path(mock_profile))
            if _open_sessions > 0 and _active_profile not in (None, wanted):
                raise NvmlError(
                    f"cannot switch the mock NVML profile to {wanted} while a session on {_active_profile} "
                    "is open (the mock reads its profile at the first nvmlInit); close it first"
                )
            lib = str(mock.activate(mock_profile))
            profile = os.environ.get(mock.PROFILE_ENV)
            _install_library(lib)
        elif library_path:
            lib = library_path
            _install_library(library_path)
        else:
            lib = SYSTEM_LIBRARY
            _load_system_library()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise from_pynvml(exc, f"nvmlInit ({lib})") from exc
        _open_sessions += 1
        if _open_sessions == 1:
            _active_profile = profile
    log.debug("NVML initialised from %s", lib)
    return lib, profile


def open_session(library_path: str = "", mock_profile: str = "") -> NvmlSession:
    """Load NVML (see the module docstring for the choice), call ``nvmlInit`` and return the session.

    :param library_path: explicit ``libnvidia-ml.so.1`` to load; ignored when ``mock_profile`` is given.
    :param mock_profile: bundled mock profile name (``dgx-a100``) or path of a profile file.
    :raises NvmlLibraryNotFound: no library at the path, or no system library.
    :raises dradriver.nvml.mock.MockNvmlError: unknown profile or mock library not built.
    :raises NvmlError: ``nvmlInit`` failed (e.g. ``NvmlDriverNotLoaded``); the message says so.
    """
    lib, profile = _initialise(library_path, mock_profile)
    return NvmlSession(lib, profile)


def open_session_or_absent(library_path: str = "", mock_profile: str = "") -> NvmlSession:
    """:func:`open_session`, or, when the driver is not available now (:data:`DRIVER_ABSENT`), a session that is not
    initialised and says why (:attr:`NvmlSession.unavailable_reason`; :meth:`NvmlSession.init` tries again).

    :raises dradriver.nvml.mock.MockNvmlError: unknown profile or mock library not built.
    :raises NvmlError: ``nvmlInit`` failed for another reason.
    """
    try:
        return open_session(library_path, mock_profile)
    except DRIVER_ABSENT as exc:
        log.warning("NVML not available: %s", exc)
        return NvmlSession(library_path or SYSTEM_LIBRARY, mock_profile or None, unavailable=str(exc))
