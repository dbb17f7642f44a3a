"""The documentation site: it builds strictly, its generated reference follows the code, its examples work, and
the README stays the short front door into it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dradriver.cli import build_parser
from dradriver.domain import configs
from dradriver.domain.computedomains import parse_channel_config, parse_daemon_config
from dradriver.domain.featuregates import GATES, FeatureGates
from tools import docsite

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CHECKED = re.compile(r"<!-- checked: ([a-z]+)(?: (\S+))? -->\n```yaml\n(.*?)```", re.DOTALL)
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner on stderr


def _checked_examples(kind: str) -> list[tuple[str, str | None, str]]:
    """(page, argument, YAML) of every example on the site marked ``<!-- checked: KIND ... -->``."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for match in CHECKED.finditer(page.read_text()):
            if match.group(1) == kind:
                found.append((str(page.relative_to(DOCS)), match.group(2), match.group(3)))
    return found


def test_site_builds_strictly_offline(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link or anchor, a page missing from the nav, a generated block the
    code cannot render, or any other warning fails."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    commands = (tmp_path / "site" / "reference" / "commands" / "index.html").read_text()
    assert "--feature-gates" in commands and "compute-domain-daemon check" in commands
    assert "&lt;dir&gt;/gpu.nvidia.com" in commands and "DCGM_FI_* names" in commands  # help shown as written
    assert "<!-- generated:" not in (tmp_path / "site" / "user-guide" / "selecting-gpus" / "index.html").read_text()


def test_command_reference_covers_every_subcommand_and_option() -> None:
    reference = docsite.command_reference()
    walked = list(docsite._walk(build_parser(), "dradriver"))
    expected = {"dradriver feature-gates", "dradriver compute-domain-daemon run", "dradriver demo"}
    assert expected <= {command for command, _ in walked}
    for command, parser in walked:
        assert f"`{command}`\n" in reference, command
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help") and action.help != "==SUPPRESS==":
                    assert f"`{option}`" in reference, f"{command} {option}"


def test_environment_reference_lists_every_twin_and_fails_on_an_undescribed_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reference = docsite.environment_reference()
    for name in ("NODE_NAME", "FEATURE_GATES", "ADDITIONAL_XIDs_TO_IGNORE", "IMEX_ISOLATION", "LOG_VERBOSITY",
                 "DRADRIVER_NO_EXTENSIONS", "DRADRIVER_POD_RESOURCES_SOCKET"):
        assert f"| `{name}` |" in reference, name
    monkeypatch.delitem(docsite.OTHER_VARIABLES, "DRADRIVER_NO_EXTENSIONS")
    with pytest.raises(ValueError, match="describe DRADRIVER_NO_EXTENSIONS"):
        docsite.environment_reference()


def test_feature_gate_reference_lists_every_gate() -> None:
    reference = docsite.feature_gate_reference()
    assert all(f"| `{gate.name}` |" in reference for gate in GATES)


def test_an_unknown_generated_block_fails_the_build() -> None:
    with pytest.raises(ValueError, match="unknown generated block 'comands'"):
        docsite.render("# Page\n\n<!-- generated: comands -->\n")


def test_attribute_reference_shows_every_device_kind() -> None:
    reference = docsite.attribute_reference()
    for heading in ("`type=gpu`: attributes", "`type=gpu`: capacity", "`type=mig`: attributes", "`type=mig`: capacity",
                    "`type=channel`: attributes", "`type=daemon`: attributes"):
        assert heading in reference, heading
    assert "| `profile` | string |" in reference and "| `memory` | quantity |" in reference


def test_attribute_reference_shows_the_shares_capacity_of_consumable_shares() -> None:
    """``--consumable-shares N`` publishes a ``shares`` capacity of N on every GPU: the table has its row, with the
    value of the variant that publishes it."""
    reference = docsite.attribute_reference()
    gpu_capacity = reference.split("### `type=gpu`: capacity")[1].split("###")[0]
    header, _, *rows = [[cell.strip() for cell in line.strip("|").split("|")]
                        for line in gpu_capacity.strip().splitlines()]
    shares = next(row for row in rows if row[:2] == ["`shares`", "quantity"])
    assert shares[header.index("`dgx-h100 --consumable-shares 4`")] == "`4`"


def test_claim_examples_on_the_site_allocate(tmp_path: Path) -> None:
    """Every claim marked ``checked: allocate PROFILE`` allocates on the slices of that mock profile."""
    examples = _checked_examples("allocate")
    assert len(examples) >= 5
    slices: dict[str, Path] = {}
    for index, (page, profile, text) in enumerate(examples):
        assert profile, page
        if profile not in slices:
            slices[profile] = tmp_path / f"{profile}.yaml"
            proc = subprocess.run([sys.executable, "-m", "dradriver", "inspect", "--mock-profile", profile,
                                   "--node-name", "node-a"], env=_environment(), capture_output=True, text=True,
                                  timeout=60, check=True)
            slices[profile].write_text(proc.stdout)
        claim = tmp_path / f"claim-{index}.yaml"
        claim.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "dradriver", "allocate", str(slices[profile]),
                               str(REPO / "deploy" / "kustomize" / "base" / "deviceclasses.yaml"), str(claim)],
                              env=_environment(), capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, f"{page} example {index}: {proc.stderr}"


