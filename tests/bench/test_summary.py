"""``python -m bench``'s summary: ratios of medians, or of a recorded measure where the ratio names one."""

from __future__ import annotations

from typing import Any

from bench import __main__ as bench_main


def _bench(scenario: str, variant: str, median: float, **info: Any) -> dict[str, Any]:
    return {"name": f"test_{scenario}[{variant}]", "stats": {"median": median},
            "extra_info": {"scenario": scenario, "variant": variant, **info}}


def test_a_ratio_with_a_measure_divides_the_measure_not_the_median() -> None:
    """compute_domain_256's call also starts the domain's settle wait and stops the controller after the clock
    stopped; its speed-up is the ratio of the recorded seconds to every channel prepared."""
    raw = {"benchmarks": [_bench("compute_domain_256", "nvidia", 16.0, prepared_s=12.5),
                          _bench("compute_domain_256", "dradriver", 14.0, prepared_s=10.0),
                          _bench("cdi_1gpu", "twin", 3e-5), _bench("cdi_1gpu", "extension", 1e-5)]}
    summary = bench_main.summarise(raw)
    row = summary["compute_domain_256"]["NVIDIA's protocol / dradriver, time to all 256 prepared (speed-up)"]
    assert row == {"value": 1.25, "target": ">= 20.0", "met": False}
    assert summary["compute_domain_256"]["median dradriver (us)"]["value"] == 14e6  # the medians are still shown
    assert summary["cdi_1gpu"]["twin / extension (speed-up)"]["value"] == 3.0  # no measure: the medians


def test_a_ratio_whose_measure_is_missing_is_left_out() -> None:
    raw = {"benchmarks": [_bench("compute_domain_256", "nvidia", 16.0),
                          _bench("compute_domain_256", "dradriver", 14.0, prepared_s=10.0)]}
    summary = bench_main.summarise(raw)
    assert not any("speed-up" in name for name in summary["compute_domain_256"])
