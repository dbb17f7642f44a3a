"""Guard: when extensions are expected, the compiled claim store is what the plugin actually runs on."""

from __future__ import annotations

from pathlib import Path

from dradriver import _native
from dradriver.host.claimstate import ClaimState


def test_compiled_claimstore_is_loaded_unless_twins_are_requested(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("b\n")
    state = ClaimState.open(tmp_path / "claims.state", boot_id_path=boot)
    if _native.use_extensions():
        assert _native.implementation("claimstore") == "c"
        assert state.implementation == "c"
        assert _native.load("claimstore").__file__.endswith(".so")  # type: ignore[union-attr]
    else:
        assert _native.implementation("claimstore") == "py"
        assert state.implementation == "py"
    state.close()
