"""Where the sandbox finds NVIDIA's peer binaries: only where ``DRADRIVER_NVIDIA_PEERS`` says."""

from __future__ import annotations

from pathlib import Path

import pytest

from dradriver.sandbox.nvidiapeer import PEERS_VARIABLE, peer_missing, peer_paths


def test_nvidia_peers_are_found_only_under_the_folder_the_variable_names(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.delenv(PEERS_VARIABLE, raising=False)
    assert peer_paths() == (None, None)
    assert peer_missing().startswith(f"{PEERS_VARIABLE} is not set")
    monkeypatch.setenv(PEERS_VARIABLE, str(tmp_path))
    assert peer_paths() == (tmp_path / "bin" / "gpu-kubelet-plugin", tmp_path / "mocknvml")
    assert peer_missing() == f"NVIDIA's plugin binary not found ({tmp_path / 'bin' / 'gpu-kubelet-plugin'})"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "gpu-kubelet-plugin").write_text("")
    assert peer_missing() == f"NVIDIA's mock NVML not found ({tmp_path / 'mocknvml'})"
