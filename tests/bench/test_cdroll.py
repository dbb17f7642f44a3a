"""``python -m bench roll`` (bench/cdroll.py): an upgrade of a rack's pre-warmed IMEX daemons in the multi-node
sandbox, measured per node. What is checked is what the run observes, not how fast it is."""

from __future__ import annotations

import pytest

from bench import cdroll


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_roll_of_two_nodes_reports_each_node_unusable_once_warned_and_the_pods_kept_running() -> None:
    report = cdroll.run(nodes=2, domains=1, time_scale=0.1)
    assert set(report.unusable_s) == {"rack1-node00", "rack1-node01"}
    assert all(s > 0 for s in report.unusable_s.values())  # every node's daemon was replaced, none silently
    assert report.warned == {"rack1-node00": True, "rack1-node01": True}
    assert all(s > 0 for s in report.condition_false_s.values())  # the domain's condition said so on each node
    assert report.pods_kept_running
    assert report.roll_s >= report.max_s >= report.median_s > 0
    text = cdroll.format_report(report)
    assert "| rack1-node00 |" in text and "every node named in a Warning Event of every domain: yes" in text


def test_the_windows_add_up_each_key_s_time_in_the_false_state() -> None:
    windows = cdroll._Windows()
    windows.sample(0.0, {"a": True, "b": False})
    windows.sample(1.0, {"a": False, "b": True})
    windows.sample(1.5, {"a": True, "b": False})
    windows.close(4.0)
    assert windows.total == {"a": 0.5, "b": 1.0 + 2.5}


def test_the_command_refuses_a_rack_larger_than_an_nvl72(capsys: pytest.CaptureFixture[str]) -> None:
    assert cdroll.main(["--nodes", "19"]) == 2
    assert "--nodes must be 1-18 (one NVL72 rack)" in capsys.readouterr().err
