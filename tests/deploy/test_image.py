"""``docker build`` of ``deploy/container/Dockerfile``, where a container engine answers.

This machine kind ships the docker client but no engine; the test then skips and says so. Where an engine
runs (a developer's workstation, a CI runner with Docker), it builds the image and runs ``dradriver --help``
and the mock-profile listing in it, as the non-root default user.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = "dradriver:test"


def _engine_answers() -> str | None:
    """``None`` if a docker engine answers, else why not."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker client on PATH"
    try:
        proc = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 15 s"
    if proc.returncode != 0 or not proc.stdout.strip():
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "docker info failed"
        return f"no docker engine answers: {last}"
    return None


@pytest.mark.slow
def test_docker_build_and_run() -> None:
    reason = _engine_answers()
    if reason is not None:
        pytest.skip(f"image build not exercised here: {reason}")
    subprocess.run(
        ["docker", "build", "-f", "deploy/container/Dockerfile", "-t", TAG, "."], cwd=REPO, check=True, timeout=1800
    )
    out = subprocess.run(
        ["docker", "run", "--rm", TAG, "--help"], capture_output=True, text=True, check=True, timeout=120
    )
    assert "gpu-kubelet-plugin" in out.stdout
    user = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "id", TAG, "-u"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert user.stdout.strip() == "65532"
