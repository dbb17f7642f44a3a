"""Would a rollback strand anything? What NVIDIA's kubelet plugin, started in dradriver's place on this node, would
make of each claim dradriver holds (``dradriver rollback-check``). Read-only: nothing on the node is written.

NVIDIA's plugin knows a claim only from ``<plugin dir>/checkpoint.json`` (its own format, kept by
:mod:`dradriver.kubeletplugin.rollback`; NVIDIA's ``cmd/gpu-kubelet-plugin/checkpoint.go`` and
``cmd/compute-domain-kubelet-plugin/checkpoint.go`` in kubernetes-sigs/dra-driver-nvidia-gpu) and, at its
unprepare, undoes only what that file's ``configState`` says (``device_state.go``: ``timeSliceApplied``,
``mpsControlDaemonID``, a ``mig.concrete`` device it created, the ComputeDomain node label) and deletes the spec
``<vendor>-<class>_<uid>.yaml``. A claim is **held** when NVIDIA's plugin would refuse its devices to other claims
and, at the claim's unprepare, undo all that dradriver set up for it; otherwise it is **stranded**, with one
:class:`Finding` per reason:

* ``half-prepared``: PREPARE_STARTED (a prepare in flight or cut short by a crash). The checkpoint names only
  completed claims, so NVIDIA's plugin neither refuses its devices nor rolls back what was applied; dradriver rolls
  it back at its next start.
* ``not-in-checkpoint``: a completed claim the checkpoint does not name as ``PrepareCompleted`` with the same
  devices: no file (``--nvidia-checkpoint=false``), a file that does not verify, one of another boot (NVIDIA drops
  it), or a missing or different entry. NVIDIA's plugin would hand its devices to another claim.
* ``consumable-share-mps``: a consumable share served by dradriver's per-device MPS control daemon (its limits
  enforced from ``consumedCapacity``; gate ``ConsumableShares``). One daemon serves several claims' shares, which
  NVIDIA's ``configState`` of one claim cannot say, so the checkpoint does not name it: NVIDIA's unprepare leaves
  the daemon (Deployment ``mps-control-daemon-share-<hash>``) running and the compute mode ``EXCLUSIVE_PROCESS``.
* ``channel-isolation``: an IMEX channel prepared under ``--imex-isolation channel`` (dradriver's; NVIDIA has no
  such flag). NVIDIA holds and unprepares the claim, but no longer keeps other ComputeDomains off the channel.
* ``device-metadata``: KEP-5304 files under ``<plugin dir>/dra-device-metadata/<uid>/`` (gate ``DeviceMetadata``,
  which dradriver implements for every device kind, NVIDIA for VFIO devices only); NVIDIA's unprepare removes the
  spec that mounts them but never the files.
* ``json-spec``: the claim's CDI spec is (also) a ``.json`` file (written by a release before ``.yaml`` names;
  dradriver's start writes the ``.yaml`` spec and removes it): NVIDIA deletes only ``.yaml``, so the file stays and
  a re-prepare by NVIDIA makes two files define one CDI device.
* ``unknown-undo``: an undo record of a kind this check does not know (a newer release prepared the claim).

A held claim may still carry :attr:`ClaimVerdict.needs`: NVIDIA's gates without which its unprepare would not undo
everything (``MPSSupport`` for an MPS control daemon, ``DynamicMIG`` for a MIG device created at prepare,
``HostManagedIMEXDaemon`` for a host-managed channel). Entries the checkpoint has for claims dradriver does not hold
(NVIDIA prepared them before the switch) are reported as held: they are NVIDIA's own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dradriver.domain.cdi import LEGACY_SPEC_SUFFIX
from dradriver.domain.featuregates import DYNAMIC_MIG as DYNAMIC_MIG_GATE
from dradriver.domain.featuregates import HOST_MANAGED_IMEX_DAEMON, MPS_SUPPORT
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, DriverIdentity
from dradriver.domain.nvcheckpoint import (
    CD_CLAIM,
    GPU_CLAIM,
    Checkpoint,
    CheckpointEntry,
    CheckpointError,
    CheckpointState,
)
from dradriver.domain.ports import UndoRecord
from dradriver.host import devicemetadata, nvcheckpointfile
from dradriver.host.claimstate import ClaimPhase, ClaimRecord, ClaimSnapshot, read_claims
from dradriver.kubeletplugin.payload import aborted_mark, read_payload
from dradriver.preparers.computedomain import CHANNEL_KIND, DAEMON_KIND
from dradriver.preparers.dynamicmig import KIND as DYNAMIC_MIG
from dradriver.preparers.mps import MpsSharing
from dradriver.preparers.shares import KIND as SHARE
from dradriver.preparers.sharing import ExclusiveUse, TimeSlicing

__all__ = ["ClaimVerdict", "DriverReport", "Feature", "Finding", "Verdict", "check_driver"]

# Undo kinds NVIDIA's checkpoint represents fully (nothing, a device, or a configState it undoes).
_REPRESENTED = frozenset({"gpu", "mig", ExclusiveUse.kind, TimeSlicing.kind, MpsSharing.kind, DYNAMIC_MIG, SHARE,
                          CHANNEL_KIND, DAEMON_KIND})


class Verdict(enum.Enum):
    """What NVIDIA's plugin would make of a claim."""

    HELD = "held"
    """Refused to other claims and undone fully at its unprepare."""
    STRANDED = "stranded"
    """Something would be left behind or unprotected (see the findings)."""


