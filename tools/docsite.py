"""MkDocs hook (``hooks:`` in ``mkdocs.yml``): the reference pages generated from the code at build time.

A page asks for a generated block with a marker line ``<!-- generated: NAME -->``; :func:`on_page_markdown`
replaces it with the markdown of :data:`GENERATORS` ``[NAME]``. An unknown name fails the build, so a typo
cannot silently leave a page empty. The blocks, each from the one place the code keeps the fact:

* ``commands``: every subcommand of ``dradriver`` (nested ones too), its description and each option with its
  environment twins, default and choices, walked from the argparse parsers :func:`dradriver.cli.build_parser`
  builds (with an empty environment, so an operator's variables never leak into the defaults shown);
* ``console-scripts``: the executables ``[project.scripts]`` in ``pyproject.toml`` installs;
* ``environment``: every environment variable: the flags' twins (from the same parsers), NVIDIA's variables that
  are no flag's twin (:data:`dradriver.config.NVIDIA_ENVIRONMENT`), and every other ``DRADRIVER_*`` name the
  sources mention (:data:`OTHER_VARIABLES` must describe each one, or the build fails);
* ``feature-gates``: :data:`dradriver.domain.featuregates.GATES`, and the gates' mutual rules;
* ``attributes``: the attributes and capacities of each device kind, read from what ``dradriver inspect
  --mock-profile`` publishes for :data:`ATTRIBUTE_PROFILES` (one subprocess per profile: the mock NVML library
  serves one profile per process).

Everything runs offline and takes about a second per profile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
ENV_SUFFIX = re.compile(r"\s*\[env ([A-Za-z0-9_, ]+)\]\s*$")
DRADRIVER_VARIABLE = re.compile(r"(?<=[\"'`])DRADRIVER_[A-Z0-9_]+\b")  # quoted: a name, not a constant

#: Environment variables that are no flag's twin and not NVIDIA's: what each does. The build fails when the
#: sources mention a ``DRADRIVER_*`` name that is neither a flag's twin nor listed here.
OTHER_VARIABLES: dict[str, str] = {
    "DRADRIVER_IMAGE_CDI_HOOK": "Where the plugin's image carries `nvidia-cdi-hook` (default "
                                "`/usr/bin/nvidia-cdi-hook`), copied into the plugin directory when "
                                "`NVIDIA_CDI_HOOK_PATH` is empty; the sandbox points it at a stand-in.",
    "DRADRIVER_MODPROBE": "The command (words separated by spaces) a kernel module name is appended to when VFIO "
                          "passthrough loads `vfio-pci` (gate PassthroughSupport); unset: `chroot <--host-root> "
                          "modprobe`, as NVIDIA. The sandbox points it at its `modprobe` stand-in.",
    "DRADRIVER_NO_EXTENSIONS": "`1` runs the pure-Python twins of the compiled modules (`nvmlpoll`, `cdispec`, "
                               "`claimstore`) instead of the extensions; without it a missing extension is a "
                               "start-up error.",
    "DRADRIVER_MOCK_NVML_PROFILE": "The profile the mock `libnvidia-ml.so.1` serves (set by `--mock-profile`; "
                                   "`ext/mocknvml/README.md`).",
    "DRADRIVER_MOCK_NVML_STATE": "The mock NVML's state file (MIG instances, compute modes, settings), shared by "
                                 "the processes of one emulated node.",
    "DRADRIVER_MOCK_NVML_PROC_ROOT": "The `proc` root the mock NVML reports processes from.",
    "DRADRIVER_MOCK_NVML_SYSFS": "A sysfs root: the mock NVML then lists only the GPUs whose PCI function there "
                                 "is bound to `nvidia` at `nvmlInit`, as NVML does (VFIO passthrough in the sandbox).",
    "DRADRIVER_MOCK_NVML_CONTROL": "A file the mock NVML appends every successful setting to, as a control command "
                                   "(tests and the sandbox read it).",
    "DRADRIVER_HOSTS_FILE": "The hosts file `compute-domain-daemon` writes the domain's DNS names into "
                            "(`--hosts-file`; default `/etc/hosts`).",
    "DRADRIVER_IMEXD_DIR": "The IMEX daemon's configuration directory in `compute-domain-daemon` (`--imexd-dir`; "
                           "default `/imexd`).",
    "DRADRIVER_POLL_INTERVAL_SECONDS": "`compute-domain-daemon`: seconds between its clique reads while the watch is "
                                       "down.",
    "DRADRIVER_SANDBOX_CONTAINER": "Marks the processes the sandbox's container runner starts for a pod, so it "
                                   "can find and stop them (sandbox only).",
    "DRADRIVER_FABRIC_IMEX_MGMT": "The file the sandbox's `nvidia-imex` stand-in locks as its node's one IMEX "
                                  "session (the node's `fabric-imex-mgmt` capability node; sandbox only).",
    "DRADRIVER_NVIDIA_PEERS": "The folder with NVIDIA's own peer binaries (`bin/gpu-kubelet-plugin`, `mocknvml/`), "
                              "for the tests and benchmarks that run NVIDIA's plugin beside dradriver's; unset: "
                              "they are skipped (tests) or run dradriver only (`python -m bench vs_nvidia`).",
    "DRADRIVER_BENCH_REAL_NVML": "`python -m bench`: `1` runs the NVML scenarios against the machine's real "
                                 "driver (read-only calls).",
    "DRADRIVER_APISERVER_LATENCY": "The sandbox's API emulator: seconds added to each read, write and watch event, "
                                   "e.g. `read=10ms,write=30ms,watch=5ms` (unset: none; "
                                   "`dradriver/sandbox/apiserver/flowcontrol.py`).",
    "DRADRIVER_APISERVER_FLOW_CONTROL": "The sandbox's API emulator: an API Priority and Fairness limit answered "
                                        "429 with `Retry-After`, e.g. `seats=245,queue=50,wait=15s,retry-after=1` "
                                        "(unset: no limit).",
}

#: (profile, what it shows) for the attribute table: full GPUs, static MIG devices, a GB200 with its clique.
ATTRIBUTE_PROFILES: tuple[tuple[str, str], ...] = (
    ("dgx-a100", "A100 40GB, two GPUs in MIG mode"),
    ("dgx-h100", "H100 80GB"),
    ("gb200-nvl72-node", "GB200 NVL72 compute tray"),
    ("l4-inference", "L4"),
)
#: Publications that only flags produce, as ``(column, profile, inspect flags, what)``: the ``shares`` capacity
#: of ``--consumable-shares N`` (with the gate ConsumableShares every device is multi-allocatable and carries it).
ATTRIBUTE_VARIANTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("dgx-h100 --consumable-shares 4", "dgx-h100",
     ("--feature-gates", "ConsumableShares=true", "--consumable-shares", "4"), "H100 80GB, each GPU in 4 shares"),
)


# ---------------------------------------------------------------------------------------------- helpers
@contextmanager
def _empty_environment() -> Iterator[None]:
    """Run the block with only ``PATH``, ``HOME`` and ``PYTHONPATH`` in ``os.environ``; restore it after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if k in ("PATH", "HOME", "PYTHONPATH")})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _cell(text: object) -> str:
    """``text`` fit for one markdown table cell: one line, pipes escaped, and outside code spans ``<``, ``>`` and
    ``*`` escaped, so help like ``<dir>/gpu.nvidia.com`` or ``DCGM_FI_*`` shows as written (not as an HTML tag
    or emphasis)."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(parts).replace("|", "\\|")


def _code(text: object) -> str:
    return f"`{text}`" if str(text) != "" else ""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(sorted(action.choices.items()))
    return {}


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Subcommand name -> its one-line ``help`` (what ``dradriver --help`` lists)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {str(choice.dest): str(choice.help or "") for choice in action._choices_actions}
    return {}


def _walk(parser: argparse.ArgumentParser, prefix: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) of every subcommand under ``parser``, depth first, sorted by name."""
    for name, sub in _subparsers(parser).items():
        line = f"{prefix} {name}"
        yield line, sub
        yield from _walk(sub, line)


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    sys.path.insert(0, str(REPO))
    from dradriver.cli import build_parser

    with _empty_environment():
        return list(_walk(build_parser(), "dradriver"))


