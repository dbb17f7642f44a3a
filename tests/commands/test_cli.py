"""The command line as an operator meets it: plain ``--help``, a wrong flag answered with the subcommand's usage,
``-o`` on every subcommand, ``allocate``/``explain`` machine-readable output, ``sandbox`` refusing an unknown
profile before it starts anything."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver.cli import build_parser, main, plain, subcommand_parser

REPO = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    raise AssertionError("no subcommands")


COMMANDS = _commands()
REST_MARKUP = re.compile(r"``|:(class|func|meth|mod|data|attr|exc|ref):`|(?<![`\w])`[^`\s][^`]*`(?![`\w])")


def test_plain_renders_rest_inline_markup() -> None:
    assert plain("``dradriver inspect``: see :class:`~dradriver.nvml.mock.Profile` and :func:`open <x.open>`") == \
        "dradriver inspect: see Profile and open"
    assert plain("the `interpreted` word, ``a`b``, example::\n\n    code") == \
        "the interpreted word, a`b, example:\n\n    code"
    assert plain(None) is None


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_plain_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: dradriver {command}")
    assert not REST_MARKUP.search(text), REST_MARKUP.search(text)


def test_top_level_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert not REST_MARKUP.search(capsys.readouterr().out)


@pytest.mark.parametrize("command", COMMANDS)
def test_wrong_flag_prints_the_subcommands_usage(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--no-such-flag"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: dradriver {command} "), err
    assert err.rstrip().endswith(f"dradriver {command}: error: unrecognized arguments: --no-such-flag"), err


def test_wrong_flag_without_a_command_prints_the_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--no-such-flag"])
    assert info.value.code == 2
    assert "dradriver: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_accepts_dash_o(command: str) -> None:
    sub = subcommand_parser(build_parser(), command)
    assert sub is not None
    action = sub._option_string_actions.get("-o")
    assert action is not None, f"{command} has no -o"
    assert action.choices and "json" in action.choices, action.choices
    assert "--output" in action.option_strings
    args = build_parser().parse_args([command, "-o", "json"])
    assert getattr(args, action.dest) == "json"


def test_allocate_and_explain_write_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inputs = [str(REPO / "deploy" / "examples" / "gpu-40gi.yaml")]
    slices = tmp_path / "slices.json"
    assert main(["inspect", "--mock-profile", "dgx-h100", "--node-name", "n1", "-o", "json"]) == 0
    slices.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": json.loads(capsys.readouterr().out)}))
    classes = REPO / "dradriver" / "sandbox" / "manifests" / "deviceclasses.yaml"
    files = [str(slices), str(classes), *inputs]
    assert main(["allocate", "-o", "json", *files]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["kind"] == "List" and listing["items"]
    claims = [item for item in listing["items"] if item["kind"] == "ResourceClaim"]
    assert claims and all(c["status"]["allocation"]["devices"]["results"] for c in claims)
    assert all(p["spec"]["nodeName"] for p in listing["items"] if p["kind"] == "Pod")
    assert main(["explain", "-o", "json", *files]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["allocatable"] is True and answer["failures"] == []
    assert [c["metadata"]["name"] for c in answer["claims"]] == [c["metadata"]["name"] for c in claims]
    assert any("accepted" in line for line in answer["explanation"])


def test_sandbox_refuses_an_unknown_profile_up_front() -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "sandbox", "--profile", "dgx-z900"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dradriver sandbox: error: unknown mock NVML profile 'dgx-z900'")
    assert "dgx-h100" in lines[0]


def _with_closed_stdout(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with standard output a pipe whose reader is already gone (``... | head -1`` once head exits)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              check=False)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("argv", [
    ["inspect", "--mock-profile", "dgx-h100"],
    ["inspect", "--mock-profile", "dgx-h100", "-o", "json"],
    ["feature-gates"],
    ["mock-profiles"],
    ["rollback-check", "--kubelet-plugins-directory-path", "."],
], ids=lambda argv: " ".join(argv))
def test_a_closed_stdout_ends_a_command_quietly(argv: list[str]) -> None:
    proc = _with_closed_stdout([sys.executable, "-m", "dradriver", *argv])
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 141  # 128 + SIGPIPE, what a shell reports for `yes | head -1`


def test_a_closed_stdout_ends_a_console_script_quietly() -> None:
    """NVIDIA-named executables (``gpu-kubelet-plugin`` ...) run through ``console_main``: a component that
    writes to a closed stdout ends as quietly as a ``dradriver`` subcommand."""
    code = ("import sys; from dradriver.commands._entrypoint import console_main; "
            "sys.exit(console_main('gpu-kubelet-plugin', 'x', (), lambda args: print('line\\n' * 20000) or 0, []))")
    proc = _with_closed_stdout([sys.executable, "-c", code])
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_elsewhere_is_not_taken_for_a_closed_stdout() -> None:
    from dradriver.commands._entrypoint import exit_quietly_on_closed_stdout

    def body() -> int:
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a child's stdin or a socket, stdout is fine

    with pytest.raises(BrokenPipeError):
        exit_quietly_on_closed_stdout(body)


@pytest.mark.parametrize("command", ["sandbox", "demo", "inspect"])
def test_a_bad_node_name_is_one_line_naming_the_flag_and_the_rule(command: str) -> None:
    """Refused before anything starts (no node laid out, no API emulator), with the API server's rule."""
    proc = subprocess.run([sys.executable, "-m", "dradriver", command, "--node-name", "Bad_Name!"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"dradriver {command}: --node-name 'Bad_Name!' is not a valid Node name: a lowercase "
                           "RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'"), line
