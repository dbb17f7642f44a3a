"""Switching the compute-domain plugin in without draining: adopt the claims NVIDIA's
``compute-domain-kubelet-plugin`` prepared, from its ``<plugins dir>/compute-domain.nvidia.com/checkpoint.json``
(format: :mod:`dradriver.domain.nvcheckpoint`, :data:`~dradriver.domain.nvcheckpoint.CD_CLAIM`; NVIDIA's
``cmd/compute-domain-kubelet-plugin/device_state.go`` in kubernetes-sigs/dra-driver-nvidia-gpu).

Which entries are NVIDIA's: dradriver's own rollback checkpoint names exactly the claims its claim state holds, so
an entry whose claim UID the claim state does not hold was written by NVIDIA's plugin. NVIDIA's boot-ID rule
applies (a checkpoint of another boot is ignored; an empty boot ID is this boot's). What each state becomes:

* ``PrepareCompleted``: a PREPARE_COMPLETED claim holding the entry's devices (``channel-<id>``, ``daemon-<id>``
  with the kubelet ``Device`` NVIDIA answered) with undo records of dradriver's own kinds (``imex-channel`` with
  ``label`` set: its unprepare removes the node label ``resource.nvidia.com/computeDomain`` when it still names
  the claim's ComputeDomain, as NVIDIA's would; ``imex-daemon``: nothing to undo, the domain directory stays until
  its ComputeDomain is gone, as NVIDIA's). The CDI spec NVIDIA wrote (same file name) is kept, and dradriver's
  unprepare deletes it;
* ``PrepareAborted``: dradriver's aborted-prepare mark with NVIDIA's ``abortedAt`` and the digest of the entry's
  allocation, so a prepare of the same allocation is refused as stale for the rest of the TTL (an expired one is
  not adopted: NVIDIA's cleanup would delete it);
* ``PrepareStarted``: a PREPARE_STARTED claim with the undo records of what NVIDIA may have applied (its node
  label, only where it names the claim's ComputeDomain), which recovery rolls back as NVIDIA's unprepare of a
  started claim would.

The ComputeDomain of an entry is its group's ``configState.ComputeDomain``, else the ``domainID`` of the claim's
opaque config in the entry's ``status``; the allocation mode (``Single``/``All``) is from that config. What the
checkpoint does not say is read from NVIDIA's CDI spec of the claim: the channel nodes it injects, and a daemon's
``CLIQUE_ID`` and ComputeDomain name, so that a spec dradriver renders again from the record (``/var/run/cdi``
cleaned, the kubelet retrying) injects what NVIDIA's did.

Switching back and forth converges as on the GPU plugin, by the same rule
(:func:`dradriver.kubeletplugin.adoption.converge`): a claim NVIDIA's plugin unprepared while dradriver was away is
forgotten, not brought back from dradriver's older claim state; one it prepared again under the same UID is adopted
from its newer entry. The file is read by the GPU plugin's reader
(:func:`~dradriver.kubeletplugin.adoption.read_nvidia_claims`, with this plugin's schema), and half-prepared
entries follow the GPU plugin's rule too (the module docstring of :mod:`dradriver.kubeletplugin.adoption`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dradriver.domain.claims import ClaimError, ClaimRef, claim_from_object
from dradriver.domain.nvcheckpoint import CD_CLAIM, CheckpointEntry, CheckpointError, CheckpointState
from dradriver.domain.ports import UndoRecord
from dradriver.host.claimstate import ClaimState, HeldDevice
from dradriver.kubeletplugin.adoption import (
    AdoptionReport,
    OwnGroups,
    converge,
    read_nvidia_claims,
    store_adopted,
)
from dradriver.kubeletplugin.payload import aborted_payload, encode_payload
from dradriver.kubeletplugin.rollback import parse_rfc3339
from dradriver.kubeletplugin.runner import allocation_digest
from dradriver.preparers.computedomain import CHANNEL_KIND, CHANNEL_PREFIX, DAEMON_KIND

__all__ = ["adopt_compute_domain_claims"]

log = logging.getLogger(__name__)


def _opaque(entry: CheckpointEntry, driver: str) -> Mapping[str, Any]:
    """The parameters of the entry's opaque config for ``driver`` (``{}`` when none)."""
    allocation = entry.status.get("allocation") or {}
    for config in (allocation.get("devices") or {}).get("config") or ():
        opaque = config.get("opaque") or {}
        if opaque.get("driver") == driver and isinstance(opaque.get("parameters"), Mapping):
            return opaque["parameters"]
    return {}