@dataclass(frozen=True)
class Option:
    """One visible argument of a parser, as the reference shows it."""

    spellings: tuple[str, ...]
    """``("-o", "--output")``; a positional's metavar."""
    argument: str
    """``{yaml,json}``, the metavar, ``...`` after a repeated positional, or ``""``."""
    twins: tuple[str, ...]
    """The environment variables from the help's ``[env ...]`` suffix."""
    default: str
    help: str

    @property
    def spelling(self) -> str:
        """Markdown: every spelling in code, then the argument."""
        text = ", ".join(f"`{s}`" for s in self.spellings)
        return f"{text} `{self.argument}`" if self.argument and self.argument != "..." else \
            f"{text} ..." if self.argument else text


def _options(parser: argparse.ArgumentParser) -> Iterator[Option]:
    """Each visible option and positional of ``parser`` (``--help`` and nested subcommands left out)."""
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        help_text = action.help or ""
        twins: tuple[str, ...] = ()
        found = ENV_SUFFIX.search(help_text)
        if found:
            twins = tuple(name.strip() for name in found.group(1).split(","))
            help_text = help_text[: found.start()]
        argument = ""
        if action.choices and not action.option_strings:
            argument = "{" + ",".join(str(c) for c in action.choices) + "}"
        elif action.nargs != 0 and action.option_strings:
            argument = ("{" + ",".join(str(c) for c in action.choices) + "}") if action.choices else \
                str(action.metavar or "")
        elif action.nargs in ("*", "+"):
            argument = "..."
        spellings = tuple(action.option_strings) or (str(action.metavar or action.dest),)
        default = action.default
        shown = "" if default in (None, argparse.SUPPRESS, False, "") or action.nargs == 0 else _code(default)
        if isinstance(default, bool) and action.nargs == "?":
            shown = _code(str(default).lower())
        yield Option(spellings, argument, twins, shown, help_text)


