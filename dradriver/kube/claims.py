"""Reading ResourceClaims (``resource.k8s.io/v1``) for NodePrepareResources, and writing the driver's device
status (``status.devices``, KEP-4817).

The kubelet sends only ``(namespace, name, uid)``; the allocation lives in the claim's status. The GET is
here; the checks and the reduction to a :class:`dradriver.domain.claims.Claim` are pure and live in
:func:`dradriver.domain.claims.claim_from_object`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote

from dradriver.domain import claims as domain_claims
from dradriver.kube import errors
from dradriver.kube.client import JSONDict, KubeClient


def _claim_path(namespace: str, name: str) -> str:
    """The claim's API path (typed ResourceV1Api methods are avoided: ``KubeClient.raw``)."""
    return f"/apis/resource.k8s.io/v1/namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"


def get_resource_claim(client: KubeClient, namespace: str, name: str, *,
                       timeout_s: float | None = None, retry: bool = True) -> JSONDict:
    """``GET /apis/resource.k8s.io/v1/namespaces/<namespace>/resourceclaims/<name>`` as a dict.

    :param timeout_s: the whole GET's time limit, seconds, retries included (:meth:`KubeClient.call`).
    :param retry: False asks once (the caller retries on its own schedule).
    :raises errors.KubeNotFoundError: no such claim.
    :raises errors.KubeTimeoutError: no answer within ``timeout_s``.
    :raises errors.KubeAPIError: any other failure, after retries for 429/5xx/connection errors.
    """
    return client.call(f"GET resourceclaims {namespace}/{name}", client.raw("GET", _claim_path(namespace, name)),
                       timeout_s=timeout_s, retry=retry)


def fetch_claim(client: KubeClient, ref: domain_claims.ClaimRef, *, driver: str, pool: str,
                timeout_s: float | None = None) -> domain_claims.Claim:
    """GET the claim named by ``ref`` and reduce it to this node's allocation results for ``driver``.

    :param timeout_s: the GET's time limit, seconds (``None``: the client's own timeouts per try).
    :raises dradriver.domain.claims.ClaimError: the claim is gone (404), replaced (UID mismatch), not
        allocated, or has nothing for this driver on this node.
    :raises errors.KubeTimeoutError: no answer within ``timeout_s``.
    :raises errors.KubeAPIError: the API server could not be asked (transient; the kubelet retries).
    """
    try:
        obj = get_resource_claim(client, ref.namespace, ref.name, timeout_s=timeout_s)
    except errors.KubeNotFoundError as exc:
        raise domain_claims.ClaimError(ref, "ResourceClaim not found in the API server (deleted?)") from exc
    return domain_claims.claim_from_object(obj, ref, driver=driver, pool=pool)


def claim_standing(client: KubeClient, ref: domain_claims.ClaimRef, *, driver: str, pool: str) -> str:
    """Whether a prepared claim still stands: ``""`` when its ResourceClaim exists with the same UID and its
    allocation still has devices of ``driver`` in ``pool``; otherwise why not (``gone``, ``replaced by UID <uid>``,
    ``no longer allocated to this node``).

    :raises errors.KubeAPIError: the API server could not be asked (the caller decides nothing then).
    """
    try:
        obj = get_resource_claim(client, ref.namespace, ref.name)
    except errors.KubeNotFoundError:
        return "gone: the ResourceClaim no longer exists"
    uid = str((obj.get("metadata") or {}).get("uid", ""))
    if uid != ref.uid:
        return f"replaced: the ResourceClaim {ref.namespace}/{ref.name} now has UID {uid or '<none>'}"
    try:
        domain_claims.claim_from_object(obj, ref, driver=driver, pool=pool)
    except domain_claims.ClaimError as exc:
        return f"no longer allocated to this node ({exc.cause})"
    return ""


