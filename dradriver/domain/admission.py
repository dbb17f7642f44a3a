"""Admission of ResourceClaims and ResourceClaimTemplates: the ``webhook`` executable's validation, pure.

NVIDIA's chart can run a validating admission webhook from the driver's image (``webhook.enabled``,
``cmd/webhook`` in NVIDIA/k8s-dra-driver-gpu): the API server POSTs an ``admission.k8s.io/v1`` AdmissionReview
for every CREATE/UPDATE of a ResourceClaim or ResourceClaimTemplate (``resource.k8s.io`` ``v1``, ``v1beta2``,
``v1beta1``) to ``/validate-resource-claim-parameters`` and refuses the write when the answer is not allowed.
This module turns a review's request into the answer; :mod:`dradriver.server.webhook` serves it over HTTPS.

What is checked, for each ``spec.devices.config[i]`` (``spec.spec.devices.config[i]`` in a template) with an
``opaque`` config:

* driver ``gpu.nvidia.com``: the parameters are decoded, normalised and validated by the functions the kubelet
  plugin's Prepare uses (:func:`dradriver.domain.configs.decode`, :func:`~dradriver.domain.configs.normalize`,
  :func:`~dradriver.domain.configs.validate`, with the same feature gates), so a refusal here reads exactly as
  Prepare's error would, with the field path under ``spec`` instead of ``status.allocation``. ``VfioDeviceConfig``
  is accepted with the ``PassthroughSupport`` gate and refused without it, as Prepare does (NVIDIA's webhook
  refuses it whatever the gates, though NVIDIA's plugin takes it: its webhook's list of kinds lacks it). Kinds
  dradriver does not take as GPU configs (the compute-domain kinds) are refused here too: Prepare would refuse
  them. NVIDIA's webhook accepts the compute-domain kinds under ``gpu.nvidia.com``;
* driver ``compute-domain.nvidia.com`` (NVIDIA's webhook skips it): ``ComputeDomainChannelConfig`` and
  ``ComputeDomainDaemonConfig`` decoded strictly by the compute-domain plugin's own decoders
  (:func:`dradriver.domain.computedomains.parse_channel_config`, :func:`~dradriver.domain.computedomains.
  parse_daemon_config`);
* admin access (NVIDIA's webhook does not look): a ``gpu.nvidia.com`` config that sets a sharing strategy and may
  apply to a request with ``adminAccess: true`` is refused (:func:`refuse_sharing_for_admin_access`).

Configs of other drivers and non-opaque configs are ignored. Every failing config gives one error; they are joined
as NVIDIA's webhook joins them: ``"<N> configs failed to validate: <error>; <error>"``, with ``reason: Invalid``
in the response status (the API server then answers the client ``admission webhook "gpu.nvidia.com" denied the
request: <message>``). A review that cannot be read, or is for another resource, is answered as NVIDIA's is
(HTTP 400 for an unreadable body, a ``BadRequest`` denial for another resource).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dradriver.domain import configs
from dradriver.domain.claims import base_request_name
from dradriver.domain.computedomains import ComputeDomainError, parse_channel_config, parse_daemon_config
from dradriver.domain.configs import DeviceConfig, DeviceConfigError
from dradriver.domain.featuregates import DEFAULT_GATES, FeatureGates
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, GPU_DRIVER
from dradriver.errors import DradriverError

WEBHOOK_NAME = "gpu.nvidia.com"
"""The webhook's name in NVIDIA's ValidatingWebhookConfiguration (the prefix of the API server's denial)."""

VALIDATE_PATH = "/validate-resource-claim-parameters"
"""The path the ValidatingWebhookConfiguration names (NVIDIA's)."""

READY_PATH = "/readyz"
"""The liveness and readiness probes' path; answers ``ok``."""

REVIEW_API_VERSION = "admission.k8s.io/v1"
REVIEW_KIND = "AdmissionReview"

RESOURCE_GROUP = "resource.k8s.io"
SERVED_VERSIONS = ("v1", "v1beta2", "v1beta1")
"""The ``resource.k8s.io`` versions whose claims and templates are admitted (NVIDIA's list)."""

SPEC_PATHS = {"resourceclaims": "spec", "resourceclaimtemplates": "spec.spec"}
"""Resource -> the field path of its ResourceClaimSpec."""

CD_CHANNEL_CONFIG = "ComputeDomainChannelConfig"
CD_DAEMON_CONFIG = "ComputeDomainDaemonConfig"

UNCHECKED_OPERATIONS = ("DELETE", "CONNECT")
"""Operations with no new object to check: allowed, should a configuration's rules send them."""

REASON_INVALID = "Invalid"
REASON_BAD_REQUEST = "BadRequest"


class ReviewError(DradriverError, ValueError):
    """The request body is no ``admission.k8s.io/v1`` AdmissionReview with a request (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to one review request.

    :param allowed: the write may go ahead.
    :param message: why not (``""`` when allowed).
    :param reason: the status reason: ``Invalid`` (a config failed) or ``BadRequest`` (not a claim or template).
    """

    allowed: bool
    message: str = ""
    reason: str = ""


def read_review(body: bytes) -> dict[str, Any]:
    """Decode an AdmissionReview request body.

    :returns: the review as a dict, with a ``request`` object.
    :raises ReviewError: not JSON, not an object, another ``apiVersion``/``kind`` (NVIDIA accepts only
        ``admission.k8s.io/v1``), or no ``request`` object.
    """
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReviewError(f"request could not be decoded: {exc}") from None
    if not isinstance(review, dict):
        raise ReviewError("request could not be decoded: the body is not a JSON object")
    gvk = f"{review.get('apiVersion', '')}, Kind={review.get('kind', '')}"
    if review.get("apiVersion") != REVIEW_API_VERSION or review.get("kind") != REVIEW_KIND:
        raise ReviewError(f"unsupported group version kind: {gvk} (expected {REVIEW_API_VERSION}, "
                          f"Kind={REVIEW_KIND})")
    if not isinstance(review.get("request"), dict):
        raise ReviewError("request could not be decoded: the AdmissionReview has no request")
    return review


def answer_review(review: Mapping[str, Any], gates: FeatureGates = DEFAULT_GATES) -> dict[str, Any]:
    """The response AdmissionReview for a review from :func:`read_review`.

    :returns: ``{"apiVersion", "kind", "response": {"uid", "allowed", "status"?}}``; ``status`` (``message``,
        ``reason``) only when not allowed.
    """
    request = review["request"]
    verdict = admit_claim_parameters(request, gates)
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": verdict.allowed}
    if not verdict.allowed:
        response["status"] = {"message": verdict.message, "reason": verdict.reason}
    return {"apiVersion": review["apiVersion"], "kind": review["kind"], "response": response}


def admit_claim_parameters(request: Mapping[str, Any], gates: FeatureGates = DEFAULT_GATES) -> Verdict:
    """Validate the opaque configs of the ResourceClaim or ResourceClaimTemplate in an AdmissionReview request.

    An UPDATE that leaves the spec as it was (a finalizer added by the scheduler or removed at deletion, a
    label) is allowed without a check: a claim stored before the webhook ran, or before the gates changed, must
    stay writable, or it could neither be allocated nor deleted (NVIDIA's webhook checks every UPDATE). DELETE and
    CONNECT are allowed.

    :param request: the review's ``request`` (``resource``: group, version, resource; ``operation``; ``object``;
        ``oldObject`` on UPDATE).
    :param gates: the feature gates the kubelet plugin runs with (they decide which sharing strategies pass).
    :returns: allowed, or refused with every failing config's error (module docstring).
    """
    resource = request.get("resource")
    resource = resource if isinstance(resource, Mapping) else {}
    group, version, plural = (str(resource.get(k, "")) for k in ("group", "version", "resource"))
    spec_path = SPEC_PATHS.get(plural)
    if group != RESOURCE_GROUP or version not in SERVED_VERSIONS or spec_path is None:
        return Verdict(False, "expected resource to be one of the supported versions for resourceclaims or "
                              f"resourceclaimtemplates, got {group}/{version}, Resource={plural}", REASON_BAD_REQUEST)
    if request.get("operation") in UNCHECKED_OPERATIONS:
        return Verdict(True)
    spec = _spec_at(request.get("object"), spec_path)
    if request.get("operation") == "UPDATE" and spec == _spec_at(request.get("oldObject"), spec_path):
        return Verdict(True)  # a metadata write (finalizers, labels) of an object admitted before
    if not isinstance(spec, Mapping):
        return Verdict(False, f"{spec_path}: the {plural[:-1]} in the request has no spec", REASON_BAD_REQUEST)
    errors = config_errors(spec, spec_path, gates)
    if not errors:
        return Verdict(True)
    return Verdict(False, f"{len(errors)} configs failed to validate: {'; '.join(errors)}", REASON_INVALID)


def _spec_at(obj: object, spec_path: str) -> object:
    for part in spec_path.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def config_errors(spec: Mapping[str, Any], spec_path: str = "spec",
                  gates: FeatureGates = DEFAULT_GATES) -> list[str]:
    """One error per failing opaque config of a ResourceClaimSpec, in config order (module docstring).

    :param spec: a ResourceClaimSpec of any served version (``devices.requests``, ``devices.config``).
    :param spec_path: the field path of ``spec`` (``spec`` or ``spec.spec``), prefixed to every error's field.
    :returns: errors as ``<field path>: <problem>``, empty when every config passes.
    """
    devices = spec.get("devices")
    devices = devices if isinstance(devices, Mapping) else {}
    entries = devices.get("config")
    entries = entries if isinstance(entries, list) else []
    admin = admin_access_requests(devices.get("requests"))
    errors: list[tuple[int, str]] = []
    decoded: list[tuple[int, tuple[str, ...], DeviceConfig]] = []
    for index, entry in enumerate(entries):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping):
            continue
        where = f"{spec_path}.devices.config[{index}].opaque.parameters"
        parameters = opaque.get("parameters")
        try:
            if opaque.get("driver") == GPU_DRIVER.driver_name:
                config = configs.normalize(configs.decode(parameters, where), gates)
                configs.validate(config, gates, where)
                requests = entry.get("requests")
                names = tuple(r for r in requests if isinstance(r, str)) if isinstance(requests, list) else ()
                decoded.append((index, names, config))
            elif opaque.get("driver") == COMPUTE_DOMAIN_DRIVER.driver_name:
                validate_compute_domain_config(parameters, where)
        except (DeviceConfigError, ComputeDomainError) as exc:
            errors.append((index, str(exc)))
    errors.extend(admin_access_errors(decoded, admin, spec_path))
    return [problem for _, problem in sorted(errors, key=lambda e: e[0])]


