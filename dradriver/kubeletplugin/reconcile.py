"""Stale-claim cleanup: prepared claims the kubelet will never unprepare are found and unprepared.

The kubelet sends NodeUnprepareResources when a pod's claims are no longer needed, but not when the pod was
force-deleted, the node was partitioned while the ResourceClaim was deleted, or the claim was re-created under a
new UID: then the claim state keeps the devices held forever (NVIDIA's driver has the same gap). The
:class:`StaleClaimReconciler` runs once at start and every ``period_s``: it looks up each completed claim's
ResourceClaim by namespace/name and UID, and once a claim has stood stale (gone, replaced, or no longer allocated
to this node) for ``grace_s`` seconds it unprepares it through the batch runner, as the kubelet would, logs it,
reports it (a Warning Event and a metric, through ``on_cleanup``). Each round also deletes the runner's expired
aborted-prepare marks. Nothing is decided in a round in which the API
server answers an error. Claims adopted from CDI specs after claim-state damage carry no name and are left to
the kubelet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dradriver.domain.claims import ClaimRef
from dradriver.errors import DradriverError
from dradriver.host.claimstate import ClaimPhase
from dradriver.kubeletplugin.runner import BatchRunner

log = logging.getLogger(__name__)

Standing = Callable[[ClaimRef], str]
"""Blocking: ``""`` when the claim stands, else why it is stale (``dradriver.kube.claims.claim_standing``).

:raises DradriverError: the API server could not be asked."""


@dataclass(frozen=True, slots=True)
class Cleanup:
    """One stale claim that was unprepared: which, why, and the unprepare's error (``""`` on success)."""

    ref: ClaimRef
    reason: str
    error: str


class StaleClaimReconciler:
    """Finds and unprepares stale claims (module docstring).

    :param standing: the API lookup of one claim.
    :param grace_s: how long a claim must look stale before it is unprepared (seconds).
    :param period_s: seconds between rounds.
    :param on_cleanup: called for each claim unprepared (Event, metric), in a worker thread; must not raise.
    :param clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, runner: BatchRunner, standing: Standing, *, grace_s: float = 300.0, period_s: float = 60.0,
                 on_cleanup: Callable[[Cleanup], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.standing = standing
        self.grace_s = grace_s
        self.period_s = period_s
        self.on_cleanup = on_cleanup
        self.clock = clock
        self._stale_since: dict[str, float] = {}
        self.rounds = 0
        self.skipped_rounds = 0
        """Rounds abandoned because the API server answered an error."""

    def _candidates(self) -> list[ClaimRef]:
        return [r.ref for r in self.runner.state.claims().values()
                if r.phase is ClaimPhase.PREPARE_COMPLETED and r.namespace and r.name]

    def find_stale(self) -> dict[str, tuple[ClaimRef, str]] | None:
        """Blocking: look every completed claim up; UID -> (claim, reason) for the stale ones, or ``None`` when
        the API server answered an error (nothing is decided then)."""
        stale: dict[str, tuple[ClaimRef, str]] = {}
        for ref in self._candidates():
            try:
                reason = self.standing(ref)
            except DradriverError as exc:
                log.warning("stale-claim check skipped this round: cannot read ResourceClaim %s: %s", ref, exc)
                return None
            if reason:
                stale[ref.uid] = (ref, reason)
        return stale

    async def run_once(self) -> list[Cleanup]:
        """One round: delete expired aborted-prepare marks (compute-domain plugin, NVIDIA's
        ``cmd/*-kubelet-plugin/cleanup.go``), then look up, age, unprepare what stood stale for ``grace_s``."""
        self.rounds += 1
        try:
            await asyncio.to_thread(self.runner.forget_expired_aborts)
        except (OSError, DradriverError) as exc:
            log.warning("deleting expired aborted-prepare marks failed (next round retries): %s", exc)
        stale = await asyncio.to_thread(self.find_stale)
        if stale is None:
            self.skipped_rounds += 1
            return []
        now = self.clock()
        for uid in list(self._stale_since):
            if uid not in stale:
                del self._stale_since[uid]  # it stands again (or is gone from the state)
        due: list[tuple[ClaimRef, str]] = []
        for uid, (ref, reason) in stale.items():
            since = self._stale_since.setdefault(uid, now)
            if now - since >= self.grace_s:
                due.append((ref, reason))
        if not due:
            return []
        answers = await asyncio.to_thread(self.runner.unprepare_claims, [ref for ref, _ in due])
        done: list[Cleanup] = []
        for ref, reason in due:
            error = answers.get(ref.uid, "no answer")
            cleanup = Cleanup(ref, reason, error)
            if error:
                log.error("stale claim %s (%s): unprepare failed: %s", ref, reason, error)
            else:
                self._stale_since.pop(ref.uid, None)
                log.warning("unprepared stale claim %s: %s", ref, reason)
            if self.on_cleanup is not None:
                try:
                    await asyncio.to_thread(self.on_cleanup, cleanup)
                except Exception:
                    log.exception("stale-claim cleanup callback failed")
            done.append(cleanup)
        return done

    async def run(self) -> None:
        """Rounds until cancelled: one now, then every ``period_s``."""
        while True:
            try:
                await self.run_once()
            except Exception:  # a failed round is logged; the next one tries again
                log.exception("stale-claim round failed")
            await asyncio.sleep(self.period_s)
