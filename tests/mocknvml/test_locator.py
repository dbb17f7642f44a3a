"""``dradriver.nvml.mock`` (locating the library and profiles) and ``dradriver mock-profiles``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dradriver.cli import main
from dradriver.nvml import mock

BUNDLED = ["a100-80gb-node", "dgx-a100", "dgx-b200", "dgx-h100", "dgx-h200", "gb200-nvl72-fabric-failed",
           "gb200-nvl72-fabric-in-progress", "gb200-nvl72-node", "gb200-nvl72-rack-a", "gb200-nvl72-rack-b",
           "l4-inference", "synthetic-large", "vr200-node"]


def test_bundled_profile_names_are_listed_sorted() -> None:
    assert mock.profile_names() == BUNDLED


def test_mock_profiles_name_output_prints_one_name_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mock-profiles", "-o", "name"]) == 0
    assert capsys.readouterr().out.splitlines() == BUNDLED


def test_mock_profiles_table_gives_each_profile_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mock-profiles"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "GPUS", "DESCRIPTION"]
    assert [line.split()[0] for line in lines] == BUNDLED
    for line in lines:
        name, gpus, description = line.split(maxsplit=2)
        profile = mock.load_profile(name)
        assert int(gpus) == len(profile["gpus"])
        assert description == " ".join(profile["description"].split()) and description


def test_mock_profiles_json_lists_name_gpus_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mock-profiles", "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == BUNDLED
    assert {r["name"]: r["gpus"] for r in rows}["dgx-a100"] == 8
    assert all(r["description"] for r in rows)


def test_profile_path_accepts_names_and_existing_files(tmp_path: Path) -> None:
    bundled = mock.profile_path("dgx-a100")
    assert bundled.is_absolute() and bundled.name == "dgx-a100.json"
    own = tmp_path / "mine.json"
    own.write_text("{}")
    assert mock.profile_path(str(own)) == own.resolve()


def test_unknown_profile_error_lists_the_valid_names() -> None:
    with pytest.raises(mock.MockNvmlError) as info:
        mock.profile_path("dgx-z900")
    message = str(info.value)
    assert "dgx-z900" in message
    for name in BUNDLED:
        assert name in message


def test_library_path_points_at_the_built_library() -> None:
    path = mock.library_path()
    assert path.name == "libnvidia-ml.so.1" and path.is_file()


def test_missing_library_error_names_the_setup_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(mock, "_LIBRARY_DIR", tmp_path)
    with pytest.raises(mock.MockNvmlError, match=r"pip install -e"):
        mock.library_path()


def test_activate_sets_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mock.PROFILE_ENV, raising=False)
    assert mock.activate("dgx-h100") == mock.library_path()
    assert os.environ[mock.PROFILE_ENV] == str(mock.profile_path("dgx-h100"))


def test_load_profile_and_model_merge() -> None:
    profile = mock.load_profile("dgx-a100")
    gpus = mock.resolved_gpus(profile)
    assert len(gpus) == 8
    assert gpus[0]["name"] == "NVIDIA A100-SXM4-40GB"
    assert gpus[0]["uuid"] == profile["gpus"][0]["uuid"]


def test_load_profile_rejects_invalid_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(mock.MockNvmlError, match="cannot read"):
        mock.load_profile(str(bad))
