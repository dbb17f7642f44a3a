"""NVIDIA's ``--feature-gates`` syntax, defaults and rules (``nvidia-dra-driver.md`` section 8)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dradriver.config import PLUGIN_FLAGS, add_flags, config_from_args
from dradriver.domain import featuregates as fg
from dradriver.errors import FlagError


def test_defaults_are_nvidias_except_health() -> None:
    gates = fg.FeatureGates()
    assert not gates.time_slicing_settings and not gates.mps_support and not gates.dynamic_mig
    assert gates[fg.IMEX_DAEMONS_WITH_DNS_NAMES] and gates[fg.COMPUTE_DOMAIN_CLIQUES]
    assert gates.nvml_device_health_check  # dradriver's documented difference
    assert fg.GATES_BY_NAME[fg.NVML_DEVICE_HEALTH_CHECK].nvidia_default is False


def test_time_slicing_settings_is_implemented_both_ways() -> None:
    assert fg.GATES_BY_NAME[fg.TIME_SLICING_SETTINGS].support is fg.Support.IMPLEMENTED
    assert fg.parse_feature_gates("TimeSlicingSettings=true").time_slicing_settings
    assert not fg.parse_feature_gates("TimeSlicingSettings=false").time_slicing_settings


def test_chart_syntax_with_trailing_comma_and_blanks() -> None:
    gates = fg.parse_feature_gates(" ContextualLogging=false , IMEXDaemonsWithDNSNames=True,,")
    assert gates.explicit == {"ContextualLogging": False, "IMEXDaemonsWithDNSNames": True}
    assert gates.render() == "ContextualLogging=false,IMEXDaemonsWithDNSNames=true"
    assert fg.parse_feature_gates("") == fg.FeatureGates()


@pytest.mark.parametrize(("text", "message"), [
    ("Bogus=true", "unrecognized feature gate: Bogus"),
    ("DynamicMIG", "missing bool value for 'DynamicMIG'"),
    ("ContextualLogging=yes", "invalid value of ContextualLogging=yes"),
    ("DRAListTypeAttributes=true", "DRAListTypeAttributes=true is not implemented by dradriver"),
    ("IMEXDaemonsWithDNSNames=false", "IMEXDaemonsWithDNSNames=false is not supported: dradriver.s IMEX daemons"),
    ("NVMLDeviceHealthCheck=false", "NVMLDeviceHealthCheck=false is not supported"),
])
def test_refusals_name_the_gate(text: str, message: str) -> None:
    with pytest.raises(fg.FeatureGateError, match=message):
        fg.parse_feature_gates(text)


def test_nvidia_rules_are_enforced() -> None:
    implemented = {g.name for g in fg.GATES if g.support is fg.Support.IMPLEMENTED}
    for first, second in fg.MUTUALLY_EXCLUSIVE:
        if {first, second} <= implemented | {fg.NVML_DEVICE_HEALTH_CHECK}:
            with pytest.raises(fg.FeatureGateError, match="mutually exclusive"):
                fg.check_gates(fg.FeatureGates({first: True, second: True}))
    gates = fg.FeatureGates({fg.COMPUTE_DOMAIN_CLIQUES: True, fg.IMEX_DAEMONS_WITH_DNS_NAMES: False})
    with pytest.raises(fg.FeatureGateError):
        fg.check_gates(gates)


def test_dynamic_mig_is_implemented_and_exclusive_with_mps() -> None:
    assert fg.GATES_BY_NAME[fg.DYNAMIC_MIG].support is fg.Support.IMPLEMENTED
    gates = fg.parse_feature_gates("DynamicMIG=true")
    assert gates.dynamic_mig and gates.render() == "DynamicMIG=true"
    assert not fg.FeatureGates().dynamic_mig  # off by default, like NVIDIA's
    # refused either way: NVIDIA's exclusivity, or MPS not implemented (yet) in this build
    with pytest.raises(fg.FeatureGateError, match=r"mutually exclusive|MPSSupport=true is not implemented"):
        fg.check_gates(fg.FeatureGates({fg.DYNAMIC_MIG: True, fg.MPS_SUPPORT: True}))
def test_mps_support_is_implemented_and_needs_the_image_name() -> None:
    import argparse

    assert fg.GATES_BY_NAME[fg.MPS_SUPPORT].support is fg.Support.IMPLEMENTED
    assert fg.parse_feature_gates("MPSSupport=true").mps_support is True
    parser = argparse.ArgumentParser()
    add_flags(parser, PLUGIN_FLAGS, environ={"FEATURE_GATES": "MPSSupport=true", "NAMESPACE": "gpu-system"})
    with pytest.raises(FlagError, match=r"--image-name .* is required with the MPSSupport feature gate"):
        config_from_args(parser.parse_args(["--node-name", "n"]))
    config = config_from_args(parser.parse_args(["--node-name", "n", "--image-name", "reg/dradriver:1"]))
    assert (config.namespace, config.image_name, config.feature_gates.mps_support) == (
        "gpu-system", "reg/dradriver:1", True)
    assert config.mps_root == config.plugin_dir / "mps"


def test_flag_and_env_twin() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, PLUGIN_FLAGS, environ={"FEATURE_GATES": "LoggingAlphaOptions=true,"})
    config = config_from_args(parser.parse_args(["--node-name", "n"]))
    assert config.feature_gates["LoggingAlphaOptions"] is True
    with pytest.raises(FlagError, match=r"FEATURE_GATES.*unrecognized feature gate: Nope"):
        config_from_args(parser.parse_args(["--node-name", "n", "--feature-gates", "Nope=true"]))


def test_feature_gates_command_lists_every_gate() -> None:
    out = subprocess.run([sys.executable, "-m", "dradriver", "feature-gates"], check=True, capture_output=True,
                         text=True).stdout
    for gate in fg.GATES:
        assert gate.name in out


def test_consumable_shares_gate_is_implemented_with_nvidias_flag() -> None:
    import argparse

    from dradriver.domain.shares import MEMORY, SHARES, ShareMode

    assert fg.GATES_BY_NAME[fg.CONSUMABLE_SHARES].support is fg.Support.IMPLEMENTED
    assert fg.parse_feature_gates("ConsumableShares=true").consumable_shares
    parser = argparse.ArgumentParser()
    add_flags(parser, PLUGIN_FLAGS, environ={"CONSUMABLE_SHARES": "memory"})
    with pytest.raises(FlagError, match=r"--consumable-shares \(env CONSUMABLE_SHARES\)=memory requires the "
                                        "ConsumableShares feature gate"):
        config_from_args(parser.parse_args(["--node-name", "n"]))
    with pytest.raises(FlagError, match=r"--image-name \(env IMAGE_NAME\) is required with --consumable-shares=memory"):
        config_from_args(parser.parse_args(["--node-name", "n", "--feature-gates", "ConsumableShares=true"]))
    image = ["--image-name", "dradriver:1"]
    config = config_from_args(parser.parse_args(["--node-name", "n", "--feature-gates", "ConsumableShares=true",
                                                 *image]))
    assert config.consumable_shares == ShareMode(MEMORY)
    config = config_from_args(parser.parse_args(["--node-name", "n", "--feature-gates", "ConsumableShares=true",
                                                 "--consumable-shares", "4", *image]))
    assert config.consumable_shares == ShareMode(SHARES, 4)
    assert config_from_args(parser.parse_args(["--node-name", "n", "--consumable-shares", "disabled"])) \
        .consumable_shares == ShareMode()


def test_device_metadata_is_implemented_without_passthrough_support() -> None:
    gate = fg.GATES_BY_NAME[fg.DEVICE_METADATA]
    assert gate.support is fg.Support.IMPLEMENTED and gate.effective_default is False  # NVIDIA's default
    assert "PassthroughSupport" in gate.note  # the documented difference
    assert fg.parse_feature_gates("DeviceMetadata=true").device_metadata
    assert not fg.FeatureGates().device_metadata


def test_passthrough_and_fabric_manager_partitioning_are_implemented_and_passthrough_goes_with_health_checks() -> None:
    for name in (fg.PASSTHROUGH_SUPPORT, fg.FABRIC_MANAGER_PARTITIONING):
        assert fg.GATES_BY_NAME[name].support is fg.Support.IMPLEMENTED
        assert not fg.GATES_BY_NAME[name].effective_default  # NVIDIA's default, off
    gates = fg.parse_feature_gates("PassthroughSupport=true,FabricManagerPartitioning=true,NVMLDeviceHealthCheck=true")
    assert gates.passthrough_support and gates.fabric_manager_partitioning and gates.nvml_device_health_check
    assert (fg.PASSTHROUGH_SUPPORT, fg.NVML_DEVICE_HEALTH_CHECK) not in fg.MUTUALLY_EXCLUSIVE
    with pytest.raises(fg.FeatureGateError, match="feature gates DynamicMIG and PassthroughSupport are mutually "
                                                  "exclusive"):
        fg.parse_feature_gates("DynamicMIG=true,PassthroughSupport=true")
