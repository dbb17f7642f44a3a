"""The ``vs_nvidia`` bench scenario's report (issue 17), without NVIDIA's binary: shape, not timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import __main__ as bench_main
from bench import vs_nvidia


@pytest.mark.slow
def test_without_the_peer_reports_dradriver_alone_and_says_so(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert bench_main.main(["vs_nvidia", "--nvidia-plugin", str(tmp_path / "absent"), "--rounds", "1",
                            "--claims", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["peer_run"] is False
    assert report["peer_note"].startswith("peer not run: NVIDIA's plugin binary not found")
    assert set(report["rows"]) == set(vs_nvidia.TARGETS)
    for figure, row in report["rows"].items():
        assert row["label"] == vs_nvidia.LABELS[figure]
        assert row["nvidia"] is None
        assert row["dradriver"] > 0, figure
    # memory is set against a bare interpreter measured in the same run
    bare = report["bare_interpreter_rss_mib"]
    assert bare > 0
    rest = report["rows"]["rss_rest_mib"]
    assert rest["ratio"] == pytest.approx(rest["dradriver"] / bare, rel=1e-3)
    assert "bare interpreter" in rest["target"]
    # the only absolute target is judged without the peer; the relative ones are not
    assert report["rows"]["start_to_registration_s"]["met"] is not None
    assert report["rows"]["prepare_p50_ms"]["met"] is None
    floors = report["floors"]
    assert floors["api_get_p50_ms"] > 0
    assert floors["unprepare_floor_ms"] == report["rows"]["empty_call_p50_ms"]["dradriver"]
    assert floors["prepare_floor_ratio"] is None and floors["unprepare_floor_ratio"] is None
    assert len(report["load_average"]) == 2 and len(report["samples"]["dradriver"]) == 1
    text = capsys.readouterr().out
    assert text == vs_nvidia.format_report(report) + "\n"
    assert text.splitlines()[0] == report["peer_note"]
    assert all(vs_nvidia.LABELS[f] in text for f in vs_nvidia.TARGETS)


def test_with_peer_samples_every_row_has_a_ratio_and_a_verdict() -> None:
    ours = {"prepare_p50_ms": 2.0, "prepare_p99_ms": 5.0, "unprepare_p50_ms": 1.0, "start_to_registration_s": 0.2,
            "start_to_slice_s": 0.8, "cpu_to_start_s": 0.7,
            "cpu_to_registration_s": 0.2, "cpu_per_pair_ms": 1.5, "empty_call_p50_ms": 0.5, "rss_rest_mib": 80.0,
            "rss_after_claims_mib": 82.0, "api_get_p50_ms": 1.0}
    theirs = {k: v * 2 for k, v in ours.items()}
    theirs["api_get_p50_ms"] = 1.0  # the same client and emulator in both runs
    report = vs_nvidia.build_report({"dradriver": [ours], "nvidia": [theirs]}, bare_rss_mib=10.0, peer_reason="",
                                    claims=600, rounds=1)
    assert report["peer_run"] is True and report["peer_note"] == ""
    for figure, row in report["rows"].items():
        assert row["ratio"] == 0.5, figure
        assert row["nvidia"] == theirs[figure]
    assert report["rows"]["prepare_p50_ms"]["met"] is True  # 0.5 <= 0.7
    assert report["rows"]["cpu_to_start_s"]["met"] is None  # reported, no target
    assert report["rows"]["start_to_registration_s"]["met"] is True  # 0.2 s <= 0.3 s
    # the floors: dradriver's empty call (0.5 ms) + a GET (1.0 ms) under NVIDIA's 4 ms prepare; the empty call
    # alone under its 2 ms unprepare
    assert report["floors"] == {"api_get_p50_ms": 1.0, "prepare_floor_ms": 1.5, "unprepare_floor_ms": 0.5,
                                "prepare_floor_ratio": 0.375, "unprepare_floor_ratio": 0.25}
    assert "empty call + GET 1.5 ms" in vs_nvidia.format_report(report)



def test_the_cost_of_nvidias_checkpoint_is_reported_from_the_runs_without_it() -> None:
    ours = {"prepare_p50_ms": 2.0, "prepare_p99_ms": 5.0, "unprepare_p50_ms": 1.0, "cpu_per_pair_ms": 1.5}
    without = {"prepare_p50_ms": 1.5, "prepare_p99_ms": 4.0, "unprepare_p50_ms": 0.75, "cpu_per_pair_ms": 1.0}
    costs = vs_nvidia.checkpoint_costs({"dradriver": [ours], vs_nvidia.NO_CHECKPOINT: [without]})
    assert costs["prepare_p50_ms"] == {"with": 2.0, "without": 1.5, "delta": 0.5}
    assert costs["unprepare_p50_ms"]["delta"] == 0.25
    assert vs_nvidia.checkpoint_costs({"dradriver": [ours], vs_nvidia.NO_CHECKPOINT: []}) == {}
    report = {"peer_run": True, "rows": {}, "bare_interpreter_rss_mib": 10.0, "rounds": 1, "claims": 1,
              "checkpoint_cost": costs}
    assert "one-claim NodePrepareResources p50 2.0 / 1.5 (+0.5 ms)" in vs_nvidia.format_report(report)


@pytest.mark.slow
def test_the_held_claims_comparison_times_pairs_beside_held_claims_with_and_without_the_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--held 0,20``: dradriver with and without NVIDIA's checkpoint, pairs timed while 0 and 20 claims are held;
    the checkpoint names the held claims while the pairs run (its size grows), and each run leaves the node empty."""
    out = tmp_path / "held.json"
    assert bench_main.main(["vs_nvidia", "--held", "0,20", "--rounds", "1", "--claims", "3", "--json",
                            str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["held"]: row for row in report["rows"]}
    assert set(rows) == {0, 20}
    for row in rows.values():
        assert set(row["with"]) == set(row["without"]) == set(row["ratio"]) == set(vs_nvidia.HELD_FIGURES)
        assert all(row["with"][f] > 0 and row["without"][f] > 0 for f in vs_nvidia.HELD_FIGURES)
        assert row["ratio"]["prepare_p50_ms"] == round(row["with"]["prepare_p50_ms"]
                                                       / row["without"]["prepare_p50_ms"], 2)
    assert rows[20]["checkpoint_kib"] > rows[0]["checkpoint_kib"] > 0
    samples = report["samples"]["20"]
    assert len(samples["dradriver"]) == len(samples[vs_nvidia.NO_CHECKPOINT]) == 1
    # without it, the file the other side left (naming no claim) is never rewritten: it does not grow
    assert samples[vs_nvidia.NO_CHECKPOINT][0]["checkpoint_kib"] < 1.0 < rows[20]["checkpoint_kib"]
    assert capsys.readouterr().out == vs_nvidia.format_held_report(report) + "\n"