def validate_compute_domain_config(parameters: object, where: str) -> None:
    """Decode a ``compute-domain.nvidia.com`` config as the compute-domain plugin does at Prepare.

    :param parameters: the ``opaque.parameters`` object.
    :param where: its field path.
    :raises ComputeDomainError: not an object, a kind other than ``ComputeDomainChannelConfig`` and
        ``ComputeDomainDaemonConfig``, or the plugin's decoder refuses it (``apiVersion``, unknown fields,
        ``domainID`` missing, ``allocationMode`` not ``Single``/``All``).
    """
    if not isinstance(parameters, Mapping):
        raise ComputeDomainError(f"{where}: not an object")
    kind = parameters.get("kind")
    if kind == CD_DAEMON_CONFIG:
        parse_daemon_config(parameters, where)
    elif kind == CD_CHANNEL_CONFIG:
        parse_channel_config(parameters, where)
    else:
        raise ComputeDomainError(f"{where}.kind: {kind!r} is not one of {CD_CHANNEL_CONFIG!r}, "
                                 f"{CD_DAEMON_CONFIG!r}")


def admin_access_requests(requests: object) -> tuple[str, ...]:
    """Names of the requests with ``adminAccess: true``: under ``exactly`` (``v1``, ``v1beta2``) or at the
    request's top level (``v1beta1``); ``firstAvailable`` subrequests have no admin access in any version."""
    names: list[str] = []
    for request in requests if isinstance(requests, list) else ():
        if not isinstance(request, Mapping):
            continue
        exact = request.get("exactly")
        fields = exact if isinstance(exact, Mapping) else request
        if fields.get("adminAccess") is True and isinstance(request.get("name"), str):
            names.append(request["name"])
    return tuple(names)