# ------------------------------------------------------------------------------------------- generators
def command_reference() -> str:
    """Every subcommand: a heading, its description as ``--help`` prints it, and a table of its options."""
    sys.path.insert(0, str(REPO))
    from dradriver.cli import build_parser

    with _empty_environment():
        top = build_parser()
    out = ["| Command | What it does |", "|---|---|"]
    for name, summary in sorted(_summaries(top).items()):
        out.append(f"| [`dradriver {name}`](#dradriver-{name}) | {_cell(summary)} |")
    out.append("")
    for line, parser in _commands():
        depth = line.count(" ")
        out.append(f"{'#' * (depth + 1)} `{line}`\n")
        description = (parser.description or "").strip()
        if description:
            out.append("```text\n" + description + "\n```\n")
        rows = list(_options(parser))
        if rows:
            out.append("| Option | Environment | Default | What it does |\n|---|---|---|---|")
            for option in rows:
                out.append(f"| {option.spelling} | {', '.join(_code(t) for t in option.twins)} | "
                           f"{_cell(option.default)} | {_cell(option.help)} |")
            out.append("")
    return "\n".join(out)


def console_scripts() -> str:
    """The executables the package installs and what each runs."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    rows = ["| Executable | Runs |", "|---|---|"]
    rows += [f"| `{name}` | `{target}` |" for name, target in sorted(scripts.items())]
    return "\n".join(rows) + "\n"


def _mentioned_variables() -> dict[str, set[str]]:
    """``DRADRIVER_*`` name -> the source files (repository-relative) that mention it."""
    found: dict[str, set[str]] = {}
    sources = [*REPO.glob("dradriver/**/*.py"), *REPO.glob("ext/**/*.c"), *REPO.glob("ext/**/*.pyx"),
               *REPO.glob("bench/*.py")]
    for path in sources:
        for name in DRADRIVER_VARIABLE.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def environment_reference() -> str:
    """Three tables: flag twins (with the commands that read them), NVIDIA's other variables, dradriver's others.

    :raises ValueError: a ``DRADRIVER_*`` name in the sources is neither a flag's twin nor in :data:`OTHER_VARIABLES`.
    """
    sys.path.insert(0, str(REPO))
    from dradriver.config import NVIDIA_ENVIRONMENT

    twins: dict[str, tuple[str, set[str], str]] = {}
    for line, parser in _commands():
        for option in _options(parser):
            for name in option.twins:
                flag = ", ".join(f"`{s}`" for s in option.spellings)
                flag, commands, text = twins.get(name, (flag, set(), option.help))
                commands.add(line.removeprefix("dradriver "))
                twins[name] = (flag, commands, text)
    out = ["## Twins of flags", "",
           "A flag given on the command line wins over its variable; an empty variable counts as unset.", "",
           "| Variable | Flag | Commands | What it sets |", "|---|---|---|---|"]
    for name in sorted(twins):
        flag, commands, text = twins[name]
        out.append(f"| `{name}` | {flag} | "
                   f"{', '.join(f'`{c}`' for c in sorted(commands))} | {_cell(text)} |")
    out += ["", "## NVIDIA's variables that are no flag's twin", "",
            "| Variable | What dradriver does with it |", "|---|---|"]
    out += [f"| `{var.name}` | {_cell(var.treatment)} |" for var in NVIDIA_ENVIRONMENT]
    mentioned = _mentioned_variables()
    missing = sorted(set(mentioned) - set(twins) - set(OTHER_VARIABLES))
    if missing:
        raise ValueError(f"tools/docsite.py OTHER_VARIABLES: describe {', '.join(missing)} "
                         f"(mentioned in {', '.join(sorted(mentioned[missing[0]]))})")
    out += ["", "## Other variables", "", "| Variable | What it does | Read in |", "|---|---|---|"]
    for name in sorted(set(OTHER_VARIABLES) & set(mentioned)):  # a description no source needs is left out
        files = ", ".join(f"`{f}`" for f in sorted(mentioned[name])[:3])
        out.append(f"| `{name}` | {_cell(OTHER_VARIABLES[name])} | {files} |")
    return "\n".join(out) + "\n"


def feature_gate_reference() -> str:
    """The gate table (``dradriver feature-gates``) with each gate's summary and note, then the gates' rules."""
    sys.path.insert(0, str(REPO))
    from dradriver.domain.featuregates import GATES, MUTUALLY_EXCLUSIVE, REQUIRES

    out = ["| Gate | NVIDIA's default | dradriver's default | Stage | Support | What it enables "
           "| How dradriver differs |",
           "|---|---|---|---|---|---|---|"]
    for gate in GATES:
        out.append(f"| `{gate.name}` | `{str(gate.nvidia_default).lower()}` | "
                   f"`{str(gate.effective_default).lower()}` | {gate.stage} | {gate.support.value} | "
                   f"{_cell(gate.summary)} | {_cell(gate.note)} |")
    out += ["", "Rules checked at start (NVIDIA's `ValidateFeatureGates`):", ""]
    out += [f"- `{a}` and `{b}` cannot both be on." for a, b in MUTUALLY_EXCLUSIVE]
    out += [f"- `{a}` needs `{b}`." for a, b in REQUIRES]
    return "\n".join(out) + "\n"


def _published(profile: str, flags: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The devices ``dradriver inspect --mock-profile PROFILE -o json FLAGS...`` publishes."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "dradriver", "inspect", "--mock-profile", profile,
                           "--node-name", "node-a", "-o", "json", *flags],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"dradriver inspect --mock-profile {profile} {' '.join(flags)}: {proc.stderr.strip()}")
    slices = json.loads(proc.stdout)
    return [device for item in slices for device in item["spec"].get("devices", [])]


def _value(attribute: dict[str, Any]) -> tuple[str, str]:
    """(type, value) of a published attribute: ``{"string": "x"}`` -> ``("string", "x")``."""
    (kind, value), = attribute.items()
    return kind, str(value).lower() if isinstance(value, bool) else str(value)


def attribute_reference() -> str:
    """Per device type, one table of attributes and one of capacities, with an example value from each profile."""
    sys.path.insert(0, str(REPO))
    from dradriver.domain.computedomains import plugin_resource_slices
    from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER

    channels = COMPUTE_DOMAIN_DRIVER.driver_name
    sources = [(profile, _published(profile)) for profile, _ in ATTRIBUTE_PROFILES]
    sources += [(column, _published(profile, flags)) for column, profile, flags, _ in ATTRIBUTE_VARIANTS]
    sources.append((channels, [device for item in plugin_resource_slices(
        "node-a", channels, daemon=True, channels=2) for device in item["spec"]["devices"]]))
    by_type: dict[str, dict[str, dict[str, dict[str, str]]]] = {}
    for profile, devices in sources:
        for device in devices:
            kind = _value(device["attributes"]["type"])[1]
            tables = by_type.setdefault(kind, {"attributes": {}, "capacity": {}})
            for name, attribute in device.get("attributes", {}).items():
                value_type, value = _value(attribute)
                tables["attributes"].setdefault(name, {"type": value_type}).setdefault(profile, value)
            for name, capacity in device.get("capacity", {}).items():
                tables["capacity"].setdefault(name, {"type": "quantity"}).setdefault(profile, capacity["value"])
    out = ["Example values come from the bundled mock profiles: " +
           "; ".join([f"`{p}` ({what})" for p, what in ATTRIBUTE_PROFILES] +
                     [f"`{column}` ({what})" for column, _, _, what in ATTRIBUTE_VARIANTS]) +
           f", and the `{channels}` devices of a node with two channels (types `channel`, `daemon`). "
           "An empty cell: that profile publishes no such device or not this field.", ""]
    for kind in sorted(by_type, key=lambda k: (k not in ("gpu", "mig"), k)):  # GPUs first, then IMEX devices
        profiles = [p for p, _ in sources if any(p in v for t in by_type[kind].values() for v in t.values())]
        for table in ("attributes", "capacity"):
            rows = by_type[kind][table]
            if not rows:
                continue
            out += [f"### `type={kind}`: {table}", "",
                    "| Name | Type | " + " | ".join(f"`{p}`" for p in profiles) + " |",
                    "|---|---|" + "---|" * len(profiles)]
            for name in sorted(rows, key=lambda n: (n.count("/") > 0, n)):
                cells = [_cell(_code(rows[name].get(p, ""))) for p in profiles]
                out.append(f"| `{name}` | {rows[name]['type']} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "commands": command_reference,
    "console-scripts": console_scripts,
    "environment": environment_reference,
    "feature-gates": feature_gate_reference,
    "attributes": attribute_reference,
}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated block.

    :raises ValueError: a marker names no generator.
    """
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated block {name!r}; known: {', '.join(sorted(GENERATORS))}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs event: fill a page's generated blocks."""
    return render(markdown)
