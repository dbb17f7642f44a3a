"""The demo's bundled manifests are byte-for-byte the ones deploy/ ships."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "dradriver" / "sandbox" / "manifests"


@pytest.mark.parametrize(
    "original",
    [
        "deploy/kustomize/base/deviceclasses.yaml",
        "deploy/kustomize/base/crds/resource.nvidia.com_computedomains.yaml",
        "deploy/kustomize/base/crds/resource.nvidia.com_computedomaincliques.yaml",
        "deploy/examples/gpu-40gi.yaml",
        "deploy/examples/shared-claim.yaml",
        "deploy/examples/device-plugin-pod.yaml",
    ],
)
def test_bundled_copy_matches_deploy(original: str) -> None:
    source = ROOT / original
    copy = BUNDLED / source.name
    assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from {source}: copy it again"