class Feature(enum.Enum):
    """Why a claim would be stranded (module docstring)."""

    HALF_PREPARED = "half-prepared"
    NOT_IN_CHECKPOINT = "not-in-checkpoint"
    CONSUMABLE_SHARE_MPS = "consumable-share-mps"
    CHANNEL_ISOLATION = "channel-isolation"
    DEVICE_METADATA = "device-metadata"
    JSON_SPEC = "json-spec"
    UNKNOWN_UNDO = "unknown-undo"


@dataclass(frozen=True, slots=True)
class Finding:
    """One reason a claim would be stranded: the feature and what would happen to it, in words."""

    feature: Feature
    reason: str


@dataclass(frozen=True, slots=True)
class ClaimVerdict:
    """The verdict on one claim.

    :param driver: ``gpu.nvidia.com`` or ``compute-domain.nvidia.com``.
    :param uid: the claim UID; ``namespace``/``name`` as stored (empty where NVIDIA's entry left them out).
    :param state: ``PREPARE_COMPLETED``, ``PREPARE_STARTED``, ``PREPARE_ABORTED`` (an aborted-prepare mark) or
        ``NVIDIA`` (an entry of NVIDIA's own that dradriver does not hold).
    :param needs: NVIDIA's feature gates its unprepare needs to undo everything.
    """

    driver: str
    uid: str
    namespace: str
    name: str
    state: str
    findings: tuple[Finding, ...] = ()
    needs: tuple[str, ...] = ()

    @property
    def verdict(self) -> Verdict:
        """:attr:`Verdict.STRANDED` when there is any finding."""
        return Verdict.STRANDED if self.findings else Verdict.HELD

    def to_json(self) -> dict[str, Any]:
        """``{driver, uid, namespace, name, state, verdict, findings: [{feature, reason}], needs}``."""
        return {"driver": self.driver, "uid": self.uid, "namespace": self.namespace, "name": self.name,
                "state": self.state, "verdict": self.verdict.value,
                "findings": [{"feature": f.feature.value, "reason": f.reason} for f in self.findings],
                "needs": list(self.needs)}


@dataclass(frozen=True, slots=True)
class DriverReport:
    """One plugin directory's claims and what was found about its files.

    :param problems: what makes the whole answer doubtful (a damaged claim state: records may be missing); each
        counts as a stranding.
    :param notes: facts that strand nothing (no claim state, a state of another boot).
    """

    driver: str
    plugin_dir: Path
    claims: tuple[ClaimVerdict, ...] = ()
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def stranded(self) -> bool:
        """True when a claim would be stranded or the claim state is damaged."""
        return bool(self.problems) or any(c.findings for c in self.claims)

    def to_json(self) -> dict[str, Any]:
        """``{driver, pluginDir, stranded, problems, notes, claims: [ClaimVerdict.to_json()]}``."""
        return {"driver": self.driver, "pluginDir": str(self.plugin_dir), "stranded": self.stranded,
                "problems": list(self.problems), "notes": list(self.notes),
                "claims": [c.to_json() for c in self.claims]}


