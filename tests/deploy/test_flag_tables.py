"""``deploy/helm/README.md``'s flag tables against the code: for each of NVIDIA's five binaries, every flag (and
alias) and environment variable dradriver's entry point defines appears in that binary's section, and every flag
the section's table names in its first column is one the entry point defines (so the table neither forgets a flag
nor promises one the code lacks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dradriver import config
from dradriver.commands import compute_domain_controller, compute_domain_daemon, webhook

README = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "README.md"
SECTIONS = {
    "gpu-kubelet-plugin": config.PLUGIN_FLAGS,
    "compute-domain-kubelet-plugin": config.COMPUTE_DOMAIN_PLUGIN_FLAGS,
    "compute-domain-controller": compute_domain_controller.FLAGS,
    "compute-domain-daemon": compute_domain_daemon.DAEMON_FLAGS,
    "webhook": webhook.FLAGS,
}
#: argparse's own options, in every table.
BUILTIN = {"--help", "--version"}


def _section(binary: str) -> str:
    """The text of the ``##`` section whose heading ends with ``binary`` (or names NVIDIA's ``binary``)."""
    parts = re.split(r"^## ", README.read_text(), flags=re.MULTILINE)
    found = [p for p in parts if re.search(rf"(^|NVIDIA's ){re.escape(binary)}\b", p.splitlines()[0])]
    assert len(found) == 1, f"deploy/helm/README.md has {len(found)} sections for {binary}"
    return found[0]


def _first_column_flags(text: str) -> set[str]:
    out: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            out |= set(re.findall(r"`(-[-\w]+)`", line.split(" | ")[0]))
    return out


@pytest.mark.parametrize("binary", list(SECTIONS))
def test_the_table_names_every_flag_and_variable_of_the_binary(binary: str) -> None:
    text = _section(binary)
    quoted = set(re.findall(r"`([^`]+)`", text))
    flags = (*SECTIONS[binary], *config.LOGGING_FLAGS)
    names = {name for flag in flags for name in (flag.option, *flag.aliases, *flag.envs)}
    missing = sorted(names - quoted)
    assert not missing, f"deploy/helm/README.md, section {binary}, does not name {missing}"


@pytest.mark.parametrize("binary", list(SECTIONS))
def test_the_table_names_no_flag_the_binary_lacks(binary: str) -> None:
    flags = (*SECTIONS[binary], *config.LOGGING_FLAGS)
    defined = {name for flag in flags for name in (flag.option, *flag.aliases)} | BUILTIN
    extra = sorted(_first_column_flags(_section(binary)) - defined)
    assert not extra, f"deploy/helm/README.md, section {binary}, lists {extra}, which the binary does not define"
