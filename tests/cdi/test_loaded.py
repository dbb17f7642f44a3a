"""Guard against a suite that passes only because it silently ran the pure-Python twin."""

from __future__ import annotations

import os

import pytest

from dradriver import _native


@pytest.mark.skipif(os.environ.get("DRADRIVER_NO_EXTENSIONS") == "1", reason="the twin was selected explicitly")
def test_compiled_cdispec_is_loaded() -> None:
    module = _native.load("cdispec")
    assert module.__name__ == "dradriver._native.cdispec"
    assert module.__file__ is not None and not module.__file__.endswith(".py"), module.__file__
    assert _native.implementation("cdispec") == "c"


def test_twin_is_selected_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRADRIVER_NO_EXTENSIONS", "1")
    assert _native.load("cdispec").__name__ == "dradriver._native.cdispec_py"
