"""Runtime home of the compiled hot paths (sources in ``ext/``) and their pure-Python twins.

:func:`load` picks the implementation of one module in one place. The compiled module is the default;
``DRADRIVER_NO_EXTENSIONS=1`` selects the twin explicitly. A compiled module that fails to import is a
loud :class:`~dradriver.errors.ExtensionMissingError`, never a silent fall-back to the slow path.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, overload

from dradriver.errors import ExtensionMissingError

if TYPE_CHECKING:
    from dradriver._native import cdispec, claimstore, kubeletchecksum, nvmlpoll
    from dradriver._native.claimstore_py import (
        ClaimConflictError,
        ClaimRecordError,
        ClaimStateCorruptError,
        ClaimStateError,
        ClaimStateVersionError,
        ClaimUnknownError,
    )


class NvmlpollModule(Protocol):
    """What :func:`load` returns for ``"nvmlpoll"``: the types of ``nvmlpoll.pyi``, for both implementations."""

    __name__: str
    Poller: type[nvmlpoll.Poller]


class CdispecModule(Protocol):
    """What :func:`load` returns for ``"cdispec"``: the types of ``cdispec.pyi``, for both implementations."""

    __name__: str
    KNOWN_VERSIONS: tuple[str, ...]
    HOOK_NAMES: tuple[str, ...]
    NODE_TYPES: tuple[str, ...]
    MAX_MAJOR: int
    MAX_MINOR: int
    MAX_FILE_MODE: int
    MAX_UINT32: int
    IMEX_CHANNEL_COUNT: int
    IMEX_CHANNEL_DIR: str
    MAX_ANNOTATIONS_SIZE: int

    def render_spec(
        self,
        kind: str,
        devices: Sequence[Sequence[object]],
        common: Sequence[object] | None = None,
        annotations: Sequence[tuple[str, str]] = (),
        cdi_version: str | None = None,
    ) -> bytes: ...

    def render_channel_spec(
        self,
        kind: str,
        channels: Sequence[int] | range,
        major: int,
        name_prefix: str = "",
        file_mode: int | None = 0o666,
        host_root: str = "",
        common: Sequence[object] | None = None,
        cdi_version: str | None = None,
        device_name: str | None = None,
    ) -> bytes: ...


class ClaimstoreModule(Protocol):
    """What :func:`load` returns for ``"claimstore"``: the types of ``claimstore.pyi``, for both implementations."""

    __name__: str
    ClaimConflictError: type[ClaimConflictError]
    ClaimRecordError: type[ClaimRecordError]
    ClaimStateCorruptError: type[ClaimStateCorruptError]
    ClaimStateError: type[ClaimStateError]
    ClaimStateVersionError: type[ClaimStateVersionError]
    ClaimUnknownError: type[ClaimUnknownError]
    Table: type[claimstore.Table]
    MAGIC: bytes
    FORMAT_VERSION: int
    READABLE_VERSIONS: tuple[int, ...]
    STATE_PREPARE_STARTED: int
    STATE_PREPARE_COMPLETED: int
    RECORD_PUT: int
    RECORD_DELETE: int
    APPLY_OK: int
    APPLY_TORN: int
    APPLY_BAD_FRAME: int
    APPLY_BAD_RECORD: int
    FRAME_HEAD_SIZE: int
    MAX_STR: int
    MAX_COUNT: int
    MAX_PAYLOAD: int

    def crc32(self, data: bytes, value: int = 0) -> int: ...
    def encode_header(self, boot_id: str, version: int = ...) -> bytes: ...
    def decode_header(self, data: bytes) -> tuple[int, str, int]: ...
    def append(self, fd: int, data: bytes) -> None: ...


class KubeletchecksumModule(Protocol):
    """What :func:`load` returns for ``"kubeletchecksum"``: the types of ``kubeletchecksum.pyi``."""

    __name__: str
    FNV32_OFFSET: int
    FNV32_PRIME: int
    PREFIX: bytes

    def checksum(self, data: bytes) -> int: ...


NativeModule = NvmlpollModule | CdispecModule | ClaimstoreModule | KubeletchecksumModule
"""Any module :func:`load` returns."""

if TYPE_CHECKING:  # the stubs (``<name>.pyi``) satisfy the protocols load() is typed with
    _nvmlpoll_check: NvmlpollModule = nvmlpoll
    _cdispec_check: CdispecModule = cdispec
    _claimstore_check: ClaimstoreModule = claimstore
    _kubeletchecksum_check: KubeletchecksumModule = kubeletchecksum


def use_extensions() -> bool:
    """False when ``DRADRIVER_NO_EXTENSIONS=1`` asks for the pure-Python twins."""
    return os.environ.get("DRADRIVER_NO_EXTENSIONS", "") != "1"


@overload
def load(name: Literal["nvmlpoll"]) -> NvmlpollModule: ...
@overload
def load(name: Literal["cdispec"]) -> CdispecModule: ...
@overload
def load(name: Literal["claimstore"]) -> ClaimstoreModule: ...
@overload
def load(name: Literal["kubeletchecksum"]) -> KubeletchecksumModule: ...
@overload
def load(name: str) -> NativeModule: ...


def load(name: str) -> NativeModule:
    """Return ``dradriver._native.<name>`` (compiled) or ``dradriver._native.<name>_py`` (twin).

    :raises ExtensionMissingError: the compiled module is wanted but cannot be imported.
    """
    if not use_extensions():
        return importlib.import_module(f"{__name__}.{name}_py")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:
        raise ExtensionMissingError(
            f"compiled module dradriver._native.{name} is missing ({exc}); rebuild with "
            "`python -m pip install -e .` or set DRADRIVER_NO_EXTENSIONS=1 to run the pure-Python twin"
        ) from exc


MODULES: tuple[str, ...] = ("nvmlpoll", "cdispec", "claimstore", "kubeletchecksum")
"""Every hot path with a compiled module in ``ext/`` and a pure-Python twin."""


def load_all() -> dict[str, str]:
    """Load every module of :data:`MODULES` now (at program start); returns name -> ``"c"``/``"py"``.

    :raises ExtensionMissingError: a compiled module is wanted but cannot be imported.
    """
    return {name: ("py" if load(name).__name__.endswith("_py") else "c") for name in MODULES}


def implementation(name: str) -> str:
    """``"c"`` or ``"py"``: which implementation :func:`load` returns for ``name``."""
    module = load(name)
    return "py" if module.__name__.endswith("_py") else "c"
