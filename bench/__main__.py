"""``python -m bench [--quick] [--json PATH] [-k EXPR]``: run the benchmark suite and summarise it.

Runs every ``bench/bench_*.py`` with pytest-benchmark, saves the raw results under ``bench/results/``,
then prints one table of ratios (each against a baseline measured in the same run) and figures, with the
target beside each. ``--json PATH`` also writes the summary as one JSON object:
``{scenario: {ratio or figure name: {"value": float, "target": "<= 1.3", "met": bool}}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from bench.targets import RATIOS

ROOT = Path(__file__).resolve().parent


def summarise(raw: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Turn a pytest-benchmark JSON document into ``{scenario: {name: {value, target, met}}}``."""
    medians: dict[tuple[str, str], float] = {}
    per: dict[tuple[str, str], dict[str, Any]] = {}
    summary: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for bench in raw.get("benchmarks", []):
        info = bench.get("extra_info", {})
        scenario, variant = info.get("scenario"), info.get("variant")
        if scenario and variant:
            medians[(scenario, variant)] = float(bench["stats"]["median"])
            per[(scenario, variant)] = info
        for name, figure in info.get("figures", {}).items():
            value, op, target = figure
            if not op:  # a reported figure without a target
                summary[scenario or bench["name"]][name] = {"value": value, "target": "", "met": True}
                continue
            met = value <= target if op == "<=" else value >= target
            summary[scenario or bench["name"]][name] = {"value": value, "target": f"{op} {target}", "met": met}
    for ratio in RATIOS:
        num = medians.get((ratio.scenario, ratio.numerator))
        den = medians.get((ratio.scenario, ratio.denominator))
        if ratio.measure and num is not None and den is not None:
            num = per[(ratio.scenario, ratio.numerator)].get(ratio.measure)
            den = per[(ratio.scenario, ratio.denominator)].get(ratio.measure)
        if num is None or den is None or den == 0:
            continue
        if ratio.per:
            num /= float(per[(ratio.scenario, ratio.numerator)][ratio.per])
            den /= float(per[(ratio.scenario, ratio.denominator)][ratio.per])
        value = num / den
        summary[ratio.scenario][ratio.name] = {
            "value": round(value, 3),
            "target": f"{ratio.op} {ratio.target}",
            "met": ratio.met(value),
        }
    for (scenario, variant), median in sorted(medians.items()):
        row = {"value": round(median * 1e6, 2), "target": "", "met": True}
        summary[scenario].setdefault(f"median {variant} (us)", row)
    return dict(summary)


def format_table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Render the summary as a Markdown table."""
    lines = ["| scenario | measure | value | target | met |", "|---|---|---|---|---|"]
    for scenario in sorted(summary):
        for name, row in summary[scenario].items():
            met = "" if not row["target"] else ("yes" if row["met"] else "NO")
            lines.append(f"| {scenario} | {name} | {row['value']} | {row['target']} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the suite; returns pytest's exit code (0 when every benchmark ran)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vs_nvidia"]:  # the side-by-side scenario against NVIDIA's plugin (bench/vs_nvidia.py)
        from bench import vs_nvidia

        return vs_nvidia.main(argv[1:])
    if argv[:1] == ["fleet"]:  # a ComputeDomain's start on a fleet, simulated time (bench/fleet.py)
        from bench import fleet

        return fleet.main(argv[1:])
    if argv[:1] == ["roll"]:  # a rolling update of a rack's pre-warmed IMEX daemons, the sandbox (bench/cdroll.py)
        from bench import cdroll

        return cdroll.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few rounds per benchmark (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as one JSON object")
    parser.add_argument("-k", metavar="EXPR", help="only benchmarks matching this pytest -k expression")
    args = parser.parse_args(argv)
    results = ROOT / "results"
    results.mkdir(exist_ok=True)
    raw_path = results / f"run-{time.strftime('%Y%m%d-%H%M%S')}.json"
    pytest_args = [
        str(ROOT),
        "-o", "python_files=bench_*.py",
        "-o", "testpaths=bench",
        "-p", "no:cacheprovider",
        "--timeout=900",
        "--benchmark-only",
        f"--benchmark-json={raw_path}",
        "--benchmark-sort=name",
        "-q",
    ]
    if args.quick:
        pytest_args += ["--benchmark-min-rounds=3", "--benchmark-max-time=0.05", "--benchmark-warmup=off"]
    else:
        pytest_args += ["--benchmark-min-rounds=10", "--benchmark-max-time=0.5"]
    if args.k:
        pytest_args += ["-k", args.k]
    code = pytest.main(pytest_args)
    if not raw_path.exists():
        print("no benchmark results were written", file=sys.stderr)
        return int(code) or 1
    summary = summarise(json.loads(raw_path.read_text()))
    print()
    print(format_table(summary))
    print(f"\nraw results: {raw_path}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main())
