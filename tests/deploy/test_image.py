"""``deploy/container/Dockerfile``: what NVIDIA's chart needs of it, and ``docker build`` where an engine answers.

The static checks run everywhere: the image carries the executables and paths NVIDIA's chart runs
(``nvidia-image-contract.md``) and its ``nvidia-chart`` target runs as root. This machine kind ships the docker
client but no engine; the build test then skips and says so. Where an engine runs (a developer's workstation, a
CI runner with Docker), it builds both targets and runs ``dradriver --help`` (non-root default user) and the
chart's executables (``nvidia-chart``, uid 0).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = "dradriver:test"
CHART_TAG = "dradriver:test-nvidia-chart"
DOCKERFILE = REPO / "deploy" / "container" / "Dockerfile"


#: The executables NVIDIA's chart (and the DaemonSet of dradriver's compute-domain controller) run by name.
CHART_EXECUTABLES = ("gpu-kubelet-plugin", "compute-domain-kubelet-plugin", "compute-domain-controller",
                     "compute-domain-daemon", "webhook")


def test_every_executable_the_chart_runs_is_a_console_script() -> None:
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    missing = [name for name in CHART_EXECUTABLES if name not in scripts]
    assert not missing, f"pyproject.toml [project.scripts] lacks {missing}"


def _stages() -> dict[str, str]:
    """Stage name (``""`` for the last, unnamed one) -> its instructions."""
    out: dict[str, str] = {}
    parts = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.MULTILINE)[1:]
    for index, part in enumerate(parts):
        header = part.splitlines()[0]
        name = header.split(" AS ")[1].strip() if " AS " in header else ("" if index == len(parts) - 1 else header)
        out[name] = "FROM " + part
    return out


def test_image_carries_what_nvidias_chart_runs() -> None:
    stages = _stages()
    runtime = stages["runtime"]
    assert "COPY --chmod=0755 deploy/container/kubelet-plugin-prestart.sh /usr/bin/kubelet-plugin-prestart.sh" \
        in runtime
    # The build runs each executable the chart runs and the tools of the chart's bash -c script (cp, sed, mount).
    for executable in CHART_EXECUTABLES:
        assert f"{executable} --version" in runtime, f"the image build does not check {executable}"
    assert "command -v bash cp sed mount" in runtime
    assert "RUN bash -n /usr/bin/kubelet-plugin-prestart.sh" in runtime
    assert stages["nvidia-chart"].splitlines()[0] == "FROM runtime AS nvidia-chart"
    assert "USER 0:0" in stages["nvidia-chart"]
    # The default target stays the non-root image.
    assert stages[""].strip() == "FROM runtime" and "USER 65532:65532" in runtime
    # The script is in the build context although deploy/ is not (.dockerignore re-includes it).
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    assert "deploy" in lines and "!deploy/container/kubelet-plugin-prestart.sh" in lines
    assert lines.index("!deploy/container/kubelet-plugin-prestart.sh") > lines.index("deploy")


def test_image_ships_nvidias_cdi_hook_from_the_container_toolkit_image() -> None:
    """As NVIDIA's image: ``nvidia-cdi-hook`` copied from a pinned NVIDIA container-toolkit image to the path the
    plugin copies it from (``PluginConfig.image_cdi_hook``), with its provenance and licence in the image."""
    from dradriver.config import PluginConfig

    text = DOCKERFILE.read_text()
    preamble = text.split("\nFROM ")[0]
    [image] = re.findall(r"^ARG TOOLKIT_CONTAINER_IMAGE=(\S+)$", preamble, flags=re.MULTILINE)
    assert re.fullmatch(r"nvcr\.io/nvidia/k8s/container-toolkit:v\d+\.\d+\.\d+(@sha256:[0-9a-f]{64})?", image), image
    stages = _stages()
    assert stages["toolkit"].splitlines()[0] == "FROM ${TOOLKIT_CONTAINER_IMAGE} AS toolkit"
    hook = str(PluginConfig(node_name="n").image_cdi_hook)
    assert f"COPY --from=toolkit --chmod=0755 /artifacts/rpm/usr/bin/nvidia-cdi-hook {hook}\n" in stages["runtime"]
    assert "RUN nvidia-cdi-hook --help" in stages["runtime"]
    # Provenance and licence: in the Dockerfile, in the image (a notice in the build context) and in the docs.
    assert "Apache License 2.0" in preamble and "github.com/NVIDIA/nvidia-container-toolkit" in preamble
    notice = REPO / "deploy" / "container" / "licenses" / "nvidia-cdi-hook.NOTICE"
    assert f"COPY {notice.relative_to(REPO)} /usr/share/doc/nvidia-cdi-hook/NOTICE" in stages["runtime"]
    assert "Apache License, Version 2.0" in notice.read_text() and "container-toolkit" in notice.read_text()
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    assert lines.index(f"!{notice.relative_to(REPO)}") > lines.index("deploy")
    page = (REPO / "docs" / "install" / "nvidia-chart.md").read_text()
    assert "nvcr.io/nvidia/k8s/container-toolkit" in page and "Apache-2.0" in page


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
    subprocess.run(
        ["docker", "build", "-f", "deploy/container/Dockerfile", "--target", "nvidia-chart", "-t", CHART_TAG, "."],
        cwd=REPO, check=True, timeout=1800,
    )
    chart = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "bash", CHART_TAG, "-c",
         "id -u && " + " && ".join(f"{e} --version" for e in CHART_EXECUTABLES) + " && test -x "
         "/usr/bin/kubelet-plugin-prestart.sh && bash -n /usr/bin/kubelet-plugin-prestart.sh && "
         "test -x /usr/bin/nvidia-cdi-hook && "
         "command -v cp sed mount"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    assert chart.stdout.splitlines()[0] == "0"
    for executable in CHART_EXECUTABLES:
        assert f"{executable} (dradriver " in chart.stdout, chart.stdout
