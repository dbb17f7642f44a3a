"""NodePrepareResources / NodeUnprepareResources for ``gpu.nvidia.com``: the kubelet plugin's use cases.

For each claim of a prepare batch (reference ``kubelet-dra-protocol.md`` 4.3, ``nvidia-dra-driver.md`` 4.2):

1. GET the ResourceClaim (outside the lock; the claims of one batch are fetched concurrently), check its UID
   and allocation, keep the results for our driver and this node's pool;
2. under the node-wide lock: a claim already PREPARE_COMPLETED returns its stored answer (its CDI spec is
   rewritten if it vanished); otherwise each result's device must exist on this node and must not be held
   by another claim (admin-access results excepted); the claim is recorded PREPARE_STARTED, its CDI spec is
   written atomically, and it is recorded PREPARE_COMPLETED;
3. any failure rolls back what this claim did and becomes that claim's error string; other claims of the
   batch are unaffected.

Unprepare works from the stored claim state alone (the ResourceClaim may be gone): delete the CDI spec, then
forget the claim. Unknown claims succeed. A prepare that was in flight when the same claim UID was
unprepared is refused, so a slow prepare never brings an unprepared claim back.

At start, :meth:`Driver.recover` rolls back claims a crash left PREPARE_STARTED and removes CDI specs of
ours that no stored claim owns, so the node converges after a SIGKILL at any point.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dradriver.domain import cdi, configs
from dradriver.domain.claims import Claim, ClaimError, ClaimRef, ClaimResult, base_request_name
from dradriver.domain.claimstate import ClaimConflictError, ClaimPhase, ClaimRecord, ClaimState, HeldDevice
from dradriver.domain.devices import DeviceIndex, GpuDevice, MigDevice, NodeInventory
from dradriver.driver.metrics import DriverMetrics
from dradriver.errors import DradriverError

log = logging.getLogger(__name__)

FetchClaim = Callable[[ClaimRef], Claim]
"""Blocking: GET the claim and reduce it (``dradriver.kube.claims.fetch_claim`` bound to a client)."""

_SPEC_FILE = re.compile(re.escape(cdi.VENDOR) + r"-" + re.escape(cdi.CLASS) + r"_(?P<uid>[0-9A-Za-z._-]+)\.json$")


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`Driver.recover` did at start."""

    rolled_back: tuple[str, ...]
    orphan_specs_removed: tuple[str, ...]
    claims_kept: int
    missing_devices: tuple[str, ...]
    adopted: tuple[str, ...] = ()


