"""The objects the compute-domain controller makes for one ComputeDomain, free of I/O: the daemon
ResourceClaimTemplate and the IMEX daemon DaemonSet (driver namespace), and the workload ResourceClaimTemplate
(the domain's namespace).

Facts (NVIDIA's ``cmd/compute-domain-controller/``): both daemon objects are named
``computedomain-daemon-<cdUID>`` and carry the finalizer ``resource.nvidia.com/computeDomain`` and the label
``resource.nvidia.com/computeDomain=<cdUID>``; the templates add ``resource.nvidia.com/computeDomainTarget``
(``Daemon`` / ``Workload``). The daemon template requests ``daemon`` from ``compute-domain-daemon.nvidia.com``
with a ``ComputeDomainDaemonConfig{domainID}``; the workload template (named by
``spec.channel.resourceClaimTemplate.name``) requests ``channel`` from
``compute-domain-default-channel.nvidia.com`` with a ``ComputeDomainChannelConfig{domainID, allocationMode}``
(``Single`` forced in host-managed IMEX mode). With ``IMEX_ISOLATION=channel`` (host-managed only) it requests from
``compute-domain-channel.nvidia.com`` instead, with a CEL selector ``...id == <the domain's channel>``, so the
scheduler allocates the domain's own channel on every node. The DaemonSet's pods run only on nodes labelled with
the domain (the plugin labels a node when it prepares a workload channel there), as ServiceAccount
``compute-domain-daemon-service-account``, tolerate every ``NoSchedule``/``NoExecute``/``PreferNoSchedule``
taint, run ``compute-domain-daemon -v $(LOG_VERBOSITY) run`` with env ``LOG_VERBOSITY``,
``MAX_NODES_PER_IMEX_DOMAIN``, ``NODE_NAME``, ``POD_IP``, ``POD_UID``, ``POD_NAME``, ``POD_NAMESPACE``,
``NVIDIA_VISIBLE_DEVICES=void`` and ``FEATURE_GATES`` (every gate), and are probed with
``compute-domain-daemon check``: startup every 1 s up to 1200 times (20 min), liveness every 60 s up to 20
times, readiness every 10 s once; each probe times out after 10 s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dradriver.domain.computedomains import (
    ALLOCATION_SINGLE,
    API_GROUP_VERSION,
    CHANNEL_DEVICE_CLASS,
    DAEMON_DEVICE_CLASS,
    DAEMON_SERVICE_ACCOUNT,
    DEFAULT_MAX_NODES_PER_IMEX_DOMAIN,
    FINALIZER,
    ISOLATED_CHANNEL_DEVICE_CLASS,
    LABEL_CLIQUE_ID,
    LABEL_COMPUTE_DOMAIN,
    LABEL_TARGET,
    NODE_CLIQUE_LABEL,
    ComputeDomain,
    clique_domain_name,
    clique_domain_uid,
    daemon_object_name,
)
from dradriver.domain.featuregates import DEFAULT_GATES, FeatureGates
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER

__all__ = [
    "ANNOTATION_TEMPLATE_HASH",
    "DAEMON_CLAIM_NAME",
    "DAEMON_CONTAINER",
    "IMEX_ISOLATION_CHANNEL",
    "IMEX_ISOLATION_DOMAIN",
    "IMEX_MODE_DRIVER_MANAGED",
    "IMEX_MODE_HOST_MANAGED",
    "IMEX_MODE_PRE_WARMED",
    "TARGET_DAEMON",
    "TARGET_WORKLOAD",
    "ControllerSettings",
    "clique_daemon_set",
    "clique_domain",
    "daemon_claim_template",
    "daemon_set",
    "owner_of",
    "render_all_gates",
    "workload_claim_template",
]

JSONDict = dict[str, Any]

TARGET_DAEMON, TARGET_WORKLOAD = "Daemon", "Workload"
DAEMON_CONTAINER = "compute-domain-daemon"
"""The DaemonSet's container, and the name of its pod's resource claim."""
DAEMON_CLAIM_NAME = "compute-domain-daemon"
IMEX_MODE_DRIVER_MANAGED, IMEX_MODE_HOST_MANAGED = "driverManaged", "hostManaged"
ANNOTATION_TEMPLATE_HASH = "resource.nvidia.com/daemonTemplateHash"
"""Pre-warmed mode: the hash of the pod template a clique DaemonSet was made with (:func:`clique_daemon_set`): the
controller updates a DaemonSet whose hash is not the one its flags give now (a new image after an upgrade)."""
IMEX_MODE_PRE_WARMED = "preWarmed"
"""dradriver's third IMEX mode: one long-lived IMEX daemon per node of every clique, a DaemonSet per clique the
controller keeps before any ComputeDomain exists; each ComputeDomain gets its own channel in its cliques' domains."""
IMEX_ISOLATION_DOMAIN, IMEX_ISOLATION_CHANNEL = "domain", "channel"
RESOURCE_API_VERSION = "resource.k8s.io/v1"
_PROBE_TIMEOUT_S = 10


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """What the controller's flags (NVIDIA's ``cmd/compute-domain-controller/main.go``) put into the objects it makes.

    :param namespace: the driver namespace (``--namespace``): daemon templates, DaemonSets, cliques live there.
    :param image: the daemon pods' image (``--image-name``).
    :param log_verbosity: the daemons' ``LOG_VERBOSITY`` (``--log-verbosity-cd-daemon``), a klog level.
    :param max_nodes_per_imex_domain: ``MAX_NODES_PER_IMEX_DOMAIN`` (18: GB200/GB300 NVL72).
    :param pull_secrets: ``imagePullSecrets`` of daemon pods (``--cd-daemon-image-pull-secret-names``).
    :param feature_gates: the gates in force; the daemons get all of them in ``FEATURE_GATES``.
    :param imex_mode: ``driverManaged`` (IMEX daemons in the per-domain DaemonSet), ``hostManaged`` or
        ``preWarmed`` (dradriver's: a DaemonSet of IMEX daemons per clique, :func:`clique_daemon_set`).
    :param imex_isolation: ``domain`` (channel 0 for every domain, NVIDIA's) or ``channel`` (host-managed only:
        each domain its own channel, annotation ``resource.nvidia.com/imexChannel``); pre-warmed mode always
        isolates by channel.
    """

    namespace: str = "default"
    image: str = ""
    log_verbosity: int = 4
    max_nodes_per_imex_domain: int = DEFAULT_MAX_NODES_PER_IMEX_DOMAIN
    pull_secrets: tuple[str, ...] = ()
    feature_gates: FeatureGates = DEFAULT_GATES
    imex_mode: str = IMEX_MODE_DRIVER_MANAGED
    imex_isolation: str = IMEX_ISOLATION_DOMAIN

    @property
    def host_managed(self) -> bool:
        """IMEX runs on the host: no DaemonSet, daemon template, cliques or node labels (7.3)."""
        return self.imex_mode == IMEX_MODE_HOST_MANAGED

    @property
    def pre_warmed(self) -> bool:
        """Pre-warmed IMEX: the clique DaemonSets run the daemons; a domain has no DaemonSet, daemon template or
        node label of its own."""
        return self.imex_mode == IMEX_MODE_PRE_WARMED

    @property
    def domain_daemons(self) -> bool:
        """Driver-managed IMEX: each domain its own DaemonSet, daemon template, cliques and node labels."""
        return not self.host_managed and not self.pre_warmed

    @property
    def channel_isolation(self) -> bool:
        """``IMEX_ISOLATION=channel``, or pre-warmed mode: each domain gets its own IMEX channel."""
        return self.imex_isolation == IMEX_ISOLATION_CHANNEL or self.pre_warmed


