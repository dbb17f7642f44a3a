"""The claim payload: what the claim state stores for a prepared claim beside its devices.

JSON ``{"v": 1, "spec": <spec path>, "undo": [<UndoRecord.to_json()>...]}`` plus the optional keys ``pins``,
``shares``, ``aborted_at`` (Unix seconds) and ``allocation`` (:class:`StoredPayload`); a payload that is a bare spec
path (written before undo records existed) reads as a claim without records. Written by the batch runner
(:mod:`dradriver.kubeletplugin.runner`), read by it and by the rollback checkpoint
(:mod:`dradriver.kubeletplugin.rollback`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.domain.ports import UndoRecord
from dradriver.host.claimstate import ClaimPhase, ClaimRecord, HeldDevice

PAYLOAD_VERSION = 1


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """What the claim state stores for a claim beside its devices.

    :param spec: path of the claim's CDI spec.
    :param undo: the undo records of what was applied, in apply order.
    :param pins: DRA device name -> the physical device's UUID when it was prepared (GPU or MIG UUID), so a
        device name that later resolves to another GPU is never handed to the claim.
    :param shares: DRA device name -> ``shareID`` of the devices the claim holds a consumable share of.
    :param aborted_at: set on an aborted-prepare mark (NVIDIA's ``PrepareAborted`` with ``abortedAt``,
        NVIDIA's ``cmd/compute-domain-kubelet-plugin/checkpoint.go``, ``device_state.go``): wall-clock seconds (Unix
        time) of the unprepare that aborted the claim's prepare. Such a record is PREPARE_STARTED with no devices and no
        undo records.
    :param allocation: digest of the claim's allocation (:func:`~dradriver.kubeletplugin.runner.allocation_digest`)
        seen by its last prepare (``""``: unknown); a mark refuses only a prepare of the same allocation, as NVIDIA
        compares the claim status.
    """

    spec: str
    undo: tuple[UndoRecord, ...] = ()
    pins: Mapping[str, str] = field(default_factory=dict)
    shares: Mapping[str, str] = field(default_factory=dict)
    aborted_at: float | None = None
    allocation: str = ""


def encode_payload(spec: Path | str, records: Sequence[UndoRecord], pins: Mapping[str, str] | None = None,
                   shares: Mapping[str, str] | None = None, *, aborted_at: float | None = None,
                   allocation: str = "") -> str:
    """The JSON text the claim state stores for a claim beside its devices (read back by :func:`read_payload`)."""
    doc: dict[str, Any] = {"v": PAYLOAD_VERSION, "spec": str(spec), "undo": [r.to_json() for r in records]}
    if pins:
        doc["pins"] = dict(pins)
    if shares:
        doc["shares"] = dict(shares)
    if aborted_at is not None:
        doc["aborted_at"] = aborted_at
    if allocation:
        doc["allocation"] = allocation
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def shares_of(held: Sequence[HeldDevice]) -> dict[str, str]:
    """DRA device name -> ``shareID`` (``""``: none) of the held devices that are consumable shares."""
    return {h.device: h.share_id or "" for h in held if h.shared}


def held_devices(record: ClaimRecord) -> tuple[HeldDevice, ...]:
    """The devices of a stored claim with their consumable shares restored from its payload."""
    try:
        shares = read_payload(record.payload).shares
    except ValueError:
        return record.devices
    if not shares:
        return record.devices
    return tuple(
        dataclasses.replace(d, admin_access=False, shared=True, share_id=shares[d.device] or None)
        if d.device in shares else d
        for d in record.devices
    )


def read_payload(payload: bytes | str) -> StoredPayload:
    """Decode a stored claim payload; a bare spec path (an older state file) has no records and no pins.

    :raises ValueError: the payload is JSON but not a valid payload document.
    """
    text = payload.decode() if isinstance(payload, bytes) else payload
    if not text.startswith("{"):
        return StoredPayload(text)
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("undo", []), list) \
            or not isinstance(doc.get("pins", {}), dict) or not isinstance(doc.get("shares", {}), dict):
        raise ValueError(f"claim payload {text[:80]!r} is not a payload document")
    pins = {str(k): str(v) for k, v in doc.get("pins", {}).items()}
    shares = {str(k): str(v) for k, v in doc.get("shares", {}).items()}
    aborted = doc.get("aborted_at")
    if aborted is not None and (not isinstance(aborted, int | float) or isinstance(aborted, bool)):
        raise ValueError(f"claim payload {text[:80]!r}: aborted_at is not a number")
    return StoredPayload(str(doc.get("spec", "")), tuple(UndoRecord.from_json(r) for r in doc.get("undo", [])), pins,
                         shares, None if aborted is None else float(aborted), str(doc.get("allocation") or ""))


def aborted_payload(spec: Path | str, aborted_at: float, allocation: str) -> str:
    """The stored payload of an aborted-prepare mark written from outside an unprepare (adopted from NVIDIA's
    ``PrepareAborted``): ``aborted_at`` Unix seconds, ``allocation`` the claim's allocation digest (``""``: any
    allocation)."""
    return encode_payload(spec, [], aborted_at=aborted_at, allocation=allocation)


def aborted_mark(record: ClaimRecord) -> StoredPayload | None:
    """The payload of ``record`` when it is an aborted-prepare mark (see :class:`StoredPayload`), else ``None``
    (also for an unreadable payload)."""
    if record.phase is not ClaimPhase.PREPARE_STARTED or record.devices:
        return None
    try:
        stored = read_payload(record.payload)
    except ValueError:
        return None
    return stored if stored.aborted_at is not None else None