def publish_device_status(client: KubeClient, ref: domain_claims.ClaimRef, *, driver: str, pool: str,
                          devices: Mapping[str, Mapping[str, Any]] | None, attempts: int = 5,
                          retry: bool = True) -> bool:
    """Write this driver's entries of ``ResourceClaim.status.devices`` (KEP-4817 ``AllocatedDeviceStatus``).

    ``devices`` maps a DRA device name to its ``data`` (raw JSON, at most 10 KiB; the entry gets condition
    ``Ready=True``; the entry's other conditions, such as a binding condition :func:`set_device_condition` wrote,
    are kept); ``None`` removes every entry of ``driver`` and ``pool`` (the claim was unprepared). An entry is
    written for each allocation result of the device, with the result's ``shareID`` when it has one (the list is
    keyed by driver, pool, device and shareID; a consumable share's entry must name its share). Entries of other
    drivers, pools and devices are kept; only allocated devices are written (the API requires each entry to match
    an allocated device). Read-modify-write through the ``status`` subresource with the ``resourceVersion`` read (a
    conflict re-reads and retries), as NVIDIA's driver does (``kubeletplugin/draplugin.go`` in
    k8s.io/dynamic-resource-allocation). Nothing is sent
    after the GET when the entries are already as wanted.

    :param attempts: tries on a ``resourceVersion`` conflict.
    :param retry: False sends each request once (429/5xx/connection errors are raised at once).
    :returns: False when the claim is gone, replaced (UID differs) or no longer allocated (nothing written).
    :raises errors.KubeAPIError: the write failed after ``attempts`` conflicts or a non-conflict error.
    """
    what = f"PUT resourceclaims/status {ref.namespace}/{ref.name}"
    for attempt in range(attempts):
        try:
            obj = get_resource_claim(client, ref.namespace, ref.name, retry=retry)
        except errors.KubeNotFoundError:
            return False
        if obj.get("metadata", {}).get("uid") != ref.uid:
            return False
        status = obj.setdefault("status", {})
        results = [r for r in ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
                   if r.get("driver") == driver and r.get("pool") == pool]
        if not results and devices is not None:
            return False

        def ours(entry: Mapping[str, Any]) -> bool:
            return (entry.get("driver") == driver and entry.get("pool") == pool
                    and (devices is None or entry.get("device") in devices))

        before = status.get("devices") or []
        kept = [d for d in before if not ours(d)]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        written: set[tuple[str, str]] = set()
        for result in results if devices is not None else ():
            name, share = str(result.get("device", "")), str(result.get("shareID") or "")
            data = devices.get(name) if devices is not None else None
            if data is None or (name, share) in written:
                continue
            written.add((name, share))
            entry: dict[str, Any] = {"driver": driver, "pool": pool, "device": name}
            if share:
                entry["shareID"] = share
            previous = next((d for d in before if ours(d) and d.get("device") == name
                             and str(d.get("shareID") or "") == share), None)
            stamp = now
            if previous is not None and previous.get("data") == dict(data):
                stamp = next((c.get("lastTransitionTime") for c in previous.get("conditions") or []
                              if c.get("type") == "Ready"), now)
            others = [c for c in (previous or {}).get("conditions") or [] if c.get("type") != "Ready"]
            entry.update({"data": dict(data), "conditions": [{
                "type": "Ready", "status": "True", "reason": "Prepared", "lastTransitionTime": stamp,
                "message": "prepared by the kubelet plugin"}, *others]})
            kept.append(entry)
        if kept == before:
            return True
        status["devices"] = kept
        try:
            client.call(what, client.raw("PUT", _claim_path(ref.namespace, ref.name) + "/status"), body=obj,
                        retry=retry)
            return True
        except errors.KubeConflictError:
            if attempt == attempts - 1:
                raise
        except errors.KubeNotFoundError:
            return False
    return False


CLAIMS_PATH = "/apis/resource.k8s.io/v1/resourceclaims"
"""ResourceClaims of every namespace (LIST and WATCH)."""


