"""KEP-5304 device metadata: the ``DeviceMetadata`` documents a container reads to learn the attributes of the
devices it was given, their in-container paths, and what each prepared device adds to them (pure).

The protocol (Kubernetes docs, "Dynamic Resource Allocation", section "DRA device metadata in containers", beta in
1.37; KEP-5304 ``keps/sig-node/5304-dra-attributes-downward-api``; the Go types in
``k8s.io/dynamic-resource-allocation/api/metadata``):

* **path**: inside the container, ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claimName>/
  <requestName>/<driverName>-metadata.json`` for a claim the pod names directly, or
  ``.../resourceclaimtemplates/<podClaimName>/<requestName>/<driverName>-metadata.json`` for a claim made from a
  ResourceClaimTemplate (``podClaimName`` is ``pod.spec.resourceClaims[].name``, which the claim carries in its
  ``resource.kubernetes.io/pod-claim-name`` annotation). ``<requestName>`` is the top-level request (a prioritized
  list's ``/<subrequest>`` dropped); the file's ``requests[].name`` keeps the full ``<request>/<subrequest>``.
* **format**: a stream of ``DeviceMetadata`` objects, the same metadata once per API version, newest first
  (``metadata.resource.k8s.io/v1beta1``, required, then ``v1alpha1`` for older readers); a reader takes the first
  version it knows. Each object: ``metadata`` (the claim's ``name``, ``namespace``, ``uid``, ``generation``),
  ``podClaimName`` (template claims only), ``requests[]`` of ``{name, devices[]}``, each device ``{driver, pool,
  name, attributes}`` with attribute values in the ResourceSlice's typed form (``{"string": ...}``,
  ``{"int": ...}``, ``{"version": ...}``, ``{"bool": ...}``). Capacity is not part of the format.
* **generation** starts at 1 when the file is written at prepare, and goes up by one each time the plugin rewrites
  the file with other content while the claim stays prepared (after a driver reload its ``driverVersion`` and
  ``cudaDriverVersion`` change: :meth:`dradriver.host.devicemetadata.DeviceMetadataFiles.rewrite`).
* **exposure**: read-only; dradriver bind-mounts the file through its own per-claim CDI spec (the docs allow any
  mechanism that puts the file read-only at that path).

Attributes: a device's published ResourceSlice attributes (the same entries the plugin publishes, so the file
equals what the scheduler saw), plus what is only known or only useful at run time: ``memory`` (bytes, the
device's ``memory`` capacity, which the format cannot carry as capacity), a MIG device's ``placementStart`` and
``placementSize`` (memory slices), and what a preparer adds for its kind (a dynamic MIG device's ``uuid``, an IMEX
channel's ComputeDomain). At most 32 per device (``DeviceMetadata`` validation); published ones win.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dradriver.domain.claims import AllocationResult, Claim, base_request_name
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.domain.migplacements import MigPlacement

API_VERSIONS: tuple[str, ...] = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")
"""The versions written, newest first (the docs: ``v1beta1`` is required, ``v1alpha1`` optional)."""
KIND = "DeviceMetadata"
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
RESOURCE_CLAIMS_SUBDIR = "resourceclaims"
RESOURCE_CLAIM_TEMPLATES_SUBDIR = "resourceclaimtemplates"
FILE_SUFFIX = "-metadata.json"
MAX_ATTRIBUTES = 32
"""``DeviceMetadata`` ``devices[].attributes``: ``+k8s:maxProperties=32``."""

Attributes = Mapping[str, Mapping[str, Any]]
"""Attribute name -> typed value (``{"string": "..."}`` and so on), as in a ResourceSlice."""


@dataclass(frozen=True, slots=True)
class MetadataDevice:
    """One device of a request: its pool and name and its attributes (typed form)."""

    pool: str
    name: str
    attributes: Attributes = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestMetadata:
    """One metadata file: a request of a claim and the devices this driver gave it.

    :param request: the full request reference (``gpu`` or ``gpu/high-memory``).
    :param devices: in allocation-result order.
    """

    request: str
    devices: tuple[MetadataDevice, ...]

    @property
    def base_request(self) -> str:
        """The top-level request name (the path segment)."""
        return base_request_name(self.request)


def file_name(driver: str) -> str:
    """``<driver>-metadata.json``: the file's name, on the host and in the container."""
    return driver + FILE_SUFFIX


def container_path(claim: Claim, request: str, driver: str) -> str:
    """Where a container finds the metadata file of ``request`` (full or base name) of ``claim`` (module
    docstring)."""
    if claim.pod_claim_name:
        where = f"{RESOURCE_CLAIM_TEMPLATES_SUBDIR}/{claim.pod_claim_name}"
    else:
        where = f"{RESOURCE_CLAIMS_SUBDIR}/{claim.ref.name}"
    return f"{CONTAINER_DIR}/{where}/{base_request_name(request)}/{file_name(driver)}"


def requests_of(results: Sequence[AllocationResult]) -> list[tuple[str, list[str]]]:
    """The claim's requests in result order: (full request reference, device names in result order, each once)."""
    out: dict[str, list[str]] = {}
    for result in results:
        names = out.setdefault(result.request, [])
        if result.device not in names:
            names.append(result.device)
    return list(out.items())


def int_attribute(value: int) -> dict[str, int]:
    """``{"int": value}``."""
    return {"int": int(value)}


