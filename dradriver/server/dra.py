"""The DRA node services ``DRAPlugin`` v1 and v1beta1: protobuf <-> :class:`ClaimPreparer` calls.

Thin on purpose: decode the kubelet's ``Claim`` triples into :class:`ClaimRef`, call the preparer once per
batch, encode its per-claim results. The servicers are synchronous: they run in the DRA server's worker threads
(``grpc.server``, see :mod:`dradriver.server.sockets`), one per call, and call the blocking preparer there.
Rules from the kubelet's ``pkg/kubelet/cm/dra/manager.go`` and ``kubeletplugin/draplugin.go`` in
k8s.io/dynamic-resource-allocation:

* every requested claim UID gets an entry in the response (a missing one makes the kubelet fail the
  whole batch as "skipped"), and nothing else does (an unknown key is an error for the kubelet);
* a claim's problem goes into that claim's ``error`` string, never into a failed RPC;
* an unexpected exception from the preparer becomes a generic error on every claim of the batch and a
  logged traceback; a :class:`DradriverError` raised for the whole batch lends its message to each claim;
* an empty request gets an empty response (probes send ``NodePrepareResources{}``).

v1 and v1beta1 differ only in ``Device.share_id`` (v1 field 5), which v1beta1 cannot carry.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dradriver._proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from dradriver.domain.claims import ClaimRef, ClaimResult
from dradriver.errors import DradriverError

if TYPE_CHECKING:  # the protocol only; importing it loads the domain model (~0.1 s before the sockets)
    from dradriver.domain.ports import ClaimPreparer

log = logging.getLogger(__name__)

_request_ids = itertools.count(1)


def decode_claims(claims: Sequence[Any]) -> tuple[list[ClaimRef], dict[str, str]]:
    """Split the request's ``Claim`` messages into usable references and per-UID decode errors.

    A claim with an empty ``namespace``, ``uid`` or ``name`` (all required by the API) is not passed on;
    its UID (possibly ``""``) maps to an error naming the empty fields. Repeated UIDs are passed on once.
    """
    refs: list[ClaimRef] = []
    errors: dict[str, str] = {}
    seen: set[str] = set()
    for claim in claims:
        ref = ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
        missing = [field for field in ("namespace", "uid", "name") if not getattr(claim, field)]
        if missing:
            errors[claim.uid] = f"claim {ref}: empty {', '.join(missing)} in the kubelet's request"
        elif ref.uid not in seen:
            seen.add(ref.uid)
            refs.append(ref)
    return refs, errors


def _batch_error(action: str, refs: Sequence[ClaimRef], exc: Exception) -> dict[str, str]:
    if isinstance(exc, DradriverError):
        log.error("%s failed for the whole batch of %d claims: %s", action, len(refs), exc)
        return {ref.uid: f"claim {ref}: {exc}" for ref in refs}
    log.error("unexpected error in %s for %d claims", action, len(refs), exc_info=exc)
    return {
        ref.uid: f"claim {ref}: internal error in the DRA plugin during {action} "
        f"({type(exc).__name__}); see the plugin log"
        for ref in refs
    }


def _encode_device(pb2: ModuleType, device: Any) -> Any:
    message = pb2.Device(
        request_names=list(device.request_names),
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=list(device.cdi_device_ids),
    )
    if device.share_id is not None and "share_id" in pb2.Device.DESCRIPTOR.fields_by_name:
        message.share_id = device.share_id
    return message


def _time_remaining(context: Any) -> float | None:
    """Seconds left of the caller's gRPC deadline, or ``None`` when it sent none."""
    remaining = getattr(context, "time_remaining", None)
    value = remaining() if callable(remaining) else None
    return float(value) if isinstance(value, int | float) else None