def list_resource_claims(client: KubeClient) -> JSONDict:
    """``GET /apis/resource.k8s.io/v1/resourceclaims``: every namespace's claims, one response (``items`` and
    ``metadata.resourceVersion``, to watch from).

    :raises errors.KubeAPIError: after retries.
    """
    return client.call("LIST resourceclaims", client.raw("GET", CLAIMS_PATH))


def watch_resource_claims(client: KubeClient, resource_version: str, timeout_s: float) -> Iterator[JSONDict]:
    """Watch every namespace's ResourceClaims from ``resource_version``; yields watch events (``type``,
    ``object``) until the server ends the watch (after ``timeout_s``).

    :raises errors.KubeGoneError: the server ended the watch with an ``ERROR`` event (410 ``Expired``): list again.
    :raises errors.KubeAPIError: opening or reading failed.
    """
    what = "WATCH resourceclaims"
    options: dict[str, Any] = {"resource_version": resource_version} if resource_version else {}
    for event in client.stream(what, client.raw("GET", CLAIMS_PATH), timeout_s=timeout_s, **options):
        if event.get("type") == "ERROR":
            status = event.get("object") or {}
            raise errors.KubeGoneError(what, reason=str(status.get("reason") or "Expired"),
                                       message=str(status.get("message") or ""))
        yield event


def set_device_condition(client: KubeClient, ref: domain_claims.ClaimRef, *, driver: str, pool: str, device: str,
                         condition: Mapping[str, str], attempts: int = 5) -> bool:
    """Set one condition (``type``, ``status``, ``reason``, ``message``; ``metav1.Condition``) in the claim's
    ``status.devices[]`` entry of ``driver``/``pool``/``device`` (the entry is made when missing; its other
    conditions and ``data`` are kept; ``lastTransitionTime`` changes only with ``status``), as a KEP-5007 binding
    condition is reported (kubernetes/enhancements keps/sig-scheduling/5007-device-attach-before-pod-scheduled).
    Read-modify-write through the ``status`` subresource, a ``resourceVersion`` conflict read again.

    :returns: False when the claim is gone, replaced (UID differs) or ``device`` is not allocated to it (nothing
        written); True when the condition is as asked.
    :raises errors.KubeAPIError: the write failed after ``attempts`` conflicts or a non-conflict error.
    """
    what = f"PUT resourceclaims/status {ref.namespace}/{ref.name}"
    for attempt in range(attempts):
        try:
            obj = get_resource_claim(client, ref.namespace, ref.name)
        except errors.KubeNotFoundError:
            return False
        if obj.get("metadata", {}).get("uid") != ref.uid:
            return False
        status = obj.setdefault("status", {})
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        if not any(r.get("driver") == driver and r.get("pool") == pool and r.get("device") == device
                   for r in results):
            return False
        entries = status.setdefault("devices", [])
        entry = next((d for d in entries if (d.get("driver"), d.get("pool"), d.get("device")) == (driver, pool, device)
                      and not d.get("shareID")), None)
        if entry is None:
            entry = {"driver": driver, "pool": pool, "device": device}
            entries.append(entry)
        conditions = entry.setdefault("conditions", [])
        previous = next((c for c in conditions if c.get("type") == condition["type"]), None)
        wanted = {"type": condition["type"], "status": condition["status"], "reason": condition["reason"],
                  "message": condition.get("message", "")}
        if previous is not None and {k: previous.get(k, "") for k in wanted} == wanted:
            return True
        stamp = (previous.get("lastTransitionTime") if previous is not None
                 and previous.get("status") == wanted["status"] else None)
        wanted["lastTransitionTime"] = stamp or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        entry["conditions"] = [c for c in conditions if c.get("type") != condition["type"]] + [wanted]
        try:
            client.call(what, client.raw("PUT", _claim_path(ref.namespace, ref.name) + "/status"), body=obj)
            return True
        except errors.KubeConflictError:
            if attempt == attempts - 1:
                raise
        except errors.KubeNotFoundError:
            return False
    return False