def _device_names(entry: CheckpointEntry) -> set[str]:
    return {d.device.device_name for g in entry.groups for d in g.devices if d.device is not None}


@dataclass(frozen=True, slots=True)
class _Kept:
    """The checkpoint as NVIDIA's plugin would take it: its entries, or why it would take none."""

    claims: Mapping[str, CheckpointEntry]
    missing: str  # "" when the file is used


def _read_kept(path: Path, identity: DriverIdentity, boot_id: str) -> _Kept:
    schema = CD_CLAIM if identity.driver_name == COMPUTE_DOMAIN_DRIVER.driver_name else GPU_CLAIM
    try:
        stored: Checkpoint | None = nvcheckpointfile.read_checkpoint(path, schema)
    except CheckpointError as exc:
        return _Kept({}, f"{path} cannot be used, NVIDIA's plugin would refuse to start on it: {exc}")
    except OSError as exc:
        return _Kept({}, f"{path} cannot be read: {exc}")
    if stored is None:
        return _Kept({}, f"there is no {path} (the plugin runs with --nvidia-checkpoint=false, or has written none)")
    if stored.node_boot_id not in ("", boot_id):
        return _Kept({}, f"{path} is of boot {stored.node_boot_id}, not this boot {boot_id}: NVIDIA's plugin drops it")
    return _Kept(stored.claims, "")


def _checkpoint_finding(record: ClaimRecord, kept: _Kept, checkpoint: Path) -> Finding | None:
    if kept.missing:
        return Finding(Feature.NOT_IN_CHECKPOINT, f"{kept.missing}; NVIDIA's plugin would not know the claim and "
                                                  "would hand its devices to another claim")
    entry = kept.claims.get(record.uid)
    if entry is None:
        return Finding(Feature.NOT_IN_CHECKPOINT, f"{checkpoint} does not name the claim; NVIDIA's plugin would "
                                                  "hand its devices to another claim")
    if entry.state is not CheckpointState.PREPARE_COMPLETED:
        return Finding(Feature.NOT_IN_CHECKPOINT, f"{checkpoint} names the claim as {entry.state.value}, not "
                                                  "PrepareCompleted")
    held = {d.device for d in record.devices}
    named = _device_names(entry)
    if named != held:
        return Finding(Feature.NOT_IN_CHECKPOINT, f"{checkpoint} names devices {sorted(named)} for the claim, "
                                                  f"which holds {sorted(held)}")
    return None


def _undo_findings(undo: Sequence[UndoRecord]) -> tuple[list[Finding], list[str]]:
    findings: list[Finding] = []
    needs: list[str] = []
    for record in undo:
        data = record.data if isinstance(record.data, Mapping) else {}
        if record.kind not in _REPRESENTED:
            findings.append(Finding(Feature.UNKNOWN_UNDO, f"undo record of kind {record.kind!r} on "
                                                          f"{record.target!r}: unknown to this release, so whether "
                                                          "NVIDIA's checkpoint can say it is not known"))
        elif record.kind == SHARE and data.get("daemon"):
            findings.append(Finding(Feature.CONSUMABLE_SHARE_MPS, f"consumable share of {record.target} enforced by "
                                    f"dradriver's MPS control daemon {data['daemon']} (gate ConsumableShares): "
                                    "NVIDIA's checkpoint cannot name a daemon several claims share, so NVIDIA's "
                                    "unprepare leaves the daemon running and its limits unenforced for new claims"))
        elif record.kind == CHANNEL_KIND and "channel" in data:
            findings.append(Finding(Feature.CHANNEL_ISOLATION, f"IMEX channel {data['channel']} isolated for "
                                    f"ComputeDomain {data.get('domain', '?')} (--imex-isolation channel): NVIDIA's "
                                    "plugin holds and unprepares the claim but would let another ComputeDomain's "
                                    "claim take the channel"))
        elif record.kind == MpsSharing.kind and data.get("id"):
            needs.append(MPS_SUPPORT)
        elif record.kind == DYNAMIC_MIG:
            needs.append(DYNAMIC_MIG_GATE)
        if record.kind == CHANNEL_KIND and "label" in data and not data.get("label"):
            needs.append(HOST_MANAGED_IMEX_DAEMON)
    return findings, sorted(set(needs))