def admin_access_errors(entries: Sequence[tuple[int, tuple[str, ...], DeviceConfig]], admin: Sequence[str],
                        spec_path: str = "spec") -> list[tuple[int, str]]:
    """The claim's ``gpu.nvidia.com`` configs that may apply to an admin-access request and set a sharing strategy.

    A config applies to a request when it names it (or one of its subrequests), or names no request at all; the
    walk goes from the highest precedence (the last entry) down and stops at the first config naming the request,
    as Prepare's selection does. A config naming no request applies only to devices of its kind, which the claim
    does not tell before allocation, so every such config above the naming one counts (the DeviceClass's configs
    are not in the claim and are not checked here).

    :param entries: (config index, ``requests``, decoded and normalised config), in config order.
    :param admin: names of the requests with ``adminAccess: true``.
    :returns: (config index, error) per offending config, in config order; the error is
        :func:`refuse_sharing_for_admin_access`'s.
    """
    found: dict[int, str] = {}
    for request in admin:
        for index, names, config in reversed(entries):
            naming = any(base_request_name(n) == request for n in names)
            if naming or not names:
                where = f"{spec_path}.devices.config[{index}].opaque.parameters"
                try:
                    refuse_sharing_for_admin_access(request, config, where)
                except DeviceConfigError as exc:
                    found.setdefault(index, str(exc))
            if naming:
                break
    return sorted(found.items())


def refuse_sharing_for_admin_access(request: str, config: DeviceConfig, where: str) -> None:
    """The rule: a config that sets a GPU sharing strategy must not apply to a request with admin access.

    Admin access (KEP-5018) gives a device that other claims may be using, for monitoring; time-slicing or an MPS
    control daemon would change how those claims' workloads run, so the two cannot be combined (NVIDIA refuses it
    at Prepare since kubernetes-sigs/dra-driver-nvidia-gpu#1280). This is the admission side, before allocation:
    it names the request, where the plugin's Prepare names the allocation result and device.

    :param request: the admin-access request's name.
    :param config: the decoded config that applies to it.
    :param where: the field path of the config's parameters.
    :raises DeviceConfigError: at ``<where>.sharing.strategy`` when ``config`` sets a strategy.
    """
    strategy = config.sharing.strategy if config.sharing is not None else ""
    if strategy:
        raise configs.admin_sharing_refusal(where, json.dumps(strategy), f"request {json.dumps(request)}")
