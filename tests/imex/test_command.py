"""``compute-domain-daemon`` as a console script and a ``dradriver`` subcommand: NVIDIA's flags and their
environment twins, refused gates, the subcommand requirement."""

from __future__ import annotations

from pathlib import Path

import pytest

from dradriver.cli import build_parser, subcommand_parser
from dradriver.commands import compute_domain_daemon


def test_flags_and_environment_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"CLIQUE_ID": "uuid.3", "COMPUTE_DOMAIN_UUID": "cd-uid", "COMPUTE_DOMAIN_NAME": "cd",
           "COMPUTE_DOMAIN_NAMESPACE": "ns", "NODE_NAME": "n1", "POD_IP": "10.0.0.1", "POD_UID": "p-uid",
           "POD_NAME": "pod", "POD_NAMESPACE": "driver", "MAX_NODES_PER_IMEX_DOMAIN": "9",
           "DRADRIVER_IMEXD_DIR": "/x/imexd", "DRADRIVER_HOSTS_FILE": "/x/hosts"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    sub = subcommand_parser(build_parser(), "compute-domain-daemon")
    assert sub is not None
    args = sub.parse_args(["-v", "4", "run"])
    assert (args.cliqueid, args.compute_domain_uuid, args.compute_domain_name, args.compute_domain_namespace,
            args.node_name, args.pod_ip, args.pod_uid, args.pod_name, args.pod_namespace,
            args.max_nodes_per_imex_domain, args.imexd_dir, args.hosts_file, args.verbosity, args.action) == (
        "uuid.3", "cd-uid", "cd", "ns", "n1", "10.0.0.1", "p-uid", "pod", "driver", 9, "/x/imexd", "/x/hosts", 4,
        "run")
    assert sub.parse_args(["--cliqueid", "", "check"]).cliqueid == ""


def test_console_script_help_and_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        compute_domain_daemon.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: compute-domain-daemon") and "run|check" in out and "COMPUTE_DOMAIN_UUID" in out
    assert compute_domain_daemon.main([]) == 2
    assert "a subcommand is required: run or check" in capsys.readouterr().err


def test_gates_dradriver_does_not_implement_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert compute_domain_daemon.main(["--feature-gates", "ComputeDomainCliques=false", "run"]) == 2
    err = capsys.readouterr().err
    assert "ComputeDomainCliques=false is not supported" in err and "ComputeDomainClique objects only" in err


def test_check_without_a_clique_succeeds_and_with_one_needs_the_daemon(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert compute_domain_daemon.main(["--cliqueid", "", "check"]) == 0
    code = compute_domain_daemon.main(["--cliqueid", "u.1", "--imexd-dir", str(tmp_path), "check"])
    assert code == 1
    assert "this pod's nvidia-imex has not been started yet" in capsys.readouterr().err  # before nvidia-imex-ctl