def render_all_gates(gates: Mapping[str, bool]) -> str:
    """Every gate, ``Name=true|false`` joined by commas in name order: the daemons' ``FEATURE_GATES``."""
    return ",".join(f"{name}={'true' if value else 'false'}" for name, value in sorted(gates.items()))


def _labels(cd: ComputeDomain, target: str | None = None) -> dict[str, str]:
    labels = {LABEL_COMPUTE_DOMAIN: cd.uid}
    if target is not None:
        labels[LABEL_TARGET] = target
    return labels


def _claim_template(name: str, namespace: str, labels: dict[str, str], request: str, device_class: str,
                    parameters: JSONDict, selector: str = "") -> JSONDict:
    exactly: JSONDict = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": RESOURCE_API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "finalizers": [FINALIZER], "labels": labels},
        "spec": {"spec": {"devices": {
            "requests": [{"name": request, "exactly": exactly}],
            "config": [{"requests": [request], "opaque": {"driver": COMPUTE_DOMAIN_DRIVER.driver_name,
                                                          "parameters": parameters}}],
        }}},
    }


def daemon_claim_template(cd: ComputeDomain, settings: ControllerSettings) -> JSONDict:
    """The ``resource.k8s.io/v1`` ResourceClaimTemplate ``computedomain-daemon-<cdUID>`` (driver namespace) each
    daemon pod claims its ``daemon`` device through."""
    params = {"apiVersion": API_GROUP_VERSION, "kind": "ComputeDomainDaemonConfig", "domainID": cd.uid}
    return _claim_template(daemon_object_name(cd.uid), settings.namespace, _labels(cd, TARGET_DAEMON), "daemon",
                           DAEMON_DEVICE_CLASS, params)