def _claim_verdict(identity: DriverIdentity, record: ClaimRecord, kept: _Kept, plugin_dir: Path) -> ClaimVerdict:
    driver = identity.driver_name
    mark = aborted_mark(record)
    if mark is not None:  # an aborted prepare: nothing held, nothing applied
        return ClaimVerdict(driver, record.uid, record.namespace, record.name, "PREPARE_ABORTED")
    findings: list[Finding] = []
    try:
        stored = read_payload(record.payload)
    except ValueError as exc:
        stored = None
        findings.append(Finding(Feature.UNKNOWN_UNDO, f"its stored payload cannot be read ({exc}): what was set up "
                                                      "for it is not known"))
    undo = stored.undo if stored is not None else ()
    if record.phase is ClaimPhase.PREPARE_STARTED:
        applied = ", ".join(sorted({r.kind for r in undo})) or "nothing recorded yet"
        findings.append(Finding(Feature.HALF_PREPARED, "PREPARE_STARTED (a prepare in flight or cut short): the "
                                "checkpoint names completed claims only, so NVIDIA's plugin would neither refuse its "
                                f"devices nor roll back what was applied ({applied}); dradriver rolls it back at its "
                                "next start"))
    else:
        found = _checkpoint_finding(record, kept, plugin_dir / nvcheckpointfile.CHECKPOINT_FILE)
        if found is not None:
            findings.append(found)
    more, needs = _undo_findings(undo)
    findings += more
    metadata = plugin_dir / devicemetadata.SUBDIR / record.uid
    if metadata.is_dir():
        findings.append(Finding(Feature.DEVICE_METADATA, f"device metadata files (KEP-5304) in {metadata}: NVIDIA's "
                                "unprepare removes the spec that mounts them but never the files"))
    legacy = Path(stored.spec).with_suffix(LEGACY_SPEC_SUFFIX) if stored is not None and stored.spec else None
    if legacy is not None and legacy.is_file():
        findings.append(Finding(Feature.JSON_SPEC, f"its CDI spec {legacy} is a .json file: NVIDIA's unprepare "
                                "deletes only <vendor>-<class>_<uid>.yaml, so the spec would stay behind"))
    return ClaimVerdict(driver, record.uid, record.namespace, record.name, record.phase.name, tuple(findings),
                        tuple(needs))


def check_driver(identity: DriverIdentity, plugins_dir: Path, boot_id: str) -> DriverReport:
    """The verdicts on every claim of the plugin ``identity`` names under ``plugins_dir`` (the kubelet's plugins
    directory; the plugin's files are in ``<plugins_dir>/<driver>``), on a node whose boot ID is ``boot_id``.

    Reads the claim state (:func:`dradriver.host.claimstate.read_claims`), the payloads
    (:func:`dradriver.kubeletplugin.payload.read_payload`), the kept checkpoint
    (:func:`dradriver.host.nvcheckpointfile.read_checkpoint`) and the device-metadata directories; writes nothing.

    :raises dradriver.host.claimstate.ClaimStateVersionError: the claim state is of a newer format.
    :raises OSError: the claim state exists but cannot be read.
    """
    plugin_dir = plugins_dir / identity.driver_name
    snapshot: ClaimSnapshot = read_claims(plugin_dir / identity.state_file)
    notes: list[str] = []
    problems = [str(p) for p in snapshot.problems if p.damage]
    claims: dict[str, ClaimRecord] = snapshot.claims
    if not snapshot.exists:
        notes.append(f"no claim state at {snapshot.path}: dradriver holds no claims of {identity.driver_name} here")
    elif snapshot.boot_id not in (None, boot_id) and claims:
        notes.append(f"the claim state is of boot {snapshot.boot_id}, not this boot {boot_id}: its "
                     f"{len(claims)} claim(s) died with that boot and are discarded at the next start")
        claims = {}
    kept = _read_kept(plugin_dir / nvcheckpointfile.CHECKPOINT_FILE, identity, boot_id)
    verdicts = [_claim_verdict(identity, record, kept, plugin_dir) for record in claims.values()]
    verdicts += [ClaimVerdict(identity.driver_name, uid, entry.namespace, entry.name, "NVIDIA")
                 for uid, entry in sorted(kept.claims.items()) if uid not in claims]
    return DriverReport(identity.driver_name, plugin_dir, tuple(verdicts), tuple(problems), tuple(notes))
