"""NVIDIA's ``checkpoint.json`` on disk: read it (verified, never guessed at) and replace it whole.

The file is ``<kubelet plugins dir>/<driver>/checkpoint.json`` (``/var/lib/kubelet/plugins/gpu.nvidia.com/`` on a
node), mode 0600, written as the kubelet's checkpoint manager writes it for NVIDIA's plugin
(``pkg/kubelet/checkpointmanager`` in kubernetes/kubernetes): the whole file to a temp file whose name starts
with ``.`` in the same directory, fsync, rename over the file. Bytes and checksums:
:mod:`dradriver.domain.nvcheckpoint`.

Why fsync here when the claim state needs none (:mod:`dradriver.host.claimstate`): NVIDIA's plugin reads this file
at start before it compares boot IDs, and exits 1 on a file it cannot parse or verify. A power loss that left a
renamed but unwritten (empty or partial) file would crash-loop NVIDIA's plugin on the rebooted node; an fsync'd
file is whole, old or new, and an old one is dropped by NVIDIA's boot-ID rule.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from pathlib import Path

from dradriver.domain.nvcheckpoint import GPU_CLAIM, Checkpoint, ClaimSchema, decode
from dradriver.host.cdifiles import write_file_atomically

__all__ = ["CHECKPOINT_FILE", "CHECKPOINT_MODE", "keep_aside", "read_checkpoint", "write_checkpoint"]

CHECKPOINT_FILE = "checkpoint.json"
"""File name inside the plugin directory (NVIDIA's ``DriverPluginCheckpointFileBasename``)."""
CHECKPOINT_MODE = 0o600
"""The mode NVIDIA's checkpoint manager gives the file."""


def read_checkpoint(path: Path | str, schema: ClaimSchema = GPU_CLAIM) -> Checkpoint | None:
    """The checkpoint at ``path``, both checksums verified; ``None`` when there is no file.

    :raises CheckpointError: the file is damaged, of an unknown version, or its checksums do not verify (the
        message names the file and what is wrong).
    :raises OSError: the file exists but cannot be read.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return decode(data, schema, source=str(path))


WRITTEN_MARK_SUFFIX = ".dradriver-written"
"""Beside ``checkpoint.json``: ``.<name>.dradriver-written``, the SHA-256 (hex) of the bytes dradriver last wrote there
(:func:`mark_written`). NVIDIA's plugin does not know the file: when ``checkpoint.json`` still hashes to it, no other
plugin has written the checkpoint since (:func:`written_by_dradriver`)."""


def _mark_path(path: Path | str) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{WRITTEN_MARK_SUFFIX}")


def mark_written(path: Path | str, data: bytes) -> None:
    """Record that dradriver wrote ``data`` to ``path`` (after :func:`write_checkpoint`): the mark file is replaced
    atomically but not synced; a mark lost to a power cut only makes the next start compare entries instead
    (:func:`written_by_dradriver` answers ``False``).

    :raises OSError: the mark cannot be written (the checkpoint itself is written already).
    """
    write_file_atomically(_mark_path(path), hashlib.sha256(data).hexdigest().encode() + b"\n", mode=CHECKPOINT_MODE,
                          durable=False, sync_dir=False)


def written_by_dradriver(path: Path | str, data: bytes) -> bool:
    """Whether ``data`` (the bytes read from ``path``) are what dradriver last wrote there (:func:`mark_written`):
    ``False`` when another plugin rewrote the file since, or when there is no readable mark."""
    try:
        mark = _mark_path(path).read_text().strip()
    except OSError:
        return False
    return mark == hashlib.sha256(data).hexdigest()


def read_checkpoint_and_mark(path: Path | str, schema: ClaimSchema = GPU_CLAIM) -> tuple[Checkpoint, bool] | None:
    """:func:`read_checkpoint`, and whether the file is what dradriver last wrote there
    (:func:`written_by_dradriver`); ``None`` when there is no file.

    :raises CheckpointError: as :func:`read_checkpoint`.
    :raises OSError: the file exists but cannot be read.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return decode(data, schema, source=str(path)), written_by_dradriver(path, data)


def write_checkpoint(path: Path | str, data: bytes) -> None:
    """Replace ``path`` with ``data`` (:func:`dradriver.domain.nvcheckpoint.assemble`'s bytes): temp file
    ``.<name>.tmp-<random>``, fsync, rename; readers see the old file or the new one, whole.

    :raises OSError: the directory is missing or not writable, or the disk is full (``path`` is unchanged).
    """
    write_file_atomically(path, data, mode=CHECKPOINT_MODE, durable=True, sync_dir=False)


def keep_aside(path: Path | str, tag: str) -> Path | None:
    """Rename ``path`` to ``<path>.<tag>-<UTC timestamp>`` (a damaged file kept for a person to read); the new
    path, or ``None`` when there was no file."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    target = Path(f"{path}.{tag}-{stamp}")
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    return target