def merge_attributes(published: Attributes | None, *extra: Attributes) -> dict[str, dict[str, Any]]:
    """The published attributes first, then each ``extra`` for names not taken, at most :data:`MAX_ATTRIBUTES`."""
    out: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (published or {}).items()}
    for more in extra:
        for key, value in more.items():
            if key not in out and len(out) < MAX_ATTRIBUTES:
                out[key] = dict(value)
    return out


def document(claim: Claim, request: RequestMetadata, driver: str, api_version: str,
             generation: int = 1) -> dict[str, Any]:
    """One ``DeviceMetadata`` object of ``api_version`` for one request (module docstring)."""
    doc: dict[str, Any] = {
        "kind": KIND,
        "apiVersion": api_version,
        "metadata": {"name": claim.ref.name, "namespace": claim.ref.namespace, "uid": claim.ref.uid,
                     "generation": generation},
    }
    if claim.pod_claim_name:
        doc["podClaimName"] = claim.pod_claim_name
    devices: list[dict[str, Any]] = []
    for device in request.devices:
        entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "name": device.name}
        if device.attributes:
            entry["attributes"] = {k: dict(v) for k, v in sorted(device.attributes.items())}
        devices.append(entry)
    doc["requests"] = [{"name": request.request, "devices": devices}]
    return doc


def encode(claim: Claim, request: RequestMetadata, driver: str,
           versions: Sequence[str] = API_VERSIONS, generation: int = 1) -> bytes:
    """The file's bytes: one compact JSON object per line, one per version of ``versions`` in that order."""
    return b"".join(json.dumps(document(claim, request, driver, v, generation), separators=(",", ":")).encode()
                    + b"\n" for v in versions)


class MetadataFormatError(ValueError):
    """A metadata stream that is not a sequence of JSON objects."""


def decode(data: bytes | str) -> list[dict[str, Any]]:
    """Every object of a metadata stream, in order (a reader takes the first whose ``apiVersion`` it knows).

    :raises MetadataFormatError: something other than JSON objects separated by white space.
    """
    text = data.decode() if isinstance(data, bytes) else data
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return out
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise MetadataFormatError(f"device metadata stream: {exc}") from exc
        if not isinstance(obj, dict):
            raise MetadataFormatError(f"device metadata stream: a {type(obj).__name__}, not an object")
        out.append(obj)


def first_known(objects: Iterable[Mapping[str, Any]],
                versions: Sequence[str] = API_VERSIONS) -> Mapping[str, Any] | None:
    """The first object of a stream whose ``apiVersion`` is one of ``versions`` and whose kind is
    ``DeviceMetadata`` (``None``: none)."""
    for obj in objects:
        if obj.get("apiVersion") in versions and obj.get("kind") == KIND:
            return obj
    return None


def published_attributes(slices: Iterable[Mapping[str, Any]]) -> dict[str, Attributes]:
    """Device name -> its attributes in the ResourceSlices a plugin publishes (``spec.devices[].attributes``)."""
    out: dict[str, Attributes] = {}
    for resource_slice in slices:
        for device in (resource_slice.get("spec") or {}).get("devices") or ():
            out[str(device["name"])] = device.get("attributes") or {}
    return out


def runtime_attributes(entry: object) -> dict[str, dict[str, int]]:
    """What a GPU, MIG device or dynamic-MIG placement adds to its published attributes: ``memory`` (bytes) and,
    for a MIG device or placement, ``placementStart`` and ``placementSize`` (memory slices); ``{}`` for others."""
    out: dict[str, dict[str, int]] = {}
    if isinstance(entry, GpuDevice | MigDevice | MigPlacement) and entry.memory_bytes is not None:
        out["memory"] = int_attribute(entry.memory_bytes)
    if isinstance(entry, MigDevice | MigPlacement):
        out["placementStart"] = int_attribute(entry.placement_start)
        out["placementSize"] = int_attribute(entry.placement_size)
    return out


def compute_domain_attributes(record: Mapping[str, Any] | None) -> dict[str, dict[str, str]]:
    """An IMEX channel's or daemon's ComputeDomain from its undo record (``domain`` UID, ``namespace``, ``name``):
    ``computeDomainUID``, ``computeDomainNamespace``, ``computeDomainName`` (the names NVIDIA's daemon gets as
    ``COMPUTE_DOMAIN_UUID``/``_NAMESPACE``/``_NAME``); ``{}`` without a record."""
    if not record or not record.get("domain"):
        return {}
    return {"computeDomainUID": {"string": str(record["domain"])},
            "computeDomainNamespace": {"string": str(record.get("namespace") or "")},
            "computeDomainName": {"string": str(record.get("name") or "")}}


def spec_mounts(spec: Mapping[str, Any]) -> dict[str, list[Mapping[str, Any]]]:
    """The metadata-file mounts of a parsed CDI spec by CDI device name (``"*"``: the spec-level edits, where the
    compute-domain plugin's one-device claim specs carry them); ``{}`` when none."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    places = [("*", spec.get("containerEdits") or {})]
    places += [(str(d.get("name")), d.get("containerEdits") or {}) for d in spec.get("devices") or ()]
    for name, edits in places:
        found = [m for m in edits.get("mounts") or ()
                 if str(m.get("containerPath", "")).startswith(CONTAINER_DIR + "/")]
        if found:
            out[name] = found
    return out