def workload_claim_template(cd: ComputeDomain, settings: ControllerSettings, channel: int | None = None) -> JSONDict:
    """The ResourceClaimTemplate ``spec.channel.resourceClaimTemplate.name`` in the domain's namespace that
    workload pods name to get the domain's IMEX channel(s).

    :param channel: ``IMEX_ISOLATION=channel``: the domain's channel ID; the request then uses
        ``compute-domain-channel.nvidia.com`` and selects ``device.attributes['compute-domain.nvidia.com'].id ==
        <channel>``.
    :raises ValueError: channel isolation without a channel, or a channel in domain isolation.
    """
    mode = ALLOCATION_SINGLE if not settings.domain_daemons else cd.allocation_mode
    params = {"apiVersion": API_GROUP_VERSION, "kind": "ComputeDomainChannelConfig", "domainID": cd.uid,
              "allocationMode": mode}
    if settings.channel_isolation != (channel is not None):
        raise ValueError(f"ComputeDomain {cd.namespace}/{cd.name}: IMEX isolation {settings.imex_isolation!r} "
                         f"{'needs' if channel is None else 'takes no'} channel ID for its workload template")
    if channel is None:
        return _claim_template(cd.template_name, cd.namespace, _labels(cd, TARGET_WORKLOAD), "channel",
                               CHANNEL_DEVICE_CLASS, params)
    driver = COMPUTE_DOMAIN_DRIVER.driver_name
    return _claim_template(cd.template_name, cd.namespace, _labels(cd, TARGET_WORKLOAD), "channel",
                           ISOLATED_CHANNEL_DEVICE_CLASS, params,
                           f"device.attributes['{driver}'].id == {int(channel)}")


def _field_env(name: str, path: str) -> JSONDict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _probe(period_s: int, failures: int) -> JSONDict:
    return {"exec": {"command": ["compute-domain-daemon", "check"]}, "periodSeconds": period_s,
            "failureThreshold": failures, "timeoutSeconds": _PROBE_TIMEOUT_S}


