"""Shared checks for produced ResourceSlices: the official schema (kubernetes-validate) plus the API limits."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate

from dradriver.domain.resourceslices import limit_violations


def newest_schema_version() -> str:
    """Newest Kubernetes version bundled with kubernetes-validate that has ``resource.k8s.io/v1`` slices."""
    root = Path(kubernetes_validate.__file__).resolve().parent / "kubernetes-json-schema"
    versions = []
    for d in root.glob("v*-local-strict"):
        if (d / "resourceslice-resource-v1.json").is_file():
            match = re.match(r"v(\d+)\.(\d+)\.(\d+)-local-strict", d.name)
            if match:
                versions.append(tuple(int(x) for x in match.groups()))
    assert versions, "kubernetes-validate has no resource.k8s.io/v1 schema"
    return ".".join(str(x) for x in max(versions))


SCHEMA_VERSION = newest_schema_version()


def assert_valid_slice(obj: dict[str, Any]) -> None:
    """Validate against the official schema (strict) and the per-slice API limits."""
    kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    assert limit_violations(obj) == []


_BINARY = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}


def quantity_value(text: str) -> int:
    """Integer value of a canonical integer/binary-SI quantity (the only forms the builder emits)."""
    match = re.fullmatch(r"(0|[1-9]\d*)(Ki|Mi|Gi|Ti|Pi|Ei)?", text)
    assert match, f"not a canonical integer quantity: {text!r}"
    return int(match.group(1)) * _BINARY[match.group(2) or ""]
