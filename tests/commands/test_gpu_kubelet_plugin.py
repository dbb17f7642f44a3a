"""``gpu-kubelet-plugin``: every flag and environment variable of NVIDIA's gpu-kubelet-plugin is honoured or refused.

NVIDIA's list is :data:`NVIDIA_FLAGS` (``nvidia-dra-driver.md`` 1.1 and ``gpu-kubelet-plugin --help`` of
v0.5.0-dev); where NVIDIA's binary is present (``../shared/peers/bin``) its ``--help`` is compared with it.
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dradriver import config, logs
from dradriver.commands import _entrypoint, gpu_kubelet_plugin
from dradriver.domain.featuregates import parse_feature_gates
from dradriver.errors import FlagError

REPO = Path(__file__).resolve().parents[2]
PEER = REPO.parent / "shared" / "peers" / "bin" / "gpu-kubelet-plugin"

#: NVIDIA's gpu-kubelet-plugin: option -> environment variables (first is the primary).
NVIDIA_FLAGS: dict[str, tuple[str, ...]] = {
    "--additional-xids-to-ignore": ("ADDITIONAL_XIDS_TO_IGNORE",),
    "--cdi-root": ("CDI_ROOT",),
    "--consumable-shares": ("CONSUMABLE_SHARES",),
    "--container-driver-root": ("DRIVER_ROOT_CTR_PATH",),
    "--healthcheck-port": ("HEALTHCHECK_PORT",),
    "--host-root": ("HOST_ROOT",),
    "--http-endpoint": ("HTTP_ENDPOINT",),
    "--image-name": ("IMAGE_NAME",),
    "--image-pull-policy": ("IMAGE_PULL_POLICY",),
    "--image-pull-secrets": ("IMAGE_PULL_SECRETS",),
    "--kubelet-plugins-directory-path": ("KUBELET_PLUGINS_DIRECTORY_PATH",),
    "--kubelet-registrar-directory-path": ("KUBELET_REGISTRAR_DIRECTORY_PATH",),
    "--metrics-path": ("METRICS_PATH",),
    "--namespace": ("NAMESPACE",),
    "--node-name": ("NODE_NAME",),
    "--nvidia-cdi-hook-path": ("NVIDIA_CDI_HOOK_PATH",),
    "--nvidia-driver-root": ("NVIDIA_DRIVER_ROOT", "HOST_DRIVER_ROOT"),
    "--host_driver-root": ("NVIDIA_DRIVER_ROOT", "HOST_DRIVER_ROOT"),
    "--service-account-name": ("SERVICE_ACCOUNT_NAME",),
    "--feature-gates": ("FEATURE_GATES",),
    "--kube-api-burst": ("KUBE_API_BURST",),
    "--kube-api-qps": ("KUBE_API_QPS",),
    "--kubeconfig": ("KUBECONFIG",),
    "--log-flush-frequency": ("LOG_FLUSH_FREQUENCY",),
    "--log-json-info-buffer-size": ("LOG_JSON_INFO_BUFFER_SIZE",),
    "--log-json-split-stream": ("LOG_JSON_SPLIT_STREAM",),
    "--log-text-info-buffer-size": ("LOG_TEXT_INFO_BUFFER_SIZE",),
    "--log-text-split-stream": ("LOG_TEXT_SPLIT_STREAM",),
    "--logging-format": ("LOGGING_FORMAT",),
    "--vmodule": ("VMODULE",),
    "-v": ("V",),
}


def _flags() -> dict[str, config.Flag]:
    out: dict[str, config.Flag] = {}
    for flag in (*config.PLUGIN_FLAGS, *config.LOGGING_FLAGS):
        for option in (flag.option, *flag.aliases):
            out[option] = flag
    return out


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_flags(parser, (*config.PLUGIN_FLAGS, *config.LOGGING_FLAGS),
                     environ={"NODE_NAME": "node-a", **(environ or {})})
    return parser.parse_args(argv)


def _config(argv: list[str], environ: dict[str, str] | None = None) -> config.PluginConfig:
    return config.config_from_args(_parse(argv, environ))


def test_every_nvidia_flag_and_env_twin_exists() -> None:
    ours = _flags()
    for option, envs in NVIDIA_FLAGS.items():
        assert option in ours, option
        for env in envs:
            assert env in ours[option].envs, (option, env)
    # ADDITIONAL_XIDs_TO_IGNORE: the spelling operators set in the chart's env (issue 18); both are read.
    assert "ADDITIONAL_XIDs_TO_IGNORE" in ours["--additional-xids-to-ignore"].envs


def test_nvidia_binary_help_lists_no_flag_we_lack() -> None:
    if not PEER.exists():
        pytest.skip(f"NVIDIA's gpu-kubelet-plugin not present at {PEER}")
    text = subprocess.run([str(PEER), "--help"], capture_output=True, text=True, timeout=60).stdout
    options = set(re.findall(r"^\s+(--?[a-z][\w-]*)", text, re.MULTILINE)) - {"--help", "-h", "--version"}
    envs = set(re.findall(r"\$([A-Z][A-Za-z_]+)", text))
    ours = _flags()
    assert options <= set(ours), options - set(ours)
    assert envs <= {env for flag in ours.values() for env in flag.envs}


@pytest.mark.parametrize("argv", [["-v", "6"], ["-v=6"], ["-v6"], ["--v=6"], ["--v", "6"]])
def test_klog_verbosity_spellings(argv: list[str]) -> None:
    assert _parse(argv).verbosity == 6


def test_env_twin_of_v_is_v() -> None:
    assert _parse([], {"V": "3"}).verbosity == 3


def test_driver_root_aliases() -> None:
    assert str(_config(["--host_driver-root", "/run/nvidia/driver"]).nvidia_driver_root) == "/run/nvidia/driver"
    assert str(_config([], {"HOST_DRIVER_ROOT": "/run/nvidia/driver"}).nvidia_driver_root) == "/run/nvidia/driver"
    with pytest.raises(FlagError, match="NVIDIA_DRIVER_ROOT='/' and HOST_DRIVER_ROOT='/run/nvidia/driver' disagree"):
        _parse([], {"NVIDIA_DRIVER_ROOT": "/", "HOST_DRIVER_ROOT": "/run/nvidia/driver"})


def test_both_xid_spellings() -> None:
    assert _config([], {"ADDITIONAL_XIDs_TO_IGNORE": "13, 31"}).additional_xids_to_ignore == (13, 31)
    # A manifest's empty ADDITIONAL_XIDS_TO_IGNORE does not hide the operator's NVIDIA spelling.
    both = {"ADDITIONAL_XIDS_TO_IGNORE": "", "ADDITIONAL_XIDs_TO_IGNORE": "48"}
    assert _config([], both).additional_xids_to_ignore == (48,)
    assert _config([], {"ADDITIONAL_XIDS_TO_IGNORE": "48", "ADDITIONAL_XIDs_TO_IGNORE": "48"}) \
        .additional_xids_to_ignore == (48,)
    with pytest.raises(FlagError, match="disagree"):
        _parse([], {"ADDITIONAL_XIDS_TO_IGNORE": "48", "ADDITIONAL_XIDs_TO_IGNORE": "79"})


def test_pod_template_settings() -> None:
    cfg = _config([], {"NAMESPACE": "nvidia-dra-driver-gpu", "IMAGE_NAME": "r/dradriver:1",
                       "IMAGE_PULL_SECRETS": "a, b,", "IMAGE_PULL_POLICY": "Always", "SERVICE_ACCOUNT_NAME": "sa"})
    assert (cfg.namespace, cfg.image_name, cfg.image_pull_secrets, cfg.image_pull_policy,
            cfg.service_account_name) == ("nvidia-dra-driver-gpu", "r/dradriver:1", ("a", "b"), "Always", "sa")
    assert _config([]).namespace == "default"
    with pytest.raises(FlagError, match=r"IMAGE_PULL_POLICY.*'Sometimes'"):
        _config(["--image-pull-policy", "Sometimes"])


def test_kube_api_rate_limit_flags() -> None:
    cfg = _config(["--kube-api-qps", "20", "--kube-api-burst", "40"])
    assert (cfg.kube_api_qps, cfg.kube_api_burst) == (20.0, 40)
    assert _config([], {"KUBE_API_QPS": "2.5"}).kube_api_qps == 2.5
    with pytest.raises(FlagError, match="KUBE_API_BURST"):
        _config(["--kube-api-burst", "-1"])
    with pytest.raises(FlagError, match="KUBE_API_QPS='fast' is not a number"):
        _parse([], {"KUBE_API_QPS": "fast"})


def test_consumable_shares_values() -> None:
    assert str(_config([]).consumable_shares) == "disabled"
    assert not _config([], {"CONSUMABLE_SHARES": ""}).consumable_shares.enabled
    with pytest.raises(FlagError, match="must be a positive integer"):
        _config(["--consumable-shares", "-3"])
    with pytest.raises(FlagError, match="requires the ConsumableShares feature gate"):
        _config(["--consumable-shares", "memory"])


def test_alt_proc_devices_path_replaces_proc_devices(tmp_path: Path) -> None:
    assert _config(["--proc-root", str(tmp_path)]).proc_devices_path == tmp_path / "devices"
    alt = tmp_path / "alt-proc-devices"
    assert _config([], {"ALT_PROC_DEVICES_PATH": str(alt)}).proc_devices_path == alt


def _logging(argv: list[str], environ: dict[str, str] | None = None, gates: str = "") -> logs.LoggingConfig:
    return config.logging_config_from_args(_parse(argv, environ), parse_feature_gates(gates), klog=True)


def test_logging_flags_are_checked_as_component_base_checks_them() -> None:
    assert _logging(["-v", "4", "--vmodule", "runner=6,sockets.go=2"]) == logs.LoggingConfig(
        verbosity=4, vmodule=(("runner", 6), ("sockets", 2)), klog=True)
    assert _logging([], {"LOGGING_FORMAT": "json"}).format == "json"
    with pytest.raises(FlagError, match="only supported with the text log format"):
        _logging(["--vmodule", "runner=6", "--logging-format", "json"])
    with pytest.raises(FlagError, match="needs the feature gate LoggingBetaOptions"):
        _logging(["--log-format", "json"], gates="LoggingBetaOptions=false")
    with pytest.raises(FlagError, match="needs the feature gate LoggingAlphaOptions"):
        _logging(["--log-text-split-stream"])
    assert _logging(["--log-text-split-stream=true"], gates="LoggingAlphaOptions=true").split_stream
    with pytest.raises(FlagError, match="accepts only 0"):
        _logging(["--log-text-info-buffer-size", "2Ki"])
    assert _logging(["--log-json-info-buffer-size", "0"]).split_stream is False
    with pytest.raises(FlagError, match="not a duration"):
        _logging(["--log-flush-frequency", "often"])
    assert _logging(["--log-flush-frequency", "1m30s"]).verbosity == 0
    with pytest.raises(FlagError, match="must not be negative"):
        _logging(["-v", "-1"])
    with pytest.raises(FlagError, match="expected pattern=N"):
        _logging(["--vmodule", "runner"])


def test_inert_nvidia_environment_is_warned_and_documented() -> None:
    warnings = config.inert_environment({"NVIDIA_DRA_TEST_FORCE_GPU_ARCH": "ampere", "LOG_VERBOSITY": "4",
                                         "NVIDIA_VISIBLE_DEVICES": "void",
                                         "NVIDIA_FABRICMANAGER_ADDRESS": "127.0.0.1:6666"})
    assert len(warnings) == 1 and "NVIDIA_DRA_TEST_FORCE_GPU_ARCH" in warnings[0]
    assert "DynamicMIG" in warnings[0]
    names = {var.name for var in config.NVIDIA_ENVIRONMENT}
    assert {"LOG_VERBOSITY", "MASK_NVIDIA_DRIVER_PARAMS", "NVIDIA_VISIBLE_DEVICES",
            "NVIDIA_MIG_CONFIG_DEVICES"} <= names
    readme = (REPO / "deploy" / "helm" / "README.md").read_text()
    for name in names | {env for envs in NVIDIA_FLAGS.values() for env in envs} | {"ADDITIONAL_XIDs_TO_IGNORE"}:
        assert f"`{name}`" in readme, name


def test_console_script_is_declared() -> None:
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gpu-kubelet-plugin"] == "dradriver.commands.gpu_kubelet_plugin:main"


def test_version_and_bad_flag_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as version:
        gpu_kubelet_plugin.main(["--version"])
    assert version.value.code == 0 and "gpu-kubelet-plugin (dradriver " in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        gpu_kubelet_plugin.main(["--no-such-flag"])
    assert bad.value.code == 2 and "gpu-kubelet-plugin: error: unrecognized arguments" in capsys.readouterr().err


def test_malformed_environment_is_one_line_and_status_2(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HEALTHCHECK_PORT", "fifty")
    assert gpu_kubelet_plugin.main([]) == 2
    assert capsys.readouterr().err == "gpu-kubelet-plugin: HEALTHCHECK_PORT='fifty' is not an integer\n"


def test_refused_gate_stops_start_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("NODE_NAME", "node-a")
    assert gpu_kubelet_plugin.main(["-v", "4", "--feature-gates", "DRAListTypeAttributes=true,"]) == 2
    assert "DRAListTypeAttributes=true is not implemented by dradriver" in capsys.readouterr().err


def test_start_logging_uses_klog_and_warns_inert_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVIDIA_DRA_TEST_FORCE_GPU_ARCH", "ampere")
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        _entrypoint.start_logging("gpu-kubelet-plugin", _parse(["-v", "4"]), parse_feature_gates(""))
        logging.getLogger("dradriver.test").debug("debug at -v 4")
    finally:
        logs.configure()
    lines = stream.getvalue().splitlines()
    assert re.match(r"^W\d{4} [\d:.]{15} [ \d]{7,} _entrypoint\.py:\d+\] NVIDIA_DRA_TEST_FORCE_GPU_ARCH='ampere'",
                    lines[0]), lines
    assert re.match(r"^I\d{4} .* test_gpu_kubelet_plugin\.py:\d+\] debug at -v 4$", lines[1]), lines


def test_dradriver_cli_reports_disagreeing_twins_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from dradriver import cli

    monkeypatch.setenv("NVIDIA_DRIVER_ROOT", "/")
    monkeypatch.setenv("HOST_DRIVER_ROOT", "/run/nvidia/driver")
    assert cli.main(["mock-profiles"]) == 2
    assert capsys.readouterr().err == ("dradriver: --nvidia-driver-root: NVIDIA_DRIVER_ROOT='/' and "
                                       "HOST_DRIVER_ROOT='/run/nvidia/driver' disagree; set one of them\n")


@pytest.mark.parametrize("name", ["Bad_Name!", "gpu-node-1.", "a" * 254])
def test_a_node_name_the_api_server_would_refuse_is_a_flag_error(name: str) -> None:
    with pytest.raises(FlagError, match=r"^--node-name \(env NODE_NAME\) '.*' is not a valid Node name: "):
        _config(["--node-name", name])
    assert _config(["--node-name", "gpu-node-1.example.com"]).node_name == "gpu-node-1.example.com"
