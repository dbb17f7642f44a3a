"""ComputeDomains become what the compute-domain controller creates for them, so the simulator allocates a domain's
workload as a cluster would and ``explain`` answers "why is my job's pod pending" for domains too.

For each ``resource.nvidia.com/v1beta1`` ``ComputeDomain`` the controller (driver-managed IMEX, domain isolation:
NVIDIA's defaults) creates, by the same pure functions the running controller calls
(:mod:`dradriver.domain.cdtemplates`):

* the workload ResourceClaimTemplate ``spec.channel.resourceClaimTemplate.name`` in the domain's namespace: one
  request ``channel`` of DeviceClass ``compute-domain-default-channel.nvidia.com`` (the node's ``channel-0``) with
  a ``ComputeDomainChannelConfig``. Each Pod naming it gets its own claim, as from any template; since a node
  publishes one ``channel-0``, a domain's Pods land on different nodes (NVIDIA's one-domain-per-node rule);
* the daemon ResourceClaimTemplate ``computedomain-daemon-<cdUID>`` in the driver namespace, whose claim each
  IMEX daemon Pod of the domain's DaemonSet holds (request ``daemon``, the node's ``daemon-0``). The DaemonSet runs
  a daemon Pod on every node where a workload Pod runs, so each workload Pod's claims are allocated together with
  a daemon claim on the same node (named as the daemon Pod's would be: ``<daemon pod>-compute-domain-daemon-
  <5 characters>``). A node whose ``daemon-0`` another domain's daemon holds cannot take the Pod, and ``explain``
  says so.

A ComputeDomain without a UID (a manifest, not a dump) gets a stable stand-in. A template of the same name already
in the input (a dump of a cluster where the controller made it) is used as given. The nodes' compute-domain
ResourceSlices come from the input (``dradriver inspect --driver compute-domain.nvidia.com``, or a dump).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dradriver.allocator.conversion import as_mapping
from dradriver.allocator.naming import generated_name, template_claim_name
from dradriver.allocator.resources import InputError
from dradriver.allocator.workloads import pod_uid
from dradriver.domain.cdtemplates import (
    DAEMON_CLAIM_NAME,
    TARGET_DAEMON,
    TARGET_WORKLOAD,
    ControllerSettings,
    daemon_claim_template,
    workload_claim_template,
)
from dradriver.domain.computedomains import (
    API_GROUP,
    COMPUTE_DOMAIN_KIND,
    LABEL_COMPUTE_DOMAIN,
    LABEL_TARGET,
    ComputeDomain,
    ComputeDomainError,
    daemon_object_name,
)

DEFAULT_SETTINGS = ControllerSettings()
"""NVIDIA's defaults: driver-managed IMEX, domain isolation, driver namespace ``default`` (the controller's
``--namespace`` default)."""


@dataclass
class DomainTemplates:
    """What the controller makes of the input's ComputeDomains.

    :param workload: the workload ResourceClaimTemplates (the Pods' templates), in input order.
    :param daemon: domain UID -> its daemon ResourceClaimTemplate (claimed by the domain's daemon Pods only).
    :param domains: domain UID -> ``namespace/name`` of the ComputeDomain (for messages).
    :param notes: one line per domain, for ``explain``.
    """

    workload: list[dict[str, Any]] = field(default_factory=list)
    daemon: dict[str, dict[str, Any]] = field(default_factory=dict)
    domains: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def is_compute_domain(obj: Mapping[str, Any]) -> bool:
    """Whether ``obj`` is a ``resource.nvidia.com`` ComputeDomain (any version)."""
    return obj.get("kind") == COMPUTE_DOMAIN_KIND and str(obj.get("apiVersion", "")).split("/")[0] == API_GROUP


def read_domain(obj: Mapping[str, Any], templates: DomainTemplates,
                settings: ControllerSettings = DEFAULT_SETTINGS) -> None:
    """Add the templates the controller creates for the ComputeDomain ``obj`` (module docstring) to ``templates``.

    :raises InputError: ``spec.channel.resourceClaimTemplate.name`` is missing (the object and field named).
    """
    meta = dict(as_mapping(obj.get("metadata")))
    namespace = str(meta.get("namespace") or "default")
    name = str(meta.get("name") or "<unnamed>")
    meta.update(namespace=namespace, uid=str(meta.get("uid") or pod_uid(namespace, f"{COMPUTE_DOMAIN_KIND}/{name}")))
    try:
        domain = ComputeDomain.from_object({**obj, "metadata": meta})
    except ComputeDomainError as exc:
        raise InputError(str(exc)) from None
    workload = workload_claim_template(domain, settings)
    templates.workload.append(workload)
    templates.domains[domain.uid] = f"{namespace}/{name}"
    daemon = "" if settings.host_managed else daemon_object_name(domain.uid)
    if daemon:
        templates.daemon[domain.uid] = daemon_claim_template(domain, settings)
    templates.notes.append(
        f"ComputeDomain {namespace}/{name}: ResourceClaimTemplate {namespace}/{domain.template_name} (one IMEX "
        f"channel per Pod, allocationMode {domain.allocation_mode})"
        + (f"; each Pod's node also runs an IMEX daemon Pod claiming a daemon device (template "
           f"{settings.namespace}/{daemon})" if daemon else ""))


def domain_of(template: Mapping[str, Any]) -> str | None:
    """The UID of the ComputeDomain whose workload template ``template`` is (its labels), else ``None``."""
    labels = as_mapping(as_mapping(template.get("metadata")).get("labels"))
    if labels.get(LABEL_TARGET) != TARGET_WORKLOAD:
        return None
    uid = labels.get(LABEL_COMPUTE_DOMAIN)
    return str(uid) if uid else None


def is_daemon_template(template: Mapping[str, Any]) -> bool:
    """Whether ``template`` is a domain's daemon template (its claims belong to daemon Pods, never alone)."""
    labels = as_mapping(as_mapping(template.get("metadata")).get("labels"))
    return labels.get(LABEL_TARGET) == TARGET_DAEMON


def daemon_domain(template: Mapping[str, Any]) -> str | None:
    """The UID of the ComputeDomain whose daemon template ``template`` is (its labels), else ``None``."""
    labels = as_mapping(as_mapping(template.get("metadata")).get("labels"))
    uid = labels.get(LABEL_COMPUTE_DOMAIN)
    return str(uid) if is_daemon_template(template) and uid else None


def daemon_claim(template: Mapping[str, Any], domain: str, pod_ref: str) -> tuple[str, str, str]:
    """``(namespace, claim name, origin)`` of the daemon claim of the IMEX daemon Pod that runs beside the workload
    Pod ``pod_ref`` (``namespace/name``): the DaemonSet's Pod ``computedomain-daemon-<cdUID>-<5 characters>`` and
    its claim named by the ResourceClaim controller's rule."""
    meta = as_mapping(template.get("metadata"))
    namespace = str(meta.get("namespace") or "default")
    daemon_pod = generated_name(f"{meta.get('name')}-", f"{pod_ref}/{DAEMON_CLAIM_NAME}")
    name = template_claim_name(namespace, daemon_pod, DAEMON_CLAIM_NAME)
    return namespace, name, (f"from template {meta.get('name')} for IMEX daemon pod {daemon_pod} of ComputeDomain "
                             f"{domain}, on the node of pod {pod_ref}")
