"""Allocator tests read ``dradriver inspect`` output: the plugin's environment variables of the shell running the
tests must not change it."""

from __future__ import annotations

import pytest

PLUGIN_ENVIRONMENT = ("DRADRIVER_MOCK_PROFILE", "DRADRIVER_NVML_LIBRARY", "NODE_NAME", "SYSFS_ROOT", "FEATURE_GATES",
                      "CONSUMABLE_SHARES", "IMEX_MODE")


@pytest.fixture(autouse=True)
def _clean_plugin_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PLUGIN_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
