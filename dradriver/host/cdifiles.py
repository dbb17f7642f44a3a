"""Crash-safe CDI spec files: atomic writes, deletes, and the start-up sweep of temp files a crash left.

Files are written to a temp name without a ``.yaml``/``.json`` suffix (``.<name>.tmp-<random>``, a name CDI consumers
ignore) in the same directory and renamed over the spec's name, with mode 0644 (the CDI library's ``pkg/cdi/spec.go``).
Claim specs are not fsync'd: they matter only within one boot (a process crash leaves the kernel's page cache, which
every reader sees, intact; after a reboot the plugin deletes every claim spec of the old boot). The argument is in
:mod:`dradriver.host.claimstate`. ``durable=True`` fsyncs the file and its directory for files that must
survive a power loss.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from dradriver.domain.cdi import LEGACY_SPEC_SUFFIX, SPEC_FILE_MODE, SPEC_SUFFIX, CdiKind, CdiSpecError


def sync_directory(directory: Path | str) -> None:
    """``fsync`` a directory, making renames and unlinks in it durable.

    :raises OSError: the directory cannot be opened.
    """
    dir_fd = os.open(str(directory), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_file_atomically(path: Path | str, data: bytes, *, mode: int = SPEC_FILE_MODE, sync_dir: bool = True,
                          durable: bool = False) -> None:
    """Replace ``path`` with ``data`` so readers see the old file or the whole new one, never a part.

    Writes ``.<name>.tmp-<random>`` in the same directory (a name CDI consumers ignore) and renames it over
    ``path``: atomic for every reader on this kernel, and a process killed at any point leaves ``path`` whole
    (old or new). ``durable=True`` also fsyncs the temp file before the rename and, with ``sync_dir``, the
    directory after it, so the new file survives a power loss (``sync_dir=False`` leaves the directory to the
    caller, who then calls :func:`sync_directory` once for several files). On failure the temp file is
    removed and ``path`` is untouched.

    :raises OSError: the directory is missing or not writable, or the disk is full.
    """
    directory, name = os.path.split(os.fspath(path))
    tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have cleared bits
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable and sync_dir:
        sync_directory(directory)


def remove_stale_temp_files(kind: CdiKind, cdi_root: Path | str, claim_uid: str | None = None) -> int:
    """Remove temp files a crashed writer left for this claim's spec (every claim's when ``claim_uid`` is
    ``None``); return how many. Lists the directory: O(files in the CDI root)."""
    prefix = f".{kind.spec_name(claim_uid)}.tmp-" if claim_uid is not None else f".{kind.spec_prefix}"
    removed = 0
    try:
        names = os.listdir(cdi_root)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(prefix) and ".tmp-" in name:
            try:
                os.unlink(os.path.join(cdi_root, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def write_claim_spec(
    kind: CdiKind,
    cdi_root: Path | str,
    claim_uid: str,
    data: bytes,
    *,
    sync_dir: bool = True,
    clean_temp: bool = True,
    durable: bool = False,
) -> Path:
    """Write the claim's rendered spec ``data`` atomically with mode 0644; return the file's path.

    Not fsync'd unless ``durable`` (a claim spec lives for one boot: :mod:`dradriver.host.claimstate` has the
    argument); with ``durable``, ``sync_dir=False`` means the caller fsyncs the CDI root itself
    (:func:`sync_directory`) before relying on it.
    ``clean_temp=False``: skip the per-claim temp-file sweep (a directory listing); callers that sweep once at
    start (:func:`remove_stale_temp_files` without a claim UID) keep each write O(1).

    Idempotent: writing again replaces the file. The file has NVIDIA's name (``.yaml``, see
    :meth:`CdiKind.spec_name`); a ``.json`` spec an older dradriver wrote for the same claim is removed
    afterwards, because the same device defined in two files of one directory makes consumers drop it
    (the CDI library's ``pkg/cdi/spec.go``). Temp files a crashed earlier write left behind are removed first.

    :raises CdiSpecError: the content cannot be built, or the file cannot be written.
    """
    path = _claim_spec_file(kind, cdi_root, claim_uid)
    try:
        if clean_temp:
            remove_stale_temp_files(kind, cdi_root, claim_uid)
        write_file_atomically(path, data, sync_dir=sync_dir, durable=durable)
        _unlink(_legacy_twin(path))
    except OSError as exc:
        raise CdiSpecError(f"claim {claim_uid}: cannot write CDI spec {path}: {exc}") from exc
    return Path(path)


def _claim_spec_file(kind: CdiKind, cdi_root: Path | str, claim_uid: str) -> str:
    """:meth:`CdiKind.spec_path` as a string (a per-claim path: built without pathlib on the claim path).

    :raises CdiSpecError: the claim UID is not usable in names.
    """
    return os.path.join(os.fspath(cdi_root), kind.spec_name(claim_uid))


def _legacy_twin(path: str) -> str:
    """``<name>.json`` beside ``<name>.yaml``: where dradriver wrote the same claim's spec before 2026-12."""
    return path[:-len(SPEC_SUFFIX)] + LEGACY_SPEC_SUFFIX


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def delete_claim_spec(kind: CdiKind, cdi_root: Path | str, claim_uid: str, *, clean_temp: bool = True) -> bool:
    """Remove the claim's spec (and an older release's ``.json`` twin or leftover temp files); True if a spec
    existed.

    A missing file is not an error (unprepare may run twice). ``clean_temp=False`` as for
    :func:`write_claim_spec`.

    :raises CdiSpecError: the file exists but cannot be removed.
    """
    path = _claim_spec_file(kind, cdi_root, claim_uid)
    try:
        found = _unlink(path)
        found = _unlink(_legacy_twin(path)) or found
        if clean_temp:
            remove_stale_temp_files(kind, cdi_root, claim_uid)
    except OSError as exc:
        raise CdiSpecError(f"claim {claim_uid}: cannot delete CDI spec {path}: {exc}") from exc
    return found
