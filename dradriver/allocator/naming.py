"""Names the Kubernetes control plane generates: ``metadata.generateName`` suffixes, controller name bases.

Facts (Kubernetes sources, reference for the simulator):

* ``generateName`` (``apiserver/pkg/storage/names``, ``SimpleNameGenerator``): the API server appends five
  random characters from ``bcdfghjklmnpqrstvwxz2456789`` (``utilrand.String``), first cutting the base to
  58 characters so the name stays within 63.
* the ResourceClaim controller (``pkg/controller/resourceclaim``) creates a Pod's claim from
  ``resourceClaimTemplateName`` with ``generateName: <pod>-<pod claim name>-``; when that base is longer than
  57 characters both parts are cut in proportion to their length and joined by one hyphen (no trailing one).
* the Deployment controller names its ReplicaSet ``<deployment>-<pod-template-hash>``, the hash being the
  FNV-32a hash of the pod template written with ``rand.SafeEncodeString`` (each decimal digit mapped onto the
  same alphabet).

The simulator cannot know the API server's random characters, so :func:`suffix` derives them from a seed
(the object the name is generated for): the same input always gets the same names, with the real length and
alphabet. The pod-template hash is computed over the template's JSON, not over Go's object dump as the
Deployment controller does, so its value differs from a real cluster's (its form does not).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

ALPHANUMS = "bcdfghjklmnpqrstvwxz2456789"
"""``k8s.io/apimachinery/pkg/util/rand`` alphabet (no vowels, no confusable digits)."""

RANDOM_LENGTH = 5
MAX_NAME_LENGTH = 63
MAX_GENERATED_BASE = MAX_NAME_LENGTH - RANDOM_LENGTH
CLAIM_BASE_LIMIT = 57
"""ResourceClaim controller: longest ``<pod>-<claim>-`` base before both parts are cut."""


def suffix(seed: str, length: int = RANDOM_LENGTH) -> str:
    """``length`` characters of :data:`ALPHANUMS`, fixed by ``seed`` (stand-in for the random suffix)."""
    digest = hashlib.sha256(seed.encode()).digest()
    return "".join(ALPHANUMS[b % len(ALPHANUMS)] for b in digest[:length])


def generated_name(base: str, seed: str) -> str:
    """What the API server makes of ``metadata.generateName: base`` (base cut to 58, five characters added)."""
    return base[:MAX_GENERATED_BASE] + suffix(seed)


def claim_generate_name(pod_name: str, pod_claim_name: str) -> str:
    """The ``generateName`` the ResourceClaim controller uses for a Pod's template claim."""
    base = f"{pod_name}-{pod_claim_name}-"
    if len(base) <= CLAIM_BASE_LIMIT:
        return base
    total = len(base)
    return pod_name[: len(pod_name) * CLAIM_BASE_LIMIT // total] + "-" + pod_claim_name[
        : len(pod_claim_name) * CLAIM_BASE_LIMIT // total
    ]


def template_claim_name(namespace: str, pod_name: str, pod_claim_name: str) -> str:
    """Name of the claim generated for ``pod_name``'s ``resourceClaims[pod_claim_name]`` from a template."""
    return generated_name(claim_generate_name(pod_name, pod_claim_name), f"{namespace}/{pod_name}/{pod_claim_name}")


def safe_encode(text: str) -> str:
    """``rand.SafeEncodeString``: each byte mapped onto :data:`ALPHANUMS`."""
    return "".join(ALPHANUMS[b % len(ALPHANUMS)] for b in text.encode())


def fnv32a(data: bytes) -> int:
    """The 32-bit FNV-1a hash."""
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def pod_template_hash(template: Any) -> str:
    """The ``pod-template-hash`` label form for ``template`` (see the module docstring for how it differs)."""
    return safe_encode(str(fnv32a(json.dumps(template, sort_keys=True, default=str).encode())))