class Driver:
    """Implements :class:`dradriver.domain.ports.ClaimPreparer` for the gRPC layer.

    :param inventory: this node's devices (``dradriver.nvml.discovery.discover``).
    :param state: the durable claim state (holds the node-wide lock for every mutation).
    :param fetch_claim: blocking claim GET + reduction; raises :class:`ClaimError` for a claim-level problem.
    :param cdi_root: directory for the per-claim CDI specs.
    :param node_info: where device-node numbers come from.
    :param pool: this node's pool name (the node name).
    :param common: spec-level edits added to every claim spec (driver libraries, binaries, hooks), found once
        at start (``dradriver.domain.driverfiles``, ``cdi.driver_edits``).
    """

    def __init__(
        self,
        *,
        inventory: NodeInventory,
        state: ClaimState,
        fetch_claim: FetchClaim,
        cdi_root: Path,
        node_info: cdi.DeviceNodeInfo,
        pool: str,
        metrics: DriverMetrics | None = None,
        common: cdi.ContainerEdits | None = None,
    ) -> None:
        self.inventory = inventory
        self.index = DeviceIndex.build(inventory)
        self.state = state
        self.fetch_claim = fetch_claim
        self.cdi_root = cdi_root
        self.node_info = node_info
        self.common = common
        self.pool = pool
        self.metrics = metrics
        self._lock = threading.Lock()  # in-process serialisation; ClaimState adds the node-wide flock
        self._seq = itertools.count(1)
        self._unprepared_at: dict[str, int] = {}
        self.preparations = 0  # claims actually prepared (not answered from state); for tests and metrics
        self._counts: tuple[int, dict[str, int]] = (0, {})
        self._prepared: dict[str, tuple[str, str]] = {}

    # ---------------------------------------------------------------------------------- prepare
    async def prepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimResult]:
        """Prepare a batch; every UID gets a result (see the module docstring)."""
        started = next(self._seq)
        began = time.monotonic()
        with self.metrics.in_flight("prepare") if self.metrics else contextlib.nullcontext():
            fetched = await asyncio.gather(*(asyncio.to_thread(self._fetch, ref) for ref in claims))
            results = await asyncio.to_thread(self._prepare_all, list(zip(claims, fetched, strict=True)), started)
        if self.metrics is not None:
            seconds = time.monotonic() - began
            for res in results.values():
                outcome = "success" if res.ok else "error"
                self.metrics.observe_prepare(outcome, seconds, error_type=None if res.ok else "prepare_devices")
        self._changed()
        return results

    def _changed(self) -> None:
        """After a batch, on the event loop: publish the views :meth:`_refresh_views` computed (no locking)."""
        if self.metrics is not None:
            claims, by_type = self._counts
            self.metrics.set_prepared(claims, by_type)

    def _refresh_views(self) -> None:
        """In the worker thread, with the state at hand: device -> claim map and counts for metrics."""
        claims = self.state.claims()
        by_type: dict[str, int] = {}
        devices: dict[str, tuple[str, str]] = {}
        for record in claims.values():
            for dev in record.devices:
                found = self.index.by_name.get(dev.device)
                kind = "unknown" if found is None else ("mig" if isinstance(found, MigDevice) else "gpu")
                by_type[kind] = by_type.get(kind, 0) + 1
                if record.phase is ClaimPhase.PREPARE_COMPLETED:
                    devices.setdefault(dev.device, (record.namespace, record.name))
        self._counts = (len(claims), by_type)
        self._prepared = devices  # replaced whole: readers on other threads see the old or the new map

    def _fetch(self, ref: ClaimRef) -> Claim | str:
        try:
            return self.fetch_claim(ref)
        except ClaimError as exc:
            return str(exc)
        except DradriverError as exc:
            return f"claim {ref}: cannot read the ResourceClaim: {exc}"

    def _prepare_all(self, items: list[tuple[ClaimRef, Claim | str]], started: int) -> dict[str, ClaimResult]:
        """Prepare a batch in three phases, so its durability costs O(1) syncs of the claim state.

        1. under one group commit: check every claim and record the valid ones PREPARE_STARTED (one sync);
        2. write each started claim's CDI spec (file fsync'd; one directory fsync for the batch);
        3. under one group commit: record them PREPARE_COMPLETED (one sync); failed ones are rolled back.

        A claim's answer is given only after phase 3 is durable. A crash at any point leaves STARTED claims,
        which the next start rolls back (:meth:`recover`), or COMPLETED ones whose specs are on disk. Any
        error, expected or not, stays with its claim: every UID of the batch gets an answer.
        """
        out: dict[str, ClaimResult] = {}
        todo: list[tuple[Claim, list[HeldDevice], list[GpuDevice | MigDevice]]] = []
        written: list[tuple[Claim, list[HeldDevice]]] = []
        with self._lock:
            try:
                with self.state.locked():
                    with self.state.group_commit():
                        for ref, fetched in items:
                            if isinstance(fetched, str):
                                out[ref.uid] = ClaimResult(error=fetched)
                                continue
                            try:
                                answer = self._start_one(fetched, started)
                            except Exception as exc:  # one claim's problem is that claim's answer
                                out[ref.uid] = ClaimResult(error=_claim_error(ref, exc))
                                continue
                            if isinstance(answer, ClaimResult):
                                out[ref.uid] = answer
                            else:
                                todo.append((fetched, *answer))
                    failed: list[tuple[Claim, str]] = []
                    for claim, held, devices in todo:
                        try:
                            cdi.write_claim_spec(self.cdi_root, claim.ref.uid, devices, node_info=self.node_info,
                                                 common=self.common, sync_dir=False, clean_temp=False)
                            written.append((claim, held))
                        except Exception as exc:
                            failed.append((claim, _claim_error(claim.ref, exc)))
                    if written:
                        cdi.sync_directory(self.cdi_root)
                    with self.state.group_commit():
                        for claim, _ in written:
                            self.state.prepare_completed(claim.ref.uid)
                        for claim, error in failed:
                            out[claim.ref.uid] = ClaimResult(error=error)
                            try:
                                self._roll_back(claim.ref.uid)
                            except Exception:  # left STARTED: rolled back by the kubelet's retry or at start
                                log.exception("rolling back claim %s failed", claim.ref)
            except (OSError, DradriverError) as exc:
                # The claim state or the CDI directory could not be made durable: no claim of the batch that
                # was still in progress is acknowledged. STARTED records are rolled back at the next start, or
                # redone when the kubelet retries.
                for claim, _, _ in todo:
                    out.setdefault(claim.ref.uid, ClaimResult(error=f"claim {claim.ref}: cannot record claim "
                                                                    f"state: {exc}"))
                written = []
            finally:
                self._refresh_views()
        for claim, held in written:
            self.preparations += 1
            log.info("prepared claim %s: %s", claim.ref, ", ".join(h.device for h in held))
            out[claim.ref.uid] = ClaimResult(devices=tuple(h.to_prepared() for h in held))
        return out

    def _start_one(
        self, claim: Claim, started: int
    ) -> ClaimResult | tuple[list[HeldDevice], list[GpuDevice | MigDevice]]:
        """Phase 1 for one claim: the stored answer of a completed claim, or its devices, recorded STARTED."""
        ref = claim.ref
        if self._unprepared_at.get(ref.uid, 0) > started:
            raise ClaimError(ref, "the claim was unprepared while this prepare was in flight; not preparing it")
        record = self.state.get(ref.uid)
        adopted = record is not None and not record.namespace and not record.name
        if record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED and not adopted:
            self._ensure_spec(record)
            return ClaimResult(devices=tuple(d.to_prepared() for d in record.devices))
        # New, half-prepared, or adopted from a CDI spec after state damage (request names unknown): prepare
        # from the claim itself; the devices it already holds count as its own in the conflict check.
        held, devices = self._resolve(claim)
        self.state.prepare_started(
            ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            devices=held,
            payload=str(cdi.claim_spec_path(self.cdi_root, ref.uid)),
        )
        return held, devices

    def _resolve(self, claim: Claim) -> tuple[list[HeldDevice], list[GpuDevice | MigDevice]]:
        """Allocation results -> held devices (results naming one device merged) and the device objects."""
        order: list[str] = []
        requests: dict[str, list[str]] = {}
        admin: dict[str, bool] = {}
        for i, result in enumerate(claim.results):
            if result.device not in self.index.by_name:
                raise ClaimError(
                    claim.ref,
                    f"status.allocation.devices.results[{i}] (request {result.request!r}): device "
                    f"{result.device!r} does not exist in pool {self.pool!r} on this node",
                )
            if result.device not in requests:
                order.append(result.device)
                requests[result.device] = []
                admin[result.device] = result.admin_access
            name = base_request_name(result.request)
            if name not in requests[result.device]:
                requests[result.device].append(name)
            admin[result.device] = admin[result.device] and result.admin_access
        for name in order:
            holder = self.state.holder(self.pool, name)
            if holder is not None and holder != claim.ref.uid and not admin[name]:
                other = self.state.get(holder)
                who = f"{other.namespace}/{other.name} (uid {holder})" if other else f"uid {holder}"
                raise ClaimError(claim.ref, f"device {name!r} is already prepared for claim {who}")
        # Opaque GpuConfig/MigDeviceConfig: decoded, selected and validated per result before anything is
        # written. Sharing gates are off (no time-slicing/MPS implementation), so every selected config means
        # exclusive use and adds no CDI edits today.
        configs.select_configs(claim, self.index.by_name)
        held = [
            HeldDevice(
                request_names=tuple(requests[name]),
                pool=self.pool,
                device=name,
                cdi_device_ids=(cdi.cdi_device_id(claim.ref.uid, name),),
                admin_access=admin[name],
            )
            for name in order
        ]
        return held, [self.index.by_name[name] for name in order]

    def _ensure_spec(self, record: ClaimRecord) -> None:
        """Rewrite a completed claim's CDI spec when it has vanished (e.g. /var/run/cdi was cleaned)."""
        if cdi.claim_spec_path(self.cdi_root, record.uid).exists():
            return
        devices = [self.index.by_name[d.device] for d in record.devices if d.device in self.index.by_name]
        if len(devices) != len(record.devices):
            missing = sorted(d.device for d in record.devices if d.device not in self.index.by_name)
            raise ClaimError(record.ref, f"CDI spec vanished and devices {missing} are no longer on this node")
        cdi.write_claim_spec(self.cdi_root, record.uid, devices, node_info=self.node_info, common=self.common)
        log.warning("rewrote the vanished CDI spec of claim %s", record.ref)

    def _roll_back(self, uid: str) -> None:
        try:
            cdi.delete_claim_spec(self.cdi_root, uid)
        finally:
            self.state.remove(uid)

    # -------------------------------------------------------------------------------- unprepare
    async def unprepare_claims(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare a batch from stored state alone; returns UID -> error ("" on success)."""
        began = time.monotonic()
        with self.metrics.in_flight("unprepare") if self.metrics else contextlib.nullcontext():
            results = await asyncio.to_thread(self._unprepare_all, list(claims))
        if self.metrics is not None:
            seconds = time.monotonic() - began
            for error in results.values():
                outcome = "error" if error else "success"
                self.metrics.observe_unprepare(outcome, seconds, error_type="unprepare_devices" if error else None)
        self._changed()
        return results

    def _unprepare_all(self, claims: list[ClaimRef]) -> dict[str, str]:
        """Delete each claim's CDI spec, then forget the batch's claims under one group commit.

        Specs go first, so a crash never leaves a spec without a claim; a claim whose spec is gone but whose
        removal was not yet durable is simply unprepared again when the kubelet retries.
        """
        out: dict[str, str] = {}
        with self._lock:
            stored: list[ClaimRef] = []
            try:
                with self.state.locked():
                    for ref in claims:
                        self._unprepared_at.pop(ref.uid, None)
                        self._unprepared_at[ref.uid] = next(self._seq)  # newest last: eviction keeps recent ones
                        try:
                            # Unknown claims succeed; a spec of that UID (adopted or leaked) goes too.
                            cdi.delete_claim_spec(self.cdi_root, ref.uid, clean_temp=False)
                        except Exception as exc:
                            if not isinstance(exc, DradriverError):
                                log.error("unprepare of claim %s failed unexpectedly", ref, exc_info=exc)
                            out[ref.uid] = f"claim {ref}: unprepare failed: {exc}"
                            continue
                        if self.state.get(ref.uid) is None:
                            out[ref.uid] = ""
                        else:
                            stored.append(ref)
                    with self.state.group_commit():
                        for ref in stored:
                            self.state.remove(ref.uid)
            except (OSError, DradriverError) as exc:
                for ref in stored:
                    out[ref.uid] = f"claim {ref}: unprepare failed: {exc}"
                stored = []
            finally:
                self._refresh_views()
            for ref in stored:
                log.info("unprepared claim %s", ref)
                out[ref.uid] = ""
            if len(self._unprepared_at) > 4096:  # keep only recent tombstones
                for uid in list(itertools.islice(self._unprepared_at, len(self._unprepared_at) - 2048)):
                    del self._unprepared_at[uid]
        return out

    # ---------------------------------------------------------------------------------- startup
    def recover(self, *, state_damaged: bool = False) -> RecoveryReport:
        """Converge after a crash: roll back PREPARE_STARTED claims, then deal with CDI specs no claim owns.

        :param state_damaged: the claim state lost records to damage. Then an orphan spec may belong to a
            claim that still holds its devices: it is adopted (recorded as prepared under its claim UID, with
            the devices its spec names) instead of deleted, so the devices stay protected and the kubelet's
            unprepare of that UID cleans up. Otherwise orphan specs are leftovers and are deleted.
        """
        rolled_back: list[str] = []
        removed: list[str] = []
        adopted: list[str] = []
        with self._lock, self.state.locked():
            for uid, record in list(self.state.claims().items()):
                if record.phase is ClaimPhase.PREPARE_STARTED:
                    self._roll_back(uid)
                    rolled_back.append(uid)
                    log.warning("rolled back claim %s left half-prepared by an earlier run", record.ref)
            known = set(self.state.claims())
            temps = cdi.remove_stale_temp_files(self.cdi_root)  # once here, so each prepare stays O(1)
            if temps:
                log.warning("removed %d temporary CDI file(s) a crashed write left behind", temps)
            try:
                names = os.listdir(self.cdi_root)
            except FileNotFoundError:
                names = []
            for name in names:
                match = _SPEC_FILE.match(name)
                if not match or match["uid"] in known:
                    continue
                if state_damaged:
                    # The spec may belong to a running container whose claim record was lost: never delete it.
                    if self._adopt(match["uid"], self.cdi_root / name):
                        adopted.append(match["uid"])
                    else:
                        log.error("kept orphan CDI spec %s: the claim state was damaged and the spec could not "
                                  "be adopted; the kubelet's unprepare of its claim removes it", name)
                    continue
                cdi.delete_claim_spec(self.cdi_root, match["uid"])
                removed.append(match["uid"])
                log.warning("removed orphan CDI spec %s (no prepared claim owns it)", name)
            held = {d.device for r in self.state.claims().values() for d in r.devices}
            missing = sorted(held - set(self.index.by_name))
            self._refresh_views()
        if missing:
            log.error("prepared claims hold devices this node no longer has: %s", ", ".join(missing))
        return RecoveryReport(tuple(rolled_back), tuple(removed), len(self.state), tuple(missing), tuple(adopted))

    def _adopt(self, uid: str, path: Path) -> bool:
        """Record the claim ``uid`` as prepared from its CDI spec alone; False when the spec is unreadable."""
        try:
            spec = json.loads(path.read_bytes())
            names = [str(d["name"]) for d in spec.get("devices", [])]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("cannot adopt orphan CDI spec %s: %s", path, exc)
            return False
        prefix = f"{uid}-"
        devices = [n[len(prefix):] for n in names if n.startswith(prefix)]
        held = [
            HeldDevice(request_names=(), pool=self.pool, device=d, cdi_device_ids=(cdi.cdi_device_id(uid, d),))
            for d in devices
        ]
        try:
            self.state.prepare_started(uid, namespace="", name="", devices=held, payload=str(path))
            self.state.prepare_completed(uid)
        except (ClaimConflictError, DradriverError) as exc:
            log.error("cannot adopt orphan CDI spec %s: %s", path, exc)
            return False
        log.error("claim state lost claim %s; adopted it from its CDI spec (devices %s) until it is unprepared",
                  uid, ", ".join(devices))
        return True

    def prepared_devices(self) -> dict[str, tuple[str, str]]:
        """DRA device name -> (claim namespace, claim name) for every completed claim (metrics labels).

        A snapshot taken after the last batch; safe to call from any thread, never waits on the claim state.
        """
        return self._prepared


def _claim_error(ref: ClaimRef, exc: BaseException) -> str:
    """The per-claim error string for ``exc``: its own message for our errors, a logged traceback otherwise."""
    if isinstance(exc, ClaimError | ClaimConflictError | cdi.CdiSpecError):
        return str(exc)
    if isinstance(exc, DradriverError):
        log.error("prepare of claim %s failed: %s", ref, exc)
        return f"claim {ref}: {exc}"
    log.error("prepare of claim %s failed unexpectedly", ref, exc_info=exc)
    return f"claim {ref}: internal error ({type(exc).__name__}: {exc}); see the plugin log"
