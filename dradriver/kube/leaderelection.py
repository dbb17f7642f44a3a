"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's semantics, so two controller replicas
can run and only one reconciles.

NVIDIA's controller (``pkg/flags/leaderelection.go``, ``cmd/compute-domain-controller/main.go``) uses client-go's
``leaderelection`` with a Lease lock: lease duration 15 s, renew deadline 10 s, retry period 2 s, identity
``<podName>-<random uuid>``, ``ReleaseOnCancel``. This module keeps those rules:

* a candidate takes the Lease when it does not exist, when nobody holds it (``holderIdentity`` empty: released),
  or when the holder has not changed it for ``leaseDurationSeconds`` *as observed by this candidate's own clock*
  (client-go never compares the server's ``renewTime`` with the local clock: no clock-skew assumption);
* every write is conditional on the Lease's ``resourceVersion`` (a 409 means someone else won the round);
* the leader renews every ``retry_period_s``; when no renewal succeeds for ``renew_deadline_s`` it stops leading
  (:meth:`LeaderElector.run` returns, the callback's stop event is set) -- the process must then stop acting;
* on cancel (the stop event) the leader releases the Lease (``holderIdentity`` emptied, ``leaseDurationSeconds``
  1) so a standby takes over at its next retry instead of after a full lease duration.

Why not ``kubernetes.leaderelection`` from the official client: its ``LeaderElection.run`` blocks in ``acquire``
with no way to cancel it, has no release on cancel, runs the leader's work in a daemon thread it never stops,
and sends requests outside :meth:`~dradriver.kube.client.KubeClient.call` (no retries on 5xx, no rate limit, no
translation into our errors). The rules above fit in this small module.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient

__all__ = ["LeaderElectionConfig", "LeaderElector", "candidate_identity"]

log = logging.getLogger(__name__)


def candidate_identity(pod_name: str) -> str:
    """``<podName>-<random uuid>``: unique per process, so a restarted pod never mistakes the old lease for its own."""
    return f"{pod_name}-{uuid.uuid4()}"


@dataclass(frozen=True, slots=True)
class LeaderElectionConfig:
    """Where the Lease is and how it is timed (seconds).

    :param lease_duration_s: how long a standby waits, after the last change it saw, before taking the Lease.
    :param renew_deadline_s: how long the leader keeps trying to renew before it gives up leading.
    :param retry_period_s: between two tries (standby) or two renewals (leader).
    :raises ValueError: ``lease_duration_s <= renew_deadline_s`` or ``renew_deadline_s <= retry_period_s``
        (client-go's checks, with its jitter factor 1.2 on the retry period).
    """

    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if self.lease_duration_s <= self.renew_deadline_s:
            raise ValueError(f"leader election: lease duration {self.lease_duration_s}s must be greater than the "
                             f"renew deadline {self.renew_deadline_s}s")
        if self.renew_deadline_s <= 1.2 * self.retry_period_s:
            raise ValueError(f"leader election: renew deadline {self.renew_deadline_s}s must be greater than 1.2 x "
                             f"the retry period {self.retry_period_s}s")
        if not self.identity:
            raise ValueError("leader election: the identity must not be empty")


def _micro_time() -> str:
    """``metav1.MicroTime`` as the API writes it: RFC 3339 with microseconds, UTC."""
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(slots=True)
class LeaderElector:
    """One candidate.

    :param clock: a monotonic clock (seconds), for the observation times.
    """

    client: KubeClient
    config: LeaderElectionConfig
    clock: Callable[[], float] = time.monotonic
    _observed: tuple[str, str, int] | None = field(default=None, init=False)  # (holder, renewTime, transitions)
    _observed_at: float = field(default=0.0, init=False)
    _lease: JSONDict | None = field(default=None, init=False)
    _leading: threading.Event = field(default_factory=threading.Event, init=False)

    @property
    def is_leader(self) -> bool:
        """This candidate holds the Lease (as of its last successful write)."""
        return self._leading.is_set()

    def holder(self) -> str:
        """The holder this candidate last observed (``""``: none)."""
        return self._observed[0] if self._observed else ""

    # -- one round ------------------------------------------------------------------------------------------------
    def _spec(self, transitions: int, acquire_time: str | None) -> JSONDict:
        now = _micro_time()
        return {"holderIdentity": self.config.identity,
                "leaseDurationSeconds": max(1, round(self.config.lease_duration_s)),
                "acquireTime": acquire_time or now, "renewTime": now, "leaseTransitions": transitions}

    def try_acquire_or_renew(self) -> bool:
        """One try: create, take over or renew the Lease. True when this candidate holds it afterwards.

        :raises errors.KubeAPIError: a failure other than a lost race (409) or a missing Lease.
        """
        cfg = self.config
        try:
            lease = self.client.call(f"GET leases {cfg.namespace}/{cfg.name}",
                                     self.client.coordination.read_namespaced_lease, cfg.name, cfg.namespace)
        except errors.KubeNotFoundError:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": cfg.name, "namespace": cfg.namespace}, "spec": self._spec(0, None)}
            try:
                created = self.client.call(f"POST leases {cfg.namespace}/{cfg.name}",
                                           self.client.coordination.create_namespaced_lease, cfg.namespace, body)
            except (errors.KubeAlreadyExistsError, errors.KubeConflictError):
                return False
            self._observe(created)
            return True
        spec = lease.get("spec") or {}
        self._observe(lease)
        holder = str(spec.get("holderIdentity") or "")
        mine = holder == cfg.identity
        duration = float(spec.get("leaseDurationSeconds") or cfg.lease_duration_s)
        if holder and not mine and self.clock() < self._observed_at + duration:
            return False  # held by another candidate, renewed within its lease as far as we have seen
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        lease["spec"] = self._spec(transitions, str(spec.get("acquireTime")) if mine and spec.get("acquireTime")
                                   else None)
        try:
            updated = self.client.call(f"PUT leases {cfg.namespace}/{cfg.name}",
                                       self.client.coordination.replace_namespaced_lease, cfg.name, cfg.namespace,
                                       lease)
        except (errors.KubeConflictError, errors.KubeNotFoundError):
            return False
        self._observe(updated)
        return True

    def _observe(self, lease: JSONDict) -> None:
        spec = lease.get("spec") or {}
        record = (str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or ""),
                  int(spec.get("leaseTransitions") or 0))
        if record != self._observed:
            self._observed = record
            self._observed_at = self.clock()
        self._lease = lease

    def release(self) -> bool:
        """Give the Lease up if this candidate holds it (``ReleaseOnCancel``). True when it was released."""
        cfg = self.config
        self._leading.clear()
        try:
            lease = self.client.call(f"GET leases {cfg.namespace}/{cfg.name}",
                                     self.client.coordination.read_namespaced_lease, cfg.name, cfg.namespace)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != cfg.identity:
                return False
            now = _micro_time()
            lease["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": now,
                             "acquireTime": now}
            self.client.call(f"PUT leases {cfg.namespace}/{cfg.name}",
                             self.client.coordination.replace_namespaced_lease, cfg.name, cfg.namespace, lease,
                             retry=False)
        except errors.KubeAPIError as exc:
            log.warning("leader election: releasing lease %s/%s failed: %s", cfg.namespace, cfg.name, exc)
            return False
        log.info("leader election: %s released lease %s/%s", cfg.identity, cfg.namespace, cfg.name)
        return True

    def _try(self) -> bool:
        try:
            return self.try_acquire_or_renew()
        except errors.KubeAPIError as exc:
            log.warning("leader election: lease %s/%s: %s", self.config.namespace, self.config.name, exc)
            return False

    # -- the loop ----------------------------------------------------------------------------------------------------
    def run(self, lead: Callable[[threading.Event], Any], stop: threading.Event) -> bool:
        """Wait to become leader, then call ``lead(lost)`` in a thread while renewing; return when ``stop`` is set
        (the Lease is released) or leadership is lost (``lost`` is set for ``lead``, which must return soon).

        :returns: True when this candidate led at some point and lost the Lease (the caller should exit
            non-zero, as NVIDIA's controller does), False when it stopped on ``stop``.
        """
        cfg = self.config
        log.info("leader election: %s waits for lease %s/%s", cfg.identity, cfg.namespace, cfg.name)
        while not stop.is_set():
            if self._try():
                break
            stop.wait(cfg.retry_period_s)
        if stop.is_set():
            return False
        self._leading.set()
        log.info("leader election: %s acquired lease %s/%s", cfg.identity, cfg.namespace, cfg.name)
        lost = threading.Event()
        worker = threading.Thread(target=self._lead, args=(lead, lost), name="leader", daemon=True)
        worker.start()
        last_renewal = self.clock()
        try:
            while not stop.wait(cfg.retry_period_s):
                if lost.is_set():  # the leader's work ended by itself (it failed)
                    break
                if self._try() and self.holder() == cfg.identity:
                    last_renewal = self.clock()
                elif self.clock() - last_renewal >= cfg.renew_deadline_s:
                    log.error("leader election: %s could not renew lease %s/%s within %.1fs: stops leading",
                              cfg.identity, cfg.namespace, cfg.name, cfg.renew_deadline_s)
                    self._leading.clear()
                    lost.set()
                    worker.join(timeout=cfg.renew_deadline_s)
                    return True
        finally:
            lost.set()
            worker.join(timeout=cfg.renew_deadline_s)
            if self._leading.is_set():  # stopped, or the work ended by itself: hand over at once
                self.release()
        return not stop.is_set()

    def _lead(self, lead: Callable[[threading.Event], Any], lost: threading.Event) -> None:
        try:
            lead(lost)
        except Exception:
            log.exception("leader election: the leader's work failed")
        finally:
            lost.set()