def test_opaque_config_examples_decode_and_validate() -> None:
    gates = FeatureGates({"TimeSlicingSettings": True, "MPSSupport": True, "PassthroughSupport": True})
    device_examples = _checked_examples("config")
    assert {yaml.safe_load(text)["kind"] for _, _, text in device_examples} == set(configs.SUPPORTED_KINDS)
    for page, _, text in device_examples:
        configs.validate(configs.normalize(configs.decode(yaml.safe_load(text), where=page), gates), gates, where=page)
    channels, daemons = _checked_examples("channel"), _checked_examples("daemon")
    assert channels and daemons
    assert all(parse_channel_config(yaml.safe_load(text)).allocation_mode == "All" for _, _, text in channels)
    assert all(parse_daemon_config(yaml.safe_load(text)).domain_id for _, _, text in daemons)


def test_readme_is_the_short_front_door() -> None:
    """Under 150 lines, the three commands ``.ci/run`` runs exactly as written, and every link into the site
    names a page that exists."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    for command in ("python -m pip install -e '.[test]'", "python -m pytest", "dradriver demo"):
        assert f"`{command}`" in readme, command
    links = [link.split("#")[0] for link in MARKDOWN_LINK.findall(readme) if link.startswith("docs/")]
    assert len(links) >= 8
    assert [link for link in links if not (REPO / link).is_file()] == []


def test_bench_readme_says_how_to_run_and_the_site_has_the_figures() -> None:
    """``bench/README.md`` is how to run each scenario and against what, not a dated log; the figures of every
    scenario with a ratio target are on ``docs/benchmarks.md``, in its own table (history stays in git)."""
    sys.path.insert(0, str(REPO))
    from bench.targets import RATIOS

    readme = (REPO / "bench" / "README.md").read_text()
    page = (DOCS / "benchmarks.md").read_text()
    assert len(readme.splitlines()) < 120 and "Re-measured" not in readme and "../docs/benchmarks.md" in readme
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "dated measurements belong in git history"
    latest = page.split("## Latest measurement per scenario")[1].split("\n## ")[0]
    for scenario in {ratio.scenario for ratio in RATIOS}:
        assert f"`{scenario}`" in readme, scenario
        assert re.search(rf"^### .*`{scenario}`", latest, re.MULTILINE), scenario


PRODUCT = ("dradriver", "deploy", "bench", "ext", "protos", "tools", "docs", "README.md", "mkdocs.yml")
"""What ships or documents the product: none of it may know the private folder beside the checkout."""
PRIVATE = re.compile(r"\.\./shared|shared/(?:reference|peers)|[\"']shared[\"']\s*/\s*[\"']peers"
                     r"|nvidia-dra-driver(?:-updates)?\.md|nvidia-dra-driver-updates\W+\d"
                     r"|\b(?:gpu-facts|kubelet-dra-protocol|style-anchors|nvidia-image-contract)\b|\bcdi\.md\b")
"""The private folder (``../shared``, its ``reference/`` and ``peers/``, a path built as ``"shared" / "peers"``) and
the private notes by file name."""


def _product_files() -> list[Path]:
    roots = [REPO / name for name in PRODUCT]
    files = [p for root in roots for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()]
    return [p for p in files if p.suffix not in (".so", ".pyc", ".o") and "__pycache__" not in p.parts
            and not p.read_text(errors="replace").startswith("/* Generated by Cython")]  # build output of ext/


def test_no_product_file_cites_the_private_reference_folder() -> None:
    """Facts are cited by their public source (NVIDIA's repository, issues, KEPs, the CDI spec, ``nvml.h``), never by
    ``../shared`` or a private note's name, and the product finds NVIDIA's peer binaries only through
    ``DRADRIVER_NVIDIA_PEERS``, never by a path beside the checkout."""
    cited = [f"{p.relative_to(REPO)}: {match.group(0)}" for p in _product_files()
             for match in [PRIVATE.search(p.read_text(errors="replace"))] if match]
    assert cited == []


DOCS_PAGE = re.compile(r"(?<![\w/.-])(?:\.\./)*(docs/[\w/.-]+\.md)\b")
"""A page of the site named by its path from the repository root (``docs/operations/metrics.md``), also relative
(``../../docs/install/nvidia-chart.md``); a path inside a URL is not one."""


def test_every_docs_page_the_product_names_exists() -> None:
    """Docstrings, error messages, manifests and the benchmarks point at pages that exist: a page that moved
    (``docs/metrics.md`` is now ``docs/operations/metrics.md``) fails until every pointer follows it."""
    named = [f"{p.relative_to(REPO)}: {page}" for p in _product_files() if DOCS not in p.parents
             for page in DOCS_PAGE.findall(p.read_text(errors="replace")) if not (REPO / page).is_file()]
    assert named == []
    assert DOCS_PAGE.findall("see docs/metrics.md, ../../docs/install/kustomize.md") == [
        "docs/metrics.md", "docs/install/kustomize.md"]
    assert DOCS_PAGE.findall("https://example.com/docs/page.md") == []


def test_the_private_folder_guard_sees_each_form_of_citation() -> None:
    for text in ("see ../shared/reference/cdi.md", "PEERS = REPO.parent / \"shared\" / \"peers\"",
                 "(``nvidia-dra-driver.md`` 4.4)", "nvidia-dra-driver-updates 2c", "(gpu-facts 3.1)",
                 "kubelet-dra-protocol.md section 4", "reference: style-anchors.md", "nvidia-image-contract.md"):
        assert PRIVATE.search(text), text
    for text in ("--namespace nvidia-dra-driver-gpu", 'DRIVER_NAMESPACE = "nvidia-dra-driver"',
                 "kubernetes-sigs/dra-driver-nvidia-gpu cmd/gpu-kubelet-plugin/checkpoint.go"):
        assert not PRIVATE.search(text), text