def daemon_set(cd: ComputeDomain, settings: ControllerSettings) -> JSONDict:
    """The ``apps/v1`` DaemonSet ``computedomain-daemon-<cdUID>`` of the domain's IMEX daemons (module
    docstring for every field's source).

    :raises ValueError: host-managed IMEX mode (it has no DaemonSet) or no image.
    """
    if settings.host_managed:
        raise ValueError("host-managed IMEX mode runs no IMEX daemon DaemonSet")
    if not settings.image:
        raise ValueError("the daemon image (--image-name / IMAGE_NAME) is required")
    name = daemon_object_name(cd.uid)
    selector = {LABEL_COMPUTE_DOMAIN: cd.uid}
    env = [
        {"name": "LOG_VERBOSITY", "value": str(settings.log_verbosity)},
        {"name": "MAX_NODES_PER_IMEX_DOMAIN", "value": str(settings.max_nodes_per_imex_domain)},
        _field_env("NODE_NAME", "spec.nodeName"),
        _field_env("POD_IP", "status.podIP"),
        _field_env("POD_UID", "metadata.uid"),
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
        {"name": "FEATURE_GATES", "value": render_all_gates(settings.feature_gates)},
    ]
    pod_spec: JSONDict = {
        "nodeSelector": dict(selector),
        "serviceAccountName": DAEMON_SERVICE_ACCOUNT,
        "containers": [{
            "name": DAEMON_CONTAINER,
            "image": settings.image,
            "command": ["compute-domain-daemon", "-v", "$(LOG_VERBOSITY)", "run"],
            "env": env,
            "resources": {"claims": [{"name": DAEMON_CLAIM_NAME}]},
            "startupProbe": _probe(1, 1200),
            "livenessProbe": _probe(60, 20),
            "readinessProbe": _probe(10, 1),
        }],
        "tolerations": [{"operator": "Exists", "effect": effect}
                        for effect in ("NoSchedule", "NoExecute", "PreferNoSchedule")],
        "resourceClaims": [{"name": DAEMON_CLAIM_NAME, "resourceClaimTemplateName": name}],
    }
    if settings.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in settings.pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": settings.namespace, "finalizers": [FINALIZER],
                     "labels": dict(selector)},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "template": {"metadata": {"labels": dict(selector)}, "spec": pod_spec},
        },
    }


def clique_domain(clique_id: str, settings: ControllerSettings) -> ComputeDomain:
    """Pre-warmed mode: clique ``clique_id``'s IMEX domain in the shape of a ComputeDomain (UID
    :func:`~dradriver.domain.computedomains.clique_domain_uid`, in the driver namespace), so the per-domain
    daemon objects, the daemon claim, the membership records and the daemon itself serve it unchanged."""
    uid = clique_domain_uid(clique_id)
    return ComputeDomain(name=clique_domain_name(clique_id), namespace=settings.namespace, uid=uid,
                         template_name=daemon_object_name(uid))


def clique_daemon_set(clique_id: str, settings: ControllerSettings) -> JSONDict:
    """Pre-warmed mode: the DaemonSet ``computedomain-daemon-<clique domain ID>`` of clique ``clique_id``'s IMEX
    daemons: :func:`daemon_set` of :func:`clique_domain`, on every node labelled ``nvidia.com/gpu.clique=
    <clique_id>`` (the compute-domain plugin sets the label with ``--gpu-clique-label-enabled``) rather than on
    nodes labelled for one domain; the object also carries ``resource.nvidia.com/computeDomain.cliqueID`` and
    :data:`ANNOTATION_TEMPLATE_HASH` (16 hex digits of the SHA-256 of the pod template's canonical JSON).

    :raises ValueError: not pre-warmed mode, or no image.
    """
    if not settings.pre_warmed:
        raise ValueError("clique DaemonSets exist only in the pre-warmed IMEX mode (--imex-mode preWarmed)")
    ds = daemon_set(clique_domain(clique_id, settings), settings)
    ds["spec"]["template"]["spec"]["nodeSelector"] = {NODE_CLIQUE_LABEL: clique_id}
    ds["metadata"]["labels"][LABEL_CLIQUE_ID] = clique_id
    canonical = json.dumps(ds["spec"]["template"], sort_keys=True, separators=(",", ":")).encode()
    ds["metadata"]["annotations"] = {ANNOTATION_TEMPLATE_HASH: hashlib.sha256(canonical).hexdigest()[:16]}
    return ds


def owner_of(obj: Mapping[str, Any]) -> str:
    """The CD UID an object made by the controller belongs to (its ``resource.nvidia.com/computeDomain``
    label), ``""`` for any other object."""
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_COMPUTE_DOMAIN) or "")