def prepare(pb2: ModuleType, preparer: ClaimPreparer, request: Any, deadline_s: float | None = None) -> Any:
    """Serve one ``NodePrepareResources`` for the API version whose generated module is ``pb2`` (blocking, in the
    DRA server's worker thread for the call).

    :param deadline_s: seconds left of the kubelet's gRPC deadline (``None``: it sent none); the preparer
        answers within it.
    """
    request_id = next(_request_ids)
    refs, errors = decode_claims(request.claims)
    log.debug("request %d: NodePrepareResources %s", request_id, [str(ref) for ref in refs])
    results: Mapping[str, ClaimResult] = {}
    if refs:
        try:
            results = preparer.prepare_claims(refs, deadline_s=deadline_s)
        except Exception as exc:
            errors.update(_batch_error("NodePrepareResources", refs, exc))
    response = pb2.NodePrepareResourcesResponse()
    for ref in refs:
        entry = response.claims[ref.uid]
        if ref.uid in errors:
            entry.error = errors[ref.uid]
            continue
        result = results.get(ref.uid)
        if result is None:
            log.error("request %d: the driver returned no result for claim %s", request_id, ref)
            entry.error = f"claim {ref}: the DRA plugin returned no result for this claim"
        elif result.error:
            entry.error = result.error
        else:
            entry.devices.extend(_encode_device(pb2, device) for device in result.devices)
    for uid, error in errors.items():
        if uid not in response.claims:
            response.claims[uid].error = error
    _log_unrequested(request_id, results, response.claims)
    log.debug(
        "request %d: NodePrepareResources done, %d errors",
        request_id,
        sum(1 for entry in response.claims.values() if entry.error),
    )
    return response


def unprepare(pb2: ModuleType, preparer: ClaimPreparer, request: Any) -> Any:
    """Serve one ``NodeUnprepareResources`` for the API version whose generated module is ``pb2`` (blocking)."""
    request_id = next(_request_ids)
    refs, errors = decode_claims(request.claims)
    log.debug("request %d: NodeUnprepareResources %s", request_id, [str(ref) for ref in refs])
    results: Mapping[str, str] = {}
    if refs:
        try:
            results = preparer.unprepare_claims(refs)
        except Exception as exc:
            errors.update(_batch_error("NodeUnprepareResources", refs, exc))
    response = pb2.NodeUnprepareResourcesResponse()
    for ref in refs:
        entry = response.claims[ref.uid]
        if ref.uid in errors:
            entry.error = errors[ref.uid]
        elif ref.uid not in results:
            log.error("request %d: the driver returned no result for claim %s", request_id, ref)
            entry.error = f"claim {ref}: the DRA plugin returned no result for this claim"
        else:
            entry.error = results[ref.uid]
    for uid, error in errors.items():
        if uid not in response.claims:
            response.claims[uid].error = error
    _log_unrequested(request_id, results, response.claims)
    return response


def _log_unrequested(request_id: int, results: Mapping[str, object], answered: Mapping[str, object]) -> None:
    extra = sorted(set(results) - set(answered))
    if extra:
        log.warning(
            "request %d: the driver answered for claims not in the request, dropped: %s", request_id, extra
        )


class DRAPluginV1Servicer(dra_v1_pb2_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (advertised as ``v1.DRAPlugin``)."""

    def __init__(self, preparer: ClaimPreparer) -> None:
        self._preparer = preparer

    def NodePrepareResources(
        self, request: dra_v1_pb2.NodePrepareResourcesRequest, context: Any
    ) -> dra_v1_pb2.NodePrepareResourcesResponse:
        response: dra_v1_pb2.NodePrepareResourcesResponse = prepare(dra_v1_pb2, self._preparer, request,
                                                                          _time_remaining(context))
        return response

    def NodeUnprepareResources(
        self, request: dra_v1_pb2.NodeUnprepareResourcesRequest, context: Any
    ) -> dra_v1_pb2.NodeUnprepareResourcesResponse:
        response: dra_v1_pb2.NodeUnprepareResourcesResponse = unprepare(
            dra_v1_pb2, self._preparer, request
        )
        return response


class DRAPluginV1Beta1Servicer(dra_v1beta1_pb2_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` (advertised as ``v1beta1.DRAPlugin``).

    Same behaviour as :class:`DRAPluginV1Servicer`; a device's ``share_id`` is dropped (no such field).
    """

    def __init__(self, preparer: ClaimPreparer) -> None:
        self._preparer = preparer

    def NodePrepareResources(
        self, request: dra_v1beta1_pb2.NodePrepareResourcesRequest, context: Any
    ) -> dra_v1beta1_pb2.NodePrepareResourcesResponse:
        response: dra_v1beta1_pb2.NodePrepareResourcesResponse = prepare(
            dra_v1beta1_pb2, self._preparer, request, _time_remaining(context)
        )
        return response

    def NodeUnprepareResources(
        self, request: dra_v1beta1_pb2.NodeUnprepareResourcesRequest, context: Any
    ) -> dra_v1beta1_pb2.NodeUnprepareResourcesResponse:
        response: dra_v1beta1_pb2.NodeUnprepareResourcesResponse = unprepare(
            dra_v1beta1_pb2, self._preparer, request
        )
        return response
