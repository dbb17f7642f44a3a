"""Speed and memory targets, each a ratio against a baseline measured in the same run.

Every benchmark records ``extra_info["scenario"]`` and ``extra_info["variant"]`` (for example
``extension``, ``twin``, ``c_loop``, ``whole_file``). A ratio divides the median time of one variant by
that of another within the same scenario (or across scenarios, written ``scenario:variant``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ratio:
    """``numerator / denominator`` of median times; ``target`` is met when ``value <op> target``.

    ``per`` divides both sides by a count recorded in ``extra_info[per]`` (e.g. values per poll).
    ``measure`` names an ``extra_info`` key (seconds) to divide instead of the median: for a one-round scenario whose
    call does more than what is measured (a fleet's start, a settle wait after the clock stopped).
    """

    scenario: str
    name: str
    numerator: str
    denominator: str
    op: str
    target: float
    per: str = ""
    measure: str = ""

    def met(self, value: float) -> bool:
        """Whether ``value`` meets the target."""
        return value <= self.target if self.op == "<=" else value >= self.target


RATIOS: tuple[Ratio, ...] = (
    Ratio("vfio_prepare_unprepare", "VfioPreparer apply+undo / the same sysfs writes in a direct sequence",
          "preparer", "direct", "<=", 10.0),
    Ratio("explain_fleet_18000", "explain, claim that fits nowhere: per device / per shape (speed-up)",
          "nowhere_per_device", "nowhere_per_shape", ">=", 20.0),
    Ratio("prepare_1g_dynamic_mig", "dynamic MIG 1g prepare / full-GPU prepare (mock NVML time included)",
          "dynamic_mig", "full_gpu", "<=", 2.5),
    Ratio("claimstate_dynamic_mig", "56 live MIG claims: after 10,000 historical / after 10 (flatness)",
          "history_10000", "history_10", "<=", 1.5),
    Ratio("nvml_poll_8gpu_7mig", "extension per field / C loop per field", "extension", "c_loop", "<=", 1.3),
    Ratio("nvml_poll_8gpu_7mig", "pynvml twin / extension (speed-up)", "twin", "extension", ">=", 4.0),
    Ratio("cdi_1gpu", "twin / extension (speed-up)", "twin", "extension", ">=", 1.0),
    Ratio("cdi_8gpu", "twin / extension (speed-up)", "twin", "extension", ">=", 1.0),
    Ratio("cdi_2048_channels", "twin / extension (speed-up)", "twin", "extension", ">=", 5.0),
    Ratio(
        "claimstore_pair",
        "extension at 10,000 / extension at 10 (flatness)",
        "extension_10000",
        "extension_10",
        "<=",
        1.5,
    ),
    Ratio(
        "claimstore_pair",
        "whole-file JSON baseline / extension at 10,000 (speed-up)",
        "whole_file_10000",
        "extension_10000",
        ">=",
        20.0,
    ),
    Ratio("claimstore_pair", "twin at 10,000 / twin at 10 (flatness)", "twin_10000", "twin_10", "<=", 1.5),
    Ratio(
        "claimstore_pair_tmpfs",
        "extension at 10,000 / extension at 10 (flatness, fdatasync nearly free)",
        "extension_10000",
        "extension_10",
        "<=",
        1.5,
    ),
    Ratio(
        "claimstore_pair_tmpfs",
        "whole-file JSON baseline / extension at 10,000 (speed-up)",
        "whole_file_10000",
        "extension_10000",
        ">=",
        20.0,
    ),
    Ratio(
        "claimstore_pair_tmpfs",
        "twin at 10,000 / extension at 10,000 (speed-up)",
        "twin_10000",
        "extension_10000",
        ">=",
        1.0,
    ),
    Ratio(
        "slices_h200_dynamic_mig",
        "republish after an instance change / full rebuild",
        "republish_instance_created",
        "full_rebuild",
        "<=",
        0.2,
    ),
    Ratio(
        "slices_h200_dynamic_mig",
        "republish with one GPU rebuilt / full rebuild",
        "republish_one_gpu_rebuilt",
        "full_rebuild",
        "<=",
        0.4,
    ),
    Ratio("compute_domain_256", "NVIDIA's protocol / dradriver, time to all 256 prepared (speed-up)", "nvidia",
          "dradriver", ">=", 20.0, measure="prepared_s"),
)