NVIDIA_CLIQUE = "nvidia-spec"
"""The ``clique`` of an adopted channel record whose NVIDIA spec injects channel nodes (NVIDIA injects them only on
a node in a clique; the value is read for its truth only, and the clique ID is not in a channel spec)."""


@dataclass(frozen=True, slots=True)
class _SpecFacts:
    """What NVIDIA's CDI spec of a claim says that its checkpoint entry does not: the daemon's environment
    (``CLIQUE_ID``, ``COMPUTE_DOMAIN_NAME``) and the IMEX channel numbers injected."""

    env: Mapping[str, str]
    channels: tuple[int, ...]


def _read_spec(path: Path) -> _SpecFacts:
    """NVIDIA's spec (YAML) at ``path``; empty facts when it is absent or unreadable (then dradriver's render
    from the record decides)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return _SpecFacts({}, ())
    env: dict[str, str] = {}
    channels: list[int] = []
    for device in (doc or {}).get("devices") or () if isinstance(doc, Mapping) else ():
        edits = (device or {}).get("containerEdits") or {}
        for item in edits.get("env") or ():
            key, _, value = str(item).partition("=")
            env[key] = value
        for node in edits.get("deviceNodes") or ():
            match = _CHANNEL_NODE.fullmatch(str((node or {}).get("path") or ""))
            if match:
                channels.append(int(match.group(1)))
    return _SpecFacts(env, tuple(sorted(set(channels))))


_CHANNEL_NODE = re.compile(r"/dev/nvidia-caps-imex-channels/channel(\d+)")


def _undo(kind: str, device: str, info_id: int, domain: str, namespace: str, mode: str,
          plugin_dir: Path, spec: _SpecFacts) -> UndoRecord:
    """dradriver's undo record for one of NVIDIA's prepared devices (the data its own preparer writes, completed
    from NVIDIA's spec, so that a spec dradriver renders again from the record injects what NVIDIA's did)."""
    if kind == "daemon":
        return UndoRecord(DAEMON_KIND, 1, device, {
            "domain": domain, "namespace": spec.env.get("COMPUTE_DOMAIN_NAMESPACE", namespace),
            "name": spec.env.get("COMPUTE_DOMAIN_NAME", ""), "clique": spec.env.get("CLIQUE_ID", ""),
            "dir": str(plugin_dir / "domains" / domain)})
    return UndoRecord(CHANNEL_KIND, 1, device, {"domain": domain, "namespace": namespace, "name": "",
                                                "mode": mode or "Single", "channels": list(spec.channels or [info_id]),
                                                "clique": NVIDIA_CLIQUE if spec.channels else "",
                                                "label": bool(domain)})


def _records(entry: CheckpointEntry, *, pool: str, driver: str, plugin_dir: Path,
             spec: _SpecFacts) -> tuple[list[HeldDevice], list[UndoRecord]]:
    params = _opaque(entry, driver)
    fallback = str(params.get("domainID") or "")
    mode = str(params.get("allocationMode") or "")
    held: list[HeldDevice] = []
    undo: list[UndoRecord] = []
    for group in entry.groups:
        domain = group.config_state.compute_domain or fallback
        for prepared in group.devices:
            if prepared.device is None:
                continue
            name = prepared.device.device_name
            held.append(HeldDevice(request_names=tuple(prepared.device.requests), pool=pool, device=name,
                                   cdi_device_ids=tuple(prepared.device.cdi_device_ids)))
            undo.append(_undo(prepared.kind, name, prepared.id, domain, entry.namespace, mode, plugin_dir, spec))
    if not held:  # PrepareStarted before its devices were recorded: its allocation says what it was preparing
        results = ((entry.status.get("allocation") or {}).get("devices") or {}).get("results") or ()
        for result in results:
            if result.get("driver") != driver or result.get("pool") != pool:
                continue
            name = str(result.get("device") or "")
            kind = "channel" if name.startswith(CHANNEL_PREFIX) else "daemon"
            held.append(HeldDevice(request_names=(str(result.get("request") or ""),), pool=pool, device=name))
            undo.append(_undo(kind, name, 0, fallback, entry.namespace, mode, plugin_dir, spec))
    return held, undo


def adopt_compute_domain_claims(state: ClaimState, path: Path, *, boot_id: str, pool: str, driver: str,
                                spec_of: Callable[[str], Path], aborted_ttl_s: float,
                                clock: Callable[[], float] = time.time,
                                own_groups: OwnGroups | None = None) -> AdoptionReport:
    """At start, before recovery: write NVIDIA's compute-domain claims into ``state`` (see the module docstring).
    What dradriver's state held that NVIDIA unprepared or prepared again converges on NVIDIA's, by the GPU
    plugin's rule (:func:`dradriver.kubeletplugin.adoption.converge`; ``own_groups``: the rollback checkpoint's).
    A claim that cannot be stored (a device another claim holds) is not adopted and is named in ``refused``.
    Nothing on the node or in the API is changed here.

    :param path: NVIDIA's ``checkpoint.json`` (``<plugin dir>/checkpoint.json``).
    :param pool: this node's pool (its node name); ``driver``: ``compute-domain.nvidia.com``.
    :param spec_of: claim UID -> its CDI spec path (the runner's).
    :param aborted_ttl_s: the aborted-prepare TTL (90 s); an older ``PrepareAborted`` entry is not adopted.
    :raises OSError: the checkpoint exists but cannot be read.
    """
    adopted: list[str] = []
    aborted: list[str] = []
    started: list[str] = []
    refused: list[tuple[str, str]] = []
    with state.locked(), state.group_commit():
        try:
            foreign = read_nvidia_claims(path, boot_id=boot_id, held=set(state.claims()), schema=CD_CLAIM)
        except CheckpointError as exc:
            log.error("NVIDIA's checkpoint %s is not used (%s): its claims are kept from their CDI specs", path, exc)
            return AdoptionReport(problem=str(exc))
        converged = converge(state, foreign, spec_of=spec_of, own_groups=own_groups)
        for uid, entry in sorted(converged.entries.items()):
            spec = str(spec_of(uid))
            if entry.state is CheckpointState.PREPARE_ABORTED:
                at = parse_rfc3339(entry.aborted_at)
                if at is None or abs(clock() - at) >= aborted_ttl_s:
                    continue
                ref = ClaimRef(entry.namespace, entry.name, uid)
                try:
                    digest = allocation_digest(claim_from_object(
                        {"metadata": {"uid": uid, "namespace": entry.namespace, "name": entry.name},
                         "status": entry.status}, ref, driver=driver, pool=pool))
                except ClaimError:
                    digest = ""  # no allocation recorded: every prepare of the claim is refused for the TTL
                state.prepare_started(uid, namespace=entry.namespace, name=entry.name, devices=[],
                                      payload=aborted_payload(spec, at, digest))
                aborted.append(uid)
                continue
            held, undo = _records(entry, pool=pool, driver=driver, plugin_dir=path.parent,
                                  spec=_read_spec(Path(spec)))
            why = store_adopted(state, uid, entry, held, encode_payload(spec, undo, {}))
            if why:
                refused.append((uid, why))
            elif entry.state is CheckpointState.PREPARE_COMPLETED:
                adopted.append(uid)
            else:
                started.append(uid)
    log.info("NVIDIA's checkpoint %s: %d claim(s) adopted, %d aborted prepare(s) kept, %d half-prepared to roll "
             "back, %d dropped (unprepared by NVIDIA), %d replaced (prepared again by NVIDIA), %d not adopted", path,
             len(adopted), len(aborted), len(started), len(converged.dropped), len(converged.replaced), len(refused))
    return AdoptionReport(tuple(adopted), tuple(started), converged.dropped, converged.replaced, tuple(refused),
                          tuple(aborted), unflushed=converged.unflushed)
