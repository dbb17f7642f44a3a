"""KEP-5007 binding conditions of the compute-domain plugin's IMEX channels (``--binding-conditions``): the node's
plugin says in each claim's ``status.devices[]`` when the claim's ComputeDomain is ready on the node, so the
scheduler binds the workload pod only then and its prepare never waits (``docs/user-guide/compute-domains.md``,
"Binding conditions").

KEP-5007 ("DRA: Device Binding Conditions", kubernetes/enhancements ``keps/sig-scheduling/5007-device-attach-before-
pod-scheduled``; gate ``DRADeviceBindingConditions`` on the API server and the scheduler, beta and on by default in
Kubernetes 1.37): a device published with ``bindingConditions`` is allocated with them copied into its allocation
result; kube-scheduler's DynamicResources plugin then waits in PreBind until every one of them is ``True`` in the
claim's ``status.devices[]`` entry of the device, fails the binding when one of its ``bindingFailureConditions`` is
``True`` (the claim is deallocated and the pod scheduled again), and gives up after ``bindingTimeout`` (default
600 s) the same way.

With the option the channels carry ``bindingConditions: [ComputeDomainReady]``, ``bindingFailureConditions:
[ComputeDomainFailed]`` and ``bindsToNode: true``
(:func:`~dradriver.domain.computedomains.plugin_resource_slices`). :class:`BindingConditionWriter` watches the
cluster's ResourceClaims (one LIST, then a WATCH from its ``resourceVersion``; a watch that ends or expires is opened
again, after a LIST on 410) and keeps those allocated a channel of this node's pool whose condition is not decided
yet. Every :attr:`BindingConditionWriter.poll_s` (and at once on a claim event) each such claim is assessed by the
channel preparer (:meth:`~dradriver.preparers.computedomain.ChannelPreparer.assess_binding`: the node is labelled
for the domain, driver-managed, so its IMEX daemon is started here; ready when that daemon is): ready sets
``ComputeDomainReady=True`` (reason ``DomainReady``), a failure sets ``ComputeDomainFailed=True`` with the reason
(``IMEXDaemonFailed``, ``NodeServesAnotherDomain``, ``InvalidChannelClaim``) and its message, through
:func:`dradriver.kube.claims.set_device_condition` (a GET and a PUT of the status subresource). A claim deallocated
or deleted before its prepare (its binding failed or timed out) gives its node label up
(:meth:`~dradriver.preparers.computedomain.ChannelPreparer.abandon_binding`).

Cost: one watch of all ResourceClaims per node with the option on (the API has no field selector on a claim's
allocation), and, per claim waiting for its domain, the preparer's readiness read once a poll (this node's daemon's
readiness record first, then the clique); two writes per claim (the condition, then the prepare's device status).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dradriver.domain import claims as domain_claims
from dradriver.domain.claims import ClaimRef
from dradriver.domain.computedomains import BINDING_CONDITION, BINDING_FAILURE_CONDITION
from dradriver.kube import claims as kube_claims
from dradriver.kube import errors as kube_errors
from dradriver.kube.client import KubeClient
from dradriver.preparers.computedomain import BindingVerdict

log = logging.getLogger(__name__)

Assess = Callable[[domain_claims.Claim, str], BindingVerdict]
"""``(claim, device) -> verdict``: :meth:`~dradriver.preparers.computedomain.ChannelPreparer.assess_binding`."""


@dataclass(slots=True)
class _Waiting:
    """A claim with channels of this pool whose binding condition is not decided yet."""

    ref: ClaimRef
    obj: dict[str, Any]
    devices: tuple[str, ...]


def undecided_devices(obj: Mapping[str, Any], *, driver: str, pool: str) -> tuple[str, ...]:
    """The devices of ``driver`` in ``pool`` allocated to the claim ``obj`` with :data:`BINDING_CONDITION` among
    their allocation result's ``bindingConditions`` whose ``status.devices[]`` entry has neither that condition
    nor :data:`BINDING_FAILURE_CONDITION` ``True`` yet (``()`` for a claim being deleted)."""
    if (obj.get("metadata") or {}).get("deletionTimestamp"):
        return ()
    status = obj.get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    entries = {(d.get("driver"), d.get("pool"), d.get("device")): d for d in status.get("devices") or []}
    out: list[str] = []
    for result in results:
        if result.get("driver") != driver or result.get("pool") != pool:
            continue
        if BINDING_CONDITION not in (result.get("bindingConditions") or ()):
            continue
        entry = entries.get((driver, pool, result.get("device"))) or {}
        decided = any(c.get("type") in (BINDING_CONDITION, BINDING_FAILURE_CONDITION) and c.get("status") == "True"
                      for c in entry.get("conditions") or ())
        if not decided and result.get("device") not in out:
            out.append(str(result.get("device")))
    return tuple(out)


def _allocated_here(obj: Mapping[str, Any], *, driver: str, pool: str) -> bool:
    results = (((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return any(r.get("driver") == driver and r.get("pool") == pool for r in results)


def _ref(obj: Mapping[str, Any]) -> ClaimRef:
    meta = obj.get("metadata") or {}
    return ClaimRef(namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""),
                    uid=str(meta.get("uid") or ""))


class BindingConditionWriter:
    """Sets the binding conditions of this node's allocated channels (module docstring); two daemon threads.

    :param client: the plugin's API client.
    :param driver: ``compute-domain.nvidia.com``.
    :param pool: this node's pool (the node name).
    :param assess: the channel preparer's :meth:`assess_binding`.
    :param abandon: the channel preparer's :meth:`abandon_binding` (a claim given up before its prepare).
    :param poll_s: how often a waiting claim's domain is assessed again, seconds.
    :param watch_timeout_s: ``timeoutSeconds`` of each watch, seconds.
    """

    POLL_S = 1.0
    WATCH_TIMEOUT_S = 300.0
    RELIST_DELAY_S = 1.0

    def __init__(self, client: KubeClient, *, driver: str, pool: str, assess: Assess,
                 abandon: Callable[[ClaimRef], None], poll_s: float = POLL_S,
                 watch_timeout_s: float = WATCH_TIMEOUT_S) -> None:
        self.client, self.driver, self.pool = client, driver, pool
        self.assess, self.abandon = assess, abandon
        self.poll_s, self.watch_timeout_s = poll_s, watch_timeout_s
        self.writes = 0
        """Conditions written (True or failure)."""
        self._cond = threading.Condition()
        self._waiting: dict[str, _Waiting] = {}  # by claim UID
        self._assessed: dict[str, ClaimRef] = {}  # claims assessed here and not prepared yet (their label)
        self._said: dict[str, str] = {}  # claim UID -> last "waiting" message logged
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ control
    def start(self) -> BindingConditionWriter:
        """Start the watch and the assessing threads."""
        self._threads = [threading.Thread(target=self._watch, name="binding-conditions-watch", daemon=True),
                         threading.Thread(target=self._assess_loop, name="binding-conditions", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop both threads (a watch being read ends with its connection at the latest)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    def waiting(self) -> list[ClaimRef]:
        """The claims whose binding condition is not decided yet."""
        with self._cond:
            return [w.ref for w in self._waiting.values()]

    # ------------------------------------------------------------------ claims seen
    def observe(self, obj: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Take one claim as the API has it now (a LIST item or a WATCH event's object)."""
        ref = _ref(obj)
        devices = () if deleted else undecided_devices(obj, driver=self.driver, pool=self.pool)
        gone = deleted or not _allocated_here(obj, driver=self.driver, pool=self.pool)
        with self._cond:
            if devices:
                self._waiting[ref.uid] = _Waiting(ref, dict(obj), devices)
                self._cond.notify_all()
            else:
                self._waiting.pop(ref.uid, None)
            abandoned = self._assessed.pop(ref.uid, None) if gone else None
        if abandoned is not None:
            log.info("claim %s: given up before its prepare on node %s (deallocated or deleted)", abandoned,
                     self.pool)
            try:
                self.abandon(abandoned)
            except kube_errors.KubeAPIError as exc:
                log.warning("claim %s: node label not removed: %s", abandoned, exc)

    def _watch(self) -> None:
        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    listed = kube_claims.list_resource_claims(self.client)
                    seen = set()
                    for item in listed.get("items") or ():
                        seen.add(str((item.get("metadata") or {}).get("uid") or ""))
                        self.observe(item)
                    with self._cond:
                        vanished = [w.ref for uid, w in self._waiting.items() if uid not in seen]
                    for ref in vanished:
                        self.observe({"metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid}},
                                     deleted=True)
                    version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                for event in kube_claims.watch_resource_claims(self.client, version, self.watch_timeout_s):
                    if self._stop.is_set():
                        return
                    obj = event.get("object") or {}
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self.observe(obj, deleted=event.get("type") == "DELETED")
            except kube_errors.KubeGoneError:
                version = ""
            except kube_errors.KubeAPIError as exc:
                log.warning("binding conditions: watching ResourceClaims failed (listing again): %s", exc)
                version = ""
                self._stop.wait(self.RELIST_DELAY_S)

    # ------------------------------------------------------------------ assessing
    def _assess_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                batch = list(self._waiting.values())
            for waiting in batch:
                if self._stop.is_set():
                    return
                self._decide(waiting)
            with self._cond:
                if not self._stop.is_set():
                    self._cond.wait(timeout=self.poll_s)

    def assess_now(self) -> None:
        """Assess every waiting claim once, on the caller's thread."""
        with self._cond:
            batch = list(self._waiting.values())
        for waiting in batch:
            self._decide(waiting)

    def _decide(self, waiting: _Waiting) -> None:
        try:
            claim = domain_claims.claim_from_object(waiting.obj, waiting.ref, driver=self.driver, pool=self.pool)
        except domain_claims.ClaimError:
            return  # no longer allocated here: the next event drops it
        for device in waiting.devices:
            try:
                verdict = self.assess(claim, device)
                with self._cond:
                    if waiting.ref.uid in self._waiting:
                        self._assessed[waiting.ref.uid] = waiting.ref
                if verdict.state == "waiting":
                    if self._said.get(waiting.ref.uid) != verdict.message:
                        self._said[waiting.ref.uid] = verdict.message
                        log.info("claim %s: binding condition %s not set yet: %s", waiting.ref, BINDING_CONDITION,
                                 verdict.message)
                    continue
                condition = BINDING_CONDITION if verdict.state == "ready" else BINDING_FAILURE_CONDITION
                written = kube_claims.set_device_condition(
                    self.client, waiting.ref, driver=self.driver, pool=self.pool, device=device,
                    condition={"type": condition, "status": "True", "reason": verdict.reason,
                               "message": verdict.message})
            except kube_errors.KubeAPIError as exc:
                log.warning("claim %s: binding condition of %s not decided (asking again in %.1f s): %s",
                            waiting.ref, device, self.poll_s, exc)
                continue
            if written:
                self.writes += 1
                self._said.pop(waiting.ref.uid, None)
                level = logging.INFO if verdict.state == "ready" else logging.WARNING
                log.log(level, "claim %s: %s=True on %s (%s: %s)", waiting.ref, condition, device, verdict.reason,
                        verdict.message)
                with self._cond:
                    current = self._waiting.get(waiting.ref.uid)
                    if current is not None:
                        rest = tuple(d for d in current.devices if d != device)
                        if rest:
                            current.devices = rest
                        else:
                            del self._waiting[waiting.ref.uid]
